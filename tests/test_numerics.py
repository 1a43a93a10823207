"""A parallelized model computes the single-device loss and gradients (LocalTensorMode)."""

import copy

import pytest
import torch
from helpers import SHARDING_PROFILE, LocalTensorMode, full, local_mesh, reference_step
from torch.distributed.tensor.debug import CommDebugMode

import autoshard
from autoshard.models import MLP, TransformerBlock, TransformerConfig
from autoshard.planfile import ParamPlacement, Plan

MESHES = [((4,), ("dp",)), ((2, 2), ("dp", "tp"))]


def mse(out):
    return out.pow(2).mean()


def make(model_name):
    torch.manual_seed(0)
    if model_name == "mlp":
        return MLP(dim=16, hidden=32), (torch.randn(8, 16),)
    cfg = TransformerConfig(dim=16, n_heads=4, n_layers=1, vocab_size=0)
    return TransformerBlock(cfg), (torch.randn(4, 8, 16),)


def check_same(model, inputs, plan, shape, names):
    ref = copy.deepcopy(model)
    ref_loss, ref_grads = reference_step(ref, inputs, mse)
    with LocalTensorMode(int(torch.tensor(shape).prod())):
        mesh = local_mesh(shape, names)
        sharded = autoshard.parallelize(copy.deepcopy(model), plan, mesh, loss_fn=mse, profile=SHARDING_PROFILE)
        with CommDebugMode() as comm:
            loss = mse(sharded(*inputs))
            loss.backward()
        # The model's own collectives are in its lowered programs (CommDebugMode sees only the loss's).
        counts = {str(k): v for k, v in comm.get_comm_counts().items()}
        for program in sharded.forward.programs.values():
            for kind, n in program.collective_counts().items():
                counts[kind] = counts.get(kind, 0) + n
        torch.testing.assert_close(full(loss), ref_loss, rtol=1e-5, atol=1e-5)
        for fqn, p in sharded.named_parameters():
            torch.testing.assert_close(full(p.grad), ref_grads[fqn], rtol=1e-5, atol=1e-5, msg=fqn)
            want = list(autoshard._torch_compat.to_placements(plan.param_spec(fqn)))
            assert list(p.placements) == want
            assert list(p.grad.placements) == want, fqn
    return counts


@pytest.mark.parametrize("model_name", ["mlp", "block"])
@pytest.mark.parametrize("shape, names", MESHES)
def test_planned_model_matches_single_device(world, model_name, shape, names):
    world(int(torch.tensor(shape).prod()))
    model, inputs = make(model_name)
    mesh = autoshard.fake_mesh(shape, names)
    plan = autoshard.plan(model, inputs, mesh, profile=SHARDING_PROFILE, loss_fn=mse, memory_budget=None)
    # Under slow compute the planner must shard something: not an all-replicate plan.
    sharded_specs = [s for s in plan.inputs if "S(" in s] + [
        fqn for fqn in plan.params if "S(" in str(plan.param_spec(fqn))
    ]
    assert sharded_specs, plan.describe()
    counts = check_same(model, inputs, plan, shape, names)
    assert sum(counts.values()) > 0, counts


def hand_plan(model, inputs, shape, names, param_spec, input_spec):
    params = {fqn: ParamPlacement(placements=dict(zip(names, param_spec(p).placements)), shape=list(p.shape))
              for fqn, p in model.named_parameters()}
    return Plan(mesh_shape=list(shape), axis_names=list(names), params=params, inputs=[input_spec],
                model={"class": type(model).__name__})


@pytest.mark.parametrize("style", ["ddp", "fsdp"])
def test_hand_plans_match_single_device(world, style):
    """DDP and FSDP-like placements through the same apply path, counted collectives."""
    from costmodel import Spec

    world(4)
    model, inputs = make("mlp")
    if style == "ddp":
        plan = hand_plan(model, inputs, (4,), ("dp",), lambda p: Spec(("R",)), "S(0)")
    else:
        plan = hand_plan(model, inputs, (4,), ("dp",), lambda p: Spec(("S(0)",)), "S(0)")
    counts = check_same(model, inputs, plan, (4,), ("dp",))
    # DDP reduces gradients; FSDP gathers weights before use.
    expected = "all_reduce" if style == "ddp" else "all_gather"
    assert any(expected in k and v > 0 for k, v in counts.items()), counts


def test_weights_gathered_once_per_step_match_single_device(world):
    """A plan made for 4 microbatches (a pipeline stage's) under FSDP: the weights its matmuls
    read are gathered on the step's first microbatch and reused by the other three (the later
    forwards run no all-gather), and the gradients accumulated over the four, reduced once,
    are the single-device sum."""
    from autoshard.runtime.lower import collectives

    world(4)
    model, _ = make("block")
    mesh = autoshard.fake_mesh((4,), ("dp",))
    micro = [torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(k)) for k in range(4)]
    plan = autoshard.plan(model, (micro[0],), mesh, profile=SHARDING_PROFILE, loss_fn=mse, memory_budget=None,
                          microbatches=4, pins={"*": "S(0)"}, seed_baselines=False)
    assert plan.held, plan.describe()
    assert Plan.from_json(plan.to_json()).held == plan.held
    assert "weights gathered once per step and held for every microbatch: 6 views" in plan.describe()
    ref = copy.deepcopy(model)
    ref.zero_grad()
    ref_losses = []
    for x in micro:
        loss = mse(ref(x))
        loss.backward()
        ref_losses.append(loss.detach())
    with LocalTensorMode(4):
        sharded = autoshard.parallelize(copy.deepcopy(model), plan, local_mesh((4,), ("dp",)), loss_fn=mse,
                                        profile=SHARDING_PROFILE, accumulate_gradients=True)
        for _step in range(2):  # the second step gathers the weights again
            for x, want in zip(micro, ref_losses):
                loss = mse(sharded(x))
                loss.backward()
                torch.testing.assert_close(full(loss), want, rtol=1e-5, atol=1e-5)
            (program,) = sharded.forward.programs.values()
            assert program.held_values is not None
            sharded.forward.reduce_gradients()
            assert program.held_values is None
            for fqn, p in sharded.named_parameters():
                torch.testing.assert_close(full(p.grad), ref.get_parameter(fqn).grad, rtol=1e-5, atol=1e-5,
                                           msg=fqn)
                p.grad = None
        rank = program._any_rank()
        first, later = (gathered_bytes(collectives(gm(rank).gm))
                        for gm in (program.forward_program, program.forward_held_program))
    # The held weights are the block's six matmul weights, nearly all its bytes (its norms' weights
    # are read by a multiply, not through a view, and gathered per microbatch).
    assert len(plan.held) == 6 and first > 0 and later <= first / 20, (plan.held, first, later)


def gathered_bytes(nodes) -> int:
    """Bytes the all-gathers among ``nodes`` (a program's collectives) send from each rank."""
    out = 0
    for n in nodes:
        if "all_gather" in n.target._opname:
            v = n.args[0].meta["val"]
            out += v.numel() * v.element_size()
    return out
