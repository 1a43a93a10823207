"""PlannedStep: the costed graph runs op by op with the planner's own redistributes."""

import copy
import dataclasses

import pytest
import torch
from helpers import SHARDING_PROFILE, LocalTensorMode, full, lift_replicated_locals, local_mesh, reference_adamw
from test_reference_models import lm_loss, plan_tiny, tiny, tokens
from torch.distributed.tensor.debug import CommDebugMode

import autoshard
from autoshard.runtime.replay import PlannedStep

MESHES = [((2, 2), ("dp", "tp")), ((2, 2, 2), ("rep", "dp", "tp"))]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("shape, names", MESHES)
def test_planned_step_runs_exactly_the_planned_collectives(world, name, shape, names):
    world(int(torch.tensor(shape).prod()))
    model, x, plan = plan_tiny(name, shape, names)
    planned = sum(len(r["steps"]) for r in plan.redistributes)
    assert planned > 0, "the plan under test moves nothing"
    ref = copy.deepcopy(model)
    ref_losses, _ = reference_adamw(ref, (x,), lm_loss)
    with LocalTensorMode(int(torch.tensor(shape).prod())) as mode:
        mesh = local_mesh(shape, names)
        sharded = autoshard.parallelize(copy.deepcopy(model), plan, mesh)
        lift_replicated_locals(sharded, mode)
        _train_as_planned(sharded, plan, mesh, x, planned, ref, ref_losses)


def _train_as_planned(sharded, plan, mesh, x, planned, ref, ref_losses):
    """3 AdamW steps through PlannedStep (no buckets): every collective that ran is a step of a
    planned redistribute and every planned step ran; losses, gradient placements and final
    parameters match the single-device reference."""
    step = PlannedStep(sharded, plan, mesh, (x,), lm_loss, profile=SHARDING_PROFILE, bucket_mb=0)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    for k in range(3):
        opt.zero_grad()
        with CommDebugMode() as comm:
            loss = step(x)
        assert comm.get_total_counts() == planned, (comm.get_comm_counts(), planned)
        assert full(loss).item() == pytest.approx(ref_losses[k], rel=1e-5, abs=1e-6)
        for fqn, p in sharded.named_parameters():
            assert tuple(p.grad.placements) == tuple(p.placements), fqn
        opt.step()
    ref_params = dict(ref.named_parameters())
    for fqn, p in sharded.named_parameters():
        err = (full(p.detach()) - ref_params[fqn].detach()).abs().max().item()
        assert err <= 1e-4, f"{fqn}: {err:.3g} after 3 AdamW steps"


def test_planned_step_rejects_a_plan_for_another_graph(world):
    world(4)
    model, x, plan = plan_tiny("llama", (2, 2), ("dp", "tp"))
    with LocalTensorMode(4):
        mesh = local_mesh((2, 2), ("dp", "tp"))
        sharded = autoshard.parallelize(copy.deepcopy(model), plan, mesh)
        with pytest.raises(autoshard.PlanError, match="no specs for graph nodes"):
            PlannedStep(sharded, plan, mesh, (x,), lambda out: out.float().mean(), profile=SHARDING_PROFILE)


def test_bucketed_gradient_reductions_give_the_same_training(world):
    """A data-parallel plan: every weight gradient is one all-reduce over dp. Bucketed, they
    run as a few flat all-reduces (one when the bucket holds everything) and training is
    unchanged: loss and parameters after 3 AdamW steps equal the unbucketed run's."""
    world(4)
    from autoshard.planning.baselines import baseline_pins

    mesh_shape, names = (4,), ("dp",)
    pins, inputs = baseline_pins("ddp", tiny("llama"), 1)
    # Local copies at a device's rate: at the test profile's 1 GB/s, gathering some weight
    # gradients' activations is priced below reducing the gradients, and the plan is not DDP's.
    model, x = tiny("llama"), tokens()
    plan = autoshard.plan(model, (x,), autoshard.fake_mesh(mesh_shape, names), loss_fn=lm_loss, memory_budget=None,
                          profile=dataclasses.replace(SHARDING_PROFILE, mem_bandwidth_gbps=1000.0), pins=pins,
                          input_specs=inputs)
    runs = {}
    whole, small = 1024.0, 4096 / 2**20  # MiB: every gradient in one bucket; a few in each
    for bucket in (0, whole, small):
        with LocalTensorMode(4) as mode:
            mesh = local_mesh(mesh_shape, names)
            sharded = autoshard.parallelize(copy.deepcopy(model), plan, mesh)
            lift_replicated_locals(sharded, mode)
            step = PlannedStep(sharded, plan, mesh, (x,), lm_loss, profile=SHARDING_PROFILE, bucket_mb=bucket)
            opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
            losses = []
            for _ in range(3):
                opt.zero_grad()
                with CommDebugMode() as comm:
                    losses.append(full(step(x)).item())
                opt.step()
            reduces = comm.get_comm_counts().get(torch.ops.c10d_functional.all_reduce, 0)
            runs[bucket] = (losses, {f: full(p.detach()) for f, p in sharded.named_parameters()}, reduces,
                            step.buckets)
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    # Every weight gradient is one all-reduce unbucketed, and all of them share the single bucket.
    assert runs[0][2] >= n_params and runs[0][3] == 0
    assert runs[whole][3] == 1 and runs[whole][2] == runs[0][2] - n_params + 1
    assert 1 < runs[small][3] < n_params
    for bucket in (whole, small):
        assert runs[bucket][0] == pytest.approx(runs[0][0], rel=1e-6)
        for fqn, p in runs[0][1].items():
            assert torch.allclose(runs[bucket][1][fqn], p, atol=1e-6), fqn


