"""Deep models traced three and four layers deep and unrolled: node for node the full trace."""

import logging

import pytest
import torch
import torch.nn as nn

import autoshard
from autoshard.errors import ConfigError
from autoshard.graph.tracing import trace
from autoshard.graph.unroll import compare, trace_unrolled
from autoshard.models import gpt2, llama


def _both(model, inputs, caplog, **kw):
    with caplog.at_level(logging.INFO, logger="autoshard.graph.unroll"):
        caplog.clear()
        fast = trace_unrolled(model, inputs, **kw)
        said = caplog.text
    whole = trace(model, inputs, **kw)
    return fast, whole, said


@pytest.mark.parametrize("make", [lambda: llama("tiny", n_layers=9), lambda: gpt2("tiny", n_layers=8)],
                         ids=["llama", "gpt2"])
def test_unrolled_trace_is_the_full_trace(make, caplog):
    model = make()
    x = torch.randint(0, 64, (2, 16))
    fast, whole, said = _both(model, (x,), caplog)
    assert "unrolled" in said, said
    assert compare(fast, whole) is None
    assert len(fast.layer_groups[0]) == len(model.layers if hasattr(model, "layers") else model.blocks)
    # Names, tags and gradients line up, so the planner's ties and the plan's node names do too.
    assert fast.grad_of.keys() == whole.grad_of.keys()
    assert [n.name for n in fast.placeholders] == [n.name for n in whole.placeholders]


def test_compare_sees_a_difference():
    x = torch.randint(0, 64, (2, 16))
    a = trace(llama("tiny", n_layers=2), (x,))
    b = trace(llama("tiny", n_layers=3), (x,))
    assert compare(a, b) is not None
    c = trace(llama("tiny", n_layers=2), (x[:, :8],))  # same nodes, other shapes
    assert "value" in compare(a, c) or "arguments" in compare(a, c)


def test_hugging_face_llama_with_its_cache_unrolls(caplog):
    """HF Llama lifts a constant (the KV cache's empty tensor) inside every layer: each copy of
    the layer gets its own, numbered as make_fx numbers them."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, vocab_size=128, max_position_embeddings=32)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    x = torch.randint(0, 128, (2, 8))
    fast, whole, said = _both(model, (x,), caplog, loss_fn=lambda out: out["logits"].float().pow(2).mean())
    assert "unrolled" in said, said
    assert compare(fast, whole) is None
    assert sum(n.op == "get_attr" for n in fast.gm.graph.nodes) >= 8


class _Block(nn.Module):
    def __init__(self, idx, dim=16):
        super().__init__()
        self.idx = idx
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        y = torch.relu(self.lin(x)) + x
        return y * 2 if self.idx == 3 else y  # the fourth layer differs: the four-layer trace shows it


class _Odd(nn.Module):
    def __init__(self, n=10, by_index=False):
        super().__init__()
        self.layers = nn.ModuleList(_Block(i) for i in range(n))
        self.n, self.by_index = n, by_index

    def forward(self, x):
        for i in range(self.n):  # by_index: a loop that needs every layer present
            x = self.layers[i](x) if self.by_index else x
        if not self.by_index:
            for layer in self.layers:
                x = layer(x)
        return x


@pytest.mark.parametrize("by_index", [False, True], ids=["index-dependent-layer", "loop-over-range"])
def test_models_unrolling_cannot_reproduce_are_traced_whole(by_index, caplog):
    model = _Odd(by_index=by_index)
    if by_index:
        for b in model.layers:
            b.idx = -1
    fast, whole, said = _both(model, (torch.randn(4, 16),), caplog)
    assert "tracing every layer" in said, said
    assert compare(fast, whole) is None


class _TwoStacks(nn.Module):
    """Two long groups one after the other (an encoder and a decoder)."""

    def __init__(self, n=8):
        super().__init__()
        self.inp = nn.Linear(16, 16)  # the first layer's input needs a gradient, as embeddings do
        self.enc = nn.ModuleList(_Block(-1) for _ in range(n))
        self.dec = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(n + 1))

    def forward(self, x):
        x = self.inp(x)
        for layer in self.enc:
            x = layer(x)
        for layer in self.dec:
            x = layer(x) + x
        return x


def test_two_long_groups_unroll(caplog):
    fast, whole, said = _both(_TwoStacks(), (torch.randn(4, 16),), caplog)
    assert "enc.0..enc.7" in said and "dec.0..dec.8" in said, said
    assert compare(fast, whole) is None


def test_planner_unroll_option(world):
    world(4)
    mesh = autoshard.fake_mesh((2, 2), ("dp", "tp"))
    model = llama("tiny", n_layers=8)
    x = torch.randint(0, 64, (4, 16))
    fast = autoshard.plan(model, (x,), mesh, memory_budget=None)
    whole = autoshard.plan(model, (x,), mesh, memory_budget=None, unroll_layers=False)
    assert fast.nodes == whole.nodes
    assert fast.params == whole.params
    with pytest.raises(ConfigError, match="unroll_layers"):
        autoshard.PlanOptions(unroll_layers="yes")


class _CachedIndex(nn.Module):
    """Adds a table built in forward by a cached static method (the way Hugging Face's BEiT
    builds its relative position index: ``lru_cache`` keyed by the window alone)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    @staticmethod
    @__import__("functools").lru_cache(maxsize=4)
    def table(n: int) -> torch.Tensor:
        return torch.arange(n * 8, dtype=torch.float32).reshape(n, 8) / 100

    def forward(self, x):
        return self.proj(x) + self.table(x.shape[0])


def test_a_value_cached_in_forward_is_traced_alike_every_time():
    """A trace leaves no fake tensor in a model's function caches: a second trace records the same
    ops as the first (not a constant with no data, which made the planned graph and the one
    ``parallelize`` traces differ node for node), and the model runs eagerly after a trace."""
    model, x = _CachedIndex(), torch.randn(4, 8)
    first, second = trace(model, (x,), None), trace(model, (x,), None)
    assert [(n.name, n.target) for n in first.gm.graph.nodes] == [(n.name, n.target) for n in second.gm.graph.nodes]
    assert _CachedIndex.table.cache_info().currsize == 0
    torch.testing.assert_close(model(x), model.proj(x) + torch.arange(32.0).reshape(4, 8) / 100)


class _Counting(nn.Module):
    """Adds a term only on its first call: traced once as planned, then otherwise."""

    def __init__(self):
        super().__init__()
        self.proj, self.calls = nn.Linear(8, 8), 0

    def forward(self, x):
        self.calls += 1
        y = self.proj(x)
        return y * y.sigmoid() + y.tanh() if self.calls == 1 else y


def test_a_model_that_traces_otherwise_than_planned_is_refused(world):
    """A model whose graph at ``parallelize`` is not the planned one (state kept between calls)
    gets a PlanError that says so, not other nodes' placements by name."""
    from helpers import SHARDING_PROFILE, LocalTensorMode, local_mesh

    world(4)
    model, x = _Counting(), torch.randn(8, 8)
    plan = autoshard.plan(model, (x,), autoshard.fake_mesh((2, 2), ("dp", "tp")), profile=SHARDING_PROFILE,
                          memory_budget=None, seed_baselines=False)
    with LocalTensorMode(4), pytest.raises(autoshard.PlanError, match=r"traced otherwise than when it was planned"):
        autoshard.parallelize(model, plan, local_mesh((2, 2), ("dp", "tp")))(x)
