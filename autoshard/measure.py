"""``autoshard measure``: run a plan's lowered programs and set what they take beside what the
plan predicted.

Each rank parallelizes the model with the plan (:func:`autoshard.parallelize`, the loss lowered
with the model, torch's bucketing and overlap passes as configured) and runs ``warmup`` steps,
then ``steps`` timed steps (forward and backward, a barrier before and after each: the slowest
rank sets a step), then ``attribution_steps`` more under :class:`CollectiveLog`, which times
every functional collective of the programs from its issue to the end of its wait:

- *exposed* communication: time the rank spends issuing collectives and blocked in their
  waits (what overlap did not hide); *compute* is the step minus that;
- per collective kind and group: count, bytes (the full buffer, as the profile's fits count
  them) and exposed time, against the plan's own steps (``step_us`` / ``step_bytes`` of its
  redistributes; a bucket is one measured collective for several planned ones).

The timed steps run without the log (its Python hook on every op would slow them); the
attribution steps' exposed times are read per step. Times are taken on the clock the work runs
on (:class:`HostClock` on CPU backends; :class:`CudaClock`, CUDA events on the compute stream,
on GPUs, where issuing and waiting return to the host at once and only the stream waits).
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard import _torch_compat as tc
from autoshard.errors import ConfigError, PlanError
from autoshard.planfile import Plan
from autoshard.runtime.passes import KIND

_WAIT = torch.ops._c10d_functional.wait_tensor.default

@dataclass(frozen=True)
class MeasureConfig:
    """How long to measure."""

    steps: int = 10
    """Timed steps (their median is the measured step)."""
    warmup: int = 3
    """Steps run first and not timed (the first lowers the programs)."""
    attribution_steps: int = 2
    """Steps run under :class:`CollectiveLog` after the timed ones, for the per-collective view."""
    memory_steps: int = 2
    """Steps run last with an AdamW optimizer under torch's memory tracker, its states made in the
    first: the peak of live tensor storage per rank, beside the plan's predicted peak (0: none)."""

    def __post_init__(self):
        for name in ("steps", "warmup", "attribution_steps", "memory_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if name == "steps" else 0):
                low = 1 if name == "steps" else 0
                raise ConfigError(f"{name}: expected an integer >= {low}, found {v!r}")


@dataclass
class CollectiveStats:
    count: float = 0.0
    bytes: float = 0.0
    us: float = 0.0


@dataclass
class Measurement:
    """Predicted against measured, per step (measured figures: medians over steps, means over
    ranks for the per-collective rows)."""

    plan_name: str
    mesh: dict
    backend: str
    predicted: dict
    """As the plan states them: ``step_us`` (its simulated step, overlap included; the additive
    one in plan files older than the simulation), ``compute_us``, ``comm_us`` (every collective),
    ``exposed_us`` (the communication its step does not hide), ``additive_us`` (nothing
    overlapped), ``host_idle_us`` (the device's predicted waits for the host: 0 without a host
    stream) and ``plan_simulated_us`` (its simulation, None in older plan files)."""
    measured: dict
    """``step_us`` (median of the timed steps, slowest rank), ``comm_exposed_us``,
    ``compute_us`` (= step - exposed), ``steps``, ``step_us_all`` (every timed step)."""
    collectives: list[dict] = field(default_factory=list)
    """One row per (kind, group): ``predicted`` and ``measured`` :class:`CollectiveStats` as dicts."""
    simulated: dict = field(default_factory=dict)
    """The lowered programs that ran, simulated on a compute and a communication stream
    (:mod:`autoshard.planning.simulate`): ``step_us``, ``compute_us``, ``comm_us``, ``exposed_us``,
    ``host_idle_us``."""
    memory: dict = field(default_factory=dict)
    """Peak memory per rank (:func:`run_memory_steps`): ``predicted_peak_bytes`` (the plan's),
    ``measured_peak_bytes`` (one per rank: live tensor storage at its peak, optimizer step
    included), ``at_peak`` (per rank, bytes by category at that peak), and on CUDA
    ``max_allocated_bytes`` (the allocator's own peak). Empty where not measured."""
    step_samples: list = field(default_factory=list)
    """In-step collective times ``[kind, group, group_size, bytes, us]``: per message, the
    shortest issue-to-wait time of the attribution steps, median over ranks (``group``: mesh
    axes joined by ``+``). What ``--refine`` fits the profile to."""

    @property
    def ratio(self) -> float:
        """Predicted step over measured step."""
        return self.predicted["step_us"] / self.measured["step_us"]

    @property
    def simulated_ratio(self) -> float | None:
        """Simulated step over measured step."""
        return self.simulated["step_us"] / self.measured["step_us"] if self.simulated else None

    @property
    def memory_ratio(self) -> float | None:
        """Predicted peak memory over the largest rank's measured peak."""
        m = self.memory
        if not m.get("measured_peak_bytes") or not m.get("predicted_peak_bytes"):
            return None
        return m["predicted_peak_bytes"] / max(m["measured_peak_bytes"])

    def to_json(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "simulated_ratio": self.simulated_ratio,
                "memory_ratio": self.memory_ratio}

    def table(self) -> str:
        p, m = self.predicted, self.measured
        # Measured compute holds the device's waits for the host: so does the prediction set beside it.
        idle = p.get("host_idle_us", 0.0)
        lines = [f"autoshard measure: {self.plan_name} on {self.mesh} ({self.backend}), "
                 f"{m['steps']} timed steps",
                 f"{'':24s} {'predicted':>12s} {'measured':>12s} {'pred/meas':>10s}",
                 f"{'step (ms)':24s} {p['step_us'] / 1e3:12.3f} {m['step_us'] / 1e3:12.3f} {self.ratio:10.3f}",
                 f"{'compute (ms)':24s} {(p['compute_us'] + idle) / 1e3:12.3f} {m['compute_us'] / 1e3:12.3f} "
                 f"{_ratio(p['compute_us'] + idle, m['compute_us'])}"
                 + (f"   (of which waiting for the host {idle / 1e3:.3f})" if idle else ""),
                 f"{'exposed comm. (ms)':24s} {p['exposed_us'] / 1e3:12.3f} {m['comm_exposed_us'] / 1e3:12.3f} "
                 f"{_ratio(p['exposed_us'], m['comm_exposed_us'])}   (predicted: of {p['comm_us'] / 1e3:.3f} "
                 "in all)",
                 f"{'additive step (ms)':24s} {p['additive_us'] / 1e3:12.3f} {m['step_us'] / 1e3:12.3f} "
                 f"{_ratio(p['additive_us'], m['step_us'])}   (nothing overlapped)"]
        if self.simulated:
            sim = self.simulated
            lines += [f"{'simulated step (ms)':24s} {sim['step_us'] / 1e3:12.3f} {m['step_us'] / 1e3:12.3f} "
                      f"{self.simulated_ratio:10.3f}   (lowered programs, overlap: compute "
                      f"{sim['compute_us'] / 1e3:.3f}, communication {sim['comm_us'] / 1e3:.3f} of which exposed "
                      f"{sim['exposed_us'] / 1e3:.3f})"]
        if self.memory.get("measured_peak_bytes"):
            mem = self.memory
            peaks = mem["measured_peak_bytes"]
            top = max(range(len(peaks)), key=peaks.__getitem__)
            lines.append(f"{'peak memory (MiB)':24s} {mem['predicted_peak_bytes'] / 2**20:12.2f} "
                         f"{peaks[top] / 2**20:12.2f} {self.memory_ratio:10.3f}   (largest rank, {top}; ranks "
                         f"{min(peaks) / 2**20:.2f}-{max(peaks) / 2**20:.2f}; optimizer step included)")
            parts = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in mem["at_peak"][top].items() if v)
            lines.append(f"  at rank {top}'s peak (MiB): {parts}")
            if mem.get("predicted_at_peak"):
                parts = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in mem["predicted_at_peak"].items() if v)
                lines.append(f"  predicted at its peak, {mem.get('predicted_peak_at')} (MiB): {parts}")
            for r, peak in enumerate(peaks):
                lines.append(f"  rank {r}: measured {peak / 2**20:.2f} MiB, predicted / measured "
                             f"{mem['predicted_peak_bytes'] / peak:.3f}")
        if self.collectives:
            lines.append("per step, per rank:     count pred/meas      MiB pred/meas        ms pred/exposed")
            for row in self.collectives:
                a, b = row["predicted"], row["measured"]
                lines.append(f"  {row['kind'] + '(' + row['group'] + ')':22s} {a['count']:7.0f} {b['count']:7.1f} "
                             f"{a['bytes'] / 2**20:10.2f} {b['bytes'] / 2**20:10.2f} "
                             f"{a['us'] / 1e3:10.3f} {b['us'] / 1e3:10.3f}")
        return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:10.3f}" if b > 0 else f"{'-':>10s}"


