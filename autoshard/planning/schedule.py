r"""A pipeline schedule's step and memory, from its stages' times: torch's order, simulated.

A pipeline of ``S = p * v`` stages runs on ``p`` ranks of the pipeline axis, stage ``s`` on
rank ``s mod p`` (``v`` virtual stages per rank: torch's loop placement), ``m`` microbatches.
Each rank runs its compute actions in the order torch's runtime runs them (:func:`orders`:
GPipe, 1F1B, interleaved 1F1B), one at a time. With ``f_s``, ``b_s`` stage ``s``'s forward
and backward of one microbatch and ``c_s`` the send of its boundary activation to stage
``s + 1`` (the gradient comes back at the same price), an action starts when its rank is free and its inputs are there:

    start F(s, j) >= end F(s-1, j) + c_(s-1)                       (s > 0)
    start B(s, j) >= end F(s, j),   start B(s, j) >= end B(s+1, j) + c_s   (s < S-1)

and the step is the last action's end. Sends run beside compute (torch issues them
asynchronously); a receive is waited for where its action starts. With equal stages and free
sends this is the textbook ``(m + p - 1)(f + b)`` for 1F1B and GPipe, and
``(m + (p - 1)/v)(f + b) v`` for interleaved 1F1B (``f``, ``b`` per virtual stage), which
:func:`simulate` reproduces exactly (tests/test_pipeline_schedule.py); it is simulated rather than
written in closed form so that unequal stages (the embedding on the first, the head and the loss
on the last) and sends cost what they do.

Memory: a stage keeps one microbatch's saved activations ``a_s`` from the start of its forward
to the end of its backward. A rank's activations at time ``t`` are ``sum_s a_s n_s(t)`` over
its stages, ``n_s(t)`` the microbatches in flight there; the schedule's peak of that sum is
reported per rank (1F1B: the first rank holds ``p`` microbatches, the last one; GPipe: every
rank holds all ``m``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autoshard import _torch_compat as tc
from autoshard.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
"""Schedules whose order torch's classes give: GPipe, 1F1B, interleaved 1F1B (several
stages per rank)."""


@dataclass
class ScheduleRun:
    """One step of a pipeline schedule, simulated (microseconds, bytes)."""

    step_us: float
    """From the first action's start to the last action's end."""
    busy_us: list[float]
    """Per rank, its compute (forward and backward) in the step."""
    bubble: float
    """The idle share of the step on the busiest rank: ``1 - max(busy) / step``."""
    in_flight: list[int]
    """Per stage, the most microbatches it held at once (forwarded, backward not done)."""
    peak_activation_bytes: list[float] = field(default_factory=list)
    """Per rank, the peak over the step of ``sum_s a_s n_s(t)`` over its stages."""
    rank_end_us: list[float] = field(default_factory=list)
    """Per rank, when its last action ends."""

    def to_json(self) -> dict:
        return {"step_us": round(self.step_us, 3), "busy_us": [round(b, 3) for b in self.busy_us],
                "bubble": round(self.bubble, 4), "in_flight": list(self.in_flight),
                "peak_activation_bytes": [int(b) for b in self.peak_activation_bytes],
                "rank_end_us": [round(t, 3) for t in self.rank_end_us]}


def check_schedule(schedule: str, ranks: int, microbatches: int, stages_per_rank: int) -> None:
    """Raise where torch's schedule cannot run these counts."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule: expected one of {SCHEDULES}, found {schedule!r}")
    if ranks < 1 or microbatches < 1 or stages_per_rank < 1:
        raise ConfigError(f"pipeline ranks ({ranks}), microbatches ({microbatches}) and stages per rank "
                          f"({stages_per_rank}) must be >= 1")
    if schedule != "interleaved_1f1b" and stages_per_rank != 1:
        raise ConfigError(f"schedule {schedule!r} runs one stage per rank, found stages_per_rank={stages_per_rank} "
                          "(interleaved_1f1b runs several)")
    if schedule == "interleaved_1f1b":
        rounds = max(1, microbatches // ranks)
        if microbatches % rounds:
            raise ConfigError(f"interleaved_1f1b needs microbatches ({microbatches}) to be a multiple of "
                              f"max(1, microbatches // ranks) = {rounds}")


def simulate(schedule: str, ranks: int, microbatches: int, forward_us, backward_us, send_us=None,
             activation_bytes=None, stages_per_rank: int = 1) -> ScheduleRun:
    """Simulate torch's ``schedule`` (module docstring). Per stage ``s`` (``ranks *
    stages_per_rank`` of them): ``forward_us[s]``, ``backward_us[s]`` for one microbatch,
    ``send_us[s]`` the send from ``s`` to ``s + 1`` (the last entry unused; default free),
    ``activation_bytes[s]`` what one microbatch in flight holds there (default 0)."""
    check_schedule(schedule, ranks, microbatches, stages_per_rank)
    n_stages = ranks * stages_per_rank
    for name, seq in (("forward_us", forward_us), ("backward_us", backward_us), ("send_us", send_us),
                      ("activation_bytes", activation_bytes)):
        if seq is not None and len(seq) != n_stages:
            raise ConfigError(f"{name}: expected one entry per stage ({n_stages} = {ranks} ranks x "
                              f"{stages_per_rank} per rank), found {len(seq)}")
    send = list(send_us) if send_us is not None else [0.0] * n_stages
    act = list(activation_bytes) if activation_bytes is not None else [0.0] * n_stages
    order = orders(schedule, ranks, microbatches, stages_per_rank)
    end: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * ranks
    busy = [0.0] * ranks
    nxt = [0] * ranks
    # Per rank, (time, key, stage, +1 | -1) events of the in-flight account.
    events: list[list[tuple[float, int, int, int]]] = [[] for _ in range(ranks)]
    left = sum(len(o) for o in order.values())
    while left:
        progressed = False
        for r in range(ranks):
            while nxt[r] < len(order[r]):
                kind, s, j = order[r][nxt[r]]
                ready = _ready(kind, s, j, n_stages, end, send)
                if ready is None:
                    break
                start = max(clock[r], ready)
                dur = forward_us[s] if kind == "F" else backward_us[s]
                clock[r] = end[(kind, s, j)] = start + dur
                busy[r] += dur
                # At one instant a backward's end frees before a forward's start holds (key 0 < 1).
                events[r].append((start, 1, s, 1) if kind == "F" else (start + dur, 0, s, -1))
                nxt[r] += 1
                left -= 1
                progressed = True
        if not progressed:
            stuck = {r: order[r][nxt[r]] for r in range(ranks) if nxt[r] < len(order[r])}
            raise RuntimeError(f"pipeline schedule {schedule!r} deadlocks at {stuck} (an order torch gave)")
    step = max(end.values())
    in_flight = [0] * n_stages
    peaks = []
    for r in range(ranks):
        held, count, peak = 0.0, [0] * n_stages, 0.0
        for _t, _key, s, delta in sorted(events[r]):
            held += delta * act[s]
            count[s] += delta
            in_flight[s] = max(in_flight[s], count[s])
            peak = max(peak, held)
        peaks.append(peak)
    bubble = 1.0 - max(busy) / step if step > 0 else 0.0
    return ScheduleRun(step_us=step, busy_us=busy, bubble=bubble, in_flight=in_flight, peak_activation_bytes=peaks,
                       rank_end_us=list(clock))


def orders(schedule: str, ranks: int, microbatches: int, stages_per_rank: int = 1) -> dict[int, list]:
    """Per rank, its compute actions ``(kind, stage, microbatch)`` in the order torch runs them.
    GPipe: every forward, then every backward. 1F1B (``Schedule1F1B._step_microbatches``;
    its ``_get_pipeline_order``, a drawing aid, skips the last rank's first microbatch):
    stage ``s`` runs ``w = min(m, p - s)`` forwards, then alternates one backward and one
    forward while forwards remain, then the remaining backwards. Interleaved 1F1B: torch's
    own order (:func:`autoshard._torch_compat.interleaved_order`), which its runtime executes."""
    check_schedule(schedule, ranks, microbatches, stages_per_rank)
    if schedule == "interleaved_1f1b":
        return tc.interleaved_order(ranks, microbatches, stages_per_rank)
    out = {}
    for s in range(ranks):
        if schedule == "gpipe":
            out[s] = [("F", s, j) for j in range(microbatches)] + [("B", s, j) for j in range(microbatches)]
            continue
        w = min(microbatches, ranks - s)
        acts = [("F", s, j) for j in range(w)]
        for j in range(microbatches - w):
            acts += [("B", s, j), ("F", s, w + j)]
        acts += [("B", s, j) for j in range(microbatches - w, microbatches)]
        out[s] = acts
    return out


def _ready(kind: str, s: int, j: int, n_stages: int, end: dict, send: list) -> float | None:
    """When the inputs of ``kind``(s, j) are there, or None while one is not computed yet."""
    if kind == "F":
        if s == 0:
            return 0.0
        e = end.get(("F", s - 1, j))
        return None if e is None else e + send[s - 1]
    own = end.get(("F", s, j))
    if own is None:
        return None
    if s == n_stages - 1:
        return own
    e = end.get(("B", s + 1, j))
    return None if e is None else max(own, e + send[s])
