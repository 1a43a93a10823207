"""Fits, profiles, lookup fallbacks, and a real 2-process gloo calibration."""

import json

import numpy as np
import pytest

from costmodel import LinkModel, Profile, load_profile
from costmodel.calibrate import CalibrationConfig, check_backend, groups_of, run
from costmodel.fit import CollectiveFit, fit_collective
from costmodel.profile import DEFAULT_OVERLAP


def synthetic(alpha=25.0, beta=2e-4, noise=0.02, seed=0, sizes=None):
    rng = np.random.default_rng(seed)
    b = np.repeat(sizes if sizes is not None else 4.0 ** np.arange(5, 14), 5)
    t = (alpha + beta * b) * (1 + noise * rng.standard_normal(b.size))
    return b, t


def test_fit_recovers_alpha_beta():
    b, t = synthetic()
    f = fit_collective("all_reduce", "tp", 8, True, b, t)
    assert f.alpha_us == pytest.approx(25.0, rel=0.05)
    assert f.beta_us_per_byte == pytest.approx(2e-4, rel=0.05)
    # busbw = bus factor / beta: 2*(7/8) / 2e-4 us/B = 8750 B/us = 8.75 GB/s
    assert f.busbw_gbps == pytest.approx(8.75, rel=0.05)


def test_fit_is_robust_to_outliers():
    b, t = synthetic(noise=0.01)
    t[::7] *= 20  # a few samples hit by a straggler
    f = fit_collective("all_gather", "dp", 4, False, b, t)
    assert f.beta_us_per_byte == pytest.approx(2e-4, rel=0.1)
    assert f.predict_one(4.0**10) == pytest.approx(25 + 2e-4 * 4.0**10, rel=0.1)


@pytest.mark.parametrize("seed", range(5))
def test_predictions_are_monotone_and_extrapolate(seed):
    b, t = synthetic(noise=0.3, seed=seed)  # very noisy: medians may go down with size
    f = fit_collective("reduce_scatter", "tp", 4, True, b, t)
    q = np.logspace(0, 12, 400)
    p = f.predict(q)
    assert np.all(np.diff(p) >= -1e-9)
    assert f.predict_one(0) == 0.0 and p[0] > 0
    # Beyond the sweep: the fitted bandwidth, not a constant or an explosion.
    big = f.knots_bytes[-1]
    assert f.predict_one(4 * big) - f.predict_one(big) == pytest.approx(f.beta_us_per_byte * 3 * big)


def test_fit_rejects_bad_samples():
    with pytest.raises(ValueError, match="positive and finite"):
        fit_collective("all_reduce", "tp", 2, True, [1, 2], [1, -1])
    with pytest.raises(ValueError, match="equal, non-empty"):
        fit_collective("all_reduce", "tp", 2, True, [1, 2], [1])
    with pytest.raises(ValueError, match="knot sizes must increase"):
        CollectiveFit("all_reduce", "tp", 2, True, 1.0, 0.1, [2.0, 1.0], [1.0, 2.0])


def calibrated(fits) -> Profile:
    return load_profile("h100-sxm").with_calibration(fits, [], {"shape": [2, 4], "axis_names": ["dp", "tp"]}, {})


def test_lookup_exact_rescaled_then_constants():
    b, t = synthetic()
    fit = fit_collective("all_gather", "tp", 4, True, b, t)
    prof = calibrated([fit])
    # 1. exact (kind, class, size)
    assert prof.collective_predictor("all_gather", 4, True)(1e6) == pytest.approx(fit.predict_one(1e6))
    # 2. same kind and class, other size: alpha + bytes * busfactor(8) / fitted busbw
    p8 = prof.collective_predictor("all_gather", 8, True)(1e6)
    assert p8 == pytest.approx(fit.alpha_us + 1e6 * (7 / 8) / (fit.busbw_gbps * 1e3))
    # 3. nothing measured for that kind or class: the link constants, never zero
    inter = prof.collective_predictor("all_gather", 4, False)(1e6)
    assert inter == pytest.approx(prof.inter_node.latency_us + 1e6 * 0.75 / (prof.inter_node.busbw_gbps * 1e3))
    assert prof.collective_predictor("all_to_all", 4, True)(1e6) > 0
    assert prof.collective_predictor("all_reduce", 1, True)(1e6) == 0


