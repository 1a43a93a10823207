"""Activation checkpointing as a planning choice: what each mode recomputes, what it costs and
saves in the problem, and that the lowered programs recompute it with unchanged numerics."""

import copy

import numpy as np
import pytest
import torch
from helpers import (
    SHARDING_PROFILE,
    LocalTensorMode,
    full,
    lift_replicated_locals,
    local_mesh,
    reference_adamw,
    spy_on_solves,
)

import autoshard
from autoshard.errors import ConfigError, MemoryBudgetError, PlanError
from autoshard.graph.recompute import EXPENSIVE, choose
from autoshard.graph.tracing import trace
from autoshard.models import MLP, llama
from autoshard.planfile import Plan
from solver.evaluate import evaluate


def lm_loss(out):
    return out.float().pow(2).mean()


def tiny(n_layers=2, seq=16):
    torch.manual_seed(0)
    model = llama("tiny", n_layers=n_layers, max_seq_len=seq)
    x = torch.randint(0, 256, (8, seq), generator=torch.Generator().manual_seed(1))
    return model, x


def test_modes_recompute_what_they_say():
    model, x = tiny()
    tg = trace(model, (x,), lm_loss)
    by_name = {n.name: n for n in tg.gm.graph.nodes}
    none, sel, full_ = (choose(tg, m) for m in ("none", "selective", "full"))
    assert none.count == 0 and not none.nodes
    assert set(sel.nodes) == set(full_.nodes) == {"layers.0", "layers.1"}
    for layer, names in full_.nodes.items():
        nodes = [by_name[n] for n in names]
        assert set(sel.nodes[layer]) < set(names)
        assert any(n.target in EXPENSIVE for n in nodes)  # full recomputes the matmuls too
        assert not any(by_name[n].target in EXPENSIVE for n in sel.nodes[layer])
        at = by_name[full_.at[layer]]
        assert tg.phase(at) == "backward"
        for n in nodes:
            assert tg.phase(n) == "forward"
            # A layer's output feeds the next layer's forward: kept, never recomputed.
            assert all(tg.phase(u) == "backward" or u.name in names for u in n.users
                       if autoshard.graph.layers.node_layer(u) != (layer, "fwd")), n.name
    # Layers are recomputed alike (the same number of nodes each), in graph order.
    assert len(full_.nodes["layers.0"]) == len(full_.nodes["layers.1"])


@pytest.fixture
def planner(world):
    world(4)
    model, x = tiny(n_layers=4, seq=32)
    mesh = autoshard.fake_mesh((2, 2), ("dp", "tp"))
    # No buckets: the budgets below sit at the edge of what the solver's rows allow, and a bucket
    # holds its flat buffer beyond them (the plan's account, tests/test_memory.py).
    return autoshard.Planner(model, (x,), mesh, loss_fn=lm_loss, memory_budget=None, time_limit=60,
                             seed_baselines=False, bucket_mb=0)


def test_recomputation_costs_compute_and_saves_memory(planner):
    """Copies are tied to their originals and charged their compute; the least memory any plan
    can have falls from none to selective to full, and the optimum's cost rises."""
    least = {}
    plans = {}
    for mode in ("none", "selective", "full"):
        problem = planner.problem(recompute=mode)
        rc, gp = planner.variant(mode)
        assert gp.num_originals == planner.built.num_originals
        for c, v in gp.copy_of.items():
            assert gp.nodes[c] is gp.nodes[v] and any(c in g and v in g for g in problem.ties)
        least[mode] = _least_peak(problem)
        plans[mode] = planner.solve(recompute=mode)
        assert plans[mode].recompute["mode"] == mode
        assert plans[mode].summary["recompute"]["nodes"] == rc.count
    assert least["full"] < least["selective"] < least["none"]
    assert plans["none"].summary["step_us"] < plans["selective"].summary["step_us"] \
        < plans["full"].summary["step_us"]
    assert plans["full"].summary["recompute"]["compute_us"] > 0


