"""The redistribute planner: exhaustive execution on LocalTensorMode, costs, errors."""

import itertools
import random
from collections import Counter

import numpy as np
import pytest
import torch
from redistribute_cases import all_specs
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor._redistribute import (
    disable_redistribute_transform_optimization,
    redistribute_local_tensor,
)
from torch.distributed.tensor.debug import CommDebugMode

from costmodel import MeshTopology, Spec, load_profile
from costmodel._torch_compat import dtensor_spec
from costmodel.executor import execute_plan
from costmodel.redistribute import RedistributePlanner
from costmodel.states import RedistributeError

PROFILE = load_profile("h100-sxm")
# Op names CommDebugMode records for each kind (DTensor's all_to_all is its own shard_dim_alltoall op).
_FUNCOL = {"all_gather": ("all_gather_into_tensor",), "reduce_scatter": ("reduce_scatter_tensor",),
           "all_reduce": ("all_reduce",), "all_to_all": ("alltoall", "all_to_all")}


def _rank_values(t):
    return t._local_tensors if hasattr(t, "_local_tensors") else {0: t}


def check_pairs(world, mesh_shape, shape, pairs):
    import math

    world(math.prod(mesh_shape))
    names = tuple("abcde"[: len(mesh_shape)])
    planner = RedistributePlanner(MeshTopology(mesh_shape, 8), PROFILE)
    with LocalTensorMode(math.prod(mesh_shape)):
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        torch.manual_seed(0)
        full = torch.randn(shape)
        rep = Spec(("R",) * len(mesh_shape))
        cache = {}

        def local_of(spec):
            if spec not in cache:
                cache[spec] = redistribute_local_tensor(full, dtensor_spec(rep, mesh, shape),
                                                        dtensor_spec(spec, mesh, shape))
            return cache[spec]

        for src, dst in pairs:
            plan = planner.plan(src, dst, shape, 4)
            with CommDebugMode() as comm:
                out = execute_plan(local_of(src), plan, mesh, shape)
            if "P(" in str(dst):
                # Partial values are not unique per rank: compare what they reduce to. DTensor's
                # flattened-merge optimization gathers nested uneven shards wrongly (torch 2.13:
                # S(1)S(1)R -> RRR of a size-5 dim on (2, 2, 2)), so the reference runs without it.
                with disable_redistribute_transform_optimization():
                    back = redistribute_local_tensor(out, dtensor_spec(dst, mesh, shape),
                                                     dtensor_spec(rep, mesh, shape))
                for r, v in _rank_values(back).items():
                    torch.testing.assert_close(v, full, msg=f"{src} -> {dst} rank {r}: {plan.describe()}")
            else:
                ref = local_of(dst)
                for r, v in _rank_values(out).items():
                    # Exact but for summation order when partials are reduced (merged or nested).
                    torch.testing.assert_close(v, _rank_values(ref)[r], rtol=1e-6, atol=1e-6,
                                               msg=f"{src} -> {dst} rank {r}: {plan.describe()}")
            issued = Counter()
            for op, n in comm.get_comm_counts().items():
                name = str(op)
                for kind, fns in _FUNCOL.items():
                    if any(fn in name for fn in fns):
                        issued[kind] += n
            planned = Counter(s.kind for s in plan.steps if s.kind in _FUNCOL)
            assert issued == planned, f"{src} -> {dst}: issued {dict(issued)}, planned {plan.describe()}"


def test_every_pair_on_2x2(world):
    specs = all_specs(2, 2)
    check_pairs(world, (2, 2), (4, 6), list(itertools.product(specs, specs)))


def test_every_pair_on_2x2_uneven(world):
    specs = all_specs(2, 2, partials=("P(sum)",))
    check_pairs(world, (2, 2), (3, 5), list(itertools.product(specs, specs)))