def test_profile_roundtrip_merge_and_validation(tmp_path):
    b, t = synthetic()
    prof = calibrated([fit_collective("all_reduce", "dp", 2, False, b, t)])
    prof.save(tmp_path / "p.json")
    again = load_profile(tmp_path / "p.json")
    assert again == prof and again.collectives[0].predict_one(1e5) == prof.collectives[0].predict_one(1e5)
    other = calibrated([fit_collective("all_gather", "tp", 4, True, b, t)])
    merged = prof.merge(other)
    assert {(f.kind, f.group) for f in merged.collectives} == {("all_reduce", "dp"), ("all_gather", "tp")}
    cpu = load_profile("cpu-gloo")
    with pytest.raises(ValueError, match="different devices"):
        prof.merge(cpu)
    data = json.loads((tmp_path / "p.json").read_text())
    (tmp_path / "old.json").write_text(json.dumps({**data, "version": 1}))
    with pytest.raises(ValueError, match="expected 2, found 1"):
        load_profile(tmp_path / "old.json")
    with pytest.raises(ValueError, match="equal-length shape and axis_names"):
        Profile.from_json({**data, "mesh": {"shape": [2, 4], "axis_names": ["dp"]}})
    with pytest.raises(ValueError, match="busbw_gbps must be > 0"):
        LinkModel(1.0, 0.0)
    with pytest.raises(ValueError, match=r"overlap must be a share in \[0, 1\], found 1.5"):
        Profile.from_json({**data, "overlap": 1.5})
    older = {k: v for k, v in data.items() if k != "overlap"}  # written before the share existed
    assert Profile.from_json(older).overlap == DEFAULT_OVERLAP
    # Per-dtype peaks: absent from the JSON when empty (a profile's digest stays what it was).
    bare = Profile.from_json({k: v for k, v in data.items() if k != "dtype_tflops"})
    assert "dtype_tflops" not in bare.to_json() and bare.tflops("float32") == bare.peak_tflops
    fp32 = Profile.from_json({**data, "dtype_tflops": {"float32": 60.0}})
    assert fp32.tflops("float32") == 60.0 and fp32.tflops("bfloat16") == fp32.peak_tflops
    assert Profile.from_json(fp32.to_json()) == fp32 and fp32.digest() != bare.digest()
    with pytest.raises(ValueError, match=r"dtype_tflops must map dtype names to rates > 0, found \{'float32': 0\}"):
        Profile.from_json({**data, "dtype_tflops": {"float32": 0}})


def test_the_matmuls_beside_a_collective_are_sized_to_fit_several_in_its_time():
    """The overlap share's denominator is the shorter of compute and collective: one matmul
    outlasting the collective left its few hideable milliseconds under the matmul's own noise
    (a CPU: a 1024 float32 matmul 41 ms beside a 6 ms all-reduce; the share came out 0-0.94)."""
    from costmodel.calibrate import OVERLAP_MATMULS, overlap_side

    assert overlap_side(1024, 5e-6, 40e-6) == 1024  # a GPU: eight fit already
    side = overlap_side(1024, 41e-3, 6e-3)
    assert side % 64 == 0 and 64 <= side < 1024
    assert OVERLAP_MATMULS * 41e-3 * (side / 1024) ** 3 <= 6e-3  # by the cube law, enough now fit
    assert overlap_side(side, 41e-3 * (side / 1024) ** 3, 6e-3) == side  # and it is kept
    assert overlap_side(128, 1.0, 1e-6) == 64  # never below 64
    assert overlap_side(1024, 0.0, 6e-3) == 1024 and overlap_side(1024, 1e-3, 0.0) == 1024  # nothing timed


