"""The step simulated on the lowered programs (one compute, one communication stream)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import autoshard
from autoshard.graph.tracing import trace
from autoshard.models import llama
from autoshard.planning.problem import GraphProblem
from autoshard.planning.simulate import simulate_plan, simulate_step
from autoshard.runtime.program import PlannedProgram
from costmodel import load_profile
from costmodel.ops import host_kind


def test_simulated_step_prices_the_programs_that_run(world):
    """Without bucketing or overlap the programs' collectives are the plan's steps, each waited
    for at once: the simulated communication is the plan's, all of it exposed. With torch's
    passes an FSDP-like plan's gathers go in buckets and run beside compute: fewer collectives,
    less communication and a shorter step, part of it hidden."""
    world(4)
    torch.manual_seed(0)
    model = llama("tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=128, max_seq_len=16)
    inputs = (torch.randint(0, 128, (8, 16)),)
    mesh = autoshard.fake_mesh((2, 2), ("dp", "tp"))
    plan = autoshard.plan(model, inputs, mesh, profile="cpu-gloo", time_limit=10, memory_budget=None,
                          pins={"*": "S(0)R"}, input_specs=["S(0)R"])
    planned_comm = sum(sum(r["step_us"]) for r in plan.redistributes)
    assert planned_comm > 0
    tg = trace(model, inputs)
    plain = simulate_step(PlannedProgram(tg, plan, mesh, None, 0, False, False), 0)
    assert plain.comm_us == pytest.approx(planned_comm, rel=1e-6)
    assert plain.exposed_us == pytest.approx(plain.comm_us, rel=1e-6)
    assert plain.step_us == pytest.approx(plain.compute_us + plain.comm_us, rel=1e-6)
    assert plain.collectives == sum(len(r["steps"]) for r in plan.redistributes)
    passes = simulate_step(PlannedProgram(tg, plan, mesh, None, 25, True, False), 0)
    assert passes.collectives < plain.collectives
    assert passes.comm_us < plain.comm_us  # one latency per bucket
    assert passes.exposed_us < passes.comm_us  # some of it beside compute
    assert passes.step_us < plain.step_us
    assert passes.step_us >= passes.compute_us


def _llama_on_eight(world, profile: str):
    """A planner of a 2-layer LLaMA, batch 16 x 64, on 8 data-parallel ranks, no budget."""
    world(8)
    torch.manual_seed(0)
    model = llama("tiny", dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=512, max_seq_len=64)
    return autoshard.Planner(model, (torch.randint(0, 512, (16, 64)),), autoshard.fake_mesh((8,), ("dp",)),
                             profile=profile, time_limit=10, memory_budget=None)


def test_plan_simulation_overlaps_parameter_and_gradient_moves(world):
    """At plan time, on the planned graph: a plan's predicted step is its simulation, never
    above its additive step and never below its compute; an FSDP plan's gathers run ahead and
    its gradient reductions beside the backward, so part of its communication is hidden; a plan
    with no communication simulates to its additive step. The profile's overlap share moves the
    step between the additive one (0) and the perfectly overlapped walk (1), linearly."""
    planner = _llama_on_eight(world, "h100-sxm")
    fsdp = planner.solve(pins={"*": "S(0)"}, input_specs=["S(0)"])
    # Nothing sharded, additively: no communication (the overlap objective may shard activations).
    alone = planner.solve(pins={"*": "R"}, input_specs=["R"], overlap_objective=False)
    for plan in (fsdp, alone, planner.solve()):
        s, sim = plan.summary, plan.summary["simulated"]
        assert sim["step_us"] == s["step_us"]
        assert s["compute_us"] <= s["step_us"] <= s["additive_us"] * (1 + 1e-9), s
        assert 0 <= sim["exposed_comm_us"] <= sim["comm_us"] * (1 + 1e-9) + 1e-6
        # Buckets merge collectives: the same bytes, fewer latencies.
        assert sim["comm_us"] == pytest.approx(s["comm_us"] - sim["bucket_saved_us"], rel=1e-6, abs=1e-3)
    assert fsdp.summary["comm_us"] > 0
    assert fsdp.summary["simulated"]["buckets"] > 0 and fsdp.summary["simulated"]["bucket_saved_us"] > 0
    assert fsdp.summary["simulated"]["exposed_comm_us"] < 0.9 * fsdp.summary["comm_us"]
    assert fsdp.summary["step_us"] < fsdp.summary["additive_us"]
    assert alone.summary["comm_us"] == pytest.approx(0, abs=1e-3)
    assert alone.summary["step_us"] == pytest.approx(alone.summary["additive_us"], rel=1e-9)
    gp = planner.built
    choice = planner._plans[next(k for k in planner._plans if '"S(0)"' in k)][1]
    perfect, none = simulate_plan(gp, choice, 1.0), simulate_plan(gp, choice, 0.0)
    saved = fsdp.summary["simulated"]["bucket_saved_us"]
    assert none.step_us == pytest.approx(fsdp.summary["additive_us"] - saved, rel=1e-6)
    assert perfect.step_us < none.step_us
    eta = planner.profile.overlap
    assert fsdp.summary["step_us"] == pytest.approx(none.step_us - eta * (none.step_us - perfect.step_us), rel=1e-6)


def test_views_of_a_gathered_bucket_member_become_reshapes():
    """A gathered bucket is split along dim 1 (a row per rank), so a member is a strided slice;
    a recorded view that merges its rows fails on it until the pass turns it into a reshape
    (seen on GPT-2's DDP plan on 4 gloo ranks)."""
    import operator

    import torch.fx as fx

    from autoshard.runtime.passes import reshape_strided_bucket_slices

    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")
    split = g.call_function(aten.split_with_sizes.default, (x, [4, 6], 1))
    member = g.call_function(operator.getitem, (split, 1))
    rows = g.call_function(aten.view.default, (member, [2, 6]))
    flat = g.call_function(aten.view.default, (rows, [12]))
    g.output(flat)
    gm = fx.GraphModule(torch.nn.Module(), g)
    x_val = torch.arange(20.0).reshape(2, 10)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        gm(x_val)
    assert reshape_strided_bucket_slices(gm) == 2
    gm.recompile()
    assert torch.equal(gm(x_val), x_val[:, 4:].reshape(12))


def test_gathered_bucket_members_are_copied_out_contiguous():
    """torch's CPU ``native_group_norm_backward`` reads a strided slice as if contiguous: fed its
    gradient and statistics as members of one gathered bucket (split along dim 1) it is off by
    tens (Wav2Vec2's feature extractor). The pass copies each member it reads out contiguous, as
    FSDP2 copies gathered parameters out of its buffer, and the op's answer is the unbucketed one."""
    import operator

    import torch.fx as fx

    from autoshard.runtime.passes import reshape_strided_bucket_slices

    aten = torch.ops.aten
    n, c, length = 4, 16, 79
    torch.manual_seed(0)
    x, w = torch.randn(n, c, length), torch.randn(c)
    _, mean, rstd = aten.native_group_norm(x, w, torch.randn(c), n, c, length, c, 1e-5)
    grad = torch.randn(n, c, length)
    want = aten.native_group_norm_backward(grad, x, mean, rstd, w, n, c, length, c, [True, True, True])
    bucket = torch.cat([mean.reshape(n, -1), rstd.reshape(n, -1), grad.reshape(n, -1)], 1)

    g = fx.Graph()
    b, xs, ws = g.placeholder("bucket"), g.placeholder("x"), g.placeholder("w")
    split = g.call_function(aten.split_with_sizes.default, (b, [c, c, c * length], 1))
    m, r, d = (g.call_function(operator.getitem, (split, k)) for k in range(3))
    m, r = (g.call_function(aten.view.default, (t, [n, c])) for t in (m, r))
    d = g.call_function(aten.reshape.default, (d, [n, c, length]))
    g.output(g.call_function(aten.native_group_norm_backward.default,
                             (d, xs, m, r, ws, n, c, length, c, [True, True, True])))
    gm = fx.GraphModule(torch.nn.Module(), g)
    reshape_strided_bucket_slices(gm)
    gm.recompile()
    clones = [u for u in gm.graph.nodes if u.target is aten.clone.default]
    assert len(clones) == 3 and all(u.args[0].target is operator.getitem for u in clones)
    for got, ref in zip(gm(bucket, x, w), want):
        torch.testing.assert_close(got, ref)


def test_no_op_moves_across_a_recomputation_and_collectives_stay_where_scheduled():
    """The overlap scheduler pulls the next layer's recomputation (independent of the pending
    wait) ahead of this layer's backward to hide a collective; the program runs it after the
    ops planned before it again, the collective still started where the scheduler started it
    and waited for before its reader. Within a segment the scheduler's order stays."""
    import torch.fx as fx

    from autoshard import _torch_compat as tc
    from autoshard.runtime.passes import keep_recomputation_in_place, recompute_segments

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    g = fx.Graph()
    x = g.placeholder("x")
    start = g.call_function(c10d.all_reduce.default, (x, "sum", "0"))
    wait = g.call_function(c10d.wait_tensor.default, (start,))
    a = g.call_function(aten.mul.Tensor, (x, 2.0))
    c = g.call_function(aten.add.Tensor, (wait, a))
    b = g.call_function(aten.mul.Tensor, (x, 3.0))  # the next layer's recomputation
    b.meta["custom"] = {tc.RECOMPUTED: True}
    g.output((c, b))
    gm = fx.GraphModule(torch.nn.Module(), g)
    segment = recompute_segments(gm)
    assert [segment[n] for n in (start, wait, a, c, b)] == [0, 0, 0, 0, 1]
    # As the scheduler leaves it: `b` pulled ahead of the wait, the wait just before its reader.
    for before, node in ((a, b), (b, wait)):
        before.append(node)
    assert [n for n in gm.graph.nodes if n.op == "call_function"] == [start, a, b, wait, c]
    keep_recomputation_in_place(gm, segment)
    gm.graph.lint()
    assert [n for n in gm.graph.nodes if n.op == "call_function"] == [start, a, wait, c, b]
    # Without a recomputation the scheduler's order is the program's.
    plain = {n: 0 for n in segment}
    for before, node in ((a, b), (b, wait)):
        before.append(node)
    keep_recomputation_in_place(gm, plain)
    assert [n for n in gm.graph.nodes if n.op == "call_function"] == [start, a, b, wait, c]


def test_host_stream_bounds_a_program_of_small_ops_by_their_issue():
    """With a host issue time h per op, a program of tiny ops lasts (ops) x h, views included
    (they cost the host, not the device), and the device's wait is idle time, not exposed
    communication; a program of large ops hides its issue behind them; h = 0 is the two-stream
    walk."""
    import dataclasses

    from torch.fx.experimental.proxy_tensor import make_fx

    from autoshard.planning.simulate import simulate
    from autoshard.runtime.passes import Estimator
    from costmodel import load_profile

    def chain(x):
        for _ in range(50):
            x = (x * 1.0001).view(-1)
        return x

    base = load_profile("h100-sxm")
    small = make_fx(chain)(torch.ones(8))
    ops = sum(1 for n in small.graph.nodes if n.op == "call_function")
    assert ops == 100
    plain = simulate(small, Estimator(base))
    assert plain.idle_us == 0 and plain.step_us == pytest.approx(50 * base.kernel_launch_us)
    host = simulate(small, Estimator(dataclasses.replace(base, host_op_us=20.0)))
    assert host.step_us == pytest.approx(ops * 20.0) and host.compute_us == plain.compute_us
    assert host.idle_us == pytest.approx(host.step_us - host.compute_us)
    assert host.overlapped(0.9).exposed_us == pytest.approx(0.0, abs=1e-9)
    big = make_fx(lambda a: a @ a)(torch.ones(4096, 4096))
    large = simulate(big, Estimator(dataclasses.replace(base, host_op_us=20.0)))
    assert large.step_us == pytest.approx(large.compute_us + 20.0)  # only the first issue shows


def test_the_host_issues_a_view_at_its_own_time_and_a_getitem_free():
    """``host_view_us``: a view (no kernel) costs the host its own time, any other op
    ``host_op_us``, a tuple's getitem nothing; both walks, the lowered program's and the planned
    graph's, charge the same per node."""
    import dataclasses

    from torch.fx.experimental.proxy_tensor import make_fx

    from autoshard.planning.simulate import simulate
    from autoshard.runtime.passes import Estimator

    def chain(x):
        for _ in range(50):
            x = torch.split(x * 1.0001, 4)[0].view(-1)  # a kernel, a split (a view), a getitem, a view
        return x

    base = load_profile("h100-sxm")
    gm = make_fx(chain)(torch.ones(8))
    kinds = [host_kind(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert (kinds.count("kernel"), kinds.count("view")) == (50, 100) and kinds.count("free") >= 50
    split = dataclasses.replace(base, host_op_us=20.0, host_view_us=5.0)
    assert simulate(gm, Estimator(split)).step_us == pytest.approx(50 * 20.0 + 100 * 5.0)
    same = dataclasses.replace(base, host_op_us=20.0)  # no view figure: a view issues as any op
    assert simulate(gm, Estimator(same)).step_us == pytest.approx(150 * 20.0)
    gp = SimpleNamespace(nodes=[n for n in gm.graph.nodes], _issue=None,
                         host_by_kind={k: split.host_us(k) for k in ("free", "view", "kernel")})
    issue = GraphProblem.issue_us(gp)
    assert sum(issue) == pytest.approx(50 * 20.0 + 100 * 5.0) and issue[0] == 0  # the placeholder


def test_plan_simulation_waits_for_the_host_where_the_ops_are_small(world):
    """The planned graph's walk keeps the same host clock: a plan of small ops is priced at its
    issue, ops x h at least, and reports the device's wait; one of large ops is not moved."""
    import dataclasses

    from costmodel import load_profile
    from costmodel.ops import host_kind

    world(1)
    torch.manual_seed(0)
    model = llama("tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=128, max_seq_len=16)
    inputs = (torch.randint(0, 128, (2, 16)),)
    mesh = autoshard.fake_mesh((1,), ("dp",))
    base = load_profile("h100-sxm")
    plain = autoshard.plan(model, inputs, mesh, profile=base, time_limit=10)
    hosted = autoshard.plan(model, inputs, mesh, profile=dataclasses.replace(base, host_op_us=20.0), time_limit=10)
    # Every op the host issues (a getitem of an op's outputs is free: fused attention's two and three).
    ops = len([n for n in trace(model, inputs).gm.graph.nodes
               if n.op == "call_function" and host_kind(n.target) != "free"])
    assert "host_idle_us" not in plain.summary["simulated"]
    assert hosted.summary["step_us"] >= ops * 20.0 > 2 * plain.summary["step_us"]
    assert hosted.summary["simulated"]["host_idle_us"] > 0
    assert hosted.summary["compute_us"] == plain.summary["compute_us"]
    assert hosted.summary["simulated"]["exposed_comm_us"] == 0


def test_window_terms_and_the_walk_trace_account_for_every_cost_of_a_plan(world):
    """The diagnostic of objective against walk (benchmarks/objective_gap.py): each node's compute
    in one window, each move hideable in one window or exposed in one; with no host floors the
    windows' parts add up to the objective at share 1; the trace covers the walk's nodes in order
    and ends within its step; a plan another planner made has no choice here."""
    from autoshard.errors import ConfigError
    from autoshard.planning.simulate import walk_trace
    from autoshard.planning.windows import overlap_windows, window_terms

    planner = _llama_on_eight(world, "cpu-gloo")
    plan = planner.solve(pins={"*": "S(0)"}, input_specs=["S(0)"])
    _, gp = planner.variant(plan.recompute["mode"])
    choice = planner.choice_of(plan)
    terms = window_terms(gp, choice)
    p = gp.problem
    compute = sum(float(p.node_costs[v][choice[v]]) for v in range(p.num_nodes))
    moves = sum(float(p.edge_costs[k][choice[e[0]], choice[e[1]]]) for k, e in enumerate(p.edges))
    assert terms["compute"].sum() == pytest.approx(compute) and moves > 0
    assert terms["exposed"].sum() + terms["hideable"].sum() == pytest.approx(moves)
    assert terms["hideable"].sum() > 0 and not terms["floor"].any()
    assert overlap_windows(gp, 1.0).cost(p, choice) == pytest.approx(terms["objective"].sum())
    timeline, trace = walk_trace(gp, choice)
    assert sorted(v for v, *_ in trace) == list(range(len(gp.nodes)))
    assert all(b <= a for _, b, a, _ in trace) and trace[-1][2] <= timeline.step_us + 1e-6
    assert timeline.step_us == pytest.approx(simulate_plan(gp, choice, 1.0).step_us)
    other = _llama_on_eight(world, "cpu-gloo")
    with pytest.raises(ConfigError, match="not made by this planner"):
        other.choice_of(plan)


def test_walk_shares_weigh_each_window_by_what_the_walk_hides_there(world):
    """An FSDP plan on gloo's profile, where some gathers wait in the walk: per window, the share
    of what it may hide that the walk hides, in [0, eta] and below eta somewhere; F weighed by
    them adds each window's deficit (the walk's time there beyond the window's objective) up to
    what the window may hide, so it lies between F and F plus every deficit; at half the share,
    half the shares."""
    from autoshard.planning.simulate import walk_trace
    from autoshard.planning.windows import overlap_windows, walk_shares, window_terms

    planner = _llama_on_eight(world, "cpu-gloo")
    plan = planner.solve(pins={"*": "S(0)"}, input_specs=["S(0)"])
    _, gp = planner.variant(plan.recompute["mode"])
    choice = planner.choice_of(plan)
    windows = overlap_windows(gp, 1.0)
    shares = walk_shares(gp, windows, choice)
    assert ((shares >= 0) & (shares <= 1)).all() and (shares < 0.9).any(), shares
    terms = window_terms(gp, choice)
    walked = np.zeros(len(terms["compute"]))
    for v, before, after, _ in walk_trace(gp, choice)[1]:
        walked[terms["segment"][v]] += after - before
    deficits = np.maximum(0.0, walked - terms["objective"])
    f, weighed = windows.cost(gp.problem, choice), windows.with_shares(shares).cost(gp.problem, choice)
    assert f < weighed <= f + deficits.sum() + 1e-6
    np.testing.assert_allclose(walk_shares(gp, overlap_windows(gp, 0.5), choice), shares / 2)


def test_collectives_start_early_in_the_memory_the_step_leaves_free(world):
    """Where a program's own peak lies below the step's (an FSDP forward under full recomputation:
    the backward holds more), the plan's account says by how much, and the overlap scheduler may
    hold that much more to start the gathers early: less of the communication is exposed than
    where it may hold nothing more, the plan's predicted peak unchanged."""
    world(8)
    torch.manual_seed(0)
    model = llama("tiny", dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=1024, vocab_size=1024, max_seq_len=64)
    inputs = (torch.randint(0, 1024, (16, 64)),)
    mesh = autoshard.fake_mesh((8,), ("dp",))
    plan = autoshard.plan(model, inputs, mesh, profile="h100-sxm", time_limit=20, memory_budget=None,
                          pins={"*": "S(0)"}, input_specs=["S(0)"], recompute="full", bucket_mb=0)
    memory = plan.summary.memory
    assert memory["headroom_bytes"]["forward"] > 0 and memory["headroom_bytes"]["backward"] == 0
    tg = trace(model, inputs)
    free = simulate_step(PlannedProgram(tg, plan, mesh, None, 0, True, False), 0)
    held = PlannedProgram(tg, plan, mesh, None, 0, True, False)
    held.headroom = {}  # what a plan that does not say its headroom runs
    tight = simulate_step(held, 0)
    assert free.comm_us == pytest.approx(tight.comm_us, rel=1e-9)
    assert free.exposed_us < 0.8 * tight.exposed_us and free.step_us < tight.step_us
