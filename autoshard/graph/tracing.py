"""Trace a training step into one joint forward+backward aten graph on fake tensors.

The step is ``loss = loss_fn(model(*inputs)); grads = autograd.grad(loss, params)``,
traced by ``make_fx`` under ``FakeTensorMode``: no weight is materialized, so the
model may live on the meta device. Placeholders are tagged ``param``, ``buffer``
or ``input``; outputs ``loss`` or ``grad`` (with the parameter's FQN).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch.func import functional_call

from autoshard import _torch_compat as tc
from autoshard._torch_compat import FakeTensorMode, make_fx
from autoshard.errors import TraceError
from autoshard.graph.layers import layer_groups, tag_layers
from autoshard.graph.viewwrites import functionalize_view_writes

PHASE = "autoshard_phase"
"""``node.meta["custom"]`` key of the step's phase that created the node."""


def default_loss(out):
    """Mean of the (first) output: a scalar whose gradient reaches every parameter used.

    Hugging Face outputs (dict-like ``ModelOutput``) contribute their ``logits``.
    """
    if isinstance(out, dict):
        out = out["logits"] if "logits" in out else next(iter(out.values()), None)
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise TraceError(f"model output: expected a tensor (or tuple of tensors), found {type(out).__name__}")
    return out if out.ndim == 0 else out.float().mean()


@dataclass
class TracedGraph:
    """The joint graph and what each placeholder and output is."""

    gm: fx.GraphModule
    param_fqns: list[str]
    """Parameter FQNs, in placeholder order."""
    buffer_fqns: list[str]
    """Buffer FQNs, in placeholder order after the parameters."""
    num_inputs: int
    """Number of tensor example inputs (placeholders after the buffers), keyword ones included."""
    kinds: dict[str, str] = field(default_factory=dict)
    """Placeholder node name -> ``param`` / ``buffer`` / ``input``."""
    fqn_of: dict[str, str] = field(default_factory=dict)
    """Placeholder node name -> parameter or buffer FQN, ``input{k}`` (positional input k) or the
    keyword's name (a tensor keyword input)."""
    loss_node: fx.Node | None = None
    grad_of: dict[str, fx.Node] = field(default_factory=dict)
    """Parameter FQN -> the node producing its gradient (absent when unused)."""
    input_grad_of: dict[int, fx.Node] = field(default_factory=dict)
    """Tensor input index -> the node producing its gradient, where the step was traced with
    ``input_grads`` (a pipeline stage sends its input's gradient back to the stage before)."""
    layer_groups: list[list[str]] = field(default_factory=list)
    """Repeated layers whose traced nodes are tagged (see :mod:`autoshard.graph.layers`)."""
    outputs: list = field(default_factory=list)
    """The model's output leaves (its pytree flattened): the node of each tensor leaf, the
    value itself for any other leaf."""
    output_tree: object = None
    """The pytree spec that rebuilds the model's output from ``outputs``."""
    output_grads: dict[int, fx.Node] = field(default_factory=dict)
    """Output leaf index -> the node of the loss's gradient with respect to that output (the
    backward pass of the model starts from these; absent for leaves the loss does not reach)."""

    def phase(self, node: fx.Node) -> str | None:
        """``forward`` (the model), ``loss`` (``loss_fn``) or ``backward`` for a traced op."""
        return node_phase(node)

    def loss_seed(self) -> fx.Node | None:
        """The node autograd seeded the backward with: ``ones_like(loss)``, the loss's gradient."""
        return _loss_seed(self.loss_node)

    @property
    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"]

    def input_nodes(self) -> list[fx.Node]:
        return [n for n in self.placeholders if self.kinds[n.name] == "input"]


