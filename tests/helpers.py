"""Shared pieces of the tests: a profile where sharding pays, and numerics checks."""

import math

import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from costmodel import LinkModel, Profile

# Slow compute and fast links: on toy models the planner then shards work
# instead of replicating it, so the numerics tests exercise real shardings.
SHARDING_PROFILE = Profile(
    name="test-slow-compute",
    device="test",
    peak_tflops=1e-6,
    mem_bandwidth_gbps=1.0,
    memory_bytes=2**34,
    devices_per_node=8,
    intra_node=LinkModel(latency_us=1.0, busbw_gbps=1000.0),
    inter_node=LinkModel(latency_us=1.0, busbw_gbps=1000.0),
    compute_efficiency=1.0,
    kernel_launch_us=0.0,
)


def full(t):
    """A DTensor (possibly of LocalTensors) as one plain tensor."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    rec = getattr(t, "reconcile", None)
    return rec() if rec is not None else t


def local_mesh(shape, names):
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def reference_step(model, inputs, loss_fn):
    model.zero_grad()
    loss = loss_fn(model(*inputs))
    loss.backward()
    return loss.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def assert_plan_matches_single_device(model, inputs, plan, shape, names, loss_fn):
    """``plan`` on a LocalTensorMode mesh of ``shape``: the single-device loss and gradients."""
    import copy

    import autoshard

    ref_loss, ref_grads = reference_step(copy.deepcopy(model), inputs, loss_fn)
    with LocalTensorMode(math.prod(shape)):
        sharded = autoshard.parallelize(copy.deepcopy(model), plan, local_mesh(shape, names))
        loss = loss_fn(sharded(*inputs))
        loss.backward()
        torch.testing.assert_close(full(loss), ref_loss, rtol=1e-5, atol=1e-6)
        for fqn, p in sharded.named_parameters():
            torch.testing.assert_close(full(p.grad), ref_grads[fqn], rtol=1e-4, atol=1e-5, msg=fqn)


__all__ = ["SHARDING_PROFILE", "LocalTensorMode", "assert_plan_matches_single_device", "full", "local_mesh",
           "reference_step"]


def lift_replicated_locals(model, mode):
    """Give every parameter a per-rank local tensor under LocalTensorMode.

    ``distribute_tensor`` with only Replicate placements keeps the plain tensor as the
    local shard; under LocalTensorMode an in-place optimizer update of that shared
    tensor with per-rank values is then applied once per rank (a harness artefact:
    on real processes every rank owns its copy). Cloning it per rank restores that.
    """
    from torch.distributed._local_tensor import LocalTensor

    for p in model.parameters():
        if isinstance(p, DTensor) and not isinstance(p._local_tensor, LocalTensor):
            plain = p._local_tensor.detach()
            p._local_tensor = mode.rank_map(lambda _r, t=plain: t.clone())


def reference_adamw(model, inputs, loss_fn, steps: int = 3, lr: float = 1e-2):
    """Single-device AdamW: (losses per step, grads of the last step by FQN)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, grads = [], {}
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(*inputs))
        loss.backward()
        losses.append(loss.item())
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
    return losses, grads


def spy_on_starts(monkeypatch) -> list[list[str]]:
    """``solver.solve`` watched: per call from then on, the names of the starts it was given."""
    import solver

    given: list[list[str]] = []
    real = solver.solve

    def spy(problem, *args, starts=(), **kwargs):
        given.append([name for name, _ in starts])
        return real(problem, *args, starts=starts, **kwargs)

    monkeypatch.setattr(solver, "solve", spy)
    return given


def spy_on_solves(monkeypatch, planner) -> list:
    """``planner._solve_once`` watched: the options of each solve it makes from then on (its own
    and its hand-written plans')."""
    solved: list = []
    real = planner._solve_once

    def spy(opts, *args, **kwargs):
        solved.append(opts)
        return real(opts, *args, **kwargs)

    monkeypatch.setattr(planner, "_solve_once", spy)
    return solved


def tiny_llama_on_2x2():
    """A small LLaMA, its batch and a fake (2, 2) mesh (dp, tp): the planner tests' workload."""
    import autoshard
    from autoshard.models import llama

    torch.manual_seed(0)
    model = llama("tiny", dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=344, vocab_size=512, max_seq_len=64)
    return model, (torch.randint(0, 512, (16, 64)),), autoshard.fake_mesh((2, 2), ("dp", "tp"))
