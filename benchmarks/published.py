"""Predicted against published: torchtitan's measured FSDP training throughput and memory.

    python benchmarks/published.py [--cases NAME,...] [--time-limit 60]

Each case is a run torchtitan published (bf16 compute with float32 master weights, FSDP2 over every
rank, torch's SDPA flash attention, no torch.compile, no Float8: the configurations the cost model
claims to price), planned here as it was run: the model's shapes, the global batch and sequence,
FSDP's parameter splits pinned (``baseline_pins("fsdp")``: every parameter split over all ranks,
the batch over all ranks), its activation checkpointing (torchtitan's "selective" as our
``selective`` mode, "full" as ``full``), on the profile of its GPUs, in the memory the run had
(its published reading, else its GPU's, less the float32 master state below). Per case:
the predicted step (ms) and tokens per second per GPU against the published TPS/GPU, and the
predicted peak against the published memory where one was given (torchtitan's reading of the
allocator's reserved peak, fragmentation included, so the prediction should lie below it). The
model is planned in bf16, as FSDP2's mixed precision runs it (weights gathered, activations kept
and FLOPs in bf16); the float32 master weights, gradients and Adam states the run keeps per shard
are added to the predicted peak (8 bytes per parameter per rank beyond the bf16 model's).

The published runs, with their sources (public; figures copied, hardware as stated there):

- ``h100-8b-8``, ``h100-8b-128``: Llama 3.1 8B, 8 and 128 H100, local batch 2, sequence 8192,
  selective AC: 5,762 and 5,605 TPS/GPU, 82.4 and 67.0 GiB (torchtitan,
  ``benchmarks/llama3_h100_202412_torchtitan.md``, tables 1 and 3, rows "FSDP"). Their H100s are
  96 GB HBM2e at a 500 W limit, "between SXM and NVL" in peak FLOP/s: the ``h100-sxm`` profile
  (989 TFLOP/s, 3.35 TB/s) is faster hardware, so the prediction should be above the measurement.
- ``a100-8b-64``: Llama 3 8B, 64 A100 80 GB, local batch 1, sequence 8192, selective (op) AC:
  2,973 TPS/GPU; ``a100-70b-64``: Llama 3 70B, full AC, local batch 1: 331 TPS/GPU;
  ``a100-l2-13b-64``: Llama 2 13B (sequence 4096), local batch 2, no AC: 2,162 TPS/GPU;
  ``a100-l2-70b-64``: Llama 2 70B, local batch 2, full AC: 353 TPS/GPU (torchtitan,
  ``docs/performance.md`` as of 2024, on the ``a100-sxm`` profile).

A run with no published memory fit in its GPU: a predicted peak above the GPU's memory is wrong
there, and so is a plan that finds no way to fit (printed as such). The line before the last
counts both. Last line:
``median |predicted/published - 1| X, worst Y (case)`` over the throughputs, the measure of how
far a predicted step can be trusted on the hardware profiles as shipped (uncalibrated;
``autoshard calibrate`` on the cluster replaces them).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoshard  # noqa: E402
from autoshard.errors import MemoryBudgetError  # noqa: E402
from autoshard.models import llama  # noqa: E402
from autoshard.planning.baselines import baseline_pins  # noqa: E402
from costmodel import load_profile  # noqa: E402

#: Llama 2's shapes (Llama 3's are the presets): 32000-token vocabulary.
LLAMA2_13B = dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824, vocab_size=32000)
LLAMA2_70B = dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=32000)


@dataclass(frozen=True)
class Published:
    """One published run: what was trained, on what, and what was measured."""

    preset: str
    overrides: tuple
    ranks: int
    local_batch: int
    seq: int
    recompute: str
    profile: str
    tps_per_gpu: float
    memory_gib: float | None
    source: str


CASES = {
    "h100-8b-8": Published("8b", (), 8, 2, 8192, "selective", "h100-sxm", 5762, 82.4,
                           "torchtitan benchmarks/llama3_h100_202412_torchtitan.md table 1"),
    "h100-8b-128": Published("8b", (), 128, 2, 8192, "selective", "h100-sxm", 5605, 67.0,
                             "torchtitan benchmarks/llama3_h100_202412_torchtitan.md table 3"),
    "a100-8b-64": Published("8b", (), 64, 1, 8192, "selective", "a100-sxm", 2973, None,
                            "torchtitan docs/performance.md (2024), Llama 3 8B, selective op"),
    "a100-70b-64": Published("70b", (), 64, 1, 8192, "full", "a100-sxm", 331, None,
                             "torchtitan docs/performance.md (2024), Llama 3 70B, full"),
    "a100-l2-13b-64": Published("8b", tuple(LLAMA2_13B.items()), 64, 2, 4096, "none", "a100-sxm", 2162, None,
                                "torchtitan docs/performance.md (2024), Llama 2 13B, no AC"),
    "a100-l2-70b-64": Published("70b", tuple(LLAMA2_70B.items()), 64, 2, 4096, "full", "a100-sxm", 353, None,
                                "torchtitan docs/performance.md (2024), Llama 2 70B, full"),
}


def fit_gib(case: Published) -> float:
    """What the run fit in, GiB: its published reading, else its GPU's memory."""
    return case.memory_gib or load_profile(case.profile).memory_bytes / 2**30


