"""Elementwise ops DTensor has no sharding rule for, given its own pointwise rule.

These ops lack ``torch.Tag.pointwise`` (the tag DTensor's pointwise rules are registered by),
so a traced graph that holds one had it planned replicated and run replicated on every rank:
routers of Hugging Face MoE models (``floor_divide`` of token positions by top-k), Llama 4's
complex rotary table (``polar``), the out-of-place ``copy`` and ``fill`` that writes through
views become (:mod:`autoshard.graph.viewwrites`), the backward of Mamba's ``softplus`` and of
other activations. Each output element is a function of the inputs' elements
at the same (broadcast) index, so any sharding of the output with the inputs sharded alike is
exact; a partial input is not (``floor(a + b) != floor(a) + floor(b)``), and DTensor's
pointwise rule does not offer one for them.
"""

from __future__ import annotations

import torch

from autoshard import _torch_compat as tc

_A = torch.ops.aten

ELEMENTWISE = (_A.floor_divide.default, _A.floor_divide.Scalar, _A.polar.default, _A.complex.default, _A.copy.default,
               _A.fill.Tensor, _A.masked_fill.Tensor, _A.hardswish.default,
               # activations' gradients: (grad, input or result, scalars) -> grad in, elementwise
               _A.hardtanh_backward.default, _A.leaky_relu_backward.default, _A.elu_backward.default,
               _A.softplus_backward.default, _A.mish_backward.default, _A.hardswish_backward.default,
               _A.hardsigmoid_backward.default, _A.softshrink_backward.default, _A.hardshrink_backward.default)
"""Ops registered with DTensor's elementwise rule (where DTensor has no rule of its own)."""


def register() -> None:
    """Give each op of :data:`ELEMENTWISE` DTensor's pointwise rule (idempotent)."""
    for op in ELEMENTWISE:
        tc.register_pointwise(op)


register()
