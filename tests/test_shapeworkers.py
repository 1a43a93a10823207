"""ShapeWorkers: forked processes that keep what they built for a shape and run later work on it
where it is kept; errors come back as themselves."""

import pytest

from autoshard.errors import MemoryBudgetError
from autoshard.planning.shapeworkers import HELD_NOT, ShapeWorkers


def _build(shape, scale):
    if shape == ("die",):
        import os

        os._exit(3)
    if shape == ("boom",):
        raise MemoryBudgetError("budget 1 B is infeasible", budget_bytes=1.0, min_feasible_bytes=8.0)
    return sum(shape) * scale, {"shape": shape, "scale": scale}


def _grow(kept, extra):
    kept["scale"] += extra  # the worker's copy: a later run sees it
    return kept["shape"], kept["scale"]


def _fail(kept):
    raise KeyError("no such thing")


def test_a_shape_is_run_where_it_was_built_and_dropped_when_ranked_out():
    pool = ShapeWorkers(2, _build, hold=1)
    try:
        pool.submit((1, 2), 10)
        pool.submit((3, 4), 100)
        assert not pool.has_room() and pool.running == {(1, 2), (3, 4)}
        assert sorted([pool.next(), pool.next()]) == [30, 700]
        assert pool.run((1, 2), _grow, 1) == ((1, 2), 11)
        assert pool.run((1, 2), _grow, 1) == ((1, 2), 12)  # state kept between runs
        assert pool.run((9,), _grow, 1) is HELD_NOT  # never built
        pool.submit((5,), 1)
        pool.next()
        # Each worker keeps at most one of the ranked shapes; a shape not ranked is dropped.
        pool.keep([(5,), (3, 4)])
        assert pool.run((1, 2), _grow, 1) is HELD_NOT
        # (1, 2) and (5,) went to worker 0, (3, 4) to worker 1: each keeps its best ranked.
        held = [s for s in [(5,), (3, 4)] if pool.run(s, _grow, 0) is not HELD_NOT]
        assert held == [(5,), (3, 4)]
        with pytest.raises(KeyError, match="no such thing"):
            pool.run(held[0], _fail)
        pool.submit(("boom",), 1)
        with pytest.raises(MemoryBudgetError) as err:
            pool.next()
        assert (err.value.budget_bytes, err.value.min_feasible_bytes) == (1.0, 8.0)
        assert pool.has_room()
    finally:
        pool.close()
    assert all(not p.is_alive() for p in pool.procs)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="workers >= 1 and hold >= 0, found 0 and 3"):
        ShapeWorkers(0, _build)


def test_a_worker_that_dies_is_an_error_that_says_so():
    pool = ShapeWorkers(1, _build)
    try:
        pool.submit(("die",), 1)
        with pytest.raises(RuntimeError, match=r"worker 0 \(pid \d+\) ended without answering, exit code 3"):
            pool.next()
    finally:
        pool.close()


_BARRIER: list = []  # set before the workers fork: they inherit it (it does not pickle)


def _meet(kept):
    _BARRIER[0].wait(timeout=60)  # both runs at once, or the barrier breaks
    return kept["shape"]


def _hang(kept):
    import time

    time.sleep(600)


def test_runs_on_shapes_kept_by_different_workers_run_at_once_and_can_be_stopped():
    import multiprocessing

    _BARRIER[:] = [multiprocessing.get_context("fork").Barrier(2)]
    pool = ShapeWorkers(2, _build, hold=2)
    try:
        pool.submit((1,), 1)
        pool.submit((2,), 1)
        pool.next(), pool.next()
        k1, k2 = pool.held((1,)), pool.held((2,))
        assert {k1, k2} == {0, 1} and pool.idle(k1) and pool.idle(k2)
        assert pool.start((1,), _meet) and pool.start((2,), _meet)
        assert not pool.has_room() and not pool.idle(k1)
        with pytest.raises(RuntimeError, match=f"worker {k1} is busy with \\(1,\\)"):
            pool.start((1,), _grow, 1)
        assert not pool.start((9,), _grow, 1)  # kept by none
        assert sorted([pool.next_run(), pool.next_run()]) == [((1,), (1,)), ((2,), (2,))]
        # A run that will not end is stopped with its worker: what that worker kept is lost; a run
        # not named goes on.
        assert pool.start((1,), _hang) and pool.start((2,), _grow, 1)
        assert pool.abandon([(1,)]) == [(1,)]
        assert pool.next_run() == ((2,), ((2,), 2))
        assert pool.run((1,), _grow, 1) is HELD_NOT and pool.held((1,)) is None
        assert pool.run((2,), _grow, 1) == ((2,), 3)
        pool.submit((3,), 1)  # the worker left takes it
        assert pool.next() == 3 and pool.held((3,)) == k2
    finally:
        pool.close()
    assert all(not p.is_alive() for p in pool.procs)


def _slow_build(shape, seconds):
    import time

    time.sleep(seconds)
    return shape, {"shape": shape}


def _slow_run(kept, seconds):
    import time

    time.sleep(seconds)
    return kept["shape"]


def test_answers_come_in_the_order_their_requests_were_sent_not_the_order_they_finish():
    """What a search decides from its answers then does not hang on which worker ran faster."""
    pool = ShapeWorkers(2, _slow_build, hold=2)
    try:
        pool.submit((1,), 0.6)  # finishes last
        pool.submit((2,), 0.0)
        assert [pool.next(), pool.next()] == [(1,), (2,)]
        assert pool.start((1,), _slow_run, 0.6) and pool.start((2,), _slow_run, 0.0)
        assert [pool.next_run(), pool.next_run()] == [((1,), (1,)), ((2,), (2,))]
        assert pool.start((2,), _slow_run, 0.6) and pool.start((1,), _slow_run, 0.0)
        assert [pool.next_run(), pool.next_run()] == [((2,), (2,)), ((1,), (1,))]
    finally:
        pool.close()
