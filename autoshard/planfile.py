"""The plan: what to shard how, as a versioned JSON file.

A plan holds the mesh it was made for, a fingerprint of the model (every
parameter's FQN and shape), per-parameter placements by FQN, per-input specs,
per-node specs, every redistribute with its predicted steps and time, a
predicted cost summary and solver statistics.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from autoshard.errors import PlanError
from autoshard.plansummary import PlanSummary, pipeline_choice_line
from costmodel.spec import Spec

PLAN_VERSION = 1

#: Activation checkpointing modes a plan can carry (:mod:`autoshard.graph.recompute`).
RECOMPUTE_MODES = ("none", "selective", "full")


def without_timings(value):
    """A plan's JSON (or any part of it) without the wall-clock figures it records (seconds of
    phases and solves): what two runs from the same inputs must agree on (issue "reproducible
    solves")."""
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items()
                if not (k == "seconds" or k.endswith("_s") or k == "plan_seconds")}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def layer_of(fqn: str) -> str:
    """``layers.3.attn.wq.weight`` -> ``layers.3``; ``embed.weight`` -> ``embed``."""
    m = re.match(r"^(.*?\.\d+)\.", fqn)
    if m:
        return m.group(1)
    return fqn.rsplit(".", 1)[0] if "." in fqn else fqn


def _recompute_entry(data) -> dict:
    """A plan's ``recompute`` field, checked (absent in plans made before it: nothing recomputed)."""
    if data is None:
        return {"mode": "none", "nodes": {}, "at": {}}
    if not isinstance(data, dict) or data.get("mode") not in RECOMPUTE_MODES:
        raise PlanError(f"plan recompute: expected {{'mode': one of {RECOMPUTE_MODES}, 'nodes', 'at'}}, "
                        f"found {data!r:.200}")
    nodes, at = data.get("nodes", {}), data.get("at", {})
    if not (isinstance(nodes, dict) and isinstance(at, dict)) or set(nodes) != set(at) \
            or not all(isinstance(v, list) and all(isinstance(n, str) for n in v) for v in nodes.values()):
        raise PlanError("plan recompute: expected 'nodes' {layer: [node names]} and 'at' {layer: node name} "
                        f"for the same layers, found layers {sorted(nodes)[:5]} and {sorted(at)[:5]}")
    return {"mode": data["mode"], "nodes": {k: list(v) for k, v in nodes.items()}, "at": dict(at)}


@dataclass
class ParamPlacement:
    """Placement of one parameter (or buffer) by mesh axis name."""

    placements: dict[str, str]
    """Mesh axis name -> ``R`` / ``S(d)``."""
    shard_order: dict[str, list[str]] = field(default_factory=dict)
    """Tensor dim (as a string) -> mesh axis names in split order, where non-default."""
    shape: list[int] = field(default_factory=list)
    """Global shape the plan was made for."""

    def spec(self, axis_names: list[str]) -> Spec:
        missing = [a for a in axis_names if a not in self.placements]
        if missing:
            raise PlanError(f"placements {self.placements} lack mesh axes {missing}")
        order = tuple((int(d), tuple(axis_names.index(a) for a in axes)) for d, axes in self.shard_order.items())
        return Spec(tuple(self.placements[a] for a in axis_names), order)


