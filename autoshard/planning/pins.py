"""Pins: fix the spec of named parameters, modules or inputs before solving.

A pin key is a glob over parameter (or buffer) FQNs; a key that names a module
pins every parameter under it (``layers.*.attn`` pins ``layers.3.attn.wq.weight``).
A value is a spec in text form (``"S(0)[1,0]S(0)"``, one placement per mesh axis)
or a dict ``{axis name: placement}`` with the other axes replicated. Inputs are
pinned by position with ``input_specs``.
"""

from __future__ import annotations

import fnmatch

from autoshard.errors import AutoshardError
from costmodel.spec import Spec


def to_spec(value, axis_names: tuple[str, ...], what: str) -> Spec:
    if isinstance(value, Spec):
        spec = value
    elif isinstance(value, dict):
        unknown = sorted(set(value) - set(axis_names))
        if unknown:
            raise AutoshardError(f"{what}: axes {unknown} are not mesh axes {list(axis_names)}")
        spec = Spec(tuple(str(value.get(a, "R")) for a in axis_names))
    else:
        try:
            spec = Spec.parse(str(value))
        except ValueError as exc:
            raise AutoshardError(f"{what}: {exc}") from None
    if len(spec.placements) != len(axis_names):
        raise AutoshardError(
            f"{what}: spec {spec} has {len(spec.placements)} placements, the mesh has {len(axis_names)} axes "
            f"{list(axis_names)}"
        )
    return spec


def resolve_pins(pins: dict, fqns: list[str], axis_names: tuple[str, ...]) -> dict[str, Spec]:
    """Parameter FQN -> pinned spec. Every key must match something; later keys win."""
    out: dict[str, Spec] = {}
    # A key without wildcards (every key of a hand-written plan: one per parameter) names a
    # parameter or a module: looked up, not matched against every name (LLaMA-70B: 723 keys
    # times 723 names, 1 s per baseline).
    under: dict[str, list[str]] = {}
    for f in fqns:
        under.setdefault(f, []).append(f)
        parts = f.split(".")
        for k in range(1, len(parts)):
            under.setdefault(".".join(parts[:k]), []).append(f)
    for key, value in (pins or {}).items():
        spec = to_spec(value, axis_names, f"pin {key!r}")
        if any(c in key for c in "*?["):
            hits = [f for f in fqns if fnmatch.fnmatchcase(f, key) or fnmatch.fnmatchcase(f, key + ".*")]
        else:
            hits = under.get(key, [])
        if not hits:
            raise AutoshardError(
                f"pin {key!r} matches no parameter or module; parameters look like {fqns[:3]}"
            )
        for f in hits:
            out[f] = spec
    return out
