"""Predicted against measured peak memory on one GPU: rank 0's programs of each plan, run with
the CUDA caching allocator and a real AdamW step, where ``memory_fidelity.py`` measures live
tensor storage on gloo ranks.

    python benchmarks/gpu_memory.py export --out memprogs.pt                       # where the planner runs
    python benchmarks/gpu_memory.py measure --programs memprogs.pt --json mem.json  # on the GPU node
    python benchmarks/gpu_memory.py report --programs memprogs.pt --measured mem.json

``export`` plans LLaMA-style models in bf16 under the shipped ``h100-sxm`` profile: on a mesh of
one (no recomputation, and full recomputation), and on a fake (2, 4) mesh (DDP, FSDP, TP,
FSDP+TP, FSDP+TP with full recomputation and ours, no budget). Per plan it lowers rank 0's
forward (its loss inside, as ``autoshard measure`` runs it) and backward, replaces each
collective by an empty tensor of its output's shape (the buffer the collective would hand
back), and writes them as Python source in
FX's boxed convention (each input freed at its last use, as the executor runs them) with the
plan's predicted peak and which inputs are parameters. The traced CPU attention kernel runs as
the executor runs it on CUDA (flash where it fits). ``measure`` needs only torch with CUDA (the
GPU node's torch may predate the planner's): per program, parameters and buffers allocated
once, then two steps (forward, backward, the gradients set, ``torch.optim.AdamW``'s step with
torch's default implementation on CUDA, ``zero_grad``), the allocator's peak
(``max_memory_allocated``) and reserved peak. The models also run eagerly (the plain module,
``loss.backward()``, AdamW) on a mesh of one: what a user runs without us. ``report`` prints
predicted against measured per plan; last line: median |predicted / measured - 1|, the worst,
and how many plans measured above their prediction by more than 5%.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from gpu_rank_compute import _filled, _inputs_meta, load, strip_collectives  # noqa: E402

#: name -> (config overrides, batch, seq)
MODELS = {
    "tiny": (dict(dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=688, vocab_size=2048), 4, 128),
    "llama2048": (dict(dim=2048, n_layers=4, n_heads=16, n_kv_heads=8, ffn_dim=5632, vocab_size=32000), 8, 1024),
    "llama4096": (dict(dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000), 8, 2048),
}
SHARDED = ("ddp", "fsdp", "tp", "fsdp_tp", "fsdp_tp_ac", "autoshard")
DTYPE = torch.bfloat16
_cuda = torch.cuda
CPU_FORWARD = "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default("
CPU_BACKWARD = "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default("


def _model(name: str):
    from autoshard.models import llama

    cfg, batch, seq = MODELS[name]
    torch.manual_seed(0)
    model = llama("tiny", max_seq_len=seq, **cfg).to(DTYPE)
    return model, (torch.randint(0, cfg["vocab_size"], (batch, seq)),)


def _plans(name: str, shape: tuple) -> dict:
    """Plan name -> plan, on a fake mesh of ``shape`` (made here: one process group at a time)."""
    import torch.distributed as dist

    import autoshard

    if dist.is_initialized():
        dist.destroy_process_group()
    mesh = autoshard.fake_mesh(shape, ("dp", "tp")[:len(shape)])
    if shape == (1,):
        out = {}
        for mode, key in (("none", "single"), ("full", "recompute")):
            model, inputs = _model(name)
            out[key] = autoshard.Planner(model, inputs, mesh, profile="h100-sxm", memory_budget=None, recompute=mode,
                                         time_limit=30).solve()
        return out
    model, inputs = _model(name)
    found = autoshard.Planner(model, inputs, mesh, profile="h100-sxm", memory_budget=None,
                              time_limit=30).compare([p for p in SHARDED if p != "autoshard"])
    for plan_name, plan in list(found.items()):
        if isinstance(plan, str):
            print(f"{name}/{plan_name}: not planned ({plan})", flush=True)
            del found[plan_name]
    return found


def _attention_source() -> str:
    """The executor's CUDA attention functions, as source the GPU node runs without autoshard."""
    from autoshard.graph import attention

    # The traced program reads the CPU kernel's layouts (output and gradients contiguous in
    # (B, H, L, E)); the executor's views take a contiguous copy where they cannot view a kernel's
    # own layout (Lowering._call), as these do, up front.
    glue = """
def _strided(kernel, strides, *args, **kwargs):
    return tuple(o if tuple(o.stride()) == tuple(st) else torch.empty_strided(o.shape, st, dtype=o.dtype,
                                                                               device=o.device).copy_(o)
                 for o, st in zip(kernel(*args, **kwargs), strides))
"""
    return attention.device_kernel_source() + "\n\n" + glue