def test_planned_step_keeps_non_default_shard_orders(world):
    """FSDP over TP: weights split on dim 0 first by tp (axis 1), then by dp (axis 0). The
    parameters hold exactly those shards (DTensor's _StridedShard encoding of the order),
    the collectives that run are the plan's order-aware steps, and training matches."""
    from torch.distributed.tensor.placement_types import _StridedShard

    world(4)
    shape, names = (2, 2), ("dp", "tp")
    pins = {"layers.*.ffn.w1.weight": "S(0)[1,0]S(0)", "layers.*.attn.wq.weight": "S(0)[1,0]S(0)"}
    model, x, plan = plan_tiny("llama", shape, names, pins=pins)
    assert str(plan.param_spec("layers.0.ffn.w1.weight")) == "S(0)[1,0]S(0)"
    planned = sum(len(r["steps"]) for r in plan.redistributes)
    ref = copy.deepcopy(model)
    ref_losses, _ = reference_adamw(ref, (x,), lm_loss)
    with LocalTensorMode(4) as mode:
        mesh = local_mesh(shape, names)
        sharded = autoshard.parallelize(copy.deepcopy(model), plan, mesh)
        lift_replicated_locals(sharded, mode)
        w1 = dict(sharded.named_parameters())["layers.0.ffn.w1.weight"]
        assert any(isinstance(p, _StridedShard) for p in w1.placements)
        want = dict(model.named_parameters())["layers.0.ffn.w1.weight"].detach()
        assert torch.equal(full(w1.detach()), want)
        rows = want.shape[0] // 4
        # rank (dp, tp) holds tp-chunk tp, then its dp-half: rows (2 tp + dp) * rows / ... in order
        locals_ = w1.to_local()._local_tensors
        for rank in range(4):
            dp, tp = divmod(rank, 2)
            start = (tp * 2 + dp) * rows
            assert torch.equal(locals_[rank], want[start:start + rows]), rank
        _train_as_planned(sharded, plan, mesh, x, planned, ref, ref_losses)


@pytest.mark.parametrize("text", ["S(0)[1,0]S(0)R", "S(0)[2,0,1]S(0)S(0)", "S(1)S(0)S(1)[2,0]", "S(0)S(0)S(0)",
                                  "RS(1)S(1)[2,1]"])
def test_shard_orders_round_trip_through_dtensor_placements(world, text):
    from autoshard._torch_compat import from_placements, placements_for
    from autoshard.runtime.shards import distribute
    from costmodel import Spec

    world(8)
    spec = Spec.parse(text)
    with LocalTensorMode(8):
        mesh = local_mesh((2, 2, 2), ("a", "b", "c"))
        assert from_placements(placements_for(spec, mesh), mesh) == spec
        x = torch.arange(16 * 8 * 3, dtype=torch.float32).reshape(16, 8, 3)
        d = distribute(x, mesh, spec)
        assert from_placements(d.placements, mesh) == spec
        assert torch.equal(full(d), x)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_planned_step_runs_hugging_face_models(world, arch):
    """PlannedStep runs what parallelize runs: a Hugging Face decoder (tensor constants lifted
    inside forward, the KV cache's empty tensor) gives the single-device loss and gradients."""
    from helpers import reference_step
    from test_reference_models import plan_hf

    world(4)
    model, x, loss_fn, plan = plan_hf(arch)
    ref_loss, ref_grads = reference_step(copy.deepcopy(model), (x,), loss_fn)
    with LocalTensorMode(4) as mode:
        mesh = local_mesh((2, 2), ("dp", "tp"))
        sharded = autoshard.parallelize(copy.deepcopy(model), plan, mesh)
        lift_replicated_locals(sharded, mode)
        step = PlannedStep(sharded, plan, mesh, (x,), loss_fn, profile=SHARDING_PROFILE, bucket_mb=0)
        loss = step(x)
        torch.testing.assert_close(full(loss), ref_loss, rtol=1e-5, atol=1e-6)
        for fqn, p in sharded.named_parameters():
            torch.testing.assert_close(full(p.grad), ref_grads[fqn], rtol=1e-4, atol=1e-5, msg=fqn)


def test_a_view_of_an_attention_output_runs_where_no_move_made_it_contiguous(world):
    """A plan (a tiny LLaMA on (2, 2, 2), kept in tests/data) whose fused attention output reaches
    the transpose and view that merge its heads with no redistribute between them: DTensor's
    strides of the kernel's output are not the kernel's layout (its heads inside its sequence),
    so the view is refused; PlannedStep views a contiguous copy, as lowering does, and trains
    as the single device does."""
    from pathlib import Path

    world(8)
    model, x = tiny("llama"), tokens()
    plan = autoshard.Plan.load(Path(__file__).parent / "data" / "plan_llama_tiny_2x2x2_view_on_attention.json")
    ref_losses, _ = reference_adamw(copy.deepcopy(model), (x,), lm_loss)
    with LocalTensorMode(8) as mode:
        mesh = local_mesh((2, 2, 2), ("rep", "dp", "tp"))
        sharded = autoshard.parallelize(copy.deepcopy(model), plan, mesh)
        lift_replicated_locals(sharded, mode)
        step = PlannedStep(sharded, plan, mesh, (x,), lm_loss, profile=SHARDING_PROFILE, bucket_mb=0)
        assert full(step(x)).item() == pytest.approx(ref_losses[0], rel=1e-5, abs=1e-6)
