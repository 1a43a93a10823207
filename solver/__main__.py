"""``python -m solver FILE TIMEOUT_SECONDS``: solve an IOPDDL instance.

Progress goes to stderr; the last line on stdout is the chosen strategy indices.
"""

import argparse
import logging
import sys

from solver import InfeasibleError, ProblemError, load_iopddl, solve
from solver.stall import DEFAULT_STALL


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m solver", description=__doc__)
    ap.add_argument("file", help="IOPDDL instance (.json or .json.gz)")
    ap.add_argument("timeout", type=float, help="time limit in seconds")
    ap.add_argument("--backend", default="highs", choices=["highs", "cbc"])
    ap.add_argument("--stop-when-stalled", action="store_true",
                    help="end the searches once they stop improving (solver/stall.py) instead of using the "
                         "whole time limit, as a contest's fixed budget invites")
    args = ap.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    try:
        problem = load_iopddl(args.file)
        sol = solve(problem, time_limit=args.timeout, backend=args.backend,
                    stall=DEFAULT_STALL if args.stop_when_stalled else None)
    except (ProblemError, InfeasibleError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"cost {sol.cost:.0f} status {sol.status} seconds {sol.seconds:.2f}", file=sys.stderr)
    print(sol.to_list())
    return 0


if __name__ == "__main__":
    sys.exit(main())
