"""Real processes: plan, apply and train under torchrun with 4 gloo ranks."""

import re
import subprocess
import sys

import pytest

from helpers import SHARDING_PROFILE


def losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+ loss ([-\d.e]+)$", out, flags=re.M)]


@pytest.mark.timeout(600)
def test_torchrun_training_matches_single_process(tmp_path):
    prof = tmp_path / "slow-compute.json"
    SHARDING_PROFILE.save(prof)  # sharding pays under this profile, so the plan really shards
    plan_file = tmp_path / "plan.json"
    common = ["--steps", "4", "--dim", "32", "--layers", "1", "--vocab", "64", "--batch", "8", "--seq", "8"]
    single = subprocess.run([sys.executable, "-m", "autoshard.train", "--single", *common],
                            capture_output=True, text=True, check=True)
    from costmodel.calibrate import free_port

    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
         "-m", "autoshard.train", "--mesh", "dp=2,tp=2", "--profile", str(prof), "--save-plan", str(plan_file),
         *common],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    ref, got = losses(single.stdout), losses(run.stdout)
    assert len(ref) == 4 and len(got) == 4, run.stdout[-2000:]
    assert got == pytest.approx(ref, rel=1e-5, abs=1e-6)
    import autoshard

    plan = autoshard.Plan.load(plan_file)
    sharded = [f for f in plan.params if "S(" in str(plan.param_spec(f))] + [s for s in plan.inputs if "S(" in s]
    assert sharded, "the plan under test shards nothing"
