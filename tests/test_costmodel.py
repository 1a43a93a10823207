import numpy as np
import pytest

from costmodel import (
    LinkModel,
    MeshTopology,
    Profile,
    Spec,
    builtin_profiles,
    collective_time_us,
    compute_time_us,
    load_profile,
    plan_steps,
)


@pytest.mark.parametrize("text", ["RR", "S(0)R", "P(sum)S(1)", "S(0)[1,0]S(0)", "RS(2)P(avg)"])
def test_spec_text_roundtrip(text):
    assert str(Spec.parse(text)) == text


def test_spec_errors():
    with pytest.raises(ValueError, match="cannot parse"):
        Spec.parse("Q(0)")
    with pytest.raises(ValueError, match="must list exactly the axes"):
        Spec(("S(0)", "R"), ((0, (0, 1)),))


def test_local_shape_rounds_up():
    assert Spec.parse("S(0)S(1)").local_shape((10, 16), (4, 8)) == (3, 2)
    assert Spec.parse("S(0)[1,0]S(0)").local_shape((64, 3), (2, 4)) == (8, 3)


def test_bus_bandwidth_conventions():
    link = LinkModel(latency_us=0.0, busbw_gbps=100.0)
    b = 1e9
    # 1 GB over 8 ranks at 100 GB/s bus bandwidth: all_gather moves 7/8 of it, all_reduce twice that.
    assert collective_time_us("all_gather", b, 8, link) == pytest.approx(1e4 * 7 / 8)
    assert collective_time_us("all_reduce", b, 8, link) == pytest.approx(2e4 * 7 / 8)
    assert collective_time_us("all_reduce", b, 1, link) == 0
    sizes = np.logspace(3, 9, 20)
    t = collective_time_us("reduce_scatter", sizes, 8, link)
    assert np.all(np.diff(t) > 0)


def test_topology_inner_axis_is_intra_node():
    topo = MeshTopology((8, 8), devices_per_node=8)
    assert topo.group_is_intra_node((1,)) and not topo.group_is_intra_node((0,))


def test_redistribute_steps_and_bytes():
    prof = load_profile("h100-sxm")
    topo = MeshTopology((8, 8), 8)
    steps = plan_steps(Spec.parse("P(sum)S(1)"), Spec.parse("RR"), (1024, 1024), 4, topo, prof)
    assert [(s.kind, s.axis) for s in steps] == [("all_reduce", 0), ("all_gather", 1)]
    assert steps[0].nbytes == 1024 * 1024 * 4 // 8 and steps[1].nbytes == 1024 * 1024 * 4
    assert plan_steps(Spec.parse("RR"), Spec.parse("S(0)P(sum)"), (8, 8), 4, topo, prof) == []
    # Crossing nodes is slower than staying inside one ...
    from costmodel import RedistributePlanner

    planner = RedistributePlanner(topo, prof)
    big = (4096, 4096)
    inter = planner.transition_cost(Spec.parse("S(0)R"), Spec.parse("RR"), big, 4)
    intra = planner.transition_cost(Spec.parse("RS(0)"), Spec.parse("RR"), big, 4)
    assert inter > 4 * intra
    # ... so the planner gathers hierarchically: shrink over the fast axis, cross nodes, re-gather.
    steps = plan_steps(Spec.parse("S(0)R"), Spec.parse("RR"), big, 4, topo, prof)
    assert len(steps) >= 2 and sum(s.us for s in steps) < inter


def test_compute_roofline():
    prof = load_profile("h100-sxm")
    assert compute_time_us(0, 0, prof) == 0
    assert compute_time_us(1, 1, prof) == prof.kernel_launch_us
    big = 1e15
    assert compute_time_us(big, 0, prof) == pytest.approx(big / (prof.peak_tflops * 1e6 * prof.compute_efficiency))


