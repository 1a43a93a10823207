"""Reading plans: a per-layer table (``explain``), a readable comparison (``diff``), and the
same facts as pandas DataFrames (``Plan.to_frame``, ``redistributes_frame``, ``compare_frame``)."""

from __future__ import annotations

import math
from collections import OrderedDict

from autoshard.planfile import Plan, layer_of

#: What :func:`diff` says of two plans with nothing to tell apart.
IDENTICAL = "plans are identical in placements and predicted costs"


def explain(plan: Plan, top: int = 10) -> str:
    """Placements and per-device parameter elements per layer, totals, the dearest redistributes."""
    lines = [plan.describe(max_params=0).rsplit("\n  parameters", 1)[0], ""]
    layers: OrderedDict[str, list[str]] = OrderedDict()
    for fqn in plan.params:
        layers.setdefault(layer_of(fqn), []).append(fqn)
    axes = plan.axis_names
    width = max([len(fqn) for fqn in plan.params] + [10])
    head = f"  {'parameter':<{width}}  " + "  ".join(f"{a:>6}" for a in axes) + f"  {'global':>14}  {'per device':>12}"
    total_g = total_l = 0
    for layer, fqns in layers.items():
        lines.append(f"[{layer}]")
        lines.append(head)
        for fqn in fqns:
            p = plan.params[fqn]
            g = math.prod(p.shape) if p.shape else 0
            loc = plan.local_elems(fqn)
            total_g, total_l = total_g + g, total_l + loc
            pl = "  ".join(f"{p.placements[a]:>6}" for a in axes)
            order = f"  order {p.shard_order}" if p.shard_order else ""
            lines.append(f"  {fqn:<{width}}  {pl}  {g:>14,}  {loc:>12,}{order}")
    lines.append("")
    lines += mesh_search_table(plan)
    lines.append(f"parameters: {total_g:,} elements, {total_l:,} per device "
                 f"({total_l / max(total_g, 1):.1%}); {len(plan.redistributes)} redistributes, "
                 f"{sum(r['us'] for r in plan.redistributes):.1f} us predicted")
    dear = sorted(plan.redistributes, key=lambda r: -r["us"])[:top]
    if dear:
        lines.append(f"the {len(dear)} most expensive redistributes:")
        for r in dear:
            lines.append(f"  {r['us']:>10.1f} us  {r['node']} arg {r['arg']}: {r['from']} -> {r['to']}  "
                         f"[{', '.join(r['steps'])}]")
    return "\n".join(lines)


def mesh_search_table(plan: Plan) -> list[str]:
    """The shapes a ``mesh="auto"`` plan tried, one line each (nothing for a plan on a given mesh)."""
    rows = plan.summary.get("mesh_search")
    if not rows:
        return []
    out = [f"mesh search: {len(rows)} shapes in {plan.summary.get('mesh_search_seconds', 0):.1f} s",
           f"  {'shape':>12}  {'outcome':>10}  {'step ms':>10}  {'bound ms':>10}  {'peak GiB':>8}  {'s':>6}  note"]
    for r in rows:
        step = f"{r['step_us'] / 1e3:10.3f}" if r.get("step_us") is not None else f"{'-':>10}"
        bound = f"{r['bound_us'] / 1e3:10.3f}" if r.get("bound_us") is not None else f"{'-':>10}"
        peak = f"{r['peak_mem_bytes'] / 2**30:8.2f}" if r.get("peak_mem_bytes") is not None else f"{'-':>8}"
        note = (r.get("note") or "")[:80]
        out.append(f"  {'x'.join(map(str, r['shape'])):>12}  {r['outcome']:>10}  {step}  {bound}  {peak}  "
                   f"{r.get('seconds', 0):6.1f}  {note}")
    return out + [""]


