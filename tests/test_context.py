"""Context parallelism (all-gather form): causal attention split on the sequence is planned,
priced at its busiest rank and runs to the single-device loss and gradients."""

import contextlib

import pytest
import torch
from helpers import SHARDING_PROFILE, assert_plan_matches_single_device

import autoshard
from autoshard.graph import attention
from autoshard.models import llama
from costmodel.compute import causal_split_share


def _loss(out):
    return out.float().pow(2).mean()


def _query_specs(plan):
    return [e["in"][0 if "for_cpu_backward" not in e["op"] else 1] for e in plan.nodes.values()
            if "flash_attention_for_cpu" in e["op"]]


def test_causal_split_share_is_the_last_parts_work():
    """Contiguous parts of a causal sequence: the last part sees every key before it."""
    assert causal_split_share(8, 8, 1) == 1.0
    # 4 parts of 2 queries over 8 keys: the last keeps 7 + 8 of 36 scores.
    assert causal_split_share(8, 8, 4) == pytest.approx(15 / 36)
    # Long sequences: about (2n - 1) / n**2.
    assert causal_split_share(1 << 14, 1 << 14, 8) == pytest.approx(15 / 64, rel=1e-3)
    # More queries than keys: queries past the keys each keep all of them.
    assert causal_split_share(10, 4, 2) == pytest.approx(20 / 34)


