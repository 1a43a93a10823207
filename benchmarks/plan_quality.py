"""Predicted step time of our plan against hand-written plans, same profile and budget.

    python benchmarks/plan_quality.py [--models gpt2-small,llama-1b,llama-8b] [--meshes 8,8x8,2x4x8]
                                      [--no-scale] [--save DIR]

For GPT-2-small, a LLaMA-1B-like and a LLaMA-8B-like model (meta device, global
batch 64, sequence 1024 for GPT-2 and 2048 for LLaMA) on fake meshes (8,), (8, 8)
and (2, 4, 8), ``autoshard.compare`` costs our plan and the baselines DDP, FSDP
(ZeRO-3), Megatron TP on the last axis (data parallel on the others) and FSDP+TP
with the same cost model (h100-sxm profile, its 80 GB as the memory budget). A
baseline pins parameters and inputs; the solver schedules the rest at its best.
Per case: each plan's predicted step time (ms: simulated with the profile's overlap share),
ours split into compute and communication, peak memory per device, and where ours came from
(``from baseline X``: a hand-written plan simulated faster than the solve's, and ``compare``
took it). ``--additive-objective``: the solve minimizes the additive step instead of the
overlap objective (the hand-written plans are additive optima under their pins either way).
Each case also plans without the hand-written seeds (``seed_baselines=False``): the solve alone,
whose ratio to the best hand-written plan says what the solver finds on its own (the final plan
takes a hand-written one where it is predicted faster, so its ratio is <= 1 by construction), and
that plan's objective (the overlap objective the solver minimizes, :mod:`solver.overlap`) against
its simulated step.
Last line: the worst ratio of the solve alone (unseeded / best feasible baseline) over all cases.

Then the cases at scale (``--no-scale`` skips them):

- LLaMA-70B shapes on (8, 8, 8) = 512 ranks with global batch 512 x 2048: compared the same
  way (ours seeded by the baselines), then planned twice more without the seeds, which must
  land within 5% of the best baseline and give the same plan in both runs;
- LLaMA-8B with sequence 8192 (global batch 64) on (8, 8), 80 GiB: a long sequence, where
  activations weigh most and ours chooses its recomputation with the plan (the baselines
  include ``fsdp_tp_ac``, FSDP+TP with full activation checkpointing).

Then the mixture-of-experts cases (``--no-moe`` skips them, ``--only-moe`` runs them alone),
on (8, 8) with global batch 64 x 2048, where the baselines gain expert parallelism (``ep_tp``:
EP over the data axis + TP; ``ep_fsdp``: EP on the inner axis + FSDP):

- Mixtral-8x7B shapes, all 32 layers;
- DeepSeek-V3 shapes with 3 dense and 8 MoE layers of its 61 (its 671B parameters with
  their gradients and Adam state need >= 84 GB per rank on 64 ranks even in bf16: no
  64-rank plan of the whole model fits 80 GB).
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
from autoshard.models import gpt2, llama  # noqa: E402
from autoshard.models.moe import moe  # noqa: E402
from autoshard.planning.baselines import EXPERTS, has_experts  # noqa: E402

#: name -> (factory of a model for a sequence length, default sequence length).
MODELS = {
    "gpt2-small": (lambda seq: gpt2("small"), 1024),  # its positions are not embedded: any length
    "llama-1b": (lambda seq: llama("1b", max_seq_len=seq), 2048),
    "llama-8b": (lambda seq: llama("8b", max_seq_len=seq), 2048),
    "llama-70b": (lambda seq: llama("70b", max_seq_len=seq), 2048),
    "mixtral-8x7b": (lambda seq: moe("mixtral-8x7b", max_seq_len=seq), 2048),
    "deepseek-v3-11l": (lambda seq: moe("deepseek-v3", n_layers=8, max_seq_len=seq), 2048),
}
#: Cases at the scale people train, beyond the grid: (model, mesh, global batch, sequence).
SCALE_CASES = [("llama-70b", (8, 8, 8), 512, 2048), ("llama-8b", (8, 8), 64, 8192)]
#: Mixture-of-experts cases.
MOE_CASES = [("mixtral-8x7b", (8, 8), 64, 2048), ("deepseek-v3-11l", (8, 8), 64, 2048)]
MESH_NAMES = {1: ("tp",), 2: ("dp", "tp"), 3: ("rep", "dp", "tp")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2-small,llama-1b,llama-8b")
    ap.add_argument("--meshes", default="8,8x8,2x4x8")
    ap.add_argument("--profile", default="h100-sxm")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--no-scale", action="store_true", help="skip the cases at scale (LLaMA-70B on (8, 8, 8), "
                    "LLaMA-8B at sequence 8192)")
    ap.add_argument("--only-scale", action="store_true", help="run the cases at scale alone")
    ap.add_argument("--no-moe", action="store_true", help="skip the mixture-of-experts cases")
    ap.add_argument("--only-moe", action="store_true", help="run the mixture-of-experts cases alone")
    ap.add_argument("--compute-dtype", default="bfloat16",
                    help="FLOPs priced in this dtype (the reference shapes are float32 master weights with bf16 "
                         "compute); 'traced' for each op's own")
    ap.add_argument("--additive-objective", dest="overlap_objective", action="store_false",
                    help="solve for the additive step (overlap_objective=False)")
    ap.add_argument("--save", metavar="DIR", help="write each case's plan and its solve alone to DIR "
                    "(compare runs with benchmarks/same_plans.py)")
    ap.add_argument("--load-imbalance", type=float, default=1.0,
                    help="busiest expert-parallel rank's load over the mean (autoshard.planning.imbalance)")
    args = ap.parse_args()
    if args.compute_dtype == "traced":
        args.compute_dtype = None
    cases = [(name, tuple(int(x) for x in mesh_text.split("x")), args.batch, MODELS[name][1])
             for mesh_text in args.meshes.split(",") for name in args.models.split(",")]
    if args.only_scale or args.only_moe:
        cases = []
    if not args.no_scale and not args.only_moe:
        cases += SCALE_CASES
    if not args.no_moe and not args.only_scale:
        cases += MOE_CASES
    worst = 0.0
    for name, shape, batch, seq in cases:
        if dist.is_initialized():
            dist.destroy_process_group()
        mesh = autoshard.fake_mesh(shape, MESH_NAMES[len(shape)])
        factory = MODELS[name][0]
        with torch.device("meta"):
            model = factory(seq)
        tokens = torch.empty(batch, seq, dtype=torch.long, device="meta")
        t0 = time.perf_counter()
        res = autoshard.compare(model, (tokens,), mesh, profile=args.profile, time_limit=args.time_limit,
                                load_imbalance=args.load_imbalance, overlap_objective=args.overlap_objective,
                                compute_dtype=args.compute_dtype)
        seconds = time.perf_counter() - t0
        ours = res["autoshard"]
        if isinstance(ours, str):  # no plan within the budget, solved or hand-written
            print(f"{name:15s} mesh={shape!s:10s} batch={batch}x{seq} no plan: {ours.splitlines()[0]}", flush=True)
            continue
        feasible = {k: v for k, v in res.items() if k != "autoshard" and not isinstance(v, str)}
        cells = []
        for k in [k for k in res if k != "autoshard"]:
            v = res[k]
            cells.append(f"{k}=" + ("infeasible" if isinstance(v, str) else f"{v.summary['step_us'] / 1e3:.1f}"))
        _save(args.save, ours, name, shape, batch, seq, "")
        s = ours.summary
        rc = ours.recompute["mode"]
        line = (f"{name:15s} mesh={shape!s:10s} batch={batch}x{seq} ours={s['step_us'] / 1e3:.1f}ms "
                + (f"(recompute {rc}) " if rc != "none" else "") +
                f"(compute {s['compute_us'] / 1e3:.1f} + comm {s['comm_us'] / 1e3:.1f}, "
                f"peak {s['peak_mem_bytes'] / 2**30:.1f}GiB, {ours.solver['status']}, from "
                f"{ours.solver['source']}) " + " ".join(cells))
        if has_experts(model):
            line += " " + _experts(model, ours)
        best = None
        if feasible:
            best_name, best = min(feasible.items(), key=lambda kv: kv[1].summary["step_us"])
            ratio = s["step_us"] / best.summary["step_us"]
            line += f" best={best_name} final_ratio={ratio:.4f}"
        else:
            line += " best=none (every baseline breaks the budget)"
        print(line + f" [{seconds:.0f}s]", flush=True)
        alone, alone_s = _solve_alone(model, tokens, mesh, args)
        if alone is None:
            print("    solve alone: infeasible", flush=True)
            continue
        _save(args.save, alone, name, shape, batch, seq, "_alone")
        a = alone.summary
        alone_ratio = a.step_us / best.summary.step_us if best is not None else float("nan")
        if best is not None:
            worst = max(worst, alone_ratio)
        objective_us, objective = _objective(alone)
        print(f"    solve alone: {a.step_us / 1e3:.1f}ms ({alone.solver['status']}, from {alone.solver['source']}, "
              f"{alone_s:.0f}s) alone_ratio={alone_ratio:.4f}; its objective ({objective}) {objective_us / 1e3:.1f}ms "
              f"= {objective_us / a.step_us:.3f} x its simulated step"
              + (f"; ended by the wall clock: {', '.join(alone.solver['cut_by_clock'])}"
                 if alone.solver.get("cut_by_clock") else ""), flush=True)
        if (name, shape, batch, seq) == SCALE_CASES[0]:
            _same_plan_again(model, tokens, mesh, args, alone)
    print(f"worst ratio of the solve alone / best baseline: {worst:.4f}")


def _save(folder, plan, name, shape, batch, seq, suffix) -> None:
    """``plan`` to ``folder/NAME_MESH_BATCHxSEQ{suffix}.json`` when ``--save`` names a folder."""
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        plan.save(Path(folder) / f"{name}_{'x'.join(map(str, shape))}_{batch}x{seq}{suffix}.json")


def _objective(plan) -> tuple[float, str]:
    """(the solver's objective of the plan, its name): the overlap objective where the plan was
    solved with it, else the additive step."""
    value = (plan.summary.overlap or {}).get("objective_us")
    return (value, "overlap") if value is not None else (plan.summary.additive_us, "additive")


def _experts(model, plan) -> str:
    """What the plan does with the experts: a MoE layer's expert weights' spec, and the
    all_to_all steps of the step (count, predicted milliseconds of the redistributes with one)."""
    fqn = next(f for f, p in model.named_parameters() if EXPERTS.search(f.rpartition(".")[0]) and p.ndim == 3)
    a2a = [r for r in plan.redistributes if any(st.startswith("all_to_all") for st in r["steps"])]
    steps = sum(st.startswith("all_to_all") for r in a2a for st in r["steps"])
    return (f"experts={plan.param_spec(fqn)} all_to_all={steps} steps "
            f"({sum(r['us'] for r in a2a) / 1e3:.1f}ms in their redistributes)")


def _solve_alone(model, tokens, mesh, args):
    """(the plan without the hand-written seeds, its seconds), or (None, seconds) where nothing fits."""
    t0 = time.perf_counter()
    try:
        p = autoshard.plan(model, (tokens,), mesh, profile=args.profile, time_limit=args.time_limit,
                           seed_baselines=False, load_imbalance=args.load_imbalance,
                           overlap_objective=args.overlap_objective, compute_dtype=args.compute_dtype)
    except autoshard.MemoryBudgetError:
        p = None
    return p, time.perf_counter() - t0


def _same_plan_again(model, tokens, mesh, args, first) -> None:
    """Plan once more without the seeds: whether the two runs give the same plan."""
    again, seconds = _solve_alone(model, tokens, mesh, args)
    same = again is not None and first.params == again.params and first.nodes == again.nodes
    print(f"    solve alone again: {again.summary.step_us / 1e3:.1f}ms ({seconds:.0f}s), same plan in both runs: "
          f"{same}" + (f"; ended by the wall clock: {', '.join(again.solver['cut_by_clock'])}"
                       if again.solver.get("cut_by_clock") else ""), flush=True)


if __name__ == "__main__":
    main()