def test_compute_is_priced_at_the_rate_of_its_dtype():
    import dataclasses

    from costmodel.refine import refine_compute

    prof = load_profile("h100-sxm")
    big = 1e15
    bf16, fp32 = compute_time_us(big, 0, prof, "bfloat16"), compute_time_us(big, 0, prof, "float32")
    assert bf16 == compute_time_us(big, 0, prof)
    # float32 matmuls (no TF32) run on the CUDA cores: the data sheet's 67 against 989 TFLOP/s.
    assert fp32 / bf16 == pytest.approx(989 / 67)
    # Memory-bound work is priced by bytes whatever its dtype.
    assert compute_time_us(1, 1e9, prof, "float32") == compute_time_us(1, 1e9, prof, "bfloat16")
    # Refining compute scales every dtype's times by the same factor, also where the peak rises.
    hosted = dataclasses.replace(prof, host_op_us=8.0)
    for c in (2.0, 0.25):
        refined, _ = refine_compute(hosted, 1.0, c)
        for dtype in ("bfloat16", "float32"):
            assert compute_time_us(big, 0, refined, dtype) == pytest.approx(c * compute_time_us(big, 0, prof, dtype))
        assert refined.host_op_us == pytest.approx(c * 8.0)  # the host's issue is in measured compute too


def test_memory_bound_ops_are_priced_at_their_access_patterns_bandwidth():
    import dataclasses

    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from autoshard.graph.pricing import memory_pattern
    from autoshard.runtime.passes import Estimator

    def step(x, w, y, idx):
        return (x + y, x * w, x.sum(-1), torch.softmax(x, -1), x.t().contiguous(),
                x.view(256, 8, 64).transpose(0, 1).contiguous(), x * 2.0, torch.cat([x, y], -1), x.sum(0),
                torch.ops.aten.embedding_dense_backward(x, idx, 64, -1, False))

    gm = make_fx(step, tracing_mode="fake")(torch.ones(256, 512), torch.ones(512), torch.ones(256, 512),
                                            torch.zeros(256, dtype=torch.long))
    ops = [n for n in gm.graph.nodes if n.op == "call_function" and not getattr(n.target, "is_view", False)]
    # A concatenation reads each input once: a copy, though each is smaller than the output. A
    # sum over rows keeps the last dim: an outer reduction. An embedding's gradient scatters.
    assert [memory_pattern(n) for n in ops] == [None, "broadcast", "reduction", "normalize", "transposed",
                                                "strided", None, None, "outer_reduction", "scatter"]
    base = load_profile("h100-sxm")
    shares = {"broadcast": 0.5, "reduction": 0.8, "normalize": 0.4, "strided": 0.6, "transposed": 0.25,
              "outer_reduction": 0.3, "scatter": 0.2}
    slow = dataclasses.replace(base, mem_efficiency=shares, kernel_launch_us=0.0)
    fast = dataclasses.replace(base, kernel_launch_us=0.0)
    for n in ops:
        ratio = Estimator(slow).compute_us(n) / Estimator(fast).compute_us(n)
        assert ratio == pytest.approx(1 / shares.get(memory_pattern(n), 1.0))
    with pytest.raises(ValueError, match="mem_efficiency must map access patterns"):
        dataclasses.replace(base, mem_efficiency={"diagonal": 0.5})
    # A profile calibrated before outer reductions were measured prices them as reductions.
    older = dataclasses.replace(base, mem_efficiency={"reduction": 0.8})
    assert older.bandwidth_gbps("outer_reduction") == older.bandwidth_gbps("reduction") < base.mem_bandwidth_gbps
    assert older.bandwidth_gbps("scatter") == base.mem_bandwidth_gbps  # no fallback: a copy's


