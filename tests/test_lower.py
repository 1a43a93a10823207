"""Lowered plans: per-rank programs of local ops and functional collectives, the plan's steps
exactly, the loss left to the caller."""

import copy
import re

import pytest
import torch
from helpers import (
    SHARDING_PROFILE,
    LocalTensorMode,
    assert_plan_matches_single_device,
    full,
    local_mesh,
    reference_step,
)

import autoshard
from autoshard.graph.tracing import trace
from autoshard.models import llama
from autoshard.runtime.lower import collectives

COLLECTIVE_STEPS = {"all_gather", "all_reduce", "reduce_scatter", "all_to_all"}


def lm_loss(out):
    return out.float().pow(2).mean()


def other_loss(out):
    # Another loss than the plan's: the lowered programs must not depend on it.
    return (out.float() * 3).sin().sum()


def solver_plan(model, x):
    """The solve alone's plan of ``model`` on ``x`` over a (2, 2) mesh, where sharding pays."""
    return autoshard.plan(model, (x,), autoshard.fake_mesh((2, 2), ("dp", "tp")), profile=SHARDING_PROFILE,
                          loss_fn=lm_loss, memory_budget=None, seed_baselines=False)


def tiny():
    torch.manual_seed(0)
    model = llama("tiny", n_layers=2, max_seq_len=16)
    x = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    return model, x


def test_node_names_do_not_depend_on_the_loss():
    model, x = tiny()
    a, b = trace(model, (x,), lm_loss), trace(model, (x,), other_loss)

    def model_nodes(tg):
        return [(n.name, str(n.target)) for n in tg.gm.graph.nodes if not n.name.startswith("loss_")]

    assert model_nodes(a) == model_nodes(b)
    assert any(n.name.startswith("loss_") for n in b.gm.graph.nodes)
    assert a.output_grads and set(a.output_grads) == {0}


@pytest.mark.parametrize("shape, names", [((4,), ("dp",)), ((2, 2), ("dp", "tp"))])
def test_lowered_collectives_are_the_plans_steps(world, shape, names):
    """Every collective in rank 0's programs is a step of a planned redistribute between two
    of the model's nodes, and every such step is there (the outputs' gradients arrive in the
    planned spec, so the moves the plan puts after the loss run outside the programs)."""
    world(int(torch.tensor(shape).prod()))
    model, x = tiny()
    plan = autoshard.plan(model, (x,), autoshard.fake_mesh(shape, names), profile=SHARDING_PROFILE,
                          loss_fn=lm_loss, memory_budget=None)
    with LocalTensorMode(int(torch.tensor(shape).prod())):
        mesh = local_mesh(shape, names)
        sharded = autoshard.parallelize(copy.deepcopy(model), plan, mesh, bucket_mb=0, overlap=False)
        lm_loss(sharded(x)).backward()
        program = next(iter(sharded.forward.programs.values()))
        bucketed = autoshard.parallelize(copy.deepcopy(model), plan, mesh)
        lm_loss(bucketed(x)).backward()
        merged = next(iter(bucketed.forward.programs.values()))
    tg = program.tg
    by_name = {n.name: n for n in tg.gm.graph.nodes}
    loss_part = {n.name for n in tg.gm.graph.nodes if n.name.startswith("loss_")}
    expected = 0
    for r in plan.redistributes:
        if r["arg"] == "grad":
            expected += sum(s.split("(")[0] in COLLECTIVE_STEPS for s in r["steps"])
            continue
        node = by_name[r["node"]]
        if node.name in loss_part:
            continue
        producer = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)][r["arg"]]
        if producer.name in loss_part:
            continue
        expected += sum(s.split("(")[0] in COLLECTIVE_STEPS for s in r["steps"])
    got = len(collectives(program.forward_program(0).gm)) + len(collectives(program.backward_program(0).gm))
    assert expected > 0
    assert got == expected, (got, expected, program.collective_counts(0))
    assert program.lowering.off_plan == []
    # Bucketed and overlapped: fewer collectives, the same bytes per kind.
    def sent_bytes(prog):
        out = {}
        for gm in (prog.forward_program(0).gm, prog.backward_program(0).gm):
            for n in collectives(gm):
                v = n.args[0].meta["val"]
                kind = n.target._opname.removesuffix("_out")
                out[kind] = out.get(kind, 0) + v.numel() * v.element_size()
        return out

    assert sent_bytes(merged) == sent_bytes(program) and sum(sent_bytes(program).values()) > 0
    assert sum(merged.collective_counts(0).values()) < sum(program.collective_counts(0).values())

    # Overlapped: collectives wait later than they start (independent compute placed between).
    def window(prog):
        total = 0
        for gm in (prog.forward_program(0).gm, prog.backward_program(0).gm):
            at = {n: i for i, n in enumerate(gm.graph.nodes)}
            total += sum(min(at[u] for u in c.users) - at[c] - 1 for c in collectives(gm))
        return total

    assert window(program) == 0 < window(merged)


