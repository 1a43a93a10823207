"""The ``autoshard`` command line.

  autoshard demo [--mesh dp=8,tp=8]                 plan a small GPT on a fake 64-rank mesh
  autoshard plan MODULE:FACTORY --mesh dp=8,tp=8 -o plan.json
  autoshard show plan.json                          print a plan's summary
  autoshard explain plan.json                       per-layer table, the dearest redistributes
  autoshard diff a.json b.json                      what differs between two plans
  autoshard lower MODULE:FACTORY --plan plan.json   one rank's lowered programs: collectives, code
  autoshard calibrate --mesh dp=2,tp=4 -o prof.json  measure collectives (under torchrun, or --nproc N)
  autoshard serve [--db plans.sqlite] [--port 8000]    the plan service (HTTP JSON API)
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time

EXAMPLES = """examples:
  autoshard demo
  autoshard demo --mesh dp=4,tp=2 --layers 1 -o plan.json
  autoshard demo --model llama-8b --batch 64 --seq 2048 --compare
  autoshard plan mypkg.models:make --mesh dp=8,tp=8 --pin 'layers.*.attn.wq=RS(0)' -o plan.json
  autoshard plan mypkg.models:make --mesh dp=8,tp=8 --memory-budget 70GiB -o plan.json
  autoshard show plan.json
  torchrun --nproc-per-node 8 -m autoshard calibrate --mesh dp=2,tp=4 -o h100-node.json
  autoshard calibrate --backend gloo --nproc 4 --mesh dp=2,tp=2 --max-bytes 4MiB -o cpu.json

