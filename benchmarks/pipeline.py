"""Pipelined plans against the best plan without a pipeline and hand-written FSDP+TP+PP, predicted.

    python benchmarks/pipeline.py [--cases 70b:8x8x8:32,405b:8x16x8:64] [--time-limit 60] [--schedule 1f1b]

A case ``MODEL:AxBxC:M`` plans LLaMA-3 shapes (meta device, h100-sxm, bf16 pricing, the
device's memory less its reserve as the budget), each plan in a process of its own: without a
pipeline on the mesh (A, B, C) (axes ``rep, dp, tp``, our solve); pipelined over an axis of size
A with the stages on (B, C) (axes ``pp, dp, tp``), ``M`` microbatches (``auto``: each pipelined plan
climbs to its own count, :mod:`autoshard.planning.microbatches`), 1F1B: ours (every stage
solved) and torchtitan's hand-written FSDP + TP + PP, with and without full activation
checkpointing (``plan_pipeline(baseline="fsdp_tp" | "fsdp_tp_ac")``, our partition). Global batch as
in ``plan_time.py`` (70B: 512 x 2048, 405B: 1024 x 2048, 8B: 64 x 2048). Prints per case every
predicted step, the pipelined plan's stage table and the planning times; the last line is the
worst over the cases of ours pipelined / the best of the others (below 1: our pipelined plan
beats every alternative in every case). A plan that cannot meet the budget counts as
infinitely slow.

``--allow`` adds a fifth plan per case, pipelining allowed, not required
(:func:`autoshard.planning.pipechoice.plan_or_pipeline` on (A, B, C) with axes ``pp, dp, tp``: both
made, the faster kept), says which it kept and, where it kept the plan without a pipeline, whether
that plan's placements are those of the plan made alone; its last line is then the worst over the
cases of that plan / the best of (ours without, FSDP+TP+PP, FSDP+TP+PP+AC).
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


def run_one(case: str, kind: str, time_limit: float, schedule: str, layers=None) -> dict:
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
    if kind == "flat":
        mesh = autoshard.fake_mesh(shape, ("rep", "dp", "tp"))
        plan = autoshard.plan(model, (tokens,), mesh, profile="h100-sxm", compute_dtype="bfloat16",
                              time_limit=time_limit)
        return {"step_ms": plan.summary["step_us"] / 1e3, "seconds": time.perf_counter() - t0,
                "recompute": plan.recompute.get("mode"), "placements": _placements(plan)}
    mesh = autoshard.fake_mesh(shape, ("pp", "dp", "tp"))
    if kind == "allow":
        from autoshard.planning.pipechoice import plan_or_pipeline

        got = plan_or_pipeline(model, (tokens,), mesh, axis="pp", microbatches=m if m == "auto" else int(m),
                               schedule=schedule, profile="h100-sxm", compute_dtype="bfloat16",
                               time_limit=time_limit)
        if isinstance(got, autoshard.Plan):
            return {"step_ms": got.summary["step_us"] / 1e3, "seconds": time.perf_counter() - t0,
                    "kept": "flat", "placements": _placements(got), "choice": got.summary["pipeline_choice"]}
        return {"step_ms": got.step_us / 1e3, "seconds": time.perf_counter() - t0, "kept": "pipeline",
                "choice": got.choice, "microbatches": got.microbatches}
    try:
        pp = plan_pipeline(model, (tokens,), mesh, axis="pp", microbatches=m if m == "auto" else int(m),
                           schedule=schedule,
                           profile="h100-sxm", compute_dtype="bfloat16", time_limit=time_limit,
                           baseline=None if kind == "pp" else kind, layers_per_stage=layers)
    except MemoryBudgetError as exc:
        return {"step_ms": float("inf"), "seconds": time.perf_counter() - t0, "error": str(exc).splitlines()[0]}
    return {"step_ms": pp.step_us / 1e3, "seconds": time.perf_counter() - t0, "table": pp.describe(),
            "layers": [s.layers[1] - s.layers[0] for s in pp.stages], "microbatches": pp.microbatches}


def _placements(plan) -> str:
    """A digest of every parameter's placements (axis names aside: the meshes' are not the same)."""
    import hashlib

    text = json.dumps([[f, [p.placements[a] for a in plan.axis_names], p.shard_order]
                       for f, p in sorted(plan.params.items())])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="70b:8x8x8:32,405b:8x16x8:64")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--allow", action="store_true", help="also plan with pipelining allowed, not required")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--layers", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        case, kind = args.one.rsplit("@", 1)
        layers = [int(x) for x in args.layers.split(",")] if args.layers else None
        print(json.dumps(run_one(case, kind, args.time_limit, args.schedule, layers)))
        return
    worst = 0.0
    for case in args.cases.split(","):
        got = {}
        for kind in ("flat", "pp", "fsdp_tp", "fsdp_tp_ac") + (("allow",) if args.allow else ()):
            extra = ["--layers", ",".join(map(str, got["pp"]["layers"]))] if got.get("pp", {}).get("layers") else []
            out = subprocess.run([sys.executable, __file__, "--one", f"{case}@{kind}", "--time-limit",
                                  str(args.time_limit), "--schedule", args.schedule, *extra],
                                 capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{case} ({kind}) failed:\n{out.stderr[-3000:]}")
            got[kind] = json.loads(out.stdout.strip().splitlines()[-1])
        best_other = min(got[k]["step_ms"] for k in ("flat", "fsdp_tp", "fsdp_tp_ac"))
        ratio = got["pp"]["step_ms"] / best_other
        worst = max(worst, got["allow"]["step_ms"] / best_other if args.allow else ratio)
        print(f"{case}: without a pipeline {got['flat']['step_ms']:.1f} ms (recompute {got['flat']['recompute']}, "
              f"{got['flat']['seconds']:.1f} s); pipelined: ours {got['pp']['step_ms']:.1f} ms "
              f"({got['pp']['seconds']:.1f} s, {got['pp'].get('microbatches')} microbatches), FSDP+TP+PP "
              f"{got['fsdp_tp']['step_ms']:.1f} ms ({got['fsdp_tp'].get('microbatches')} microbatches), "
              f"FSDP+TP+PP+AC {got['fsdp_tp_ac']['step_ms']:.1f} ms ({got['fsdp_tp_ac'].get('microbatches')} "
              f"microbatches); ours pipelined / best other {ratio:.3f}")
        print(got["pp"].get("table") or got["pp"].get("error"))
        if args.allow:
            from autoshard.plansummary import pipeline_choice_line

            a = got["allow"]
            same = (", the plan made alone" if a.get("placements") == got["flat"]["placements"] else
                    ", not the plan made alone") if a["kept"] == "flat" else ""
            print(f"{case}: pipelining allowed: kept the {a['kept']} plan{same}, {a['step_ms']:.1f} ms in "
                  f"{a['seconds']:.1f} s; / best other {a['step_ms'] / best_other:.3f}\n"
                  + pipeline_choice_line(a["choice"]))
    what = "pipelining allowed" if args.allow else "ours pipelined"
    print(f"worst ratio {what} / best of (ours without, FSDP+TP+PP, FSDP+TP+PP+AC): {worst:.3f}")


if __name__ == "__main__":
    main()
