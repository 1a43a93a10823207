"""Pipeline planning: stages cut by torch's splitter and planned on the sub-mesh, the schedule's
step from their times, each rank's memory with its in-flight microbatches, and the plan file."""

import pytest
import torch

import autoshard
from autoshard.errors import ConfigError, MemoryBudgetError
from autoshard.graph.layers import layer_groups
from autoshard.models import llama
from autoshard.planning.pipeline import PipelinePlan, balanced_partition, plan_pipeline, split_stages, stage_plan
from autoshard.planning.schedule import simulate


def _model(layers=6, vocab=4096):
    with torch.device("meta"):
        return llama("tiny", dim=128, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=vocab,
                     max_seq_len=64)


def _tokens(batch=16):
    return torch.empty(batch, 64, dtype=torch.long, device="meta")


def _loss(out):
    return out.float().pow(2).mean()


@pytest.fixture(scope="module")
def planned():
    from conftest import use_world

    use_world(64)
    mesh = autoshard.fake_mesh((4, 4, 4), ("pp", "dp", "tp"))
    return plan_pipeline(_model(), (_tokens(),), mesh, axis="pp", microbatches=8, profile="h100-sxm",
                         loss_fn=_loss, time_limit=600)


def test_balanced_partition_gives_the_heavy_ends_fewer_layers():
    assert balanced_partition(8, 4, 1.0) == [2, 2, 2, 2]
    # A head worth 1.5 layers: the last stage takes one layer; of the partitions whose slowest
    # stage is 3, the most even.
    assert balanced_partition(8, 4, 1.0, 0.0, 1.5) == [2, 3, 2, 1]
    counts = balanced_partition(30, 4, 1.0, 2.0, 6.0)
    # 38 layers of work on 4 stages: 9.5 each at best, so 10 with whole layers.
    assert sum(counts) == 30 and max(counts[0] + 2, counts[-1] + 6, *counts[1:-1]) == 10
    with pytest.raises(ConfigError, match="at least as many repeated layers"):
        balanced_partition(3, 4, 1.0)


def test_the_step_is_the_schedule_of_the_stages_times(planned):
    pp = planned
    assert [s.rank for s in pp.stages] == [0, 1, 2, 3]
    assert sum(s.layers[1] - s.layers[0] for s in pp.stages) == 6
    again = simulate("1f1b", 4, 8, [s.forward_us for s in pp.stages], [s.backward_us for s in pp.stages],
                     [s.send_us for s in pp.stages])
    assert pp.step_us == pytest.approx(again.step_us)
    assert pp.step_us > 8 * max(s.forward_us + s.backward_us for s in pp.stages)
    assert all(s.send_us > 0 for s in pp.stages[:-1]) and pp.stages[-1].send_us == 0
    # Each stage's time is its plan's step, cut at its forward's share.
    for s in pp.stages:
        assert s.forward_us + s.backward_us == pytest.approx(s.plan.summary["step_us"], rel=1e-6)
        assert 0 < s.forward_us < s.backward_us


def test_each_rank_holds_its_in_flight_microbatches(planned):
    """1F1B: stage s keeps p - s microbatches; each stage is solved holding the most its stages
    alike hold (the middle ones: 3), so its plan's peak counts them, and the gradients it
    accumulates unreduced (solved for 8 microbatches: nothing is added beside the peak)."""
    pp = planned
    assert pp.run.in_flight == [4, 3, 2, 1]
    held = [4, 3, 3, 1]
    for s in pp.stages:
        assert s.activation_bytes > 0
        assert s.plan.summary["memory"]["saved_bytes"] == pytest.approx(held[s.index] * s.activation_bytes)
        assert s.gradient_bytes == 0 and s.plan.summary["memory"]["at_peak"].get("gradients", 0) > 0
        assert pp.memory_bytes[s.rank] == pytest.approx(s.plan.summary["peak_mem_bytes"])
        assert pp.memory_bytes[s.rank] <= pp.budget_bytes


