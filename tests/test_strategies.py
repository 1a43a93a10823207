"""Strategy enumeration: the planner's own expansion of DTensor's single-dim rules
(``_torch_compat.expand_placements``) gives exactly what DTensor's expander gives, node by node,
on the reference models and on meshes whose axes outnumber small dims (so the shardability
filter drops strategies)."""

import math

import pytest
import torch

import autoshard
from autoshard import _torch_compat as tc
from autoshard.graph.strategies import StrategyEnumerator, clear_shared_cache, mesh_signature
from autoshard.graph.tracing import trace
from autoshard.models import gpt2, llama
from autoshard.models.moe import moe


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
        clear_shared_cache()
        fast = _all(tg, mesh)
        monkeypatch.setattr(tc, "FAST_EXPANSION", False)
        clear_shared_cache()
        slow = _all(tg, mesh)
        monkeypatch.setattr(tc, "FAST_EXPANSION", True)
        assert fast.keys() == slow.keys()
        for node in fast:
            a, b = fast[node], slow[node]
            assert a.fallback == b.fallback, (name, node)
            assert a.strategies == b.strategies, (name, node, shape,
                                                  set(a.strategies) ^ set(b.strategies))
    assert sum(fast_calls) >= 10, "the placement expansion was not used"


def test_strategies_shared_across_meshes_equal_each_mesh_enumerated_alone(world):
    """A mesh search builds a dozen meshes of three axes in one process; a node's strategies
    enumerated for one are reused for another whose :func:`mesh_signature` is the same. Each
    mesh's strategies, built after the others, equal those enumerated for it alone, node by node,
    on meshes whose axes divide the model's dims differently (heads 4, kv heads 2, ffn 96)."""
    world(64)
    torch.manual_seed(0)
    model = llama("tiny", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96)
    tg = trace(model, (torch.randint(0, 256, (64, 16)),), lambda out: out.float().mean())
    shapes = [(2, 4, 8), (4, 2, 8), (8, 2, 4), (2, 2, 16), (4, 4, 4), (16, 2, 2)]
    clear_shared_cache()
    together, enumerated = {}, []
    for shape in shapes:
        enum = StrategyEnumerator(autoshard.fake_mesh(shape, ("a", "b", "c")))
        together[shape] = {n.name: enum.for_node(n) for n in tg.gm.graph.nodes if n.op == "call_function"}
        enumerated.append(enum.stats.enumerated)
    for shape in shapes:
        clear_shared_cache()
        alone = _all(tg, autoshard.fake_mesh(shape, ("a", "b", "c")))
        assert alone.keys() == together[shape].keys()
        for node, a in alone.items():
            b = together[shape][node]
            assert (a.fallback, a.strategies) == (b.fallback, b.strategies), (shape, node)
    # Later meshes enumerate only the nodes whose signature no earlier mesh had.
    assert all(0 < e < enumerated[0] for e in enumerated[1:]), enumerated


def test_mesh_signature_reads_divisibility_by_every_product_of_axes(world):
    """Meshes that split a node's dims alike (every product of axes divides and fits the same
    dims) share a signature; one product that divides a dim for one mesh and not the other
    tells them apart."""
    world(64)
    tg = trace(torch.nn.Linear(12, 8), (torch.randn(32, 12),), lambda out: out.sum())
    mm = next(n for n in tg.gm.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.addmm.default)
    args = [a for a in mm.all_input_nodes]
    # Sizes 8, 12, 32 and the runs 96, 256, 384. (2, 4, 8) and (4, 2, 8): the products 2 and 4
    # both divide 12 and 32 and 96 ..., 16 and 32 both divide 32, 96, 256, 384 and neither 8 nor
    # 12 (nor fit them): alike. (2, 2, 16): 16 alone does not divide 8, where 8 does.
    assert mesh_signature(mm, args, (2, 4, 8)) == mesh_signature(mm, args, (4, 2, 8))
    assert mesh_signature(mm, args, (2, 4, 8)) != mesh_signature(mm, args, (2, 2, 16))
    # 12 into 8 pieces fits, into 16 it does not: (2, 4, 8) against (2, 4, 16) on 128 ranks.
    assert mesh_signature(mm, args, (2, 4, 8)) != mesh_signature(mm, args, (2, 4, 16))
    # Sizes 3, 7, 9 and their runs: neither 4 nor 5 divides one, and each fits both or neither;
    # but 9 rows into 4 pieces leave one empty (3, 3, 3, 0), into 5 none (2, 2, 2, 2, 1), and 7
    # the other way round: one axis may split them unevenly on one mesh and not the other.
    tg = trace(torch.nn.Linear(7, 9), (torch.randn(3, 7),), lambda out: out.sum())
    mm = next(n for n in tg.gm.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.addmm.default)
    assert mesh_signature(mm, list(mm.all_input_nodes), (4,)) != mesh_signature(mm, list(mm.all_input_nodes), (5,))


def test_uneven_splits_only_over_one_axis_and_never_empty():
    """A dim split into pieces that do not divide it is planned only when one mesh axis splits
    it (DTensor's ceil split: 9 over 2 is 5 and 4) and no piece is empty (3 over 4 would leave
    one rank none); over several axes the uneven pieces nest (10 over (2, 2): 3, 2, 3, 2), which
    DTensor's flattened gather assembles wrongly, so those are left out. Axes of size 1 split
    nothing."""
    from autoshard.graph.strategies import all_specs, splits_fit
    from costmodel import Spec

    assert splits_fit(Spec(("S(0)", "R")), (9, 16), (2, 2))
    assert splits_fit(Spec(("S(0)", "S(0)")), (12, 16), (2, 2))
    assert not splits_fit(Spec(("S(0)", "S(0)")), (10, 16), (2, 2))
    assert not splits_fit(Spec(("S(0)",)), (3, 16), (4,))
    assert not splits_fit(Spec(("S(0)",)), (1, 16), (2,))
    assert splits_fit(Spec(("S(0)", "S(0)")), (9, 16), (1, 2))
    specs = {str(s) for s in all_specs(2, 2, shape=(10, 16), mesh_shape=(2, 2))}
    assert {"S(0)R", "RS(0)", "S(0)S(1)", "S(1)S(1)"} <= specs and "S(0)S(0)" not in specs


def test_no_strategy_splits_a_dim_so_that_a_piece_is_empty(world):
    """A view of rows split four ways, (128, 32) as (2, 64, 32): DTensor's rule keeps the split on
    the leading 2 (a piece empty; SegFormer's decode head, whose lowered view then failed).
    No strategy of the planner holds such a spec, on its inputs or its outputs."""
    from autoshard.graph.strategies import splits_fit

    world(4)
    tg = trace(_Rows(), (torch.randn(2, 64, 16),), lambda out: out.sum())
    enum = StrategyEnumerator(autoshard.fake_mesh((2, 2), ("dp", "tp")))
    views = [n for n in tg.gm.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.view.default
             and tuple(n.meta["val"].shape) == (2, 64, 32)]
    assert views
    for node in views:
        strategies = enum.for_node(node).strategies
        assert strategies and not enum.for_node(node).fallback
        for st in strategies:
            assert splits_fit(st.outs[0], (2, 64, 32), (2, 2)), (node.name, st)
            assert splits_fit(st.ins[0], tuple(node.args[0].meta["val"].shape), (2, 2)), (node.name, st)


class _Rows(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 32)

    def forward(self, x):
        return self.proj(x.reshape(-1, 16)).view(2, 64, 32)