def test_auto_recomputes_only_where_memory_binds(planner):
    assert planner.solve(recompute="auto").recompute["mode"] == "none"  # no budget: nothing to trade
    free = planner.solve(recompute="auto", memory_budget=2**40)
    assert free.recompute["mode"] == "none"  # the memory-free optimum fits: recomputing only adds time
    assert free.summary["recompute_tried"] == {"none": free.summary["step_us"], "selective": "pruned",
                                               "full": "pruned"}
    # Below the least peak of any plan that keeps everything, above that of full recomputation.
    budget = _least_peak(planner.problem(recompute="none")) - 1
    assert _least_peak(planner.problem(recompute="full")) < budget
    # The error names the mode: recomputation meets this budget, so the model itself is not infeasible.
    with pytest.raises(MemoryBudgetError, match=r"infeasible for this model \(recompute='none'\)"):
        planner.solve(recompute="none", memory_budget=budget)
    chosen = planner.solve(recompute="auto", memory_budget=budget)
    assert chosen.recompute["mode"] in ("selective", "full")
    assert chosen.summary["peak_mem_bytes"] <= budget
    assert chosen.summary["recompute_tried"]["none"] == "infeasible"
    tried = {m: t for m, t in chosen.summary["recompute_tried"].items() if not isinstance(t, str)}
    assert chosen.summary["step_us"] == min(tried.values())


def test_baselines_of_an_infeasible_mode_are_not_solved(planner, monkeypatch):
    """Where keeping every activation is proved not to fit, the hand-written plans that keep
    them (DDP, FSDP, TP, FSDP+TP) cannot either: they are reported infeasible without a solve,
    and only FSDP+TP with full recomputation is solved."""
    budget = _least_peak(planner.problem(recompute="none")) - 1
    with pytest.raises(MemoryBudgetError):
        planner.solve(recompute="none", memory_budget=budget)
    solved = spy_on_solves(monkeypatch, planner)
    table = planner.compare(memory_budget=budget, recompute="full")
    modes = [opts.recompute for opts in solved]
    assert modes.count("none") == 0, modes
    for name in ("ddp", "fsdp", "tp", "fsdp_tp"):
        assert isinstance(table[name], str) and "infeasible" in table[name], table[name]
    assert not isinstance(table["fsdp_tp_ac"], str)


def _least_peak(problem):
    """The peak of each tie group's least-usage strategy: no plan of ``problem`` peaks lower."""
    low = [int(np.argmin(u)) for u in problem.node_usages]
    for group in problem.ties:
        for v in group:
            low[v] = low[group[0]]
    return evaluate(problem, np.array(low)).peak_usage


def test_plan_file_keeps_the_recomputation(planner, tmp_path):
    plan = planner.solve(recompute="selective")
    plan.save(tmp_path / "p.json")
    back = Plan.load(tmp_path / "p.json")
    assert back.recompute == plan.recompute and back.recompute["mode"] == "selective"
    data = plan.to_json()
    del data["recompute"]
    assert Plan.from_json(data).recompute["mode"] == "none"  # plans from before recomputation
    data["recompute"] = {"mode": "sometimes"}
    with pytest.raises(PlanError, match="recompute"):
        Plan.from_json(data)


