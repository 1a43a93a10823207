"""Fused attention: the CPU kernel's sharding rules run right, its strategies, FLOPs and price."""

import pytest
import torch
import torch.nn.functional as F
from helpers import SHARDING_PROFILE, LocalTensorMode, full, local_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

import autoshard
from autoshard.graph.attention import attention_flops
from autoshard.graph.strategies import StrategyEnumerator
from autoshard.graph.tracing import trace
from autoshard.models import llama
from costmodel.compute import causal_share

FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _qkv(b=4, hq=4, hkv=2, s=8, e=16, mask=None):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, s, e, generator=g, requires_grad=True)
    k = torch.randn(b, hkv, s, e, generator=g, requires_grad=True)
    v = torch.randn(b, hkv, s, e, generator=g, requires_grad=True)
    return q, k, v


def _sdpa(q, k, v, mask, causal):
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


# (query/key/value placement, mask placement, causal); each on a 1-D mesh of 2 ranks.
CASES = [
    ("batch", Shard(0), Shard(0), True),
    ("heads", Shard(1), Replicate(), True),
    ("batch, mask", Shard(0), Shard(0), False),
    ("heads, mask", Shard(1), Shard(1), False),
    ("queries", Shard(2), Shard(2), False),
]


@pytest.mark.parametrize("name, qp, mp, causal", CASES, ids=[c[0] for c in CASES])
def test_cpu_kernel_rules_compute_the_single_device_result(world, name, qp, mp, causal):
    """DTensor runs the fused CPU kernel, forward and backward, on every placement its rule
    offers (grouped queries included): output and gradients equal the single-device ones."""
    world(2)
    q, k, v = _qkv()
    mask = None
    if "mask" in name or name == "queries":
        mask = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    ref = _sdpa(q, k, v, mask, causal)
    ref.square().sum().backward()
    kv_p = Replicate() if name == "queries" else qp
    with LocalTensorMode(2):
        mesh = local_mesh((2,), ("x",))
        dq = distribute_tensor(q.detach(), mesh, [qp]).requires_grad_()
        dk = distribute_tensor(k.detach(), mesh, [kv_p]).requires_grad_()
        dv = distribute_tensor(v.detach(), mesh, [kv_p]).requires_grad_()
        dm = None if mask is None else distribute_tensor(mask, mesh, [mp])
        out = _sdpa(dq, dk, dv, dm, causal)
        assert out.placements == (qp,)
        out.square().sum().backward()
        torch.testing.assert_close(full(out), ref.detach(), rtol=1e-5, atol=1e-5)
        for t, d in ((q, dq), (k, dk), (v, dv)):
            torch.testing.assert_close(full(d.grad), t.grad, rtol=1e-4, atol=1e-5)
        if name == "queries":  # each rank's queries reach every key: partial key gradients, summed
            assert isinstance(dk.grad.placements[0], (Partial, Replicate))


def _attention_node(tg, backward=False):
    want = "attention_for_cpu_backward.default" if backward else "attention_for_cpu.default"
    return next(n for n in tg.gm.graph.nodes if n.op == "call_function" and str(n.target).endswith(want))


def _strategy_specs(world, model, x, shape):
    world(int(torch.tensor(shape).prod()))
    mesh = autoshard.fake_mesh(shape, tuple("abc"[: len(shape)]))
    tg = trace(model, (x,))
    en = StrategyEnumerator(mesh)
    return tg, {b: {str(st.ins[0]) for st in en.for_node(_attention_node(tg, b)).strategies} for b in (False, True)}


