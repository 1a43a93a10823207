"""Long context: our plan against FSDP with context parallelism and FSDP with full recomputation.

    python benchmarks/long_context.py [--cases 32768:8,65536:8,131072:8,131072:64] [--cp 1,2,4,8]
                                      [--budget-gib 80] [--profile h100-sxm] [--time-limit 30]

LLaMA-3-8B shapes in bfloat16 (meta device, FLOPs priced in bf16), per case ``seq:ranks`` and
per context-parallel degree ``c`` (dividing the ranks): global batch ``ranks / c`` sequences on
the mesh ``(ranks / c, c)`` named ``(dp, cp)`` (``(ranks,)`` named ``dp`` for ``c = 1``, ``cp`` for
``c = ranks``), ``--budget-gib`` per
rank, three plans:

- ``ours``: the solver alone (no hand-written seeds), every option at its default (it chooses
  the recomputation);
- ``fsdp_cp``: torchtitan's FSDP + CP, every parameter sharded over all ranks, the tokens split
  by batch over ``dp`` and by sequence over ``cp``; the rest (attention's split included) the
  solver's best completion; the better of selective and full recomputation;
- ``fsdp_ac`` (``c = 1`` only): FSDP with full recomputation, the batch over every rank.

Per row: each plan's predicted step (ms), peak per rank (GiB), planning seconds, how ours
splits attention and the sequence; "infeasible" where no plan of that kind fits the budget
(with the smallest budget that would). The ratio per row is ours / the best hand-written plan
that fits. Last line: ``worst ratio=<max over rows>`` and the slowest plan's seconds.
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


def _mesh(ranks: int, cp: int):
    if dist.is_initialized():
        dist.destroy_process_group()
    if cp == 1:
        return autoshard.fake_mesh((ranks,), ("dp",))
    if cp == ranks:
        return autoshard.fake_mesh((ranks,), ("cp",))
    return autoshard.fake_mesh((ranks // cp, cp), ("dp", "cp"))


def _plan(model, tokens, mesh, args, **kw):
    t0 = time.perf_counter()
    try:
        plan = autoshard.plan(model, (tokens,), mesh, profile=args.profile, memory_budget=int(args.budget_gib * 2**30),
                              compute_dtype="bfloat16", seed_baselines=False, time_limit=args.time_limit, **kw)
    except Exception as exc:  # an infeasible budget: said with the budget that would fit
        text = str(exc).splitlines()[0]
        if "budget" not in text and "infeasible" not in text.lower():
            raise
        return None, time.perf_counter() - t0, text
    return plan, time.perf_counter() - t0, ""


def _splits(plan) -> str:
    """How a plan splits attention (its query's spec, most kernels) and the tokens."""
    att = plan.summary.get("attention", {})
    splits = att.get("splits", {})
    query = max(splits, key=splits.get) if splits else "-"
    seq = att.get("sequence")
    cp = f", CP {seq['kernels']} kernels ({seq['balanced']} balanced, {seq['ring']} ring)" if seq else ""
    return f"attention q {query}{cp}, tokens {plan.inputs[0] if plan.inputs else '?'}"


def _fmt(name, plan, seconds, why) -> str:
    if plan is None:
        return f"{name}: infeasible ({why[:90]}) [{seconds:.1f}s]"
    s = plan.summary
    return (f"{name}: {s['step_us'] / 1e3:9.1f} ms {s['peak_mem_bytes'] / 2**30:6.1f} GiB "
            f"AC {(s.get('recompute') or {}).get('mode', 'none')} ({_splits(plan)}) [{seconds:.1f}s]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="32768:8,65536:8,131072:8,131072:64", help="seq:ranks, comma-separated")
    ap.add_argument("--cp", default="1,2,4,8", help="context-parallel degrees")
    ap.add_argument("--model", default="8b", help="LLaMA preset")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument("--profile", default="h100-sxm")
    ap.add_argument("--budget-gib", type=float, default=80.0)
    ap.add_argument("--time-limit", type=float, default=30.0)
    args = ap.parse_args()
    degrees = [int(c) for c in args.cp.split(",")]
    print(f"LLaMA-{args.model} shapes, bf16, {args.profile}, budget {args.budget_gib:.0f} GiB per rank", flush=True)
    worst, slowest = 0.0, 0.0
    for case in args.cases.split(","):
        seq, ranks = (int(v) for v in case.split(":"))
        over = {} if args.layers is None else {"n_layers": args.layers}
        with torch.device("meta"):
            model = llama(args.model, max_seq_len=seq, **over).to(torch.bfloat16)
        for cp in degrees:
            if ranks % cp:
                continue
            batch = ranks // cp
            tokens = torch.empty(batch, seq, dtype=torch.long, device="meta")
            mesh = _mesh(ranks, cp)
            ours = _plan(model, tokens, mesh, args)
            shape = tuple(mesh.shape)
            hand = {}
            if cp > 1:
                pins, (tokens_spec,) = baseline_pins("fsdp_cp", model, len(shape), shape)
                best = None
                # torchtitan's long-context runs use selective or full (fsdp_cp_ac) checkpointing.
                for rc in ("selective", "full"):
                    got = _plan(model, tokens, mesh, args, pins=pins, input_specs=[tokens_spec], recompute=rc)
                    if best is None or (got[0] is not None and (
                            best[0] is None or got[0].summary["step_us"] < best[0].summary["step_us"])):
                        best = got
                hand["fsdp_cp"] = best
            else:
                pins, _ = baseline_pins("fsdp", model, len(shape), shape)
                hand["fsdp_ac"] = _plan(model, tokens, mesh, args, pins=pins, input_specs=["S(0)"], recompute="full")
            slowest = max([slowest, ours[1]] + [h[1] for h in hand.values()])
            fits = [h[0].summary["step_us"] for h in hand.values() if h[0] is not None]
            if ours[0] is None:
                ratio = float("inf") if fits else float("nan")
            else:
                ratio = ours[0].summary["step_us"] / min(fits) if fits else 0.0
            if ratio == ratio:  # not NaN: some plan fits
                worst = max(worst, ratio)
            cells = [_fmt("ours", *ours)] + [_fmt(k, *v) for k, v in hand.items()]
            print(f"seq {seq:6d} ranks {ranks:3d} cp {cp} batch {batch:3d}  " + "  |  ".join(cells)
                  + f"  ratio {ratio:.3f}", flush=True)
    print(f"worst ratio={worst:.3f} slowest plan {slowest:.1f}s")


if __name__ == "__main__":
    main()
