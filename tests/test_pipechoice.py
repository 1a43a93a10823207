"""Pipelining allowed: the plan with stages over an axis and the plan without, made side by side
(or one after the other), the faster kept and both recorded."""

import pytest
import torch

import autoshard
from autoshard.errors import ConfigError
from autoshard.models import llama
from autoshard.planning import pipechoice
from autoshard.planning.pipechoice import plan_or_pipeline
from autoshard.planning.pipeline import PipelinePlan, plan_pipeline


def _model(layers=6, dim=128, ffn=256, vocab=4096, seq=64):
    with torch.device("meta"):
        return llama("tiny", dim=dim, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=ffn, vocab_size=vocab,
                     max_seq_len=seq)


def _tokens(batch=16, seq=64):
    return torch.empty(batch, seq, dtype=torch.long, device="meta")


def _check_rows(choice, kept_us):
    rows = {r["kind"]: r for r in choice["alternatives"]}
    assert set(rows) == {"flat", "pipeline"}
    steps = {k: r.get("step_us", float("inf")) for k, r in rows.items()}
    assert choice["chosen"] == ("pipeline" if steps["pipeline"] < steps["flat"] else "flat")
    assert steps[choice["chosen"]] == pytest.approx(kept_us, abs=1e-3)


def test_a_pipeline_that_loses_leaves_the_plan_without_one_unchanged(world, tmp_path):
    """A small model whose step is compute: the pipeline's bubble makes it slower, so the plan is
    the one ``autoshard.plan`` makes alone (same placements, same step), the pipelined step
    recorded beside it."""
    world(64)
    mesh = autoshard.fake_mesh((4, 4, 4), ("pp", "dp", "tp"))
    kw = dict(profile="h100-sxm", time_limit=120)
    got = plan_or_pipeline(_model(), (_tokens(),), mesh, axis="pp", microbatches=8, **kw)
    assert isinstance(got, autoshard.Plan)
    choice = got.summary["pipeline_choice"]
    _check_rows(choice, got.summary["step_us"])
    assert choice["chosen"] == "flat"
    alone = autoshard.plan(_model(), (_tokens(),), mesh, **kw)
    assert got.summary["step_us"] == pytest.approx(alone.summary["step_us"], rel=1e-9)
    assert {f: got.param_spec(f) for f in got.params} == {f: alone.param_spec(f) for f in alone.params}
    piped = plan_pipeline(_model(), (_tokens(),), mesh, axis="pp", microbatches=8, **kw)
    row = next(r for r in choice["alternatives"] if r["kind"] == "pipeline")
    assert row["step_us"] == pytest.approx(piped.step_us, rel=1e-6)
    assert row["step_us"] > got.summary["step_us"]
    assert "pipelining over 'pp' allowed" in got.describe()
    got.save(tmp_path / "p.json")
    assert autoshard.Plan.load(tmp_path / "p.json").summary["pipeline_choice"] == choice


def test_a_budget_only_the_pipeline_meets_keeps_the_pipeline(world, monkeypatch, tmp_path):
    """A budget below what the plan without a pipeline can hold (its proved floor) that the
    pipeline's microbatches fit: the pipelined plan is kept, the other's error recorded; made one
    after the other where no worker may be forked."""
    world(64)
    monkeypatch.setattr(pipechoice, "_may_fork", lambda: False)
    mesh = autoshard.fake_mesh((4, 4, 4), ("pp", "dp", "tp"))
    model, tokens = _model(layers=8, dim=512, ffn=2048, seq=1024), _tokens(64, 1024)
    budget = 0.075 * 2**30
    with pytest.raises(autoshard.MemoryBudgetError) as err:
        autoshard.plan(model, (tokens,), mesh, profile="h100-sxm", memory_budget=budget, time_limit=20)
    assert err.value.min_feasible_bytes > budget
    got = plan_or_pipeline(model, (tokens,), mesh, axis="pp", microbatches=16, profile="h100-sxm",
                           memory_budget=budget, time_limit=20)
    assert isinstance(got, PipelinePlan)
    assert max(got.memory_bytes) <= budget
    _check_rows(got.choice, got.step_us)
    assert not got.choice["beside"]
    flat = next(r for r in got.choice["alternatives"] if r["kind"] == "flat")
    assert "MemoryBudgetError" in flat["error"]
    got.save(tmp_path / "pp.json")
    assert PipelinePlan.load(tmp_path / "pp.json").choice == got.choice
    assert "kept the plan pipelined" in got.describe()


def test_a_model_that_cannot_be_pipelined_keeps_its_plan_and_says_why(world):
    world(16)
    mesh = autoshard.fake_mesh((4, 4), ("pp", "dp"))
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    got = plan_or_pipeline(model, (torch.randn(16, 32),), mesh, axis="pp", microbatches=4, time_limit=30)
    assert isinstance(got, autoshard.Plan)
    row = next(r for r in got.summary["pipeline_choice"]["alternatives"] if r["kind"] == "pipeline")
    assert "no repeated layers" in row["error"]


def test_an_axis_the_mesh_lacks_is_the_callers_error(world):
    world(16)
    mesh = autoshard.fake_mesh((4, 4), ("dp", "tp"))
    with pytest.raises(ConfigError, match="'pp' is not an axis of the mesh"):
        plan_or_pipeline(_model(), (_tokens(),), mesh, axis="pp", microbatches=4)