def test_grouped_query_heads_are_split_only_evenly(world):
    """Query head h reads key head h // (Hq / Hkv): a head split is offered only where it splits
    both head counts into equal parts; batch splits always."""
    x = torch.randint(0, 256, (8, 16))
    even = llama("tiny", n_heads=4, n_kv_heads=2)  # 4 and 2 heads over 2 ranks: even
    _, specs = _strategy_specs(world, even, x, (2,))
    for backward in (False, True):
        assert {"S(0)", "S(1)"} <= specs[backward], specs[backward]
    uneven = llama("tiny", n_heads=4, n_kv_heads=2)  # 4 and 2 heads over 4 ranks: kv heads cannot follow
    _, specs = _strategy_specs(world, uneven, x, (4,))
    assert "S(0)" in specs[False] and "S(1)" not in specs[False]
    # A causal kernel's queries split on the sequence (context parallelism, tests/test_context.py)
    # only where the batch cannot take the axis: 8 sequences over 4 ranks can.
    assert "S(2)" not in specs[False]


def test_fused_attention_is_planned_not_replicated(world):
    """The reference LLaMA plans its fused attention with no fallback, and the FLOPs priced are
    the causal kernel's, the backward 2.5 times the forward."""
    world(4)
    model, x = llama("tiny"), torch.randint(0, 256, (8, 32))
    plan = autoshard.plan(model, (x,), autoshard.fake_mesh((2, 2), ("dp", "tp")), profile=SHARDING_PROFILE,
                          memory_budget=None)
    assert not any("attention" in op for op in plan.summary.get("fallback_ops", {})), plan.summary["fallback_ops"]
    assert any("attention" in op for op in (n.get("op", "") for n in plan.nodes.values()))
    att = plan.summary["attention"]
    assert att["kernels"] == 2 and sum(att["splits"].values()) == 2 and "kernel_shares" not in att
    assert "fused attention: 2 kernels, query split" in plan.describe()
    tg = trace(model, (x,))
    fwd, bwd = attention_flops(_attention_node(tg)), attention_flops(_attention_node(tg, True))
    b, h, s, e = 8, 4, 32, 16
    assert fwd == pytest.approx(4 * b * h * s * s * e * causal_share(s, s))
    assert bwd == pytest.approx(2.5 * fwd)


def test_causal_share():
    assert causal_share(4, 4) == pytest.approx(10 / 16)
    assert causal_share(1, 8) == pytest.approx(1 / 8)
    assert causal_share(8, 4) == pytest.approx((1 + 2 + 3 + 4 * 5) / 32)
    assert causal_share(4096, 4096) == pytest.approx(0.5, abs=1e-3)


def test_kernel_shares_price_fused_attention():
    """A fused kernel's FLOPs run at its share of the calibrated rate; other ops do not change."""
    from dataclasses import replace

    from costmodel import compute_time_us
    from costmodel.errors import CostModelError

    prof = replace(SHARDING_PROFILE, kernel_shares={"attention_forward": 0.5})
    big = 1e12
    assert compute_time_us(big, 0, prof, kernel="attention_forward") == pytest.approx(
        2 * compute_time_us(big, 0, SHARDING_PROFILE, kernel="attention_forward"))
    assert compute_time_us(big, 0, prof, kernel="attention_backward") == compute_time_us(big, 0, prof)
    assert "kernel_shares" not in SHARDING_PROFILE.to_json()  # absent when empty: digests kept
    with pytest.raises(CostModelError, match="kernel_shares must map kernels"):
        replace(SHARDING_PROFILE, kernel_shares={"softmax": 0.5})


def test_math_attention_option_keeps_the_scores(world):
    """``attention="math"`` traces matmul + softmax (the scores materialized)."""
    model = llama("tiny", attention="math")
    tg = trace(model, (torch.randint(0, 256, (2, 16)),))
    targets = {str(n.target) for n in tg.gm.graph.nodes}
    assert "aten._softmax.default" in targets and not any("attention" in t for t in targets)
    with pytest.raises(autoshard.ConfigError, match="attention: expected one of"):
        llama("tiny", attention="flash")


