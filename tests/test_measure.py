"""`autoshard measure`: the pure parts, and one real 4-rank gloo run."""

import json
import subprocess
import sys

import pytest
import torch

from autoshard.errors import ConfigError
from autoshard.measure import (
    CollectiveStats,
    MeasureConfig,
    Measurement,
    full_buffer_bytes,
    group_axes,
    predicted_collectives,
)
from autoshard.planfile import Plan


def _plan(redistributes) -> Plan:
    return Plan(mesh_shape=[2, 2], axis_names=["dp", "tp"], params={}, inputs=[], redistributes=redistributes,
                summary={"step_us": 100.0, "compute_us": 80.0, "comm_us": 20.0})


def test_predicted_collectives_sum_the_plan_steps_per_kind_and_group():
    plan = _plan([
        {"node": "a", "arg": 0, "steps": ["all_gather(dp)", "all_reduce(tp)"], "us": 9.0,
         "step_us": [4.0, 5.0], "step_bytes": [1024, 2048]},
        {"node": "b", "arg": 0, "steps": ["all_gather(dp)"], "us": 3.0, "step_us": [3.0], "step_bytes": [512]},
        # a plan written before per-step figures: the time is split evenly, bytes unknown
        {"node": "c", "arg": 0, "steps": ["all_to_all(dp,tp)", "all_to_all(dp,tp)"], "us": 6.0},
    ])
    got = predicted_collectives(plan)
    assert got == {("all_gather", "dp"): CollectiveStats(2, 1536, 7.0),
                   ("all_reduce", "tp"): CollectiveStats(1, 2048, 5.0),
                   ("all_to_all", "dp,tp"): CollectiveStats(2, 0, 6.0)}


def test_groups_are_named_by_the_mesh_axes_they_span():
    grid = [[0, 1, 2, 3], [4, 5, 6, 7]]  # (dp=2, tp=4)
    names = ("dp", "tp")
    assert group_axes([1, 5], grid, names, 5) == "dp"
    assert group_axes([4, 5, 6, 7], grid, names, 6) == "tp"
    assert group_axes(range(8), grid, names, 3) == "dp,tp"
    assert group_axes([0, 5], grid, names, 0) == "?"  # no sub-mesh through rank 0
    assert group_axes([1, 2], grid, names, 9) == "?"  # not a rank of the mesh
    assert full_buffer_bytes("all_gather", 100, 4) == 400  # its input is one shard
    assert full_buffer_bytes("reduce_scatter", 400, 4) == 400


def test_measurement_table_and_config_checks():
    m = Measurement(plan_name="plan for Llama", mesh={"dp": 4}, backend="gloo",
                    predicted={"step_us": 50_000.0, "compute_us": 40_000.0, "comm_us": 25_000.0,
                               "exposed_us": 10_000.0, "additive_us": 65_000.0},
                    measured={"step_us": 100_000.0, "comm_exposed_us": 20_000.0, "compute_us": 80_000.0,
                              "steps": 3, "step_us_all": [1e5] * 3},
                    collectives=[{"kind": "all_reduce", "group": "dp",
                                  "predicted": vars(CollectiveStats(2, 2**20, 1e4)),
                                  "measured": vars(CollectiveStats(1, 2**20, 2e4))}])
    assert m.ratio == 0.5
    text = m.table()
    assert "step (ms)" in text and "0.500" in text and "all_reduce(dp)" in text
    assert "exposed comm. (ms)" in text and "additive step (ms)" in text and "0.650" in text
    assert json.loads(json.dumps(m.to_json()))["ratio"] == 0.5
    with pytest.raises(ConfigError, match="steps: expected an integer >= 1, found 0"):
        MeasureConfig(steps=0)
    with pytest.raises(ConfigError, match="warmup: expected an integer >= 0"):
        MeasureConfig(warmup=-1)


