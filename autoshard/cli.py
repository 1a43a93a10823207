"""The ``autoshard`` command line.

  autoshard demo [--mesh dp=8,tp=8]                 plan LLaMA-8B shapes on a fake 64-rank mesh
  autoshard plan MODULE:FACTORY --mesh dp=8,tp=8 -o plan.json
  autoshard show plan.json                          print a plan's summary
  autoshard explain plan.json                       per-layer table, the dearest redistributes
  autoshard diff a.json b.json                      what differs between two plans
  autoshard lower MODULE:FACTORY --plan plan.json   one rank's lowered programs: collectives, code
  autoshard calibrate --mesh dp=2,tp=4 -o prof.json  measure collectives (under torchrun, or --nproc N)
  autoshard measure MODULE:FACTORY --plan plan.json  run the plan, predicted against measured step
                    [--refine prof.json -o prof2.json]  ... and refit the profile to in-step collectives
  autoshard serve [--db plans.sqlite|postgresql://...]  the plan service (HTTP JSON API, replicas)
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import math
import os
import socket
import sys
import time

EXAMPLES = """examples:
  autoshard demo
  autoshard demo --mesh dp=4,tp=2 --layers 1 -o plan.json
  autoshard demo --model llama-70b --mesh dp=8,tp=8 --compare
  autoshard demo --model gpt --dim 512 --heads 8 --layers 2 --batch 8 --seq 128
  autoshard plan mypkg.models:make --mesh dp=8,tp=8 --pin 'layers.*.attn.wq=RS(0)' -o plan.json
  autoshard plan mypkg.models:make --mesh dp=8,tp=8 --memory-budget 70GiB -o plan.json
  autoshard plan mypkg.models:make --ranks 64 -o plan.json          # the mesh shape chosen too
  autoshard show plan.json
  torchrun --nproc-per-node 8 -m autoshard calibrate --mesh dp=2,tp=4 -o h100-node.json
  autoshard calibrate --backend gloo --nproc 4 --mesh dp=2,tp=2 --max-bytes 4MiB -o cpu.json
  autoshard measure mypkg.models:make --plan plan.json --backend gloo --nproc 4 --json measured.json

