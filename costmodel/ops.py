"""Which ops of a traced program launch work on the device: the host issues every op, but a
view (it aliases its input: no kernel, no memory) costs it less than an op that launches a
kernel, and a tuple's ``getitem`` almost nothing (:attr:`costmodel.Profile.host_view_us`)."""

from __future__ import annotations

import operator

import torch


def is_view_target(target) -> bool:
    """Whether calling ``target`` (an aten overload) aliases its input: view ops, ``detach`` and
    ``_unsafe_view``."""
    return isinstance(target, torch._ops.OpOverload) and bool(getattr(target, "is_view", False)) \
        or target in (torch.ops.aten.detach.default, torch.ops.aten._unsafe_view.default)


def host_kind(target) -> str:
    """How the host issues a call of ``target``: ``"free"`` (a Python ``getitem`` of an op's
    tuple), ``"view"`` or ``"kernel"``."""
    if target is operator.getitem:
        return "free"
    return "view" if is_view_target(target) else "kernel"