def test_stages_alike_are_solved_once_and_named_for_their_layers(planned):
    pp = planned
    by_kind = {}
    for s in pp.stages:
        by_kind.setdefault((s.role, s.layers[1] - s.layers[0]), set()).add(id(s.plan))
    assert all(len(ids) == 1 for ids in by_kind.values())
    # Their modules: torch's split of the model at the same layers.
    model = _model()
    group = layer_groups(model)[0]
    counts = [s.layers[1] - s.layers[0] for s in pp.stages]
    modules = split_stages(model, (torch.zeros(2, 64, dtype=torch.long, device="meta"),), group, counts)
    for s, mod in zip(pp.stages, modules):
        names = {n for n, _ in mod.named_parameters()}
        assert names == {f for f in stage_plan(pp, s).params if f in names} and names <= set(stage_plan(pp, s).params)
    # The model is left as given: splitting it again works.
    split_stages(model, (torch.zeros(2, 64, dtype=torch.long, device="meta"),), group, [1, 2, 2, 1])
    # Every stage but the first computes its input's gradient (sent back).
    assert [s.plan.model.get("input_grads") for s in pp.stages] == [None, [0], [0], [0]]


def test_the_plan_file_round_trips(planned, tmp_path):
    pp = planned
    pp.save(tmp_path / "pp.json")
    back = PipelinePlan.load(tmp_path / "pp.json")
    assert back.to_json() == pp.to_json()
    assert "pipeline over 'pp'" in back.describe() and "bubble" in back.describe()


def test_interleaved_stages_share_a_rank(world):
    world(64)
    mesh = autoshard.fake_mesh((2, 4, 8), ("pp", "dp", "tp"))
    pp = plan_pipeline(_model(8), (_tokens(),), mesh, axis="pp", microbatches=4, schedule="interleaved_1f1b",
                       stages_per_rank=2, profile="h100-sxm", loss_fn=_loss, time_limit=600)
    assert [s.rank for s in pp.stages] == [0, 1, 0, 1]
    one = plan_pipeline(_model(8), (_tokens(),), mesh, axis="pp", microbatches=4, profile="h100-sxm",
                        loss_fn=_loss, time_limit=600)
    assert pp.run.bubble < one.run.bubble


def test_bad_pipelines_are_refused_with_values(world):
    world(64)
    mesh = autoshard.fake_mesh((4, 16), ("pp", "dp"))
    with pytest.raises(ConfigError, match="'cp' is not an axis"):
        plan_pipeline(_model(), (_tokens(),), mesh, axis="cp", microbatches=4)
    with pytest.raises(ConfigError, match=r"batch \(16\) is not divisible by microbatches \(6\)"):
        plan_pipeline(_model(), (_tokens(),), mesh, axis="pp", microbatches=6)
    with pytest.raises(ConfigError, match="4 stages need at least as many repeated layers, found 3"):
        plan_pipeline(_model(3), (_tokens(),), mesh, axis="pp", microbatches=4)
    with pytest.raises(ConfigError, match="expected 4 counts"):
        plan_pipeline(_model(), (_tokens(),), mesh, axis="pp", microbatches=4, layers_per_stage=[3, 3])


def test_a_budget_below_the_in_flight_microbatches_says_what_it_needs(world):
    world(64)
    mesh = autoshard.fake_mesh((4, 16), ("pp", "dp"))
    with pytest.raises(MemoryBudgetError) as info:
        plan_pipeline(_model(), (_tokens(64),), mesh, axis="pp", microbatches=16, profile="h100-sxm",
                      loss_fn=_loss, memory_budget=2**19, time_limit=20)
    assert "pipeline" in str(info.value) and info.value.budget_bytes == 2**19
    assert info.value.min_feasible_bytes > info.value.budget_bytes