@pytest.mark.slow
@pytest.mark.parametrize("part", range(6))
def test_every_pair_on_2x2x2(world, part):
    # Every placement and shard order with P(sum); P(avg) is covered by the random pairs below
    # (all 159^2 pairs with both partials take ~8 minutes here). Six parts, so that parallel
    # test processes share the ~5 minutes this takes on one core.
    specs = all_specs(3, 2, partials=("P(sum)",))
    check_pairs(world, (2, 2, 2), (4, 8), list(itertools.product(specs, specs))[part::6])


def test_random_pairs_with_avg_on_2x2x2_uneven(world):
    specs = all_specs(3, 2)
    rng = random.Random(0)
    check_pairs(world, (2, 2, 2), (6, 5), [(rng.choice(specs), rng.choice(specs)) for _ in range(250)])


@pytest.mark.slow
def test_random_pairs_on_2x2x2x2(world):
    specs = all_specs(4, 3, partials=("P(sum)",))
    rng = random.Random(1)
    check_pairs(world, (2, 2, 2, 2), (4, 8, 3), [(rng.choice(specs), rng.choice(specs)) for _ in range(150)])


def test_costs_bytes_and_groups():
    topo = MeshTopology((8, 8), 8)
    planner = RedistributePlanner(topo, PROFILE)
    # S(0)S(0) in either order -> R R needs two gathers, the last axis of the order first.
    plan = planner.plan(Spec.parse("S(0)[1,0]S(0)"), Spec.parse("RR"), (1024, 1024), 4)
    assert [(s.kind, s.axes) for s in plan.steps] == [("all_gather", (0,)), ("all_gather", (1,))]
    assert plan.steps[0].nbytes == 1024 * 1024 * 4 // 8 and plan.steps[1].nbytes == 1024 * 1024 * 4
    # On one node the default order gathers both axes in one collective over the flattened group.
    one_node = RedistributePlanner(MeshTopology((2, 4), 8), PROFILE)
    plan = one_node.plan(Spec.parse("S(0)S(0)"), Spec.parse("RR"), (1024, 1024), 4)
    assert [(s.kind, s.axes) for s in plan.steps] == [("all_gather", (0, 1))]
    # Across nodes a multi-step path can beat both plain gathers (it is searched, not assumed).
    plan = planner.plan(Spec.parse("S(0)S(0)"), Spec.parse("RR"), (1024, 1024), 4)
    naive = sum(planner.transition_cost(a, b, (1024, 1024), 4) for a, b in [
        (Spec.parse("S(0)S(0)"), Spec.parse("S(0)R")), (Spec.parse("S(0)R"), Spec.parse("RR"))])
    assert plan.us <= naive + 1e-9
    # Local steps are free.
    assert planner.plan(Spec.parse("RR"), Spec.parse("S(1)S(0)"), (64, 64), 4).us < 1e-3
    # Never costlier than going without merged steps.
    plain = RedistributePlanner(topo, PROFILE, merge=False)
    specs = all_specs(2, 2)
    for src, dst in itertools.product(specs[::3], specs[::3]):
        assert planner.plan(src, dst, (64, 64), 4).us <= plain.plan(src, dst, (64, 64), 4).us + 1e-9


def test_heuristic_keeps_optimum():
    topo = MeshTopology((2, 2, 4), 8)
    astar = RedistributePlanner(topo, PROFILE)
    dijkstra = RedistributePlanner(topo, PROFILE, use_heuristic=False)
    specs = all_specs(3, 2)
    rng = random.Random(3)
    for _ in range(200):
        src, dst = rng.choice(specs), rng.choice(specs)
        assert astar.plan(src, dst, (64, 32), 2).us == pytest.approx(dijkstra.plan(src, dst, (64, 32), 2).us)
    assert astar.stats["expanded"] < dijkstra.stats["expanded"]


@pytest.mark.parametrize("profile,shape", [(PROFILE, (4096, 1024, 64)), (PROFILE, (96, 20, 7)),
                                           (load_profile("cpu-gloo"), (512, 256, 8))])