@pytest.mark.parametrize("parts", [2, 4])
def test_sequence_kernels_compute_the_causal_result(parts):
    """Each part of the queries against the whole keys, at its offset: the parts' outputs and
    query gradients are the single kernel's, their key and value gradients sum to its own."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 16, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 16, 8, generator=g, requires_grad=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grad = torch.randn(ref.shape, generator=g)
    ref.backward(grad)
    run = 16 // parts
    outs, dqs, dk, dv = [], [], 0, 0
    for r in range(parts):
        sl = slice(r * run, (r + 1) * run)
        out, lse = attention.sequence_forward(q.detach()[:, :, sl], k.detach(), v.detach(), r * run)
        a, b, c = attention.sequence_backward(grad[:, :, sl], q.detach()[:, :, sl], k.detach(), v.detach(), out, lse,
                                              r * run)
        outs.append(out)
        dqs.append(a)
        dk, dv = dk + b, dv + c
    torch.testing.assert_close(torch.cat(outs, 2), ref.detach())
    torch.testing.assert_close(torch.cat(dqs, 2), q.grad)
    torch.testing.assert_close(dk, k.grad)
    torch.testing.assert_close(dv, v.grad)


def _matches_single_device(model, x, plan, loss_fn):
    """The plan on CP 2 x DP 2 under LocalTensorMode: the single-device loss and gradients."""
    assert_plan_matches_single_device(model, (x,), plan, (2, 2), ("dp", "cp"), loss_fn)


def _cp_plan(world, shape, names, batch, seq, input_spec, **kw):
    world(int(torch.tensor(shape).prod()))
    # One key head: a head split over 2 ranks cannot split it evenly, so the sequence is split.
    model = llama("tiny", n_heads=4, n_kv_heads=1, max_seq_len=seq)
    x = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    plan = autoshard.plan(model, (x,), autoshard.fake_mesh(shape, names), profile=SHARDING_PROFILE, loss_fn=_loss,
                          memory_budget=None, seed_baselines=False, input_specs=[input_spec], **kw)
    return model, x, plan


@pytest.mark.parametrize("batch, seq, tokens, mirrored", [(2, 64, "S(0)S(1)", True), (2, 62, "S(0)S(1)", False),
                                                         (1, 64, "S(1)S(1)", True)],
                         ids=["mirror", "contiguous", "two-axes"])
def test_context_parallel_plan_matches_single_device(world, monkeypatch, batch, seq, tokens, mirrored):
    """CP 2 x DP 2 on LocalTensorMode: a plan that splits the causal kernels' queries on the
    sequence gives the single-device loss and gradients, balanced by the mirror exchange where
    the sequence cuts into two chunks per rank (64 over 2), in one run per rank where not (62);
    and CP over both axes (one sequence over 4 ranks), the mirror on their flattened group. Ring
    attention is taken out of the strategies: it has its own test below."""
    calls = []
    for name in ("mirror_forward", "mirror_backward", "sequence_forward", "sequence_backward"):
        fn = getattr(attention, name)
        monkeypatch.setattr(attention, name, lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k))
    with _causal_kernels_restricted(monkeypatch, lambda *a: not attention.is_ring(*a)):
        model, x, plan = _cp_plan(world, (2, 2), ("dp", "cp"), batch, seq, tokens)
    specs = _query_specs(plan)
    both = tokens == "S(1)S(1)"
    assert specs and all(s == "S(2)S(2)" if both else "S(2)" in s for s in specs), specs
    assert plan.summary["attention"]["sequence"] == {"kernels": 2, "balanced": 2 if mirrored else 0, "ring": 0}
    assert "context parallel: 2 causal kernels split on the sequence" in plan.describe()
    _matches_single_device(model, x, plan, _loss)
    # Two layers' forward and backward kernels on each of 4 ranks.
    assert calls.count("mirror_forward") == (8 if mirrored else 0), calls
    assert calls.count("sequence_forward") == (16 if mirrored else 8), calls


def test_sequence_split_is_priced_at_its_busiest_rank(world):
    """A contiguous causal split costs its last part's work (about 2 - 1/n an even share); the
    mirror exchange evens it out and adds its messages (half the local queries each way)."""
    from autoshard.graph.strategies import StrategyEnumerator
    from autoshard.graph.tracing import trace

    world(4)
    mesh = autoshard.fake_mesh((4,), ("cp",))
    model = llama("tiny", n_heads=4, n_kv_heads=1, max_seq_len=64)
    for seq, factor in ((64, 1.0), (60, 4 * causal_split_share(60, 60, 4))):
        # Two sequences over 4 ranks: the batch cannot take the axis, so the sequence split is offered.
        tg = trace(model, (torch.randint(0, 256, (2, seq)),))
        node = next(n for n in tg.gm.graph.nodes if n.target is attention.CPU_FORWARD)
        ns = StrategyEnumerator(mesh).for_node(node)
        split = next(st for st in ns.strategies if str(st.ins[0]) == "S(2)")
        assert attention.work_factor(node, split.ins, (4,), ns.tensor_args) == pytest.approx(factor)
        axes, sizes, passes = attention.kernel_messages(node, split.ins, (4,), ns.tensor_args)
        assert passes == []  # the all-gather form
        if seq == 64:  # (2, 4, 16, 16) float32 local queries: halves of 2 KiB, log-sum-exp halves 256 B
            assert axes == (0,) and sizes == [2 * 4 * 8 * 16 * 4] * 2 + [2 * 4 * 8 * 4]
        else:
            assert axes == (0,) and sizes == []  # contiguous: nothing exchanged
        rings = [st for st in ns.strategies if str(st.ins[0]) == "S(2)" and str(st.ins[1]) == "S(2)"]
        if seq == 64:  # the ring: the same work; keys and values (2, 1, 16, 16) float32 passed 3 times
            (ring,) = rings
            assert attention.work_factor(node, ring.ins, (4,), ns.tensor_args) == pytest.approx(1.0)
            axes, sizes, passes = attention.kernel_messages(node, ring.ins, (4,), ns.tensor_args)
            assert axes == (0,) and passes == [2 * 16 * 16 * 4] * 6
            assert sizes == [2 * 4 * 8 * 16 * 4] * 2 + [2 * 4 * 8 * 4] + [2 * 8 * 16 * 4] * 2
        else:  # no ring where the mirror cannot balance it
            assert rings == []
        whole = next(st for st in ns.strategies if str(st.ins[0]) == "R")
        assert attention.work_factor(node, whole.ins, (4,), ns.tensor_args) == 1.0
    # Four sequences over 4 ranks: a batch split does the same work with nothing gathered.
    tg = trace(model, (torch.randint(0, 256, (4, 64)),))
    node = next(n for n in tg.gm.graph.nodes if n.target is attention.CPU_FORWARD)
    assert not any("S(2)" in str(st.ins[0]) for st in StrategyEnumerator(mesh).for_node(node).strategies)
    assert factor == pytest.approx(7 / 4, rel=0.05)


def test_fsdp_cp_is_a_hand_written_plan_by_name(world):
    """FSDP + CP: parameters as FSDP's, the tokens by batch over all axes but the last and by
    sequence over the last; compare() solves it when asked by name, its recomputation with it,
    and by default where the batch cannot take every rank."""
    from autoshard.planning.baselines import baseline_pins, baseline_recompute, baselines_for
    from costmodel import Spec

    model = llama("tiny", n_heads=4, n_kv_heads=1)
    fsdp, _ = baseline_pins("fsdp", model, 2, (2, 2))
    pins, inputs = baseline_pins("fsdp_cp", model, 2, (2, 2))
    assert pins == fsdp and inputs == [Spec(("S(0)", "S(1)"))]
    assert baseline_pins("fsdp_cp_ac", model, 1, (4,))[1] == [Spec(("S(1)",))]
    assert baseline_recompute("fsdp_cp_ac") == "full" and baseline_recompute("fsdp_cp") == "none"
    assert "fsdp_cp" not in baselines_for(model)  # not a default seed
    world(4)
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    got = autoshard.compare(model, (x,), autoshard.fake_mesh((2, 2), ("dp", "cp")), baselines=["fsdp_cp"],
                            profile=SHARDING_PROFILE, loss_fn=_loss, memory_budget=None)
    plan = got["fsdp_cp"]
    assert plan.inputs == ["S(0)S(1)"], plan.inputs
    # By default where the batch cannot be split over every rank (2 sequences, 4 ranks), not where it can.
    for batch, want in ((2, True), (8, False)):
        planner = autoshard.Planner(model, (torch.randint(0, 256, (batch, 64)),),
                                    autoshard.fake_mesh((2, 2), ("dp", "cp")), profile=SHARDING_PROFILE)
        assert ("fsdp_cp" in planner.baseline_names()) is want
        assert ("fsdp_cp_ac" in planner.baseline_names()) is want
    assert got["autoshard"].summary["step_us"] <= plan.summary["step_us"] * (1 + 1e-9)


@contextlib.contextmanager
def _causal_kernels_restricted(monkeypatch, keep):
    """Only the causal kernels' strategies that `keep(node, ins, targs)` accepts (and those that
    leave the queries whole) while planning, so that a test runs the form of context parallelism
    it is about whichever form the test profile prices lower."""
    from autoshard.graph import strategies

    real = strategies.StrategyEnumerator._enumerate

    def restricted(self, node, targs, errors):
        out = real(self, node, targs, errors)
        if not attention.is_causal_cpu_kernel(node):
            return out
        return [st for st in out if not attention.query_axes(node, st.ins, targs) or keep(node, st.ins, targs)]

    strategies.clear_shared_cache()
    monkeypatch.setattr(strategies.StrategyEnumerator, "_enumerate", restricted)
    try:
        yield
    finally:
        # Later plans must not reuse the restricted strategies from the shared cache.
        strategies.clear_shared_cache()


def test_ring_attention_plan_matches_single_device(world, monkeypatch):
    """Ring attention (keys and values split like the queries, passed round the ring, partial
    results merged by their log-sum-exp, balanced by the mirror exchange) on CP 2 x DP 2: the
    single-device loss and gradients. The all-gather form is taken out of the strategies so
    that the plan runs the ring."""
    calls = []
    for name in ("ring_forward", "ring_backward"):
        fn = getattr(attention, name)
        monkeypatch.setattr(attention, name, lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k))
    with _causal_kernels_restricted(monkeypatch, attention.is_ring):
        model, x, plan = _cp_plan(world, (2, 2), ("dp", "cp"), 2, 64, "S(0)S(1)")
    keys = [e["in"][1 if "for_cpu_backward" not in e["op"] else 2] for e in plan.nodes.values()
            if "flash_attention_for_cpu" in e["op"]]
    assert keys and all("S(2)" in k for k in keys), keys
    assert plan.summary["attention"]["sequence"]["ring"] == 2
    assert "2 balanced by the mirror exchange, 2 ring attention" in plan.describe()
    _matches_single_device(model, x, plan, _loss)
    assert calls.count("ring_forward") == calls.count("ring_backward") == 8, calls


def test_hugging_face_llama_splits_its_sequence(world):
    """A Hugging Face LLaMA (its default attention: the causal fused kernel, positions built in
    its forward) planned with its tokens split by sequence on CP 2 x DP 2: the causal kernels
    split on the sequence, and the single-device loss and gradients."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                   intermediate_size=176, vocab_size=256, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))

    def loss_fn(out):
        return out.logits.float().pow(2).mean()

    world(4)
    plan = autoshard.plan(model, (x,), autoshard.fake_mesh((2, 2), ("dp", "cp")), profile=SHARDING_PROFILE,
                          loss_fn=loss_fn, memory_budget=None, seed_baselines=False, input_specs=["S(0)S(1)"])
    assert plan.summary["attention"]["sequence"]["kernels"] == 2, plan.summary["attention"]
    _matches_single_device(model, x, plan, loss_fn)