def test_in_flight_charges_what_the_forward_keeps_for_the_backward(world):
    """PlanOptions(in_flight=n): the rows charge n times the forward values live when the
    backward starts, nothing else; the plan's account then reports n microbatches' worth."""
    world(64)
    mesh = autoshard.fake_mesh((4, 16), ("dp", "tp"))
    model, tokens = _model(2), _tokens(64)
    one = autoshard.Planner(model, (tokens,), mesh, profile="h100-sxm", loss_fn=_loss)
    three = autoshard.Planner(model, (tokens,), mesh, profile="h100-sxm", loss_fn=_loss, in_flight=3)
    a, b = one.built.problem.node_usages, three.built.problem.node_usages
    scaled = [v for v in range(len(a)) if not (a[v] == b[v]).all()]
    assert scaled and all((b[v] == 3 * a[v]).all() for v in scaled)
    from autoshard.graph.tracing import node_phase

    assert all(node_phase(one.built.nodes[v]) == "forward" for v in scaled)
    pinned = {"pins": {"*": "RR"}, "seed_baselines": False}
    p1, p3 = one.solve(**pinned), three.solve(**pinned)
    # (The two solves may split an activation differently: within 0.1%.)
    assert p3.summary["memory"]["saved_bytes"] == pytest.approx(3 * p1.summary["memory"]["saved_bytes"], rel=1e-3)
    assert p1.summary["memory"]["saved_bytes"] > 0


def test_hand_written_stages_are_the_baselines_pins(world):
    """baseline="fsdp_tp": every stage FSDP on dp and TP on tp (torchtitan's FSDP + TP + PP), its
    activations solved under those pins; our stages, solved, are no slower."""
    from autoshard.planning.baselines import baseline_pins

    world(64)
    mesh = autoshard.fake_mesh((4, 4, 4), ("pp", "dp", "tp"))
    kw = dict(axis="pp", microbatches=4, profile="h100-sxm", loss_fn=_loss, time_limit=600)
    ours = plan_pipeline(_model(), (_tokens(),), mesh, **kw)
    hand = plan_pipeline(_model(), (_tokens(),), mesh, baseline="fsdp_tp",
                         layers_per_stage=[s.layers[1] - s.layers[0] for s in ours.stages], **kw)
    for s in hand.stages:
        plan = stage_plan(hand, s)
        model = _model()
        group = layer_groups(model)[0]
        counts = [t.layers[1] - t.layers[0] for t in hand.stages]
        mod = split_stages(model, (torch.zeros(2, 64, dtype=torch.long, device="meta"),), group, counts)[s.index]
        pins, _ = baseline_pins("fsdp_tp", mod, 2, (4, 4))
        assert all(plan.param_spec(f) == spec for f, spec in pins.items())
    assert ours.step_us <= hand.step_us * 1.0001


def test_microbatches_charge_each_gradient_move_and_held_gather_once_per_step(world):
    """PlanOptions(microbatches=m): the edges moving gradients to their parameters' specs and
    the parameters into the views that keep them for the backward (the gathered weights) cost
    1/m (the stage makes those moves once per step), and those views and the gradients live the
    whole step; no other edge or interval changes. pipeline_times prices the reduction whole, once."""
    from autoshard.planning.problem import accumulated, gathered_once

    world(64)
    mesh = autoshard.fake_mesh((4, 16), ("dp", "tp"))
    model, tokens = _model(2), _tokens(64)
    one = autoshard.Planner(model, (tokens,), mesh, profile="h100-sxm", loss_fn=_loss)
    four = autoshard.Planner(model, (tokens,), mesh, profile="h100-sxm", loss_fn=_loss, microbatches=4)
    held = set(gathered_once(four.built, four.traced))
    # Each layer's seven matmul weights, and the head's (the rotary tables' views besides).
    assert sum(four.built.nodes[v].name.startswith("t") for v in held) >= 2 * 7 + 1
    moved = gathers = 0
    for e, a, b in zip(one.built.edges, one.built.problem.edge_costs, four.built.problem.edge_costs):
        if e.arg < 0 or (e.arg == 0 and e.consumer in held):
            assert b == pytest.approx(a / 4)
            moved += int(e.arg < 0 and (a > 0).any())
            gathers += int(e.arg == 0 and (a > 0).any())
        else:
            assert (a == b).all()
    assert moved > 0 and gathers > 0
    # The held views and the gradients' accumulation buffers live over the whole step.
    whole = held | set(accumulated(four.built, four.traced))
    iv1, iv4 = one.built.problem.intervals, four.built.problem.intervals
    end = iv4[:, 1].max()
    assert len(whole) > len(held) and all(tuple(iv4[v]) == (0, end) for v in whole)
    assert all((iv1[v] == iv4[v]).all() for v in range(len(iv1)) if v not in whole)
    ddp = {"pins": {"*": "RR"}, "seed_baselines": False}
    p1, p4 = one.solve(**ddp), four.solve(**ddp)
    (_, _, r1), (f4, b4, r4) = one.pipeline_times(p1), four.pipeline_times(p4)
    # The same parameters' gradients moved whole in both (the activations' splits may differ).
    assert r1 > 0 and r4 == pytest.approx(r1, rel=0.2)
    # The amortized plan's own step carries a quarter of its moves at most.
    assert p4.summary["step_us"] - (f4 + b4) <= r4 / 4 * 1.01


