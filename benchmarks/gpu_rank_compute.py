"""Predicted against measured compute of one rank of sharded plans, on one GPU: the pieces a
tensor-parallel or data-parallel rank runs (thin matmuls included), where ``gpu_fidelity.py``
checks only whole models on a mesh of one.

    python benchmarks/gpu_rank_compute.py export --out progs.pt        # where the planner runs
    python benchmarks/gpu_rank_compute.py measure --programs progs.pt [--ops] \\
        --json measured.json                                             # on the GPU node
    python benchmarks/gpu_rank_compute.py predict --programs progs.pt --measured measured.json \\
        --profile calibrated.json           # the GPU calibrated in the same run (gpu_fidelity.py measure)

``export`` plans each model on a fake mesh (ours and the hand-written plans, as
``Planner.compare`` gives them), lowers rank 0's forward and backward programs (local aten ops
and functional collectives, after the executor's bucketing and overlap passes) and writes them
as Python source with every collective replaced by an empty tensor of its output's shape (so
the programs run on one GPU, with any torch that has the aten ops: the GPU node's torch may
predate the planner's). It also lists every distinct matmul of the programs (op, operand shapes
and strides).

``measure`` (torch and CUDA only) times each program with CUDA events after warm-up (median of
``--steps``) and each distinct matmul alone.

``predict`` prices the same programs by the executor's estimator (:class:`autoshard.runtime.passes.Estimator`,
the simulation's walk of host, compute and communication streams, collectives free as on the
GPU) under the calibrated profile ``--measured`` carries, with and without its matmul curve
(``Profile.matmul_shares``): per program and per matmul, predicted over measured. Last line: the
median |predicted/measured - 1| of the programs with the curve and without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: name -> (config overrides, batch, seq, mesh shape, axis names)
MODELS = {
    "llama2048": (dict(dim=2048, n_layers=2, n_heads=16, n_kv_heads=8, ffn_dim=5632, vocab_size=32000),
                  8, 1024, (2, 4), ("dp", "tp")),
    "llama4096": (dict(dim=4096, n_layers=1, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000),
                  8, 2048, (1, 8), ("dp", "tp")),
}
PLANS = ("autoshard", "ddp", "fsdp", "tp", "fsdp_tp")
#: Dtype of every model (the planner prices bf16 at the profile's bf16 rate).
DTYPE = torch.bfloat16


def _collective_targets():
    f = torch.ops._c10d_functional
    return {f.all_reduce.default, f.all_gather_into_tensor.default, f.reduce_scatter_tensor.default,
            f.all_to_all_single.default, f.broadcast.default}


def strip_collectives(gm, int_high: int = 1):
    """``gm`` with each functional collective an empty tensor of its output's shape and stride
    (allocated like its input; integers drawn from [0, ``int_high``): gathered token ids index
    embeddings) and each wait the value waited for: the program's compute alone."""
    import torch.fx as fx

    f = torch.ops._c10d_functional
    collectives = _collective_targets()
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        if n.target is f.wait_tensor.default:
            n.replace_all_uses_with(n.args[0])
            g.erase_node(n)
        elif n.target is f.all_gather_into_tensor_out.default:
            n.replace_all_uses_with(n.kwargs["out"])
            g.erase_node(n)
        elif n.target in collectives:
            val = n.meta["val"]
            with g.inserting_before(n):
                empty = g.call_function(torch.ops.aten.new_empty_strided.default,
                                        (n.args[0], tuple(val.shape), tuple(val.stride())))
                empty.meta.update(val=val, standin=True)
                if not val.dtype.is_floating_point and val.dtype != torch.bool:
                    empty = g.call_function(torch.ops.aten.randint_like.low_dtype, (empty, 0, int_high))
                    empty.meta.update(val=val, standin=True)
            n.replace_all_uses_with(empty)
            g.erase_node(n)
    g.eliminate_dead_code()
    gm.recompile()
    return fx.GraphModule(gm, g)


def _inputs_meta(gm) -> list[dict]:
    out = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            v = n.meta.get("val")
            out.append(None if not isinstance(v, torch.Tensor) else
                       {"shape": list(v.shape), "stride": list(v.stride()), "dtype": str(v.dtype).split(".")[-1]})
    return out


