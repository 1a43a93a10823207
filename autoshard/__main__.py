import sys

from autoshard.cli import main
from costmodel.calibrate import exit_rank, is_torchrun_rank

code = main()
if is_torchrun_rank():
    exit_rank(code or 0)  # a gloo rank can abort in finalization after its work is done
sys.exit(code)
