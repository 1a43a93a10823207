"""Hardware profiles: what the cost model is evaluated with.

A profile holds compute figures (peak, bandwidth, efficiency), an alpha-beta
model per link class (within a node / across nodes) from data sheets or
nccl-tests figures, and, once calibrated (``autoshard calibrate``), the raw
samples and a fitted curve per (collective, group) measured on the user's own
cluster, with the identity of what was measured.

Collective lookup (:meth:`Profile.collective_predictor`), in order:

1. a fit for the same kind, link class and group size: used as is;
2. a fit for the same kind and link class, another group size: its latency and
   bus bandwidth, rescaled to the group size by the nccl-tests bus factor;
3. otherwise the link class's alpha-beta constants (never a silent zero).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from costmodel.errors import CostModelError
from costmodel.fit import CollectiveFit
from costmodel.links import LinkModel

PROFILE_VERSION = 2
#: Access patterns of memory-bound ops that reach less than a copy's bandwidth (``Profile.mem_efficiency``).
MEMORY_PATTERNS = ("broadcast", "reduction", "outer_reduction", "normalize", "strided", "transposed", "scatter")
#: Fused kernels whose FLOPs run at a rate of their own (``Profile.kernel_shares``): fused attention's
#: forward and backward (flash, memory-efficient, cuDNN, the CPU flash kernel).
KERNELS = ("attention_forward", "attention_backward")
#: A pattern a profile does not measure is priced as the one it refines, where that one is measured
#: (a profile calibrated before ``outer_reduction`` existed prices those as reductions).
PATTERN_FALLBACK = {"outer_reduction": "reduction"}
#: ``Profile.overlap`` where a profile does not give it (profiles written before it existed).
DEFAULT_OVERLAP = 0.9


@dataclass(frozen=True)
class Profile:
    """Per-device compute and per-link communication constants."""

    name: str
    """Short name, e.g. ``h100-sxm``."""
    device: str
    """Device type the figures describe."""
    peak_tflops: float
    """Dense peak for the planning dtype (bf16 on GPUs, fp32 on CPUs), TFLOP/s."""
    mem_bandwidth_gbps: float
    """Device memory bandwidth, GB/s."""
    memory_bytes: int
    """Device memory, bytes: the default per-device memory budget."""
    devices_per_node: int
    """Ranks that share the fast intra-node links."""
    intra_node: LinkModel
    """Links between ranks of one node."""
    inter_node: LinkModel
    """Links between nodes."""
    dtype_tflops: dict = field(default_factory=dict)
    """Dense peak of each dtype whose rate differs from ``peak_tflops``, by torch dtype name,
    TFLOP/s: ``{"float32": 67.0}`` on an H100, whose float32 matmuls (PyTorch's default, no
    TF32) run on the CUDA cores at a fifteenth of bf16. A dtype not named runs at
    ``peak_tflops``; ``compute_efficiency`` applies to every dtype."""
    compute_efficiency: float = 0.6
    """Fraction of peak a well-shaped kernel reaches."""
    mem_efficiency: dict = field(default_factory=dict)
    """Share of ``mem_bandwidth_gbps`` that a memory-bound op reaches, by its access pattern
    (:data:`MEMORY_PATTERNS`, :func:`autoshard.graph.pricing.memory_pattern`): ``broadcast`` (an
    operand smaller than the output, re-read: norms' weights, rotary tables, biases),
    ``reduction`` (an output smaller than an input: sums, means), ``outer_reduction`` (a
    reduction that keeps the last dim: sums over the batch, as bias and norm-weight gradients
    are; else priced as ``reduction``), ``normalize`` (softmax and norms: a reduction and an
    elementwise pass), ``strided`` (an operand not contiguous whose last dim is: attention heads
    permuted), ``transposed`` (an operand whose last dim is not contiguous: a transpose made
    contiguous), ``scatter`` (rows accumulated at indices: an embedding's gradient, index_add).
    A pattern not named, a contiguous elementwise op and a copy reach the whole bandwidth.
    Measured by ``autoshard calibrate``; on an H100 in bf16 about 0.54 (broadcast), 0.45
    (softmax), 0.19 (transposed); on an H200 0.54 (outer reduction), 0.09 (scatter)."""
    matmul_shares: dict = field(default_factory=dict)
    """Share of the calibrated matmul rate (``tflops(dtype) * compute_efficiency``, measured on
    one square size) that a matmul reaches by its size, by side (a string of an int: the side of
    the cube of its M x N x K times its batch entries) in ascending order: ``{"128": 0.35, "512": 0.8,
    "1024": 1.0, "2048": 1.05}``. Between sides the share follows log(side) linearly; beyond
    the ends it stays at the end's. A matmul sharded into thin local pieces (tensor parallelism
    on many ranks) runs below the rate of a well-shaped one. Measured by ``autoshard
    calibrate``; empty: every matmul at the calibrated rate."""
    kernel_shares: dict = field(default_factory=dict)
    """Share of the calibrated matmul rate (``tflops(dtype) * compute_efficiency``) that a fused
    kernel's FLOPs reach, by kernel (:data:`KERNELS`): ``{"attention_forward": 0.6,
    "attention_backward": 0.5}``. Fused attention does its matmuls in tiles beside an online
    softmax, the backward recomputing the scores, so it runs below a large matmul's rate. A
    kernel not named runs at the calibrated rate. Measured by ``autoshard calibrate`` where the
    device runs the kernel; shipped GPU profiles carry published figures (see ``source``)."""
    kernel_launch_us: float = 5.0
    """Floor on the time of any kernel, microseconds."""
    host_op_us: float = 0.0
    """Host time to issue one op of the step's program (Python, dispatcher, launch; views too),
    microseconds. A GPU runs an op no sooner than the host has issued it and every op before
    it, so a program of small ops lasts as long as their issue (:mod:`autoshard.planning.simulate`'s host
    stream). Measured by ``autoshard calibrate`` on GPUs (a toy training step traced and replayed);
    0 models no host stream: a CPU device runs each op on the issuing thread, where
    ``kernel_launch_us`` floors it, and shipped GPU profiles leave it to calibration."""
    all_to_all_by_gather: bool = False
    """Whether the executor runs an all_to_all as an all_gather of each rank's whole shard and a
    chunk of the result, and is priced so: DTensor does on a CPU mesh (its functional
    collectives have no gloo all_to_all), where a gloo step of GPT-2 on (2, 2) measured four
    all_gathers of 3 MiB in place of the planned all_to_alls. Set by ``autoshard calibrate`` on
    CPU meshes."""
    host_view_us: float | None = None
    """Host time to issue a view op (no kernel: :func:`costmodel.ops.host_kind`), microseconds;
    None: ``host_op_us``, as any op. Python's dispatch of a view is a third to a half of a
    kernel's launch, and a lowered program holds two to three views per kernel. Measured by
    ``autoshard calibrate`` on GPUs (a chain of views traced and replayed); ``host_op_us`` is
    then the issue of an op that launches a kernel."""
    overlap: float = DEFAULT_OVERLAP
    """Share of the communication that compute running beside it could hide which it does hide:
    1 when a collective and compute share nothing, 0 when they contend for everything (each then
    adds its whole time to the step). A step is priced as ``additive - overlap * (additive -
    perfectly overlapped)`` (:mod:`autoshard.planning.simulate`). Measured by ``autoshard calibrate`` (a
    collective beside matmuls against each alone); the default is an assumption for GPUs, whose
    collective kernels take some SMs and memory bandwidth from compute."""
    source: str = ""
    """Where the figures come from."""
    collectives: tuple = ()
    """Fitted :class:`CollectiveFit` per (kind, group), from calibration."""
    mesh: dict = field(default_factory=dict)
    """The mesh calibration ran on: ``{"shape": [...], "axis_names": [...]}``."""
    identity: dict = field(default_factory=dict)
    """What was measured: device, count, backend, torch and NCCL versions, host hash, date."""
    samples: tuple = ()
    """Raw calibration samples ``(kind, group, group_size, intra_node, bytes, us)``."""
    step_samples: tuple = ()
    """Collectives timed inside real training steps (``autoshard measure --refine``), laid out as
    ``samples`` and kept apart from them (:mod:`costmodel.refine`)."""
    refinements: tuple = ()
    """One record per refinement from in-step samples: date, what ran, the factor per fit."""

    def __hash__(self) -> int:
        return hash(self.digest())

    def __eq__(self, other) -> bool:
        return isinstance(other, Profile) and self.digest() == other.digest()

    def digest(self) -> str:
        """sha256 of the JSON form: the profile's identity in plan files."""
        d = self.__dict__.get("_digest")
        if d is None:
            text = json.dumps(self.to_json(), sort_keys=True)
            d = "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]
            object.__setattr__(self, "_digest", d)
        return d

    def __post_init__(self):
        for f in ("peak_tflops", "mem_bandwidth_gbps", "memory_bytes", "devices_per_node"):
            if not getattr(self, f) > 0:
                raise CostModelError(f"profile {self.name!r}: {f} must be > 0, found {getattr(self, f)}")
        if not isinstance(self.dtype_tflops, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                for k, v in self.dtype_tflops.items()):
            raise CostModelError(f"profile {self.name!r}: dtype_tflops must map dtype names to rates > 0, "
                                 f"found {self.dtype_tflops!r}")
        if not 0 < self.compute_efficiency <= 1:
            raise CostModelError(f"compute_efficiency must be in (0, 1], found {self.compute_efficiency}")
        if not isinstance(self.mem_efficiency, dict) or not all(
                k in MEMORY_PATTERNS and isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 2
                for k, v in self.mem_efficiency.items()):
            raise CostModelError(f"profile {self.name!r}: mem_efficiency must map access patterns "
                                 f"{MEMORY_PATTERNS} to shares of the bandwidth in (0, 2], "
                                 f"found {self.mem_efficiency!r}")
        if not isinstance(self.matmul_shares, dict) or not all(
                isinstance(k, str) and k.isdigit() and int(k) > 0 and isinstance(v, (int, float))
                and not isinstance(v, bool) and 0 < v <= 4 for k, v in self.matmul_shares.items()):
            raise CostModelError(f"profile {self.name!r}: matmul_shares must map sides (positive integers, as "
                                 f"strings) to shares of the calibrated rate in (0, 4], found {self.matmul_shares!r}")
        if not isinstance(self.kernel_shares, dict) or not all(
                k in KERNELS and isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 4
                for k, v in self.kernel_shares.items()):
            raise CostModelError(f"profile {self.name!r}: kernel_shares must map kernels {KERNELS} to shares of "
                                 f"the calibrated rate in (0, 4], found {self.kernel_shares!r}")
        ordered = sorted(self.matmul_shares.items(), key=lambda kv: int(kv[0]))
        object.__setattr__(self, "matmul_shares", dict(ordered))
        # (log side, share) per point: the planner asks once per strategy of every matmul.
        object.__setattr__(self, "_matmul_points", [(math.log(int(k)), v) for k, v in ordered])
        if not (isinstance(self.host_op_us, (int, float)) and 0 <= self.host_op_us < float("inf")):
            raise CostModelError(f"profile {self.name!r}: host_op_us must be a finite time >= 0, "
                                 f"found {self.host_op_us!r}")
        if self.host_view_us is not None and not (
                isinstance(self.host_view_us, (int, float)) and 0 <= self.host_view_us < float("inf")):
            raise CostModelError(f"profile {self.name!r}: host_view_us must be a finite time >= 0 or null, "
                                 f"found {self.host_view_us!r}")
        if not (isinstance(self.overlap, (int, float)) and 0 <= self.overlap <= 1):
            raise CostModelError(f"profile {self.name!r}: overlap must be a share in [0, 1], found {self.overlap!r}")
        if isinstance(self.intra_node, dict):
            object.__setattr__(self, "intra_node", LinkModel(**self.intra_node))
        if isinstance(self.inter_node, dict):
            object.__setattr__(self, "inter_node", LinkModel(**self.inter_node))
        fits = tuple(CollectiveFit(**f) if isinstance(f, dict) else f for f in self.collectives)
        object.__setattr__(self, "collectives", fits)
        object.__setattr__(self, "samples", tuple(tuple(x) for x in self.samples))
        object.__setattr__(self, "step_samples", tuple(tuple(x) for x in self.step_samples))
        object.__setattr__(self, "refinements", tuple(dict(r) for r in self.refinements))
        if self.mesh:
            shape, names = self.mesh.get("shape"), self.mesh.get("axis_names")
            if not isinstance(shape, (list, tuple)) or not isinstance(names, (list, tuple)) or not shape \
                    or len(shape) != len(names) \
                    or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape):
                raise CostModelError(f"profile {self.name!r}: mesh must have equal-length shape and axis_names "
                                     f"(sizes >= 1), found {self.mesh}")

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items()
             if k not in ("collectives", "samples", "step_samples", "refinements", "dtype_tflops", "host_op_us",
                          "host_view_us", "mem_efficiency", "matmul_shares", "all_to_all_by_gather",
                          "kernel_shares")}
        # Absent when empty or 0: older profiles keep their JSON form, hence their digest.
        if self.mem_efficiency:
            d["mem_efficiency"] = dict(sorted(self.mem_efficiency.items()))
        if self.host_op_us:
            d["host_op_us"] = self.host_op_us
        if self.host_view_us is not None:
            d["host_view_us"] = self.host_view_us
        if self.all_to_all_by_gather:
            d["all_to_all_by_gather"] = True
        if self.matmul_shares:
            d["matmul_shares"] = dict(self.matmul_shares)
        if self.kernel_shares:
            d["kernel_shares"] = dict(sorted(self.kernel_shares.items()))
        if self.dtype_tflops:
            d["dtype_tflops"] = dict(sorted(self.dtype_tflops.items()))
        d["collectives"] = [f.to_json() for f in self.collectives]
        d["samples"] = [list(x) for x in self.samples]
        # Written only once present: an unrefined profile keeps its JSON form, hence its digest
        # (plan files name their profile by it).
        if self.step_samples or self.refinements:
            d["step_samples"] = [list(x) for x in self.step_samples]
            d["refinements"] = [dict(r) for r in self.refinements]
        return {"version": PROFILE_VERSION, **d}

    def bandwidth_gbps(self, pattern: str | None = None) -> float:
        """Memory bandwidth a memory-bound op of this access pattern reaches (None: a copy's)."""
        if not pattern:
            return self.mem_bandwidth_gbps
        share = self.mem_efficiency.get(pattern)
        if share is None:
            share = self.mem_efficiency.get(PATTERN_FALLBACK.get(pattern), 1.0)
        return self.mem_bandwidth_gbps * share

    def matmul_share(self, side: float | None) -> float:
        """The share of the calibrated rate a matmul of this side reaches (``matmul_shares``;
        1 without a curve or a side)."""
        pts = self._matmul_points
        if not pts or not side or side <= 0:
            return 1.0
        x = math.log(side)
        if x <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return pts[-1][1]

    def kernel_share(self, kernel: str | None) -> float:
        """The share of the calibrated rate a fused kernel reaches (``kernel_shares``; 1 for
        None or a kernel not named)."""
        return self.kernel_shares.get(kernel, 1.0) if kernel else 1.0

    def host_us(self, kind: str) -> float:
        """Host time to issue an op of this :func:`~costmodel.ops.host_kind`, microseconds."""
        if kind == "free":
            return 0.0
        if kind == "view" and self.host_view_us is not None:
            return self.host_view_us
        return self.host_op_us

    def tflops(self, dtype: str | None = None) -> float:
        """Dense peak of a matmul in ``dtype`` (a torch dtype name; None: the planning dtype)."""
        return self.dtype_tflops.get(dtype, self.peak_tflops) if dtype else self.peak_tflops

    def priced_as(self, dtype: str) -> "Profile":
        """This profile with every op's FLOPs priced at ``dtype``'s rate, whatever dtype it was
        traced in: a model traced in float32 that trains under mixed precision (bf16 matmuls over
        float32 master weights). Its own name (``h100-sxm@bfloat16``), so a plan made with it
        carries it. A profile with one rate for every dtype is itself."""
        if not self.dtype_tflops:
            return self
        return replace(self, name=f"{self.name}@{dtype}", peak_tflops=self.tflops(dtype), dtype_tflops={})

    def link(self, intra_node: bool) -> LinkModel:
        return self.intra_node if intra_node else self.inter_node

    def collective_predictor(self, kind: str, group_size: int, intra_node: bool) -> Callable[[float], float]:
        """``bytes -> microseconds`` for ``kind`` on a group of ``group_size`` ranks (see module doc)."""
        if group_size <= 1:
            return lambda b: 0.0
        if kind == "all_to_all" and self.all_to_all_by_gather:
            gather = self.collective_predictor("all_gather", group_size, intra_node)
            return lambda b: gather(b * group_size)  # every rank's whole input, gathered
        exact = [f for f in self.collectives
                 if f.kind == kind and f.intra_node == intra_node and f.group_size == group_size]
        if exact:
            return exact[0].predict_one
        alpha, per_byte = self.fallback_line(kind, group_size, intra_node)
        return lambda b: alpha + b * per_byte if b > 0 else 0.0

    def fallback_line(self, kind: str, group_size: int, intra_node: bool) -> tuple[float, float]:
        """``(alpha us, us per byte)`` for a group size with no fit of its own (rules 2 and 3 of
        the module doc): the nearest measured size's fit rescaled, else the link's constants."""
        same = [f for f in self.collectives if f.kind == kind and f.intra_node == intra_node]
        if same:
            near = min(same, key=lambda f: (abs(math.log(f.group_size / group_size)), f.group))
            link = LinkModel(near.alpha_us, near.busbw_gbps)
        else:
            link = self.link(intra_node)
        return link.line(kind, group_size)

    def samples_frame(self):
        """The raw calibration samples as a pandas DataFrame, one row per timed repeat, with the
        fitted time beside each: ``kind``, ``group``, ``group_size``, ``intra_node``, ``bytes``,
        ``us``, ``predicted_us`` (the profile's prediction for that collective and size)."""
        import pandas as pd

        frame = pd.DataFrame([tuple(x) for x in self.samples],
                             columns=["kind", "group", "group_size", "intra_node", "bytes", "us"])
        predict = {}
        frame["predicted_us"] = [
            predict.setdefault((k, n, i), self.collective_predictor(k, int(n), bool(i)))(float(b))
            for k, n, i, b in zip(frame["kind"], frame["group_size"], frame["intra_node"], frame["bytes"])]
        return frame

    def fits_frame(self):
        """One row per fitted collective: ``kind``, ``group``, ``group_size``, ``intra_node``,
        ``alpha_us``, ``busbw_gbps`` and the number of knots of its monotone correction."""
        import pandas as pd

        return pd.DataFrame([{"kind": f.kind, "group": f.group, "group_size": f.group_size,
                              "intra_node": f.intra_node, "alpha_us": f.alpha_us, "busbw_gbps": f.busbw_gbps,
                              "knots": len(f.knots_bytes)} for f in self.collectives],
                            columns=["kind", "group", "group_size", "intra_node", "alpha_us", "busbw_gbps", "knots"])

    def with_calibration(self, fits, samples, mesh: dict, identity: dict, **changes) -> "Profile":
        return replace(self, collectives=tuple(fits), samples=tuple(samples), mesh=dict(mesh),
                       identity=dict(identity), **changes)

    def merge(self, other: "Profile") -> "Profile":
        """Samples and fits of both (other's win on the same kind and group); same device only."""
        if other.device != self.device:
            raise CostModelError(f"cannot merge profiles of different devices: {self.device!r} and {other.device!r}")
        fits = {(f.kind, f.group): f for f in self.collectives}
        fits.update({(f.kind, f.group): f for f in other.collectives})
        return replace(self, collectives=tuple(fits[k] for k in sorted(fits)),
                       samples=tuple(self.samples) + tuple(other.samples))

    @staticmethod
    def from_json(data: dict) -> "Profile":
        version = data.get("version") if isinstance(data, dict) else None
        if version != PROFILE_VERSION:
            raise CostModelError(f"profile version: expected {PROFILE_VERSION}, found {version!r}")
        from costmodel.jsonfields import fields_of

        fields = fields_of(Profile, {k: v for k, v in data.items() if k != "version"}, "profile")
        fields["collectives"] = tuple(CollectiveFit(**fields_of(CollectiveFit, f, f"profile.collectives[{i}]"))
                                      for i, f in enumerate(fields.get("collectives", ())))
        for key in ("samples", "step_samples"):
            fields[key] = tuple(_sample(x, f"profile.{key}[{i}]") for i, x in enumerate(fields.get(key, ())))
        refinements = fields.get("refinements", ())
        if not all(isinstance(r, dict) for r in refinements):
            raise CostModelError("profile.refinements: expected a list of objects")
        return Profile(**fields)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


def _sample(x, where: str) -> tuple:
    """One calibration sample ``(kind, group, group_size, intra_node, bytes, us)``, checked."""
    ok = (isinstance(x, (list, tuple)) and len(x) == 6 and isinstance(x[0], str) and isinstance(x[1], str)
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                  for v in (x[2], x[4], x[5])) and isinstance(x[3], (bool, int)))
    if not ok:
        raise CostModelError(f"{where}: expected [kind, group, group_size, intra_node, bytes, us], "
                             f"found {json.dumps(x, default=str)[:80]}")
    return tuple(x)


_DIR = Path(__file__).parent / "profiles"


def builtin_profiles() -> list[str]:
    return sorted(p.stem for p in _DIR.glob("*.json"))


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name (see ``builtin_profiles()``) or a profile file by path."""
    path = Path(name_or_path)
    if not path.exists():
        path = _DIR / f"{name_or_path}.json"
        if not path.exists():
            raise FileNotFoundError(
                f"profile {str(name_or_path)!r}: no such file and no shipped profile of that name; "
                f"shipped: {builtin_profiles()}"
            )
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CostModelError(f"{path}: cannot read a profile JSON file: {exc}") from None
    return Profile.from_json(data)