def _matmul(n) -> dict | None:
    """Node ``n`` as a matmul to time alone (op, operand shapes and strides, dtype), or None."""
    from autoshard.graph.pricing import matmul_operands

    if n.op != "call_function" or matmul_operands(n) is None:
        return None
    args = [a.meta["val"] for a in n.args if hasattr(a, "meta")]
    return {"op": n.target.__name__.split(".")[0], "shapes": [list(a.shape) for a in args],
            "strides": [list(a.stride()) for a in args], "dtype": str(args[-1].dtype).split(".")[-1]}


def _matmuls(gm) -> list[dict]:
    return [mm for mm in map(_matmul, gm.graph.nodes) if mm is not None]


def _model(name: str):
    from autoshard.models import llama

    cfg, batch, seq, _, _ = MODELS[name]
    torch.manual_seed(0)
    model = llama("tiny", max_seq_len=seq, **cfg).to(DTYPE)
    return model, (torch.randint(0, cfg["vocab_size"], (batch, seq)),)


def programs(name: str, plans: dict):
    """plan name -> rank 0's planned program of model ``name`` under that plan
    (``autoshard.runtime.program.PlannedProgram``, scheduled by the plan's own profile)."""
    import autoshard
    from autoshard._torch_compat import quiet_tracing
    from autoshard.graph.tracing import trace
    from autoshard.runtime.program import PlannedProgram

    _, _, _, shape, axes = MODELS[name]
    model, inputs = _model(name)
    mesh = autoshard.fake_mesh(shape, axes)
    with quiet_tracing():
        tg = trace(model, inputs)
    return {plan_name: PlannedProgram(tg, plan, mesh) for plan_name, plan in plans.items()}


def plan_all(name: str, profile: str) -> dict:
    """Ours and the hand-written plans of model ``name`` on its mesh: plan name -> Plan."""
    import autoshard

    _, _, _, shape, axes = MODELS[name]
    model, inputs = _model(name)
    found = autoshard.Planner(model, inputs, autoshard.fake_mesh(shape, axes), profile=profile,
                              time_limit=30).compare([p for p in PLANS if p != "autoshard"])
    plans = {}
    for plan_name in PLANS:
        plan = found.get(plan_name)
        if plan is None or isinstance(plan, str):
            print(f"{name}/{plan_name}: not planned ({plan})", flush=True)
            continue
        plans[plan_name] = plan
    return plans


