"""PlannedStep: the costed graph runs op by op with the planner's own redistributes."""

import copy

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

import autoshard
from autoshard.replay import PlannedStep
from helpers import SHARDING_PROFILE, LocalTensorMode, full, lift_replicated_locals, local_mesh, reference_adamw
from test_reference_models import lm_loss, tiny, tokens

MESHES = [((2, 2), ("dp", "tp")), ((2, 2, 2), ("rep", "dp", "tp"))]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("shape, names", MESHES)
def test_planned_step_runs_exactly_the_planned_collectives(world, name, shape, names):
    world(int(torch.tensor(shape).prod()))
    model, x = tiny(name), tokens()
    plan = autoshard.plan(model, (x,), autoshard.fake_mesh(shape, names), profile=SHARDING_PROFILE,
                          loss_fn=lm_loss, memory_budget=None)
    planned = sum(len(r["steps"]) for r in plan.redistributes)
    assert planned > 0, "the plan under test moves nothing"
    ref = copy.deepcopy(model)
    ref_losses, _ = reference_adamw(ref, (x,), lm_loss)
    with LocalTensorMode(int(torch.tensor(shape).prod())) as mode:
        mesh = local_mesh(shape, names)
        sharded = autoshard.parallelize(copy.deepcopy(model), plan, mesh)
        lift_replicated_locals(sharded, mode)
        step = PlannedStep(sharded, plan, mesh, (x,), lm_loss, profile=SHARDING_PROFILE)
        opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
        for k in range(3):
            opt.zero_grad()
            with CommDebugMode() as comm:
                loss = step(x)
            # Every collective that ran is a step of a planned redistribute, and every planned step ran.
            assert comm.get_total_counts() == planned, (comm.get_comm_counts(), planned)
            assert full(loss).item() == pytest.approx(ref_losses[k], rel=1e-5, abs=1e-6)
            for fqn, p in sharded.named_parameters():
                assert list(p.grad.placements) == list(p.placements), fqn
            opt.step()
        ref_params = dict(ref.named_parameters())
        for fqn, p in sharded.named_parameters():
            err = (full(p.detach()) - ref_params[fqn].detach()).abs().max().item()
            assert err <= 1e-4, f"{fqn}: {err:.3g} after 3 AdamW steps"


def test_planned_step_rejects_a_plan_for_another_graph(world):
    world(4)
    model, x = tiny("llama"), tokens()
    plan = autoshard.plan(model, (x,), autoshard.fake_mesh((2, 2), ("dp", "tp")), profile=SHARDING_PROFILE,
                          loss_fn=lm_loss, memory_budget=None)
    with LocalTensorMode(4):
        mesh = local_mesh((2, 2), ("dp", "tp"))
        sharded = autoshard.parallelize(copy.deepcopy(model), plan, mesh)
        with pytest.raises(autoshard.PlanError, match="no specs for graph nodes"):
            PlannedStep(sharded, plan, mesh, (x,), lambda out: out.float().mean(), profile=SHARDING_PROFILE)
