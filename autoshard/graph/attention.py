"""Fused attention (``F.scaled_dot_product_attention``'s kernels): sharding rules, FLOPs, kernels.

``F.scaled_dot_product_attention`` traced on the meta device or a CPU runs torch's fused CPU
kernel ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward), as a CUDA trace
runs the flash, memory-efficient or cuDNN kernel. Every one of them keeps only its output and
the row log-sum-exp (``lse``, float32, ``(B, H, L)``) for the backward, which recomputes the
scores block by block: memory linear in the sequence, FLOPs quadratic.

Sharding rules of the CPU kernel (DTensor has rules for the CUDA kernels only), per mesh axis,
with ``q: (B, Hq, L, E)``, ``k: (B, Hkv, S, E)``, ``v: (B, Hkv, S, Ev)``, ``Hkv | Hq`` (grouped
queries), ``mask`` broadcastable to ``(B, Hq, L, S)``:

- batch: ``q, k, v, out, lse`` and every gradient ``S(0)``; the mask ``S(0)`` where it has a
  batch dim of its own, else ``R``;
- heads: the same on dim 1, the mask's head dim ``S`` where it has one. With grouped queries a
  head split is right only when it splits ``Hq`` and ``Hkv`` evenly (query head ``h`` reads
  key head ``h // (Hq / Hkv)``): :func:`heads_split_evenly` drops the others
  (``strategies.executable``);
- queries: ``q, out, lse, grad_q`` split on the query sequence (``S(2)``), ``k, v``
  replicated; in the backward ``grad_k`` and ``grad_v`` are partial sums (each rank's queries
  contribute to every key).

A causal kernel masks by local positions, so DTensor's rule does not offer the query split for
it (the local kernel would shift the diagonal). The planner does (:func:`rule_arguments`): a
causal query split is context parallelism in its all-gather form (LLaMA 3's), the keys and
values gathered by the planned redistribute, each rank's queries run against the keys up to
its last one by :func:`sequence_forward` and :func:`sequence_backward` (the lowering calls
them; the queries' global offset is the rank's), the key and value gradients reduce-scattered
by the planned redistribute. Split contiguously, the rank with the sequence's end does the most
work (about ``2 - 1/n`` times an even share); where the sequence cuts into two chunks per rank,
each rank swaps its second chunk with its mirror's (:func:`mirror_forward`,
:func:`mirror_backward`: rank ``r`` of ``n`` runs chunks ``2r`` and ``2n - 1 - 2r``, equal work).
:func:`work_factor` prices the busiest rank, :func:`kernel_messages` the exchange. Where the
mirror balances a split, ring attention is offered too (:func:`ring_strategies`): keys, values
and their gradients split like the queries, their shards passed round the ring
(:func:`ring_forward`, :func:`ring_backward`). Either is offered only where the batch could not
take the split's axes (:func:`sequence_split_offered`).

Nothing else is legal: the head dim is contracted inside the softmax, and a split of the keys'
sequence needs the softmax's running maximum and sum merged across ranks (ring attention).

FLOPs (:func:`attention_flops`, by :func:`costmodel.compute.attention_flops`): forward
``2 B Hq L S (E + Ev)`` (scores and their product with ``v``), backward ``2 B Hq L S (3 E + 2 Ev)``
(the scores recomputed, ``dP``, ``dV``, ``dQ``, ``dK``), both times the share of the ``L x S``
scores a causal mask keeps (``(L+1)/2L`` when ``L = S``). Torch's FLOP counter ignores the
causal mask and has no formula for the CPU kernel.
The kernels reach their own share of the matmul rate (``Profile.kernel_shares``).
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from autoshard import _torch_compat as tc
from costmodel.compute import attention_flops as fused_flops
from costmodel.compute import balanced_split_share, causal_split_share
from costmodel.profile import KERNELS

aten = torch.ops.aten

#: The fused forward kernels of ``F.scaled_dot_product_attention``.
FORWARD = (aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_flash_attention.default,
           aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_cudnn_attention.default)
#: Their backward kernels.
BACKWARD = (aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            aten._scaled_dot_product_flash_attention_backward.default,
            aten._scaled_dot_product_efficient_attention_backward.default,
            aten._scaled_dot_product_cudnn_attention_backward.default)
FUSED = frozenset(FORWARD + BACKWARD)

#: ``Profile.kernel_shares`` keys of the two kernels.
KERNEL_FORWARD, KERNEL_BACKWARD = KERNELS


def is_fused_attention(target) -> bool:
    """Whether an op is one of the fused attention kernels (forward or backward)."""
    return target in FUSED


def kernel_of(target) -> str | None:
    """The ``Profile.kernel_shares`` key an op is priced by (None: not a fused kernel)."""
    if target in FORWARD:
        return KERNEL_FORWARD
    if target in BACKWARD:
        return KERNEL_BACKWARD
    return None


def bound_args(target, args, kwargs) -> dict:
    """The op's arguments by schema name (``query``, ``key``, ``value``, ``is_causal``,
    ``attn_mask`` / ``attn_bias`` ...), defaults filled in."""
    out = {}
    for k, a in enumerate(target._schema.arguments):
        if k < len(args) and not a.kwarg_only:
            out[a.name] = args[k]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def _shape(x):
    v = x.meta.get("val") if isinstance(x, fx.Node) else x
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def attention_flops(node: fx.Node) -> float | None:
    """FLOPs of a fused attention node (forward or backward, formulas in the module doc); None
    for other ops or shapes not of rank 4."""
    target = node.target
    if target not in FUSED:
        return None
    args = bound_args(target, node.args, node.kwargs)
    q, k, v = (_shape(args.get(n)) for n in ("query", "key", "value"))
    if not (q and k and v) or len(q) != 4 or len(k) != 4 or len(v) != 4:
        return None
    return fused_flops(q[0], q[1], q[2], k[2], q[3], v[3], bool(args.get("is_causal")), target in BACKWARD)


def attention_summary(nodes, chosen, profile, mesh_shape=None) -> dict:
    """What a plan says of its fused attention (``Plan.summary["attention"]``; empty without
    any): ``kernels`` (forward kernels planned), ``splits`` (the query's spec -> kernels so
    split), ``sequence`` (causal kernels split on the sequence: context parallelism;
    ``balanced`` of them by the mirror exchange, ``ring`` of them ring attention; absent where
    none) and ``kernel_shares`` (the profile's shares of the matmul rate the kernels are priced
    at; absent: at the matmul rate)."""
    splits: dict[str, int] = {}
    sequence = balanced = ring = 0
    for n, st in zip(nodes, chosen):
        if n.op == "call_function" and n.target in FORWARD:
            key = str(st.ins[0])
            splits[key] = splits.get(key, 0) + 1
            axes = [a for a, d in enumerate(st.ins[0].shard_dims()) if d == 2]
            if axes and is_causal_cpu_kernel(n):
                sequence += 1
                q_len = _shape(bound_args(n.target, n.args, n.kwargs)["query"])[2]
                balanced += mesh_shape is not None and mirror_axes(axes, q_len, mesh_shape) is not None
                ring += 2 in st.ins[1].shard_dims()  # the key's spec: split too on a ring
    if not splits:
        return {}
    out = {"kernels": sum(splits.values()), "splits": dict(sorted(splits.items()))}
    if sequence:
        out["sequence"] = {"kernels": sequence, "balanced": int(balanced), "ring": int(ring)}
    shares = {k: profile.kernel_share(k) for k in KERNELS if k in profile.kernel_shares}
    if shares:
        out["kernel_shares"] = shares
    return out


# ----------------------------------------------------------------------------------------------
# Sharding rules of the CPU kernel (DTensor's single-dim form: outputs, then tensor inputs).


def _mask_placement(mask, q_dims: int, q_size: int, dim: int):
    """The mask's placement when ``q`` is split on ``dim`` (of ``(B, H, L, S)``): split on its own
    matching dim where that dim is not broadcast, else replicated."""
    shape = tuple(mask.shape)
    own = dim - (q_dims - len(shape))  # the mask broadcasts from the right
    if own >= 0 and shape[own] == q_size and q_size > 1:
        return tc.Shard(own)
    return tc.Replicate()


def _cpu_rules(args: dict, backward: bool) -> list[list]:
    q, mask = args["query"], args.get("attn_mask")
    Shard, Replicate, Partial = tc.Shard, tc.Replicate, tc.Partial
    rules = []
    for dim in (0, 1):
        n_out = 3 if backward else 2
        n_in = 6 if backward else 3
        rule = [Shard(dim)] * (n_out + n_in)
        if mask is not None:
            rule.append(_mask_placement(mask, len(q.shape), q.shape[dim], dim))
        rules.append(rule)
    if not args.get("is_causal"):
        if backward:  # grad_q, grad_k, grad_v | grad_out, q, k, v, out, lse
            rule = [Shard(2), Partial(), Partial(), Shard(2), Shard(2), Replicate(), Replicate(), Shard(2), Shard(2)]
        else:  # out, lse | q, k, v
            rule = [Shard(2), Shard(2), Shard(2), Replicate(), Replicate()]
        if mask is not None:
            rule.append(_mask_placement(mask, len(q.shape), q.shape[2], 2))
        rules.append(rule)
    return rules


def _cpu_forward_rule(op, args_schema, kwargs_schema):
    return _cpu_rules(bound_args(op, args_schema, kwargs_schema), backward=False)


def _cpu_backward_rule(op, args_schema, kwargs_schema):
    return _cpu_rules(bound_args(op, args_schema, kwargs_schema), backward=True)


def register_rules() -> None:
    """Give the CPU kernel and its backward DTensor sharding rules (once; DTensor's own rule
    wins where a torch version ships one)."""
    # is_causal (forward arg 4, backward arg 7) changes the rule: DTensor caches by the
    # arguments from these positions on.
    tc.register_single_dim_rule(aten._scaled_dot_product_flash_attention_for_cpu.default, _cpu_forward_rule,
                                static_from=3)
    tc.register_single_dim_rule(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                                _cpu_backward_rule, static_from=6)


#: Position of ``is_causal`` in the CPU kernels' schemas (forward, backward).
_CAUSAL_ARG = {aten._scaled_dot_product_flash_attention_for_cpu.default: 4,
               aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 7}


def is_causal_cpu_kernel(node) -> bool:
    """Whether ``node`` (an FX node or a stand-in) is a causal CPU attention kernel, forward or backward."""
    if node.target not in _CAUSAL_ARG:
        return False
    return bool(bound_args(node.target, node.args, node.kwargs).get("is_causal"))


def rule_arguments(node) -> tuple[tuple, dict]:
    """(args, kwargs) to ask the kernel's rule for ``node``'s strategies with: a causal kernel's
    as if it were not causal, so that the query split is among them (module doc); the others'
    own."""
    if not is_causal_cpu_kernel(node):
        return tuple(node.args), dict(node.kwargs)
    pos = _CAUSAL_ARG[node.target]
    if len(node.args) > pos:
        return tuple(node.args[:pos]) + (False,) + tuple(node.args[pos + 1:]), dict(node.kwargs)
    return tuple(node.args), {**node.kwargs, "is_causal": False}


def _query_index(node: fx.Node, tensor_args: list[fx.Node]) -> int | None:
    q = bound_args(node.target, node.args, node.kwargs).get("query")
    return tensor_args.index(q) if q in tensor_args else None


def query_axes(node: fx.Node, ins, tensor_args: list[fx.Node]) -> list[int]:
    """The mesh axes a strategy (input specs ``ins``) splits a causal CPU kernel's queries on."""
    if not is_causal_cpu_kernel(node):
        return []
    k = _query_index(node, tensor_args)
    return [] if k is None else [a for a, d in enumerate(ins[k].shard_dims()) if d == 2]


