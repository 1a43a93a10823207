"""Calibration microbenchmarks: measure collectives on the user's own cluster.

For each collective kind, each mesh axis and each flattened group of axes a plan
can use (ascending axis order, as DeviceMesh flattens), a sweep of message sizes:
warm-up, then ``repeats`` timed runs of ``iters`` back-to-back calls; each run's
time is the maximum over ranks (the slowest rank finishes the collective), and a
sample is kept per run. NCCL runs are timed with CUDA events, gloo runs with the
wall clock between barriers. Bytes follow nccl-tests: the full buffer (output of
all_gather, input of reduce_scatter). Rank 0 prints progress; Ctrl-C stops the
sweep and keeps what was measured. A matmul microbenchmark calibrates compute.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import logging
import math
import os
import platform
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from costmodel.collectives import MeshTopology
from costmodel.compute import attention_flops
from costmodel.errors import CostModelError
from costmodel.fit import fit_collective
from costmodel.links import LinkModel
from costmodel.profile import KERNELS, Profile, load_profile

log = logging.getLogger(__name__)

DEFAULT_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass
class CalibrationConfig:
    """What to measure and how hard."""

    kinds: tuple[str, ...] = DEFAULT_KINDS
    """Collectives to sweep."""
    min_bytes: int = 4096
    """Smallest message (full buffer), bytes."""
    max_bytes: int = 64 * 2**20
    """Largest message; also capped by ``memory_fraction`` of free device memory on GPUs."""
    factor: int = 4
    """Size step: each size is ``factor`` times the previous."""
    warmup: int = 2
    """Untimed calls before each size."""
    iters: int = 5
    """Least back-to-back calls per timed run."""
    run_seconds: float = 0.02
    """Each timed run lasts about this long (more calls for small messages): averages out scheduling noise."""
    repeats: int = 3
    """Timed runs per size (one sample each)."""
    flattened: bool = True
    """Also measure every multi-axis group (flattened sub-mesh)."""
    matmul_size: int = 1024
    """Side of the square matmul that calibrates compute efficiency and, beside an all-reduce of
    ``max_bytes``, the overlap share (0: skip both)."""

    def __post_init__(self):
        if not 0 < self.min_bytes <= self.max_bytes:
            raise CostModelError(f"need 0 < min_bytes <= max_bytes, found {self.min_bytes} and {self.max_bytes}")
        if self.factor < 2:
            raise CostModelError(f"factor must be >= 2, found {self.factor}")
        if self.iters < 1 or self.repeats < 1 or self.warmup < 0:
            raise CostModelError("iters and repeats must be >= 1 and warmup >= 0")
        bad = set(self.kinds) - set(DEFAULT_KINDS) - {"broadcast"}
        if bad:
            raise CostModelError(f"unknown collective kinds {sorted(bad)}; expected some of "
                             f"{DEFAULT_KINDS + ('broadcast',)}")

    def sizes(self) -> list[int]:
        out, b = [], self.min_bytes
        while b <= self.max_bytes:
            out.append(int(b))
            b *= self.factor
        return out


def groups_of(axis_names: tuple[str, ...], flattened: bool) -> list[tuple[str, ...]]:
    """Every axis alone, then (optionally) every ascending multi-axis group."""
    groups = [(a,) for a in axis_names]
    if flattened:
        for k in range(2, len(axis_names) + 1):
            groups += list(itertools.combinations(axis_names, k))
    return groups


def message_elems(kind: str, nbytes: int, n: int, itemsize: int) -> int:
    """Elements of the full buffer: a multiple of the group size, at least one per rank."""
    per = max(1, nbytes // (itemsize * n))
    return per * n


@dataclass
class Timer:
    """Seconds per call of a function on ``device``: CUDA events on GPUs, the host clock
    elsewhere (benchmarks time with it as calibration does)."""

    device: torch.device

    def run(self, fn, iters: int) -> float:
        """Seconds per call on this rank."""
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters

    def best(self, fn) -> float:
        """Seconds per call, the best of three runs of three after two warm-up calls."""
        self.run(fn, 2)
        return min(self.run(fn, 3) for _ in range(3))

    def device_best(self, fn, calls: int = 20) -> float:
        """Seconds per call that the device spends, best of three: on a GPU, ``calls`` calls
        captured in a CUDA graph and replayed, so the host's issue (10-17 us an op on the GPU
        nodes seen, more than a small kernel's own time) is not in it; elsewhere :meth:`best`."""
        if self.device.type != "cuda":
            return self.best(fn)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture, as CUDA graphs ask
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        return min(self.run(graph.replay, 3) for _ in range(3)) / calls


