"""Measured training step on 4 gloo processes: our plan against DDP and FSDP, same run.

    python benchmarks/train_step.py            # spawns torchrun --nproc-per-node 4 itself

A small LLaMA-style model (dim 256, 2 layers, 8 heads / 4 KV heads, vocab 2048,
batch 16 x 128) trains with AdamW on the same batches three ways on a 4-rank
``dp`` mesh: our plan (planned on rank 0 with the measured ``cpu-gloo`` profile,
applied with ``autoshard.parallelize``: the model's forward and ``loss.backward()`` run the
plan's lowered per-rank programs, one collective per planned step; ``autoshard (replay)``:
the reference interpreter ``autoshard.PlannedStep``, op by op through DTensor, gradient
all-reduces bucketed and overlapped), ``DistributedDataParallel`` and FSDP2
(``fully_shard`` per block and at the root). Per method: median step time over
the timed steps and bytes handed to collectives per step (a dispatch mode that
sums the tensors of every c10d / functional collective). Last line: our step time
/ the best baseline's.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WARMUP, STEPS = 2, 6
CFG = dict(dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=688, vocab_size=2048, max_seq_len=128)
BATCH, SEQ = 16, 128


class CommBytes(TorchDispatchMode):
    """Sums the bytes of tensors passed to collectives (c10d and functional collective ops)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns = getattr(func, "namespace", "")
        # wait_tensor and _wrap_tensor_autograd follow each functional collective: not collectives.
        if ns in ("c10d", "_c10d_functional") and not any(w in func.__name__ for w in ("wait", "wrap")):
            seen = []
            torch.utils._pytree.tree_map(lambda t: seen.append(t) if isinstance(t, torch.Tensor) else None,
                                         (args, kwargs or {}))
            self.bytes += sum(t.numel() * t.element_size() for t in seen[:1] or seen)
            self.calls += 1
        return func(*args, **(kwargs or {}))


def loss_fn(logits):
    return logits.float().pow(2).mean()


def build():
    from autoshard.models import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(**CFG))


def data():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, CFG["vocab_size"], (BATCH, SEQ), generator=g) for _ in range(WARMUP + STEPS)]


def run(model, batches, local_batch, planned=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times, comm = [], CommBytes()
    for k, tokens in enumerate(batches):
        x = local_batch(tokens)
        dist.barrier()
        t0 = time.perf_counter()
        mode = comm if k == WARMUP else None  # bytes of one steady-state step
        if mode is not None:
            mode.__enter__()
        try:
            if planned is not None:
                loss = planned(x)  # forward + backward as planned; sets .grad
            else:
                loss = loss_fn(model(x))
                loss.backward()
            opt.step()
            opt.zero_grad()
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)
        dist.barrier()
        if k >= WARMUP:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), comm.bytes, comm.calls


def worker() -> None:
    import autoshard
    from autoshard.plan import Plan
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    batches = data()
    shard = BATCH // world
    results = {}

    box = [None]
    if rank == 0:
        t0 = time.perf_counter()
        plan = autoshard.plan(build(), (batches[0],), mesh, profile="cpu-gloo", loss_fn=loss_fn)
        print(f"planned in {time.perf_counter() - t0:.1f}s: predicted step {plan.summary['step_us'] / 1e3:.1f} ms; "
              f"inputs {plan.inputs}; sharded params "
              f"{sum('S(' in str(plan.param_spec(f)) for f in plan.params)}/{len(plan.params)}", flush=True)
        box[0] = plan.to_json()
    dist.broadcast_object_list(box, src=0)
    plan = Plan.from_json(box[0])
    t0 = time.perf_counter()
    ours = autoshard.parallelize(build(), plan, mesh)
    ours(batches[0])  # lowers the forward; the first step below lowers the backward (warm-up)
    if rank == 0:
        program = next(iter(ours.forward.programs.values()))
        fwd, bwd = program.forward_program(rank).gm, program.backward_program(rank).gm
        print(f"lowered in {time.perf_counter() - t0:.1f}s: forward {len(fwd.graph.nodes)} nodes, backward "
              f"{len(bwd.graph.nodes)} nodes; collectives {program.collective_counts(rank)}", flush=True)
    results["autoshard"] = run(ours, batches, lambda t: t)
    replayed = autoshard.parallelize(build(), plan, mesh)
    step = autoshard.PlannedStep(replayed, plan, mesh, (batches[0],), loss_fn, profile="cpu-gloo")
    results["autoshard (replay)"] = run(replayed, batches, lambda t: t, planned=step)

    ddp = DistributedDataParallel(build())
    results["ddp"] = run(ddp, batches, lambda t: t[rank * shard:(rank + 1) * shard])

    fsdp = build()
    for layer in fsdp.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    results["fsdp"] = run(fsdp, batches, lambda t: t[rank * shard:(rank + 1) * shard])

    if rank == 0:
        for name, (sec, nbytes, calls) in results.items():
            print(f"{name:18s} step {sec * 1e3:8.1f} ms   collectives/step {calls:4d}   bytes/step {nbytes / 2**20:8.2f} MiB")
        best = min(("ddp", "fsdp"), key=lambda k: results[k][0])
        for k in ("ddp", "fsdp"):
            print(f"ours/{k}: step time {results['autoshard'][0] / results[k][0]:.3f}, "
                  f"bytes {results['autoshard'][1] / max(results[k][1], 1):.3f}")
        print(f"ours / best baseline ({best}) step time: {results['autoshard'][0] / results[best][0]:.3f}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    if "RANK" in os.environ:
        worker()
        return
    from costmodel.calibrate import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
           __file__]
    sys.exit(subprocess.call(cmd))


if __name__ == "__main__":
    main()
