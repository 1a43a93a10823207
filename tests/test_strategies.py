"""Strategy enumeration: the planner's own expansion of DTensor's single-dim rules
(``_torch_compat.expand_placements``) gives exactly what DTensor's expander gives, node by node,
on the reference models and on meshes whose axes outnumber small dims (so the shardability
filter drops strategies)."""

import math

import pytest
import torch

import autoshard
from autoshard import _torch_compat as tc
from autoshard.models import gpt2, llama
from autoshard.moe import moe
from autoshard.strategies import StrategyEnumerator
from autoshard.tracing import trace


def _models():
    torch.manual_seed(0)
    return {"llama": (llama("tiny"), torch.randint(0, 256, (8, 16))),
            "gpt2": (gpt2("tiny"), torch.randint(0, 256, (8, 16))),
            "moe": (moe("tiny"), torch.randint(0, 256, (4, 8)))}


def _all(tg, mesh):
    enum = StrategyEnumerator(mesh)
    return {n.name: enum.for_node(n) for n in tg.gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("shape", [(4,), (2, 2), (2, 4, 2), (3, 2, 2)])
def test_placement_expansion_equals_dtensors(shape, monkeypatch, world):
    world(math.prod(shape))
    mesh = autoshard.fake_mesh(shape, tuple(f"a{k}" for k in range(len(shape))))
    fast_calls = []
    real = tc.expand_placements

    def counted(*args):
        out = real(*args)
        fast_calls.append(out is not None)
        return out

    monkeypatch.setattr(tc, "expand_placements", counted)
    for name, (model, x) in _models().items():
        vocab = getattr(getattr(model, "cfg", None), "vocab_size", 256)
        tg = trace(model, (x % vocab,), lambda out: (out if isinstance(out, torch.Tensor) else out[0]).float().mean())
        fast = _all(tg, mesh)
        monkeypatch.setattr(tc, "FAST_EXPANSION", False)
        slow = _all(tg, mesh)
        monkeypatch.setattr(tc, "FAST_EXPANSION", True)
        assert fast.keys() == slow.keys()
        for node in fast:
            a, b = fast[node], slow[node]
            assert a.fallback == b.fallback, (name, node)
            assert a.strategies == b.strategies, (name, node, shape,
                                                  set(a.strategies) ^ set(b.strategies))
    assert sum(fast_calls) >= 10, "the placement expansion was not used"