def test_cover_heuristic_admissible_on_4d(profile, shape):
    """A* with the cover bound finds Dijkstra's optimum on a 4-D mesh spanning two nodes, for
    bandwidth-bound, uneven, and calibrated (knotted, measured) costs."""
    topo = MeshTopology((2, 2, 2, 2), 4)
    dijkstra = RedistributePlanner(topo, profile, use_heuristic=False)
    specs = all_specs(4, 3, partials=("P(sum)",))
    rng = random.Random(7)
    for _ in range(4):
        src = rng.choice(specs)
        dsts = rng.sample(specs, 12)
        truth = dijkstra.costs(src, dsts, shape, 4)
        for dst, want in zip(dsts, truth):
            astar = RedistributePlanner(topo, profile)
            got = astar.plan(src, dst, shape, 4)
            assert got.us == pytest.approx(want, rel=1e-9, abs=1e-6), f"{src} -> {dst}: {got.describe()}"


@pytest.mark.parametrize("profile", ["h100-sxm", "cpu-gloo"])
@pytest.mark.parametrize("mesh_shape,shape", [((2, 2), (8, 6, 5)), ((4, 2), (64, 32, 3)), ((2, 2, 2), (16, 12, 6))])
def test_astar_matches_dijkstra_on_every_pair(profile, mesh_shape, shape):
    """Pairs of specs (partials included; every source on 2-D meshes, 12 on (2, 2, 2)): A* with its bound, upper bound
    and pruning finds the cost of exhaustive Dijkstra with every move. On the calibrated gloo
    profile merged collectives can be cheaper than single ones, which breaks rules that look
    safe under alpha-beta costs (a free chunk taken early can block a cheaper merged gather)."""
    prof = load_profile(profile)
    topo = MeshTopology(mesh_shape, 4)
    specs = all_specs(len(mesh_shape), len(shape), partials=("P(sum)",))
    reference = RedistributePlanner(topo, prof, use_heuristic=False)
    sources = specs if len(specs) < 100 else random.Random(1).sample(specs, 12)  # (2, 2, 2): 12 x 291
    for src in sources:
        for dst, want in zip(specs, reference.costs(src, specs, shape, 4)):
            got = RedistributePlanner(topo, prof).plan(src, dst, shape, 4)
            assert got.us == pytest.approx(want, rel=1e-9, abs=1e-6), f"{src} -> {dst}: {got.describe()}"


@pytest.mark.parametrize("mesh_shape,shape", [((2, 2, 2), (16, 12, 6)), ((2, 2, 2, 2), (8, 6, 5))])
def test_cost_matrix_matches_per_source_search(mesh_shape, shape):
    """The state graph searched by scipy (cost_matrix, costs) gives the per-source search's costs
    (a graph limit of one state forces that search), and both agree with A* on sampled pairs."""
    prof = load_profile("h100-sxm")
    topo = MeshTopology(mesh_shape, 4)
    specs = all_specs(len(mesh_shape), len(shape), partials=("P(sum)",))
    rng = random.Random(3)
    srcs, dsts = rng.sample(specs, 8), rng.sample(specs, 40)
    fast = RedistributePlanner(topo, prof).cost_matrix(srcs, dsts, shape, 4)
    slow = RedistributePlanner(topo, prof, use_heuristic=False, max_graph_states=1)
    want = np.array([slow.costs(s, dsts, shape, 4) for s in srcs])
    np.testing.assert_allclose(fast, want, rtol=1e-9, atol=1e-6)
    for i, j in [(0, 0), (3, 17), (7, 39)]:
        assert fast[i, j] == pytest.approx(RedistributePlanner(topo, prof).plan(srcs[i], dsts[j], shape, 4).us,
                                           rel=1e-9, abs=1e-6)