def mirror_axes(axes: list[int], q_len: int, mesh_shape) -> tuple[int, ...] | None:
    """The axes over which a causal query split is balanced by the mirror exchange (module doc):
    the split's axes of more than one rank, where ``q_len`` cuts into two chunks per rank (a
    rank's chunk index is row-major over them, as its index in their flattened group); None:
    run contiguously."""
    axes = tuple(a for a in axes if mesh_shape[a] > 1)
    if not axes or q_len % (2 * math.prod(mesh_shape[a] for a in axes)):
        return None
    return axes


def work_factor(node: fx.Node, ins, mesh_shape, tensor_args: list[fx.Node]) -> float:
    """The busiest rank's work over an even share of the kernel's work, under a strategy: 1 but
    where a causal kernel's queries are split (module doc)."""
    axes = query_axes(node, ins, tensor_args)
    if not axes:
        return 1.0
    parts = math.prod(mesh_shape[a] for a in axes)
    args = bound_args(node.target, node.args, node.kwargs)
    q, k = _shape(args["query"]), _shape(args["key"])
    if mirror_axes(axes, q[2], mesh_shape) is not None:
        return balanced_split_share(q[2], k[2], parts) * parts
    return causal_split_share(q[2], k[2], parts) * parts


def kernel_messages(node: fx.Node, ins, mesh_shape,
                    tensor_args: list[fx.Node]) -> tuple[tuple[int, ...], list[int], list[int]]:
    """(the axes, the bytes of each exposed message, the bytes of each ring message) a strategy
    sends inside a causal kernel split on the sequence. Exposed: the mirror exchange's halves
    (forward: the queries' in, the output's and log-sum-exp's back, and with a ring the keys'
    and values' in; backward: the gradient's, queries', output's and log-sum-exp's in, the
    queries' gradient back, and with a ring the keys', values' and their gradients'). Ring:
    ``n - 1`` passes of the local keys and values, and in the backward ``n`` of their float32
    gradient sums, which overlap the block attention. ((), [], []) where none is sent."""
    axes = query_axes(node, ins, tensor_args)
    if not axes:
        return (), [], []
    args = bound_args(node.target, node.args, node.kwargs)
    q, k, v = args["query"], args["key"], args["value"]
    ring = is_ring(node, ins, tensor_args)
    group = mirror_axes(axes, _shape(q)[2], mesh_shape)
    parts = math.prod(mesh_shape[a] for a in axes)

    def local(t, size=None):
        shape = ins[tensor_args.index(t)].local_shape(_shape(t), mesh_shape)
        return math.prod(shape) * (size or t.meta["val"].element_size())

    qh, lseh = local(q) // 2, math.prod(ins[tensor_args.index(q)].local_shape(_shape(q), mesh_shape)[:3]) * 2
    kh, vh = (local(k) // 2, local(v) // 2) if ring else (0, 0)
    forward = node.target is CPU_FORWARD
    exposed = []
    if group is not None:
        exposed = [qh, qh, lseh] if forward else [qh, qh, qh, lseh, qh]
        if ring:
            exposed += [kh, vh] if forward else [kh, vh, kh, vh]
    passes = []
    if ring:
        passes = [local(k), local(v)] * (parts - 1)
        if not forward:
            passes += [local(k, 4), local(v, 4)] * parts
    return tuple(a for a in axes if mesh_shape[a] > 1), [b for b in exposed if b], passes


def ring_strategies(node: fx.Node, strategies, tensor_args: list[fx.Node], mesh_shape) -> list:
    """Ring attention's strategies of a causal CPU kernel: each query split of ``strategies``
    (the all-gather form: keys and values replicated, their gradients partial on the split's
    axes) with the keys, values and their gradients split on the sequence like the queries
    instead (:func:`ring_forward`), where the mirror exchange balances it. (Split contiguously,
    a rank would receive blocks it never reads: the last pass of every rank but the one that
    holds the sequence's end. A lowered program drops an unread collective, so the ranks'
    programs would disagree; and a ring of contiguous runs is as unbalanced as the all-gather
    form's.)"""
    from costmodel.spec import Spec

    if not is_causal_cpu_kernel(node):
        return []
    args = bound_args(node.target, node.args, node.kwargs)
    if args.get("attn_mask") is not None:
        return []
    k_at = [tensor_args.index(args[name]) for name in ("key", "value") if args.get(name) in tensor_args]
    qk = _query_index(node, tensor_args)
    out = []
    for st in strategies:
        axes = [a for a, d in enumerate(st.ins[qk].shard_dims()) if d == 2]
        if not axes or any(st.ins[i].placements[a] != "R" for i in k_at for a in axes):
            continue
        if mirror_axes(axes, _shape(args["query"])[2], mesh_shape) is None:
            continue

        def along(spec, axes=axes):
            return Spec(tuple("S(2)" if a in axes else p for a, p in enumerate(spec.placements)), spec.shard_order)

        ins = tuple(along(sp) if i in k_at else sp for i, sp in enumerate(st.ins))
        outs = st.outs if node.target is CPU_FORWARD else (st.outs[0], *(along(o) for o in st.outs[1:]))
        out.append(type(st)(outs=outs, ins=ins))
    return out


def is_ring(node: fx.Node, ins, tensor_args: list[fx.Node]) -> bool:
    """Whether a strategy (input specs ``ins``) runs a causal kernel as ring attention (its keys
    split on the sequence)."""
    if not is_causal_cpu_kernel(node):
        return False
    key = bound_args(node.target, node.args, node.kwargs).get("key")
    return key in tensor_args and 2 in ins[tensor_args.index(key)].shard_dims()


def sequence_split_offered(node: fx.Node, ins, tensor_args: list[fx.Node], mesh_shape=None) -> bool:
    """Whether a strategy's split of a causal kernel's queries on the sequence (if any) is
    offered: one contiguous run per rank (axes in mesh order on dim 2: the sequence kernels need
    one offset), and only where the batch could not take those axes instead (its size, left by
    the strategy's batch split, a multiple of theirs). A batch split of the same ranks computes
    as much per rank with no keys gathered, no messages and no causal imbalance, and every op
    around attention (per token) costs the same split either way: the sequence split would only
    grow the problem (mesh_shape None: not checked)."""
    k = _query_index(node, tensor_args) if is_causal_cpu_kernel(node) else None
    if k is None:
        return True
    spec = ins[k]
    if any(d == 2 for d, _ in spec.shard_order):
        return False
    axes = [a for a, d in enumerate(spec.shard_dims()) if d == 2]
    if not axes or mesh_shape is None:
        return True
    batch = _shape(tensor_args[k])[0]
    left = batch // math.prod(mesh_shape[a] for a, d in enumerate(spec.shard_dims()) if d == 0)
    return left % math.prod(mesh_shape[a] for a in axes) != 0


def splits_causal_queries(target, args, kwargs) -> bool:
    """Whether a causal CPU kernel about to run (its arguments DTensors) has its query split on
    the sequence."""
    if target not in _CAUSAL_ARG:
        return False
    bound = bound_args(target, args, kwargs)
    return bool(bound.get("is_causal")) and any(isinstance(p, tc.Shard) and p.dim == 2
                                                for p in getattr(bound["query"], "placements", ()))


def heads_split_evenly(node: fx.Node, specs, mesh_shape, tensor_args: list[fx.Node]) -> bool:
    """Whether a strategy of a fused attention node splits the heads of its query and of its
    keys into as many equal parts (grouped queries need it: module doc). ``specs``: the
    strategy's input specs, one per node of ``tensor_args`` (the node's tensor arguments)."""
    args = bound_args(node.target, node.args, node.kwargs)
    pos = {a: k for k, a in enumerate(tensor_args)}
    q, k = args.get("query"), args.get("key")
    if q not in pos or k not in pos:
        return True
    hq, hk = _shape(q)[1], _shape(k)[1]
    if hq == hk:
        return True
    for node_arg, heads in ((q, hq), (k, hk)):
        spec = specs[pos[node_arg]]
        parts = math.prod(mesh_shape[a] for a, d in enumerate(spec.shard_dims()) if d == 1)
        if heads % parts:
            return False
    return True


# ----------------------------------------------------------------------------------------------
# Running the traced kernel on the ranks' device.
#
# A plan is traced on the meta device or a CPU, so its attention nodes are the CPU kernel's. On
# a CUDA mesh each rank runs its shard with the CUDA kernel of the same semantics, on local
# tensors: every strategy of the rule above is local (no collective inside the op), so each
# rank's shard of the outputs is the kernel's output on its shards of the inputs.

CPU_FORWARD, CPU_BACKWARD = FORWARD[0], BACKWARD[0]


def device_kernel(target, device_type: str):
    """The local function that runs a traced CPU attention kernel on ``device_type`` (same
    arguments, same outputs, local tensors); None where the node runs as traced."""
    if device_type == "cpu" or target not in (CPU_FORWARD, CPU_BACKWARD):
        return None
    return cuda_forward if target is CPU_FORWARD else cuda_backward


def flash_fits(q, k, attn_mask, is_causal) -> bool:
    """Whether the CUDA flash kernel computes what the CPU kernel does: no mask, half precision,
    a head dim it takes, (causal) as many queries as keys (flash aligns a causal mask to the
    bottom right, the CPU kernel to the top left), a device that has it."""
    e = q.shape[-1]
    return (attn_mask is None and q.dtype in (torch.float16, torch.bfloat16) and e % 8 == 0 and e <= 256
            and not (is_causal and q.shape[2] != k.shape[2]) and _has_flash(q.device))


def _has_flash(device) -> bool:
    """Whether the CUDA device runs the flash kernel (Ampere and later; True where no CUDA
    device answers: tracing on fake CUDA tensors)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return device.type == "cuda"
    return torch.cuda.get_device_capability(device) >= (8, 0)


def _no_dropout(dropout_p: float) -> None:
    if dropout_p:
        # Never traced so: SDPA with dropout runs the math path on a CPU, which is what is planned.
        raise NotImplementedError(f"fused attention with dropout_p={dropout_p} on CUDA ranks: the plan's backward "
                                  "would need the forward's random state")


def _sdpa(q, k, v, attn_mask, is_causal, scale):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def device_kernel_source() -> str:
    """The source of :func:`cuda_forward` and :func:`cuda_backward` with their helpers: what a GPU
    node runs for a traced CPU attention kernel, where it runs lowered programs without autoshard
    (``benchmarks/gpu_memory.py``)."""
    import inspect

    return "\n\n".join(inspect.getsource(f) for f in (_no_dropout, _has_flash, flash_fits, _sdpa, cuda_forward,
                                                        cuda_backward))


def cuda_forward(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """``(out, lse)`` of the CPU kernel's schema by CUDA kernels: flash where it fits (its own
    log-sum-exp, grouped queries natively); otherwise SDPA's choice of kernel, whose
    log-sum-exp the backward does not read (it recomputes the forward)."""
    _no_dropout(dropout_p)
    if flash_fits(q, k, attn_mask, is_causal):
        out, lse, *_ = aten._flash_attention_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                                                     None, q.shape[2], k.shape[2], 0.0, is_causal, False, scale=scale)
        return out.transpose(1, 2), lse
    out = _sdpa(q, k, v, attn_mask, is_causal, scale)
    return out, torch.zeros(q.shape[:3], dtype=torch.float32, device=q.device)


def cuda_backward(grad_out, q, k, v, out, lse, dropout_p, is_causal, *, attn_mask=None, scale=None):
    """``(grad_q, grad_k, grad_v)`` of the CPU kernel's schema by CUDA kernels (the path
    :func:`cuda_forward` took)."""
    _no_dropout(dropout_p)
    if flash_fits(q, k, attn_mask, is_causal):
        rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: never read
        unused = torch.zeros((), dtype=torch.uint64, device=q.device)
        grads = aten._flash_attention_backward(grad_out.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), out.transpose(1, 2), lse, None, None, q.shape[2],
                                               k.shape[2], 0.0, is_causal, rng, unused, scale=scale)
        return tuple(g.transpose(1, 2) for g in grads)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        again = _sdpa(*leaves, attn_mask, is_causal, scale)
        return tuple(torch.autograd.grad(again, leaves, grad_out))


def local_placements(target, q_placements, k_placements) -> list[tuple]:
    """Placements of a CPU attention kernel's outputs from its query's and key's, as its rule
    gives them (for a plan that names no spec of the node): the forward's ``out`` and ``lse``
    and the backward's ``grad_q`` follow the query, ``grad_k`` and ``grad_v`` the key, partial
    on an axis that splits the queries alone."""
    if target is CPU_FORWARD:
        return [tuple(q_placements)] * 2
    grad_kv = tuple(tc.Partial() if isinstance(pq, tc.Shard) and pq.dim == 2 else pk
                    for pq, pk in zip(q_placements, k_placements))
    return [tuple(q_placements), grad_kv, grad_kv]


# ----------------------------------------------------------------------------------------------
# Context parallelism (all-gather form): a rank's queries against every key before its last one.


def _offset_mask(q_len: int, offset: int, dtype, device):
    """Additive mask of queries ``offset .. offset + q_len - 1`` over keys ``0 .. offset + q_len - 1``."""
    i = torch.arange(q_len, device=device)[:, None] + offset
    j = torch.arange(offset + q_len, device=device)[None, :]
    return torch.zeros((q_len, offset + q_len), dtype=dtype, device=device).masked_fill(j > i, float("-inf"))


def sequence_forward(q, k, v, offset: int, *, scale=None):
    """``(out, lse)`` of causal attention for queries at global positions ``offset ..`` (``q``:
    ``(B, Hq, Lq, E)``, one run of the sequence) against the whole keys and values (``(B, Hkv,
    S, E)``): only keys ``< offset + Lq`` can be seen, so only those are read. On a CPU the
    kernel with the offset's mask; elsewhere :func:`block_forward`'s causal mask, which aligns
    to the bottom right: exactly the offset."""
    end = offset + q.shape[2]
    k, v = k[:, :, :end], v[:, :, :end]
    if q.device.type != "cpu":
        return block_forward(q, k, v, True, scale)
    mask = _offset_mask(q.shape[2], offset, q.dtype, q.device)
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask, scale=scale)


def sequence_backward(grad_out, q, k, v, out, lse, offset: int, *, scale=None):
    """``(grad_q, grad_k, grad_v)`` of :func:`sequence_forward`; the key and value gradients whole
    (zero past the run's last query: its part of their sum over runs)."""
    end, seq = offset + q.shape[2], k.shape[2]
    ks, vs = k[:, :, :end], v[:, :, :end]
    if q.device.type != "cpu":
        dq, dk, dv = block_backward(grad_out, q, ks, vs, out, lse, True, scale)
    else:
        mask = _offset_mask(q.shape[2], offset, q.dtype, q.device)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, ks, vs, out, lse, 0.0,
                                                                               False, attn_mask=mask, scale=scale)
    pad = seq - end
    if pad:
        dk = torch.nn.functional.pad(dk, (0, 0, 0, pad))
        dv = torch.nn.functional.pad(dv, (0, 0, 0, pad))
    return dq, dk, dv


