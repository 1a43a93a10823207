"""Check a JSON object against a dataclass's fields before building it.

Profiles arrive from files and over the service's API: a wrong type must be reported
as the field and what was found, not surface later as a ``TypeError`` deep in the cost
model. Supported annotations: ``str``, ``bool``, ``int``, ``float`` (finite; ints
accepted), ``X | None`` (null allowed), ``dict``, ``tuple`` / ``list`` (any items) and ``list[float]``, and nested
dataclasses given as objects.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing

from costmodel.errors import CostModelError


def _show(value) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(value, hint, where: str):
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"jsonfields: unsupported annotation {hint!r} at {where}")
        return _check(value, rest[0], where)
    if dataclasses.is_dataclass(hint):
        return hint(**fields_of(hint, value, where)) if isinstance(value, dict) else _bad(where, "an object", value)
    if hint is float:
        return float(value) if _is_number(value) else _bad(where, "a finite number", value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
            _bad(where, "an integer", value)
        return int(value)
    if hint is bool:
        return value if isinstance(value, bool) else _bad(where, "true or false", value)
    if hint is str:
        return value if isinstance(value, str) else _bad(where, "a string", value)
    if hint is dict:
        return value if isinstance(value, dict) else _bad(where, "an object", value)
    if hint in (tuple, list) or origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            _bad(where, "a list", value)
        args = typing.get_args(hint)
        if args and args[0] is float:
            return [_check(x, float, f"{where}[{i}]") for i, x in enumerate(value)]
        return value
    raise TypeError(f"jsonfields: unsupported annotation {hint!r} at {where}")


def _bad(where: str, expected: str, value):
    raise CostModelError(f"{where}: expected {expected}, found {_show(value)}")


def fields_of(cls, data, where: str) -> dict:
    """``data``'s fields for ``cls(**fields)``, each checked (and numbers normalized);
    a :class:`CostModelError` names the first field that is missing, unknown or mistyped."""
    if not isinstance(data, dict):
        _bad(where, "an object", data)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise CostModelError(f"{where}: unknown fields {unknown}; expected some of {sorted(fields)}")
    missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise CostModelError(f"{where}: missing fields {missing}")
    return {k: _check(v, hints[k], f"{where}.{k}") for k, v in data.items()}
