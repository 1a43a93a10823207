"""Read and write the IOPDDL contest format (ASPLOS/EuroSys 2025), .json or .json.gz,
with the planner's ties and pins as optional extra keys of ``problem``."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

from solver.problem import Problem, ProblemError


def _open(path: Path, mode: str):
    return gzip.open(path, mode + "t") if path.suffix == ".gz" else open(path, mode)


def from_dict(data: dict, name: str = "") -> Problem:
    """Build a :class:`Problem` from the contest's JSON object."""
    try:
        p = data["problem"]
        nodes, edges = p["nodes"], p["edges"]
        costs, usages, intervals = nodes["costs"], nodes["usages"], nodes["intervals"]
        edge_nodes, edge_costs = edges["nodes"], edges["costs"]
    except (KeyError, TypeError) as exc:
        raise ProblemError(
            f"not an IOPDDL problem: expected problem.nodes.{{costs,usages,intervals}} and "
            f"problem.edges.{{nodes,costs}}, missing {exc}"
        ) from None
    if not len(costs) == len(usages) == len(intervals):
        raise ProblemError(
            f"nodes disagree in count: {len(costs)} costs, {len(usages)} usages, {len(intervals)} intervals"
        )
    limit = p.get("usage_limit")
    ties, pins = p.get("ties", []), p.get("pins", {})
    if not isinstance(ties, list) or not all(isinstance(g, list) for g in ties):
        raise ProblemError(f"problem.ties: expected a list of node lists, found {type(ties).__name__}")
    if not isinstance(pins, dict):
        raise ProblemError(f"problem.pins: expected {{node: strategy}}, found {type(pins).__name__}")
    try:
        pins = {int(v): int(i) for v, i in pins.items()}
        ties = [[int(v) for v in g] for g in ties]
    except (TypeError, ValueError) as exc:
        raise ProblemError(f"problem.ties / problem.pins: expected integers: {exc}") from None
    return Problem(
        node_costs=[np.asarray(c, dtype=np.float64) for c in costs],
        node_usages=[np.asarray(u, dtype=np.float64) for u in usages],
        intervals=np.asarray(intervals, dtype=np.int64).reshape(-1, 2),
        edges=np.asarray(edge_nodes, dtype=np.int64).reshape(-1, 2),
        edge_costs=[np.asarray(c, dtype=np.float64) for c in edge_costs],
        usage_limit=None if limit is None else float(limit),
        pins=pins,
        ties=ties,
        name=p.get("name", name),
    )


def load(path: str | Path) -> Problem:
    """Load a contest instance from ``.json`` or ``.json.gz``."""
    path = Path(path)
    try:
        with _open(path, "r") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError, EOFError) as exc:
        raise ProblemError(f"{path}: cannot read an IOPDDL JSON file: {exc}") from None
    return from_dict(data, name=path.name.split(".")[0])


def _num(x: float):
    return int(x) if float(x).is_integer() else float(x)


def to_dict(problem: Problem) -> dict:
    """The contest's JSON object for ``problem``. Ties (``problem.ties``: lists of nodes that
    take one strategy index) and pins (``problem.pins``: node -> strategy) are written only
    when present: they extend the format, and a contest solver that ignores them solves a
    relaxation of the planner's problem."""
    out = {
        "name": problem.name,
        "nodes": {
            "intervals": problem.intervals.tolist(),
            "costs": [[_num(x) for x in c] for c in problem.node_costs],
            "usages": [[_num(x) for x in u] for u in problem.node_usages],
        },
        "edges": {
            "nodes": problem.edges.tolist(),
            "costs": [[_num(x) for x in m.ravel()] for m in problem.edge_costs],
        },
    }
    if problem.usage_limit is not None:
        out["usage_limit"] = _num(problem.usage_limit)
    if problem.ties:
        out["ties"] = [[int(v) for v in g] for g in problem.ties]
    if problem.pins:
        out["pins"] = {str(v): int(i) for v, i in sorted(problem.pins.items())}
    return {"problem": out}


def save(problem: Problem, path: str | Path) -> None:
    path = Path(path)
    with _open(path, "w") as f:
        json.dump(to_dict(problem), f)
