"""Held-out accuracy of calibrated collective costs on gloo, against torch's built-in model.

    python benchmarks/cost_accuracy.py [--nproc 4] [--rounds 1]

Spawns ``nproc`` local gloo processes on a (2, nproc/2) mesh, calibrates on sizes
4 KiB, 16 KiB, ... 4 MiB, then measures held-out sizes 8 KiB, 32 KiB, ... 2 MiB
and predicts them with the fitted profile and with torch's model
(``torch.distributed.tensor._collective_utils``: all_gather / all_reduce /
reduce_scatter on single mesh axes; it has no all_to_all and no flattened
groups). Prints median and p90 absolute relative error for both on the pairs
both can price, ours on everything, and as its last line the ratio of median
errors (ours / torch's).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from costmodel.calibrate import CalibrationConfig, base_profile_for, build_profile, free_port, sweep  # noqa: E402


def _worker(rank, world, port, rounds, out_file):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import _collective_utils as cu

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    calib = CalibrationConfig(min_bytes=4096, max_bytes=4 * 2**20, factor=4, repeats=7, run_seconds=0.05,
                              matmul_size=0)
    held = CalibrationConfig(min_bytes=8192, max_bytes=2 * 2**20, factor=4, repeats=7, run_seconds=0.05,
                             matmul_size=0)
    rows = []
    for r in range(rounds):
        fitted = sweep(mesh, calib, world)
        measured = sweep(mesh, held, world)
        again = sweep(mesh, held, world)  # the same sizes once more: the noise floor
        if rank == 0:
            prof = build_profile(fitted, mesh, base_profile_for("cpu"), "gloo", world)
            topo = cu.MeshTopoInfo.build_from_mesh(mesh)
            torch_fn = {"all_gather": cu.allgather_cost, "all_reduce": cu.allreduce_cost,
                        "reduce_scatter": cu.reduce_scatter_cost}
            by = {}
            for kind, group, n, intra, nbytes, us in measured.samples:
                by.setdefault((kind, group, n, intra, nbytes), []).append(us)
            by2 = {}
            for kind, group, n, intra, nbytes, us in again.samples:
                by2.setdefault((kind, group, n, intra, nbytes), []).append(us)
            for (kind, group, n, intra, nbytes), ts in by.items():
                truth = statistics.median(ts)
                repeat = statistics.median(by2[(kind, group, n, intra, nbytes)])
                ours = prof.collective_predictor(kind, n, intra)(nbytes)
                theirs = None
                if kind in torch_fn and "+" not in group:
                    theirs = torch_fn[kind](nbytes / 2**30, topo, ("dp", "tp").index(group))
                rows.append((r, kind, group, nbytes, truth, ours, theirs, repeat))
    if rank == 0:
        import json

        Path(out_file).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    import json
    import tempfile

    out = tempfile.mktemp(suffix=".json")
    mp.start_processes(_worker, args=(args.nproc, free_port(), args.rounds, out), nprocs=args.nproc,
                       start_method="spawn")
    rows = json.loads(Path(out).read_text())
    err = lambda pred, truth: abs(pred - truth) / truth  # noqa: E731
    print(f"{'round':>5} {'kind':<15} {'group':<7} {'bytes':>9} {'measured us':>12} {'ours us':>9} {'torch us':>9}")
    for r, kind, group, nbytes, truth, ours, theirs, _ in rows:
        t = f"{theirs:9.1f}" if theirs is not None else f"{'-':>9}"
        print(f"{r:>5} {kind:<15} {group:<7} {nbytes:>9} {truth:>12.1f} {ours:>9.1f} {t}")
    ours_all = np.array([err(o, t) for _, _, _, _, t, o, _, _ in rows])
    floor = np.array([err(rep, t) for _, _, _, _, t, _, _, rep in rows])
    both = [(err(o, t), err(th, t)) for _, _, _, _, t, o, th, _ in rows if th is not None]
    ours_b, torch_b = np.array([a for a, _ in both]), np.array([b for _, b in both])
    for r in range(args.rounds):
        e = np.array([err(o, t) for rr, _, _, _, t, o, _, _ in rows if rr == r])
        print(f"round {r}: ours median {np.median(e):.3f} p90 {np.quantile(e, 0.9):.3f} over {e.size} points")
    print(f"noise floor (a second measurement of the held-out sizes vs the first): median "
          f"{np.median(floor):.3f}, p90 {np.quantile(floor, 0.9):.3f}")
    print(f"ours, all {ours_all.size} points: median {np.median(ours_all):.3f}, p90 {np.quantile(ours_all, 0.9):.3f}")
    print(f"on the {len(both)} points torch can price: ours median {np.median(ours_b):.3f} "
          f"p90 {np.quantile(ours_b, 0.9):.3f}; torch median {np.median(torch_b):.3f} "
          f"p90 {np.quantile(torch_b, 0.9):.3f}")
    print(f"ratio of median errors ours/torch: {np.median(ours_b) / np.median(torch_b):.3f}")


if __name__ == "__main__":
    main()