exit codes: 0 ok, 1 unexpected error, 2 bad input (message says what was expected and found)
"""

def parse_bytes(text: str) -> int:
    """``--memory-budget 70GiB``: :func:`autoshard.units.parse_bytes` as an argparse type."""
    from autoshard.errors import ConfigError
    from autoshard.units import parse_bytes as parse

    try:
        return parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_budget(text: str) -> float:
    """``--memory-budget 70GiB`` or ``90%``: :func:`autoshard.units.parse_budget` as an argparse type."""
    from autoshard.errors import ConfigError
    from autoshard.units import parse_budget as parse

    try:
        return parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _log(msg: str) -> None:
    logging.getLogger("autoshard.cli").info(msg)


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record comes (tests swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def _setup_logging(verbosity: int):
    """Progress of every package on stderr, one ``[autoshard]`` line each: INFO by default,
    DEBUG with ``-v``, warnings only with ``-q``. Returns the function that undoes it (the
    CLI can be called in-process, by tests or notebooks)."""
    level = logging.DEBUG if verbosity > 0 else logging.WARNING if verbosity < 0 else logging.INFO
    handler = _Stderr()
    handler.setFormatter(logging.Formatter("[autoshard] %(message)s"))
    saved = []
    for name in ("autoshard", "solver", "costmodel"):
        logger = logging.getLogger(name)
        saved.append((logger, logger.level, logger.propagate))
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False  # one line per record, whatever the root logger does

    def restore() -> None:
        for logger, old_level, old_propagate in saved:
            logger.removeHandler(handler)
            logger.setLevel(old_level)
            logger.propagate = old_propagate

    return restore


def _common(p: argparse.ArgumentParser, default_mesh: str | None, default_compute_dtype: str | None = None) -> None:
    from autoshard.options import RECOMPUTE

    p.add_argument("--mesh", default=default_mesh,
                   help="mesh axes as name=size,... (e.g. dp=8,tp=8)" + (f"; default {default_mesh}" if default_mesh
                                                                        else "; or --ranks N"))
    p.add_argument("--ranks", type=int, default=None,
                   help="choose the mesh shape too: plan every 1-3 axis shape of N ranks, keep the best")
    p.add_argument("--mesh-margin", type=float, default=0.25, metavar="SHARE",
                   help="with --ranks: a shape is not bounded where every shape of one axis fewer it refines has a "
                        "plan this share slower than the best of them, nor solved where its own plan is this share "
                        "slower than the best found (default 0.25; negative: bound and solve every shape)")
    p.add_argument("--profile", default="h100-sxm", help="shipped profile name or profile file")
    p.add_argument("--memory-budget", type=parse_budget, default=None,
                   help="bytes per device, e.g. 70GiB, or a share of the device's memory, e.g. 85%% (default: the "
                        "device's memory less a 10%% reserve for the CUDA context, NCCL and fragmentation)")
    p.add_argument("--time-limit", type=float, default=60.0,
                   help="seconds the plan may take, tracing and building the problem included")
    p.add_argument("--recompute", default="auto", choices=RECOMPUTE,
                   help="activation checkpointing of the repeated layers (default auto: chosen with the plan)")
    p.add_argument("--load-imbalance", type=float, default=1.0, metavar="F",
                   help="mixture of experts: the busiest expert-parallel rank's load over the mean (default 1.0, "
                        "exact for capacity-based dispatch)")
    p.add_argument("--bucket-mb", type=float, default=25.0, metavar="MIB",
                   help="the executor's bucket cap the predicted step prices (parallelize's bucket_mb; 0: none)")
    p.add_argument("--additive-objective", dest="overlap_objective", action="store_false",
                   help="solve for the additive step (every redistribute's time counted) instead of the step with "
                        "communication overlapped by compute (overlap_objective=False); the predicted step is "
                        "simulated with overlap either way")
    p.add_argument("--compute-dtype", default=default_compute_dtype, metavar="DTYPE",
                   help="price every op's FLOPs in this dtype, e.g. bfloat16 for a float32 model that trains under "
                        "mixed precision; 'traced': each op in the dtype it was traced in, as it runs (default: "
                        + (f"{default_compute_dtype}, the reference models being float32 master weights with bf16 "
                           "compute)" if default_compute_dtype else "traced)"))
    p.add_argument("-o", "--output", default=None, help="write the plan JSON here")
    p.add_argument("--pin", action="append", default=[], metavar="FQN=SPEC",
                   help="fix parameters (FQN glob, or a module) to a spec, e.g. 'layers.*.attn.wq=RS(0)'; repeatable")
    p.add_argument("--export-problem", default=None, metavar="FILE",
                   help="also write the solver's problem in the IOPDDL contest format (.json or .json.gz; "
                        "ties and pins as extra keys)")
    p.add_argument("--compare", action="store_true",
                   help="also cost the hand-written plans (DDP, FSDP, TP, FSDP+TP, FSDP+TP with full activation "
                        "checkpointing) and print a table")
    p.add_argument("--pipeline", default=None, metavar="AXIS",
                   help="pipeline stages over this mesh axis: the repeated layers cut into stages, each planned on "
                        "the other axes, run by torch's schedules (autoshard.planning.pipeline)")
    p.add_argument("--allow-pipeline", default=None, metavar="AXIS",
                   help="plan with pipeline stages over this mesh axis and without them, keep the plan predicted "
                        "faster (both made within --time-limit; autoshard.planning.pipechoice)")
    p.add_argument("--microbatches", type=microbatch_count, default="auto", metavar="M",
                   help="with --pipeline or --allow-pipeline: microbatches per step, or 'auto' (default): chosen "
                        "by planning the pipeline at a few counts within --time-limit (planning/microbatches.py)")
    p.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe", "interleaved_1f1b"),
                   help="with --pipeline or --allow-pipeline: torch's schedule (default 1f1b)")
    p.add_argument("--stages-per-rank", type=int, default=1, metavar="V",
                   help="with --pipeline or --allow-pipeline and interleaved_1f1b: stages per pipeline rank")


def microbatch_count(text: str) -> int | str:
    """``--microbatches``: a count >= 1 or ``auto``."""
    if text == "auto":
        return text
    try:
        m = int(text)
    except ValueError:
        m = 0
    if m < 1:
        raise argparse.ArgumentTypeError(f"expected a count >= 1 or 'auto', found {text!r}")
    return m


def _compute_dtype(args) -> str | None:
    return None if args.compute_dtype in (None, "traced") else args.compute_dtype


def _run_plan(model, inputs, args) -> int:
    import autoshard
    from autoshard.errors import AutoshardError

    pins = {}
    for item in args.pin:
        fqn, sep, spec = item.partition("=")
        if not sep or not fqn or not spec:
            raise AutoshardError(f"--pin {item!r}: expected FQN=SPEC, e.g. 'layers.*.attn.wq=RS(0)'")
        pins[fqn] = spec
    if args.ranks is not None:
        return _run_mesh_search(model, inputs, args, pins)
    if args.mesh is None:
        raise AutoshardError("plan: expected --mesh name=size,... (e.g. dp=8,tp=8) or --ranks N")
    shape, names = autoshard.parse_mesh(args.mesh)
    mesh = autoshard.fake_mesh(shape, names)
    t0 = time.perf_counter()
    if args.pipeline or args.allow_pipeline:
        return _run_pipeline(model, inputs, mesh, args, pins, t0)
    planner = autoshard.Planner(model, inputs, mesh, profile=args.profile,
                                memory_budget=args.memory_budget if args.memory_budget else "auto",
                                time_limit=args.time_limit, pins=pins or None, export_problem=args.export_problem,
                                recompute=args.recompute, load_imbalance=args.load_imbalance,
                                overlap_objective=args.overlap_objective, compute_dtype=_compute_dtype(args),
                                bucket_mb=args.bucket_mb)
    plan = planner.solve()
    print(plan.describe())
    _warn_reserve(plan, planner.profile.memory_bytes)
    if args.compare:
        # The same planner: one trace, the plan above as the "autoshard" row, the pins honoured.
        results = planner.compare()
        print(f"{'plan':10s} {'step ms':>10s} {'compute ms':>11s} {'comm ms':>9s} {'exposed':>9s} {'peak GiB':>9s}")
        for name, res in results.items():
            if isinstance(res, str):
                print(f"{name:10s} {'-':>10s}  {res}")
                continue
            sm = res.summary
            print(f"{name:10s} {sm['step_us'] / 1e3:10.2f} {sm['compute_us'] / 1e3:11.2f} {sm['comm_us'] / 1e3:9.2f} "
                  f"{(sm['step_us'] - sm['compute_us']) / 1e3:9.2f} {sm['peak_mem_bytes'] / 2**30:9.2f}")
    print(f"planned in {time.perf_counter() - t0:.1f} s")
    if args.output:
        plan.save(args.output)
        print(f"wrote {args.output}")
    return 0


def _run_pipeline(model, inputs, mesh, args, pins, t0: float) -> int:
    import torch

    from autoshard.errors import AutoshardError
    from autoshard.planning.pipechoice import plan_or_pipeline
    from autoshard.planning.pipeline import plan_pipeline

    flag = "--pipeline" if args.pipeline else "--allow-pipeline"
    if args.pipeline and args.allow_pipeline:
        raise AutoshardError(f"--pipeline {args.pipeline} requires a pipeline, --allow-pipeline {args.allow_pipeline} "
                             "lets the planner choose: give one of them")
    if args.compare or args.export_problem:
        raise AutoshardError(f"{flag} plans each stage on its own: --compare and --export-problem need a plan "
                             f"without {flag}")
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    make = plan_pipeline if args.pipeline else plan_or_pipeline
    pplan = make(model, inputs, mesh, axis=args.pipeline or args.allow_pipeline, microbatches=args.microbatches,
                 schedule=args.schedule, stages_per_rank=args.stages_per_rank, profile=args.profile,
                 memory_budget=args.memory_budget if args.memory_budget else "auto",
                 time_limit=args.time_limit, pins=pins or None, recompute=args.recompute,
                 load_imbalance=args.load_imbalance, overlap_objective=args.overlap_objective,
                 compute_dtype=_compute_dtype(args), bucket_mb=args.bucket_mb)
    print(pplan.describe())
    print(f"planned in {time.perf_counter() - t0:.1f} s")
    if args.output:
        pplan.save(args.output)
        print(f"wrote {args.output}")
    return 0


def _warn_reserve(plan, device_bytes: int) -> None:
    """Say so where the plan's predicted peak leaves less of the device than the reserve that
    ``memory_budget="auto"`` keeps for the CUDA context, NCCL's buffers and fragmentation."""
    from autoshard.options import MEMORY_RESERVE

    peak = plan.summary.get("peak_mem_bytes") or 0
    if peak > device_bytes * (1 - MEMORY_RESERVE):
        print(f"warning: the plan's predicted peak {peak / 2**30:.2f} GiB leaves less than the {MEMORY_RESERVE:.0%} "
              f"reserve of the device's {device_bytes / 2**30:.2f} GiB that no plan models (CUDA context, NCCL "
              f"buffers, the allocator's fragmentation): it may run out of memory", file=sys.stderr)