def _drop_hook_residue(gm: fx.GraphModule, keep=frozenset()) -> dict[fx.Node, fx.Node]:
    """Undo what the layer-tagging hooks add to the graph: identity views (backward hooks
    wrap each layer's inputs and outputs) and the dead ``zeros`` they leave behind. Left in,
    each boundary view is one more node whose sharding rule can force a redistribute
    (measured: +3.4% predicted step on a 5-layer LLaMA). ``keep``: nodes that stay though
    nothing reads them (the model's outputs the loss does not read: CLIP's
    ``logits_per_image``)."""
    view = torch.ops.aten.view.default
    replaced: dict[fx.Node, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is view and isinstance(node.args[0], fx.Node):
            src = node.args[0].meta.get("val")
            out = node.meta.get("val")
            if isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.shape == out.shape \
                    and src.stride() == out.stride():
                node.replace_all_uses_with(node.args[0])
                replaced[node] = node.args[0]
                gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: n in keep or n.is_impure())
    return replaced


def _loss_seed(loss_node: fx.Node) -> fx.Node | None:
    seeds = [u for u in loss_node.users if u.target is torch.ops.aten.ones_like.default and node_phase(u) == "backward"]
    return seeds[0] if len(seeds) == 1 else None


def node_phase(node: fx.Node) -> str | None:
    """``forward`` (the model), ``loss`` (``loss_fn``) or ``backward``: the phase of the step
    that created a traced op (None for placeholders)."""
    custom = node.meta.get("custom")
    return custom.get(PHASE) if isinstance(custom, dict) else None


def _loss_free_names(gm: fx.GraphModule, output_grads) -> None:
    """Name the model's nodes as if the step had no loss, the loss's own nodes ``loss_*``.

    FX numbers nodes per op name in creation order (``mul``, ``mul_1`` ...), so the loss's ops
    would shift the numbers of every backward op after them: a plan made with one loss_fn
    would name its backward nodes differently from a model traced with another. Renumbered
    without the loss (its forward ops, and the backward ops that only compute the outputs'
    gradients), the model's forward and backward keep their names whatever loss the caller
    uses, and a plan can be applied with the loss left outside the model."""
    import re

    nodes = list(gm.graph.nodes)
    loss_part = {n for n in nodes if node_phase(n) == "loss"}
    stack = list(output_grads)
    while stack:
        n = stack.pop()
        if n in loss_part or node_phase(n) != "backward":
            continue
        loss_part.add(n)
        stack.extend(n.all_input_nodes)
    ns = tc.fresh_namespace()
    names = {}
    for n in nodes:
        if n in loss_part:
            names[n] = f"loss_{n.name}"
        elif n.op == "call_function":
            m = re.match(r"^(.*)_(\d+)$", n.name)
            names[n] = ns.create_name(m.group(1) if m else n.name, None)
        else:
            names[n] = ns.create_name(n.name, None)
    if len(set(names.values())) != len(names):
        return  # not expected; the original names stay (then the loss must be the plan's)
    for n in nodes:
        if names[n] != n.name:
            tc.rename_node(n, names[n])


def _to_fake(fm: FakeTensorMode, t: torch.Tensor, device: torch.device, requires_grad=False):
    with fm:
        out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
    if requires_grad:
        out.requires_grad_(True)
    return out


@dataclass
class RawTrace:
    """What ``make_fx`` returned for one training step, before the graph is tidied
    (:func:`finish`): the graph and the trace's own nodes of the model's outputs and of
    their gradients. :mod:`autoshard.graph.unroll` builds deep models' raw traces from shallow ones."""

    gm: fx.GraphModule
    param_fqns: list[str]
    buffer_fqns: list[str]
    trainable: list[int]
    """Indices into ``param_fqns`` of the parameters whose gradients the graph outputs, in order."""
    input_names: list[str]
    groups: list[list[str]]
    leaves: list = field(default_factory=list)
    tree: object = None
    grads: dict[int, fx.Node | None] = field(default_factory=dict)
    fake_mode: FakeTensorMode | None = None
    grad_inputs: list[int] = field(default_factory=list)
    """Indices of the tensor inputs whose gradients the graph outputs after the parameters'."""