def test_loss_outside_the_module_is_any_loss(world):
    """Planned with one loss, trained with another: gradients equal single-device ones."""
    world(4)
    model, x = tiny()
    plan = autoshard.plan(model, (x,), autoshard.fake_mesh((2, 2), ("dp", "tp")), profile=SHARDING_PROFILE,
                          loss_fn=lm_loss, memory_budget=None)
    ref_loss, ref_grads = reference_step(copy.deepcopy(model), (x,), other_loss)
    with LocalTensorMode(4):
        mesh = local_mesh((2, 2), ("dp", "tp"))
        sharded = autoshard.parallelize(copy.deepcopy(model), plan, mesh)
        out = sharded(x)
        assert tuple(out.shape) == (8, 16, 256)
        loss = other_loss(out)
        loss.backward()
        torch.testing.assert_close(full(loss), ref_loss, rtol=1e-5, atol=1e-4)
        for fqn, p in sharded.named_parameters():
            # This loss's gradients reach ~150: float32 sums in another order differ by ~4e-5 there.
            torch.testing.assert_close(full(p.grad), ref_grads[fqn], rtol=1e-4, atol=1e-4, msg=fqn)


@pytest.mark.parametrize("shape, names", [((4,), ("dp",)), ((2, 2), ("dp", "tp"))])
def test_loss_lowered_with_the_model(world, shape, names):
    """compute_loss: forward returns the plan's loss, computed and differentiated inside the
    lowered programs (no DTensor op outside them); loss and gradients equal single-device ones,
    and a scaled loss scales the gradients (the incoming gradient seeds the lowered backward)."""
    world(int(torch.tensor(shape).prod()))
    model, x = tiny()
    plan = autoshard.plan(model, (x,), autoshard.fake_mesh(shape, names), profile=SHARDING_PROFILE,
                          loss_fn=lm_loss, memory_budget=None)
    ref_loss, ref_grads = reference_step(copy.deepcopy(model), (x,), lm_loss)
    with LocalTensorMode(int(torch.tensor(shape).prod())):
        sharded = autoshard.parallelize(copy.deepcopy(model), plan, local_mesh(shape, names), loss_fn=lm_loss,
                                        compute_loss=True)
        loss = sharded(x)
        assert loss.ndim == 0 and all(p.is_replicate() for p in loss.placements)
        (2 * loss).backward()
        torch.testing.assert_close(full(loss), ref_loss, rtol=1e-5, atol=1e-6)
        for fqn, p in sharded.named_parameters():
            torch.testing.assert_close(full(p.grad), 2 * ref_grads[fqn], rtol=1e-4, atol=1e-5, msg=fqn)
        program = next(iter(sharded.forward.programs.values()))
        assert program.split.tangents[0][1].name == "loss_ones_like"
        targets = {str(n.target) for n in program.forward_program(0).gm.graph.nodes}
        assert "aten.mean.default" in targets  # the loss is in the program


def test_a_plan_without_its_profile_says_so(world):
    from autoshard.errors import PlanError

    world(4)
    model, x = tiny()
    plan = autoshard.plan(model, (x,), autoshard.fake_mesh((4,), ("dp",)), profile=SHARDING_PROFILE,
                          loss_fn=lm_loss, memory_budget=None)
    assert plan.profile["data"]["name"] == SHARDING_PROFILE.name  # a custom profile travels with the plan
    plan.profile.pop("data")
    with LocalTensorMode(4):
        sharded = autoshard.parallelize(copy.deepcopy(model), plan, local_mesh((4,), ("dp",)))
        with pytest.raises(PlanError, match="test-slow-compute.*pass that profile"):
            sharded(x)


def test_auto_parallel_plans_and_applies_in_one_call(world):
    world(4)
    model, x = tiny()
    ref_loss, ref_grads = reference_step(copy.deepcopy(model), (x,), lm_loss)
    with LocalTensorMode(4):
        mesh = local_mesh((2, 2), ("dp", "tp"))
        sharded = autoshard.auto_parallel(copy.deepcopy(model), (x,), mesh, loss_fn=lm_loss,
                                          profile=SHARDING_PROFILE, memory_budget=None)
        loss = lm_loss(sharded(x))
        loss.backward()
        torch.testing.assert_close(full(loss), ref_loss, rtol=1e-5, atol=1e-6)
        for fqn, p in sharded.named_parameters():
            torch.testing.assert_close(full(p.grad), ref_grads[fqn], rtol=1e-4, atol=1e-5, msg=fqn)
    assert any("S(" in str(sharded._autoshard_plan.param_spec(f)) for f in sharded._autoshard_plan.params)