def _run_mesh_search(model, inputs, args, pins) -> int:
    import autoshard
    from autoshard.errors import AutoshardError
    from autoshard.explain import mesh_search_table

    if args.compare or args.export_problem:
        raise AutoshardError("--ranks chooses the mesh: --compare and --export-problem need a given --mesh")
    t0 = time.perf_counter()
    plan = autoshard.plan(model, inputs, "auto", ranks=args.ranks, profile=args.profile,
                          memory_budget=args.memory_budget if args.memory_budget else "auto",
                          time_limit=args.time_limit, pins=pins or None, recompute=args.recompute,
                          load_imbalance=args.load_imbalance, overlap_objective=args.overlap_objective,
                          compute_dtype=_compute_dtype(args), bucket_mb=args.bucket_mb,
                          mesh_margin=None if args.mesh_margin < 0 else args.mesh_margin)
    print(plan.describe())
    from costmodel import load_profile

    _warn_reserve(plan, load_profile(args.profile).memory_bytes)
    print("\n".join(mesh_search_table(plan)))
    print(f"planned in {time.perf_counter() - t0:.1f} s")
    if args.output:
        plan.save(args.output)
        print(f"wrote {args.output}")
    return 0


def cmd_demo(args) -> int:
    import torch

    from autoshard.errors import AutoshardError
    from autoshard.models import Transformer, TransformerConfig
    from autoshard.models.catalog import parse_reference, reference

    sized = [f"--{k}" for k in ("dim", "heads", "vocab") if getattr(args, k) is not None]
    if sized and args.model != "gpt":
        raise AutoshardError(f"{', '.join(sized)} size the small GPT: expected --model gpt with them, "
                             f"found --model {args.model}")
    layers = {} if args.layers is None else {"n_layers": args.layers}
    with torch.device("meta"):
        if args.model == "gpt":
            cfg = TransformerConfig(dim=args.dim or 1024, n_heads=args.heads or 16, n_layers=args.layers or 2,
                                    vocab_size=args.vocab or 8192)
            model = Transformer(cfg)
            what = f"GPT dim={cfg.dim} heads={cfg.n_heads} layers={cfg.n_layers} vocab={cfg.vocab_size}"
        else:
            family, preset = parse_reference(args.model)
            model = reference(family, preset, seq=args.seq, **layers)
            what = f"{args.model} shapes ({model.cfg.n_layers} layers)"
    vocab = model.embed.num_embeddings
    tokens = torch.randint(0, vocab, (args.batch, args.seq), device="meta")
    where = f"{args.ranks} ranks, mesh shape chosen" if args.ranks else f"mesh {args.mesh}"
    _log(f"demo: {what}, batch {args.batch} x seq {args.seq}, {where} (fake process group, no GPU)")
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
    from autoshard.graph.tracing import trace
    from autoshard.planfile import Plan
    from autoshard.runtime.program import PlannedProgram

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