def predicted_collectives(plan: Plan) -> dict[tuple[str, str], CollectiveStats]:
    """(kind, group) -> the plan's collective steps per step: count, bytes, predicted time. A
    plan file written before per-step figures splits a redistribute's time evenly over its steps."""
    out: dict[tuple[str, str], CollectiveStats] = {}
    for r in plan.redistributes:
        steps = r.get("steps", [])
        step_us = r.get("step_us") or [r.get("us", 0.0) / max(len(steps), 1)] * len(steps)
        step_bytes = r.get("step_bytes") or [0] * len(steps)
        for text, us, nbytes in zip(steps, step_us, step_bytes):
            kind, _, group = text.partition("(")
            s = out.setdefault((kind, group.rstrip(")")), CollectiveStats())
            s.count += 1
            s.bytes += nbytes
            s.us += us
    return out


def full_buffer_bytes(kind: str, input_bytes: int, group_size: int) -> int:
    """Bytes of a collective's full buffer from its input's (an all-gather's input is one shard)."""
    return input_bytes * group_size if kind == "all_gather" else input_bytes


def group_axes(ranks, mesh_ranks, axis_names, rank: int) -> str:
    """The mesh axes (comma-joined) whose sub-mesh through ``rank`` holds exactly ``ranks``;
    ``"?"`` for a group that is no sub-mesh. ``mesh_ranks``: the mesh's rank grid (nested lists)."""
    grid = np.asarray(mesh_ranks)
    where = np.argwhere(grid == rank)
    if not len(where):
        return "?"
    coord = where[0]
    want = sorted(int(r) for r in ranks)
    for k in range(1, grid.ndim + 1):
        for axes in itertools.combinations(range(grid.ndim), k):
            index = tuple(slice(None) if d in axes else int(coord[d]) for d in range(grid.ndim))
            if sorted(int(r) for r in np.ravel(grid[index])) == want:
                return ",".join(axis_names[d] for d in axes)
    return "?"


