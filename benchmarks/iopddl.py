"""Run the solver on every IOPDDL instance in a folder, against plain HiGHS.

    python benchmarks/fetch_iopddl.py          # once: the public instances, into benchmarks/data/iopddl
    python benchmarks/iopddl.py [FOLDER] [--only G,A] [--scale 1.0] [--no-baseline] [--repeat 3]

For each instance: our ``solver.solve`` (its cost, proven lower bound and the stage its
answer came from) and the baseline (the same MILP handed to
HiGHS alone: no incumbent, no local search) within the contest time limit. The
baseline counts 0 when its model does not fit the same 30M-nonzero budget or it
finds nothing in time.
Score = best known / cost (0 when infeasible). Last line: the mean score ratio
ours / baseline. With ``--repeat N`` each instance is solved N times (the baseline once):
per instance the least, median and largest score and the spread (largest / least cost);
last line: the mean over instances of the least score (what a user can count on).

Of the contest's instances, A, G, M, S and Y were public and the rest private; ``../shared/iopddl``
holds A, G, K, M, S, T and V. For B, C, D, L, N, P, Q, R and U (``fetch_iopddl.py`` gets them
too) the strongest known cost is the contest's final results' least feasible answer.
"""

from __future__ import annotations

import argparse
import logging
import resource
import statistics
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
    # The contest's private instances: the least feasible cost in its final results
    # (ti2-group/iopddl_experiments, iopddl_final_results.csv; P's is XLA's), its time limits.
    "B": (532_843, 60),
    "C": (84_102_445_260, 60),
    "D": (313_613_524_736, 60),
    "L": (1_970_993_742, 180),
    "N": (202_739_586_553, 180),
    "P": (651_833_115_436, 240),
    "Q": (526_776_842_042, 240),
    "R": (371_899_551_572, 240),
    "U": (2_569_342_178, 300),
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
    ap.add_argument("--repeat", type=int, default=1, help="solve each instance this many times (the baseline once)")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat: expected at least 1 run, found {args.repeat}")
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="    %(message)s")
    files = sorted(Path(args.folder).glob("asplos-2025-iopddl-*.json.gz"))
    if not files:
        sys.exit(f"{args.folder}: expected IOPDDL instances (asplos-2025-iopddl-*.json.gz), found none: run "
                 "`python benchmarks/fetch_iopddl.py` or give the folder that holds them")
    only = set(args.only.split(",")) - {""}
    rows, runs = [], {}
    print(f"{'inst':<5} {'ours':>16} {'baseline':>16} {'best known':>16} {'score':>6} {'base':>6} "
          f"{'ours s':>7} {'base s':>7} {'peak MB':>8} {'our bound':>16} {'from':>8} {'clock cut':>10}", flush=True)
    for f in files:
        letter = f.name.split("-")[-1].split(".")[0]
        if only and letter not in only:
            continue
        best, limit = BEST.get(letter, (None, 60))
        limit *= args.scale
        problem = load_iopddl(f)
        for k in range(args.repeat):
            t0 = time.perf_counter()
            source, bound, cut = "-", float("nan"), "-"
            try:
                sol = solve(problem, time_limit=limit, stall=None)  # the contest fixes the budget: use it all
                ours, source = sol.cost, sol.source
                bound = sol.lower_bound if sol.lower_bound is not None else float("nan")
                cut = ",".join(sol.stats.get("cut_by_clock", [])) or "-"
            except InfeasibleError:
                ours = None
            ours_s = time.perf_counter() - t0
            base, base_s = baseline(problem, limit) if not args.no_baseline and k == 0 else (None, 0.0)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            score = best / ours if (best and ours) else 0.0
            bscore = best / base if (best and base) else 0.0
            if k == 0:
                rows.append((score, bscore))
            runs.setdefault(letter, []).append((score, ours))
            print(f"{letter:<5} {ours or float('nan'):>16.0f} {base or float('nan'):>16.0f} {best or 0:>16} "
                  f"{score:>6.3f} {bscore:>6.3f} {ours_s:>7.1f} {base_s:>7.1f} {peak:>8.0f} {bound:>16.0f} "
                  f"{source:>8} {cut:>10}", flush=True)
    mean = sum(r[0] for r in rows) / max(1, len(rows))
    bmean = sum(r[1] for r in rows) / max(1, len(rows))
    print(f"mean score ours {mean:.3f}, baseline {bmean:.3f}")
    if args.repeat == 1:
        print(f"ratio ours/baseline (mean score): {mean / bmean if bmean else float('inf'):.3f}")
        return
    worst = []
    for letter, got in runs.items():
        scores = sorted(s for s, _ in got)
        costs = [c for _, c in got if c]
        spread = max(costs) / min(costs) - 1 if len(costs) == len(got) else float("inf")
        worst.append(scores[0])
        print(f"{letter}: {len(got)} runs, score min {scores[0]:.4f} median {statistics.median(scores):.4f} "
              f"max {scores[-1]:.4f}, spread (max / min cost - 1) {spread:.2%}", flush=True)
    print(f"mean of the per-instance least score over {args.repeat} runs: {sum(worst) / len(worst):.4f}")


if __name__ == "__main__":
    main()