def mirror_layout(coordinate: int, parts: int) -> list[int]:
    """The chunks (of ``2 parts``) a rank at ``coordinate`` of the ``parts`` splitting the
    sequence holds once it swapped its second chunk with its mirror's (``parts - 1 -
    coordinate``): ``2 coordinate`` and ``2 parts - 1 - 2 coordinate``, the same causal work on
    every rank."""
    return [2 * coordinate, 2 * parts - 1 - 2 * coordinate]


def mirror_forward(q, k, v, coordinate: int, parts: int, *, scale=None):
    """:func:`sequence_forward` of queries in the mirrored layout (:func:`mirror_layout`; the
    lowering swaps the halves in and the outputs' back) against the whole keys and values."""
    c = q.shape[2] // 2
    runs = [sequence_forward(piece, k, v, j * c, scale=scale)
            for piece, j in zip(_pieces(q, 2), mirror_layout(coordinate, parts))]
    out = torch.cat([o.transpose(1, 2) for o, _ in runs], 1).transpose(1, 2)
    return out, torch.cat([lse for _, lse in runs], 2)


def mirror_backward(grad_out, q, k, v, out, lse, coordinate: int, parts: int, *, scale=None):
    """The gradients of :func:`mirror_forward` (the query gradient in the mirrored layout; key and
    value gradients whole, this rank's part of their sum)."""
    c = q.shape[2] // 2
    runs = [sequence_backward(g, qq, k, v, o, ls, j * c, scale=scale)
            for g, qq, o, ls, j in zip(_pieces(grad_out, 2), _pieces(q, 2), _pieces(out, 2), _pieces(lse, 2),
                                        mirror_layout(coordinate, parts))]
    return torch.cat([r[0] for r in runs], 2), runs[0][1] + runs[1][1], runs[0][2] + runs[1][2]


