"""Elementwise ops DTensor has no sharding rule for, given its own pointwise rule.

These ops lack ``torch.Tag.pointwise`` (the tag DTensor's pointwise rules are registered by),
so a traced graph that holds one had it planned replicated and run replicated on every rank:
routers of Hugging Face MoE models (``floor_divide`` of token positions by top-k), Llama 4's
complex rotary table (``polar``), and the out-of-place ``copy`` and ``fill`` that writes through
views become (:mod:`autoshard.graph.viewwrites`). Each output element is a function of the inputs' elements
at the same (broadcast) index, so any sharding of the output with the inputs sharded alike is
exact; a partial input is not (``floor(a + b) != floor(a) + floor(b)``), and DTensor's
pointwise rule does not offer one for them.
"""

from __future__ import annotations

import torch

from autoshard import _torch_compat as tc

_A = torch.ops.aten

ELEMENTWISE = (_A.floor_divide.default, _A.floor_divide.Scalar, _A.polar.default, _A.complex.default, _A.copy.default,
               _A.fill.Tensor)
"""Ops registered with DTensor's elementwise rule (where DTensor has no rule of its own)."""


def register() -> None:
    """Give each op of :data:`ELEMENTWISE` DTensor's pointwise rule (idempotent)."""
    for op in ELEMENTWISE:
        tc.register_pointwise(op)


register()
