"""Every private torch API autoshard uses, in one place.

A torch upgrade that moves one of these touches this file only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx.traceback as fx_traceback
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy  # noqa: F401
from torch.distributed.tensor._ops import utils as _op_utils
from torch.distributed.tensor._ops.single_dim_strategy import (
    _expand_single_dim_strategy_to_mesh,
    _PreparedSingleDimStrategy,
)
from torch.distributed.tensor.placement_types import _StridedShard
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: F401

from costmodel._torch_compat import placements_of as to_placements  # noqa: F401 (one converter)
from costmodel.spec import Spec


def lazy_graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A GraphModule that writes its Python code only when first run or printed: planning a
    20k-node graph never runs it, and code generation costs about 1 s there."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(root, graph)


def boxed_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` called with one list that it empties once it has read its inputs (FX's boxed
    convention, as AOTAutograd runs its graphs): each input is then freed at its last use in the
    graph, not held by the caller until the call returns (a backward's saved activations)."""
    from torch.fx.graph import _BoxedCodeGen

    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph.set_codegen(_BoxedCodeGen())
    return lazy_graph_module(gm, graph)


def preserve_node_meta():
    """FX's metadata channel: while active, ``node_meta_custom()`` lands on every traced node."""
    return fx_traceback.preserve_node_meta()


def node_meta_custom() -> dict:
    """The ``custom`` metadata dict copied onto the nodes created from now on."""
    return fx_traceback.current_meta.setdefault("custom", {})


