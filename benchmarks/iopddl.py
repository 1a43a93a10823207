"""Run the solver on every IOPDDL instance in a folder, against plain HiGHS.

    python benchmarks/fetch_iopddl.py          # once: the public instances, into benchmarks/data/iopddl
    python benchmarks/iopddl.py [FOLDER] [--only G,A] [--scale 1.0] [--no-baseline]

For each instance: our ``solver.solve`` (its cost, proven lower bound and the stage its
answer came from) and the baseline (the same MILP handed to
HiGHS alone: no incumbent, no local search) within the contest time limit. The
baseline counts 0 when its model does not fit the same 30M-nonzero budget or it
finds nothing in time.
Score = best known / cost (0 when infeasible). Last line: the mean score ratio
ours / baseline.
"""

from __future__ import annotations

import argparse
import logging
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solver import (  # noqa: E402
    InfeasibleError,
    evaluate,
    highs_model,  # noqa: E402
    load_iopddl,
    solve,
)

#: Strongest known cost and contest time limit (s) per instance: the contest's results
#: (google/iopddl) and the winner's released solver on 8 cores (ti2-group/iopddl_experiments).
BEST = {
    "A": (6_548_641_531, 60),
    "G": (217_039, 120),
    "K": (2_264_928_825, 180),
    "M": (49_928_460_991, 180),
    "S": (1_532_717_345, 240),
    "T": (673_292_841_000, 240),
    "V": (1_617_084, 300),
}


def baseline(problem, limit):
    t0 = time.perf_counter()
    choice = None
    try:
        model = highs_model.build(problem, max_nonzeros=30e6)
        h = highs_model.to_highs(model, max(1.0, limit - (time.perf_counter() - t0)), 1e-6)
        h.run()
        if h.getInfo().primal_solution_status >= 2:
            choice = highs_model.extract(model, np.asarray(h.getSolution().col_value), problem.num_nodes)
    except (highs_model.ModelTooLarge, ValueError):
        choice = None
    if choice is None:
        return None, time.perf_counter() - t0
    ev = evaluate(problem, choice)
    return (ev.cost if ev.feasible else None), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", nargs="?", default=str(Path(__file__).resolve().parent / "data" / "iopddl"),
                    help="folder of asplos-2025-iopddl-*.json.gz (python benchmarks/fetch_iopddl.py fills the default)")
    ap.add_argument("--only", default="", help="comma-separated instance letters")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every time limit")
    ap.add_argument("--no-baseline", action="store_true", help="skip plain HiGHS (its column reads 0)")
    args = ap.parse_args()
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="    %(message)s")
    files = sorted(Path(args.folder).glob("asplos-2025-iopddl-*.json.gz"))
    if not files:
        sys.exit(f"{args.folder}: expected IOPDDL instances (asplos-2025-iopddl-*.json.gz), found none: run "
                 "`python benchmarks/fetch_iopddl.py` or give the folder that holds them")
    only = set(args.only.split(",")) - {""}
    rows = []
    print(f"{'inst':<5} {'ours':>16} {'baseline':>16} {'best known':>16} {'score':>6} {'base':>6} "
          f"{'ours s':>7} {'base s':>7} {'peak MB':>8} {'our bound':>16} {'from':>8}", flush=True)
    for f in files:
        letter = f.name.split("-")[-1].split(".")[0]
        if only and letter not in only:
            continue
        best, limit = BEST.get(letter, (None, 60))
        limit *= args.scale
        problem = load_iopddl(f)
        t0 = time.perf_counter()
        source, bound = "-", float("nan")
        try:
            sol = solve(problem, time_limit=limit, stall=None)  # the contest fixes the budget: use it all
            ours, source = sol.cost, sol.source
            bound = sol.lower_bound if sol.lower_bound is not None else float("nan")
        except InfeasibleError:
            ours = None
        ours_s = time.perf_counter() - t0
        base, base_s = baseline(problem, limit) if not args.no_baseline else (None, 0.0)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        score = best / ours if (best and ours) else 0.0
        bscore = best / base if (best and base) else 0.0
        rows.append((score, bscore))
        print(f"{letter:<5} {ours or float('nan'):>16.0f} {base or float('nan'):>16.0f} {best or 0:>16} "
              f"{score:>6.3f} {bscore:>6.3f} {ours_s:>7.1f} {base_s:>7.1f} {peak:>8.0f} {bound:>16.0f} {source:>8}",
              flush=True)
    mean = sum(r[0] for r in rows) / max(1, len(rows))
    bmean = sum(r[1] for r in rows) / max(1, len(rows))
    print(f"mean score ours {mean:.3f}, baseline {bmean:.3f}")
    print(f"ratio ours/baseline (mean score): {mean / bmean if bmean else float('inf'):.3f}")


if __name__ == "__main__":
    main()
