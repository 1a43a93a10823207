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


def _show(value) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _list(value, field: str) -> list:
    if not isinstance(value, list):
        raise ProblemError(f"{field}: expected a list, found {type(value).__name__} {_show(value)}")
    return value


def _numbers(value, field: str, dtype=np.float64) -> np.ndarray:
    """A flat numeric array from a JSON list, or a ProblemError naming the field."""
    kind = "integers" if dtype == np.int64 else "numbers"
    if not isinstance(value, list):
        raise ProblemError(f"{field}: expected a list of {kind}, found {_show(value)}")
    try:
        # Inferred first (C speed on big instances): strings, nulls, nested lists and ints past
        # 64 bits come out as a non-numeric dtype or a ragged error instead of being coerced.
        a = np.asarray(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProblemError(f"{field}: expected a list of {kind}, found {_show(value)} ({exc})") from None
    if a.ndim != 1 and a.size:
        raise ProblemError(f"{field}: expected a flat list of {kind}, found {_show(value)}")
    if a.size and (a.dtype.kind not in ("biu" if dtype == np.int64 else "biuf")):
        raise ProblemError(f"{field}: expected a list of {kind}, found {_show(value)}")
    return (a if a.dtype == dtype else a.astype(dtype)).reshape(-1)


def _pairs(value, field: str) -> np.ndarray:
    rows = _list(value, field)
    try:
        a = np.asarray(rows)
        if a.ndim == 2 and a.shape[1] == 2 and a.dtype.kind in "biu":
            return a.astype(np.int64)
    except (TypeError, ValueError, OverflowError):
        pass  # ragged or mixed: the row-by-row pass below names the bad row
    flat = []
    for i, r in enumerate(rows):
        pair = _numbers(r, f"{field}[{i}]", np.int64)
        if pair.shape != (2,):
            raise ProblemError(f"{field}[{i}]: expected a pair [a, b], found {_show(r)}")
        flat.append(pair)
    return np.stack(flat) if flat else np.zeros((0, 2), np.int64)


def _int(value, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str, float)):
        raise ProblemError(f"{field}: expected an integer, found {_show(value)}")
    try:
        out = int(value)
    except (TypeError, ValueError, OverflowError):
        raise ProblemError(f"{field}: expected an integer, found {_show(value)}") from None
    if isinstance(value, float) and out != value:
        raise ProblemError(f"{field}: expected an integer, found {_show(value)}")
    return out


def from_dict(data: dict, name: str = "") -> Problem:
    """Build a :class:`Problem` from the contest's JSON object. Anything malformed (missing
    keys, wrong types, ragged arrays, numbers out of range) raises :class:`ProblemError`
    naming the field."""
    try:
        p = data["problem"]
        nodes, edges = p["nodes"], p["edges"]
        costs, usages, intervals = nodes["costs"], nodes["usages"], nodes["intervals"]
        edge_nodes, edge_costs = edges["nodes"], edges["costs"]
    except (KeyError, TypeError, IndexError) as exc:
        raise ProblemError(
            f"not an IOPDDL problem: expected problem.nodes.{{costs,usages,intervals}} and "
            f"problem.edges.{{nodes,costs}}, missing {exc}"
        ) from None
    costs, usages = _list(costs, "problem.nodes.costs"), _list(usages, "problem.nodes.usages")
    intervals, edge_costs = _list(intervals, "problem.nodes.intervals"), _list(edge_costs, "problem.edges.costs")
    if not len(costs) == len(usages) == len(intervals):
        raise ProblemError(
            f"nodes disagree in count: {len(costs)} costs, {len(usages)} usages, {len(intervals)} intervals"
        )
    limit = p.get("usage_limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))):
        raise ProblemError(f"problem.usage_limit: expected a number or null, found {_show(limit)}")
    ties, pins = p.get("ties", []), p.get("pins", {})
    if not isinstance(ties, list) or not all(isinstance(g, list) for g in ties):
        raise ProblemError(f"problem.ties: expected a list of node lists, found {type(ties).__name__}")
    if not isinstance(pins, dict):
        raise ProblemError(f"problem.pins: expected {{node: strategy}}, found {type(pins).__name__}")
    pins = {_int(v, "problem.pins (node)"): _int(i, f"problem.pins[{v}]") for v, i in pins.items()}
    ties = [[_int(v, f"problem.ties[{k}]") for v in g] for k, g in enumerate(ties)]
    label = p.get("name", name)
    return Problem(
        node_costs=[_numbers(c, f"problem.nodes.costs[{v}]") for v, c in enumerate(costs)],
        node_usages=[_numbers(u, f"problem.nodes.usages[{v}]") for v, u in enumerate(usages)],
        intervals=_pairs(intervals, "problem.nodes.intervals"),
        edges=_pairs(_list(edge_nodes, "problem.edges.nodes"), "problem.edges.nodes"),
        edge_costs=[_numbers(c, f"problem.edges.costs[{e}]") for e, c in enumerate(edge_costs)],
        usage_limit=None if limit is None else float(limit),
        pins=pins,
        ties=ties,
        name=label if isinstance(label, str) else str(label),
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