# ----------------------------------------------------------------------------------------------
# Ring attention: the keys and values stay split; their shards travel around the ring.


def _expand_heads(k, heads: int):
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def _math_block(q, k, v, causal: bool, scale):
    """``(out, lse)`` of ``q`` against one block of keys by plain ops (any device, any dtype)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = _expand_heads(k, q.shape[1]), _expand_heads(v, q.shape[1])
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        s = s + _offset_mask(q.shape[2], k.shape[2] - q.shape[2], torch.float32, q.device)
    lse = torch.logsumexp(s, -1)
    return (torch.exp(s - lse[..., None]) @ v.float()).to(q.dtype), lse


def _math_block_backward(grad_out, q, k, v, out, lse, causal: bool, scale):
    """The gradients of one block of :func:`_math_block` given the rows' final ``out`` and ``lse``
    (the block's share of the softmax, as flash's backward takes them)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    rep = q.shape[1] // k.shape[1]
    ke, ve = _expand_heads(k, q.shape[1]).float(), _expand_heads(v, q.shape[1]).float()
    s = (q.float() @ ke.transpose(-1, -2)) * scale
    if causal:
        s = s + _offset_mask(q.shape[2], k.shape[2] - q.shape[2], torch.float32, q.device)
    p = torch.exp(s - lse[..., None])
    do = grad_out.float()
    dv = p.transpose(-1, -2) @ do
    dp = do @ ve.transpose(-1, -2)
    ds = p * (dp - (do * out.float()).sum(-1, keepdim=True))
    dq = ds @ ke * scale
    dk = ds.transpose(-1, -2) @ q.float() * scale
    if rep > 1:
        dk = dk.unflatten(1, (k.shape[1], rep)).sum(2)
        dv = dv.unflatten(1, (k.shape[1], rep)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def block_forward(q, k, v, causal: bool, scale=None):
    """``(out, lse)`` of ``q`` against one block of keys (``causal``: the same positions, so
    the top-left mask): the CPU kernel, CUDA's flash kernel where it fits, else plain ops."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    if flash_fits(q, k, None, False):  # causal or not: equal runs, or a causal mask at the bottom right
        out, lse, *_ = aten._flash_attention_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                                                     None, q.shape[2], k.shape[2], 0.0, causal, False, scale=scale)
        return out.transpose(1, 2), lse
    return _math_block(q, k, v, causal, scale)


def block_backward(grad_out, q, k, v, out, lse, causal: bool, scale=None):
    """One block's share of the gradients, given the rows' final output and log-sum-exp."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, causal,
                                                                         scale=scale)
    if flash_fits(q, k, None, False):  # causal or not: equal runs, or a causal mask at the bottom right
        rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
        unused = torch.zeros((), dtype=torch.uint64, device=q.device)
        grads = aten._flash_attention_backward(grad_out.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), out.transpose(1, 2), lse, None, None, q.shape[2],
                                               k.shape[2], 0.0, causal, rng, unused, scale=scale)
        return tuple(g.transpose(1, 2) for g in grads)
    return _math_block_backward(grad_out, q, k, v, out, lse, causal, scale)


