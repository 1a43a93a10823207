"""What one op of a traced graph costs whatever its sharding: its FLOPs, the dtype it computes
in, its memory access pattern, where a matmul's operands are, whether it is a view.

The planner's problem (:mod:`autoshard.planning.problem`) and the program passes'
estimator (:mod:`autoshard.runtime.program.passes`) price nodes by these, so the plan and the
program it lowers to are priced alike.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode

from autoshard.errors import first_line
from autoshard.graph.attention import attention_flops
from autoshard.graph.strategies import is_tensor
from costmodel.ops import is_view_target

log = logging.getLogger(__name__)


def node_flops(node: fx.Node, memo: dict, failures: dict[str, str] | None = None) -> float:
    """FLOPs of one traced op, counted on its fake values (memoized in ``memo`` by op, argument
    shapes and literal arguments). An op fake tensors cannot run counts 0 FLOPs; its name and
    the error go to ``failures`` (the plan summary's ``flops_uncounted``) and to the log."""
    key = (node.target, tuple(tuple(a.meta["val"].shape) for a in node.all_input_nodes if is_tensor(a)),
           tuple(repr(a) for a in node.args if not isinstance(a, fx.Node)))
    if key in memo:
        return memo[key]
    fused = attention_flops(node)
    if fused is not None:  # torch's counter ignores causal masks and lacks the CPU kernel
        memo[key] = fused
        return fused
    vals = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
    fm = next((a.meta["val"].fake_mode for a in node.all_input_nodes if is_tensor(a)), None)
    flops = 0.0
    if fm is not None:
        try:
            with fm, FlopCounterMode(display=False) as fc:
                node.target(*vals[0], **vals[1])
            flops = float(fc.get_total_flops())
        except Exception as exc:  # an op fake tensors cannot run: costed as free, and said so
            flops = 0.0
            name = str(node.target)
            if failures is not None and name not in failures:
                failures[name] = first_line(exc)
                log.warning(f"FLOPs of {name} could not be counted (costed as 0): {failures[name]}")
    memo[key] = flops
    return flops


def node_dtype(node: fx.Node) -> str | None:
    """The dtype an op computes in, as ``Profile.tflops`` names it (``"bfloat16"``): its first
    floating-point output's, else its first floating-point input's (None: no such tensor)."""
    out = node.meta.get("val")
    vals = list(out) if isinstance(out, (list, tuple)) else [out]
    vals += [a.meta.get("val") for a in node.all_input_nodes]
    for v in vals:
        if isinstance(v, torch.Tensor) and v.dtype.is_floating_point:
            return str(v.dtype).removeprefix("torch.")
    return None


#: Ops that normalize along a dim (a reduction, then an elementwise pass), by name.
_NORMALIZING = ("softmax", "norm")
#: Reductions, by name: one that keeps its input's last dim reads across rows (``outer_reduction``).
_REDUCING = ("sum", "mean", "amax", "amin", "max", "min", "var", "std", "prod", "logsumexp", "any", "all")
#: Ops that accumulate rows at indices (an embedding's gradient), by name.
_SCATTERING = ("embedding_dense_backward", "index_add", "scatter_add", "index_put")
#: Ops that lay their inputs side by side: each input read once, though smaller than the output
#: (not a broadcast: on an H200 `cat` ran at 2.1x the speed the broadcast share priced it at).
_CONCATENATING = (torch.ops.aten.cat.default, torch.ops.aten.stack.default)


def memory_pattern(node: fx.Node) -> str | None:
    """The access pattern of a memory-bound op (``Profile.mem_efficiency``): ``normalize``
    (softmax or a norm, forward or backward), ``scatter`` (rows accumulated at indices),
    ``outer_reduction`` (a reduction that keeps its input's last dim), ``reduction`` (any other
    output smaller than an input),
    ``transposed`` (an operand of more than one element whose last dim is not contiguous),
    ``strided`` (one not contiguous whose last dim is), ``broadcast`` (an operand of more than
    one element but fewer than the output, re-read; not a concatenation's); None: a contiguous
    elementwise op or copy."""
    out = node.meta.get("val")
    outs = [o for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, torch.Tensor)]
    ins = [v for v in (a.meta.get("val") for a in node.all_input_nodes) if isinstance(v, torch.Tensor)]
    if not outs or not ins:
        return None
    if any(k in str(node.target) for k in _NORMALIZING):
        return "normalize"
    name = str(node.target).split(".")[1] if str(node.target).startswith("aten.") else str(node.target)
    if any(k in name for k in _SCATTERING):
        return "scatter"
    numel = max(o.numel() for o in outs)
    big = max(ins, key=lambda v: v.numel())
    if numel < big.numel():
        out = max(outs, key=lambda o: o.numel())
        if name in _REDUCING and big.dim() > 1 and out.dim() and out.shape[-1] == big.shape[-1] > 1:
            return "outer_reduction"
        return "reduction"
    if any(v.numel() > 1 and v.dim() and v.shape[-1] > 1 and v.stride()[-1] != 1 for v in ins):
        return "transposed"
    if any(v.numel() > 1 and not v.is_contiguous() for v in ins):
        return "strided"
    if node.target not in _CONCATENATING and any(1 < v.numel() < numel for v in ins):
        return "broadcast"
    return None


_UNKNOWN = object()


def op_pricing(node: fx.Node, flops: float, pattern=_UNKNOWN) -> tuple[str | None, str | None]:
    """``(dtype, pattern)`` to price ``node`` by (``costmodel.compute_time_us``): an op with
    FLOPs at its dtype's rate, one without at its access pattern's bandwidth (``pattern``: its
    :func:`memory_pattern` where the caller has it)."""
    if flops > 0:
        return node_dtype(node), None
    return None, memory_pattern(node) if pattern is _UNKNOWN else pattern


#: Matmuls by op: the positions of their operands A ([..., M, K]) and B ([..., K, N]) in ``args``.
_MATMULS = {torch.ops.aten.mm.default: (0, 1), torch.ops.aten.addmm.default: (1, 2),
            torch.ops.aten.bmm.default: (0, 1), torch.ops.aten.baddbmm.default: (1, 2)}


def matmul_operands(node: fx.Node) -> tuple[int, int] | None:
    """Where a matmul's operands A and B are among the node's tensor arguments (in
    ``strategies._tensor_args`` order: ``args`` first); None for other ops."""
    pos = _MATMULS.get(node.target)
    if pos is None:
        return None
    index = [k for k, a in enumerate(node.args) if is_tensor(a)]
    if pos[0] not in index or pos[1] not in index:
        return None
    return index.index(pos[0]), index.index(pos[1])


def matmul_side(a_shape, b_shape) -> float | None:
    """The side of the cube of a matmul's M x N x K times its batch entries
    (``Profile.matmul_share``): a batched matmul's entries run side by side, so it fills the
    device as one matmul of its whole volume does."""
    batch = max(math.prod(a_shape[:-2]), math.prod(b_shape[:-2]))
    volume = batch * a_shape[-2] * a_shape[-1] * b_shape[-1]
    return volume ** (1 / 3) if volume > 0 else None


def is_view(node: fx.Node) -> bool:
    """Whether ``node`` aliases its input (no kernel, no memory): view ops, ``detach`` and
    ``_unsafe_view``."""
    return is_view_target(node.target)