def test_bad_input():
    planner = RedistributePlanner(MeshTopology((2, 2), 8), PROFILE)
    with pytest.raises(RedistributeError, match="has 3 placements, the mesh has 2 axes"):
        planner.plan(Spec.parse("RRR"), Spec.parse("RR"), (4, 4), 4)
    with pytest.raises(ValueError, match="must list exactly the axes"):
        Spec(("S(0)", "R"), ((0, (1, 0)),))
    with pytest.raises(RedistributeError, match="shards tensor dim 2, the tensor has 2 dims"):
        planner.plan(Spec.parse("S(2)R"), Spec.parse("RR"), (4, 4), 4)
    # A different reduce op is reached through a reduction, never by reinterpreting partial values.
    plan = planner.plan(Spec.parse("P(max)R"), Spec.parse("P(sum)R"), (4, 4), 4)
    assert [s.kind for s in plan.steps] == ["all_reduce", "partition"]
    with pytest.raises(RedistributeError, match="mixes partial kinds"):
        planner.plan(Spec.parse("RR"), Spec.parse("P(max)P(sum)"), (4, 4), 4)


def test_a_cpu_mesh_runs_all_to_all_as_a_gather_and_cpu_profiles_price_it_so(world):
    """DTensor moves a shard between dims on a CPU mesh (outside LocalTensorMode) by gathering
    every rank's whole shard and keeping a chunk: an all_gather of group-size times the
    all_to_all's bytes. A profile calibrated on CPUs says so (``all_to_all_by_gather``) and prices
    it as that gather; GPU profiles price the all_to_all's own fit. Should torch's fallback go,
    this fails and the flag should go with it."""
    from torch.distributed.tensor import DTensor, Shard

    world(2)
    mesh = init_device_mesh("cpu", (2,))
    x = DTensor.from_local(torch.randn(4, 8), mesh, [Shard(0)], run_check=False)
    with CommDebugMode() as comm:
        x.redistribute(mesh, [Shard(1)])
    names = [str(op) for op, n in comm.get_comm_counts().items() if n]
    assert any("all_gather" in n for n in names) and not any("all_to_all" in n or "alltoall" in n for n in names)
    cpu = load_profile("cpu-gloo")
    assert cpu.all_to_all_by_gather and not PROFILE.all_to_all_by_gather
    for nbytes in (2**10, 2**20):
        assert cpu.collective_predictor("all_to_all", 4, True)(nbytes) == \
            cpu.collective_predictor("all_gather", 4, True)(4 * nbytes)
    assert PROFILE.collective_predictor("all_to_all", 4, True)(2**20) < \
        PROFILE.collective_predictor("all_gather", 4, True)(4 * 2**20)


@pytest.mark.parametrize("shape", [(8, 16, 4), (1, 16, 4), (4, 1, 8), (1, 1, 8)])
def test_a_step_pays_the_copy_torch_makes_around_its_collective(shape):
    """A gather along dim d > 0 pays a copy of its output exactly where torch's functional
    all_gather concatenates (torch._utils._maybe_view_chunk_cat returns no view of its input), a
    reduce_scatter onto d > 0 a copy of its input (it always concatenates chunks), read and
    written at the profile's copy bandwidth; along dim 0 neither copies."""
    from torch._utils import _maybe_view_chunk_cat

    planner = RedistributePlanner(MeshTopology((4,), 8), PROFILE)
    per_byte = 2.0 / (PROFILE.bandwidth_gbps() * 1e3)
    full = 4 * int(np.prod(shape))
    for d in range(len(shape)):
        if shape[d] % 4:
            continue
        gather = planner.plan(Spec.parse(f"S({d})"), Spec.parse("R"), shape, 4).steps
        assert [s.kind for s in gather] == ["all_gather"]
        local = list(shape)
        local[d] //= 4
        res = torch.empty([4 * local[0]] + local[1:])  # NCCL's output: the shards joined along dim 0
        viewed = d == 0 or _maybe_view_chunk_cat(res, 4, d).data_ptr() == res.data_ptr()
        assert gather[0].copy_us == pytest.approx(0.0 if viewed else full * per_byte), (shape, d)
        assert gather[0].us == pytest.approx(planner._time("all_gather", full, (0,)) + gather[0].copy_us)
        scatter = planner.plan(Spec.parse("P(sum)"), Spec.parse(f"S({d})"), shape, 4).steps
        assert [s.kind for s in scatter] == ["reduce_scatter"]
        assert scatter[0].copy_us == pytest.approx(0.0 if d == 0 else full * per_byte), (shape, d)