class HostClock:
    """Marks in host seconds: on CPU backends (gloo) a collective's work runs on the host, so its
    issue and its wait calls bracket it."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        return end - start


class CudaClock:
    """Marks as CUDA events recorded on the current (compute) stream. A collective's work waits on
    that stream for the compute issued before it, and its wait holds the stream until the work
    ends: the time between the events around its issue and after its wait is the work's own,
    queueing included, when nothing was queued between (``overlapped`` is False); between the
    events around the wait, the time the stream was held. Read once the device is synchronized."""

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3


class CollectiveLog(TorchDispatchMode):
    """Times each functional collective from its issue to the end of its first wait, on
    ``clock`` (:class:`HostClock` by default; :class:`CudaClock` on GPUs, read only after the
    device is synchronized); ``group_of(group_name) -> (axes text, group size)``. A collective
    with an op other than a view dispatched between its issue and its wait ran beside compute:
    its span holds that compute, so it is marked ``overlapped`` and :meth:`spans` leaves it out.
    Per record: ``exposed_s``, the time in its issue and its wait (what it held the rank, or the
    stream), and ``span_s``, issue to the end of the wait."""

    def __init__(self, group_of, clock=None):
        super().__init__()
        self.group_of = group_of
        self.clock = clock or HostClock()
        self.records: list[dict] = []
        self._by_output: dict[int, dict] = {}
        self._clean: list[dict] = []
        """Issued, not yet waited for, and nothing run beside them so far."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "namespace", "") != "_c10d_functional":
            if self._clean and not getattr(func, "is_view", False):
                for rec in self._clean:
                    rec["overlapped"] = True
                self._clean.clear()
            return func(*args, **kwargs)
        start = self.clock.mark()
        out = func(*args, **kwargs)
        end = self.clock.mark()
        if func is _WAIT:
            rec = self._by_output.pop(id(args[0]), None)
            if rec is not None:
                rec["waited"] = (start, end)
                if rec in self._clean:
                    self._clean.remove(rec)
            return out
        kind = KIND.get(func)
        if kind is None:
            return out
        # The group's name is the last string argument (a reduce op, when there is one, comes first).
        group_name = next((a for a in reversed(list(args) + list(kwargs.values())) if isinstance(a, str)), None)
        axes, size = self.group_of(group_name)
        inputs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
        nbytes = sum(t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor))
        rec = {"kind": kind, "group": axes, "size": size, "bytes": full_buffer_bytes(kind, nbytes, size),
               "issued": (start, end), "waited": None, "overlapped": False}
        self.records.append(rec)
        self._clean.append(rec)
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor):
                self._by_output[id(t)] = rec
        return out

    def _times(self) -> list[dict]:
        """The records with ``exposed_s`` and ``span_s`` read off their clock marks."""
        sec = self.clock.seconds
        for rec in self.records:
            if "span_s" not in rec:
                (i0, i1), waited = rec["issued"], rec["waited"]
                rec["exposed_s"] = sec(i0, i1) + (sec(*waited) if waited else 0.0)
                rec["span_s"] = sec(i0, waited[1] if waited else i1)
        return self.records

    def spans(self) -> dict[str, float]:
        """The shortest issue-to-wait time seen per (kind, group, group size, bytes), in us, keyed
        ``kind|group|size|bytes``, of the collectives waited for with nothing run beside them:
        a collective's in-step time. An overlapped one's span also holds the compute between its
        issue and its wait (a prefetched gather's: whole layers), so it measures the program,
        not the collective; the profile's overlap share prices that part."""
        out: dict[str, float] = {}
        for rec in self._times():
            if rec["overlapped"]:
                continue
            key = f"{rec['kind']}|{rec['group']}|{rec['size']}|{rec['bytes']}"
            out[key] = min(out.get(key, float("inf")), rec["span_s"] * 1e6)
        return out

    def by_kind(self, steps: int) -> dict[tuple[str, str], CollectiveStats]:
        out: dict[tuple[str, str], CollectiveStats] = {}
        for rec in self._times():
            s = out.setdefault((rec["kind"], rec["group"]), CollectiveStats())
            s.count += 1 / steps
            s.bytes += rec["bytes"] / steps
            s.us += rec["exposed_s"] * 1e6 / steps
        return out