def test_cuda_kernels_compute_what_the_cpu_kernel_does():
    """The functions that run a traced CPU kernel on CUDA ranks: where flash cannot take the
    case (a mask, float32) SDPA runs and the backward recomputes; its output and gradients
    equal the CPU kernel's (run here on CPU tensors)."""
    from autoshard.graph import attention

    q, k, v = _qkv()
    mask = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    for m, causal in ((mask, False), (None, True)):
        out, lse = FWD(q, k, v, 0.0, causal, attn_mask=m)
        g = torch.randn_like(out)
        want = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            g, q, k, v, out, lse, 0.0, causal, attn_mask=m)
        got_out, _ = attention.cuda_forward(q, k, v, 0.0, causal, attn_mask=m)
        torch.testing.assert_close(got_out, out)
        got = attention.cuda_backward(g, q, k, v, out, lse, 0.0, causal, attn_mask=m)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with pytest.raises(NotImplementedError, match="dropout_p=0.1"):
        attention.cuda_forward(q, k, v, 0.1, True)


def test_cuda_flash_path_has_the_cpu_kernels_shapes():
    """On (fake) CUDA tensors in bf16 the flash kernel runs: grouped queries natively, outputs
    and gradients in the CPU kernel's shapes and dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autoshard.graph import attention

    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(2, 8, 16, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(2, 2, 16, 64, device="cuda", dtype=torch.bfloat16)
        assert attention.flash_fits(q, k, None, True)
        out, lse = attention.cuda_forward(q, k, k, 0.0, True)
        assert out.shape == q.shape and lse.shape == (2, 8, 16) and lse.dtype == torch.float32
        dq, dk, dv = attention.cuda_backward(out, q, k, k, out, lse, 0.0, True)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
    assert attention.device_kernel(FWD, "cpu") is None
    assert attention.device_kernel(FWD, "cuda") is attention.cuda_forward


def test_lowered_programs_run_another_devices_kernel_as_planned(world, monkeypatch):
    """A mesh whose device runs another kernel (CUDA) runs each rank's shards through it, its
    outputs in the planned placements: stood in here by the CUDA functions' SDPA path on CPU
    ranks, the plan's loss and gradients equal single device."""
    from helpers import assert_plan_matches_single_device

    from autoshard.graph import attention

    world(4)
    calls = []

    def counted(fn):
        def run(*args, **kwargs):
            calls.append(fn.__name__)
            return fn(*args, **kwargs)
        return run

    kernels = {attention.CPU_FORWARD: counted(attention.cuda_forward),
               attention.CPU_BACKWARD: counted(attention.cuda_backward)}
    monkeypatch.setattr(attention, "device_kernel", lambda target, device_type: kernels.get(target))
    model, x = llama("tiny", n_heads=4, n_kv_heads=2), torch.randint(0, 256, (8, 32))

    def loss_fn(out):
        return out.float().pow(2).mean()

    plan = autoshard.plan(model, (x,), autoshard.fake_mesh((2, 2), ("dp", "tp")), profile=SHARDING_PROFILE,
                          loss_fn=loss_fn, memory_budget=None, seed_baselines=False,
                          pins={"layers.*.attn.wq": "RS(0)", "layers.*.attn.wk": "RS(0)", "layers.*.attn.wv": "RS(0)"})
    assert_plan_matches_single_device(model, (x,), plan, (2, 2), ("dp", "tp"), loss_fn)
    # Each layer's forward and backward, lowered once per rank.
    assert calls.count("cuda_forward") == calls.count("cuda_backward") == 2 * 4, calls


def test_flex_attention_is_refused_with_what_is_missing():
    """FlexAttention's backward has no CPU or meta implementation in this torch: the trace fails
    with an error that says so and names the fused SDPA form to plan instead."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    class Flex(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(64, 64)

        def forward(self, x):
            b, n, d = x.shape
            q = self.w(x).view(b, n, 4, 16).transpose(1, 2)
            mask = create_block_mask(lambda b_, h, i, j: i >= j, None, None, n, n, device=x.device)
            return flex_attention(q, q, q, block_mask=mask).transpose(1, 2).reshape(b, n, d)

    with pytest.raises(autoshard.TraceError, match="FlexAttention cannot be planned .* F.scaled_dot_product_attention"):
        trace(Flex(), (torch.randn(2, 128, 64),))
