"""Predicted against measured step on one GPU: the compute side of the prediction, checked where
the gloo fidelity run cannot (real kernels, bf16, GPU-sized layers).

    python benchmarks/gpu_fidelity.py measure --json measured.json   # on the GPU node
    python benchmarks/gpu_fidelity.py predict --measured measured.json  # anywhere the planner runs
    python benchmarks/gpu_fidelity.py all                              # both, on a GPU node

One rank, so a plan is the plain model (every tensor replicated, no collective) and the step is
all compute. ``measure`` needs only torch with CUDA and NCCL (so a GPU node whose torch predates
the planner's can still run it):

1. ``costmodel.calibrate`` on a mesh of one, NCCL (compute only: the bf16 and float32 matmul
   rates at ``--matmul-size``, the copy bandwidth, the per-op launch floor, the host's issue
   time per op of a replayed graph), folded into the shipped
   profile of this GPU (by name: h100-sxm, h200, a100-sxm, b200). The matmul rate is also
   recorded at several sizes, since one efficiency prices every matmul.
2. Per model (LLaMA-style at widths 512 to 4096 and a GPT-2-style, bf16, and one in float32):
   the step timed with CUDA events after warm-up, median, two ways: eager (forward, the
   planner's default loss, autograd's backward) and graph (the same step traced to one forward
   + backward graph of aten ops and replayed, as the executor runs a rank's lowered program).

``predict`` plans each model on a mesh of one under the shipped profile and under the calibrated
one and prints, per model, both predictions against the measured steps and their ratios to the
graph step. Last line: the median |predicted / measured - 1| under each profile.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: name -> (family, config overrides, batch, seq, dtype)
MODELS = {
    "llama512": ("llama", dict(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=1376, vocab_size=8192),
                 8, 512, "bfloat16"),
    "llama2048": ("llama", dict(dim=2048, n_layers=4, n_heads=16, n_kv_heads=8, ffn_dim=5632, vocab_size=32000),
                  4, 1024, "bfloat16"),
    "llama4096": ("llama", dict(dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000),
                  2, 2048, "bfloat16"),
    "gpt1024": ("gpt2", dict(dim=1024, n_heads=16, n_layers=4, vocab_size=32000), 8, 1024, "bfloat16"),
    "llama2048-fp32": ("llama", dict(dim=2048, n_layers=4, n_heads=16, n_kv_heads=8, ffn_dim=5632,
                                     vocab_size=32000), 4, 1024, "float32"),
}


def _models_module():
    """``autoshard.models``; on a torch without the private DTensor APIs the planner needs, the
    file alone (it needs only torch), so ``measure`` runs on any CUDA torch."""
    try:
        from autoshard import models
        return models
    except ImportError as e:
        print(f"autoshard does not import here ({e}); loading autoshard/models/dense.py alone", flush=True)
    pkg = types.ModuleType("autoshard")
    pkg.__path__ = [str(ROOT / "autoshard")]
    sys.modules["autoshard"] = pkg
    # autoshard.errors imports the solver (pulp, highspy), which the GPU node need not have: the
    # models raise only ConfigError, a ValueError.
    errors = types.ModuleType("autoshard.errors")
    errors.ConfigError = type("ConfigError", (ValueError,), {})
    sys.modules["autoshard.errors"] = errors
    spec = importlib.util.spec_from_file_location("autoshard.models.dense", ROOT / "autoshard" / "models" / "dense.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["autoshard.models.dense"] = mod
    spec.loader.exec_module(mod)
    return mod


def make(name: str):
    """Model ``name`` and its batch."""
    models = _models_module()
    family, cfg, batch, seq, dtype = MODELS[name]
    torch.manual_seed(0)
    if family == "llama":
        model = models.llama("tiny", max_seq_len=seq, **cfg)
    else:
        model = models.gpt2("tiny", **cfg)
    model = model.to(getattr(torch, dtype))
    return model, (torch.randint(0, cfg["vocab_size"], (batch, seq)),)


def _timed(fn, steps: int, warmup: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``fn`` after ``warmup`` (CUDA events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def time_step(name: str, steps: int, warmup: int = 3) -> dict[str, list[float]]:
    """Seconds of each timed step of ``name`` on this GPU, two ways: ``eager`` (the module's
    forward, the planner's default loss, autograd's backward) and ``graph`` (the same step traced
    to one forward + backward graph of aten ops and replayed without autograd, as the
    executor's lowered program runs on one rank)."""
    from torch.func import functional_call
    from torch.fx.experimental.proxy_tensor import make_fx

    model, inputs = make(name)
    model = model.cuda()
    inputs = tuple(t.cuda() for t in inputs)

    def eager():
        # The planner's default loss (autoshard.graph.tracing.default_loss) for a tensor output.
        model(*inputs).float().mean().backward()
        for p in model.parameters():
            p.grad = None

    names = [n for n, _ in model.named_parameters()]
    buffers = dict(model.named_buffers())

    def joint(params, *xs):
        out = functional_call(model, {**dict(zip(names, params)), **buffers}, xs)
        return torch.autograd.grad(out.float().mean(), params)

    params = [p.detach().requires_grad_(True) for p in model.parameters()]
    graph = make_fx(joint)(params, *inputs)
    return {"eager": _timed(eager, steps, warmup), "graph": _timed(lambda: graph(params, *inputs), steps, warmup)}


def measure(args) -> dict:
    from costmodel.calibrate import CalibrationConfig, measure_matmul, run

    if not torch.cuda.is_available():
        sys.exit("gpu_fidelity measure needs a CUDA GPU (the gloo run is benchmarks/fidelity.py)")
    device = torch.cuda.get_device_name()
    print(f"{device}, torch {torch.__version__}", flush=True)
    rates = {n: measure_matmul(torch.device("cuda"), n, torch.bfloat16) for n in (1024, 2048, 4096, 8192)}
    print("bf16 matmul TFLOP/s by side: " + ", ".join(f"{n}: {r:.0f}" for n, r in rates.items()), flush=True)
    folder = Path(tempfile.mkdtemp(prefix="autoshard-gpu-fidelity-"))
    run((1,), ("dp",), "nccl", CalibrationConfig(matmul_size=args.matmul_size), str(folder / "calibrated.json"),
        nproc=1, name="gpu-fidelity")
    steps = {}
    for name in args.models.split(","):
        steps[name] = t = time_step(name, args.steps)
        print(f"{name:15s} " + "  ".join(f"{k} {statistics.median(v) * 1e3:8.2f} ms (min {min(v) * 1e3:.2f}, max "
                                         f"{max(v) * 1e3:.2f})" for k, v in t.items()), flush=True)
    out = {"device": device, "torch": torch.__version__, "matmul_tflops": rates,
           "profile": json.loads((folder / "calibrated.json").read_text()), "steps_s": steps}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


def plan_summary(name: str, profile) -> dict:
    import autoshard

    model, inputs = make(name)
    planner = autoshard.Planner(model, inputs, autoshard.fake_mesh((1,), ("dp",)), profile=profile, time_limit=30)
    summary = planner.solve().summary
    if summary["comm_us"] != 0:
        raise RuntimeError(f"{name}: a plan on one rank has communication ({summary['comm_us']} us)")
    return summary


def predict(measured: dict) -> None:
    from costmodel import load_profile
    from costmodel.calibrate import shipped_profile_name

    path = Path(tempfile.mkdtemp(prefix="autoshard-gpu-fidelity-")) / "calibrated.json"
    path.write_text(json.dumps(measured["profile"]))
    calibrated = load_profile(path)
    shipped = load_profile(shipped_profile_name(measured["device"]))
    print(f"{measured['device']}: shipped {shipped.name} ({shipped.peak_tflops:.0f} TFLOP/s x "
          f"{shipped.compute_efficiency:.2f}, {shipped.mem_bandwidth_gbps:.0f} GB/s, launch "
          f"{shipped.kernel_launch_us:.1f} us); calibrated ({calibrated.peak_tflops:.0f} x "
          f"{calibrated.compute_efficiency:.2f}, {calibrated.mem_bandwidth_gbps:.0f} GB/s, launch "
          f"{calibrated.kernel_launch_us:.1f} us, host {calibrated.host_op_us:.1f} us per op, "
          f"{calibrated.host_us('view'):.1f} per view)", flush=True)
    rows = []
    for name, times in measured["steps_s"].items():
        # Older files held the eager step alone.
        meas = {k: statistics.median(v) * 1e3 for k, v in (times.items() if isinstance(times, dict)
                                                           else [("eager", times)])}
        ref = meas.get("graph", meas["eager"])
        pred = {label: plan_summary(name, prof)["step_us"] / 1e3
                for label, prof in (("shipped", shipped), ("calibrated", calibrated))}
        rows.append({"model": name, **{f"{k}_ratio": v / ref for k, v in pred.items()}})
        print(f"{name:15s} {MODELS[name][4]:8s} measured " + " ".join(f"{k} {v:8.2f}" for k, v in meas.items())
              + f" ms  predicted: shipped {pred['shipped']:8.2f} ({pred['shipped'] / ref:5.2f})  calibrated "
              f"{pred['calibrated']:8.2f} ({pred['calibrated'] / ref:5.2f})", flush=True)
    err = {k: statistics.median(abs(r[f"{k}_ratio"] - 1) for r in rows) for k in ("shipped", "calibrated")}
    print(f"median |predicted/measured - 1| (against the graph step where measured): shipped {err['shipped']:.3f}  "
          f"calibrated {err['calibrated']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=["measure", "predict", "all"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--matmul-size", type=int, default=4096, help="matmul side that calibrates compute")
    ap.add_argument("--json", default=None, help="measure: write the measured figures here")
    ap.add_argument("--measured", default=None, help="predict: the file measure wrote")
    args = ap.parse_args()
    if args.phase == "predict":
        if not args.measured:
            sys.exit("predict needs --measured FILE (written by: gpu_fidelity.py measure --json FILE)")
        predict(json.loads(Path(args.measured).read_text()))
        return
    measured = measure(args)
    if args.phase == "all":
        predict(measured)


if __name__ == "__main__":
    main()