def trace(
    model: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    loss_fn: Callable | None = None,
    tie_layers: bool = True,
    example_kwargs: dict | None = None,
    input_grads: bool = False,
) -> TracedGraph:
    """Trace one training step of ``model`` on ``example_inputs`` (real, fake or meta tensors).

    ``example_kwargs``: keyword arguments of ``forward``; tensors become inputs of the step
    (after the positional ones, in the dict's order), anything else is a constant of the trace.
    With ``tie_layers``, the nodes of repeated layers are tagged so that the
    planner can tie them. :func:`autoshard.graph.unroll.trace_unrolled` traces deep models faster.
    ``input_grads``: the step computes the gradient of each floating-point input too
    (:attr:`TracedGraph.input_grad_of`: a pipeline stage's, sent back to the stage before).
    """
    example_inputs = check_inputs(example_inputs)
    groups = layer_groups(model) if tie_layers else []
    return finish(raw_trace(model, example_inputs, loss_fn, example_kwargs, groups, input_grads))


def check_inputs(example_inputs) -> tuple:
    """``example_inputs`` as a tuple of tensors, or a :class:`TraceError` naming what else it holds."""
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    bad = [type(x).__name__ for x in example_inputs if not isinstance(x, torch.Tensor)]
    if bad:
        raise TraceError(f"example_inputs: expected a sequence of tensors, found element types {bad}")
    return example_inputs


def raw_trace(model: torch.nn.Module, example_inputs: tuple, loss_fn: Callable | None, example_kwargs: dict | None,
              groups: list[list[str]], input_grads: bool = False) -> RawTrace:
    """``make_fx`` of the training step, layers of ``groups`` tagged (untagged if that fails)."""
    example_kwargs = dict(example_kwargs or {})
    kw_names = [k for k, v in example_kwargs.items() if isinstance(v, torch.Tensor)]
    constants = {k: v for k, v in example_kwargs.items() if not isinstance(v, torch.Tensor)}
    input_names = [f"input{k}" for k in range(len(example_inputs))] + kw_names
    example_inputs = example_inputs + tuple(example_kwargs[k] for k in kw_names)
    loss_fn = loss_fn or default_loss
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    devices = {x.device for x in example_inputs if x.device.type != "meta"}
    device = next(iter(devices)) if devices else torch.device("cpu")

    fm = FakeTensorMode(allow_non_fake_inputs=True)
    fparams = [_to_fake(fm, p, device, requires_grad=p.requires_grad) for p in params.values()]
    fbuffers = [_to_fake(fm, b, device) for b in buffers.values()]
    grad_inputs = [k for k, x in enumerate(example_inputs) if input_grads and x.is_floating_point()]
    finputs = [_to_fake(fm, x, device, requires_grad=k in grad_inputs) for k, x in enumerate(example_inputs)]
    names_p, names_b = list(params), list(buffers)
    trainable = [i for i, p in enumerate(params.values()) if p.requires_grad]
    seen: dict = {}

    def grad_hook(k):
        def hook(g):
            seen["grads"][k] = tc.traced_node(g)
        return hook

    def step(*flat):
        ps = flat[: len(names_p)]
        bs = flat[len(names_p): len(names_p) + len(names_b)]
        xs = flat[len(names_p) + len(names_b):]
        positional = xs[: len(xs) - len(kw_names)]
        kwargs = {**constants, **dict(zip(kw_names, xs[len(positional):]))}
        state = {**dict(zip(names_p, ps)), **dict(zip(names_b, bs))}
        # The phase of each traced op is what lets a plan be split into the model's forward
        # and backward programs, with the loss left to the caller (autoshard.runtime.lower).
        tc.node_meta_custom()[PHASE] = "forward"
        out = functional_call(model, state, tuple(positional), kwargs)
        leaves, seen["tree"] = torch.utils._pytree.tree_flatten(out)
        seen["leaves"] = [tc.traced_node(v) if isinstance(v, torch.Tensor) else v for v in leaves]
        seen["grads"] = {}
        for k, v in enumerate(leaves):
            if isinstance(v, torch.Tensor) and v.requires_grad:
                v.register_hook(grad_hook(k))
        tc.node_meta_custom()[PHASE] = "loss"
        loss = loss_fn(out)
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise TraceError(f"loss: expected a scalar tensor, found {getattr(loss, 'shape', type(loss))}")
        tc.node_meta_custom()[PHASE] = "backward"
        grads = torch.autograd.grad(loss, [ps[i] for i in trainable] + [xs[k] for k in grad_inputs],
                                    allow_unused=True)
        tc.node_meta_custom().pop(PHASE, None)
        return (loss, *grads)

    clear_method_caches(model)  # a value cached by an earlier trace would be traced as a constant
    try:
        try:
            with fm, tc.preserve_node_meta(), tag_layers(model, groups):
                gm = make_fx(step, pre_dispatch=False)(*fparams, *fbuffers, *finputs)
        except TraceError:
            raise
        except Exception:
            if not groups:
                raise
            # Backward hooks can trip on unusual layer signatures: trace again untagged.
            groups = []
            with fm, tc.preserve_node_meta():
                gm = make_fx(step, pre_dispatch=False)(*fparams, *fbuffers, *finputs)
        finally:
            tc.node_meta_custom().pop(PHASE, None)
            clear_method_caches(model)  # and a fake value cached now must not reach the model's own runs
    except TraceError:
        raise
    except Exception as exc:  # the model's own error, reported with the shapes it got
        shapes = [tuple(x.shape) for x in example_inputs]
        raise TraceError(
            f"{type(model).__name__}.forward failed on example inputs of shapes {shapes}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}{_data_dependent_hint(exc)}"
            f"{_flex_attention_hint(exc)}{_grouped_mm_hint(exc)}"
        ) from exc
    return RawTrace(gm=gm, param_fqns=names_p, buffer_fqns=names_b, trainable=trainable, input_names=input_names,
                    grad_inputs=grad_inputs,
                    groups=groups, leaves=seen.get("leaves", []), tree=seen.get("tree"),
                    grads=dict(seen.get("grads", {})), fake_mode=fm)


