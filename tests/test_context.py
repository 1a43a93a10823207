"""Context parallelism (all-gather form): causal attention split on the sequence is planned,
priced at its busiest rank and runs to the single-device loss and gradients."""

import copy

import pytest
import torch
from helpers import SHARDING_PROFILE, LocalTensorMode, full, local_mesh, reference_step

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


def _cp_plan(world, shape, names, batch, seq, input_spec, **kw):
    world(int(torch.tensor(shape).prod()))
    # One key head: a head split over 2 ranks cannot split it evenly, so the sequence is split.
    model = llama("tiny", n_heads=4, n_kv_heads=1, max_seq_len=seq)
    x = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    plan = autoshard.plan(model, (x,), autoshard.fake_mesh(shape, names), profile=SHARDING_PROFILE, loss_fn=_loss,
                          memory_budget=None, seed_baselines=False, input_specs=[input_spec], **kw)
    return model, x, plan


def test_context_parallel_plan_matches_single_device(world):
    """CP 2 x DP 2 on LocalTensorMode: a plan that splits the causal kernels' queries on the
    sequence gives the single-device loss and gradients."""
    model, x, plan = _cp_plan(world, (2, 2), ("dp", "cp"), 2, 64, "S(0)S(1)")
    specs = _query_specs(plan)
    assert specs and all("S(2)" in s for s in specs), specs
    ref_loss, ref_grads = reference_step(copy.deepcopy(model), (x,), _loss)
    with LocalTensorMode(4):
        sharded = autoshard.parallelize(copy.deepcopy(model), plan, local_mesh((2, 2), ("dp", "cp")))
        loss = _loss(sharded(x))
        loss.backward()
        torch.testing.assert_close(full(loss), ref_loss, rtol=1e-5, atol=1e-6)
        for fqn, p in sharded.named_parameters():
            torch.testing.assert_close(full(p.grad), ref_grads[fqn], rtol=1e-4, atol=1e-5, msg=fqn)
