"""Where the overlap objective and the simulated step part, window by window.

    python benchmarks/objective_gap.py [--case mixtral-8x7b:8x8:64:2048] [--baselines fsdp_tp,ep_tp]
                                       [--top 8] [--time-limit 60]

A diagnostic for the solver's objective (:mod:`solver.overlap`, issue "the solver optimizes the
step it predicts"). The case ``MODEL:MESH:BATCH:SEQ`` (a model of ``plan_quality.py``) is planned
with the default options and no hand-written seeds (the solve alone), and each named hand-written
plan beside it (``Planner.compare``). Per plan: its simulated step (:func:`simulate_plan
<autoshard.planning.simulate.simulate_plan>`, at the profile's overlap share), its overlap objective
``F`` (the windows merged, as the solver weighs them) and, with every hideable move hidden
(share 1), the walk's compute-stream time per window against the window's part of the objective
(:func:`autoshard.planning.windows.window_terms`: ``S + exposed + H - min(S, H)``); then the
``--top`` windows where they differ most, with their compute, exposed and hideable communication
and the walk's waits. The last line is the least, over the plans, of ``F`` / simulated step (1
where the objective is exact; below 1 where it misses what the walk charges).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from plan_quality import MESH_NAMES, MODELS  # noqa: E402

import autoshard  # noqa: E402
from autoshard.graph.layers import node_layer  # noqa: E402
from autoshard.planning.simulate import simulate_plan, walk_trace  # noqa: E402
from autoshard.planning.windows import overlap_windows, window_terms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="mixtral-8x7b:8x8:64:2048", help="MODEL:MESH:BATCH:SEQ")
    ap.add_argument("--baselines", default="fsdp_tp,ep_tp", help="hand-written plans to set beside ours")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--profile", default="h100-sxm")
    args = ap.parse_args()
    name, mesh_text, batch, seq = args.case.split(":")
    shape = tuple(int(x) for x in mesh_text.split("x"))
    mesh = autoshard.fake_mesh(shape, MESH_NAMES[len(shape)])
    with torch.device("meta"):
        model = MODELS[name][0](int(seq))
    tokens = torch.empty(int(batch), int(seq), dtype=torch.long, device="meta")
    planner = autoshard.Planner(model, (tokens,), mesh, profile=args.profile, time_limit=args.time_limit,
                                seed_baselines=False, compute_dtype="bfloat16")
    plans = {"ours (solve alone)": planner.solve()}
    names = [n for n in args.baselines.split(",") if n]
    for base, got in planner.compare(names).items():
        if base != "autoshard":
            plans[base] = got
    share = planner.profile.overlap
    worst = float("inf")
    for label, plan in plans.items():
        if isinstance(plan, str):
            print(f"{label}: {plan.splitlines()[0]}")
            continue
        _, gp = planner.variant(plan.recompute["mode"])
        choice = planner.choice_of(plan)
        step = simulate_plan(gp, choice, share).step_us
        windows = overlap_windows(gp, share)
        objective = windows.cost(gp.problem, choice) if windows is not None else float("nan")
        terms = window_terms(gp, choice)
        timeline, trace = walk_trace(gp, choice)
        seg = terms["segment"]
        walked, waited = np.zeros(len(terms["compute"])), np.zeros(len(terms["compute"]))
        for v, before, after, wait in trace:
            walked[seg[v]] += after - before
            waited[seg[v]] += wait
        gap = walked - terms["objective"]
        worst = min(worst, objective / step)
        print(f"{label}: simulated {step / 1e3:.1f} ms, objective {objective / 1e3:.1f} ms "
              f"({objective / step:.3f} of it); share 1: walk {timeline.step_us / 1e3:.1f} ms, windows "
              f"{terms['objective'].sum() / 1e3:.1f} ms; compute {terms['compute'].sum() / 1e3:.1f}, exposed "
              f"{terms['exposed'].sum() / 1e3:.1f}, hideable {terms['hideable'].sum() / 1e3:.1f} ms")
        for w in sorted(np.argsort(-np.abs(gap))[:args.top].tolist()):
            first = int(np.nonzero(seg == w)[0][0])
            tag = node_layer(gp.nodes[gp.copy_of.get(first, first)])
            print(f"  window {w:3d} {tag[0] if tag else '-':14s} walk {walked[w] / 1e3:7.2f} ms (waits "
                  f"{waited[w] / 1e3:6.2f}) | compute {terms['compute'][w] / 1e3:7.2f} exposed "
                  f"{terms['exposed'][w] / 1e3:6.2f} hideable {terms['hideable'][w] / 1e3:6.2f} "
                  f"objective {terms['objective'][w] / 1e3:7.2f} | walk - objective {gap[w] / 1e3:+7.2f}")
    print(f"least objective / simulated step over the plans: {worst:.3f}")


if __name__ == "__main__":
    main()