def _measure_worker(factory: str, plan_path: str, backend: str, cfg, bucket_mb: float, overlap: bool,
                    json_path: str | None, refine: tuple[str, str] | None = None) -> None:
    """One rank of ``autoshard measure`` in an initialized process group."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.measure import measure_on_this_rank, save
    from autoshard.planfile import Plan
    from costmodel.calibrate import threads_per_rank

    plan = Plan.load(plan_path)
    device_type = "cuda" if backend == "nccl" else "cpu"
    if device_type == "cpu":
        torch.set_num_threads(threads_per_rank(dist.get_world_size()))
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
    mesh = init_device_mesh(device_type, tuple(plan.mesh_shape), mesh_dim_names=tuple(plan.axis_names))
    model, inputs = _from_factory(factory)
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    if device_type == "cuda":
        model, inputs = model.cuda(), tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in inputs)
    m = measure_on_this_rank(model, inputs, plan, mesh, cfg, bucket_mb=bucket_mb, overlap=overlap)
    if m is not None:
        print(m.table(), flush=True)
        if json_path:
            save(m, json_path)
            print(f"wrote {json_path}", flush=True)
        if refine and m.step_samples:
            from autoshard.measure import refine_profile
            from costmodel import load_profile

            base, out = refine
            refined, rows, compute = refine_profile(m, plan, load_profile(base), f"autoshard measure {factory} "
                                                    f"--plan {os.path.basename(plan_path)}")
            refined.save(out)
            print(f"refined {base} from {len(m.step_samples)} in-step collective sizes: "
                  + ", ".join(f"{r['kind']}(n={r['group_size']}) x{r['factor']:.3g}" for r in rows)
                  + f"; {compute}"
                  + f"; wrote {out} (plan with --profile {out})", flush=True)


def cmd_measure(args) -> int:
    """Run a plan on real processes; print its predicted step against the measured one."""
    from autoshard.errors import AutoshardError
    from autoshard.measure import MeasureConfig
    from autoshard.planfile import Plan
    from costmodel.calibrate import check_backend, run_distributed

    check_backend(args.backend)
    plan = Plan.load(args.plan)
    world = math.prod(plan.mesh_shape)
    if args.nproc is not None and args.nproc != world:
        raise AutoshardError(f"measure: the plan's mesh {dict(zip(plan.axis_names, plan.mesh_shape))} has {world} "
                             f"ranks but --nproc is {args.nproc}")
    cfg = MeasureConfig(steps=args.steps, warmup=args.warmup, attribution_steps=args.attribution_steps,
                        memory_steps=args.memory_steps)
    refine = None
    if args.refine:
        from costmodel import load_profile

        if not args.output:
            raise AutoshardError("measure --refine PROFILE needs -o/--output for the refined profile")
        if cfg.attribution_steps < 1:
            raise AutoshardError("measure --refine needs --attribution-steps >= 1 (the in-step collectives are "
                                 "timed there)")
        load_profile(args.refine)  # a bad profile fails here, before any process starts
        refine = (args.refine, args.output)
        if os.path.exists(args.output):
            os.remove(args.output)  # written again only by a refinement that happened
    run_distributed(_measure_worker, (args.factory, args.plan, args.backend, cfg, args.bucket_mb,
                                      not args.no_overlap, args.json, refine), args.backend, args.nproc, "measure")
    if refine and not os.path.exists(args.output) and int(os.environ.get("RANK", "0")) == 0:
        raise AutoshardError(f"measure --refine: the plan ran no collective with a group of 2 or more ranks, so "
                             f"there is nothing to refit; {args.output} was not written")
    return 0


def _read_tokens(path: str | None) -> tuple[str, ...]:
    """The tokens of a token file: one per line; blank lines and ``#`` comments skipped."""
    if not path:
        return ()
    with open(path) as f:
        tokens = tuple(t.strip() for t in f if t.strip() and not t.lstrip().startswith("#"))
    if not tokens:
        from autoshard.errors import AutoshardError

        raise AutoshardError(f"--token-file {path}: expected one token per line, found none")
    return tokens


