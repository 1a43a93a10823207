"""The mesh shape chosen with the plan, against every shape planned alone.

    python benchmarks/mesh_search.py [--cases 8b:64,8b:512] [--time-limit 60] [--save DIR]

Per case (a LLaMA-3 preset and a rank count; global batch = ranks sequences of 2048,
h100-sxm profile, its 80 GB as the budget, each case in a process of its own):

1. ``autoshard.plan(model, inputs, mesh="auto", ranks=N, time_limit=T)``: the search's
   table (every candidate shape: planned, pruned by its bound, or skipped), its seconds and
   the chosen shape's predicted step;
2. every candidate shape planned alone, end to end as a user would (trace included, no
   strategies kept from other meshes), with the same ``time_limit``: its predicted step (or
   infeasible) and seconds.

Checks the issue's two targets: the chosen plan's step <= the best shape planned alone
(ratio <= 1), and the search's seconds <= 3x one shape's plan (the median of the shapes
planned alone). Last line: both ratios of the last case.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run_case(case: str, time_limit: float, save: str | None = None) -> dict:
    import torch

    import autoshard
    from autoshard.errors import MemoryBudgetError
    from autoshard.graph.strategies import clear_shared_cache
    from autoshard.models.catalog import reference
    from autoshard.planning.meshsearch import axis_names, mesh_shapes
    from costmodel import load_profile

    preset, ranks = case.split(":")
    ranks = int(ranks)
    with torch.device("meta"):
        model = reference("llama", preset, seq=2048)
    tokens = torch.empty(ranks, 2048, dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    # Reference shapes in float32 (master weights) trained with bf16 compute, as under mixed precision.
    chosen = autoshard.plan(model, (tokens,), "auto", ranks=ranks, profile="h100-sxm", time_limit=time_limit,
                            compute_dtype="bfloat16")
    search_s = time.perf_counter() - t0
    if save:
        Path(save).mkdir(parents=True, exist_ok=True)
        chosen.save(Path(save) / f"{case.replace(':', '_')}.json")
    alone = []
    for shape in mesh_shapes(ranks, load_profile("h100-sxm").devices_per_node):
        clear_shared_cache()  # as in a process of its own: no strategies enumerated for other meshes
        t1 = time.perf_counter()
        try:
            p = autoshard.plan(model, (tokens,), autoshard.fake_mesh(shape, axis_names(len(shape))),
                               profile="h100-sxm", time_limit=time_limit, compute_dtype="bfloat16")
            step = p.summary["step_us"]
        except MemoryBudgetError:
            step = None
        alone.append({"shape": list(shape), "step_us": step, "seconds": round(time.perf_counter() - t1, 2)})
    return {"case": case, "search_s": round(search_s, 2), "chosen_shape": chosen.mesh_shape,
            "chosen_step_us": chosen.summary["step_us"], "table": chosen.summary["mesh_search"], "alone": alone}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="8b:64,8b:512", help="PRESET:RANKS list (70b:512 takes ~20 min)")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--save", metavar="DIR", help="write each case's chosen plan to DIR/CASE.json (compare runs "
                    "with benchmarks/same_plans.py)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_case(args.one, args.time_limit, args.save)))
        return
    last = None
    for case in args.cases.split(","):
        out = subprocess.run([sys.executable, __file__, "--one", case, "--time-limit", str(args.time_limit)]
                             + (["--save", args.save] if args.save else []), capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{case}: failed\n{out.stderr[-2000:]}", flush=True)
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"\n{case}: search {r['search_s']:.1f} s, chosen {tuple(r['chosen_shape'])} at "
              f"{r['chosen_step_us'] / 1e3:.1f} ms predicted")
        print(f"  {'shape':>14s} {'search: outcome':>22s} {'step ms':>10s} {'s':>6s}   "
              f"{'alone: step ms':>15s} {'s':>6s}")
        alone = {tuple(a["shape"]): a for a in r["alone"]}
        for row in r["table"]:
            shape = tuple(row["shape"])
            a = alone.get(shape, {})
            step = f"{row['step_us'] / 1e3:10.1f}" if row.get("step_us") else f"{'-':>10s}"
            a_step = f"{a['step_us'] / 1e3:15.1f}" if a.get("step_us") else f"{'infeasible':>15s}"
            print(f"  {'x'.join(map(str, shape)):>14s} {row['outcome'][:22]:>22s} {step} "
                  f"{row.get('seconds', 0):6.1f}   {a_step} {a.get('seconds', 0):6.1f}")
        feasible = [a for a in r["alone"] if a["step_us"]]
        best = min(feasible, key=lambda a: a["step_us"]) if feasible else None
        one = statistics.median(a["seconds"] for a in r["alone"])
        quality = r["chosen_step_us"] / best["step_us"] if best else float("nan")
        cost = r["search_s"] / one
        print(f"  best alone {tuple(best['shape']) if best else None} at "
              f"{best['step_us'] / 1e3 if best else float('nan'):.1f} ms; chosen / best alone {quality:.3f} "
              f"(target <= 1); search {r['search_s']:.1f} s / one shape's plan {one:.1f} s = {cost:.2f} "
              f"(target <= 3)", flush=True)
        last = (case, quality, cost)
    if last:
        print(f"{last[0]}: chosen/best-alone step {last[1]:.3f}, search/one-plan seconds {last[2]:.2f}")


if __name__ == "__main__":
    main()