def test_weights_held_for_the_step_are_not_recomputed(world):
    """With several microbatches a parameter's view is held (gathered once) or aliases its
    parameter: recomputing it in the backward would only gather again. One microbatch: full
    recomputation replays the layers' weight views too (FSDP's gather again in the backward)."""
    from autoshard.graph.recompute import parameter_views

    world(64)
    mesh = autoshard.fake_mesh((4, 16), ("dp", "tp"))
    model, tokens = _model(2), _tokens(64)
    recomputed = {}
    for m in (1, 4):
        planner = autoshard.Planner(model, (tokens,), mesh, profile="h100-sxm", loss_fn=_loss, microbatches=m)
        rc = planner.variant("full")[0]
        recomputed[m] = {x for names in rc.nodes.values() for x in names}
        views = {n.name for n in parameter_views(planner.traced)}
    assert len(views) >= 2 * 7 and recomputed[4]
    assert views & recomputed[1] and not views & recomputed[4]


def test_a_recut_is_estimated_from_the_stages_solved():
    """The cost-balanced re-cut is solved only where the stages solved estimate it shorter: a
    stage solved is its own answer; a middle one of another count is the nearest middle scaled
    per layer; a first or last one is its role's nearest plus or minus that many middle layers."""
    import importlib

    pipeline = importlib.import_module("autoshard.planning.pipeline")
    n = 4

    def key_of(k, counts):
        return ("first" if k == 0 else "last" if k == n - 1 else "middle"), counts[k]

    # (plan, forward, backward, activation bytes, reduction, gradient bytes, first layer)
    solved = {("first", 3): ("p0", 40.0, 80.0, 1, 9.0, 0, 0), ("middle", 4): ("p1", 40.0, 80.0, 1, 8.0, 0, 0),
              ("last", 3): ("p3", 50.0, 100.0, 1, 9.0, 0, 0)}
    got = pipeline._estimated([2, 5, 4, 3], solved, key_of, n)
    assert got[2] is solved[("middle", 4)] and got[3] is solved[("last", 3)]
    assert got[0][1:3] == pytest.approx((40.0 - 10.0, 80.0 - 20.0)) and got[0][4] == pytest.approx(7.0)
    assert got[1][1:3] == pytest.approx((50.0, 100.0)) and got[1][4] == pytest.approx(10.0)
    assert got[1][0] == "p1"


def test_a_stage_solve_counts_its_trace_and_build_in_its_share(world):
    """A stage given ``seconds`` is solved in what its trace and build left of them (as ``plan()``
    is), so the rounds of stages end within the pipeline's time limit."""
    import time

    from autoshard.planning import pipeline as pipeline_mod
    from autoshard.planning.planner import ASSEMBLY_OF_BUILD

    world(4)
    asked = []

    class Building:
        phases = {"build_s": 0.2}

        def __init__(self, *args, **kwargs):
            time.sleep(0.3)  # its trace and build

        def solve(self, time_limit=None):
            asked.append(time_limit)
            return type("P", (), {"summary": {"memory": {"saved_bytes": 0}}, "redistributes": []})()

        def pipeline_times(self, plan):
            return 1.0, 2.0, 0.0

    mesh = autoshard.fake_mesh((2, 2), ("dp", "tp"))
    pipeline_mod.solve_stage(Building, torch.nn.Linear(2, 2), (torch.zeros(2, 2),), mesh, {}, "middle", 10.0,
                              None, None, 1, 2)
    assert asked and asked[0] <= 10.0 - 0.3 - ASSEMBLY_OF_BUILD * 0.2 + 1e-6 and asked[0] > 8.0