def clear_method_caches(model: torch.nn.Module) -> int:
    """Clear the function caches (``functools.lru_cache``, bare or wrapped as Hugging Face's
    ``compile_compatible_method_lru_cache`` wraps it) held by the classes of ``model``'s modules;
    returns how many were cleared.

    A model may cache a tensor computed in forward (BEiT's relative position index, keyed by
    its window size alone): traced, the cache keeps the trace's fake tensor, so the next trace
    records it as a constant where the first recorded the ops that make it (the planned graph
    and the one ``parallelize`` traces differ node for node), and the model's own eager runs
    would read a tensor with no data."""
    import functools

    cleared, seen = 0, set()
    for cls in {c for m in model.modules() for c in type(m).__mro__ if c.__module__ != "builtins"}:
        for attr in vars(cls).values():
            f = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
            cells = [c.cell_contents for c in (getattr(f, "__closure__", None) or ()) if _filled(c)]
            for cache in (f, *cells):
                if isinstance(cache, functools._lru_cache_wrapper) and id(cache) not in seen:
                    seen.add(id(cache))
                    cache.cache_clear()
                    cleared += 1
    return cleared


def _filled(cell) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def _flex_attention_hint(exc: Exception) -> str:
    """What to do about FlexAttention, which a training step cannot be traced through here."""
    if "FlexAttention" not in str(exc) and "flex_attention" not in str(exc):
        return ""
    return ("\n  FlexAttention cannot be planned with torch " + torch.__version__.split("+")[0] + ": its backward has "
            "no implementation for the CPU or meta device that a plan is traced on, and DTensor has no sharding rule "
            "for its higher-order op. Plan the model with F.scaled_dot_product_attention (is_causal=True, or a "
            "boolean/additive attn_mask for document masking): the same fused attention, planned and run as such.")


def _grouped_mm_hint(exc: Exception) -> str:
    """What to do about torch's grouped matmul in float32 (Hugging Face's default experts)."""
    if "Expected inputs of BF16 type" not in str(exc):
        return ""
    return ("\n  torch._grouped_mm (a Hugging Face MoE's default experts, \"grouped_mm\") takes bf16 operands only, "
            "on the CPU and meta devices a plan is traced on: build the model in bf16 (`torch_dtype=torch.bfloat16`, "
            "or `model.to(torch.bfloat16)`), or pass `experts_implementation=\"batched_mm\"` to from_config, whose "
            "experts run in any dtype.")


