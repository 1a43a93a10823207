"""The microbatch count of a pipelined step, climbed to by planning the pipeline at a few counts."""

import json
import math

import pytest
import torch

import autoshard
from autoshard.errors import ConfigError
from autoshard.models import llama
from autoshard.planning.microbatches import candidates, climb, start
from autoshard.planning.pipeline import PipelinePlan, plan_pipeline


def test_candidates_divide_the_batch_fill_the_pipeline_and_run_under_the_schedule():
    assert candidates(512, 8, "1f1b") == [8, 16, 32, 64, 128, 256, 512]
    assert candidates(48, 4, "gpipe") == [4, 6, 8, 12, 16, 24, 48]
    # interleaved 1F1B runs m only where max(1, m // ranks) divides it: not 30 (30 // 4 = 7)
    assert candidates(60, 4, "1f1b") == [4, 5, 6, 10, 12, 15, 20, 30, 60]
    assert candidates(60, 4, "interleaved_1f1b", 2) == [4, 5, 6, 10, 12, 15, 20, 60]
    with pytest.raises(ConfigError, match=r"no count m >= 8 \(the pipeline ranks\) divides the batch 4"):
        candidates(4, 8, "1f1b")


def test_the_climb_starts_at_four_per_rank_and_stops_where_both_neighbours_are_slower():
    counts = candidates(512, 8, "1f1b")
    assert counts[start(counts, 8)] == 32
    # LLaMA-70B on (pp 8, dp 8, tp 8) as planned: 32 beats 16 and 64
    steps = {8: 9e3, 16: 4035.5, 32: 3355.6, 64: 3506.2, 128: 12025.2, 256: 2e4, 512: 3e4}
    asked = []

    def step_of(m):
        asked.append(m)
        return steps[m]

    assert climb(counts, start(counts, 8), step_of) == (32, {32: 3355.6, 16: 4035.5, 64: 3506.2})
    assert asked == [32, 16, 64]
    # An optimum two steps away: the climb walks to it, each count asked once.
    steps = {8: 9.0, 16: 8.0, 32: 7.0, 64: 6.0, 128: 5.0, 256: 5.5, 512: 7.0}
    asked.clear()
    best, seen = climb(counts, start(counts, 8), step_of)
    assert best == 128 and asked == [32, 16, 64, 128, 256] and len(set(asked)) == len(asked)


def test_counts_that_break_the_budget_are_left_toward_the_side_that_fits():
    counts = [8, 16, 32, 64, 128, 256, 512]
    # Fewer microbatches hold more in flight: below 128 nothing fits.
    steps = {8: math.inf, 16: math.inf, 32: math.inf, 64: math.inf, 128: 500.0, 256: 400.0, 512: 450.0}
    best, seen = climb(counts, 2, steps.__getitem__)
    assert best == 256 and seen[128] == 500.0 and seen[512] == 450.0
    # Nothing fits anywhere: every count is tried once, and the least (all infinite) is returned.
    best, seen = climb(counts, 2, lambda m: math.inf)
    assert sorted(seen) == counts and math.isinf(seen[best])


def test_a_climb_out_of_time_returns_the_best_count_planned():
    counts = [8, 16, 32, 64, 128]

    def step_of(m):
        if m == 128:
            raise StopIteration  # the caller's time limit
        return {8: 9.0, 16: 8.0, 32: 7.0, 64: 6.0}[m]

    assert climb(counts, 2, step_of) == (64, {32: 7.0, 16: 8.0, 64: 6.0})


def test_auto_microbatches_keeps_the_least_step_among_the_counts_planned(world):
    """plan_pipeline(microbatches="auto"): the start (4 per pipeline rank) and its neighbours are
    planned, the plan kept is the least step among the counts planned and no slower than its
    planned neighbours; the counts tried are in the plan, its file and its description."""
    world(8)
    with torch.device("meta"):
        model = llama("tiny", dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=4096,
                      max_seq_len=64)
    tokens = torch.empty(16, 64, dtype=torch.long, device="meta")
    mesh = autoshard.fake_mesh((2, 2, 2), ("pp", "dp", "tp"))
    # A limit no count's plan comes near, however loaded the machine: the climb ends by its rule.
    pp = plan_pipeline(model, (tokens,), mesh, axis="pp", microbatches="auto", profile="h100-sxm",
                       loss_fn=lambda out: out.float().pow(2).mean(), time_limit=600)
    tried = {r["microbatches"]: r["step_us"] for r in pp.microbatch_search}
    assert list(tried)[:3] == [8, 4, 16]
    assert tried[pp.microbatches] == min(tried.values()) == pytest.approx(pp.step_us, abs=1e-3)
    counts = candidates(16, 2, "1f1b")
    k = counts.index(pp.microbatches)
    for j in (k - 1, k + 1):
        if 0 <= j < len(counts):
            assert tried[counts[j]] >= pp.step_us
    again = PipelinePlan.from_json(json.loads(json.dumps(pp.to_json())))
    assert again.microbatch_search == pp.microbatch_search and again.microbatches == pp.microbatches
    assert f"microbatches chosen among 8: {tried[8] / 1e3:.1f} ms, 4: " in pp.describe()
    with pytest.raises(ConfigError, match=r"microbatches: expected a count >= 1 or 'auto', found 'many'"):
        plan_pipeline(model, (tokens,), mesh, axis="pp", microbatches="many")
    # A limit the start's plan uses up: the start is kept, and the plan says the climb was cut.
    short = plan_pipeline(model, (tokens,), mesh, axis="pp", microbatches="auto", profile="h100-sxm",
                          loss_fn=lambda out: out.float().pow(2).mean(), time_limit=0.5)
    assert short.microbatches == 8 and [r.get("microbatches") for r in short.microbatch_search] == [8, None]
    assert short.microbatch_search[-1] == {"stopped": "the time limit ended the climb before 4 microbatches"}
    assert "(the time limit ended the climb before 4 microbatches)" in short.describe()