def _device_attention(code: str, gm) -> str:
    """``code`` with each traced CPU attention kernel run by the executor's CUDA kernels, its
    outputs in the layouts the CPU kernel gave the trace (the program's views rely on them)."""
    for n in gm.graph.nodes:
        for cpu, kernel in ((CPU_FORWARD, "cuda_forward"), (CPU_BACKWARD, "cuda_backward")):
            if n.op == "call_function" and str(n.target) == cpu[len("torch.ops."):-1]:
                strides = [tuple(v.stride()) for v in n.meta["val"]]
                code = code.replace(f"{n.name} = {cpu}", f"{n.name} = _strided({kernel}, {strides!r}, ", 1)
    return code


def export(args) -> None:
    import autoshard
    from autoshard import _torch_compat as tc
    from autoshard._torch_compat import quiet_tracing
    from autoshard.graph.tracing import trace
    from autoshard.runtime.program import PlannedProgram

    out = {"attention": _attention_source(), "programs": {}, "models": {}}
    for name in args.models.split(","):
        cfg, batch, seq = MODELS[name]
        out["models"][name] = {"config": cfg, "batch": batch, "seq": seq}
        for shape in ((1,), (2, 4)):
            for plan_name, plan in _plans(name, shape).items():
                key = f"{'one' if shape == (1,) else '2x4'}/{plan_name}"
                model, inputs = _model(name)
                with quiet_tracing():
                    tg = trace(model, inputs)
                mesh = autoshard.fake_mesh(shape, ("dp", "tp")[:len(shape)])
                program = PlannedProgram(tg, plan, mesh, with_loss=True)
                parts = {}
                # Token ids below this index every rank's piece of the vocabulary.
                high = cfg["vocab_size"] // math.prod(shape)
                for part, prog in (("forward", program.forward_program(0)), ("backward", program.backward_program(0))):
                    gm = strip_collectives(prog.gm, high)
                    boxed = tc.boxed_graph_module(gm)
                    consts = {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
                    code = _device_attention(boxed.code, gm)
                    parts[part] = {"code": code, "inputs": _inputs_meta(gm), "consts": consts}
                kinds = [tg.kinds[n.name] for n in tg.placeholders]
                fqns = [tg.fqn_of.get(n.name) for n in tg.placeholders]
                parts["params"] = [fqns.index(f) for f in program.trainable]
                parts["kept"] = [k for k, kind in enumerate(kinds) if kind in ("param", "buffer")]
                parts["predicted_peak_bytes"] = plan.summary.peak_mem_bytes
                parts["memory"] = plan.summary.get("memory")
                parts["int_high"] = high
                out["programs"][f"{name}/{key}"] = parts
                print(f"{name}/{key}: predicted peak {plan.summary.peak_mem_bytes / 2**30:.3f} GiB", flush=True)
    torch.save(out, args.out)
    print(f"wrote {args.out}")


def _measure_program(parts: dict, attention: str, device, steps: int) -> dict:
    scope = {"torch": torch, "aten": torch.ops.aten}
    exec(compile(attention, "<attention>", "exec"), scope)
    fwd, bwd = load(parts["forward"], device, scope), load(parts["backward"], device, scope)
    gen = torch.Generator(device=device).manual_seed(0)
    metas = parts["forward"]["inputs"]
    _cuda.empty_cache()
    _cuda.reset_peak_memory_stats()
    base = _cuda.memory_allocated()
    kept = {k: _filled(metas[k], device, gen, parts["int_high"]) for k in parts["kept"]}
    params = [torch.nn.Parameter(kept[k]) for k in parts["params"]]
    for k, p in zip(parts["params"], params):
        kept[k] = p
    opt = torch.optim.AdamW(params, lr=1e-6)
    phases = {}
    for _ in range(steps):
        args = [kept[k].detach() if k in kept else _filled(m, device, gen, parts["int_high"])
                for k, m in enumerate(metas)]
        outs = fwd(args)
        phases.setdefault("forward", _cuda.max_memory_allocated() - base)
        loss, saved = outs[0], list(outs[1:])
        del outs
        bargs = saved + [torch.ones_like(loss)]
        del saved, loss
        grads = bwd(bargs)
        phases.setdefault("backward", _cuda.max_memory_allocated() - base)
        for p, g in zip(params, grads):
            p.grad = g
        del grads
        opt.step()
        opt.zero_grad(set_to_none=True)
        phases.setdefault("optimizer", _cuda.max_memory_allocated() - base)
    _cuda.synchronize()
    out = {"peak_bytes": _cuda.max_memory_allocated() - base,
           "reserved_bytes": _cuda.max_memory_reserved(), "first_step": phases}
    del opt, params, kept
    return out


def _eager(name: str, cfg: dict, batch: int, seq: int, device, steps: int) -> dict:
    from gpu_fidelity import _models_module

    models = _models_module()
    torch.manual_seed(0)
    _cuda.empty_cache()
    _cuda.reset_peak_memory_stats()
    base = _cuda.memory_allocated()
    model = models.llama("tiny", max_seq_len=seq, **cfg).to(device=device, dtype=DTYPE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for _ in range(steps):
        x = torch.randint(0, cfg["vocab_size"], (batch, seq), device=device)
        model(x).float().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _cuda.synchronize()
    out = {"peak_bytes": _cuda.max_memory_allocated() - base, "reserved_bytes": _cuda.max_memory_reserved()}
    del model, opt
    return out


class _NoStats:
    """``torch.cuda``'s memory statistics as zeros: ``measure --device cpu`` checks that every
    program runs before GPU time is spent on it."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name) if name == "is_available" else (lambda *a, **k: 0)


def measure(args) -> None:
    device = torch.device(args.device)
    if device.type == "cpu":
        global _cuda
        _cuda = _NoStats()
    data = torch.load(args.programs, weights_only=False)
    context = None
    if device.type == "cuda":
        torch.zeros(1, device=device)  # the CUDA context, made
        free, total = torch.cuda.mem_get_info()
        # What the process holds beyond the allocator's pool: the context, kernels, cuBLAS' handle.
        context = {"total_bytes": total, "context_bytes": total - free - torch.cuda.memory_reserved()}
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "context": context,
               "torch": torch.__version__, "programs": {}, "eager": {}}
    for key, parts in data["programs"].items():
        try:
            results["programs"][key] = _measure_program(parts, data["attention"], device, args.steps)
        except Exception as e:  # one failing program must not cost the others' figures
            results["programs"][key] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(key, json.dumps(results["programs"][key]), flush=True)
    for name, m in data["models"].items():
        try:
            results["eager"][name] = _eager(name, m["config"], m["batch"], m["seq"], device, args.steps)
        except Exception as e:
            results["eager"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(f"{name}/eager", json.dumps(results["eager"][name]), flush=True)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        # After matmuls, attention kernels and AdamW ran: their workspaces and handles too.
        results["context"]["after_bytes"] = total - free - torch.cuda.memory_reserved()
    Path(args.json).write_text(json.dumps(results, indent=1))


def report(args) -> None:
    data = torch.load(args.programs, weights_only=False)
    measured = json.loads(Path(args.measured).read_text())
    print(f"device: {measured['device']}, torch {measured['torch']}")
    ctx = measured.get("context") or {}
    if ctx:
        print(f"outside the allocator: {ctx['context_bytes'] / 2**30:.2f} GiB at start, "
              f"{ctx.get('after_bytes', 0) / 2**30:.2f} GiB after every program ran "
              f"(of {ctx['total_bytes'] / 2**30:.1f} GiB)")
    errors, above = [], 0
    for key, parts in data["programs"].items():
        m = measured["programs"].get(key, {})
        if "peak_bytes" not in m:
            print(f"{key:28s} not measured: {m.get('error')}")
            continue
        predicted, peak = parts["predicted_peak_bytes"], m["peak_bytes"]
        ratio = predicted / peak
        errors.append(abs(ratio - 1))
        above += peak > 1.05 * predicted
        phases = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in m["first_step"].items())
        print(f"{key:28s} predicted {predicted / 2**30:7.3f} GiB  measured {peak / 2**30:7.3f} GiB  "
              f"ratio {ratio:.3f}  (reserved {m['reserved_bytes'] / 2**30:.2f}; first step's peak after {phases})")
    for name, m in measured["eager"].items():
        one = data["programs"].get(f"{name}/one/single")
        if "peak_bytes" in m and one:
            print(f"{name + '/eager':28s} measured {m['peak_bytes'] / 2**30:7.3f} GiB (the plain module, autograd); "
                  f"our mesh-of-one plan predicted {one['predicted_peak_bytes'] / 2**30:.3f} GiB")
    print(f"{len(errors)} plans: median |predicted/measured - 1| {statistics.median(errors):.3f}, worst "
          f"{max(errors):.3f}; measured more than 5% above the prediction: {above}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("--models", default="llama2048,llama4096")
    e.add_argument("--out", default="memprogs.pt")
    m = sub.add_parser("measure")
    m.add_argument("--programs", default="memprogs.pt")
    m.add_argument("--json", default="mem.json")
    m.add_argument("--steps", type=int, default=2)
    m.add_argument("--device", default="cuda", help="cpu: run every program once, no figures (a check)")
    r = sub.add_parser("report")
    r.add_argument("--programs", default="memprogs.pt")
    r.add_argument("--measured", default="mem.json")
    args = ap.parse_args()
    {"export": export, "measure": measure, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
