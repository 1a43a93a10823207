"""Predicted step against measured step, on 4 gloo processes, with a profile calibrated in the
same run.

    python benchmarks/fidelity.py [--nproc 4] [--steps 10] [--models llama,gpt2] [--refine]

1. ``autoshard calibrate --backend gloo`` on a (2, 2) mesh of local processes (collective fits,
   the matmul rate that prices compute, the overlap share), written to a temporary profile.
2. Per model (a small LLaMA and a small GPT-2, batch 16 x 128): our plan and the hand-written
   ones (DDP, FSDP, TP, FSDP+TP, FSDP+TP with full recomputation) under that profile, from one
   ``Planner`` on a fake (2, 2) mesh.
3. Each plan measured by ``autoshard measure`` (its lowered programs with bucketing and overlap,
   as ``parallelize`` runs them by default): median step of the timed steps.

Per plan: the additive step (nothing overlapped), the plan's predicted step (its overlap
simulation on the planned graph, priced with the calibrated overlap share:
``plan.summary["step_us"]``), the simulated step of the lowered programs that ran
(:mod:`autoshard.planning.simulate`: bucketing and overlap, one compute and one communication stream,
same share), the measured step, and communication three ways. Last line, for each of the three
predictions: the median |predicted / measured - 1| over every plan, and how many of the plan
pairs (same model) whose measured steps differ by more than 15% it orders rightly.

``--refine`` then closes the loop once: the first model's own plan is measured with
``autoshard measure --refine`` (its in-step collectives and compute refit the calibrated
profile), every model is planned again under the refined profile and every plan measured
again; the calibrated round's line is printed first, the refined round's last.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCH, SEQ = 16, 128
#: Ours and the hand-written plans; FSDP+TP with full recomputation prices recomputed compute.
PLANS = ("autoshard", "ddp", "fsdp", "tp", "fsdp_tp", "fsdp_tp_ac")


def llama():
    """Factory: a small LLaMA-style model and its batch (the train_step benchmark's shapes)."""
    from autoshard.models import llama as make

    torch.manual_seed(0)
    model = make("tiny", dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=688, vocab_size=2048,
                 max_seq_len=SEQ)
    return model, (torch.randint(0, 2048, (BATCH, SEQ)),)


def gpt2():
    """Factory: a small GPT-2-style model and its batch."""
    from autoshard.models import Transformer, TransformerConfig

    torch.manual_seed(0)
    model = Transformer(TransformerConfig(dim=256, n_heads=8, n_layers=2, vocab_size=2048))
    return model, (torch.randint(0, 2048, (BATCH, SEQ)),)


def llama_long():
    """Factory: the small LLaMA with one key head (multi-query), two sequences of 8 x SEQ: a batch
    the mesh cannot split over all ranks, so the plans split the sequence (context parallelism).
    Not among the defaults: ``--models llama-long``."""
    from autoshard.models import llama as make

    torch.manual_seed(0)
    model = make("tiny", dim=256, n_layers=2, n_heads=8, n_kv_heads=1, ffn_dim=688, vocab_size=2048,
                 max_seq_len=8 * SEQ)
    return model, (torch.randint(0, 2048, (2, 8 * SEQ)),)


MODELS = {"llama": llama, "gpt2": gpt2, "llama-long": llama_long}


def calibrate(nproc: int, out: Path) -> float:
    from costmodel.calibrate import CalibrationConfig, run

    t0 = time.perf_counter()
    cfg = CalibrationConfig(min_bytes=4096, max_bytes=4 * 2**20, factor=4)
    run((2, nproc // 2), ("dp", "tp"), "gloo", cfg, str(out), nproc=nproc, name="fidelity-gloo")
    return time.perf_counter() - t0


def plan_all(name: str, profile: Path | str, folder: Path, nproc: int, models: dict | None = None,
             only: tuple[str, ...] = PLANS, **options) -> dict[str, Path]:
    """Our plan and the hand-written ones (``only`` those) for model ``name`` (of ``models``,
    default :data:`MODELS`), planned with ``options``, saved; name -> plan file."""
    import torch.distributed as dist

    import autoshard

    if dist.is_initialized():
        dist.destroy_process_group()
    model, inputs = (models or MODELS)[name]()
    planner = autoshard.Planner(model, inputs, autoshard.fake_mesh((2, nproc // 2), ("dp", "tp")),
                                profile=str(profile), time_limit=30, **options)
    results = planner.compare() if only != ("autoshard",) else {"autoshard": planner.solve()}
    files = {}
    for plan_name in only:
        res = results.get(plan_name)
        if res is None or isinstance(res, str):
            print(f"  {name}/{plan_name}: not planned ({res})", flush=True)
            continue
        files[plan_name] = folder / f"{name}-{plan_name}.json"
        res.save(files[plan_name])
    return files


def measure(name: str, plan_file: Path, nproc: int, steps: int, out: Path, refine: tuple[Path, Path] | None = None
            ) -> dict:
    """``autoshard measure`` of one plan; ``refine``: (profile, refined profile to write)."""
    factory = name.replace("-", "_")
    cmd = [sys.executable, "-m", "autoshard", "-q", "measure", f"fidelity:{factory}", "--plan", str(plan_file),
           "--backend", "gloo", "--nproc", str(nproc), "--steps", str(steps), "--json", str(out)]
    if refine:
        cmd += ["--refine", str(refine[0]), "-o", str(refine[1])]
    res = subprocess.run(cmd, cwd=Path(__file__).parent, capture_output=True, text=True, timeout=900)
    for _ in range(2):
        if res.returncode == 0 or "terminated with signal" not in res.stderr:
            break
        # A native abort inside gloo on this shared machine (seen: SIGABRT in a worker, "malloc():
        # unaligned tcache chunk detected", no Python error), twice in a row once: rerun, said out loud.
        print(f"  {plan_file.name}: a worker died by a signal, measuring again", flush=True)
        res = subprocess.run(cmd, cwd=Path(__file__).parent, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"measure {plan_file.name} failed:\n{res.stderr[-3000:]}")
    if refine:
        print("  " + "\n  ".join(line for line in res.stdout.splitlines() if "refine" in line or "compute" in line),
              flush=True)
    return json.loads(out.read_text())


def run_round(models: list[str], profile: Path, folder: Path, args, refined: Path | None = None) -> str:
    """Plan every model under ``profile``, measure each plan, print a row per plan; the last
    line's summary is returned. ``refined``: the first model's own plan is measured with
    ``--refine profile -o refined`` (its in-step collectives and compute refit the profile)."""
    rows = []
    for name in models:
        files = plan_all(name, profile, folder, args.nproc)
        for plan_name, plan_file in files.items():
            refine = (profile, refined) if refined and plan_name == "autoshard" and name == models[0] else None
            m = measure(name, plan_file, args.nproc, args.steps, folder / f"{name}-{plan_name}.measured.json", refine)
            p, q, sim = m["predicted"], m["measured"], m["simulated"]
            rows.append({"model": name, "plan": plan_name, "additive": p["additive_us"] / 1e3,
                         "predicted": p["step_us"] / 1e3, "simulated": sim["step_us"] / 1e3,
                         "measured": q["step_us"] / 1e3})
            print(f"{name:6s} {plan_name:10s} additive {p['additive_us'] / 1e3:8.2f} ms  predicted "
                  f"{p['step_us'] / 1e3:8.2f} ms  simulated "
                  f"{sim['step_us'] / 1e3:8.2f} ms  measured {q['step_us'] / 1e3:8.2f} ms  ratios "
                  f"{m['ratio']:5.3f} {m['simulated_ratio']:5.3f}  (communication: plan {p['comm_us'] / 1e3:.2f}, "
                  f"simulated {sim['comm_us'] / 1e3:.2f} of which exposed {sim['exposed_us'] / 1e3:.2f}, "
                  f"measured exposed {q['comm_exposed_us'] / 1e3:.2f} ms)", flush=True)
    summary = []
    for model_of in ("additive", "predicted", "simulated"):
        errors = [abs(r[model_of] / r["measured"] - 1) for r in rows]
        pairs = right = 0
        for a, b in itertools.combinations(rows, 2):
            lo, hi = sorted((a["measured"], b["measured"]))
            if a["model"] != b["model"] or hi <= 1.15 * lo:
                continue
            pairs += 1
            right += (a[model_of] < b[model_of]) == (a["measured"] < b["measured"])
        summary.append(f"{model_of}: median |predicted/measured - 1| {statistics.median(errors):.3f}, order right "
                       f"on {right}/{pairs} pairs > 15% apart")
    return "; ".join(summary)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--models", default="llama,gpt2")
    ap.add_argument("--refine", action="store_true",
                    help="then one closed loop: refine the profile from our first plan's measured steps, plan "
                         "again under it, measure again")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="autoshard-fidelity-"))
    profile = folder / "profile.json"
    print(f"calibrating gloo on (2, {args.nproc // 2}) ...", flush=True)
    print(f"  calibrated in {calibrate(args.nproc, profile):.0f}s: {profile}", flush=True)
    from costmodel import load_profile

    print(f"  overlap share measured: {load_profile(profile).overlap:.2f}", flush=True)
    models = args.models.split(",")
    refined = folder / "refined.json" if args.refine else None
    first = run_round(models, profile, folder, args, refined)
    if not refined:
        print(first)
        return
    print(f"calibrated profile: {first}", flush=True)
    print(f"re-planning and measuring under the refined profile {refined} ...", flush=True)
    again = folder / "again"
    again.mkdir()
    print(f"after one refine loop: {run_round(models, refined, again, args)}")


if __name__ == "__main__":
    main()
