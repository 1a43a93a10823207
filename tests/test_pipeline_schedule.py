"""Pipeline schedules simulated in torch's order: the textbook steps where stages are equal,
the in-flight counts each schedule holds, and unequal stages and sends priced as they run."""

import pytest

from autoshard.errors import ConfigError
from autoshard.planning.schedule import orders, simulate


@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (4, 5), (8, 16)])
def test_equal_stages_give_the_textbook_step(p, m):
    """1F1B and GPipe: (m + p - 1)(f + b); 1F1B holds p - s microbatches on stage s, GPipe m."""
    for schedule in ("1f1b", "gpipe"):
        run = simulate(schedule, p, m, [1.0] * p, [2.0] * p, activation_bytes=[10] * p)
        assert run.step_us == pytest.approx((m + p - 1) * 3.0)
        assert run.bubble == pytest.approx((p - 1) / (m + p - 1))
        held = [min(m, p - s) for s in range(p)] if schedule == "1f1b" else [m] * p
        assert run.in_flight == held
        assert run.peak_activation_bytes == [10 * h for h in held]


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 16, 2)])
def test_interleaved_cuts_the_bubble_by_the_stages_per_rank(p, m, v):
    """(m + (p - 1) / v)(f + b) with f, b a rank's whole forward and backward; the first
    rank holds p (1 + (p - 1) / (p v)) microbatches' worth of activations (Megatron's)."""
    n = p * v
    run = simulate("interleaved_1f1b", p, m, [1.0 / v] * n, [2.0 / v] * n, activation_bytes=[1.0 / v] * n,
                   stages_per_rank=v)
    assert run.step_us == pytest.approx((m + (p - 1) / v) * 3.0)
    assert run.peak_activation_bytes[0] == pytest.approx(p * (1 + (p - 1) / (p * v)))
    one = simulate("1f1b", p, m, [1.0] * p, [2.0] * p)
    assert run.step_us < one.step_us


def test_every_microbatch_runs_forward_then_backward_once_per_stage():
    for schedule, v in (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2)):
        order = orders(schedule, 4, 8, v)
        acts = [a for r in order.values() for a in r]
        assert sorted(acts) == sorted((k, s, j) for k in "FB" for s in range(4 * v) for j in range(8))
        for r, seq in order.items():
            assert all(s % 4 == r for _, s, _ in seq)
            for k, s, j in seq:
                if k == "B":
                    assert seq.index(("F", s, j)) < seq.index((k, s, j))


def test_the_slowest_stage_and_the_sends_set_the_step():
    """Steady 1F1B runs at the slowest stage's pace. Stage 2 twice as slow: its two warm-up
    forwards end at 6, its first backward waits for microbatch 0 through stage 3 and back
    (1 + 1 + 2 + 1 + 2 = 7); from there it is never idle (its m backwards and m - 2 forwards),
    then stages 1 and 0 run the last backward. A send delays each hop both ways."""
    p, m = 4, 8
    f, b = [1.0, 1.0, 2.0, 1.0], [2.0, 2.0, 4.0, 2.0]
    run = simulate("1f1b", p, m, f, b)
    assert run.step_us == pytest.approx(7.0 + (m * 6.0 - 2 * 2.0) + 2.0 + 2.0)
    assert run.busy_us == [24.0, 24.0, 48.0, 24.0]
    # GPipe: the sends add one trip down and one up. 1F1B alternates, so in steady state the
    # last stages wait a trip each way between microbatches: p = 2, m = 2 by hand, stage 1
    # runs F0 [1.5, 2.5], B0 [2.5, 4.5], F1, B1 [5.5, 7.5], stage 0 B0 [5, 7] and B1 [8, 10].
    free = {k: simulate(k, p, m, [1.0] * p, [2.0] * p).step_us for k in ("gpipe", "1f1b")}
    sent = {k: simulate(k, p, m, [1.0] * p, [2.0] * p, send_us=[0.5] * p).step_us for k in ("gpipe", "1f1b")}
    assert sent["gpipe"] == pytest.approx(free["gpipe"] + 2 * (p - 1) * 0.5)
    assert free["gpipe"] + 2 * (p - 1) * 0.5 < sent["1f1b"] <= free["1f1b"] + 2 * m * 0.5
    assert simulate("1f1b", 2, 2, [1.0] * 2, [2.0] * 2, send_us=[0.5] * 2).step_us == pytest.approx(10.0)


def test_bad_counts_are_refused_with_values():
    with pytest.raises(ConfigError, match="one entry per stage"):
        simulate("1f1b", 4, 8, [1.0] * 3, [2.0] * 4)
    with pytest.raises(ConfigError, match="expected one of"):
        simulate("zb", 4, 8, [1.0] * 4, [2.0] * 4)
    with pytest.raises(ConfigError, match="one stage per rank"):
        simulate("1f1b", 4, 8, [1.0] * 8, [2.0] * 8, stages_per_rank=2)