def _data_dependent_hint(exc: Exception) -> str:
    """How to plan a model whose shapes depend on tensor values (a plan is for static shapes)."""
    names = {type(e).__name__ for e in (exc, exc.__cause__, exc.__context__) if e is not None}
    if not names & {"DynamicOutputShapeException", "DataDependentOutputException", "GuardOnDataDependentSymNode"}:
        return ""
    return ("\n  the model's shapes depend on its tensors' values (nonzero, masked indexing, a loop over the "
            "experts a batch reaches), and a plan is made for static shapes. For a mixture of experts: a Hugging "
            "Face model plans with its static-shape experts, `config._experts_implementation = \"batched_mm\"` "
            "(or \"grouped_mm\" in bf16) before building it; or swap its MoE block for autoshard.models.moe.MoeLayer "
            "(capacity-based dispatch), which is what expert parallelism is planned for.")


def finish(raw: RawTrace) -> TracedGraph:
    """Tidy a raw trace (hook residue dropped, loss-free names, constants given fake values)
    and say what each placeholder and output is. Changes ``raw.gm`` in place."""
    gm, groups, fm = raw.gm, raw.groups, raw.fake_mode
    names_p, names_b, trainable, input_names = raw.param_fqns, raw.buffer_fqns, raw.trainable, raw.input_names
    seen = {"leaves": list(raw.leaves), "tree": raw.tree, "grads": dict(raw.grads)}
    rewritten = functionalize_view_writes(gm, fm)
    if rewritten:
        seen["leaves"] = [rewritten.get(v, v) if isinstance(v, fx.Node) else v for v in seen["leaves"]]
        seen["grads"] = {k: rewritten.get(n, n) for k, n in seen["grads"].items()}
    if groups:
        replaced = _drop_hook_residue(gm, keep={v for v in seen["leaves"] if isinstance(v, fx.Node)})

        def alive(n):
            while n in replaced:
                n = replaced[n]
            return n

        seen["leaves"] = [alive(v) if isinstance(v, fx.Node) else v for v in seen.get("leaves", [])]
        seen["grads"] = {k: alive(n) for k, n in seen.get("grads", {}).items() if n is not None}
    seen["grads"] = {k: n for k, n in seen.get("grads", {}).items() if n is not None}
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(fx.node.map_aggregate(out_node.args[0], lambda a: a))
    flat = outs if not isinstance(outs[0], (list, tuple)) else list(outs[0])
    loss_node = flat[0]
    for k, leaf in enumerate(seen.get("leaves", [])):
        if leaf is loss_node and k not in seen["grads"]:
            # The model returns its own loss (HF models given labels): autograd seeds that
            # output's gradient directly, and a tensor hook on the root never fires.
            seed = _loss_seed(loss_node)
            if seed is not None:
                seen["grads"][k] = seed
    _loss_free_names(gm, seen["grads"].values())
    for node in gm.graph.nodes:
        if node.op == "get_attr" and "val" not in node.meta:
            # Constants lifted by make_fx (small tensors built inside forward): give them
            # fake values so that they plan like any other tensor.
            const = getattr(gm, node.target)
            if isinstance(const, torch.Tensor):
                node.meta["val"] = fm.from_tensor(const)
    gm.recompile()  # once, after every change above
    tg = TracedGraph(gm=gm, param_fqns=names_p, buffer_fqns=names_b, num_inputs=len(input_names),
                     layer_groups=groups, outputs=seen.get("leaves", []), output_tree=seen.get("tree"),
                     output_grads=seen["grads"])
    ph = tg.placeholders
    for k, node in enumerate(ph):
        if k < len(names_p):
            tg.kinds[node.name], tg.fqn_of[node.name] = "param", names_p[k]
        elif k < len(names_p) + len(names_b):
            tg.kinds[node.name], tg.fqn_of[node.name] = "buffer", names_b[k - len(names_p)]
        else:
            tg.kinds[node.name], tg.fqn_of[node.name] = "input", input_names[k - len(names_p) - len(names_b)]
    tg.loss_node = loss_node
    for idx, g in zip(trainable, flat[1:]):
        if isinstance(g, fx.Node):
            tg.grad_of[names_p[idx]] = g
    for k, g in zip(raw.grad_inputs, flat[1 + len(trainable):]):
        if isinstance(g, fx.Node):
            tg.input_grad_of[k] = g
    return tg
