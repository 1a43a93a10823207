"""Pipelined plans against the best plan without a pipeline, predicted, LLaMA-3 shapes.

    python benchmarks/pipeline.py [--cases 70b:8x8x8:32,405b:8x16x8:32] [--time-limit 60] [--schedule 1f1b]

A case ``MODEL:AxBxC:M`` plans the model (meta device, h100-sxm, bf16 pricing, the device's
memory less its reserve as the budget) twice, each in a process of its own: without a
pipeline on the mesh (A, B, C) (axes ``rep, dp, tp``), and pipelined over an axis of size A with
the stages planned on (B, C) (axes ``pp, dp, tp``), ``M`` microbatches. Global batch as in
``plan_time.py`` (70B: 512 x 2048, 405B: 1024 x 2048, 8B: 64 x 2048). Prints per case both
predicted steps, the pipelined plan's stage table, both planning times and the ratio
pipelined / without; the last line is the worst ratio (below 1: the pipeline pays in every case).
A pipelined plan that cannot meet the budget counts as infinitely slow.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BATCH = {"8b": 64, "70b": 512, "405b": 1024}


def run_one(case: str, pipelined: bool, time_limit: float, schedule: str) -> dict:
    import torch

    import autoshard
    from autoshard.errors import MemoryBudgetError
    from autoshard.models import llama
    from autoshard.planning.pipeline import plan_pipeline

    name, shape_text, m = case.split(":")
    shape = tuple(int(x) for x in shape_text.split("x"))
    with torch.device("meta"):
        model = llama(name)
    tokens = torch.empty(BATCH[name], 2048, dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    if not pipelined:
        mesh = autoshard.fake_mesh(shape, ("rep", "dp", "tp"))
        plan = autoshard.plan(model, (tokens,), mesh, profile="h100-sxm", compute_dtype="bfloat16",
                              time_limit=time_limit)
        return {"step_ms": plan.summary["step_us"] / 1e3, "seconds": time.perf_counter() - t0,
                "recompute": plan.recompute.get("mode")}
    mesh = autoshard.fake_mesh(shape, ("pp", "dp", "tp"))
    try:
        pp = plan_pipeline(model, (tokens,), mesh, axis="pp", microbatches=int(m), schedule=schedule,
                           profile="h100-sxm", compute_dtype="bfloat16", time_limit=time_limit)
    except MemoryBudgetError as exc:
        return {"step_ms": float("inf"), "seconds": time.perf_counter() - t0, "error": str(exc).splitlines()[0]}
    return {"step_ms": pp.step_us / 1e3, "seconds": time.perf_counter() - t0, "table": pp.describe()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="70b:8x8x8:32,405b:8x16x8:32")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        case, kind = args.one.rsplit("@", 1)
        print(json.dumps(run_one(case, kind == "pp", args.time_limit, args.schedule)))
        return
    worst = 0.0
    for case in args.cases.split(","):
        got = {}
        for kind in ("flat", "pp"):
            out = subprocess.run([sys.executable, __file__, "--one", f"{case}@{kind}", "--time-limit",
                                  str(args.time_limit), "--schedule", args.schedule],
                                 capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{case} ({kind}) failed:\n{out.stderr[-3000:]}")
            got[kind] = json.loads(out.stdout.strip().splitlines()[-1])
        ratio = got["pp"]["step_ms"] / got["flat"]["step_ms"]
        worst = max(worst, ratio)
        print(f"{case}: without a pipeline {got['flat']['step_ms']:.1f} ms (recompute {got['flat']['recompute']}, "
              f"{got['flat']['seconds']:.1f} s); pipelined {got['pp']['step_ms']:.1f} ms "
              f"({got['pp']['seconds']:.1f} s); ratio {ratio:.3f}")
        print(got["pp"].get("table") or got["pp"].get("error"))
    print(f"worst ratio pipelined / without: {worst:.3f}")


if __name__ == "__main__":
    main()
