"""Real processes: plan, apply and train under torchrun with 4 gloo ranks."""

import os
import re
import subprocess
import sys
import warnings

import pytest
from helpers import SHARDING_PROFILE


def died_by_signal(stderr: str) -> bool:
    """torchrun's root cause (its first failed worker) is a signal, not a Python exception.
    Workers the agent stops afterwards are listed as SIGTERM too, but never as the root cause."""
    _, found, root = stderr.rpartition("Root Cause (first observed failure):")
    return bool(found) and re.search(r"exitcode\s*:\s*-\d+", root) is not None and "traceback : Signal" in root


def torchrun(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``autoshard.train`` on 4 gloo ranks under torchrun with ``args``.

    Once in about a hundred runs a gloo worker aborts natively ("terminate called without
    an active exception", SIGABRT) with no Python error. Such a run is rerun once, loudly;
    any Python error, or a second abort, is returned as it is (and fails the test)."""
    from costmodel.calibrate import free_port

    # faulthandler: a worker that dies in native code prints every thread's Python stack.
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}

    def launch():
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
             str(free_port()), "-m", "autoshard.train", "--mesh", "dp=2,tp=2", *args],
            capture_output=True, text=True, timeout=timeout, env=env)

    done = launch()
    if done.returncode != 0 and died_by_signal(done.stderr):
        warnings.warn(f"torchrun worker killed by a signal, rerunning once:\n{done.stderr[-4000:]}", stacklevel=2)
        done = launch()
    return done


def losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+ loss ([-\d.e]+)$", out, flags=re.M)]


@pytest.mark.timeout(600)
def test_torchrun_training_matches_single_process(tmp_path):
    """Two real 4-rank runs: steps 0-1 (plan, train, save a sharded checkpoint), then
    steps 2-3 from a meta-device model whose shards are loaded from that checkpoint
    (model and AdamW state). Together they must give the single-process loss curve."""
    prof = tmp_path / "slow-compute.json"
    SHARDING_PROFILE.save(prof)  # sharding pays under this profile, so the plan really shards
    plan_file = tmp_path / "plan.json"
    common = ["--dim", "32", "--layers", "1", "--vocab", "64", "--batch", "8", "--seq", "8"]
    single = subprocess.run([sys.executable, "-m", "autoshard.train", "--single", "--steps", "4", *common],
                            capture_output=True, text=True, check=True)
    ckpt = tmp_path / "ckpt"
    first = torchrun("--profile", str(prof), "--save-plan", str(plan_file), "--steps", "2", "--save", str(ckpt),
                     *common)
    assert first.returncode == 0, first.stderr[-3000:]
    assert any(ckpt.glob("*.distcp")), "no sharded checkpoint files written"
    run = torchrun("--plan", str(plan_file), "--resume", str(ckpt), "--start-step", "2", "--steps", "2", *common)
    assert run.returncode == 0, run.stderr[-3000:]
    replay = torchrun("--plan", str(plan_file), "--replay", "--profile", str(prof), "--steps", "4", *common)
    assert replay.returncode == 0, replay.stderr[-3000:]
    assert losses(replay.stdout) == pytest.approx(losses(single.stdout), rel=1e-5, abs=1e-6)
    ref, got = losses(single.stdout), losses(first.stdout) + losses(run.stdout)
    assert len(ref) == 4 and len(got) == 4, first.stdout[-1000:] + run.stdout[-1000:]
    assert got == pytest.approx(ref, rel=1e-5, abs=1e-6)
    import autoshard

    plan = autoshard.Plan.load(plan_file)
    sharded = [f for f in plan.params if "S(" in str(plan.param_spec(f))] + [s for s in plan.inputs if "S(" in s]
    assert sharded, "the plan under test shards nothing"


def _against_single_process(layers: int, *options: str, model: str = "gpt2", batch: int = 8, seq: int = 8) -> str:
    """3 steps of ``autoshard.train`` on 4 gloo ranks with ``options``: its stdout, once its loss
    curve is checked against the single process's."""
    common = ["--dim", "32", "--layers", str(layers), "--vocab", "64", "--batch", str(batch), "--seq", str(seq),
              "--steps", "3", "--model", model]
    single = subprocess.run([sys.executable, "-m", "autoshard.train", "--single", *common],
                            capture_output=True, text=True, check=True)
    run = torchrun(*options, *common, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    ref, got = losses(single.stdout), losses(run.stdout)
    assert len(ref) == 3 and got == pytest.approx(ref, rel=1e-5, abs=1e-6)
    return run.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchrun_compiled_programs_match_single_process():
    """parallelize(..., compile=...) runs each rank's lowered programs through torch.compile
    (aot_eager here: the whole-graph capture of local ops and functional collectives, without
    Inductor's C++ build time); the loss curve is the single process's."""
    out = _against_single_process(1, "--compile", "aot_eager")
    assert "compiled programs (aot_eager): backward@0, forward@0" in out, out[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchrun_recomputing_plan_matches_single_process():
    """A plan with full activation checkpointing on 4 gloo ranks: each layer's forward runs again
    in the lowered backward, and the loss curve is the single process's."""
    out = _against_single_process(2, "--recompute", "full")
    assert "activation checkpointing: full" in out, out[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchrun_expert_parallel_moe_matches_single_process(tmp_path):
    """The reference MoE with its experts split over the dp axis (pinned) on 4 gloo ranks, under a
    profile where bytes decide: tokens move to their experts by all_to_all, and the loss curve
    is the single process's."""
    import dataclasses

    from costmodel import LinkModel

    slow = LinkModel(latency_us=1.0, busbw_gbps=0.01)
    prof = tmp_path / "slow-links.json"
    dataclasses.replace(SHARDING_PROFILE, intra_node=slow, inter_node=slow).save(prof)
    plan_file = tmp_path / "plan.json"
    _against_single_process(1, "--profile", str(prof), "--pin", "layers.*.moe.experts.w*=S(0)R",
                            "--save-plan", str(plan_file), model="moe")
    import autoshard

    plan = autoshard.Plan.load(plan_file)
    assert "S(0)" in plan.param_spec("layers.0.moe.experts.w1").placements
    assert any(step.startswith("all_to_all") for r in plan.redistributes for step in r["steps"]), plan.describe()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchrun_context_parallel_llama_matches_single_process(tmp_path):
    """The reference LLaMA (one key head: no even head split) with its tokens split by batch over
    dp and by sequence over tp on 4 gloo ranks: its causal attention runs split on the sequence,
    balanced by the mirror exchange, and the loss curve is the single process's."""
    plan_file = tmp_path / "plan.json"
    prof = tmp_path / "slow-compute.json"
    SHARDING_PROFILE.save(prof)
    _against_single_process(2, "--profile", str(prof), "--input-spec", "S(0)S(1)", "--save-plan", str(plan_file),
                            model="llama", batch=2, seq=16)
    import autoshard

    plan = autoshard.Plan.load(plan_file)
    queries = [e["in"][0] for e in plan.nodes.values() if e["op"].endswith("flash_attention_for_cpu.default")]
    assert queries and all("S(2)" in q for q in queries), queries


def test_died_by_signal_reads_only_the_root_cause():
    """The rerun is for a native abort only: a Python error whose peers the agent then
    SIGTERMs must not be retried."""
    def summary(root_exit, root_trace):
        return ("Failures:\n[1]:\n  rank      : 3 (local_rank: 3)\n  exitcode  : -15 (pid: 7)  (SIGTERM)\n"
                "  traceback : Signal 15 (SIGTERM) received by PID 7\n-----\n"
                "Root Cause (first observed failure):\n[0]:\n  rank      : 2 (local_rank: 2)\n"
                f"  exitcode  : {root_exit} (pid: 6)\n  error_file: <N/A>\n  traceback : {root_trace}\n=====\n")

    assert died_by_signal(summary("-6", "Signal 6 (SIGABRT) received by PID 6"))
    assert not died_by_signal(summary("1", "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"))
    assert not died_by_signal("Traceback (most recent call last):\nValueError: bad mesh\n")
    no_root = summary("-6", "Signal 6 (SIGABRT) received by PID 6").replace("Root Cause (first observed failure)", "")
    assert not died_by_signal(no_root)  # without torchrun's root-cause block nothing is rerun


@pytest.mark.timeout(600)
def test_torchrun_pipeline_matches_single_process(tmp_path):
    """A reference LLaMA of 4 layers pipelined in 2 stages x DP 2 on 4 gloo ranks (1F1B, 4
    microbatches, torch's PipelineStage and schedule; each stage's plan lowered, the second
    stage's input gradient sent back), its parameters pinned to FSDP's shards: the weights
    gathered on each step's first microbatch and kept for the other three, the single process's
    losses over 3 AdamW steps."""
    from autoshard.planning.pipeline import PipelinePlan

    plan_file = tmp_path / "pipeline.json"
    _against_single_process(4, "--mesh", "pp=2,dp=2", "--pipeline", "pp", "--microbatches", "4",
                            "--pin", "*=S(0)", "--save-plan", str(plan_file), model="llama")
    pplan = PipelinePlan.load(plan_file)
    assert (pplan.schedule, pplan.microbatches, len(pplan.stages)) == ("1f1b", 4, 2)
    assert pplan.stages[1].plan.model.get("input_grads") == [0]
    assert all(s.plan.held for s in pplan.stages), [s.plan.held for s in pplan.stages]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchrun_interleaved_pipeline_with_tensor_parallel_stages_matches_single_process():
    """Interleaved 1F1B, two stages per rank (the middle stages' plans renamed to their layers),
    the stages' placements on a TP axis."""
    _against_single_process(4, "--mesh", "pp=2,tp=2", "--pipeline", "pp", "--microbatches", "4",
                            "--schedule", "interleaved_1f1b", "--stages-per-rank", "2", model="llama")