def diff(a: Plan, b: Plan) -> str:
    """What differs between two plans: mesh, model, placements, inputs, predicted costs."""
    out = []
    if a.mesh_shape != b.mesh_shape or a.axis_names != b.axis_names:
        out.append(f"mesh: {dict(zip(a.axis_names, a.mesh_shape))} -> {dict(zip(b.axis_names, b.mesh_shape))}")
    if a.model.get("fingerprint") != b.model.get("fingerprint"):
        out.append(f"model: {a.model.get('class')} {a.model.get('fingerprint')} -> "
                   f"{b.model.get('class')} {b.model.get('fingerprint')}")
    if a.profile.get("name") != b.profile.get("name"):
        out.append(f"profile: {a.profile.get('name')} -> {b.profile.get('name')}")
    for fqn in sorted(set(a.params) | set(b.params)):
        if fqn not in b.params:
            out.append(f"- {fqn}")
        elif fqn not in a.params:
            out.append(f"+ {fqn}")
        else:
            sa = str(a.param_spec(fqn)) if a.axis_names == b.axis_names else str(a.params[fqn].placements)
            sb = str(b.param_spec(fqn)) if a.axis_names == b.axis_names else str(b.params[fqn].placements)
            if sa != sb:
                out.append(f"~ {fqn}: {sa} -> {sb}")
    if a.inputs != b.inputs:
        out.append(f"inputs: {a.inputs} -> {b.inputs}")
    for key, unit, scale in (("step_us", "ms", 1e3), ("additive_us", "ms", 1e3), ("compute_us", "ms", 1e3),
                             ("comm_us", "ms", 1e3), ("peak_mem_bytes", "MiB", 2**20)):
        va, vb = a.summary.get(key), b.summary.get(key)
        if va is not None and vb is not None and va != vb:
            rel = f" ({(vb - va) / va:+.1%})" if va else ""
            out.append(f"{key}: {va / scale:.3f} -> {vb / scale:.3f} {unit}{rel}")
    if len(a.redistributes) != len(b.redistributes):
        out.append(f"redistributes: {len(a.redistributes)} -> {len(b.redistributes)}")
    return "\n".join(out) if out else IDENTICAL


def redistributes_frame(plan: Plan):
    """One row per planned redistribute: ``node``, ``arg``, ``from``, ``to``, ``steps``, ``us``;
    dearest first."""
    import pandas as pd

    frame = pd.DataFrame(plan.redistributes, columns=["node", "arg", "from", "to", "steps", "us"])
    return frame.sort_values("us", ascending=False, kind="stable").reset_index(drop=True)


def compare_frame(results: dict):
    """``compare``'s answer as a table, one row per plan: ``step_ms`` (simulated, overlap
    included), ``compute_ms``, ``comm_ms`` (every collective), ``exposed_ms`` (what the step does
    not hide), ``peak_gib``, ``ratio`` (step over the best step) and ``error`` (why a baseline
    has no plan)."""
    import pandas as pd

    rows = []
    for name, res in results.items():
        if isinstance(res, str):
            rows.append({"plan": name, "error": res})
            continue
        sm = res.summary
        rows.append({"plan": name, "step_ms": sm["step_us"] / 1e3, "compute_ms": sm["compute_us"] / 1e3,
                     "comm_ms": sm["comm_us"] / 1e3, "exposed_ms": (sm["step_us"] - sm["compute_us"]) / 1e3,
                     "peak_gib": sm["peak_mem_bytes"] / 2**30, "error": None})
    frame = pd.DataFrame(rows, columns=["plan", "step_ms", "compute_ms", "comm_ms", "exposed_ms", "peak_gib", "error"])
    frame["ratio"] = frame["step_ms"] / frame["step_ms"].min()
    return frame.set_index("plan")


def load_any(path):
    """The plan file at ``path``: a :class:`~autoshard.planfile.Plan`, or a
    :class:`~autoshard.planning.pipeline.PipelinePlan` where the file is a pipelined plan."""
    import json
    from pathlib import Path

    from autoshard.errors import PlanError

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"{path}: cannot read a plan JSON file: {exc}") from None
    if isinstance(data, dict) and data.get("kind") == "pipeline":
        from autoshard.planning.pipeline import PipelinePlan

        return PipelinePlan.from_json(data)
    return Plan.from_json(data)


