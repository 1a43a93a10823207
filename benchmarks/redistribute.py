"""Our redistribute planner against torch's ``DTensorRedistributePlanner``, same run.

    python benchmarks/redistribute.py

For a fixed suite of (src, dst) specs with non-default shard orders and partials
on meshes (8, 8), (4, 4, 4), (2, 2, 4, 4), (2, 2, 2, 2, 2): time per path, cold
and cached, for both planners, and the cost of each planner's path under OUR cost
model (torch's path priced step by step). Cold is a new planner object per pair
for both: for ours an empty path cache; the cost model's memo per mesh (collective
times by bytes and group, the heuristic's bound tables by buffer size) is emptied
at each new mesh and then shared, as it is by every planner of one process. Last line: geometric-mean
cold speed ratio (torch / ours) and the number of pairs where our path costs more.
"""

from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor._redistribute import _gen_transform_infos
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from redistribute_cases import all_specs  # noqa: E402

from costmodel import MeshTopology, Spec, load_profile, price_path, torch_path  # noqa: E402
from costmodel._torch_compat import dtensor_spec  # noqa: E402
from costmodel.bounds import mesh_costs  # noqa: E402
from costmodel.redistribute import RedistributePlanner  # noqa: E402

MESHES = [(8, 8), (4, 4, 4), (2, 2, 4, 4), (2, 2, 2, 2, 2)]
SHAPE = (4096, 1024, 64)
PAIRS_PER_MESH = 12


def suite(mesh_ndim: int, rng: random.Random) -> list[tuple[Spec, Spec]]:
    """Pairs that need several steps: multi-axis shards in non-default order, partials."""
    specs = [s for s in all_specs(mesh_ndim, len(SHAPE), partials=("P(sum)",))]
    rich = [s for s in specs if s.shard_order or str(s).count("S(") >= mesh_ndim - 1]
    with_partial = [s for s in specs if "P(" in str(s)]
    pairs = []
    while len(pairs) < PAIRS_PER_MESH:
        src = rng.choice(rich if len(pairs) % 2 else with_partial)
        dst = rng.choice(rich)
        if src != dst:
            pairs.append((src, dst))
    return pairs


def main() -> None:
    profile = load_profile("h100-sxm")
    rng = random.Random(0)
    ratios, costlier = [], 0
    per_mesh = {}
    print(f"{'mesh':<16} {'src':<22} {'dst':<22} {'ours ms':>8} {'cached us':>9} {'torch ms':>9} "
          f"{'t cached us':>11} {'ours us':>9} {'torch us':>9}")
    for mesh_shape in MESHES:
        world = math.prod(mesh_shape)
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        names = tuple("abcde"[: len(mesh_shape)])
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        topo = MeshTopology(mesh_shape, profile.devices_per_node)
        mesh_costs.cache_clear()
        for src, dst in suite(len(mesh_shape), rng):
            ours = RedistributePlanner(topo, profile)  # cold: empty cache
            t0 = time.perf_counter()
            plan = ours.plan(src, dst, SHAPE, 4)
            ours_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(100):
                ours.plan(src, dst, SHAPE, 4)
            ours_cached = (time.perf_counter() - t0) / 100
            ss, ds = dtensor_spec(src, mesh, SHAPE), dtensor_spec(dst, mesh, SHAPE)
            t0 = time.perf_counter()
            path = torch_path(mesh, src, dst, SHAPE)
            torch_s = time.perf_counter() - t0
            _gen_transform_infos(ss, ds, True)
            t0 = time.perf_counter()
            for _ in range(100):
                _gen_transform_infos(ss, ds, True)
            torch_cached = (time.perf_counter() - t0) / 100
            torch_cost = sum(price_path(ours, path, SHAPE, 4))
            if plan.us > torch_cost + 1e-6:
                costlier += 1
            ratios.append(torch_s / ours_s)
            per_mesh.setdefault(mesh_shape, []).append((ours_s, torch_s))
            print(f"{str(mesh_shape):<16} {str(src):<22} {str(dst):<22} {ours_s * 1e3:>8.2f} "
                  f"{ours_cached * 1e6:>9.2f} {torch_s * 1e3:>9.2f} {torch_cached * 1e6:>11.2f} "
                  f"{plan.us:>9.1f} {torch_cost:>9.1f}", flush=True)
    for mesh_shape, rows in per_mesh.items():
        g = math.exp(sum(math.log(t / o) for o, t in rows) / len(rows))
        print(f"mesh {str(mesh_shape):<16} ours cold max {max(o for o, _ in rows) * 1e3:.2f} ms, "
              f"mean {sum(o for o, _ in rows) / len(rows) * 1e3:.2f} ms; torch mean "
              f"{sum(t for _, t in rows) / len(rows) * 1e3:.2f} ms; geomean torch/ours {g:.1f}x")
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"pairs {len(ratios)}; ours costlier than torch's path in {costlier}")
    print(f"geomean cold speed ratio torch/ours: {geo:.1f}x; pairs where ours costs more: {costlier}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