def _read_token(path: str | None) -> str | None:
    """A client's token: the first of the file."""
    tokens = _read_tokens(path)
    return tokens[0] if tokens else None


def cmd_serve(args) -> int:
    try:
        import uvicorn

        from autoshard.serve import ServiceConfig, create_app
    except ImportError as exc:
        from autoshard.errors import AutoshardError

        raise AutoshardError(f"autoshard serve needs the service extra ({exc.name} is missing): "
                         "pip install -c constraints.txt -e '.[serve]'") from None

    from autoshard.serve.store import redact

    tokens = _read_tokens(args.token_file)
    cfg = ServiceConfig(db=args.db, workers=args.workers, max_queue=args.max_queue, job_seconds=args.job_seconds,
                        max_time_limit=args.max_time_limit, tokens=tokens, max_body_bytes=args.max_body_bytes,
                        replica=args.replica or f"{socket.gethostname()}:{args.port}",
                        lease_seconds=args.lease_seconds, max_plan_age=args.max_plan_age,
                        max_plan_bytes=args.max_plan_bytes, rate_limit=args.rate_limit, rate_burst=args.rate_burst)
    from sqlalchemy.exc import OperationalError

    try:
        app = create_app(cfg)
    except OperationalError as exc:
        from autoshard.errors import AutoshardError

        raise AutoshardError(f"--db {redact(args.db)}: cannot open the database: {str(exc.orig).strip()}") from None
    _log(f"serving on http://{args.host}:{args.port} as replica {cfg.replica} (db {redact(args.db)}, "
         f"{args.workers} workers{f', {len(tokens)} token(s) accepted' if tokens else ''}); "
         "OpenAPI at /openapi.json, metrics at /metrics")
    # The process holds ~3e5 objects from its imports (torch among them) that live as long as
    # it does; a full collection walks them all (70 ms on an idle core here, several times
    # that on a loaded host), stalling every request in flight. Frozen, collections see only
    # what requests allocate.
    gc.collect()
    gc.freeze()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def _plan_on_server(args) -> int:
    from autoshard.client import PlanClient
    from autoshard.errors import AutoshardError

    if not args.model:
        raise AutoshardError("--server needs --model (a reference model as data: llama-8b, gpt2-small, ...); "
                             "a MODULE:FACTORY cannot be sent to a service")
    from autoshard.mesh import parse_mesh
    from autoshard.models.catalog import parse_reference

    family, preset = parse_reference(args.model)

    shape, names = parse_mesh(args.mesh)
    token = _read_token(args.token_file)
    pins = dict(p.split("=", 1) for p in args.pin)
    plan = PlanClient(args.server, token=token).plan(
        {"reference": family, "preset": preset}, batch=args.batch, seq=args.seq, mesh=dict(zip(names, shape)),
        profile=args.profile, memory_budget=args.memory_budget or "auto", pins=pins, time_limit=args.time_limit,
        # Reference shapes, as the demo plans them: bf16 compute unless --compute-dtype says otherwise.
        compute_dtype="bfloat16" if args.compute_dtype is None else _compute_dtype(args))
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
    from autoshard.explain import explain, explain_pipeline, load_any
    from autoshard.planfile import Plan

    plan = load_any(args.plan)
    print(explain(plan, top=args.top) if isinstance(plan, Plan) else explain_pipeline(plan, top=args.top))
    return 0


