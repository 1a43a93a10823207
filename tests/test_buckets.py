"""The executor's buckets, found on the planned graph, and the plan's simulation with them."""

from collections import namedtuple
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import autoshard
import solver
from autoshard.graph.tracing import PHASE, trace
from autoshard.models import Transformer, TransformerConfig
from autoshard.planning.simulate import run_order, simulate_plan, simulate_step
from autoshard.runtime.buckets import plan_buckets
from autoshard.runtime.program import PlannedProgram
from costmodel import MeshTopology, Spec, load_profile

Edge = namedtuple("Edge", "consumer arg producer out")
R, S0, P = Spec(("R",)), Spec(("S(0)",)), Spec(("P(sum)",))


def _node(shape, phase):
    return SimpleNamespace(meta={"val": torch.empty(shape), "custom": {PHASE: phase}}, op="call_function")


def _graph(nodes, strategies, edges, costs):
    """A planned graph of one strategy per node: ``nodes`` (shape, phase), ``strategies`` (outs,
    ins) specs, ``edges`` (consumer, arg, producer) with a cost each, nodes 10 us."""
    problem = solver.Problem(
        node_costs=[[10.0]] * len(nodes), node_usages=[[1.0]] * len(nodes),
        intervals=[[v, len(nodes)] for v in range(len(nodes))],
        edges=[[p, c] for c, _, p in edges], edge_costs=[np.array([[c]]) for c in costs])
    return SimpleNamespace(
        nodes=[_node(*n) for n in nodes], strategies=[[SimpleNamespace(outs=o, ins=i)] for o, i in strategies],
        edges=[Edge(c, a, p, 0) for c, a, p in edges], problem=problem, copy_of={}, num_originals=len(nodes),
        issue_us=lambda: [0.0] * len(nodes), run_order=lambda: list(range(len(nodes))), bucket_mb=0.0, topo=None)


def _gathers():
    """Three parameters (64 KiB each, sharded) gathered by three forward ops in a chain."""
    nodes = [((128, 128), None)] * 3 + [((128, 128), "forward")] * 3
    strategies = [((S0,), ())] * 3 + [((R,), (R, R))] * 3
    edges = [(3, 0, 0), (4, 0, 1), (4, 1, 3), (5, 0, 2), (5, 1, 4)]
    return _graph(nodes, strategies, edges, [50.0, 50.0, 0.0, 50.0, 0.0])


def test_independent_gathers_share_a_bucket_up_to_the_cap():
    """The parameters' gathers run one after another with one key and read no member's
    consumer: one bucket at their total bytes; a cap below two of them splits it."""
    gp = _gathers()
    topo, prof = MeshTopology((4,), 8), load_profile("h100-sxm")
    choice = np.zeros(6, dtype=int)
    b = plan_buckets(gp, choice, run_order(gp), topo, prof, 25.0)
    assert b.members == [[(0, 0), (1, 0), (3, 0)]]
    one = prof.collective_predictor("all_gather", 4, True)
    assert b.us == [pytest.approx(one(3 * 128 * 128 * 4))]
    assert not b.backward[0]
    capped = plan_buckets(gp, choice, run_order(gp), topo, prof, 1.5 * 128 * 128 * 4 / 2**20)
    assert capped.members == []  # each bucket of one: not a bucket
    assert plan_buckets(gp, choice, run_order(gp), topo, prof, 0.0).members == []


def test_a_collective_that_reads_a_members_consumer_stays_out():
    """The all-reduce into ``b`` reads what ``a`` made, and ``a`` waits for the first
    all-reduce: bucketing them would be a cycle, so each runs alone (Inductor's rule); a third,
    independent one joins the first."""
    nodes = [((64, 64), "backward")] * 6
    strategies = [((P,), ())] + [((P,), (R,))] * 2 + [((P,), ())] + [((R,), (R,))] * 2
    # 0 -> 1 (all_reduce), 1 -> 2 (all_reduce), 3 -> 4 (all_reduce), 2 -> 5 free
    edges = [(1, 0, 0), (2, 0, 1), (4, 0, 3)]
    gp = _graph(nodes, strategies, edges, [30.0, 30.0, 30.0])
    b = plan_buckets(gp, np.zeros(6, dtype=int), run_order(gp), MeshTopology((4,), 8), load_profile("h100-sxm"), 25.0)
    assert b.members == [[(0, 0), (2, 0)]]
    assert b.backward == [True]


def test_the_plan_simulation_charges_one_latency_per_bucket():
    """With the buckets, the gathers cost one collective: the simulated communication drops by
    what they save, and the step with it; the walk still runs every consumer after its data."""
    gp = _gathers()
    gp.topo, gp.profile = MeshTopology((4,), 8), load_profile("h100-sxm")
    choice = np.zeros(6, dtype=int)
    alone = simulate_plan(gp, choice, 0.0)
    gp.bucket_mb = 25.0
    merged = simulate_plan(gp, choice, 0.0)
    b = plan_buckets(gp, choice, run_order(gp), gp.topo, gp.profile, 25.0)
    assert merged.collectives == 1 and alone.collectives == 3
    assert merged.comm_us == pytest.approx(alone.comm_us - b.saved_us)
    assert b.saved_us > 0
    assert merged.step_us == pytest.approx(alone.step_us - b.saved_us)
    assert merged.compute_us == alone.compute_us


@pytest.mark.parametrize("name", ["ddp", "fsdp", "tp", "fsdp_tp"])
def test_the_planned_step_is_the_lowered_programs_step(world, name):
    """On gloo, where each collective's latency is about a millisecond, the plan's own
    prediction follows what runs: its step simulated on the planned graph with the executor's
    buckets is within 5% of the same simulation on the lowered, bucketed and overlapped
    programs (without the buckets, a TP plan's prediction was 30% above it)."""
    world(4)
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(dim=128, n_heads=4, n_layers=2, vocab_size=512))
    inputs = (torch.randint(0, 512, (8, 64)),)
    mesh = autoshard.fake_mesh((2, 2), ("dp", "tp"))
    planner = autoshard.Planner(model, inputs, mesh, profile="cpu-gloo", time_limit=10, memory_budget=None)
    plan = planner.compare([name])[name]
    lowered = simulate_step(PlannedProgram(trace(model, inputs), plan, mesh), 0)
    assert plan.summary["step_us"] == pytest.approx(lowered.step_us, rel=0.05)