def traced_node(t: torch.Tensor):
    """The FX node ``make_fx`` is recording for ``t`` (None outside tracing or for an untraced tensor)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    if mode is None:
        return None
    slot = get_proxy_slot(t, mode.tracer, None)
    return None if slot is None else slot.proxy.node


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
    plain = all(type(p) in _PLAIN for p in placements)
    if plain:
        # Enumeration converts the same few placement tuples tens of thousands of times.
        found = _FROM_PLACEMENTS.get(placements)
        if found is not None:
            return found
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
    spec = Spec(tuple(out), order)
    if plain:
        _FROM_PLACEMENTS[placements] = spec
    return spec


_PLAIN = (Shard, Replicate, Partial)
_FROM_PLACEMENTS: dict[tuple, Spec] = {}


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
        # Rules over lists of optional tensors (index, index_put) read their arguments flattened,
        # as DTensor's dispatch gives them: the list's tensors are inputs like the others.
        schema.schema_info = schema.schema_info or prop.op_to_schema_info_for_single_dim_strategy.get(op)
        fast = expand_placements(op, schema, info, mesh, out_meta) if FAST_EXPANSION else None
        if fast is not None:
            return fast
        fn = _expand_single_dim_strategy_to_mesh(mesh, schema, info, out_meta)
        return fn(op, schema.args_meta, schema.kwargs_meta)
    if op in prop.op_strategy_funcs:
        if op in prop.op_to_schema_info:
            schema.schema_info = prop.op_to_schema_info[op]
        return prop.op_strategy_funcs[op](schema)
    return None


#: Whether single-dim rules are expanded on placements (:func:`expand_placements`) instead of
#: by DTensor's expander; off only to check the two agree.
FAST_EXPANSION = True


class PlacedSpec:
    """A spec of a :class:`PlacedStrategy`: its placements alone (what the planner reads)."""

    __slots__ = ("placements",)

    def __init__(self, placements: tuple):
        self.placements = placements


class PlacedStrategy:
    """An ``OpSpec`` reduced to placements: ``output_specs`` (a :class:`PlacedSpec`, a tuple
    of them with None for absent outputs, or None) and ``input_specs``."""

    __slots__ = ("output_specs", "input_specs")

    def __init__(self, output_specs, input_specs):
        self.output_specs, self.input_specs = output_specs, input_specs


class PlacedStrategies:
    """What :func:`expand_placements` returns in place of an ``OpStrategy``."""

    __slots__ = ("strategies",)

    def __init__(self, strategies: list[PlacedStrategy]):
        self.strategies = strategies


def expand_placements(op, schema: OpSchema, info, mesh, out_meta) -> PlacedStrategies | None:
    """DTensor's expansion of a single-dim rule to every mesh axis
    (``expand_to_full_mesh_op_strategy``), computed on placements alone; None where it
    cannot be (the caller then runs DTensor's own).

    DTensor builds a ``DTensorSpec`` (shard-order checks and all) for every spec of every
    combination of per-axis rules, of which a 3-D mesh has tens of thousands per op: 70% of
    building LLaMA-8B's problem on (2, 4, 8). The planner reads only placements, so this
    walks the same combinations with DTensor's own filters, in its order: no mixed partial
    kinds within one spec (sum with avg excepted), every input shardable
    (``is_tensor_shardable``: each sharded dim at least as long as its number of shards, or
    the input's current placements where the rule allows uneven shards). The per-axis rules
    come from DTensor itself (``_PreparedSingleDimStrategy``). In-place and out= ops,
    strided shards, inputs on other meshes and symbolic sizes go to DTensor's path;
    ``tests/test_strategies.py`` checks both give the same strategies on the reference models."""
    import itertools

    base = op.name().split("::")[1].split(".")[0]
    if base.endswith("_") or schema.is_out_variant_op():
        return None
    prepared = _PreparedSingleDimStrategy(info, schema, out_meta)
    if prepared.remapped_different_mesh_args or (prepared.element_mesh is not None
                                                 and prepared.element_mesh != mesh):
        return None
    singles = prepared.expanded_strategies
    if any(isinstance(p, _StridedShard) for rule in singles for p in rule):
        return None
    inputs = schema.args_strategy + schema.kwargs_strategy
    shapes = [tuple(inp.shape) for inp in inputs]
    if any(not isinstance(n, int) for shape in shapes for n in shape):
        return None
    current = [tuple(inp.strategies[0].output_spec.placements) for inp in inputs]
    sizes = tuple(mesh.shape)
    n_out, uneven = prepared.num_outputs, prepared.allow_uneven_sharding

    def mixed_partials(placements) -> bool:
        kinds = {(type(p), p.reduce_op) for p in placements if isinstance(p, Partial)}
        return len(kinds) > 1 and not (len({t for t, _ in kinds}) == 1 and {r for _, r in kinds} == {"sum", "avg"})

    def shardable(shape, placements) -> bool:
        shards = [1] * len(shape)
        for axis, p in enumerate(placements):
            if isinstance(p, Shard):
                if p.dim >= len(shape):
                    return False
                shards[p.dim] *= sizes[axis]
                if shape[p.dim] < shards[p.dim]:
                    return False
        return True

    out = []
    for combo in itertools.product(singles, repeat=len(sizes)):
        specs = [None if per_axis[0] is None else tuple(per_axis) for per_axis in zip(*combo, strict=True)]
        if any(s is not None and mixed_partials(s) for s in specs):
            continue
        ins = [s for s in specs[n_out:] if s is not None]
        if len(ins) != len(inputs):
            return None  # DTensor raises here: let it say why
        if not all(shardable(shape, s) or (uneven and s == now) for shape, s, now in zip(shapes, ins, current)):
            continue
        if n_out == 0:
            outs = None
        elif n_out > 1:
            outs = tuple(None if s is None else PlacedSpec(s) for s in specs[:n_out])
        elif specs[0] is None:
            return None
        else:
            outs = PlacedSpec(specs[0])
        out.append(PlacedStrategy(outs, [PlacedSpec(s) for s in ins]))
    return PlacedStrategies(out)


def register_pointwise(op) -> None:
    """Register DTensor's own elementwise rule for ``op`` (every input and the output sharded
    alike, broadcasting as DTensor's pointwise ops do; no partial input) unless DTensor has a
    rule: for elementwise ops that lack ``torch.Tag.pointwise``."""
    from torch.distributed.tensor._ops._pointwise_ops import _register_single_dim_pointwise

    if not has_rule(op):
        _register_single_dim_pointwise(op)


def register_single_dim_rule(op, rule, static_from: int | None = None) -> None:
    """Register ``rule`` as DTensor's single-dim sharding rule of ``op`` unless DTensor has one
    (``rule(op, args, kwargs)`` -> placement lists: outputs, then tensor inputs; tensors come as
    ``TensorMeta``). ``static_from``: the first positional argument whose value, not only its
    type, changes the rule (DTensor caches by those arguments)."""
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops.single_dim_strategy import register_single_dim_strategy

    if has_rule(op):
        return
    info = RuntimeSchemaInfo(static_from) if static_from is not None else None
    register_single_dim_strategy(op, schema_info=info)(rule)


def has_rule(op) -> bool:
    prop = sharding_propagator()
    return op in prop.op_single_dim_strategy_funcs or op in prop.op_strategy_funcs


_COORDINATES: dict = {}


def _coordinate_of(mesh, rank: int) -> list[int]:
    key = (id(mesh), rank)
    found = _COORDINATES.get(key)
    if found is not None and found[0] is mesh:
        return found[1]
    from torch.utils._python_dispatch import _disable_current_modes

    # The same computation as LocalTensorMode's: the mesh's rank tensor holds one copy of the
    # mesh per replica of a sub-mesh; rank appears once, after the leading replica index. It
    # is called while tracing: neither recorded nor run on fake tensors, and memoized (DTensor
    # asks for coordinates tens of thousands of times per program).
    with _disable_current_modes():
        ranks = mesh._layout.remap_to_tensor(mesh._rank_map.clone())
        hits = (ranks == rank).nonzero().tolist()
    if len(hits) != 1:
        raise ValueError(f"rank {rank} is not in the mesh {mesh}")
    _COORDINATES[key] = (mesh, hits[0][1:])
    return hits[0][1:]


def as_rank(rank: int):
    """A context in which every DeviceMesh answers as global rank ``rank`` (its coordinates and
    local ranks), so that DTensor code traced inside it is rank ``rank``'s program. DTensor reads
    the rank through these DeviceMesh methods only (LocalTensorMode patches the same ones)."""
    import contextlib

    from torch.distributed.device_mesh import DeviceMesh

    def get_coordinate(self):
        return _coordinate_of(self, rank)

    def get_local_rank(self, mesh_dim=None):
        if mesh_dim is None:
            mesh_dim = 0
        if isinstance(mesh_dim, str):
            mesh_dim = self.mesh_dim_names.index(mesh_dim)
        return _coordinate_of(self, rank)[mesh_dim]

    patches = {
        "get_coordinate": get_coordinate,
        "_sym_get_coordinate": lambda self, index: _coordinate_of(self, rank)[index],
        "get_rank": lambda self: rank,
        "get_local_rank": get_local_rank,
        "_is_current_rank_part_of_mesh": lambda self: True,
    }

    @contextlib.contextmanager
    def patched():
        saved = {name: getattr(DeviceMesh, name) for name in patches}
        _sharding_caches_for(rank)
        try:
            for name, fn in patches.items():
                setattr(DeviceMesh, name, fn)
            yield
        finally:
            for name, fn in saved.items():
                setattr(DeviceMesh, name, fn)
            _sharding_caches_for(_own_rank())

    return patched()


#: Whose answers DTensor's sharding-propagation caches hold: a rank, or None (this process's own).
_CACHES_HOLD: list = [None]


def _own_rank() -> int | None:
    """This process's rank where it is one rank (a real or fake process group), else None (no
    group, or every rank at once under a LocalTensorMode, suspended or not)."""
    try:
        from torch.distributed._local_tensor import get_local_tensor_mode_list
    except ImportError:
        get_local_tensor_mode_list = list
    if get_local_tensor_mode_list() or not dist.is_initialized():
        return None
    return dist.get_rank()


def _sharding_caches_for(rank: int | None) -> None:
    """Empty DTensor's caches of sharding propagation (Python's and the C++ fast path's) and of
    redistribution steps where they may hold another rank's answers than ``rank``'s. Their keys
    do not name the rank, yet with uneven shards the answers depend on it (a view's local target
    shape, a gather's unpadding): one rank's program traced after another's would take that
    rank's shard size (a bias gradient viewed as [3] on a rank holding 2)."""
    if _CACHES_HOLD[0] == rank:
        return
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    _CACHES_HOLD[0] = rank


def local_shape(shape, mesh, placements) -> tuple[int, ...]:
    """This rank's shard shape of a tensor of global ``shape`` (DTensor's own computation)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(compute_local_shape_and_global_offset(tuple(shape), mesh, tuple(placements))[0])


def shard_offset(size: int, dim: int, mesh, placements) -> int:
    """Where this rank's run of ``dim`` (global length ``size``) starts, for placements that split
    ``dim`` with plain ``Shard`` only (one contiguous run per rank: each axis, in mesh order,
    splits the previous axes' run as DTensor does)."""
    coordinate = mesh.get_coordinate()
    offset = 0
    for axis, p in enumerate(placements):
        if isinstance(p, _StridedShard) or not (isinstance(p, Shard) and p.dim == dim):
            if isinstance(p, Shard) and p.dim == dim:
                raise ValueError(f"dim {dim} is split in another order than the mesh's ({placements})")
            continue
        size, start = Shard.local_shard_size_and_offset(size, mesh.size(axis), int(coordinate[axis]))
        offset += start
    return offset


def exchange(x: torch.Tensor, dim: int, partner: int, mesh, axis: int) -> torch.Tensor:
    """``x`` sent whole to the rank at coordinate ``partner`` of mesh axis ``axis``, and what that
    rank sent here (the same shape: the two swap; a rank may be its own partner). One
    ``all_to_all_single`` over the axis's group, the other members' splits empty."""
    return wait(shift_start(x, dim, partner, partner, mesh, axis))


def shift_start(x: torch.Tensor, dim: int, to: int, came_from: int, mesh, axis: int):
    """Start sending ``x`` (along ``dim``) to the rank at coordinate ``to`` of mesh axis ``axis``
    while receiving as much from ``came_from`` (every member sends the same shape); :func:`wait`
    on the result gives what arrived. One ``all_to_all_single`` with one non-empty split each way."""
    from torch.distributed import _functional_collectives as funcol

    n = mesh.size(axis)
    rows = x.shape[dim]
    send = [rows if k == to else 0 for k in range(n)]
    recv = [rows if k == came_from else 0 for k in range(n)]
    moved = x.movedim(dim, 0).contiguous()
    return funcol.all_to_all_single(moved, recv, send, group=(mesh, axis)), dim


def wait(started) -> torch.Tensor:
    """What a :func:`shift_start` received, laid out as it was sent."""
    from torch.distributed import _functional_collectives as funcol

    got, dim = started
    return funcol.wait_tensor(got).movedim(0, dim)


def local_tensor_ranks() -> list[int] | None:
    """The ranks of the active LocalTensorMode (all ranks run in this process), else None."""
    try:
        from torch.distributed._local_tensor import enabled_local_tensor_mode
    except ImportError:
        return None
    mode = enabled_local_tensor_mode()
    return None if mode is None else sorted(mode.ranks)


def rank_parts(t: torch.Tensor, ranks: list[int]) -> dict[int, torch.Tensor]:
    """Each rank's tensor of a LocalTensor; a plain tensor is every rank's."""
    parts = getattr(t, "_local_tensors", None)
    return dict(parts) if parts is not None else {r: t for r in ranks}


def from_rank_parts(parts: dict[int, torch.Tensor]) -> torch.Tensor:
    """One LocalTensor holding each rank's tensor."""
    from torch.distributed._local_tensor import LocalTensor

    return LocalTensor({r: t.detach() for r, t in parts.items()})


def group_ranks(group_name: str) -> list[int]:
    """The global ranks of a process group, by the name functional collectives carry."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_process_group_ranks(_resolve_process_group(group_name))


def quiet_tracing():
    """A context with no ambient dispatch mode (LocalTensorMode, CommDebugMode ...) and no global
    module hook: a trace taken inside a user's forward must see the model alone, as planned."""
    import contextlib

    from torch.nn.modules import module as _module
    from torch.utils._python_dispatch import _disable_current_modes

    names = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
             "_global_backward_hooks", "_global_forward_hooks_always_called", "_global_forward_hooks_with_kwargs")

    @contextlib.contextmanager
    def quiet():
        saved = {n: dict(getattr(_module, n)) for n in names if hasattr(_module, n)}
        try:
            for n in saved:
                getattr(_module, n).clear()
            with outside_local_tensor_mode(), _disable_current_modes():
                yield
        finally:
            for n, d in saved.items():
                getattr(_module, n).update(d)

    return quiet()


def fresh_namespace():
    """An empty FX name allocator (FX's private ``_Namespace``): ``create_name(candidate, None)``
    returns the name FX would give a node asking for ``candidate``."""
    from torch.fx.graph import _Namespace

    return _Namespace()


def rename_node(node, name: str) -> None:
    """Set an FX node's name (the caller keeps names unique)."""
    node.name = name
    node.graph._graph_namespace._rename_object(node, name)


#: The ``custom`` metadata key that marks a lowered node as part of a recomputed op.
RECOMPUTED = "autoshard_recomputed"
#: The ``custom`` metadata key naming the planned node a lowered node runs.
PLANNED = "autoshard_node"


def is_recomputed(node) -> bool:
    """Whether a lowered node is part of a recomputed op (marked :data:`RECOMPUTED`)."""
    return bool(node.meta.get("custom", {}).get(RECOMPUTED, False))


def bucket_collectives(gm, cap_mb: float, segment: dict) -> None:
    """Merge independent all-reduces, all-gathers and reduce-scatters (each of one group, reduce op
    and dtype) into buckets of up to ``cap_mb`` MiB, one flat collective each (Inductor's own FX
    passes), none across segments (``segment``: node -> its segment, by its wait; the executor's
    recomputations, :func:`autoshard.runtime.passes.recompute_segments`)."""
    from torch._inductor.fx_passes import bucketing as b

    cap = lambda _bucket: float(cap_mb)  # noqa: E731 (one cap for every bucket)
    last = max(segment.values(), default=0)

    def keyed(key):
        return lambda coll: (key(coll), segment.get(next(iter(coll.users)), last))

    mode = b._default_bucket_mode()
    for bucket in b.greedy_bucket_collective_by_mb(gm, cap, b.is_all_reduce_tensor, keyed(b._ar_group_key)):
        b.merge_all_reduce_bucket(gm.graph, bucket, None)
    gathers = b.greedy_bucket_collective_by_mb(gm, cap, b.is_all_gather_into_tensor, keyed(b._ag_group_key))
    if gathers:
        b.merge_all_gather(gm, gathers, mode)
    scatters = b.greedy_bucket_collective_by_mb(gm, cap, b.is_reduce_scatter_tensor, keyed(b._rs_group_key))
    if scatters:
        b.merge_reduce_scatter(gm, scatters, mode)
    gm.recompile()


def schedule_overlap(gm, estimate_ms, max_increase_bytes: int = 0):
    """Inductor's overlap scheduler on ``gm`` with every runtime from ``estimate_ms(node,
    override_bytes)`` (its own roofline needs Triton and a GPU; its benchmarks a GPU; ours is the
    plan's cost model and the same on every rank, so no rank has to agree with another). Its own
    bucketing stays off: its merge of all-reduces can hand a view a non-contiguous slice of the
    bucket (seen on Qwen2: "view size is not compatible"); :func:`bucket_collectives` does not.
    It may start a collective early (or wait for it late) only where that raises the program's peak
    by at most ``max_increase_bytes`` (its default allows 1 GB or 5% more, which the plan's memory
    account does not hold: ``max_increase_bytes`` is what the account leaves below its peak)."""
    import contextlib

    from torch._inductor.fx_passes import node_runtime_estimation as nre
    from torch._inductor.fx_passes import overlap_scheduling as osched

    @contextlib.contextmanager
    def patched():
        saved = osched.estimate_roofline_runtime_ms, nre._log_compute_estimations
        osched.estimate_roofline_runtime_ms = lambda node: estimate_ms(node, None)
        # It counts every node's FLOPs again only to log them: half the pass's time.
        nre._log_compute_estimations = lambda *args, **kwargs: None
        try:
            yield
        finally:
            osched.estimate_roofline_runtime_ms, nre._log_compute_estimations = saved

    with patched():
        return osched.schedule_overlap_bucketing(
            gm, collective_bucketing=False, custom_runtime_estimation=estimate_ms,
            collective_estimator="analytical", compute_estimator="analytical",
            pre_bucketing_fsdp_collectives=False, max_memory_increase_gb=max(0, int(max_increase_bytes)) / 2**30,
            max_memory_increase_ratio=0.0)


def memory_tracker():
    """torch's per-category tracker of live tensor storage (``MemTracker``: parameters, buffers,
    gradients, activations, temporaries, optimizer states), a private API: ``autoshard measure``
    reads a step's peak with it on every device type, CPU included."""
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker()



def interleaved_order(ranks: int, microbatches: int, stages_per_rank: int) -> dict[int, list]:
    """Torch's interleaved 1F1B order of compute actions per pipeline rank, the order its
    runtime executes (``ScheduleInterleaved1F1B._calculate_single_rank_operations``, a method
    that reads only the counts set here, so no stage or process group is needed): per rank a
    list of ``(kind, stage, microbatch)``, ``kind`` ``"F"`` or ``"B"`` (idle slots dropped)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as s

    rounds = max(1, microbatches // ranks)
    ns = SimpleNamespace(n_local_stages=stages_per_rank, pp_group_size=ranks, _n_microbatches=microbatches,
                         number_of_rounds=rounds, microbatches_per_round=microbatches // rounds)
    kinds = {s.FORWARD: "F", s.FULL_BACKWARD: "B"}
    out = {}
    for r in range(ranks):
        acts = s.ScheduleInterleaved1F1B._calculate_single_rank_operations(ns, r)
        out[r] = [(kinds[a.computation_type], a.stage_index, a.microbatch_index) for a in acts
                  if a is not None and a.computation_type in kinds]
    return out


def root_mesh(mesh):
    """The mesh ``mesh`` was sliced from (itself where it was not sliced)."""
    return mesh._get_root_mesh()


def pipeline_stage_class(before_reduce, after_inference):
    """torch's ``PipelineStage`` calling ``before_reduce(stage)`` where the schedule reduces
    gradients (``perform_reduce_grad``, after every microbatch's backward, before the scaling)
    and ``after_inference(stage)`` once its metadata inference has run its backward
    (``_prepare_backward_infra``, on the first step)."""
    from torch.distributed.pipelining import PipelineStage

    class Stage(PipelineStage):
        def perform_reduce_grad(self, grad_scale_factor: int):
            before_reduce(self)
            super().perform_reduce_grad(grad_scale_factor)

        def _prepare_backward_infra(self, *args, **kwargs):
            out = super()._prepare_backward_infra(*args, **kwargs)
            after_inference(self)
            return out

    return Stage


def run_as_code(stage) -> None:
    """The submodules of a stage torch's pipeline splitter made run their graphs' generated code
    when traced, as they do outside tracing. (Traced, they run through fx's Interpreter, which
    replaces the node metadata our tracer tags phases and layers with.)"""
    from types import MethodType

    for mod in stage.modules():
        gm = getattr(mod, "graph_module", None)
        if hasattr(mod, "_run_with_interpreter") and gm is not None:
            mod.forward = MethodType(type(gm).forward, mod)