def test_overlap_share_is_what_running_together_hid_of_what_perfect_overlap_would():
    from costmodel.calibrate import overlap_share

    assert overlap_share(10.0, 10.0, 10.0) == 1.0  # perfect: the step is the longer of the two
    assert overlap_share(10.0, 10.0, 20.0) == 0.0  # none: their sum
    assert overlap_share(10.0, 4.0, 12.0) == 0.5  # 2 of the 4 that could hide
    assert overlap_share(10.0, 10.0, 25.0) == 0.0 and overlap_share(10.0, 10.0, 8.0) == 1.0  # noise, clipped
    assert overlap_share(10.0, 0.0, 10.0) == 0.0


def test_measured_overlap_share_goes_into_the_profile(monkeypatch):
    from types import SimpleNamespace

    import costmodel.calibrate as cal

    monkeypatch.setattr(cal, "identity", lambda mesh, backend: {"date": "today", "device_name": "cpu"})
    mesh = SimpleNamespace(device_type="cpu", shape=(2,), mesh_dim_names=("dp",))
    base = load_profile("cpu-gloo")
    measured = cal.build_profile(cal.SweepResult(overlap=0.37), mesh, base, "gloo", 2)
    assert measured.overlap == 0.37 and base.overlap != 0.37
    assert cal.build_profile(cal.SweepResult(), mesh, base, "gloo", 2).overlap == base.overlap  # not measured


def test_matmul_rates_of_other_dtypes_go_into_the_profile_as_peaks(monkeypatch):
    from types import SimpleNamespace

    import torch

    import costmodel.calibrate as cal

    monkeypatch.setattr(cal, "identity", lambda mesh, backend: {"date": "today", "device_name": "gpu"})
    gpu = SimpleNamespace(device_type="cuda", shape=(8,), mesh_dim_names=("dp",))
    base = load_profile("h100-sxm")
    prof = cal.build_profile(cal.SweepResult(matmul_tflops=700.0, other_tflops={"float32": 50.0}), gpu, base,
                             "nccl", 8)
    # Each dtype's peak times the one efficiency is the rate measured in that dtype.
    assert prof.tflops("bfloat16") * prof.compute_efficiency == pytest.approx(700.0)
    assert prof.tflops("float32") * prof.compute_efficiency == pytest.approx(50.0)
    assert prof.tflops(None) == prof.peak_tflops == base.peak_tflops
    assert prof.host_op_us == 0.0  # not measured: no host stream
    hosted = cal.build_profile(cal.SweepResult(host_op_us=12.5), gpu, base, "nccl", 8)
    assert hosted.host_op_us == 12.5 and hosted.to_json()["host_op_us"] == 12.5
    assert "host_op_us" not in base.to_json()  # absent when 0: shipped profiles keep their digest
    with pytest.raises(ValueError, match="host_op_us must be a finite time >= 0, found -1"):
        Profile.from_json({**base.to_json(), "host_op_us": -1})
    kernel_us, view_us = cal.measure_host_issue("cpu")
    assert kernel_us >= view_us > 0
    split = cal.build_profile(cal.SweepResult(host_op_us=12.5, host_view_us=4.0), gpu, base, "nccl", 8)
    assert split.host_us("kernel") == 12.5 and split.host_us("view") == 4.0 and split.host_us("free") == 0
    assert hosted.host_us("view") == 12.5  # no view figure: a view issues as any op
    assert Profile.from_json(split.to_json()).host_view_us == 4.0 and "host_view_us" not in hosted.to_json()
    with pytest.raises(ValueError, match="host_view_us must be a finite time >= 0 or null, found -2"):
        Profile.from_json({**base.to_json(), "host_view_us": -2})
    shares = cal.measure_mem_patterns("cpu", torch.float32, 256, 128)
    assert set(shares) == {"broadcast", "reduction", "outer_reduction", "normalize", "strided", "transposed",
                           "scatter"}
    assert all(0 < v <= 2 for v in shares.values())
    patterned = cal.build_profile(cal.SweepResult(mem_efficiency=shares), gpu, base, "nccl", 8)
    assert patterned.bandwidth_gbps("strided") == pytest.approx(base.mem_bandwidth_gbps * shares["strided"])
    assert patterned.bandwidth_gbps(None) == base.mem_bandwidth_gbps and "mem_efficiency" not in base.to_json()
    cpu = SimpleNamespace(device_type="cpu", shape=(2,), mesh_dim_names=("dp",))
    prof = cal.build_profile(cal.SweepResult(matmul_tflops=0.2, other_tflops={"bfloat16": 0.05}), cpu,
                             load_profile("cpu-gloo"), "gloo", 2)
    assert (prof.tflops("float32"), prof.tflops("bfloat16"), prof.compute_efficiency) == (0.2, 0.05, 1.0)
    # DTensor gathers in place of an all_to_all on CPU meshes: a CPU calibration says so, a GPU one not.
    assert prof.all_to_all_by_gather and not patterned.all_to_all_by_gather
    assert Profile.from_json(prof.to_json()).all_to_all_by_gather and "all_to_all_by_gather" not in base.to_json()