def test_planned_ops_of_equal_shapes_keep_their_own_access_patterns(world):
    """Strategies are shared by ops of equal shapes and dtypes; their costs are not where one
    operand is a transpose: each node is priced at its own pattern."""
    import dataclasses

    import torch

    import autoshard

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(256, 256))

        def forward(self, x):
            return (x * self.w).sum() + (x.t() * self.w).sum()

    world(1)
    prof = dataclasses.replace(load_profile("h100-sxm"), mem_efficiency={"transposed": 0.1}, kernel_launch_us=0.0)
    planner = autoshard.Planner(Two(), (torch.ones(256, 256),), autoshard.fake_mesh((1,), ("dp",)), profile=prof,
                                time_limit=10)
    planner.solve()
    gp = planner.built
    muls = [v for v, n in enumerate(gp.nodes) if n.target == torch.ops.aten.mul.Tensor
            and not any(a.target == torch.ops.aten.t.default for a in n.all_input_nodes if a.op == "call_function")]
    muls_t = [v for v, n in enumerate(gp.nodes) if n.target == torch.ops.aten.mul.Tensor and v not in muls]
    assert muls and muls_t
    plain, transposed = gp.compute_us[muls[0]][0], gp.compute_us[muls_t[0]][0]
    assert transposed == pytest.approx(10 * plain)


def test_planner_prices_a_float32_model_at_the_float32_rate(world):
    import torch

    import autoshard

    world(1)

    def planned(dtype, **options):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.Linear(4096, 1024)).to(dtype)
        x = torch.randn(4096, 1024, dtype=dtype)
        return autoshard.Planner(model, (x,), autoshard.fake_mesh((1,), ("dp",)), profile="h100-sxm",
                                 time_limit=10, **options).solve()

    fp32, bf16 = planned(torch.float32), planned(torch.bfloat16)
    # Matmul-bound at these shapes: float32 costs several times bfloat16 (not the same, as when
    # every dtype was priced at the bf16 peak; not the full 989/67 either: the bytes double).
    assert fp32.summary["compute_us"] > 5 * bf16.summary["compute_us"]
    # A float32 model that will train under mixed precision: priced at bf16, memory as traced.
    mixed = planned(torch.float32, compute_dtype="bfloat16")
    assert mixed.summary["compute_us"] < 2 * bf16.summary["compute_us"]
    assert mixed.summary["peak_mem_bytes"] == fp32.summary["peak_mem_bytes"]
    assert mixed.profile["name"] == "h100-sxm@bfloat16" and mixed.profile.get("data")
    assert "every op's FLOPs priced as bfloat16" in mixed.describe()
    with pytest.raises(ValueError, match="compute_dtype: expected a floating-point torch dtype name .* found 'int8'"):
        autoshard.PlanOptions(compute_dtype="int8")


def test_profiles_load_save_validate(tmp_path):
    assert {"h100-sxm", "cpu-gloo"} <= set(builtin_profiles())
    p = load_profile("h100-sxm")
    p.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == p
    with pytest.raises(FileNotFoundError, match="shipped"):
        load_profile("no-such-profile")
    with pytest.raises(ValueError, match="busbw_gbps must be > 0"):
        LinkModel(latency_us=1, busbw_gbps=0)
    with pytest.raises(ValueError, match="version"):
        Profile.from_json({**p.to_json(), "version": 7})