def _group_resolver(mesh):
    names = tuple(mesh.mesh_dim_names or [f"axis{d}" for d in range(mesh.ndim)])
    grid = mesh.mesh.tolist()
    rank = dist.get_rank()
    cache: dict = {}

    def group_of(group_name):
        if group_name not in cache:
            try:
                ranks = tc.group_ranks(group_name)
            except Exception:  # an unknown name: keep the measurement, mark the group
                ranks = []
            cache[group_name] = (group_axes(ranks, grid, names, rank) if ranks else "?", max(len(ranks), 1))
        return cache[group_name]

    return group_of


def _sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


def run_steps(model, inputs: tuple, cfg: MeasureConfig, mesh, kwargs=None) -> tuple[list[float], CollectiveLog]:
    """This rank's timed step seconds and its attribution log. ``model``: parallelized with
    ``compute_loss=True`` (its forward returns the plan's loss)."""
    kwargs = kwargs or {}
    device_type = mesh.device_type

    def step():
        loss = model(*inputs, **kwargs)
        loss.backward()
        for p in model.parameters():
            p.grad = None

    for _ in range(cfg.warmup):
        step()
    times = []
    for _ in range(cfg.steps):
        _sync(device_type)
        dist.barrier()
        t0 = time.perf_counter()
        step()
        _sync(device_type)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    log = CollectiveLog(_group_resolver(mesh), CudaClock() if device_type == "cuda" else HostClock())
    for _ in range(cfg.attribution_steps):
        _sync(device_type)
        dist.barrier()
        with log:
            step()
        _sync(device_type)
    return times, log