def test_a_mesh_of_one_rank_calibrates_compute_and_times_no_collective(tmp_path, monkeypatch, caplog):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "one.json"
    cfg = CalibrationConfig(kinds=("all_reduce",), min_bytes=4096, max_bytes=16384, warmup=1, iters=2, repeats=1,
                            run_seconds=0.002, matmul_size=64)
    run((1,), ("dp",), "gloo", cfg, str(out), nproc=1)
    prof, base = load_profile(out), load_profile("cpu-gloo")
    # A group of one rank moves no data: no sample, no fit, and no overlap share measured.
    assert prof.samples == () and prof.collectives == ()
    assert prof.overlap == base.overlap and prof.intra_node == base.intra_node
    assert prof.peak_tflops != base.peak_tflops and prof.tflops("bfloat16") > 0


def test_config_and_groups():
    assert CalibrationConfig(min_bytes=1024, max_bytes=65536, factor=4).sizes() == [1024, 4096, 16384, 65536]
    assert groups_of(("dp", "tp", "cp"), True) == [("dp",), ("tp",), ("cp",), ("dp", "tp"), ("dp", "cp"),
                                                  ("tp", "cp"), ("dp", "tp", "cp")]
    with pytest.raises(ValueError, match="unknown collective kinds"):
        CalibrationConfig(kinds=("all_reduce", "gossip"))
    with pytest.raises(ValueError, match="min_bytes <= max_bytes"):
        CalibrationConfig(min_bytes=10, max_bytes=5)


def test_bad_backend_and_mesh():
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA GPUs"):
            check_backend("nccl")
    with pytest.raises(ValueError, match="backend must be"):
        check_backend("mpi-ish")
    with pytest.raises(ValueError, match=r"mesh \(2, 2\) has 4 ranks but --nproc is 2"):
        run((2, 2), ("dp", "tp"), "gloo", CalibrationConfig(), None, nproc=2)