def test_a_matmul_is_priced_at_the_rate_of_its_size():
    """``matmul_shares``: the calibrated rate's share by side (the cube root of M x N x K), linear
    in log(side) between the sides measured, the end's beyond them; a profile without a curve
    prices every size alike. A per-rank program prices its matmuls by their local shapes."""
    import dataclasses

    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from autoshard.graph.pricing import matmul_operands, matmul_side
    from autoshard.runtime.passes import Estimator

    # Bandwidth without bound: these small matmuls are priced by their FLOPs alone.
    base = dataclasses.replace(load_profile("h100-sxm"), kernel_launch_us=0.0, mem_bandwidth_gbps=1e9)
    curved = dataclasses.replace(base, matmul_shares={"1024": 1.0, "128": 0.25, "512": 0.75})
    assert list(curved.matmul_shares) == ["128", "512", "1024"]  # kept in ascending order
    assert curved.matmul_share(64) == 0.25 and curved.matmul_share(4096) == 1.0
    assert curved.matmul_share(256) == pytest.approx(0.5)  # halfway in log(side) from 128 to 512
    assert curved.matmul_share(None) == 1.0 and base.matmul_share(128) == 1.0
    big = 1e12
    assert compute_time_us(big, 0, curved, side=128) == pytest.approx(4 * compute_time_us(big, 0, base))
    assert compute_time_us(big, 0, curved) == compute_time_us(big, 0, base)  # no side: not a matmul
    assert Profile.from_json(curved.to_json()) == curved and "matmul_shares" not in base.to_json()
    with pytest.raises(ValueError, match="matmul_shares must map sides"):
        dataclasses.replace(base, matmul_shares={"wide": 0.5})

    def step(x, w, b):
        return x @ w, torch.addmm(b, x, w), torch.bmm(x.view(2, 64, 128), w.view(2, 128, 32)), x + 1

    gm = make_fx(step, tracing_mode="fake")(torch.ones(128, 128), torch.ones(128, 64), torch.ones(64))
    mm, addmm, bmm, add = [n for n in gm.graph.nodes if n.op == "call_function"
                           and n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                                            torch.ops.aten.bmm.default, torch.ops.aten.add.Tensor)]
    assert (matmul_operands(mm), matmul_operands(addmm), matmul_operands(add)) == ((0, 1), (1, 2), None)
    # sides 101.6 (128 x 128 x 64) and 80.6 (2 x 64 x 128 x 32, batch entries included): under
    # the curve's first
    for n in (mm, addmm, bmm):
        assert Estimator(curved).compute_us(n) == pytest.approx(Estimator(base).compute_us(n) / 0.25)
    assert Estimator(curved).compute_us(add) == Estimator(base).compute_us(add)
    # A batched matmul's entries run side by side: 32 heads of 2048 x 2048 x 128 are one cube of
    # their whole volume, not 32 small ones.
    assert matmul_side((32, 2048, 2048), (32, 2048, 128)) == pytest.approx((32 * 2048 * 2048 * 128) ** (1 / 3))
    assert matmul_side((2048, 4096), (4096, 1024)) == pytest.approx((2048 * 4096 * 1024) ** (1 / 3))


def test_planner_prices_thin_local_matmuls_at_their_lower_rate(world):
    """A matmul split over tensor parallelism runs as pieces of a smaller side: with a curve, a
    strategy that shards the weight's output dim 8 ways costs more than an eighth of the whole."""
    import dataclasses

    import torch

    import autoshard

    world(8)
    model = torch.nn.Linear(1024, 1024, bias=False)
    x = torch.randn(1024, 1024)
    mesh = autoshard.fake_mesh((8,), ("tp",))

    def mm_costs(prof):
        planner = autoshard.Planner(model, (x,), mesh, profile=prof, memory_budget=None, time_limit=10)
        gp = planner.built
        v = next(v for v, n in enumerate(gp.nodes) if n.target == torch.ops.aten.mm.default)
        return gp, v, gp.compute_us[v]

    base = dataclasses.replace(load_profile("h100-sxm"), kernel_launch_us=0.0, mem_bandwidth_gbps=1e9)
    curved = dataclasses.replace(base, matmul_shares={"256": 0.5, "1024": 1.0})
    gp, v, flat = mm_costs(base)
    _, _, shaped = mm_costs(curved)
    whole = [k for k, s in enumerate(gp.strategies[v]) if all(p == "R" for sp in s.ins for p in sp.placements)]
    split = [k for k, s in enumerate(gp.strategies[v])
             if s.ins[1].placements == ("S(1)",) and s.ins[0].placements == ("R",)]
    assert whole and split
    assert shaped[whole[0]] == pytest.approx(flat[whole[0]])  # side 1024: the calibrated rate
    side = (1024 * 1024 * 128) ** (1 / 3)  # 512 per rank
    assert shaped[split[0]] == pytest.approx(flat[split[0]] / curved.matmul_share(side))
    assert curved.matmul_share(side) == pytest.approx(0.75)