FACTORY = '''
import torch
from autoshard.models import llama

def make():
    torch.manual_seed(0)
    model = llama("tiny", dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=128, max_seq_len=16)
    return model, (torch.randint(0, 128, (8, 16)),)
'''


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_measure_runs_the_plan_and_counts_exactly_its_collectives(tmp_path, world, monkeypatch):
    """A plan with replicated parameters and a split batch on 4 gloo processes, one collective
    per planned step: the measured collectives are the plan's, kind, group, count and bytes."""
    import autoshard

    (tmp_path / "fac.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    import fac

    world(4)
    plan = autoshard.plan(*fac.make(), autoshard.fake_mesh((4,), ("dp",)), profile="cpu-gloo", time_limit=20,
                          pins={"*": "R"}, input_specs=["S(0)"])
    plan_file, out = tmp_path / "plan.json", tmp_path / "measured.json"
    plan.save(plan_file)
    assert plan.redistributes, plan.describe()
    run = lambda *a: subprocess.run([sys.executable, "-m", "autoshard", *a], cwd=tmp_path,  # noqa: E731
                                    capture_output=True, text=True, timeout=500)
    refined_file = tmp_path / "refined.json"
    res = run("measure", "fac:make", "--plan", str(plan_file), "--backend", "gloo", "--nproc", "4", "--steps", "3",
              "--warmup", "1", "--bucket-mb", "0", "--no-overlap", "--json", str(out),
              "--refine", "cpu-gloo", "-o", str(refined_file))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "step (ms)" in res.stdout and "(dp)" in res.stdout, res.stdout
    m = json.loads(out.read_text())
    assert m["measured"]["steps"] == 3 and m["measured"]["step_us"] > 0
    # Exposed time comes from the attribution steps, the step from the timed ones: on two loaded
    # cores an attribution step ran 1.2x the timed median (22.6 against 21.8 ms was seen, and
    # 19.6 against 16.6); twice the step would mean a collective counted twice.
    assert 0 < m["measured"]["comm_exposed_us"] <= 1.5 * m["measured"]["step_us"]
    rows = {(r["kind"], r["group"]): r for r in m["collectives"]}
    assert rows and sum(r["predicted"]["count"] for r in rows.values()) >= 1
    # Peak memory per rank, optimizer step included, beside the plan's.
    mem = m["memory"]
    assert len(mem["measured_peak_bytes"]) == 4 and mem["predicted_peak_bytes"] == plan.summary.peak_mem_bytes
    assert all(peak >= sum(at.values()) * 0.999 for peak, at in zip(mem["measured_peak_bytes"], mem["at_peak"]))
    assert "peak memory (MiB)" in res.stdout
    assert mem["predicted_at_peak"] == plan.summary.memory["at_peak"]
    assert all(f"rank {r}: measured" in res.stdout for r in range(4)), res.stdout
    for key, r in rows.items():  # nothing runs that the plan does not have, and the reverse
        assert r["measured"]["count"] == pytest.approx(r["predicted"]["count"]), key
        assert r["measured"]["bytes"] == pytest.approx(r["predicted"]["bytes"]), key
    # The closed loop: the profile refitted to the collectives timed in those steps.
    from costmodel import load_profile

    assert m["step_samples"] and all(s[2] == 4 and s[3] > 0 and s[4] > 0 for s in m["step_samples"])
    refined, base = load_profile(refined_file), load_profile("cpu-gloo")
    assert len(refined.step_samples) == len(m["step_samples"]) and refined.samples == base.samples
    rec = refined.refinements[-1]
    assert rec["source"].startswith("autoshard measure fac:make") and rec["mesh"] == {"dp": 4}
    import statistics

    for row in rec["fits"]:  # refined predictions meet the in-step times (median over the sizes seen)
        seen = [s for s in m["step_samples"] if (s[0], s[2]) == (row["kind"], row["group_size"])]
        predict = refined.collective_predictor(row["kind"], row["group_size"], True)
        assert statistics.median(us / predict(b) for _, _, _, b, us in seen) == pytest.approx(1.0, rel=1e-6)
    assert "refined cpu-gloo from" in res.stdout
    # Compute too: every compute time the refined profile predicts is the measured over the
    # predicted compute of the programs that ran times the old one.
    from costmodel import compute_time_us

    if m["measured"]["compute_us"] <= 0:  # exposed (attribution steps) passed the timed step: nothing to fit
        assert "compute" not in rec and "compute kept (measured" in res.stdout
        assert compute_time_us(1e9, 1e6, refined) == compute_time_us(1e9, 1e6, base)
    else:
        c = rec["compute"]["factor"]
        assert c == pytest.approx(m["measured"]["compute_us"] / m["simulated"]["compute_us"], rel=1e-3)
        assert f"compute x{c:.3g}" in res.stdout
        for flops, nbytes in ((1e9, 1e6), (1e3, 1e8), (1.0, 1.0)):
            assert compute_time_us(flops, nbytes, refined) == pytest.approx(
                c * compute_time_us(flops, nbytes, base), rel=1e-3)  # c is recorded to 4 digits
    bad = run("measure", "fac:make", "--plan", str(plan_file), "--backend", "gloo", "--nproc", "4",
              "--refine", "cpu-gloo")
    assert bad.returncode == 2 and "needs -o/--output" in bad.stderr, bad.stderr[-2000:]
    bad = run("measure", "fac:make", "--plan", str(plan_file), "--backend", "gloo", "--nproc", "2")
    assert bad.returncode == 2 and "has 4 ranks but --nproc is 2" in bad.stderr, bad.stderr[-2000:]


def test_collectives_run_beside_compute_are_left_out_of_in_step_times(world):
    """A span is a collective's time only when nothing ran between its issue and its wait (a
    view does not count): an overlapped one's span holds the compute too, so the refit that
    reads :meth:`CollectiveLog.spans` leaves it out."""
    import torch
    import torch.distributed as dist

    from autoshard.measure import CollectiveLog

    world(2)
    group = dist.group.WORLD.group_name
    ops = torch.ops._c10d_functional
    log = CollectiveLog(lambda name: ("dp", 2))
    x = torch.ones(4)
    with log:
        y = torch.ones(8)
        first = ops.all_gather_into_tensor(x, 2, group)
        x.view(2, 2)  # a view between: no kernel
        ops.wait_tensor(first)
        early = ops.all_gather_into_tensor(y, 2, group)
        (x @ x).item()  # compute beside it
        ops.wait_tensor(early)
    assert [r["overlapped"] for r in log.records] == [False, True]
    assert list(log.spans()) == ["all_gather|dp|2|32"]


class _ScriptedClock:
    """Marks 0, 1, 2 ... in order taken, each one millisecond apart."""

    def __init__(self):
        self.ticks = 0

    def mark(self):
        self.ticks += 1
        return self.ticks - 1

    def seconds(self, start, end):
        return (end - start) * 1e-3


def test_collective_times_are_read_off_the_clock_marks(world):
    """Exposed time is what the issue and the wait took on the log's clock; the span runs from
    the issue to the end of the wait (marks in order: issue 0-1, wait 2-3; the second collective,
    never waited for, has its issue alone). On GPUs the clock is CUDA events, read after the
    device is synchronized, not the host's, which returns from both calls at once."""
    import torch
    import torch.distributed as dist

    from autoshard.measure import CollectiveLog, HostClock

    world(2)
    group = dist.group.WORLD.group_name
    ops = torch.ops._c10d_functional
    log = CollectiveLog(lambda name: ("dp", 2), _ScriptedClock())
    with log:
        ops.wait_tensor(ops.all_gather_into_tensor(torch.ones(4), 2, group))
        ops.all_reduce(torch.ones(4), "sum", group)
    first, second = log._times()
    assert (first["exposed_s"], first["span_s"]) == pytest.approx((2e-3, 3e-3))
    assert (second["exposed_s"], second["span_s"]) == pytest.approx((1e-3, 1e-3))
    assert log.spans() == {"all_gather|dp|2|32": pytest.approx(3e3), "all_reduce|dp|2|16": pytest.approx(1e3)}
    rows = log.by_kind(1)
    assert rows[("all_gather", "dp")].us == pytest.approx(2e3) and rows[("all_reduce", "dp")].count == 1
    assert isinstance(CollectiveLog(lambda name: ("dp", 2)).clock, HostClock)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_clock_times_a_collective_on_the_stream(tmp_path):
    import torch.distributed as dist

    from autoshard.measure import CollectiveLog, CudaClock

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        group = dist.group.WORLD.group_name
        ops = torch.ops._c10d_functional
        log = CollectiveLog(lambda name: ("dp", 1), CudaClock())
        x = torch.ones(1 << 24, device="cuda")
        with log:
            y = ops.all_reduce(x * 2, "sum", group)
            ops.wait_tensor(y)
        torch.cuda.synchronize()
        (rec,) = log._times()
        assert 0 <= rec["exposed_s"] <= rec["span_s"] and rec["span_s"] > 0
    finally:
        dist.destroy_process_group()
