"""The project's shape, checked on its source: what may import what.

- No module imports a private name (``_x``) of another module of the project, by
  ``from m import _x`` or by ``m._x``; the torch adapters (``_torch_compat``, the one place
  private torch APIs go through) are the exception.
- ``solver`` never imports torch; ``costmodel`` and ``solver`` never import ``autoshard``,
  and neither imports the other (``autoshard -> costmodel``, ``autoshard -> solver``).
- No import cycle between the project's modules, function-level imports included.
- ``autoshard``'s layers import downwards only (:data:`LAYERS`): the reference models and the
  traced graph build on the core alone, the runtime on the graph, the planner on the runtime and
  the graph; the entry points at the top (the API, the CLI, the service) on anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("autoshard", "solver", "costmodel")
ADAPTER = "_torch_compat"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(dirs) -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text(), filename=str(p))
            for d in dirs for p in sorted((ROOT / d).rglob("*.py"))}


PACKAGE_MODULES = _sources(PACKAGES)
ALL = {**PACKAGE_MODULES, **_sources(("tests", "benchmarks"))}


def _is_project(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _imports(tree: ast.Module):
    """(imported module, imported name or None) for every import in ``tree``, nested ones too."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None, a.asname
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                yield node.module, a.name, a.asname


def private_uses(me: str, tree: ast.Module) -> list[str]:
    out, aliases = [], {}
    for module, name, asname in _imports(tree):
        if not _is_project(module):
            continue
        if name is None:
            aliases[asname or module] = module
            continue
        full = f"{module}.{name}"
        if full in PACKAGE_MODULES:
            aliases[asname or name] = full
        elif name.startswith("_") and not name.startswith("__") and name != ADAPTER and module != me:
            out.append(f"{me}: from {module} import {name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            owner = aliases[node.value.id]
            attr = node.attr
            if attr.startswith("_") and not attr.startswith("__") and attr != ADAPTER and owner != me \
                    and not owner.endswith(ADAPTER):
                out.append(f"{me}: {node.value.id}.{attr} ({owner})")
    return out


def test_no_module_uses_another_modules_private_names():
    found = [use for me, tree in sorted(ALL.items()) for use in private_uses(me, tree)]
    assert found == [], "\n".join(found)


def test_the_checker_sees_both_forms():
    tree = ast.parse("from solver.heuristic import _Memory\nfrom solver import heuristic\nheuristic._Adjacency\n"
                     "from autoshard import _torch_compat\n_torch_compat._x\n")
    assert private_uses("solver.lns", tree) == ["solver.lns: from solver.heuristic import _Memory",
                                                "solver.lns: heuristic._Adjacency (solver.heuristic)"]


def test_dependency_direction():
    bad = []
    for me, tree in PACKAGE_MODULES.items():
        top = me.split(".")[0]
        for module, _name, _as in _imports(tree):
            dep = module.split(".")[0]
            if top == "solver" and dep in ("torch", "autoshard", "costmodel"):
                bad.append(f"{me} imports {module}")
            if top == "costmodel" and dep in ("autoshard", "solver"):
                bad.append(f"{me} imports {module}")
    assert bad == [], bad


#: Layer of ``autoshard`` -> the layers it may import (itself included). A module not named
#: here is an entry point (``autoshard.apply``, ``autoshard.cli``, ``autoshard.serve`` ...).
CORE = {f"autoshard.{m}" for m in ("errors", "units", "planfile", "plansummary", "options", "mesh", "gcpause",
                                 ADAPTER)}
LAYERS = {
    "core": {"core"},
    "autoshard.models": {"core", "autoshard.models"},
    "autoshard.graph": {"core", "autoshard.graph"},
    "autoshard.runtime": {"core", "autoshard.graph", "autoshard.runtime"},
    "autoshard.planning": {"core", "autoshard.graph", "autoshard.runtime", "autoshard.planning"},
}


def layer_of(module: str) -> str | None:
    if module in CORE:
        return "core"
    return next((layer for layer in LAYERS if module == layer or module.startswith(layer + ".")), None)


def layer_breaches(me: str, tree: ast.Module) -> list[str]:
    mine = layer_of(me)
    if mine is None:
        return []
    out = []
    for module, name, _as in _imports(tree):
        if module.split(".")[0] != "autoshard":
            continue
        full = f"{module}.{name}" if name and f"{module}.{name}" in PACKAGE_MODULES else module
        theirs = layer_of(full)
        if full != "autoshard" and theirs not in LAYERS[mine]:
            out.append(f"{me} ({mine}) imports {full} ({theirs or 'an entry point'})")
        elif full == "autoshard":
            out.append(f"{me} ({mine}) imports the package's public face")
    return out


def test_layers_import_downwards():
    found = [b for me, tree in sorted(PACKAGE_MODULES.items()) for b in layer_breaches(me, tree)]
    assert found == [], "\n".join(found)


def test_the_layer_checker_sees_a_breach():
    tree = ast.parse("from autoshard.planning.problem import build_problem\nfrom autoshard.graph import rng\n"
                     "from autoshard import apply\n")
    assert layer_breaches("autoshard.runtime.lower", tree) == [
        "autoshard.runtime.lower (autoshard.runtime) imports autoshard.planning.problem (autoshard.planning)",
        "autoshard.runtime.lower (autoshard.runtime) imports autoshard.apply (an entry point)"]
    assert layer_breaches("autoshard.cli", tree) == []


def test_no_import_cycles():
    graph: dict[str, set[str]] = {m: set() for m in PACKAGE_MODULES}
    for me, tree in PACKAGE_MODULES.items():
        for module, name, _as in _imports(tree):
            if not _is_project(module):
                continue
            sub = f"{module}.{name}" if name else None
            target = sub if sub in PACKAGE_MODULES else module
            if target in PACKAGE_MODULES and target != me and not (me.startswith(target + ".") and sub is None):
                graph[me].add(target)
    # A package's __init__ re-exports its modules: an edge into a package is an edge into what it
    # re-exports, so `from solver import heuristic` inside solver.lns is no cycle through solver/__init__.
    for pkg in PACKAGES:
        for m in graph:
            if pkg in graph[m] and m.startswith(pkg + "."):
                graph[m].discard(pkg)
    cycles, state = [], {}

    def visit(v, path):
        state[v] = 1
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                cycles.append(path[path.index(w):] + [w])
            elif w not in state:
                visit(w, path + [w])
        state[v] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == [], cycles