def _op(kind: str, elems: int, n: int, dtype, device, group):
    if kind == "all_reduce":
        buf = torch.ones(elems, dtype=dtype, device=device)
        return lambda: dist.all_reduce(buf, group=group)
    if kind == "all_gather":
        out = torch.empty(elems, dtype=dtype, device=device)
        inp = torch.ones(elems // n, dtype=dtype, device=device)
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # renamed in torch 2.13
        return lambda: gather(out, inp, group=group)
    if kind == "reduce_scatter":
        inp = torch.ones(elems, dtype=dtype, device=device)
        out = torch.empty(elems // n, dtype=dtype, device=device)
        scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        return lambda: scatter(out, inp, group=group)
    if kind == "all_to_all":
        inp = torch.ones(elems, dtype=dtype, device=device)
        out = torch.empty(elems, dtype=dtype, device=device)
        return lambda: dist.all_to_all_single(out, inp, group=group)
    if kind == "broadcast":
        buf = torch.ones(elems, dtype=dtype, device=device)
        src = dist.get_global_rank(group, 0)
        return lambda: dist.broadcast(buf, src=src, group=group)
    raise ValueError(kind)


def identity(mesh, backend: str) -> dict:
    dev = mesh.device_type
    name = torch.cuda.get_device_name() if dev == "cuda" else (platform.processor() or platform.machine())
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if dev == "cuda" else None
    return {
        "device_name": name,
        "device_count": dist.get_world_size(),
        "backend": backend,
        "torch": torch.__version__,
        "nccl": nccl,
        "host_hash": hashlib.sha256(socket.gethostname().encode()).hexdigest()[:12],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
    }


@dataclass
class SweepResult:
    samples: list = field(default_factory=list)
    """(kind, group, group_size, intra_node, bytes, us) per timed run."""
    interrupted: bool = False
    matmul_tflops: float | None = None
    """Achieved TFLOP/s of the calibration matmul (side ``matmul_side``) in the planning dtype."""
    matmul_side: int | None = None
    mem_bandwidth_gbps: float | None = None
    """Achieved bandwidth of a large copy (bytes read + written per second / 1e9)."""
    launch_us: float | None = None
    """Time per tiny op: the floor of every op (on a GPU its kernel's time on the device, the
    host's issue apart; on a CPU eager dispatch, issued from Python)."""
    host_op_us: float | None = None
    """GPUs: host time per op that launches a kernel, in a replayed graph (:func:`measure_host_issue`)."""
    host_view_us: float | None = None
    """GPUs: host time per view, in a replayed graph (:func:`measure_host_issue`)."""
    mem_efficiency: dict = field(default_factory=dict)
    """Bandwidth share of each memory access pattern (:func:`measure_mem_patterns`)."""
    overlap: float | None = None
    """Share of a collective that matmuls beside it hid (:func:`measure_overlap`)."""
    other_tflops: dict = field(default_factory=dict)
    """Achieved TFLOP/s of the same matmul in the dtypes other than the planning one (float32 on
    GPUs, under this process's TF32 setting; bfloat16 on CPUs), by dtype name."""
    matmul_sizes: dict = field(default_factory=dict)
    """Achieved TFLOP/s of square matmuls in the planning dtype by side, the calibration size's
    included (:func:`matmul_sides`)."""
    attention_tflops: tuple | None = None
    """Achieved TFLOP/s of fused causal attention's forward and backward in the planning dtype
    (:func:`measure_attention`)."""


#: Sides of the matmuls that calibrate the rate by size, as multiples of ``matmul_size``, by
#: device type: on GPUs from an eighth (a grid too small to fill the SMs) to 4x (the rate still
#: grows past the usual calibration sizes). Not on CPUs: a lone small matmul there runs from
#: cache, which the same matmul inside a step does not (on 4 gloo ranks of 2 cores, 128 and 256
#: timed 2x the rate of 1024, and pricing steps with that curve moved the median prediction
#: error of `benchmarks/fidelity.py` from 0.055 to 0.146, every step predicted low).
MATMUL_SIDE_FACTORS = {"cuda": (1 / 8, 1 / 4, 1 / 2, 1, 2, 4)}


def matmul_sides(n: int, device_type: str) -> list[int]:
    """The sides timed for ``Profile.matmul_shares`` around the calibration side ``n`` (at least
    16); none where the device type is not calibrated by size (:data:`MATMUL_SIDE_FACTORS`)."""
    factors = MATMUL_SIDE_FACTORS.get(device_type)
    if not factors:
        return []
    return sorted({max(16, int(round(n * f))) for f in factors} | {n})


def matmul_shares(rates: dict, n: int) -> dict[str, float]:
    """``Profile.matmul_shares`` from the rate measured at each side: each side's rate over the
    calibration side ``n``'s (itself 1)."""
    base = rates.get(n)
    if not base:
        return {}
    return {str(side): round(rate / base, 4) for side, rate in sorted(rates.items()) if rate > 0}


def kernel_shares(attention_tflops: tuple[float, float], matmul_tflops: float) -> dict[str, float]:
    """``Profile.kernel_shares`` from fused attention's measured forward and backward rates: each
    over the calibration matmul's rate (shares kept within the profile's bounds)."""
    return {kernel: round(min(4.0, max(1e-3, rate / matmul_tflops)), 4)
            for kernel, rate in zip(KERNELS, attention_tflops) if rate > 0}


def measure_matmul(device, n: int, dtype, lockstep: bool = False) -> float:
    """Achieved TFLOP/s of an n x n matmul, best of a few runs, the device's time alone
    (:meth:`Timer.device_best`): inside a step the host runs ahead, and its issue of each op is
    the host stream's, priced apart. ``lockstep``: every rank times it at once, the slowest
    rank's (:func:`lockstep_seconds`), as ranks sharing CPU cores compute in a step."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    timer = Timer(torch.device(device))
    fn = lambda: torch.mm(a, b, out=out)  # noqa: E731
    return 2 * n**3 / (lockstep_seconds(timer, fn) if lockstep else timer.device_best(fn)) / 1e12


#: Shape of the attention that calibrates ``Profile.kernel_shares`` by device type: (batch,
#: heads, sequence, head dim), causal. A GPU's is a LLaMA-shaped layer's (head dim 128) at a
#: sequence people train at; a CPU's is small enough for a CI machine.
ATTENTION_SHAPES = {"cuda": (2, 16, 4096, 128), "cpu": (2, 4, 512, 64)}


def measure_attention(device, dtype, lockstep: bool = False) -> tuple[float, float]:
    """Achieved TFLOP/s of fused causal attention (``F.scaled_dot_product_attention``: flash on
    GPUs, torch's flash kernel for CPUs), forward and backward, FLOPs counted as the planner
    counts them (:func:`costmodel.compute.attention_flops`), at :data:`ATTENTION_SHAPES`. The
    backward's time is a forward and backward less a forward."""
    import torch.nn.functional as F

    b, h, n, e = ATTENTION_SHAPES.get(torch.device(device).type, ATTENTION_SHAPES["cpu"])
    q, k, v = (torch.randn(b, h, n, e, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, h, n, e, device=device, dtype=dtype)
    timer = Timer(torch.device(device))

    def forward():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def both():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)

    seconds = (lambda fn: lockstep_seconds(timer, fn)) if lockstep else timer.best
    fwd_s, both_s = seconds(forward), seconds(both)
    bwd_s = max(both_s - fwd_s, 1e-9)
    return (attention_flops(b, h, n, n, e, e, True, False) / fwd_s / 1e12,
            attention_flops(b, h, n, n, e, e, True, True) / bwd_s / 1e12)


def measure_bandwidth(device, nbytes: int, lockstep: bool = False) -> float:
    """Achieved GB/s of an ``nbytes`` copy (its bytes read and written), best of a few runs
    (``lockstep``: :func:`lockstep_seconds`)."""
    src = torch.ones(max(1, nbytes // 4), device=device)
    dst = torch.empty_like(src)
    timer = Timer(torch.device(device))
    fn = lambda: dst.copy_(src)  # noqa: E731
    return 2 * src.numel() * 4 / (lockstep_seconds(timer, fn) if lockstep else timer.best(fn)) / 1e9


def lockstep_seconds(timer: Timer, fn, seconds: float = 0.3, runs: int = 3) -> float:
    """Seconds per call with every rank calling ``fn`` at once: the slowest rank's, median of
    ``runs`` runs of about ``seconds`` each. Ranks that share CPU cores contend in a step as they
    do here; the best of a few runs on each rank alone (what :meth:`Timer.best` gives) catches
    moments when the others were idle: on 4 gloo ranks over 2 cores the calibrated float32
    matmul rate varied 2x between runs (0.052-0.104 TFLOP/s) and steps measured 1.3-1.8x the
    compute it priced."""
    timer.run(fn, 2)
    one = torch.tensor([timer.run(fn, 1)], dtype=torch.float64, device=timer.device)
    dist.all_reduce(one, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
    iters = max(1, min(1000, int(seconds / max(float(one.item()), 1e-7))))
    return statistics.median(_slowest(timer, fn, iters) for _ in range(runs))


def measure_mem_patterns(device, dtype, rows: int, cols: int) -> dict[str, float]:
    """The bandwidth each access pattern of ``Profile.mem_efficiency`` reaches (bytes read and
    written per second, as the planner counts them) as a share of a contiguous copy's in
    ``dtype``, on a ``rows`` x ``cols`` tensor, best of a few runs: ``broadcast`` a multiply by
    a row of ``cols``, ``reduction`` a sum over the last dim, ``outer_reduction`` a sum over the
    first, ``normalize`` a softmax over the last, ``strided`` a permute that keeps the last dim
    (attention heads: rows x (cols/64) x 64 to (cols/64) x rows x 64) made contiguous,
    ``transposed`` a transpose made contiguous, ``scatter`` an embedding's gradient (the rows
    accumulated into an eighth as many at random indices)."""
    x = torch.randn(rows, cols, device=device, dtype=dtype)
    w = torch.randn(cols, device=device, dtype=dtype)
    out, out_t = torch.empty_like(x), torch.empty(cols, rows, device=device, dtype=dtype)
    timer = Timer(torch.device(device))

    def rate(fn, nbytes: int) -> float:
        return nbytes / timer.best(fn)

    size = x.numel() * x.element_size()
    copy = rate(lambda: out.copy_(x), 2 * size)
    table = max(1, rows // 8)
    idx = torch.randint(0, table, (rows,), device=device)
    rates = {"broadcast": rate(lambda: torch.mul(x, w, out=out), 2 * size),
             "reduction": rate(lambda: x.sum(-1), size + size // cols),
             "outer_reduction": rate(lambda: x.sum(0), size + size // rows),
             "scatter": rate(lambda: torch.ops.aten.embedding_dense_backward(x, idx, table, -1, False),
                             size + idx.numel() * idx.element_size() + table * cols * x.element_size()),
             "normalize": rate(lambda: torch.softmax(x, -1), 2 * size),
             "strided": rate(lambda: out.view(-1, rows, 64).copy_(x.view(rows, -1, 64).transpose(0, 1)), 2 * size),
             "transposed": rate(lambda: out_t.copy_(x.t()), 2 * size)}
    return {k: min(2.0, max(1e-3, r / copy)) for k, r in rates.items()}


def measure_launch_us(device, iters: int = 200) -> float:
    """Microseconds per one-element op, best of a few runs: the floor of every op. On a GPU the
    device's time alone (:meth:`Timer.device_best`): the host's issue is ``host_op_us``, priced
    apart. On a CPU issued from Python (eager dispatch: the CPU is its own host)."""
    x = torch.zeros(1, device=device)
    timer = Timer(torch.device(device))
    if timer.device.type == "cuda":
        return timer.device_best(lambda: x.add_(1), calls=100) * 1e6
    timer.run(lambda: x.add_(1), 20)
    return min(timer.run(lambda: x.add_(1), iters) for _ in range(3)) * 1e6


def _tiny_training_step(params, x):
    """Forward and backward of a few decoder blocks (norm, attention, gated MLP) at toy width:
    the mix of ops, views and getitems a lowered training program replays."""
    wq, wo, w1, w3, w2, g = params
    b, s, d = x.shape
    h = x
    for _ in range(2):
        n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * g
        q = (n @ wq).view(b, s, 2, d // 2).transpose(1, 2)
        a = torch.softmax(q @ q.transpose(-2, -1) / 2.0, -1) @ q
        h = h + a.transpose(1, 2).reshape(b, s, d) @ wo
        h = h + (torch.nn.functional.silu(n @ w1) * (n @ w3)) @ w2
    return torch.autograd.grad(h.float().mean(), params)


def view_chain(x):
    """Views only (each aliases the last): the host's issue of a view, replayed."""
    for _ in range(40):
        x = x.unsqueeze(0).squeeze(0).transpose(0, 1).transpose(0, 1).view(2, -1, x.shape[-1])[0:2].view(x.shape)
    return x


def _replay_us(gm, args, device) -> float:
    """Microseconds per replay of ``gm``: median of five runs of about 50 ms (a shared host's
    speed wanders: the median is what a step sees)."""
    timer = Timer(torch.device(device))
    one = timer.run(lambda: gm(*args), 3)
    iters = max(3, min(1000, int(0.05 / max(one, 1e-6))))
    runs = sorted(timer.run(lambda: gm(*args), iters) for _ in range(5))
    return runs[2] * 1e6


def measure_host_issue(device) -> tuple[float, float]:
    """(kernel, view): microseconds the host takes to issue an op that launches a kernel and a
    view (``Profile.host_op_us``, ``Profile.host_view_us``), in graphs of aten ops replayed as a
    lowered program is. A chain of views (:func:`view_chain`) times a view; a training step at
    toy width (:func:`_tiny_training_step`, forward and backward as one graph), whose ops a GPU
    finishes sooner than the next is issued, times the rest, less its views. ``getitem`` nodes
    count as free (:func:`costmodel.ops.host_kind`)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from costmodel.ops import host_kind

    def kinds(gm) -> dict[str, int]:
        out = {"free": 0, "view": 0, "kernel": 0}
        for n in gm.graph.nodes:
            if n.op == "call_function":
                out[host_kind(n.target)] += 1
        return out

    x = torch.randn(8, 16, device=device)
    chain = make_fx(view_chain)(x)
    c = kinds(chain)
    view_us = _replay_us(chain, (x,), device) / max(1, c["view"] + c["kernel"])
    d = 16
    params = [torch.randn(*shape, device=device, requires_grad=True)
              for shape in ((d, d), (d, d), (d, 2 * d), (d, 2 * d), (2 * d, d), (d,))]
    x = torch.randn(2, 8, d, device=device)
    step = make_fx(_tiny_training_step)(params, x)
    k = kinds(step)
    total = _replay_us(step, (params, x), device)
    # Noise could leave the kernels less than the views: an op that launches is never cheaper.
    kernel_us = max(view_us, (total - k["view"] * view_us) / max(1, k["kernel"]))
    return kernel_us, view_us


def _slowest(timer: Timer, fn, iters: int) -> float:
    """Seconds per call of ``fn`` on the slowest rank, every rank starting together."""
    world = dist.group.WORLD
    dist.barrier(group=world)
    t = torch.tensor([timer.run(fn, iters)], dtype=torch.float64, device=timer.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world)
    return float(t.item())


def overlap_share(compute_s: float, comm_s: float, both_s: float) -> float:
    """The share of what perfect overlap would hide that running both at once hid: compute and a
    collective take ``compute_s`` and ``comm_s`` alone and ``both_s`` together, perfect overlap
    ``max`` of the two (it hides the shorter), none their sum. Clipped to [0, 1] (noise)."""
    hideable = min(compute_s, comm_s)
    if hideable <= 0:
        return 0.0
    return min(1.0, max(0.0, (compute_s + comm_s - both_s) / hideable))


#: Matmuls beside the collective while its overlap is measured: at least this many, so that the
#: share's denominator (the shorter of compute and collective) is the collective's whole time.
OVERLAP_MATMULS = 4


def overlap_side(side: int, one_mm_s: float, comm_s: float) -> int:
    """The side of the matmuls to run beside a collective of ``comm_s`` seconds, given that one of
    ``side`` takes ``one_mm_s``: ``side`` where ``OVERLAP_MATMULS`` of them fit in the
    collective's time, else scaled down (a matmul's time goes with its side cubed) to where they
    do, a multiple of 64, at least 64. With one matmul outlasting the collective (gloo's 4 MiB
    all-reduce took 6 ms, a 1024 float32 matmul on a CPU core 41 ms), the share's few hideable
    milliseconds sat under the noise of the matmul's own, and the share measured 0-0.94 from
    run to run on the same machine."""
    if one_mm_s <= 0 or comm_s <= 0 or OVERLAP_MATMULS * one_mm_s <= comm_s:
        return side
    scaled = side * (comm_s / (OVERLAP_MATMULS * one_mm_s)) ** (1 / 3)
    return max(64, min(side, 64 * int(scaled // 64)))


def measure_overlap(device, nbytes: int, matmul_n: int, dtype, repeats: int = 5) -> float:
    """:func:`overlap_share` of an all-reduce of ``nbytes`` on every rank, started without
    waiting, beside matmuls that take about as long together, at least ``OVERLAP_MATMULS`` of
    them (of side ``matmul_n``, or smaller where that many do not fit: :func:`overlap_side`),
    timed alone and together on every rank at once; the slowest rank's times, median over
    ``repeats``."""
    world = dist.group.WORLD
    timer = Timer(device)
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)

    def comm():
        dist.all_reduce(buf, group=world)

    _slowest(timer, comm, 2)
    comm_s = _slowest(timer, comm, 3)
    side, one_mm = matmul_n, None
    for _ in range(3):  # the cube law is rough on CPUs: scale again from the side measured
        a = torch.randn(side, side, device=device, dtype=dtype)
        b = torch.randn(side, side, device=device, dtype=dtype)
        one_mm = _slowest(timer, lambda: a @ b, 3)
        smaller = overlap_side(side, one_mm, comm_s)
        if smaller == side:
            break
        side = smaller
    k = max(1, round(comm_s / max(one_mm, 1e-9)))

    def compute():
        for _ in range(k):
            a @ b

    def both():
        work = dist.all_reduce(buf, group=world, async_op=True)
        compute()
        work.wait()

    shares = []
    for _ in range(repeats):
        c, m, t = _slowest(timer, compute, 2), _slowest(timer, comm, 2), _slowest(timer, both, 2)
        shares.append(overlap_share(c, m, t))
    return sorted(shares)[len(shares) // 2]


def sweep(mesh, cfg: CalibrationConfig, devices_per_node: int) -> SweepResult:
    """Run the microbenchmarks on ``mesh`` (every rank calls this; rank 0 logs progress)."""
    rank = dist.get_rank()
    say = log.info if rank == 0 else (lambda _m: None)
    names = tuple(mesh.mesh_dim_names or [f"axis{k}" for k in range(mesh.ndim)])
    topo = MeshTopology(tuple(mesh.shape), devices_per_node)
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" \
        else torch.device("cpu")
    dtype = torch.float32
    itemsize = 4
    timer = Timer(device)
    from costmodel._torch_compat import flattened_group

    groups = groups_of(names, cfg.flattened)
    # A group of one rank moves no data: what it would time is a local copy, not a link.
    alone = [g for g in groups if math.prod(mesh.shape[names.index(a)] for a in g) == 1]
    if alone:
        say(f"skipping groups of one rank (no communication to time): {', '.join('+'.join(g) for g in alone)}")
    groups = [g for g in groups if g not in alone]
    plan = [(g, kind, size) for g in groups for kind in cfg.kinds for size in cfg.sizes()]
    result = SweepResult()
    world = dist.group.WORLD
    t_start = time.perf_counter()
    try:
        if cfg.matmul_size:
            gpu = device.type == "cuda"
            planning, other = (torch.bfloat16, torch.float32) if gpu else (torch.float32, torch.bfloat16)
            # The device's time alone: an op's issue is the host stream's, priced apart
            # (``host_op_us``). Timed from the host, an H200's 1024^3 bf16 matmul ran at 140
            # TFLOP/s, its issue; on the device at 390.
            # Ranks that share the host's cores (a CPU mesh) contend in a step: timed all at once.
            lockstep = not gpu and dist.get_world_size() > 1
            result.matmul_tflops = measure_matmul(device, cfg.matmul_size, planning, lockstep)
            result.matmul_side = cfg.matmul_size
            say(f"matmul {cfg.matmul_size}^3: {result.matmul_tflops:.3f} TFLOP/s")
            result.matmul_sizes = {side: result.matmul_tflops if side == cfg.matmul_size
                                   else measure_matmul(device, side, planning, lockstep)
                                   for side in matmul_sides(cfg.matmul_size, device.type)}
            if result.matmul_sizes:
                say("matmul rate by side: " + ", ".join(f"{side} {rate:.3f}"
                                                        for side, rate in result.matmul_sizes.items()) + " TFLOP/s")
            result.attention_tflops = measure_attention(device, planning, lockstep)
            say(f"fused attention: forward {result.attention_tflops[0]:.3f}, backward "
                f"{result.attention_tflops[1]:.3f} TFLOP/s")
            name = str(other).removeprefix("torch.")
            result.other_tflops[name] = measure_matmul(device, cfg.matmul_size, other, lockstep)
            say(f"matmul {cfg.matmul_size}^3 in {name}: {result.other_tflops[name]:.3f} TFLOP/s")
            # Every rank at once, as in a step: on shared CPU cores the contention is the point.
            result.mem_bandwidth_gbps = measure_bandwidth(device, (512 if gpu else 32) * 2**20, lockstep)
            result.launch_us = measure_launch_us(device)
            say(f"copy bandwidth {result.mem_bandwidth_gbps:.1f} GB/s, {result.launch_us:.1f} us per op")
            result.mem_efficiency = measure_mem_patterns(device, planning, 8192 if gpu else 2048,
                                                         4096 if gpu else 1024)
            say("bandwidth shares by access pattern: "
                + ", ".join(f"{k} {v:.2f}" for k, v in result.mem_efficiency.items()))
            if gpu:  # a CPU device is its own host: its ops' times hold their issue
                result.host_op_us, result.host_view_us = measure_host_issue(device)
                say(f"host: {result.host_op_us:.1f} us to issue an op of a replayed graph, "
                    f"{result.host_view_us:.1f} us a view")
            if dist.get_world_size() > 1:
                result.overlap = measure_overlap(device, cfg.max_bytes, cfg.matmul_size, planning)
                say(f"overlap: matmuls beside an all-reduce of {cfg.max_bytes / 2**20:.1f} MiB hid "
                    f"{result.overlap:.0%} of what perfect overlap would")
            else:
                say("overlap: one rank has no collective to overlap; the base profile's share is kept")
        pgs = {g: flattened_group(mesh, g) for g in groups}
        for k, (g, kind, size) in enumerate(plan):
            axes = tuple(names.index(a) for a in g)
            n = math.prod(mesh.shape[a] for a in axes)
            pg = pgs[g]
            elems = message_elems(kind, size, n, itemsize)
            nbytes = elems * itemsize
            fn = _op(kind, elems, n, dtype, device, pg)
            for _ in range(cfg.warmup):
                fn()
            # All ranks agree on the number of calls: from the slowest rank's single-call time.
            one = torch.tensor([timer.run(fn, 1)], dtype=torch.float64, device=device)
            dist.all_reduce(one, op=dist.ReduceOp.MAX, group=world)
            iters = max(cfg.iters, min(2000, int(cfg.run_seconds / max(float(one.item()), 1e-7))))
            for _ in range(cfg.repeats):
                us = _slowest(timer, fn, iters) * 1e6
                result.samples.append((kind, "+".join(g), n, topo.group_is_intra_node(axes), nbytes, us))
            last = result.samples[-1][-1]
            say(f"[{k + 1}/{len(plan)}] {kind:<14} {'+'.join(g):<10} n={n:<4} {nbytes / 2**20:9.3f} MiB "
                f"{last:10.1f} us  ({time.perf_counter() - t_start:.0f}s)")
    except KeyboardInterrupt:
        result.interrupted = True
        say(f"interrupted: keeping {len(result.samples)} samples")
    return result


def build_profile(result: SweepResult, mesh, base: Profile, backend: str, devices_per_node: int,
                  name: str | None = None) -> Profile:
    """Fit every measured (kind, group) and fold the fits into ``base``."""
    by_key: dict = {}
    for kind, group, n, intra, nbytes, us in result.samples:
        by_key.setdefault((kind, group, n, intra), []).append((nbytes, us))
    fits = []
    for (kind, group, n, intra), pts in sorted(by_key.items()):
        b, t = zip(*pts)
        fits.append(fit_collective(kind, group, n, intra, b, t))
    changes = {"devices_per_node": devices_per_node}
    # The fallback constants come from the measured all_reduces of each link class.
    for intra, key in ((True, "intra_node"), (False, "inter_node")):
        ar = [f for f in fits if f.kind == "all_reduce" and f.intra_node == intra]
        if ar:
            big = max(ar, key=lambda f: f.group_size)
            changes[key] = LinkModel(latency_us=big.alpha_us, busbw_gbps=min(big.busbw_gbps, 1e6))
    if result.mem_bandwidth_gbps:
        changes["mem_bandwidth_gbps"] = result.mem_bandwidth_gbps
    if result.launch_us:
        changes["kernel_launch_us"] = result.launch_us
    if result.host_op_us:
        changes["host_op_us"] = result.host_op_us
    if result.host_view_us is not None:
        changes["host_view_us"] = result.host_view_us
    if mesh.device_type == "cpu":  # DTensor gathers in place of an all_to_all there
        changes["all_to_all_by_gather"] = True
    if result.mem_efficiency:
        changes["mem_efficiency"] = dict(result.mem_efficiency)
    if result.overlap is not None:
        changes["overlap"] = result.overlap
    if result.matmul_tflops:
        if mesh.device_type == "cpu":
            changes.update(peak_tflops=result.matmul_tflops, compute_efficiency=1.0)
        else:
            changes["compute_efficiency"] = min(1.0, result.matmul_tflops / base.peak_tflops)
        # A peak per dtype such that peak * efficiency is the rate measured in that dtype.
        eff = changes["compute_efficiency"]
        changes["dtype_tflops"] = {**base.dtype_tflops,
                                   **{d: r / eff for d, r in result.other_tflops.items() if r > 0}}
        if result.attention_tflops:
            changes["kernel_shares"] = kernel_shares(result.attention_tflops, result.matmul_tflops)
        shares = matmul_shares(result.matmul_sizes, result.matmul_side)
        if len(shares) > 1:
            changes["matmul_shares"] = shares
    mesh_info = {"shape": list(mesh.shape), "axis_names": list(mesh.mesh_dim_names or [])}
    ident = identity(mesh, backend)
    ident["interrupted"] = result.interrupted
    return base.with_calibration(fits, result.samples, mesh_info, ident,
                                 name=name or f"calibrated-{ident['device_name'] or backend}"[:64],
                                 source=f"autoshard calibrate on {ident['date']}", **changes)


def shipped_profile_name(device_name: str) -> str:
    """The shipped profile a GPU of this name (``torch.cuda.get_device_name()``) starts from."""
    name = device_name.lower()
    for key, prof in (("h200", "h200"), ("h100", "h100-sxm"), ("a100", "a100-sxm"), ("b200", "b200")):
        if key in name:
            return prof
    return "h100-sxm"


def base_profile_for(device_type: str) -> Profile:
    if device_type == "cpu":
        return load_profile("cpu-gloo")
    try:
        return load_profile(shipped_profile_name(torch.cuda.get_device_name()))
    except FileNotFoundError:
        return load_profile("h100-sxm")


def _progress_to_stderr() -> None:
    """A calibration rank runs in its own process (torchrun, or spawned): unless the program
    configured logging, progress goes to stderr, one ``[calibrate]`` line per step."""
    logger = logging.getLogger("costmodel")
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[calibrate] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def worker(mesh_shape, axis_names, backend: str, cfg: CalibrationConfig, output: str | None,
           devices_per_node: int | None = None, name: str | None = None) -> Profile | None:
    """Everything one rank does: mesh, sweep, and (rank 0) fit and write."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if math.prod(mesh_shape) != world:
        raise CostModelError(f"mesh {tuple(mesh_shape)} has {math.prod(mesh_shape)} ranks "
                             f"but the world size is {world}")
    device_type = "cuda" if backend == "nccl" else "cpu"
    if device_type == "cpu":
        torch.set_num_threads(threads_per_rank(world))
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
    mesh = init_device_mesh(device_type, tuple(mesh_shape), mesh_dim_names=tuple(axis_names))
    dpn = devices_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    _progress_to_stderr()
    result = sweep(mesh, cfg, dpn)
    if dist.get_rank() != 0:
        return None
    profile = build_profile(result, mesh, base_profile_for(device_type), backend, dpn, name=name)
    if output:
        profile.save(output)
        log.info(f"wrote {output}: {len(profile.collectives)} fits from {len(profile.samples)} samples")
    return profile


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank(world: int) -> int:
    """Intra-op threads per CPU rank: the host's cores shared out among the local ranks (more
    threads than cores turns timings into noise)."""
    return max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def _in_process_group(rank, world, port, backend, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()
    exit_rank(0)


def exit_rank(code: int) -> None:
    """End a rank process whose work is done, skipping the interpreter's finalization.

    At exit, C++ static destructors run; with gloo, one of them now and then meets a
    still-joinable native thread and the rank dies of SIGABRT ("terminate called without an
    active exception", faulthandler: "<no Python frame>") after its work is done, which
    fails the whole command or torchrun job: 3 of 25 runs of `autoshard measure --nproc 2`
    on this 2-core machine, 0 of 20 with this exit. Logs and streams are flushed first. Only
    for a process that is a rank and nothing else (a spawned child, the CLI under torchrun);
    a Python error does not come here and keeps its traceback."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_torchrun_rank() -> bool:
    """Whether this process is a rank that torchrun (or another launcher) started."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_distributed(fn, args: tuple, backend: str, nproc: int | None, command: str) -> None:
    """``fn(*args)`` on every rank of a process group: this process's, under torchrun (its
    environment set), or ``nproc`` spawned local processes' (``fn`` picklable: module level)."""
    import torch.multiprocessing as mp

    if is_torchrun_rank():
        if not dist.is_initialized():
            dist.init_process_group(backend)
        try:
            fn(*args)
        finally:
            dist.destroy_process_group()
        return
    if not nproc:
        raise CostModelError(f"not under torchrun: pass --nproc N to spawn N local processes "
                             f"(or run `torchrun --nproc-per-node N -m autoshard {command} ...`)")
    mp.start_processes(_in_process_group, args=(nproc, free_port(), backend, fn, args), nprocs=nproc,
                       start_method="spawn")


def check_backend(backend: str) -> None:
    if backend == "nccl":
        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise CostModelError("backend 'nccl' needs CUDA GPUs and an NCCL build of torch; found "
                             f"cuda available={torch.cuda.is_available()}: use --backend gloo on CPUs")
    elif backend == "gloo":
        if not dist.is_gloo_available():
            raise CostModelError("backend 'gloo' is not available in this torch build")
    else:
        raise CostModelError(f"backend must be 'nccl' or 'gloo', found {backend!r}")


def run(mesh_shape, axis_names, backend: str, cfg: CalibrationConfig, output: str | None,
        nproc: int | None = None, name: str | None = None) -> None:
    """Calibrate under torchrun (env set), or spawn ``nproc`` local processes."""
    check_backend(backend)
    if nproc and math.prod(mesh_shape) != nproc:
        raise CostModelError(f"mesh {tuple(mesh_shape)} has {math.prod(mesh_shape)} ranks but --nproc is {nproc}")
    run_distributed(worker, (tuple(mesh_shape), tuple(axis_names), backend, cfg, output, None, name), backend, nproc,
                    "calibrate")