def test_real_gloo_calibration_two_processes(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "cpu.json"
    cfg = CalibrationConfig(kinds=("all_reduce", "all_gather"), min_bytes=4096, max_bytes=65536, factor=4,
                            warmup=1, iters=2, repeats=2, run_seconds=0.002, matmul_size=64)
    run((2,), ("dp",), "gloo", cfg, str(out), nproc=2)
    prof = load_profile(out)
    assert {(f.kind, f.group, f.group_size) for f in prof.collectives} == {("all_reduce", "dp", 2),
                                                                          ("all_gather", "dp", 2)}
    assert len(prof.samples) == 2 * 3 * 2
    assert prof.identity["backend"] == "gloo" and prof.identity["device_count"] == 2
    assert prof.mesh == {"shape": [2], "axis_names": ["dp"]}
    assert prof.peak_tflops > 0
    base = load_profile("cpu-gloo")  # what the measured figures replace
    assert prof.mem_bandwidth_gbps > 0 and prof.mem_bandwidth_gbps != base.mem_bandwidth_gbps
    assert 0 < prof.kernel_launch_us < 1e4 and prof.kernel_launch_us != base.kernel_launch_us
    for f in prof.collectives:
        assert np.all(np.diff(f.predict(np.logspace(2, 9, 50))) >= -1e-9)


def test_gpu_calibration_runs_on_a_gpu(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    cfg = CalibrationConfig(kinds=("all_reduce",), min_bytes=2**20, max_bytes=2**22, repeats=2, matmul_size=1024)
    run((2,), ("dp",), "nccl", cfg, str(tmp_path / "gpu.json"), nproc=2)
    assert load_profile(tmp_path / "gpu.json").collectives


def test_one_gpu_calibrates_compute_and_the_host(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    run((1,), ("dp",), "nccl", CalibrationConfig(kinds=("all_reduce",), max_bytes=2**16), str(tmp_path / "one.json"),
        nproc=1)
    prof = load_profile(tmp_path / "one.json")
    assert prof.collectives == () and prof.host_op_us >= prof.host_view_us > 0
    # Timed on the device alone (the host's issue is priced apart): a tiny kernel takes less than
    # the host's issue of one.
    assert 0 < prof.kernel_launch_us < prof.host_op_us
    # A grid too small to fill the SMs runs below the calibration side's rate.
    shares = list(prof.matmul_shares.values())
    assert shares[0] < 1.0 == prof.matmul_shares["1024"]
    assert 0 < prof.tflops("float32") * prof.compute_efficiency < prof.tflops("bfloat16") * prof.compute_efficiency


def test_vectorized_prediction_matches_scalar():
    b, t = synthetic(noise=0.2, seed=4)
    f = fit_collective("all_to_all", "dp+tp", 16, False, b, np.abs(t))
    q = np.concatenate([[0.0, 1.0, 100.0], np.logspace(0, 12, 300)])
    np.testing.assert_allclose(f.predict(q), [f.predict_one(x) for x in q], rtol=1e-12)


def test_samples_and_fits_as_frames():
    """A calibrated profile's samples and fits as tables: every sample with what the profile
    predicts for it, every fit with its latency and bus bandwidth."""
    prof = load_profile("cpu-gloo")
    samples = prof.samples_frame()
    assert len(samples) == len(prof.samples) > 0
    assert list(samples.columns) == ["kind", "group", "group_size", "intra_node", "bytes", "us", "predicted_us"]
    assert (samples["predicted_us"] > 0).all()
    fits = prof.fits_frame()
    assert len(fits) == len(prof.collectives) and (fits["busbw_gbps"] > 0).all()


def test_refine_scales_fits_to_in_step_times_and_converges():
    from costmodel.errors import CostModelError
    from costmodel.refine import refine

    base = load_profile("cpu-gloo")
    fit = next(f for f in base.collectives if f.kind == "all_reduce" and f.group == "dp")
    sizes = [2**16, 2**20]
    slow = [("all_reduce", "dp", 2, True, b, 3.0 * fit.predict_one(b)) for b in sizes]
    # A group the profile never measured (8 ranks across nodes): the fit starts from its fallback line.
    line = base.collective_predictor("all_gather", 8, False)
    new_group = [("all_gather", "rep+dp", 8, False, b, 0.5 * line(b)) for b in sizes]
    refined, rows = refine(base, slow + new_group, {"source": "test"})
    assert {(r["kind"], r["group_size"]): r["factor"] for r in rows} == {("all_reduce", 2): 3.0,
                                                                        ("all_gather", 8): 0.5}
    for b in (2**10, 2**18, 2**24):  # sizes the step never used scale too: the curve keeps its shape
        assert refined.collective_predictor("all_reduce", 2, True)(b) == pytest.approx(3.0 * fit.predict_one(b))
        assert refined.collective_predictor("all_gather", 8, False)(b) == pytest.approx(0.5 * line(b), rel=1e-6)
    other = next(f for f in base.collectives if f.kind == "reduce_scatter" and f.group == "tp")
    assert other in refined.collectives  # untouched
    tp = [next(f for f in p.collectives if f.kind == "all_reduce" and f.group == "tp") for p in (base, refined)]
    assert tp[1].predict_one(2**20) == pytest.approx(3.0 * tp[0].predict_one(2**20))  # same size and link: same fix
    assert len(refined.step_samples) == 4 and refined.samples == base.samples  # kept apart
    assert refined.refinements[0]["source"] == "test" and refined.refinements[0]["fits"] == rows
    again = Profile.from_json(json.loads(json.dumps(refined.to_json())))
    assert again == refined and again.digest() != base.digest()
    # Measured again at what the refined profile predicts: nothing moves.
    same = [("all_reduce", "dp", 2, True, b, refined.collective_predictor("all_reduce", 2, True)(b)) for b in sizes]
    twice, rows2 = refine(refined, same)
    assert rows2[0]["factor"] == pytest.approx(1.0) and len(twice.refinements) == 2
    with pytest.raises(CostModelError, match="no in-step collective samples"):
        refine(base, [])
    with pytest.raises(CostModelError, match="needs bytes > 0"):
        refine(base, [("all_reduce", "dp", 2, True, 0, 5.0)])


def test_matmul_rate_by_size_goes_into_the_profile_as_shares(monkeypatch):
    """Square matmuls around the calibration side are timed; each side's rate over the
    calibration side's is its share (``Profile.matmul_shares``); one side alone gives no curve."""
    from types import SimpleNamespace

    import torch

    import costmodel.calibrate as cal

    assert cal.matmul_sides(4096, "cuda") == [512, 1024, 2048, 4096, 8192, 16384]
    assert cal.matmul_sides(64, "cuda") == [16, 32, 64, 128, 256]  # no side under 16
    assert cal.matmul_sides(1024, "cpu") == []  # a lone small matmul runs from a CPU's cache
    monkeypatch.setattr(cal, "identity", lambda mesh, backend: {"date": "today", "device_name": "cpu"})
    cpu = SimpleNamespace(device_type="cpu", shape=(2,), mesh_dim_names=("dp",))
    rates = {128: 0.05, 256: 0.1, 512: 0.2}
    prof = cal.build_profile(cal.SweepResult(matmul_tflops=0.1, matmul_side=256, matmul_sizes=rates), cpu,
                             load_profile("cpu-gloo"), "gloo", 2)
    assert prof.matmul_shares == {"128": 0.5, "256": 1.0, "512": 2.0}
    assert prof.matmul_share(256) == 1.0 and prof.matmul_share(128) == 0.5
    alone = cal.build_profile(cal.SweepResult(matmul_tflops=0.1, matmul_side=256, matmul_sizes={256: 0.1}), cpu,
                              load_profile("cpu-gloo"), "gloo", 2)
    assert alone.matmul_shares == {}
    assert cal.measure_matmul("cpu", 32, torch.float32) > 0


def test_the_views_host_issue_is_timed_on_views_alone():
    """The chain that times a view's issue holds views only, so no kernel's issue is in it."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    import costmodel.calibrate as cal
    from costmodel.ops import host_kind

    gm = make_fx(cal.view_chain)(torch.randn(8, 16))
    kinds = [host_kind(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert len(kinds) >= 200 and set(kinds) == {"view"}


def test_device_time_falls_back_to_the_host_clock_off_gpus():
    import torch

    import costmodel.calibrate as cal

    calls = []
    seconds = cal.Timer(torch.device("cpu")).device_best(lambda: calls.append(1))
    assert seconds > 0 and len(calls) == 2 + 9  # best(): two warm-up calls, three runs of three


def test_lockstep_timing_is_the_slowest_ranks_median(monkeypatch):
    """Ranks that share cores time compute all at once and take the slowest rank's time, median
    of the runs: here another rank takes twice as long, so every rank reads twice its own time,
    where the best of its own runs would read its own."""
    import time

    import torch
    import torch.distributed as dist

    import costmodel.calibrate as cal

    monkeypatch.setattr(dist, "barrier", lambda group=None: None)

    def slower_peer(t, op=None, group=None):  # the MAX over this rank and a peer twice as slow
        t.mul_(2.0)

    monkeypatch.setattr(dist, "all_reduce", slower_peer)
    timer = cal.Timer(torch.device("cpu"))

    def fn():
        time.sleep(0.002)

    alone = timer.best(fn)
    together = cal.lockstep_seconds(timer, fn, seconds=0.02)
    assert 1.6 * alone < together < 3.0 * alone