def explain_pipeline(pplan, top: int = 10) -> str:
    """A pipelined plan's stage table, then :func:`explain` of each distinct stage's plan (once per
    role and layer count: the stages alike share it), named for its first stage's layers."""
    from autoshard.planning.pipeline import stage_plan

    lines = [pplan.describe()]
    for s, alike in pplan.distinct_stages():
        lines += ["", f"stage {s.index} ({s.role}, layers {s.layers[0]}-{s.layers[1] - 1}; its plan is that of "
                      f"stages {alike}):", explain(stage_plan(pplan, s), top=top)]
    return "\n".join(lines)


def diff_pipelines(a, b) -> str:
    """What differs between two pipelined plans: mesh, schedule, microbatches, the cut into
    stages, the predicted step, bubble and rank peak, then each stage's plan (:func:`diff`, with
    both named for the stage's own layers)."""
    from autoshard.planning.pipeline import stage_plan

    out = []
    if list(a.mesh_shape) != list(b.mesh_shape) or list(a.axis_names) != list(b.axis_names):
        out.append(f"mesh: {dict(zip(a.axis_names, a.mesh_shape))} -> {dict(zip(b.axis_names, b.mesh_shape))}")
    for field in ("axis", "schedule", "microbatches", "stages_per_rank"):
        if getattr(a, field) != getattr(b, field):
            out.append(f"{field}: {getattr(a, field)} -> {getattr(b, field)}")
    cut_a = [s.layers[1] - s.layers[0] for s in a.stages]
    cut_b = [s.layers[1] - s.layers[0] for s in b.stages]
    if cut_a != cut_b:
        out.append(f"layers per stage: {cut_a} -> {cut_b}")
    if a.step_us != b.step_us:
        rel = f" ({(b.step_us - a.step_us) / a.step_us:+.1%})" if a.step_us else ""
        out.append(f"step_us: {a.step_us / 1e3:.3f} -> {b.step_us / 1e3:.3f} ms{rel}")
    if a.run.bubble != b.run.bubble:
        out.append(f"bubble: {100 * a.run.bubble:.1f}% -> {100 * b.run.bubble:.1f}%")
    peak_a, peak_b = max(a.memory_bytes, default=0), max(b.memory_bytes, default=0)
    if peak_a != peak_b:
        out.append(f"rank peak: {peak_a / 2**30:.3f} -> {peak_b / 2**30:.3f} GiB")
    for k in range(max(len(a.stages), len(b.stages))):
        if k >= len(b.stages):
            out.append(f"- stage {k} ({a.stages[k].role}, layers {a.stages[k].layers[0]}-{a.stages[k].layers[1] - 1})")
            continue
        if k >= len(a.stages):
            out.append(f"+ stage {k} ({b.stages[k].role}, layers {b.stages[k].layers[0]}-{b.stages[k].layers[1] - 1})")
            continue
        sa, sb = a.stages[k], b.stages[k]
        text = diff(stage_plan(a, sa), stage_plan(b, sb))
        if text != IDENTICAL:
            out.append(f"stage {k} ({sa.role}, layers {sa.layers[0]}-{sa.layers[1] - 1} -> "
                       f"{sb.layers[0]}-{sb.layers[1] - 1}):")
            out += [f"  {line}" for line in text.splitlines()]
    return "\n".join(out) if out else IDENTICAL


def diff_any(a, b) -> str:
    """:func:`diff` of two plans, :func:`diff_pipelines` of two pipelined plans; of one of each, the
    kinds and predicted steps (their placements are not comparable: a stage places a slice of
    the model on a sub-mesh)."""
    pipelined = [not isinstance(p, Plan) for p in (a, b)]
    if all(pipelined):
        return diff_pipelines(a, b)
    if not any(pipelined):
        return diff(a, b)
    kind = ["pipelined plan" if p else "plan" for p in pipelined]
    step_a = a.step_us if pipelined[0] else a.summary["step_us"]
    step_b = b.step_us if pipelined[1] else b.summary["step_us"]
    rel = f" ({(step_b - step_a) / step_a:+.1%})" if step_a else ""
    return (f"kind: {kind[0]} -> {kind[1]} (placements not compared: a pipeline stage places a slice of the "
            f"model on a sub-mesh)\nstep_us: {step_a / 1e3:.3f} -> {step_b / 1e3:.3f} ms{rel}")
