"""Predicted peak memory of long sequences: fused attention against the math path.

    python benchmarks/attention_memory.py [--seqs 2048,4096,8192,16384] [--batch 16] [--mesh 8]
                                          [--budget-gib 90] [--no-math]

LLaMA-8B shapes (meta device, ``--dtype``, FLOPs priced in bf16) with global batch
``--batch`` on a fake mesh of ``--mesh`` ranks, FSDP pins (every parameter sharded on all
ranks, the batch split) and selective recomputation (the layers keep the outputs of their
matmuls and attention, recompute the rest), planned with no budget so that the predicted peak
is the plan's own, for each sequence length: once with the reference model's fused attention
(``attention="sdpa"``, the kernel people train with) and once with the same attention written
as matmul + softmax (``attention="math"``, whose scores are batch x heads x seq x seq).

Per sequence: each path's predicted peak per device (GiB) and step (ms), and the growth of the
fused path's peak over the previous sequence's. torchtitan's published figure for the same
configuration (LLaMA-3-8B, 8 H100s, FSDP, selective AC, local batch 2, sequence 8192) is a
measured 82.4 GiB peak (bf16 activations over float32 master weights: the default ``--dtype
bfloat16`` matches its activations and counts its parameter state at half its bytes, about 7.5
GiB per rank less; ``--dtype float32`` doubles the activations).
Last line: ``fits=<bool> ratio=<fused peak at --fit-seq> / <budget>``; the fused path must fit.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoshard  # noqa: E402
from autoshard.models import llama  # noqa: E402
from autoshard.planning.baselines import baseline_pins  # noqa: E402


def _plan(attention: str, seq: int, batch: int, ranks: int, args):
    if dist.is_initialized():
        dist.destroy_process_group()
    mesh = autoshard.fake_mesh((ranks,), ("dp",))
    with torch.device("meta"):
        model = llama(args.model, max_seq_len=seq, attention=attention).to(getattr(torch, args.dtype))
    tokens = torch.empty(batch, seq, dtype=torch.long, device="meta")
    pins, inputs = baseline_pins("fsdp", model, 1, (ranks,))
    t0 = time.perf_counter()
    plan = autoshard.plan(model, (tokens,), mesh, profile=args.profile, memory_budget=None, pins=pins,
                          input_specs=inputs, recompute="selective", compute_dtype="bfloat16",
                          seed_baselines=False, time_limit=args.time_limit)
    return plan, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="8b", help="LLaMA preset")
    ap.add_argument("--seqs", default="2048,4096,8192,16384")
    ap.add_argument("--batch", type=int, default=16, help="global batch")
    ap.add_argument("--mesh", type=int, default=8, help="ranks (one axis)")
    ap.add_argument("--profile", default="h100-sxm")
    ap.add_argument("--budget-gib", type=float, default=90.0)
    ap.add_argument("--fit-seq", type=int, default=8192, help="the sequence whose fused peak must fit the budget")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--dtype", default="bfloat16",
                    help="the model's dtype: bfloat16 (activations as mixed precision keeps them; parameters, "
                         "gradients and optimizer state then count 2 bytes, not fp32 master weights' 4) or float32")
    ap.add_argument("--no-math", action="store_true", help="plan the fused path alone")
    args = ap.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    paths = ["sdpa"] if args.no_math else ["sdpa", "math"]
    print(f"LLaMA-{args.model} shapes in {args.dtype}, global batch {args.batch} on ({args.mesh},), FSDP, "
          f"selective recompute, {args.profile}", flush=True)
    fused_peak: dict[int, float] = {}
    prev = None
    for seq in seqs:
        cells = []
        for attention in paths:
            plan, seconds = _plan(attention, seq, args.batch, args.mesh, args)
            s = plan.summary
            peak = s["peak_mem_bytes"] / 2**30
            if attention == "sdpa":
                fused_peak[seq] = peak
            cells.append(f"{attention}: peak {peak:8.1f} GiB step {s['step_us'] / 1e3:9.1f} ms [{seconds:.0f}s]")
        growth = "" if prev is None else f"  fused peak x{fused_peak[seq] / fused_peak[prev]:.2f} for x{seq / prev:.0f}"
        print(f"seq {seq:6d}  " + "  |  ".join(cells) + growth, flush=True)
        prev = seq
    at = fused_peak.get(args.fit_seq)
    if at is None:
        print(f"fits=unknown (sequence {args.fit_seq} not planned)")
        return
    print(f"fits={at <= args.budget_gib} ratio={at / args.budget_gib:.3f} "
          f"(fused peak {at:.1f} GiB at sequence {args.fit_seq} / budget {args.budget_gib:.0f} GiB)")


if __name__ == "__main__":
    main()
