"""The planner's own problems, where memory binds: our solver against the MILP alone.

    python benchmarks/planner_corpus.py [--rebuild] [--time-limit 60] [--milp-limit 60] [--only NAME,...]

A second corpus beside IOPDDL's, in the same format (ties and pins as extra keys): LLaMA-8B
and GPT-2 shapes with a few layers on (8, 8), (2, 4, 8) and (8, 8, 8), each with a memory
limit a share of the way from the least-usage peak to the memory-free optimum's peak, so
the memory-free answer never fits. ``--rebuild`` (or a missing file) traces the model and
writes ``benchmarks/corpus/NAME.json.gz``.

Per instance: nodes, tie groups, our cost, status, lower bound and stage, seconds; then
the MILP alone (:mod:`solver.highs_model`, HiGHS, no incumbent) within ``--milp-limit``:
its cost and proven bound. Last line: the worst ratio of our cost to the best proven
lower bound (ours or the MILP's); 1.0 means every answer is proved optimal.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import solver  # noqa: E402
from solver import highs_model  # noqa: E402
from solver.quotient import tie_heads  # noqa: E402
from solver.solve import memory_lower_bound  # noqa: E402

CORPUS = Path(__file__).resolve().parent / "corpus"

#: name -> (model, preset, layers, mesh, global batch, sequence, share of the way from the
#: least-usage peak to the memory-free optimum's peak where the limit sits).
CASES = {
    "llama8b-4l-8x8": ("llama", "8b", 4, (8, 8), 64, 2048, 0.4),
    "llama8b-2l-2x4x8": ("llama", "8b", 2, (2, 4, 8), 64, 2048, 0.4),
    "llama8b-2l-8x8x8": ("llama", "8b", 2, (8, 8, 8), 64, 2048, 0.4),
    "gpt2s-4l-8x8": ("gpt2", "small", 4, (8, 8), 64, 1024, 0.4),
    "gpt2s-2l-2x4x8-tight": ("gpt2", "small", 2, (2, 4, 8), 64, 1024, 0.15),
    "gpt2m-2l-8x8x8": ("gpt2", "medium", 2, (8, 8, 8), 32, 1024, 0.4),
}
MESH_NAMES = {2: ("dp", "tp"), 3: ("pp", "dp", "tp")}


def build(name: str) -> solver.Problem:
    import torch
    import torch.distributed as dist

    import autoshard
    from autoshard.models.catalog import reference

    family, preset, layers, shape, batch, seq, share = CASES[name]
    if dist.is_initialized():
        dist.destroy_process_group()
    mesh = autoshard.fake_mesh(shape, MESH_NAMES[len(shape)])
    with torch.device("meta"):
        model = reference(family, preset, n_layers=layers)
    tokens = torch.empty(batch, seq, dtype=torch.long, device="meta")
    # Float32 reference shapes priced with bf16 compute (mixed precision), as the demo plans them.
    problem = autoshard.Planner(model, (tokens,), mesh, memory_budget=None, compute_dtype="bfloat16").problem()
    free = solver.solve(problem, time_limit=60)
    least = memory_lower_bound(problem)[0]
    if free.peak_usage <= least:
        raise SystemExit(f"{name}: memory cannot bind (memory-free peak {free.peak_usage:g} <= least {least:g})")
    problem.usage_limit = float(np.floor(least + share * (free.peak_usage - least)))
    problem.name = name
    return problem


def milp_alone(problem: solver.Problem, limit: float) -> tuple[float | None, float | None, float]:
    t0 = time.perf_counter()
    try:
        model = highs_model.build(problem, max_nonzeros=30e6)
    except highs_model.ModelTooLarge:
        return None, None, time.perf_counter() - t0
    choice, bound, _ = highs_model.solve_model(model, problem.num_nodes,
                                               max(1.0, limit - (time.perf_counter() - t0)), 1e-6)
    cost = None
    if choice is not None:
        ev = solver.evaluate(problem, choice)
        cost = ev.cost if ev.feasible else None
    return cost, bound, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rebuild", action="store_true", help="trace the models and rewrite the corpus files")
    ap.add_argument("--time-limit", type=float, default=60.0, help="our solver's limit per instance")
    ap.add_argument("--milp-limit", type=float, default=60.0, help="the MILP's limit per instance")
    ap.add_argument("--only", default="", help="comma-separated instance names")
    args = ap.parse_args()
    only = set(args.only.split(",")) - {""}
    CORPUS.mkdir(exist_ok=True)
    print(f"{'instance':<22} {'nodes':>6} {'groups':>6} {'ours':>14} {'status':>9} {'from':>9} {'s':>6} "
          f"{'our bound':>14} {'milp':>14} {'milp bound':>14} {'milp s':>6} {'ours/bound':>10}", flush=True)
    worst = 1.0
    for name in CASES:
        if only and name not in only:
            continue
        path = CORPUS / f"{name}.json.gz"
        if args.rebuild or not path.exists():
            solver.save_iopddl(build(name), path)
        problem = solver.load_iopddl(path)
        groups = len(np.unique(tie_heads(problem)))
        sol = solver.solve(problem, time_limit=args.time_limit)
        cost, bound, seconds = milp_alone(problem, args.milp_limit)
        bounds = [b for b in (sol.lower_bound, bound) if b is not None]
        best_bound = max(bounds) if bounds else None
        ratio = sol.cost / best_bound if best_bound else float("nan")
        worst = max(worst, ratio) if best_bound else worst
        fmt = lambda x: f"{x:>14.6g}" if x is not None else f"{'-':>14}"  # noqa: E731
        print(f"{name:<22} {problem.num_nodes:>6} {groups:>6} {sol.cost:>14.6g} {sol.status:>9} {sol.source:>9} "
              f"{sol.seconds:>6.1f} {fmt(sol.lower_bound)} {fmt(cost)} {fmt(bound)} {seconds:>6.1f} {ratio:>10.4f}",
              flush=True)
    print(f"worst ratio ours / best proven bound: {worst:.4f}")


if __name__ == "__main__":
    main()
