"""End-to-end planning time for a LLaMA-3-8B-shaped model on a fake (8, 8) mesh.

    python benchmarks/plan_time.py [--layers 2,8,32]

LLaMA-3-8B shape: hidden 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256,
sequence 2048, global batch 64, on the meta device (no weights materialized), on
a fake 64-rank process group. Prints the time per phase (trace, strategies and
costs, solve, plan assembly) and peak RSS for 2, 8 and 32 layers: with layer
ties the solver sees one layer, so the solve should stay nearly flat.

Reference (the issue's measurement, same kind of 2-core machine, torch 2.13 CPU):
meta-pytorch/autoparallel took 252 s end to end for 32 layers (trace 40 s,
placement options 35 s, ILP build 56 s, CBC solve 91 s; 4.4 GB peak) and 135 s
for 2 layers. Its code is not vendored here, so the ratio is against those figures.
Last line: the 32-layer end-to-end seconds.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoshard  # noqa: E402
from autoshard.models import llama  # noqa: E402

AUTOPARALLEL_S = {2: 135.0, 32: 252.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="2,8,32")
    ap.add_argument("--profile", default="h100-sxm")
    args = ap.parse_args()
    mesh = autoshard.fake_mesh((8, 8), ("dp", "tp"))
    rows = []
    for n_layers in [int(x) for x in args.layers.split(",")]:
        with torch.device("meta"):
            model = llama("8b", n_layers=n_layers)
        tokens = torch.empty(64, 2048, dtype=torch.long, device="meta")
        t0 = time.perf_counter()
        plan = autoshard.plan(model, (tokens,), mesh, profile=args.profile, time_limit=120)
        total = time.perf_counter() - t0
        ph = plan.summary["phases"]
        rows.append((n_layers, total, ph, plan.summary["graph_nodes"], plan.solver.get("variables"),
                     plan.solver["status"], plan.summary["step_us"]))
        print(f"layers={n_layers:3d} total={total:6.2f}s trace={ph['trace_s']:.2f}s build={ph['build_s']:.2f}s "
              f"solve={ph['solve_s']:.2f}s assemble={ph['assemble_s']:.2f}s graph_nodes={rows[-1][3]} "
              f"milp_vars={rows[-1][4]} status={rows[-1][5]} step={rows[-1][6] / 1e3:.1f}ms "
              f"peak_rss={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f}GB", flush=True)
    for n_layers, total, *_ in rows:
        if n_layers in AUTOPARALLEL_S:
            print(f"layers={n_layers}: ours {total:.1f}s vs autoparallel {AUTOPARALLEL_S[n_layers]:.0f}s "
                  f"(ratio ours/theirs {total / AUTOPARALLEL_S[n_layers]:.3f})")
    last = rows[-1]
    print(f"{last[0]}-layer end-to-end seconds: {last[1]:.2f}")


if __name__ == "__main__":
    main()
