"""Fewer garbage-collector passes while planning, the caller's settings restored after."""

import gc

import pytest
import torch
from helpers import SHARDING_PROFILE

import autoshard
import solver
from autoshard.gcpause import PLANNING_GEN0_THRESHOLD, fewer_gc_passes
from autoshard.models import MLP


@pytest.fixture
def thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def test_thresholds_raised_within_and_restored_after_even_on_error(thresholds):
    with fewer_gc_passes():
        assert gc.get_threshold() == (PLANNING_GEN0_THRESHOLD, 10, 10)
        with fewer_gc_passes():  # nested: the outer setting survives the inner's exit
            pass
        assert gc.get_threshold() == (PLANNING_GEN0_THRESHOLD, 10, 10)
    assert gc.get_threshold() == (700, 10, 10)

    @fewer_gc_passes()
    def fails():
        raise ValueError("boom")

    with pytest.raises(ValueError):
        fails()
    assert gc.get_threshold() == (700, 10, 10)


def test_a_callers_own_setting_is_kept(thresholds):
    gc.set_threshold(0, 10, 10)  # automatic collection off: not turned back on
    with fewer_gc_passes():
        assert gc.get_threshold()[0] == 0
    gc.set_threshold(10 * PLANNING_GEN0_THRESHOLD, 5, 5)  # already rarer than ours: not lowered
    with fewer_gc_passes():
        assert gc.get_threshold() == (10 * PLANNING_GEN0_THRESHOLD, 5, 5)


def test_planning_runs_with_fewer_passes(world, thresholds, monkeypatch):
    world(4)
    seen = []
    real = solver.solve

    def spy(*args, **kwargs):
        seen.append(gc.get_threshold()[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(solver, "solve", spy)
    model = MLP(dim=16, hidden=32)
    autoshard.plan(model, (torch.randn(8, 16),), autoshard.fake_mesh((4,), ("dp",)), profile=SHARDING_PROFILE,
                   time_limit=10, seed_baselines=False)
    assert seen and set(seen) == {PLANNING_GEN0_THRESHOLD}
    assert gc.get_threshold() == (700, 10, 10)