class _Bucketed(torch.nn.Module):
    """A linear layer whose output is scaled by its bucket among fixed boundaries
    (``searchsorted``: an op DTensor has no sharding rule for) and by its floor quotient by 0.25
    (``floor_divide``: elementwise, its rule registered by :mod:`autoshard.graph.elementwise`)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 32)
        self.register_buffer("edges", torch.linspace(-1, 1, 9))

    def forward(self, x):
        y = self.proj(x)
        bucket = torch.searchsorted(self.edges, y.detach().contiguous())
        quotient = torch.floor_divide(y.detach(), 0.25)
        return y * (1 + bucket.to(y.dtype) / 8) + quotient


@pytest.mark.parametrize("op, planned", [("aten.searchsorted.Tensor", False), ("aten.floor_divide.Scalar", True)])
def test_ops_without_a_dtensor_rule_run_replicated_and_elementwise_ones_are_planned(world, op, planned):
    """An op DTensor has no rule for is planned replicated, counted in the plan's summary, and run
    replicated on each rank's full inputs; an elementwise op DTensor lacks a rule for is planned
    like any pointwise op (sharded). Either way the lowered step gives the single-device loss
    and gradients."""
    world(4)
    torch.manual_seed(0)
    model, x = _Bucketed(), torch.randn(64, 16, generator=torch.Generator().manual_seed(2))
    plan = solver_plan(model, x)
    fallback = plan.summary["fallback_ops"]
    assert (op in fallback) is not planned, fallback
    if planned:
        name = next(n for n, e in plan.nodes.items() if n.startswith("floor_divide"))
        assert "S(" in "".join(plan.nodes[name]["out"]), plan.nodes[name]
    assert_plan_matches_single_device(model, (x,), plan, (2, 2), ("dp", "tp"), lm_loss)


class _Pooled(torch.nn.Module):
    """Tokens pooled by ``AdaptiveAvgPool1d`` (Swin's classifier): traced as ``as_strided``,
    which DTensor refuses on any placement."""

    def __init__(self):
        super().__init__()
        self.proj, self.head = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)
        self.pool = torch.nn.AdaptiveAvgPool1d(1)

    def forward(self, x):
        h = self.proj(x)  # (batch, tokens, 32)
        return self.head(torch.flatten(self.pool(h.transpose(1, 2)), 1))


def test_as_strided_runs_replicated_as_planned(world):
    """``as_strided`` (an adaptive pooling's, forward and backward) is planned replicated, a
    counted fallback, and run on each rank's full inputs: the single-device loss and gradients."""
    world(4)
    torch.manual_seed(0)
    model, x = _Pooled(), torch.randn(8, 6, 16, generator=torch.Generator().manual_seed(4))
    plan = solver_plan(model, x)
    assert any("as_strided" in op for op in plan.summary["fallback_ops"]), plan.summary["fallback_ops"]
    assert_plan_matches_single_device(model, (x,), plan, (2, 2), ("dp", "tp"), lm_loss)


def test_uneven_splits_by_one_axis_only(world):
    """A dim split unevenly by one mesh axis (9 as 5 and 4) is planned and runs as planned on
    LocalTensorMode, forward and backward (each rank's program is lowered after another's: DTensor's
    caches, whose keys do not name the rank, are emptied between them, or a bias gradient's view
    would take another rank's size). Split unevenly over several axes (10 over (2, 2): 3, 2, 3, 2, which
    DTensor's flattened gather gets wrong) or into an empty piece, a pin is refused with what it
    asked, and no plan holds such a split."""
    world(4)
    torch.manual_seed(0)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(5))
    mesh_shape = (2, 2)
    mesh = autoshard.fake_mesh(mesh_shape, ("dp", "tp"))
    kw = dict(profile=SHARDING_PROFILE, loss_fn=lm_loss, memory_budget=None, seed_baselines=False)
    for width, pin in ((10, "S(0)S(0)"), (1, "S(0)R")):
        with pytest.raises(autoshard.AutoshardError, match=rf"pin '0.weight': spec {re.escape(pin)} is not a valid "
                                                           rf"spec .*\({width}, 16\).*several mesh axes"):
            autoshard.plan(torch.nn.Sequential(torch.nn.Linear(16, width)), (x,), mesh, pins={"*": pin}, **kw)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 9), torch.nn.GELU(), torch.nn.Linear(9, 16))
    for model, pins in ((torch.nn.Sequential(torch.nn.Linear(16, 9)), {"0.weight": "S(0)R", "0.bias": "S(0)R"}),
                        (torch.nn.Sequential(torch.nn.Linear(16, 9)), {"0.weight": "RS(0)", "0.bias": "RS(0)"}),
                        (mlp, {"0.weight": "RS(0)", "0.bias": "RS(0)", "2.weight": "S(1)R"})):
        plan = autoshard.plan(model, (x,), mesh, pins=pins, **kw)
        assert {f: str(plan.param_spec(f)) for f in pins} == pins
        assert_plan_matches_single_device(model, (x,), plan, mesh_shape, ("dp", "tp"), lm_loss)
    for width in (10, 9):
        model = torch.nn.Sequential(torch.nn.Linear(16, width))
        plan = autoshard.plan(model, (x,), mesh, **kw)
        for fqn, p in plan.params.items():
            for d, size in enumerate(p.shape):
                axes = [a for a, where in enumerate(p.placements.values()) if where == f"S({d})"]
                assert len(axes) <= 1 or size % 2 ** len(axes) == 0, (fqn, p.placements, p.shape)
        assert_plan_matches_single_device(model, (x,), plan, mesh_shape, ("dp", "tp"), lm_loss)