exit codes: 0 ok, 1 unexpected error, 2 bad input (message says what was expected and found)
"""

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    import re

    m = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"memory size {text!r}: expected a number with an optional unit "
                                         f"({', '.join(u for u in _UNITS if u)}), e.g. 70GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _log(msg: str) -> None:
    print(f"[autoshard] {msg}", file=sys.stderr, flush=True)


def _common(p: argparse.ArgumentParser, default_mesh: str | None) -> None:
    p.add_argument("--mesh", default=default_mesh, required=default_mesh is None,
                   help="mesh axes as name=size,... (e.g. dp=8,tp=8)")
    p.add_argument("--profile", default="h100-sxm", help="shipped profile name or profile file")
    p.add_argument("--memory-budget", type=parse_bytes, default=None,
                   help="bytes per device, e.g. 70GiB (default: the profile's device memory)")
    p.add_argument("--time-limit", type=float, default=60.0, help="solver time limit, seconds")
    p.add_argument("-o", "--output", default=None, help="write the plan JSON here")
    p.add_argument("--pin", action="append", default=[], metavar="FQN=SPEC",
                   help="fix parameters (FQN glob, or a module) to a spec, e.g. 'layers.*.attn.wq=RS(0)'; repeatable")
    p.add_argument("--export-problem", default=None, metavar="FILE",
                   help="also write the solver's problem in the IOPDDL contest format (.json or .json.gz; "
                        "ties and pins as extra keys)")
    p.add_argument("--compare", action="store_true",
                   help="also cost the hand-written plans (DDP, FSDP, TP, FSDP+TP) and print a table")


def _run_plan(model, inputs, args) -> int:
    import autoshard
    from autoshard.errors import AutoshardError

    shape, names = autoshard.parse_mesh(args.mesh)
    mesh = autoshard.fake_mesh(shape, names)
    pins = {}
    for item in args.pin:
        fqn, sep, spec = item.partition("=")
        if not sep or not fqn or not spec:
            raise AutoshardError(f"--pin {item!r}: expected FQN=SPEC, e.g. 'layers.*.attn.wq=RS(0)'")
        pins[fqn] = spec
    t0 = time.perf_counter()
    budget = args.memory_budget if args.memory_budget else "auto"
    plan = autoshard.plan(model, inputs, mesh, profile=args.profile, memory_budget=budget,
                          time_limit=args.time_limit, log=_log, pins=pins or None,
                          export_problem=args.export_problem)
    print(plan.describe())
    if args.compare:
        results = autoshard.compare(model, inputs, mesh, profile=args.profile, memory_budget=budget,
                                    time_limit=args.time_limit)
        print(f"{'plan':10s} {'step ms':>10s} {'compute ms':>11s} {'comm ms':>9s} {'peak GiB':>9s}")
        for name, res in results.items():
            if isinstance(res, str):
                print(f"{name:10s} {'-':>10s}  {res}")
                continue
            sm = res.summary
            print(f"{name:10s} {sm['step_us'] / 1e3:10.2f} {sm['compute_us'] / 1e3:11.2f} {sm['comm_us'] / 1e3:9.2f} "
                  f"{sm['peak_mem_bytes'] / 2**30:9.2f}")
    print(f"planned in {time.perf_counter() - t0:.1f} s")
    if args.output:
        plan.save(args.output)
        print(f"wrote {args.output}")
    return 0


def cmd_demo(args) -> int:
    import torch

    from autoshard.models import LLAMA_PRESETS, Transformer, TransformerConfig, gpt2, llama

    with torch.device("meta"):
        if args.model == "gpt":
            cfg = TransformerConfig(dim=args.dim, n_heads=args.heads, n_layers=args.layers, vocab_size=args.vocab)
            model = Transformer(cfg)
            what = f"GPT dim={cfg.dim} heads={cfg.n_heads} layers={cfg.n_layers} vocab={cfg.vocab_size}"
        elif args.model.startswith("llama-"):
            preset = args.model.split("-", 1)[1]
            model = llama(preset, max_seq_len=max(args.seq, LLAMA_PRESETS[preset]["max_seq_len"]))
            what = f"LLaMA {preset} shapes ({model.cfg.n_layers} layers)"
        else:
            model = gpt2(args.model.split("-", 1)[1])
            what = f"GPT-2 {args.model.split('-', 1)[1]} shapes"
    vocab = model.embed.num_embeddings
    tokens = torch.randint(0, vocab, (args.batch, args.seq), device="meta")
    _log(f"demo: {what}, batch {args.batch} x seq {args.seq}, mesh {args.mesh} (fake process group, no GPU)")
    return _run_plan(model, (tokens,), args)


def _from_factory(factory: str):
    """``(model, example_inputs)`` from ``MODULE:FUNCTION``."""
    from autoshard.errors import AutoshardError

    mod_name, _, fn_name = factory.partition(":")
    if not fn_name:
        raise AutoshardError(f"factory {factory!r}: expected MODULE:FUNCTION")
    if "" not in sys.path and os.getcwd() not in sys.path:
        # As `python -m` and `uvicorn app:app` do: a module in the current folder is found.
        sys.path.insert(0, os.getcwd())
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise AutoshardError(f"factory {factory!r}: cannot import: {exc}") from None
    made = fn()
    if not (isinstance(made, tuple) and len(made) == 2):
        raise AutoshardError(f"factory {factory!r}: expected it to return (model, example_inputs), "
                             f"found {type(made).__name__}")
    return made


def cmd_plan(args) -> int:
    from autoshard.errors import AutoshardError

    if args.server:
        return _plan_on_server(args)
    if not args.factory:
        raise AutoshardError("plan: expected MODULE:FACTORY (or --server URL with --model)")
    model, inputs = _from_factory(args.factory)
    return _run_plan(model, inputs, args)


def cmd_lower(args) -> int:
    """Lower a plan for one rank on a fake process group (no GPU, no weights) and show it."""
    from pathlib import Path

    import torch

    import autoshard
    from autoshard._torch_compat import quiet_tracing
    from autoshard.errors import AutoshardError
    from autoshard.plan import Plan
    from autoshard.runtime import PlannedProgram
    from autoshard.trace import trace

    plan = Plan.load(args.plan)
    world = math.prod(plan.mesh_shape)
    if not 0 <= args.rank < world:
        raise AutoshardError(f"--rank {args.rank}: expected 0 <= rank < {world} (the plan's mesh {plan.mesh_shape})")
    model, inputs = _from_factory(args.factory)
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    mesh = autoshard.fake_mesh(tuple(plan.mesh_shape), tuple(plan.axis_names))
    with quiet_tracing():
        tg = trace(model, inputs)
    program = PlannedProgram(tg, plan, mesh, bucket_mb=args.bucket_mb, overlap=not args.no_overlap)
    print(program.describe(args.rank))
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        for name, prog in (("forward", program.forward_program(args.rank)),
                           ("backward", program.backward_program(args.rank))):
            (out / f"{name}.rank{args.rank}.py").write_text(prog.gm.code)
        print(f"wrote {out}/forward.rank{args.rank}.py and backward.rank{args.rank}.py")
    return 0


def _read_token(path: str | None) -> str | None:
    if not path:
        return None
    with open(path) as f:
        token = f.read().strip()
    if not token:
        raise ValueError(f"--token-file {path}: the file is empty")
    return token


def cmd_serve(args) -> int:
    try:
        import uvicorn

        from autoshard.serve import ServiceConfig, create_app
    except ImportError as exc:
        raise ValueError(f"autoshard serve needs the service extra ({exc.name} is missing): "
                         "pip install -c constraints.txt -e '.[serve]'") from None

    token = _read_token(args.token_file)
    cfg = ServiceConfig(db=args.db, workers=args.workers, max_queue=args.max_queue, job_seconds=args.job_seconds,
                        max_time_limit=args.max_time_limit, token=token, max_body_bytes=args.max_body_bytes)
    _log(f"serving on http://{args.host}:{args.port} (db {args.db}, {args.workers} workers"
         f"{', token required' if token else ''}); OpenAPI at /openapi.json")
    uvicorn.run(create_app(cfg), host=args.host, port=args.port, log_level="warning")
    return 0


def _plan_on_server(args) -> int:
    from autoshard.client import PlanClient
    from autoshard.errors import AutoshardError

    if not args.model:
        raise AutoshardError("--server needs --model (a reference model as data: llama-8b, gpt2-small, ...); "
                             "a MODULE:FACTORY cannot be sent to a service")
    family, _, preset = args.model.partition("-")
    if family not in ("llama", "gpt2") or not preset:
        raise AutoshardError(f"--model {args.model!r}: expected llama-PRESET or gpt2-PRESET")
    from autoshard.mesh import parse_mesh

    shape, names = parse_mesh(args.mesh)
    token = _read_token(args.token_file)
    pins = dict(p.split("=", 1) for p in args.pin)
    plan = PlanClient(args.server, token=token).plan(
        {"reference": family, "preset": preset}, batch=args.batch, seq=args.seq, mesh=dict(zip(names, shape)),
        profile=args.profile, memory_budget=args.memory_budget or "auto", pins=pins, time_limit=args.time_limit)
    print(plan.describe())
    if args.output:
        plan.save(args.output)
        print(f"wrote {args.output}")
    return 0


def cmd_calibrate(args) -> int:
    from autoshard.mesh import parse_mesh
    from costmodel.calibrate import CalibrationConfig, run

    shape, names = parse_mesh(args.mesh)
    cfg = CalibrationConfig(
        kinds=tuple(k.strip() for k in args.kinds.split(",") if k.strip()),
        min_bytes=args.min_bytes, max_bytes=args.max_bytes, factor=args.factor,
        warmup=args.warmup, iters=args.iters, repeats=args.repeats, flattened=not args.no_flattened,
        matmul_size=args.matmul_size,
    )
    run(shape, names, args.backend, cfg, args.output, nproc=args.nproc, name=args.name)
    return 0


def cmd_explain(args) -> int:
    from autoshard.explain import explain
    from autoshard.plan import Plan

    print(explain(Plan.load(args.plan), top=args.top))
    return 0


def cmd_diff(args) -> int:
    from autoshard.explain import diff
    from autoshard.plan import Plan

    print(diff(Plan.load(args.a), Plan.load(args.b)))
    return 0


def cmd_show(args) -> int:
    from autoshard.plan import Plan

    plan = Plan.load(args.plan)
    print(plan.describe(max_params=args.max_params))
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("autoshard")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="autoshard", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES)
    ap.add_argument("--version", action="version", version=f"autoshard {_version()}")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="plan a small GPT on a fake 64-rank mesh and print the plan")
    _common(d, "dp=8,tp=8")
    d.add_argument("--model", default="gpt", choices=["gpt", "gpt2-small", "gpt2-medium", "llama-1b", "llama-8b",
                                                       "llama-70b"],
                   help="gpt: the small GPT sized by --dim/--layers/...; others: reference shapes")
    d.add_argument("--layers", type=int, default=2)
    d.add_argument("--dim", type=int, default=1024)
    d.add_argument("--heads", type=int, default=16)
    d.add_argument("--vocab", type=int, default=8192)
    d.add_argument("--batch", type=int, default=32)
    d.add_argument("--seq", type=int, default=512)
    d.set_defaults(func=cmd_demo)
    p = sub.add_parser("plan", help="plan a model made by MODULE:FACTORY() -> (model, example_inputs)")
    p.add_argument("factory", nargs="?", default=None)
    _common(p, None)
    p.add_argument("--server", default=None, help="ask this plan service (autoshard serve) instead of planning here")
    p.add_argument("--model", default=None, help="with --server: llama-PRESET or gpt2-PRESET")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--token-file", default=None, help="with --server: file holding the bearer token")
    p.set_defaults(func=cmd_plan)
    c = sub.add_parser("calibrate", help="measure collectives on this cluster and write a profile",
                       description="Run under torchrun (torchrun --nproc-per-node 8 -m autoshard calibrate "
                                   "--mesh dp=2,tp=4 -o profile.json), or spawn local processes with --nproc.")
    c.add_argument("--mesh", required=True, help="mesh axes as name=size,...; product = number of processes")
    c.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    c.add_argument("--nproc", type=int, default=None, help="spawn this many local processes (no torchrun)")
    c.add_argument("-o", "--output", required=True, help="profile JSON to write (rank 0)")
    c.add_argument("--kinds", default="all_reduce,all_gather,reduce_scatter,all_to_all")
    c.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("4KiB"))
    c.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("64MiB"))
    c.add_argument("--factor", type=int, default=4)
    c.add_argument("--warmup", type=int, default=2)
    c.add_argument("--iters", type=int, default=5)
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--matmul-size", type=int, default=1024)
    c.add_argument("--no-flattened", action="store_true", help="skip multi-axis (flattened) groups")
    c.add_argument("--name", default=None, help="profile name (default: calibrated-<device>)")
    c.set_defaults(func=cmd_calibrate)
    sv = sub.add_parser("serve", help="run the plan service (HTTP JSON API, SQLite store, solve workers)")
    sv.add_argument("--db", default="plans.sqlite")
    sv.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--workers", type=int, default=2, help="solve worker processes")
    sv.add_argument("--max-queue", type=int, default=64)
    sv.add_argument("--job-seconds", type=float, default=600.0, help="a job is stopped past this")
    sv.add_argument("--max-time-limit", type=float, default=300.0, help="largest solver time limit a request may ask")
    sv.add_argument("--token-file", default=None, help="require 'Authorization: Bearer <token in this file>'")
    sv.add_argument("--max-body-bytes", type=parse_bytes, default=parse_bytes("8MiB"))
    sv.set_defaults(func=cmd_serve)
    e = sub.add_parser("explain", help="per-layer table of a plan, totals, the dearest redistributes")
    e.add_argument("plan")
    e.add_argument("--top", type=int, default=10)
    e.set_defaults(func=cmd_explain)
    df = sub.add_parser("diff", help="what differs between two plans")
    df.add_argument("a")
    df.add_argument("b")
    df.set_defaults(func=cmd_diff)
    lw = sub.add_parser("lower", help="lower a plan for one rank (fake process group) and print its collectives")
    lw.add_argument("factory", help="MODULE:FACTORY returning (model, example_inputs), as planned")
    lw.add_argument("--plan", required=True)
    lw.add_argument("--rank", type=int, default=0)
    lw.add_argument("--bucket-mb", type=float, default=25.0)
    lw.add_argument("--no-overlap", action="store_true")
    lw.add_argument("-o", "--output", default=None, help="write the programs' code to this folder")
    lw.set_defaults(func=cmd_lower)
    s = sub.add_parser("show", help="print a plan file's summary")
    s.add_argument("plan")
    s.add_argument("--max-params", type=int, default=40)
    s.set_defaults(func=cmd_show)
    return ap


def main(argv=None) -> int:
    from autoshard.errors import AutoshardError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (AutoshardError, FileNotFoundError, ValueError) as exc:
        print(f"autoshard: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