def test_a_model_without_repeated_layers_cannot_recompute(world):
    world(4)
    torch.manual_seed(0)
    model, x = MLP(dim=16, hidden=32), torch.randn(8, 16)
    planner = autoshard.Planner(model, (x,), autoshard.fake_mesh((4,), ("dp",)), memory_budget=None, time_limit=5)
    assert planner.solve().recompute["mode"] == "none"
    with pytest.raises(ConfigError, match="repeated layer"):
        planner.solve(recompute="full")
    table = planner.compare(["fsdp_tp", "fsdp_tp_ac"])
    assert isinstance(table["fsdp_tp_ac"], str) and "repeated layer" in table["fsdp_tp_ac"]
    with pytest.raises(ConfigError, match="recompute"):
        autoshard.PlanOptions(recompute="always")


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputing_plan_matches_single_device(world, mode):
    """Loss and gradients of 3 AdamW steps equal single-device ones; the backward program runs the
    recomputed matmuls again and the forward hands it fewer saved values."""
    world(4)
    model, x = tiny()
    mesh = autoshard.fake_mesh((2, 2), ("dp", "tp"))
    planner = autoshard.Planner(model, (x,), mesh, profile=SHARDING_PROFILE, loss_fn=lm_loss,
                                memory_budget=None, time_limit=20, seed_baselines=False)
    plan, plain = planner.solve(recompute=mode), planner.solve(recompute="none")
    if mode == "full":
        # Where a layer's input is redistributed, the replay redistributes it again, and is charged.
        again = [r for r in plan.redistributes if r.get("recompute")]
        assert again and all(r["us"] > 0 for r in again)
    ref_losses, ref_grads = reference_adamw(copy.deepcopy(model), (x,), lm_loss)
    counts = {}
    with LocalTensorMode(4) as lm:
        lmesh = local_mesh((2, 2), ("dp", "tp"))
        for name, p in (("plain", plain), ("recompute", plan)):
            sharded = autoshard.parallelize(copy.deepcopy(model), p, lmesh)
            lift_replicated_locals(sharded, lm)
            opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
            losses = []
            for _ in range(3):
                opt.zero_grad()
                loss = lm_loss(sharded(x))
                loss.backward()
                losses.append(float(full(loss).detach()))
                grads = {fqn: full(q.grad).clone() for fqn, q in sharded.named_parameters()}
                opt.step()
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
            for fqn, g in grads.items():
                torch.testing.assert_close(g, ref_grads[fqn], rtol=1e-4, atol=1e-5, msg=f"{name} {fqn}")
            program = next(iter(sharded.forward.programs.values()))
            bwd = program.backward_program(0).gm
            counts[name] = (len(program.split.saved),
                            sum(n.target in EXPENSIVE for n in bwd.graph.nodes if n.op == "call_function"))
    assert counts["recompute"][0] < counts["plain"][0]
    if mode == "full":
        assert counts["recompute"][1] > counts["plain"][1]  # the forward's matmuls, run again


def test_each_layers_recompute_runs_before_its_own_backward(world):
    """The planned order runs a layer's recomputed copies, in graph order, just before the
    backward node its recompute runs before (as the lowering does), not after the backward; the
    executor's buckets span no recomputation, so the lowered backward runs each layer's
    recomputation after the later layer's backward matmuls, as planned."""
    world(4)
    model, x = tiny(n_layers=2, seq=32)
    mesh = autoshard.fake_mesh((2, 2), ("dp", "tp"))
    planner = autoshard.Planner(model, (x,), mesh, loss_fn=lm_loss, memory_budget=None, time_limit=20,
                                profile="cpu-gloo", recompute="full")
    plan = planner.compare(["fsdp_tp_ac"])["fsdp_tp_ac"]
    _, gp = planner.variant("full")
    order = gp.run_order()
    pos = {v: i for i, v in enumerate(order)}
    assert gp.recompute_at and set(gp.recompute_at) == set(gp.copy_of)
    by_layer: dict[int, list[int]] = {}
    for c, at in gp.recompute_at.items():
        by_layer.setdefault(at, []).append(c)
    assert len(by_layer) == 2
    for at, copies in by_layer.items():
        spots = sorted(pos[c] for c in copies)
        # Contiguous, right before `at`, in the originals' order.
        assert spots == list(range(pos[at] - len(copies), pos[at]))
        assert [gp.copy_of[order[i]] for i in spots] == sorted(gp.copy_of[c] for c in copies)

    from autoshard._torch_compat import RECOMPUTED

    sharded = autoshard.parallelize(model, plan, mesh, loss_fn=lm_loss)
    sharded(x)
    program = next(iter(sharded.forward.programs.values()))
    nodes = [n for n in program.backward_program(0).gm.graph.nodes if n.op == "call_function"]
    # The backward's matmuls in program order, as runs of recomputed ones and others: each
    # layer's recomputation, then its backward.
    flags = [bool(n.meta.get("custom", {}).get(RECOMPUTED)) for n in nodes if n.target == torch.ops.aten.mm.default]
    runs = [f for k, f in enumerate(flags) if k == 0 or f != flags[k - 1]]
    assert runs.count(True) == 2 and runs[-1] is False, runs
