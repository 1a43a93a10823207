"""What a plan predicts and how it was found: :class:`PlanSummary`, the plan file's ``summary``.

Typed fields for the planner and its readers (``plan.summary.step_us``); a mapping too, by the
field names the plan file uses (``plan.summary["step_us"]``), so plan files written by any
version load, and keys this version does not know are kept (:attr:`PlanSummary.extra`) and
written back as they were.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(eq=False)
class PlanSummary(MutableMapping):
    """The predicted costs of a plan and the facts of its solve. A field that is None is absent
    from the file (``"attention" in summary`` is False) unless it was set to None by key (a plan
    without a memory budget says ``"memory_budget_bytes": null``)."""

    step_us: float | None = None
    """Predicted step (microseconds): the simulated step, communication overlapped with compute
    as the executor overlaps it (``simulated``)."""
    additive_us: float | None = None
    """The solver's objective: compute plus every redistribute and the loss reduction, added."""
    compute_us: float | None = None
    comm_us: float | None = None
    """Communication, added: ``additive_us - compute_us``."""
    peak_mem_bytes: int | None = None
    """Predicted peak memory per device: the memory account's (``memory``)."""
    memory: dict | None = None
    """The memory account (:mod:`autoshard.planning.memory`): bytes per category live at the peak,
    the node running there, the largest values live there, and the solver rows' peak
    (``rows_peak_bytes``: node outputs alone, what the solver's memory constraints count)."""
    memory_budget_bytes: int | None = None
    """The budget it was planned under; None: none."""
    graph_nodes: int | None = None
    strategies: int | None = None
    """Strategies offered, all nodes together."""
    edges: int | None = None
    fallback_ops: dict | None = None
    """Op -> nodes replicated for want of a sharding rule."""
    rule_errors: dict | None = None
    """Op -> what its sharding rule raised."""
    flops_uncounted: dict | None = None
    """Op -> why its FLOPs are costed as 0."""
    recompute: dict | None = None
    """Activation checkpointing chosen: mode, nodes, layers, compute_us of the recomputation."""
    attention: dict | None = None
    """Fused attention: its kernels, how their queries are split, the rate they are priced at."""
    load_imbalance: dict | None = None
    """Expert parallelism: the imbalance factor and the expert matmuls it scales."""
    simulated: dict | None = None
    """The step simulated: step_us, exposed_comm_us, comm_us, overlap_share, buckets."""
    overlap: dict | None = None
    """The overlap objective's solve (:mod:`autoshard.planning.overlap`): the share, the additive
    optimum's objective and simulated step, the windows' solves, the kept plan's ``objective_us``
    and ``simulated_us``."""
    pinned: Any = None
    """Pins the plan was solved under."""
    solve_alone: dict | None = None
    """The solve's own answer beside the final plan: its ``step_us``, ``additive_us``, ``source``
    and whether hand-written plans started its searches (``seeded``); the final plan differs where
    a hand-written plan was predicted faster and taken instead."""
    recompute_tried: dict | None = None
    """Recompute mode -> its predicted step, where ``recompute="auto"`` tried several."""
    phases: dict | None = None
    """Seconds per planning phase (trace, build, solve, assemble)."""
    plan_seconds: float | None = None
    mesh_search: list | None = None
    """One row per mesh shape tried (``mesh="auto"``)."""
    mesh_search_seconds: float | None = None
    pipeline_choice: dict | None = None
    """Where pipelining over an axis was allowed (:mod:`autoshard.planning.pipechoice`): the axis,
    each alternative (``flat``, ``pipeline``) with its step, peak or error and seconds, and which
    was kept."""
    extra: dict = field(default_factory=dict)
    """Keys this version does not know, kept as read."""
    nulls: set = field(default_factory=set, repr=False)
    """Fields set to None by key: present, as null."""

    @classmethod
    def from_json(cls, data: dict | PlanSummary) -> PlanSummary:
        if isinstance(data, PlanSummary):
            return data
        if not isinstance(data, dict):
            raise TypeError(f"summary: expected a JSON object, found {type(data).__name__}")
        out = cls()
        for k, v in data.items():
            out[k] = v
        return out

    def to_json(self) -> dict:
        return dict(self.items())

    # ---- the mapping, by the plan file's keys ----------------------------------------
    def _is_field(self, key: str) -> bool:
        return key in _FIELD_NAMES

    def _present(self, name: str) -> bool:
        return getattr(self, name) is not None or name in self.nulls

    def __getitem__(self, key: str):
        if self._is_field(key):
            if not self._present(key):
                raise KeyError(key)
            return getattr(self, key)
        return self.extra[key]

    def __setitem__(self, key: str, value) -> None:
        if self._is_field(key):
            setattr(self, key, value)
            (self.nulls.add if value is None else self.nulls.discard)(key)
        else:
            self.extra[key] = value

    def __delitem__(self, key: str) -> None:
        if self._is_field(key):
            if not self._present(key):
                raise KeyError(key)
            setattr(self, key, None)
            self.nulls.discard(key)
        else:
            del self.extra[key]

    def __iter__(self) -> Iterator[str]:
        yield from (name for name in _FIELD_NAMES if self._present(name))
        yield from self.extra

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"PlanSummary({dict(self.items())!r})"


_FIELD_NAMES = tuple(f.name for f in fields(PlanSummary) if f.name not in ("extra", "nulls"))


def pipeline_choice_line(choice: dict | None) -> str | None:
    """One line for ``describe()``: both alternatives and which was kept (None without a choice)."""
    if not choice:
        return None
    said = [f"{'pipelined' if r['kind'] == 'pipeline' else 'without'} "
            + (f"{r['step_us'] / 1e3:.1f} ms" if "step_us" in r else f"none ({r['error']})")
            + f" ({r['seconds']:.1f} s)" for r in choice["alternatives"]]
    kept = "pipelined" if choice["chosen"] == "pipeline" else "without a pipeline"
    return f"  pipelining over {choice['axis']!r} allowed: {'; '.join(said)}; kept the plan {kept}"