@dataclass
class Plan:
    mesh_shape: list[int]
    axis_names: list[str]
    params: dict[str, ParamPlacement]
    """Parameter and buffer FQN -> placement."""
    inputs: list[str]
    """Spec of each example input, in order (positional, then tensor keyword inputs)."""
    nodes: dict[str, dict] = field(default_factory=dict)
    """Graph node name -> {"op", "out", "in"} specs."""
    redistributes: list[dict] = field(default_factory=list)
    """Every non-free redistribute: node, arg, from, to, steps, us."""
    summary: PlanSummary = field(default_factory=PlanSummary)
    """What it predicts and how it was found (:class:`~autoshard.plansummary.PlanSummary`: typed
    fields, and a mapping by the file's keys); a dict given here is read into one."""
    solver: dict = field(default_factory=dict)
    profile: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    """``{"class": name, "fingerprint": sha256 of FQNs and shapes}``."""
    recompute: dict = field(default_factory=lambda: {"mode": "none", "nodes": {}, "at": {}})
    """Activation checkpointing (:class:`autoshard.graph.recompute.Recompute`): the mode, and per
    repeated layer the nodes its backward recomputes and the backward node they run before."""
    input_names: list[str] = field(default_factory=list)
    """Name of each input: ``input{k}`` for positional input k, else the keyword (empty in plans
    written before keyword inputs: all positional)."""
    held: list[str] = field(default_factory=list)
    """Views of parameters (their nodes' names) whose gather a step of several microbatches makes
    once, on its first microbatch, and keeps for the others to the step's end (a pipeline
    stage's plan: :func:`~autoshard.planning.problem.amortized_moves`)."""
    version: int = PLAN_VERSION

    def __post_init__(self):
        self.summary = PlanSummary.from_json(self.summary)

    @property
    def keyword_inputs(self) -> list[str]:
        """The keyword inputs' names, in the order of their specs after the positional ones."""
        return [n for n in self.input_names if not (n.startswith("input") and n[5:].isdigit())]

    # ---- model identity -------------------------------------------------
    @staticmethod
    def fingerprint(shapes: dict[str, list[int]]) -> str:
        text = json.dumps(sorted((k, list(v)) for k, v in shapes.items()))
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]

    def param_spec(self, fqn: str) -> Spec:
        return self.params[fqn].spec(self.axis_names)

    # ---- JSON ------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "version": self.version,
            "mesh": {"shape": self.mesh_shape, "axis_names": self.axis_names},
            "profile": self.profile,
            "model": self.model,
            "params": {k: asdict(v) for k, v in self.params.items()},
            "inputs": self.inputs,
            "input_names": self.input_names,
            "nodes": self.nodes,
            "redistributes": self.redistributes,
            "summary": self.summary.to_json(),
            "solver": self.solver,
            "recompute": self.recompute,
            **({"held": list(self.held)} if self.held else {}),
        }

    @staticmethod
    def from_json(data: dict) -> "Plan":
        if not isinstance(data, dict):
            raise PlanError(f"plan: expected a JSON object, found {type(data).__name__}")
        version = data.get("version")
        if version != PLAN_VERSION:
            raise PlanError(f"plan version: expected {PLAN_VERSION}, found {version!r}")
        try:
            mesh = data["mesh"]
            params = {
                k: ParamPlacement(placements=dict(v["placements"]), shard_order=dict(v.get("shard_order", {})),
                                  shape=list(v.get("shape", [])))
                for k, v in data["params"].items()
            }
            plan = Plan(
                mesh_shape=[int(s) for s in mesh["shape"]],
                axis_names=list(mesh["axis_names"]),
                params=params,
                inputs=list(data["inputs"]),
                input_names=list(data.get("input_names", [])),
                nodes=data.get("nodes", {}),
                redistributes=data.get("redistributes", []),
                summary=data.get("summary", {}),
                solver=data.get("solver", {}),
                profile=data.get("profile", {}),
                model=data.get("model", {}),
                recompute=_recompute_entry(data.get("recompute")),
                held=[str(h) for h in data.get("held", [])],
            )
        except (KeyError, TypeError, AttributeError, ValueError, OverflowError) as exc:
            raise PlanError(f"plan: missing or malformed field {exc}") from None
        if len(plan.mesh_shape) != len(plan.axis_names):
            raise PlanError(
                f"plan mesh: {len(plan.mesh_shape)} sizes {plan.mesh_shape} but "
                f"{len(plan.axis_names)} axis names {plan.axis_names}"
            )
        if plan.input_names and len(plan.input_names) != len(plan.inputs):
            raise PlanError(f"plan: {len(plan.inputs)} input specs but {len(plan.input_names)} input names")
        try:
            for fqn in plan.params:
                plan.param_spec(fqn)
            for s in plan.inputs:
                Spec.parse(s)
        except (ValueError, TypeError, AttributeError) as exc:
            raise PlanError(f"plan: bad placement: {exc}") from None
        return plan

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @staticmethod
    def load(path: str | Path) -> "Plan":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PlanError(f"{path}: cannot read a plan JSON file: {exc}") from None
        return Plan.from_json(data)

    # ---- reading ---------------------------------------------------------
    def describe(self, max_params: int = 40) -> str:
        """A human-readable summary: mesh, predicted costs, parameter placements."""
        try:
            return self._describe(max_params)
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            # Only a hand-edited or corrupted file gets here: the loader checks what the plan
            # needs to run, the report reads optional fields as the planner wrote them.
            raise PlanError(f"plan: a report field (summary, solver, profile, model) is malformed: "
                            f"{type(exc).__name__}: {exc}") from None

    def _describe(self, max_params: int) -> str:
        s = self.summary
        lines = [
            f"autoshard plan v{self.version} for {self.model.get('class', '?')} "
            f"on mesh {dict(zip(self.axis_names, self.mesh_shape))}",
            f"  predicted step: {s.get('step_us', 0) / 1e3:.3f} ms "
            f"(compute {s.get('compute_us', 0) / 1e3:.3f} ms, communication {s.get('comm_us', 0) / 1e3:.3f} ms"
            + (f"; {s['additive_us'] / 1e3:.3f} ms with nothing overlapped" if "additive_us" in s else "") + ")",
            f"  profile: {self.profile.get('name', '?')}"
            + (" (every op's FLOPs priced as " + self.profile["name"].rpartition("@")[2] + ")"
               if "@" in self.profile.get("name", "") else ""),
            f"  peak memory per device: {s.get('peak_mem_bytes', 0) / 2**20:.1f} MiB"
            + (f" of budget {s['memory_budget_bytes'] / 2**20:.1f} MiB" if s.get("memory_budget_bytes") else ""),
            f"  graph: {s.get('graph_nodes', '?')} nodes, {s.get('strategies', '?')} strategies, "
            f"{s.get('edges', '?')} edges; {len(self.redistributes)} redistributes",
            f"  solver: {self.solver.get('backend', '?')} {self.solver.get('status', '?')} "
            f"in {self.solver.get('seconds', 0):.2f} s (gap {self.solver.get('gap')}"
            + (f", from {self.solver['source']}" if self.solver.get("source") else "") + ")"
            + (f"; ended by the wall clock, not its work: {', '.join(self.solver['cut_by_clock'])} (a rerun on a "
               f"less busy machine may differ)" if self.solver.get("cut_by_clock") else ""),
        ]
        choice = pipeline_choice_line(s.get("pipeline_choice"))
        if choice:
            lines.append(choice)
        alone = s.get("solve_alone")
        if alone:
            final = self.solver.get("source", "the solve")
            lines.append(f"  solve alone: {alone['step_us'] / 1e3:.3f} ms predicted"
                         + (" (its searches started from the hand-written plans)" if alone.get("seeded") else "")
                         + f"; final: {s.get('step_us', 0) / 1e3:.3f} ms (from {final})")
        rc = s.get("recompute") or {}
        if rc.get("mode", "none") != "none":
            lines.append(f"  activation checkpointing: {rc['mode']}, {rc.get('nodes', 0)} ops recomputed in "
                         f"{rc.get('layers', 0)} layers (+{rc.get('compute_us', 0) / 1e3:.3f} ms compute)")
        if self.held:
            lines.append(f"  weights gathered once per step and held for every microbatch: {len(self.held)} views "
                         f"({', '.join(self.held[:3])}{', ...' if len(self.held) > 3 else ''})")
        if s.get("simulated"):
            sim = s["simulated"]
            lines.append(f"  simulated with overlap: {sim['step_us'] / 1e3:.3f} ms (communication "
                         f"{sim['comm_us'] / 1e3:.3f} ms, of which exposed {sim['exposed_comm_us'] / 1e3:.3f} ms"
                         + (f"; overlap share {sim['overlap_share']:g}" if "overlap_share" in sim else "")
                         + (f"; the device waited {sim['host_idle_us'] / 1e3:.3f} ms for the host to issue ops"
                            if sim.get("host_idle_us") else "") + ")")
        ov = s.get("overlap") or {}
        if ov.get("objective_us") is not None:
            bound = f" (bound {ov['dual_us'] / 1e3:.3f} ms)" if ov.get("dual_us") is not None else ""
            lines.append(f"  overlap objective: {ov['objective_us'] / 1e3:.3f} ms{bound} over "
                         f"{ov.get('window_layers', 0)} windows; the additive optimum is simulated at "
                         f"{ov['additive_simulated_us'] / 1e3:.3f} ms; kept {ov['kept']}")
        if s.get("load_imbalance"):
            li = s["load_imbalance"]
            lines.append(f"  experts: {li['expert_matmuls']} expert matmuls, costed at load imbalance {li['factor']:g} "
                         "where the plan splits the experts")
        if s.get("recompute_tried"):
            tried = ", ".join(f"{m} {v / 1e3:.1f} ms" if isinstance(v, (int, float)) else f"{m} {v}"
                              for m, v in s["recompute_tried"].items())
            lines.append(f"  recompute modes tried: {tried}")
        if s.get("attention"):
            att = s["attention"]
            splits = ", ".join(f"{spec} x{k}" for spec, k in att["splits"].items())
            shares = att.get("kernel_shares")
            rate = (", priced at " + " / ".join(f"{v:g}" for v in shares.values()) + " ("
                    + " / ".join(k.removeprefix("attention_") for k in shares) + ") of the matmul rate") \
                if shares else ", priced at the matmul rate"
            lines.append(f"  fused attention: {att['kernels']} kernels, query split {splits}{rate}")
            if att.get("sequence"):
                seq = att["sequence"]
                lines.append(f"  context parallel: {seq['kernels']} causal kernels split on the sequence, "
                             f"{seq['balanced']} balanced by the mirror exchange, {seq.get('ring', 0)} ring attention")
        if s.get("fallback_ops"):
            lines.append(f"  ops with no sharding rule (replicated): {s['fallback_ops']}")
        for op, err in (s.get("rule_errors") or {}).items():
            lines.append(f"  sharding rule of {op} raised (replicated): {err}")
        for op, err in (s.get("flops_uncounted") or {}).items():
            lines.append(f"  FLOPs of {op} not counted (costed as 0): {err}")
        lines.append("  inputs: " + ", ".join(self.inputs))
        rows = self._param_rows()
        lines.append(f"  parameters ({len(self.params)}; repeated layers with equal placements shown once):"
                     if len(rows) < len(self.params) else "  parameters:")
        width = max((len(name) for name, _, _ in rows), default=0)
        for k, (name, text, count) in enumerate(rows):
            if k == max_params:
                lines.append(f"    ... {len(rows) - max_params} more")
                break
            lines.append(f"    {name:<{width}}  {text}" + (f"  x{count}" if count > 1 else ""))
        return "\n".join(lines)

    def local_elems(self, fqn: str) -> int:
        """Elements of parameter ``fqn`` one device holds (the largest shard when uneven)."""
        p = self.params[fqn]
        return math.prod(self.param_spec(fqn).local_shape(tuple(p.shape), tuple(self.mesh_shape))) if p.shape else 0

    def to_frame(self):
        """One pandas row per parameter or buffer: ``fqn``, ``layer``, one placement column per
        mesh axis, ``shard_order``, ``shape``, ``global_elems``, ``local_elems`` (per device)."""
        import pandas as pd

        rows = []
        for fqn, p in self.params.items():
            row = {"fqn": fqn, "layer": layer_of(fqn)}
            row.update({axis: p.placements[axis] for axis in self.axis_names})
            row.update(shard_order=p.shard_order or None, shape=tuple(p.shape),
                       global_elems=math.prod(p.shape) if p.shape else 0, local_elems=self.local_elems(fqn))
            rows.append(row)
        columns = ["fqn", "layer", *self.axis_names, "shard_order", "shape", "global_elems", "local_elems"]
        return pd.DataFrame(rows, columns=columns)

    def _param_rows(self) -> list[tuple[str, str, int]]:
        """(name, placements and shape, count) per row: parameters whose FQNs differ only in
        layer indices and that have the same placement, shard order and shape share one row
        (``layers.*.attn.wq``), so an 80-layer model prints one layer's worth."""
        groups: dict[tuple, list[str]] = {}
        for fqn, p in self.params.items():
            text = " ".join(f"{a}={p.placements[a]}" for a in self.axis_names)
            if p.shard_order:
                text += f" order={p.shard_order}"
            text += f"  {tuple(p.shape)}"
            groups.setdefault((re.sub(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)", "*", fqn), text), []).append(fqn)
        return [(members[0] if len(members) == 1 else pattern, text, len(members))
                for (pattern, text), members in groups.items()]
