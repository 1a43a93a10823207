"""Every strategy a plan may hold is one DTensor runs as planned: each distinct (op, input specs,
output spec) of the reference models' plans, run alone on LocalTensorMode on operands in the
planned input specs, gives the planned output spec and the unsharded op's value."""

import pytest
import torch
import torch.fx as fx
from helpers import SHARDING_PROFILE, LocalTensorMode, full, local_mesh
from torch.distributed.tensor import DTensor

import autoshard
from autoshard import _torch_compat as tc
from autoshard.graph.tracing import trace
from autoshard.models import gpt2, llama
from autoshard.models.moe import moe
from autoshard.runtime.lower import move
from costmodel import MeshTopology, RedistributePlanner, Spec

# Random ops draw a different stream sharded than whole: checked by the training tests instead.
RANDOM = ("native_dropout", "bernoulli", "rand")


def lm_loss(out):
    logits = out if isinstance(out, torch.Tensor) else out["logits"]
    return logits.float().pow(2).mean()


def _values(tg, model, x) -> dict:
    """Every node's value in one real step (the joint graph run by FX's interpreter)."""
    params = [p.detach().requires_grad_(p.requires_grad) for p in dict(model.named_parameters()).values()]
    buffers = list(dict(model.named_buffers()).values())
    seen: dict = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            seen[n] = super().run_node(n)
            return seen[n]

    Recorder(tg.gm).run(*params, *buffers, x)
    return seen


def _cases(tg, plan, only=None) -> dict:
    """One node per distinct (op, specs, argument shapes, non-tensor arguments); ``only``: ops
    whose name has this text."""
    cases = {}
    for n in tg.gm.graph.nodes:
        entry = plan.nodes.get(n.name)
        if n.op != "call_function" or not entry or any(r in str(n.target) for r in RANDOM):
            continue
        if only is not None and only not in str(n.target):
            continue
        if isinstance(n.target, torch._ops.OpOverload) and not tc.has_rule(n.target):
            continue  # no rule: replicated by the lowering, never by DTensor's dispatch
        shapes = tuple(tuple(a.meta["val"].shape) for a in n.all_input_nodes
                       if isinstance(a.meta.get("val"), torch.Tensor))
        literal = repr([a for a in n.args if not isinstance(a, fx.Node)])
        key = (str(n.target), tuple(entry["in"]), str(entry["out"]), shapes, literal)
        cases.setdefault(key, n)
    return cases


def _check_model(model, x, shape, names, only=None):
    plan = autoshard.plan(model, (x,), autoshard.fake_mesh(shape, names), profile=SHARDING_PROFILE, loss_fn=lm_loss,
                          memory_budget=None)
    tg = trace(model, (x,), lm_loss)
    values = _values(tg, model, x)
    cases = _cases(tg, plan, only)
    sharded = 0
    with LocalTensorMode(int(torch.tensor(shape).prod())):
        mesh = local_mesh(shape, names)
        planner = RedistributePlanner(MeshTopology(shape, SHARDING_PROFILE.devices_per_node), SHARDING_PROFILE)
        replicated = Spec(("R",) * len(shape))
        for (op, ins, _, _, _), n in cases.items():
            specs = iter(Spec.parse(s) for s in ins)

            def operand(a):
                v = values[a]
                if not isinstance(a.meta.get("val"), torch.Tensor):
                    return v
                # Each rank's copy a LocalTensor of its own: a partition (R -> P(sum)) divides every
                # rank's value, which a plain tensor shared by the ranks would take more than once.
                own = tc.from_rank_parts({r: v.detach().clone() for r in range(mesh.size())})
                whole = DTensor.from_local(own, mesh, tc.placements_for(replicated, mesh), run_check=False)
                return move(whole, next(specs), planner, mesh)

            args, kwargs = fx.node.map_arg((n.args, n.kwargs), operand)
            got = n.target(*args, **kwargs)
            first = got[0] if isinstance(got, (tuple, list)) else got
            want = values[n][0] if isinstance(values[n], (tuple, list)) else values[n]
            planned = plan.nodes[n.name]["out"]
            planned = planned[0] if isinstance(planned, list) else planned
            if not isinstance(first, DTensor):
                continue
            actual = tc.from_placements(first.placements, mesh)
            assert actual == Spec.parse(planned), f"{n.name} {op} {ins}: DTensor gave {actual}, the plan says {planned}"
            torch.testing.assert_close(full(first), want.detach(), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{n.name} {op} in {ins} out {planned}: {m}")
            sharded += "S(" in planned or any("S(" in s for s in ins)
    if only is None:
        # The tiny models' plans hold 45-60 distinct cases (fused attention is one op where
        # the math path was a dozen); a check that ran a handful would prove little.
        assert len(cases) > 40 and sharded > 10, (len(cases), sharded)
    else:
        assert sharded, cases


@pytest.mark.parametrize("shape, names", [((2, 2), ("dp", "tp")), ((2, 2, 2), ("rep", "dp", "tp"))])
def test_every_planned_strategy_of_the_reference_models_runs_as_planned(world, shape, names):
    world(int(torch.tensor(shape).prod()))
    torch.manual_seed(0)
    x = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    _check_model(llama("tiny", n_layers=2, max_seq_len=16), x, shape, names)
    _check_model(gpt2("tiny"), x, shape, names)


def test_every_planned_strategy_of_a_vision_model_runs_as_planned(world):
    """A patch convolution: DTensor runs convolutions by a handler of its own, narrower than the
    rule the planner reads (autoshard.graph.strategies.executable)."""
    world(4)
    from test_reference_models import _hf_input, _hf_model

    _check_model(_hf_model("vit"), _hf_input("vit"), (2, 2), ("dp", "tp"))


def test_every_planned_strategy_of_a_mixture_of_experts_runs_as_planned(world):
    """Routing (topk, cumsum, scatter_add, gather), batched expert matmuls and their backward."""
    world(4)
    torch.manual_seed(0)
    x = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    _check_model(moe("tiny", capacity_factor=1.0), x, (2, 2), ("dp", "tp"))


def test_lists_of_tensors_are_planned_and_run_as_planned(world):
    """Hugging Face Llama's rotary embedding concatenates halves (``cat`` of a tensor list): the
    planner reads DTensor's rule for the list instead of replicating, and each planned spec runs."""
    world(4)
    from test_reference_models import _hf_model

    model = _hf_model("llama")
    x = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    plan = autoshard.plan(model, (x,), autoshard.fake_mesh((2, 2), ("dp", "tp")), profile=SHARDING_PROFILE,
                          loss_fn=lm_loss, memory_budget=None)
    # The rotary cats are planned, and so are the KV cache's (onto an empty 1-D tensor, which cat
    # skips: planned as the other operand alone, the empty one replicated), sharded like the rest.
    assert not plan.summary.get("fallback_ops"), plan.summary["fallback_ops"]
    cats = [e for name, e in plan.nodes.items() if name.startswith("cat")]
    assert len(cats) == 9 and any("S(" in e["out"] for e in cats), cats
    cache = [e for e in cats if len(e["in"]) == 2 and e["in"][0] == "RR"]
    assert len(cache) == 4 and all("S(" in e["in"][1] for e in cache), cache
    _check_model(model, x, (2, 2), ("dp", "tp"), only="cat")