def _merge(state, block):
    """Two partial softmax results over disjoint key sets as one (log-sum-exp weighted)."""
    if state is None:
        return block
    (out, lse), (out_b, lse_b) = state, block
    total = torch.logaddexp(lse, lse_b)
    merged = out.float() * torch.exp(lse - total)[..., None] + out_b.float() * torch.exp(lse_b - total)[..., None]
    return merged.to(out.dtype), total


def _pieces(t, count: int):
    size = t.shape[2] // count
    return [t[:, :, i * size:(i + 1) * size] for i in range(count)]


def ring_forward(q, k, v, coordinate: int, parts: int, shift, scale=None):
    """``(out, lse)`` of causal attention whose queries, keys and values are all split on the
    sequence, in the mirrored layout (:func:`mirror_layout`): ``parts`` steps; at step ``t`` this
    rank holds the keys and values of rank ``coordinate - t`` and runs every pair of its query
    chunks and their key chunks that the mask keeps (earlier chunks whole, the same chunk
    causal), merging the partial results,
    while the block goes on to the next rank (``shift(x)``: start sending ``x`` on and receiving
    the previous rank's; ``shift.wait``: what arrived)."""
    mine = mirror_layout(coordinate, parts)
    qs = _pieces(q, len(mine))
    state = [None] * len(mine)
    block = (k, v)
    for t in range(parts):
        source = (coordinate - t) % parts
        moving = [shift(x) for x in block] if t < parts - 1 else None
        theirs = mirror_layout(source, parts)
        ks, vs = _pieces(block[0], len(theirs)), _pieces(block[1], len(theirs))
        for i, x in enumerate(mine):
            for j, y in enumerate(theirs):
                if y <= x:
                    state[i] = _merge(state[i], block_forward(qs[i], ks[j], vs[j], y == x, scale))
        if moving is not None:
            block = tuple(shift.wait(m) for m in moving)
    out = torch.cat([o.transpose(1, 2) for o, _ in state], 1).transpose(1, 2)
    return out, torch.cat([lse for _, lse in state], 2)