def export(args) -> None:
    out = {"plans": {}, "programs": {}}
    for name in args.models.split(","):
        plans = plan_all(name, args.profile)
        out["plans"][name] = {k: p.to_json() for k, p in plans.items()}
        high = _int_high(name)
        for plan_name, program in programs(name, plans).items():
            parts = {}
            for part, prog in (("forward", program.forward_program(0)), ("backward", program.backward_program(0))):
                gm = strip_collectives(prog.gm, high)
                consts = {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
                parts[part] = {"code": gm.code, "inputs": _inputs_meta(gm), "consts": consts,
                               "matmuls": _matmuls(gm), "int_high": high}
            key = f"{name}/{plan_name}"
            out["programs"][key] = parts
            print(f"{key}: forward {len(parts['forward']['code'].splitlines())} lines, backward "
                  f"{len(parts['backward']['code'].splitlines())}", flush=True)
    torch.save(out, args.out)
    print(f"wrote {args.out}")


def _int_high(name: str) -> int:
    """Token ids below this index every rank's piece of the vocabulary."""
    cfg, _, _, shape, _ = MODELS[name]
    return cfg["vocab_size"] // math.prod(shape)


def load(part: dict, device, scope: dict | None = None):
    """The exported program's ``forward`` on ``device``, its constants bound; ``scope``: more
    names its code calls."""
    scope = {"torch": torch, "device": torch.device, "inf": float("inf"), "nan": float("nan"), **(scope or {})}
    code = part["code"].replace("device(type='cpu')", f"device(type='{device.type}')")
    exec(compile(code, "<program>", "exec"), scope)
    owner = type("Owner", (), {})()
    for k, v in part["consts"].items():
        setattr(owner, k, v.to(device))
    return functools.partial(scope["forward"], owner)


def _program(part: dict, device):
    """The exported program as a callable, and its inputs on ``device``."""
    fn = load(part, device)
    gen = torch.Generator(device=device).manual_seed(0)
    inputs = [None if m is None else _filled(m, device, gen, part["int_high"]) for m in part["inputs"]]
    return (lambda: fn(*inputs)), inputs


def _filled(m: dict, device, gen, int_high: int) -> torch.Tensor:
    """A tensor of ``m``'s shape, stride and dtype: small normal floats, integers in [0, ``int_high``)."""
    dtype = getattr(torch, m["dtype"])
    # Filled through a flat base: a saved value may be an expanded view (stride 0).
    span = 1 + sum((n - 1) * st for n, st in zip(m["shape"], m["stride"]) if n > 0)
    t = torch.empty(span if all(m["shape"]) else 0, dtype=dtype, device=device)
    if dtype.is_floating_point:
        t.normal_(0, 0.02, generator=gen)
    elif dtype == torch.bool:
        t.fill_(False)
    else:
        t.random_(0, max(1, int_high), generator=gen)
    return t.as_strided(m["shape"], m["stride"])


def _timed(fn, steps: int, warmup: int, sync, event) -> float:
    """Median seconds of ``fn`` over ``steps`` runs after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        sync()
        start, end = event(), event()
        start.record()
        fn()
        end.record()
        sync()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _matmul_fn(mm: dict, device):
    """A call of the matmul ``mm`` describes, on operands made here."""
    gen = torch.Generator(device=device).manual_seed(0)
    args = [_filled({"shape": s, "stride": st, "dtype": mm["dtype"]}, device, gen, 1)
            for s, st in zip(mm["shapes"], mm["strides"])]
    op = getattr(torch.ops.aten, mm["op"]).default
    return lambda: op(*args)


def _mm_key(mm: dict) -> str:
    return f"{mm['op']} {mm['shapes']} {mm['strides']} {mm['dtype']}"


def _device_us_by_op(fn, runs: int = 3) -> dict[str, float]:
    """Device microseconds per run of ``fn`` by aten op the program calls, from torch.profiler
    over ``runs`` runs: each top-level op's kernels, those of the ops it calls inside included
    (a clone's copy is the clone's), as the estimator prices a program's node."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for evt in prof.events():
        parent = evt.cpu_parent
        if evt.name.startswith("aten::") and (parent is None or not parent.name.startswith("aten::")):
            us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
            out[evt.name] = out.get(evt.name, 0.0) + us / runs
    return {k: v for k, v in out.items() if v > 0}


class _HostEvent:
    """``torch.cuda.Event``'s two methods on the host clock (``--device cpu``: a dry run of
    ``measure`` where no GPU is)."""

    def record(self):
        import time

        self.t = time.perf_counter()

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3


def measure(args) -> None:
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_rank_compute measure needs a CUDA GPU (--device cpu: a dry run on the host)")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def event():
        return torch.cuda.Event(enable_timing=True) if cuda else _HostEvent()

    exported = torch.load(args.programs, weights_only=False)["programs"]
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "programs_s": {}, "matmuls_s": {}}
    matmuls = {}
    for key, parts in exported.items():
        for part, p in parts.items():
            try:
                fn, _ = _program(p, device)
                with torch.no_grad():
                    s = _timed(fn, args.steps, 3, sync, event)
            except Exception as e:  # one program that does not run here does not cost the others' figures
                print(f"{key}/{part}: failed: {type(e).__name__}: {e}", flush=True)
                continue
            out["programs_s"][f"{key}/{part}"] = s
            print(f"{key}/{part}: {s * 1e3:.3f} ms", flush=True)
            if cuda and args.ops:
                out.setdefault("ops_us", {})[f"{key}/{part}"] = _device_us_by_op(fn)
            for mm in p["matmuls"]:
                matmuls[_mm_key(mm)] = mm
            del fn
            if cuda:
                torch.cuda.empty_cache()
    from costmodel.calibrate import Timer

    timer = Timer(device)
    for k, mm in matmuls.items():
        # The device's time alone (a CUDA graph of 20 calls replayed), as calibration times the
        # matmul curve: the host's issue of each op is priced apart.
        out["matmuls_s"][k] = timer.device_best(_matmul_fn(mm, device))
        print(f"{k}: {out['matmuls_s'][k] * 1e6:.1f} us", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def predict(args) -> None:
    from autoshard.planning.simulate import simulate
    from autoshard.runtime.passes import Estimator
    from costmodel import load_profile

    measured = json.loads(Path(args.measured).read_text())
    path = Path(tempfile.mkdtemp(prefix="autoshard-rank-compute-")) / "calibrated.json"
    profile_json = measured.get("profile") or json.loads(Path(args.profile).read_text())
    path.write_text(json.dumps(profile_json))
    curve = load_profile(path)
    if not curve.matmul_shares:
        sys.exit(f"the profile in {args.measured} has no matmul curve to compare")
    flat = dataclasses.replace(curve, matmul_shares={})
    class Priced(Estimator):
        """The estimator, with the collectives' stand-ins free on the device as on the GPU (an
        empty tensor; the host still issues them)."""

        def compute_us(self, node):
            return 0.0 if node.meta.get("standin") else super().compute_us(node)

    ests = {"curve": Priced(curve), "flat": Priced(flat)}
    if curve.host_view_us is not None:  # the host's issue of a view apart from a kernel's, or not
        ests["one_host"] = Priced(dataclasses.replace(curve, host_view_us=None))
    print(f"{measured['device']}: matmul shares by side {curve.matmul_shares}", flush=True)
    rows = []
    mm_rows = {}
    by_op: dict[str, list[float]] = {}  # aten op -> [predicted, measured] device microseconds
    from autoshard.planfile import Plan

    saved = torch.load(args.programs, weights_only=False)["plans"]
    built = {f"{name}/{k}": (prog, _int_high(name)) for name, plans in saved.items()
             for k, prog in programs(name, {k: Plan.from_json(p) for k, p in plans.items()}).items()}
    for key, (program, high) in built.items():
        for part, prog in (("forward", program.forward_program(0)), ("backward", program.backward_program(0))):
            gm = strip_collectives(prog.gm, high)
            meas = measured["programs_s"].get(f"{key}/{part}")
            if meas is None:
                continue
            pred = {k: simulate(gm, e).step_us / 1e6 for k, e in ests.items()}
            ops = measured.get("ops_us", {}).get(f"{key}/{part}")
            if ops is not None:
                for n in gm.graph.nodes:
                    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
                        op = "aten::" + n.target.__name__.split(".")[0]
                        by_op.setdefault(op, [0.0, 0.0])[0] += ests["curve"].compute_us(n)
                for op, us in ops.items():
                    by_op.setdefault(op, [0.0, 0.0])[1] += us
            rows.append({k: v / meas for k, v in pred.items()})
            print(f"{key + '/' + part:28s} measured {meas * 1e3:8.3f} ms  predicted: "
                  + "  ".join(f"{k} {v * 1e3:8.3f} ({v / meas:5.2f})" for k, v in pred.items()), flush=True)
            for n in gm.graph.nodes:
                mm = _matmul(n)
                if mm is not None:
                    k = _mm_key(mm)
                    if k in measured["matmuls_s"] and k not in mm_rows:
                        mm_rows[k] = {e: ests[e].compute_us(n) / 1e6 / measured["matmuls_s"][k]
                                      for e in ("curve", "flat")}
    if by_op:
        print("device time by aten op over every program (the curve's estimate / torch.profiler's):")
        for op, (pred, meas) in sorted(by_op.items(), key=lambda kv: -kv[1][1]):
            if meas > 0.002 * sum(m for _, m in by_op.values()):
                print(f"  {op:40s} measured {meas / 1e3:9.3f} ms  predicted {pred / 1e3:9.3f} ms  ({pred / meas:5.2f})")
    print("matmuls alone, the device's time (predicted / measured):")
    for k, r in sorted(mm_rows.items(), key=lambda kv: measured["matmuls_s"][kv[0]]):
        print(f"  {k:80s} {measured['matmuls_s'][k] * 1e6:9.1f} us  curve {r['curve']:5.2f}  flat {r['flat']:5.2f}")
    mm_err = {e: statistics.median(abs(r[e] - 1) for r in mm_rows.values()) for e in ("curve", "flat")}
    print(f"matmuls: median |predicted/measured - 1|: curve {mm_err['curve']:.3f}  flat {mm_err['flat']:.3f}")
    err = {e: statistics.median(abs(r[e] - 1) for r in rows) for e in ests}
    print("programs: median |predicted/measured - 1|: " + "  ".join(f"{k} {v:.3f}" for k, v in err.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=["export", "measure", "predict"])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--profile", default="h100-sxm", help="export: the profile to plan with; predict: the "
                    "calibrated profile when --measured holds none")
    ap.add_argument("--out", default="rank_programs.pt", help="export: the programs file")
    ap.add_argument("--programs", default="rank_programs.pt", help="measure: the programs file export wrote")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="measure: cpu is a dry run")
    ap.add_argument("--ops", action="store_true", help="measure: each program's device time by aten op too "
                    "(torch.profiler), which predict sets against the estimator's")
    ap.add_argument("--json", default=None, help="measure: write the measured figures here")
    ap.add_argument("--measured", default=None, help="predict: the file measure wrote")
    args = ap.parse_args()
    {"export": export, "measure": measure, "predict": predict}[args.phase](args)


if __name__ == "__main__":
    main()