def predict(case: Published, time_limit: float) -> dict:
    """The published run planned as it was run: its predicted step, TPS/GPU and peak."""
    if dist.is_initialized():
        dist.destroy_process_group()
    mesh = autoshard.fake_mesh((case.ranks,), ("dp",))
    with torch.device("meta"):
        # In bf16, as FSDP2's mixed precision gathers the weights and computes (param_dtype):
        # activations, gathers and FLOPs as run. The float32 master weights, gradients and Adam
        # states it keeps beside them are added to the peak below.
        model = llama(case.preset, max_seq_len=case.seq, **dict(case.overrides)).to(torch.bfloat16)
    tokens = torch.empty(case.local_batch * case.ranks, case.seq, dtype=torch.long, device="meta")
    pins, inputs = baseline_pins("fsdp", model, 1, (case.ranks,))
    # Per parameter of this rank's shard: float32 weight, gradient and two Adam moments (16
    # bytes) where the bf16 model counted 8.
    master = 8 * sum(p.numel() for p in model.parameters()) / case.ranks
    # Planned in the memory the run had (its GPU's, less the master state the bf16 model does not
    # count): where the gathered weights do not all fit beside the activations, the plan gathers
    # them again in the backward, as FSDP2 does (``reshard_after_forward``).
    budget = fit_gib(case) * 2**30 - master
    t0 = time.perf_counter()
    plan = autoshard.plan(model, (tokens,), mesh, profile=case.profile, memory_budget=budget,
                          recompute=case.recompute, pins=pins, input_specs=inputs, seed_baselines=False,
                          time_limit=time_limit)
    step_s = plan.summary["step_us"] / 1e6
    return {"step_ms": step_s * 1e3, "tps": case.local_batch * case.seq / step_s,
            "peak_gib": (plan.summary["peak_mem_bytes"] + master) / 2**30, "seconds": time.perf_counter() - t0,
            "compute_ms": plan.summary["compute_us"] / 1e3,
            "exposed_ms": plan.summary["simulated"]["exposed_comm_us"] / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {sorted(CASES)}")
    ap.add_argument("--time-limit", type=float, default=60.0)
    args = ap.parse_args()
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; expected some of {sorted(CASES)}")
    errors, over = {}, []
    for name in names:
        case = CASES[name]
        fit = fit_gib(case)
        try:
            got = predict(case, args.time_limit)
        except MemoryBudgetError as exc:
            # The run fit; we say it cannot: a memory error of ours, counted and shown.
            print(f"{name:15s} does not fit in {fit:.1f} GiB by our account: {str(exc).splitlines()[0]}")
            over.append(name)
            continue
        ratio = got["tps"] / case.tps_per_gpu
        errors[name] = abs(ratio - 1)
        if got["peak_gib"] > fit:
            over.append(name)
        what = "reserved" if case.memory_gib else "on the GPU"
        memory = f"peak {got['peak_gib']:.1f} GiB against {fit:.1f} {what} ({got['peak_gib'] / fit:.3f})"
        print(f"{name:15s} {case.ranks:4d} x {case.profile:9s} batch {case.local_batch} x {case.seq} AC "
              f"{case.recompute:9s}: step {got['step_ms']:8.1f} ms (compute {got['compute_ms']:.1f}, exposed "
              f"{got['exposed_ms']:.1f}), {got['tps']:7.0f} TPS/GPU against {case.tps_per_gpu:5.0f} published "
              f"({ratio:.3f}); {memory} [{got['seconds']:.1f}s] ({case.source})", flush=True)
    worst = max(errors, key=errors.get)
    print(f"memory: {len(over)} of {len(names)} predicted above what the run fit in {over}")
    print(f"median |predicted/published - 1| {statistics.median(errors.values()):.3f}, worst "
          f"{errors[worst]:.3f} ({worst})")


if __name__ == "__main__":
    main()