def ring_backward(grad_out, q, k, v, out, lse, coordinate: int, parts: int, shift, scale=None):
    """The gradients of :func:`ring_forward`: the keys and values go round again, each with its
    gradients' running sums, which one last step hands back to the rank that holds the block."""
    mine = mirror_layout(coordinate, parts)
    n = len(mine)
    qs, gs, os_, ls = _pieces(q, n), _pieces(grad_out, n), _pieces(out, n), _pieces(lse, n)
    dq = [torch.zeros(p.shape, dtype=torch.float32, device=q.device) for p in qs]
    block = (k, v, torch.zeros(k.shape, dtype=torch.float32, device=k.device),
             torch.zeros(v.shape, dtype=torch.float32, device=v.device))
    for t in range(parts):
        source = (coordinate - t) % parts
        moving = [shift(x) for x in block[:2]] if t < parts - 1 else None
        theirs = mirror_layout(source, parts)
        ks, vs = _pieces(block[0], len(theirs)), _pieces(block[1], len(theirs))
        dks, dvs = _pieces(block[2], len(theirs)), _pieces(block[3], len(theirs))
        for i, x in enumerate(mine):
            for j, y in enumerate(theirs):
                if y <= x:
                    a, b, c = block_backward(gs[i], qs[i], ks[j], vs[j], os_[i], ls[i], y == x, scale)
                    # Out of place: a lowered program keeps only what its outputs read.
                    dq[i], dks[j], dvs[j] = dq[i] + a, dks[j] + b, dvs[j] + c
        # The block's gradient sums follow it to the next rank (they are complete once the
        # block is back with its owner: one step after the last).
        grads = [shift(torch.cat(d, 2)) for d in (dks, dvs)]
        block = (*(shift.wait(m) for m in moving), *(shift.wait(g) for g in grads)) if moving is not None \
            else tuple(shift.wait(g) for g in grads)
    dk, dv = block
    grad_q = torch.cat(dq, 2).to(q.dtype)
    return grad_q, dk.to(k.dtype), dv.to(v.dtype)