class _Activations(torch.nn.Module):
    """Activations whose gradients (and hardswish itself) DTensor has no rule for."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

    def forward(self, x):
        h = self.up(x)
        F = torch.nn.functional
        h = F.softplus(h) + F.leaky_relu(h, 0.1) + F.hardswish(h) + F.hardtanh(h) + F.elu(h) + F.mish(h)
        h = h.masked_fill(h > 3.0, torch.tensor(3.0))
        return self.down(h)


def test_activations_gradients_are_planned_elementwise(world):
    """softplus, leaky_relu, hardswish, hardtanh, elu and mish (their backward ops, hardswish's
    forward and masked_fill with a tensor value have no DTensor rule of their own) are planned as
    elementwise ops, nothing replicated for want of a rule, and the step is the single-device one."""
    world(4)
    torch.manual_seed(0)
    model, x = _Activations(), torch.randn(64, 16, generator=torch.Generator().manual_seed(3))
    plan = solver_plan(model, x)
    assert not plan.summary["fallback_ops"], plan.summary["fallback_ops"]
    assert any("S(" in "".join(e["out"]) for n, e in plan.nodes.items() if "backward" in e["op"]), plan.describe()
    assert_plan_matches_single_device(model, (x,), plan, (2, 2), ("dp", "tp"), lm_loss)


class _Shuffled(torch.nn.Module):
    """ViTMAE's masking in small: a permutation of each row's tokens drawn by ``torch.rand``."""

    def __init__(self):
        super().__init__()
        self.proj, self.out = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.proj(x)
        ids = torch.rand(x.shape[0], x.shape[1], device=x.device).argsort(-1)
        return self.out(torch.relu(h.gather(1, ids[..., None].expand_as(h))))


def test_random_factories_draw_one_value_on_every_rank(world):
    """``torch.rand`` reads no tensor: every rank computes its full value, drawn with one key so
    that every rank shuffles the same rows alike (each on its own generator would lose and double
    tokens, as ViTMAE's masking did); the loss (the same for any permutation) and gradients are
    the single-device ones."""
    world(4)
    torch.manual_seed(0)
    model, x = _Shuffled(), torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(6))
    plan = solver_plan(model, x)
    assert_plan_matches_single_device(model, (x,), plan, (2, 2), ("dp", "tp"), lm_loss)


def test_ranks_lowered_in_one_process_must_issue_the_same_collectives(world):
    """Every rank's program issues the same collectives in one order (on a (2, 2) mesh each rank's
    groups are its own, and they still agree); where one rank's would differ (torch's passes read
    each rank's own sizes, which an uneven shard makes differ), lowering it says which ranks part
    and where, instead of running programs that pair mismatched collectives."""
    from helpers import tiny_llama_on_2x2

    from autoshard.runtime.program import PlannedProgram

    world(4)
    model, inputs, mesh = tiny_llama_on_2x2()
    plan = autoshard.plan(model, inputs, mesh, profile="cpu-gloo", time_limit=10, memory_budget=None,
                          pins={"*": "S(0)S(0)"}, input_specs=["S(0)R"])
    program = PlannedProgram(trace(model, inputs), plan, mesh, None, 25, True, False)
    for rank in range(4):
        program.forward_program(rank)
        program.backward_program(rank)
    first = program._orders["forward"][1]
    assert first and all(len(c) >= 2 for c in first)  # kind and group size (or reduce op)
    program._orders["forward"] = (0, first[:-1])  # as if rank 0's had one collective fewer
    program._forward.pop(3)
    with pytest.raises(RuntimeError, match=rf"forward programs of ranks 0 and 3 issue different collectives: "
                                           rf"{len(first) - 1} and {len(first)}, the {len(first)}-th nothing"):
        program.forward_program(3)