def cmd_diff(args) -> int:
    from autoshard.explain import diff_any, load_any

    print(diff_any(load_any(args.a), load_any(args.b)))
    return 0


def cmd_show(args) -> int:
    from autoshard.explain import load_any
    from autoshard.planfile import Plan

    plan = load_any(args.plan)
    if not isinstance(plan, Plan):  # pipelined: the stage table, then each distinct stage's plan
        print(plan.describe())
        for s, _ in plan.distinct_stages():
            print(f"\nstage {s.index} ({s.role}, layers {s.layers[0]}-{s.layers[1] - 1}; the plan of every "
                  f"{s.role} stage of {s.layers[1] - s.layers[0]} layers):")
            print(s.plan.describe(max_params=args.max_params))
        return 0
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
    ap.add_argument("-v", "--verbose", action="count", default=0, help="more progress output (debug)")
    ap.add_argument("-q", "--quiet", action="count", default=0, help="warnings and results only")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="plan LLaMA-8B shapes (or another reference model) on a fake 64-rank mesh")
    _common(d, "dp=8,tp=8", "bfloat16")
    d.add_argument("--model", default="llama-8b", metavar="FAMILY-PRESET|gpt",
                   help="reference shapes (default llama-8b; llama-1b/70b/405b, gpt2-small/medium, moe-tiny, "
                        "moe-mixtral-8x7b, moe-deepseek-v3: autoshard.models.catalog), or gpt: a small GPT sized by "
                        "--dim/--heads/--vocab")
    d.add_argument("--layers", type=int, default=None, help="depth (default: the preset's; gpt: 2)")
    d.add_argument("--dim", type=int, default=None, help="--model gpt only (default 1024)")
    d.add_argument("--heads", type=int, default=None, help="--model gpt only (default 16)")
    d.add_argument("--vocab", type=int, default=None, help="--model gpt only (default 8192)")
    d.add_argument("--batch", type=int, default=64, help="global batch (sequences)")
    d.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    d.set_defaults(func=cmd_demo)
    p = sub.add_parser("plan", help="plan a model made by MODULE:FACTORY() -> (model, example_inputs)")
    p.add_argument("factory", nargs="?", default=None)
    _common(p, None)
    p.add_argument("--server", default=None, help="ask this plan service (autoshard serve) instead of planning here")
    p.add_argument("--model", default=None, help="with --server: llama-PRESET or gpt2-PRESET (priced as bf16 "
                                                 "compute, as the demo, unless --compute-dtype says otherwise)")
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
    sv = sub.add_parser("serve", help="run the plan service (HTTP JSON API, SQLite or PostgreSQL store, solve "
                                      "workers; replicas share a PostgreSQL database)")
    sv.add_argument("--db", default="plans.sqlite",
                    help="SQLite file, or postgresql://user@host:port/db shared by several replicas")
    sv.add_argument("--replica", default=None,
                    help="this replica's name in the store (default HOST:PORT; a restart under the same name "
                         "takes back its jobs at once)")
    sv.add_argument("--lease-seconds", type=float, default=30.0,
                    help="a running job returns to the queue this long after its replica stops renewing it")
    sv.add_argument("--max-plan-age", type=float, default=None,
                    help="evict unpinned plans unused for this many seconds")
    sv.add_argument("--max-plan-bytes", type=parse_bytes, default=None,
                    help="evict least recently used unpinned plans beyond this total (e.g. 2GiB)")
    sv.add_argument("--rate-limit", type=float, default=None, help="requests/s per token (per address without)")
    sv.add_argument("--rate-burst", type=float, default=20.0, help="requests a client may send at once")
    sv.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--workers", type=int, default=2, help="solve worker processes")
    sv.add_argument("--max-queue", type=int, default=64)
    sv.add_argument("--job-seconds", type=float, default=600.0, help="a job is stopped past this")
    sv.add_argument("--max-time-limit", type=float, default=300.0, help="largest solver time limit a request may ask")
    sv.add_argument("--token-file", default=None,
                    help="require 'Authorization: Bearer <token>', one accepted token per line of this file")
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
    ms = sub.add_parser("measure", help="run a plan on real processes: predicted against measured step",
                        description="Run under torchrun (torchrun --nproc-per-node 8 -m autoshard measure "
                                    "mypkg:make --plan plan.json), or spawn local processes with --nproc.")
    ms.add_argument("factory", help="MODULE:FACTORY returning (model, example_inputs), as planned")
    ms.add_argument("--plan", required=True)
    ms.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    ms.add_argument("--nproc", type=int, default=None, help="spawn this many local processes (no torchrun)")
    ms.add_argument("--steps", type=int, default=10, help="timed steps (their median is the measured step)")
    ms.add_argument("--warmup", type=int, default=3)
    ms.add_argument("--attribution-steps", type=int, default=2,
                    help="steps run with every collective timed, for the per-collective rows")
    ms.add_argument("--memory-steps", type=int, default=2,
                    help="steps run last with AdamW under torch's memory tracker: measured peak memory per rank "
                         "beside the plan's (0: skip)")
    ms.add_argument("--bucket-mb", type=float, default=25.0)
    ms.add_argument("--no-overlap", action="store_true")
    ms.add_argument("--json", default=None, help="also write the measurement as JSON here")
    ms.add_argument("--refine", default=None, metavar="PROFILE",
                    help="refit this profile's collective fits to the collectives timed inside the steps")
    ms.add_argument("-o", "--output", default=None, help="with --refine: where the refined profile goes")
    ms.set_defaults(func=cmd_measure)
    s = sub.add_parser("show", help="print a plan file's summary")
    s.add_argument("plan")
    s.add_argument("--max-params", type=int, default=40)
    s.set_defaults(func=cmd_show)
    return ap


def main(argv=None) -> int:
    from autoshard.errors import USER_ERRORS

    args = build_parser().parse_args(argv)
    restore = _setup_logging(args.verbose - args.quiet)
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        print(f"autoshard: error: {exc}", file=sys.stderr)
        return 2
    # Anything else is a bug: Python prints the traceback and exits 1.
    finally:
        restore()


if __name__ == "__main__":
    sys.exit(main())