def run_memory_steps(model, inputs: tuple, cfg: MeasureConfig, device_type: str, kwargs=None) -> dict:
    """This rank's peak of live tensor storage over ``cfg.memory_steps`` training steps (forward,
    backward, an AdamW step; its states made in the first step, inside the tracker), and the bytes
    by category at that peak; on CUDA also the allocator's peak."""
    if cfg.memory_steps == 0:
        return {}
    kwargs = kwargs or {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    tracker = tc.memory_tracker()
    tracker.track_external(model, opt)
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with tracker:
        for k in range(cfg.memory_steps):
            if k:
                tracker.reset_mod_stats()  # the tracker keeps per-module figures of one step only
            loss = model(*inputs, **kwargs)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    _sync(device_type)
    snapshot = tracker.get_tracker_snapshot("peak")
    device = next((d for d in snapshot if getattr(d, "type", str(d)) == device_type), next(iter(snapshot)))
    at_peak = {str(getattr(k, "value", k)): int(v) for k, v in snapshot[device].items()}
    out = {"peak_bytes": at_peak.pop("Total", sum(at_peak.values())), "at_peak": at_peak}
    if device_type == "cuda":
        out["max_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    return out


def gather_measurement(plan: Plan, times: list[float], log: CollectiveLog, cfg: MeasureConfig,
                       backend: str, simulated: dict | None = None, memory: dict | None = None) -> Measurement | None:
    """Every rank's figures to rank 0, which returns the :class:`Measurement` (None elsewhere)."""
    mine = {"times": times, "rows": {f"{k}|{g}": asdict(s) for (k, g), s in
                                     log.by_kind(max(cfg.attribution_steps, 1)).items()},
            "spans": log.spans(), "memory": memory or {}}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() != 0:
        return None
    # A step is as long as its slowest rank (barriers on both sides), per step index.
    steps = [max(r["times"][k] for r in everyone) for k in range(len(times))]
    step_us = statistics.median(steps) * 1e6
    rows: dict[tuple[str, str], CollectiveStats] = {}
    for r in everyone:
        for key, s in r["rows"].items():
            kind, group = key.split("|")
            agg = rows.setdefault((kind, group), CollectiveStats())
            agg.count += s["count"] / len(everyone)
            agg.bytes += s["bytes"] / len(everyone)
            agg.us += s["us"] / len(everyone)
    exposed = sum(s.us for s in rows.values()) if cfg.attribution_steps else float("nan")
    spans: dict[str, list[float]] = {}
    for r in everyone:
        for key, us in r["spans"].items():
            spans.setdefault(key, []).append(us)
    step_samples = []
    for key, values in sorted(spans.items()):
        kind, group, size, nbytes = key.split("|")
        if group != "?" and int(size) > 1 and int(nbytes) > 0:
            step_samples.append([kind, group.replace(",", "+"), int(size), int(nbytes), statistics.median(values)])
    predicted = predicted_collectives(plan)
    table = []
    for key in sorted(set(predicted) | set(rows)):
        table.append({"kind": key[0], "group": key[1], "predicted": asdict(predicted.get(key, CollectiveStats())),
                      "measured": asdict(rows.get(key, CollectiveStats()))})
    s = plan.summary
    idle = s.get("simulated", {}).get("host_idle_us", 0.0)
    return Measurement(
        plan_name=f"plan for {plan.model.get('class', 'a model')}",
        mesh=dict(zip(plan.axis_names, plan.mesh_shape)), backend=backend,
        predicted={"step_us": s["step_us"], "compute_us": s["compute_us"], "comm_us": s["comm_us"],
                   # Of the step past compute, what the device waited for the host is not communication.
                   "exposed_us": max(0.0, s["step_us"] - s["compute_us"] - idle),
                   "additive_us": s.get("additive_us", s["compute_us"] + s["comm_us"]),
                   "host_idle_us": idle,
                   "plan_simulated_us": s.get("simulated", {}).get("step_us")},
        measured={"step_us": step_us, "comm_exposed_us": exposed, "compute_us": step_us - exposed,
                  "steps": len(steps), "step_us_all": [round(t * 1e6, 1) for t in steps]},
        collectives=table, simulated=simulated or {}, step_samples=step_samples,
        memory=_memory_rows(plan, [r["memory"] for r in everyone]))


def _memory_rows(plan: Plan, per_rank: list[dict]) -> dict:
    if not per_rank or not all(per_rank):
        return {}
    account = plan.summary.get("memory") or {}
    out = {"predicted_peak_bytes": plan.summary.get("peak_mem_bytes"),
           "measured_peak_bytes": [r["peak_bytes"] for r in per_rank],
           "at_peak": [r["at_peak"] for r in per_rank],
           # The plan's account by category (plans written before it have none).
           "predicted_at_peak": account.get("at_peak", {}), "predicted_peak_at": account.get("peak_at")}
    if all("max_allocated_bytes" in r for r in per_rank):
        out["max_allocated_bytes"] = [r["max_allocated_bytes"] for r in per_rank]
    return out


def measure_on_this_rank(model, inputs, plan: Plan, mesh, cfg: MeasureConfig = MeasureConfig(), *, loss_fn=None,
                         bucket_mb: float = 25.0, overlap: bool = True, compile=False, kwargs=None,
                         ) -> Measurement | None:
    """Parallelize ``model`` with ``plan`` on ``mesh`` (every rank of an initialized process
    group calls this) and measure it; rank 0 gets the :class:`Measurement`."""
    import autoshard

    world = dist.get_world_size()
    if math.prod(plan.mesh_shape) != world:
        raise PlanError(f"the plan's mesh {tuple(plan.mesh_shape)} has {math.prod(plan.mesh_shape)} ranks but the "
                        f"world size is {world}")
    sharded = autoshard.parallelize(model, plan, mesh, loss_fn=loss_fn, compute_loss=True, bucket_mb=bucket_mb,
                                    overlap=overlap, compile=compile)
    times, log = run_steps(sharded, tuple(inputs), cfg, mesh, kwargs)
    memory = run_memory_steps(sharded, tuple(inputs), cfg, mesh.device_type, kwargs)
    simulated = None
    if dist.get_rank() == 0:
        from autoshard.planning.simulate import simulate_step

        program = next(iter(sharded.forward.programs.values()))
        tl = simulate_step(program, 0)
        simulated = {"step_us": tl.step_us, "compute_us": tl.compute_us, "comm_us": tl.comm_us,
                     "exposed_us": tl.exposed_us, "collectives": tl.collectives, "host_idle_us": tl.idle_us}
    return gather_measurement(plan, times, log, cfg, dist.get_backend(), simulated, memory)


def refine_profile(m: Measurement, plan: Plan, profile, source: str):
    """``profile`` refitted to the measurement's in-step collectives (:func:`costmodel.refine.refine`)
    and to its measured compute (:func:`costmodel.refine.refine_compute`: against the compute of
    the lowered programs that ran as the profile prices them; the plan's where they were not
    simulated). Returns (refined profile, one row per refitted fit, what became of compute:
    ``compute xF``, or why it was kept)."""
    from autoshard.runtime.lower import plan_profile
    from costmodel.collectives import MeshTopology
    from costmodel.refine import refine, refine_compute

    topo = MeshTopology(tuple(plan.mesh_shape), profile.devices_per_node)
    samples = []
    for kind, group, size, nbytes, us in m.step_samples:
        axes = tuple(plan.axis_names.index(a) for a in group.split("+"))
        samples.append((kind, group, size, topo.group_is_intra_node(axes), nbytes, us))
    provenance = {"source": source, "model": plan.model.get("class"), "mesh": m.mesh, "backend": m.backend,
                  "measured_step_us": round(m.measured["step_us"], 1)}
    # The compute predicted is the plan's profile's (the programs were simulated with it): a
    # factor against it says nothing of another profile's compute figures.
    # Measured compute is the step less exposed communication: the device's waits for the host
    # are in it, so they are in the prediction it is set against.
    sim = m.simulated or {}
    predicted = (sim.get("compute_us", 0.0) + sim.get("host_idle_us", 0.0)) or m.predicted["compute_us"]
    measured = m.measured["compute_us"]
    if profile != plan_profile(plan):
        compute = "compute kept (the plan was made with another profile)"
    elif not (predicted > 0 and measured > 0):
        # Exposed time is taken in the attribution steps, the step in the timed ones: on a loaded
        # machine the first can pass the second, leaving no compute to fit.
        compute = f"compute kept (measured {measured / 1e3:.3f} ms, predicted {predicted / 1e3:.3f} ms: nothing to fit)"
    else:
        profile, factor = refine_compute(profile, predicted, measured)
        provenance["compute"] = {"predicted_us": round(predicted, 1), "measured_us": round(measured, 1),
                                 "factor": round(factor, 4)}
        compute = f"compute x{factor:.3g}"
    refined, rows = refine(profile, samples, provenance)
    return refined, rows, compute



def save(m: Measurement, path: str) -> None:
    with open(path, "w") as f:
        json.dump(m.to_json(), f, indent=1)
