"""Every private torch API autoshard uses, in one place.

A torch upgrade that moves one of these touches this file only.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy  # noqa: F401
from torch.distributed.tensor._ops import utils as _op_utils
from torch.distributed.tensor._ops.single_dim_strategy import _expand_single_dim_strategy_to_mesh
from torch.distributed.tensor.placement_types import _StridedShard
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: F401

from costmodel._torch_compat import placements_of as to_placements  # noqa: F401 (one converter)
from costmodel.spec import Spec


def preserve_node_meta():
    """FX's metadata channel: while active, ``node_meta_custom()`` lands on every traced node."""
    return fx_traceback.preserve_node_meta()


def node_meta_custom() -> dict:
    """The ``custom`` metadata dict copied onto the nodes created from now on."""
    return fx_traceback.current_meta.setdefault("custom", {})


def is_persistent_buffer(module, name: str) -> bool:
    """Whether ``module``'s buffer ``name`` is part of its state dict (nn.Module's private set)."""
    return name not in module._non_persistent_buffers_set


def outside_local_tensor_mode():
    """A context that suspends an active LocalTensorMode (tracing must not run per rank)."""
    import contextlib

    try:
        from torch.distributed._local_tensor import get_local_tensor_mode_list
    except ImportError:
        return contextlib.nullcontext()
    modes = [m for m in get_local_tensor_mode_list() if not getattr(m, "_disable", False)]
    return modes[-1].disable() if modes else contextlib.nullcontext()


def sharding_propagator():
    return DTensor._op_dispatcher.sharding_propagator


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(t.shape, t.stride(), t.dtype)


def make_spec(mesh, spec: Spec, t: torch.Tensor) -> DTensorSpec:
    return DTensorSpec(mesh, to_placements(spec), tensor_meta=tensor_meta(t))


def placements_for(spec: Spec, mesh) -> tuple:
    """DTensor placements of ``spec`` on ``mesh``, its shard order included: a dim split in a
    non-default order carries ``_StridedShard`` placements (DTensor's encoding of the order, the
    one FSDP2-over-TP uses), whose local shards are exactly the planner executor's."""
    placements = to_placements(spec)
    if not spec.shard_order:
        return placements
    order = tuple(ShardOrderEntry(tensor_dim=d, mesh_dims=tuple(axes)) for d, axes in spec.shard_order)
    return tuple(DTensorSpec._convert_shard_order_to_StridedShard(order, placements, mesh))


def from_placements(placements, mesh=None) -> Spec | None:
    """Our spec for DTensor placements; None for kinds we do not plan with (norm partials,
    strided shards that encode no shard order, or any strided shard when ``mesh`` is None)."""
    placements = tuple(placements)
    order = ()
    if any(isinstance(p, _StridedShard) for p in placements):
        if mesh is None:
            return None
        decoded = DTensorSpec._maybe_convert_StridedShard_to_shard_order(placements, mesh)
        if decoded is None:
            return None
        order = tuple((e.tensor_dim, tuple(e.mesh_dims)) for e in decoded)
        placements = tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements)
    out = []
    for p in placements:
        if type(p) is Shard:
            out.append(f"S({p.dim})")
        elif type(p) is Replicate:
            out.append("R")
        elif type(p) is Partial and p.reduce_op in ("sum", "avg", "max", "min"):
            out.append(f"P({p.reduce_op})")
        else:
            return None
    return Spec(tuple(out), order)


def _zero_cost(src, dst) -> float:
    return 0.0


def op_strategy(op, schema: OpSchema, mesh, out_meta):
    """DTensor's full strategy list for ``op``; None when DTensor has no rule.

    Single-dim rules are expanded to every mesh axis by DTensor's own expander.
    DTensor's strategy functions price every (candidate input, strategy) pair with
    its own redistribute cost, which we never read (our planner prices edges):
    stubbing it out for the call removes most of the enumeration time.
    """
    saved = _op_utils.redistribute_cost
    _op_utils.redistribute_cost = _zero_cost
    try:
        return _op_strategy(op, schema, mesh, out_meta)
    finally:
        _op_utils.redistribute_cost = saved


def _op_strategy(op, schema: OpSchema, mesh, out_meta):
    prop = sharding_propagator()
    if op in prop.op_single_dim_strategy_funcs:
        info = prop.op_single_dim_strategy_funcs[op]
        fn = _expand_single_dim_strategy_to_mesh(mesh, schema, info, out_meta)
        return fn(op, schema.args_meta, schema.kwargs_meta)
    if op in prop.op_strategy_funcs:
        if op in prop.op_to_schema_info:
            schema.schema_info = prop.op_to_schema_info[op]
        return prop.op_strategy_funcs[op](schema)
    return None


def has_rule(op) -> bool:
    prop = sharding_propagator()
    return op in prop.op_single_dim_strategy_funcs or op in prop.op_strategy_funcs
