"""Plan, apply and train a reference model on real processes.

    torchrun --nproc-per-node 4 -m autoshard.train --mesh dp=2,tp=2 --steps 5
    python -m autoshard.train --single --steps 5          # the single-process reference
    torchrun ... -m autoshard.train --steps 3 --save ckpt/ --save-plan plan.json
    torchrun ... -m autoshard.train --plan plan.json --resume ckpt/ --start-step 3 --steps 2
    torchrun ... -m autoshard.train --model llama --layers 4 --mesh pp=2,dp=2 --pipeline pp --microbatches 4

Rank 0 plans (or loads ``--plan``) and broadcasts the plan; every rank builds the
same model from the same seed, applies the plan with ``autoshard.parallelize`` and
runs AdamW steps on the same synthetic batches. Rank 0 prints one ``step N loss X``
line per step, so the loss curve can be compared with ``--single``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from autoshard.cli import microbatch_count


def build(seed: int, dim: int, layers: int, vocab: int, model: str = "gpt2", seq: int = 16):
    """The model to train: a GPT-style decoder; (``llama``) the reference LLaMA, four query heads
    over one key head, ``seq`` positions; or (``moe``) the reference mixture of experts with
    four experts, two per token, room for every choice (capacity factor 2)."""
    from autoshard.models import Transformer, TransformerConfig, llama
    from autoshard.models.moe import moe

    torch.manual_seed(seed)
    if model == "llama":
        return llama("tiny", dim=dim, n_layers=layers, vocab_size=vocab, n_heads=4, n_kv_heads=1,
                     ffn_dim=2 * dim, max_seq_len=seq)
    if model == "moe":
        return moe("tiny", dim=dim, n_layers=layers, vocab_size=vocab, n_heads=4, n_kv_heads=2, ffn_dim=2 * dim,
                   expert_dim=dim, capacity_factor=2.0)
    return Transformer(TransformerConfig(dim=dim, n_heads=4, n_layers=layers, vocab_size=vocab))


def batches(steps: int, batch: int, seq: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(steps)]


def loss_fn(logits):
    # Next-token-free toy objective: keeps the example dependency-free and deterministic.
    return logits.float().pow(2).mean()


def train(model, data, lr: float, report: bool, opt=None, start: int = 0, planned_step=None):
    """AdamW steps on ``data``; prints ``step N loss X`` (N from ``start``) when ``report``.

    With ``planned_step`` (an :class:`autoshard.runtime.replay.PlannedStep`), forward and backward
    run the planned graph with the planner's own redistributes."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=lr)
    for step, tokens in enumerate(data, start=start):
        if planned_step is not None:
            loss = planned_step(tokens)
        else:
            loss = loss_fn(model(tokens))
            loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()
        if report:
            print(f"step {step} loss {value:.8f}", flush=True)
    return opt


def train_pipelined(model, mesh, data, args) -> None:
    """Plan (rank 0) and run a pipelined plan: each rank's stages in torch's schedule, AdamW on
    their parameters; the rank of the last stage whose other coordinates are 0 prints the loss
    (the mean of the microbatches' losses)."""
    from autoshard.pipelined import pipeline_schedule
    from autoshard.planning.pipeline import PipelinePlan, plan_pipeline

    box = [None]
    if dist.get_rank() == 0:
        pplan = plan_pipeline(model, (data[0],), mesh, axis=args.pipeline, microbatches=args.microbatches,
                              schedule=args.schedule, stages_per_rank=args.stages_per_rank, profile=args.profile,
                              loss_fn=loss_fn, time_limit=60,
                              pins=dict(p.split("=", 1) for p in args.pin) or None)
        print(pplan.describe(), flush=True)
        box[0] = pplan.to_json()
        if args.save_plan:
            pplan.save(args.save_plan)
    dist.broadcast_object_list(box, src=0)
    pplan = PipelinePlan.from_json(box[0])
    schedule, stages = pipeline_schedule(model, pplan, mesh, (data[0],), loss_fn=lambda out, _target: loss_fn(out))
    opt = torch.optim.AdamW([p for m in stages for p in m.parameters()], lr=args.lr)
    pp_rank = mesh.get_local_rank(args.pipeline)
    first = pplan.stages[0].rank == pp_rank
    last = pplan.stages[-1].rank == pp_rank
    others = [mesh.get_local_rank(n) for n in pplan.axis_names if n != args.pipeline]
    for step, tokens in enumerate(data, start=args.start_step):
        losses: list = []
        schedule.step(*((tokens,) if first else ()), **({"target": tokens, "losses": losses} if last else {}))
        opt.step()
        opt.zero_grad()
        if last and not any(others):
            value = torch.stack([x.full_tensor() if hasattr(x, "full_tensor") else x for x in losses]).mean()
            print(f"step {step} loss {value.item():.8f}", flush=True)


def save_checkpoint(path: str, model, opt) -> None:
    """Each rank writes its own shards (torch.distributed.checkpoint): no full gather."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def load_checkpoint(path: str, model, opt) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def main(argv=None) -> int:
    from autoshard.options import RECOMPUTE

    ap = argparse.ArgumentParser(prog="python -m autoshard.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="dp=2,tp=2")
    ap.add_argument("--model", default="gpt2", choices=("gpt2", "llama", "moe"))
    ap.add_argument("--input-spec", default=None, metavar="SPEC",
                    help="the tokens' spec (S(0)S(1): batch over the first axis, sequence over the second)")
    ap.add_argument("--pin", action="append", default=[], metavar="FQN=SPEC",
                    help="pin parameters to a spec while planning (repeatable), e.g. 'layers.*.moe.experts.w*=S(0)R'")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="cpu-gloo")
    ap.add_argument("--plan", default=None, help="apply this plan file instead of planning")
    ap.add_argument("--save-plan", default=None, help="rank 0 writes the plan it used here")
    ap.add_argument("--single", action="store_true", help="train on one process without sharding")
    ap.add_argument("--save", default=None, help="write a sharded checkpoint (model + optimizer) here at the end")
    ap.add_argument("--resume", default=None,
                    help="build the model on the meta device, allocate only this rank's shards and load them "
                         "from this sharded checkpoint, then train steps --start-step onwards")
    ap.add_argument("--start-step", type=int, default=0)
    ap.add_argument("--replay", action="store_true",
                    help="run the planned graph op by op with the planner's redistributes (autoshard.runtime.replay)")
    ap.add_argument("--recompute", default="auto", choices=RECOMPUTE,
                    help="activation checkpointing of the repeated layers, planned (needs --layers 2 or more)")
    ap.add_argument("--compile", default=None, metavar="BACKEND",
                    help="torch.compile each rank's lowered programs with this backend (inductor, aot_eager, ...)")
    ap.add_argument("--pipeline", default=None, metavar="AXIS",
                    help="pipeline stages over this mesh axis (autoshard.planning.pipeline), run by torch's schedules")
    ap.add_argument("--microbatches", type=microbatch_count, default=4, help="a count, or 'auto'")
    ap.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe", "interleaved_1f1b"))
    ap.add_argument("--stages-per-rank", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = build(args.seed, args.dim, args.layers, args.vocab, args.model, args.seq)
    pins = dict(p.split("=", 1) for p in args.pin)
    data = batches(args.start_step + args.steps, args.batch, args.seq, args.vocab, args.seed)[args.start_step:]

    if args.single:
        train(model, data, args.lr, report=True, start=args.start_step)
        return 0

    from torch.distributed.device_mesh import init_device_mesh

    import autoshard
    from autoshard.planfile import Plan

    if "RANK" not in os.environ:
        print("error: run under torchrun (or pass --single)", file=sys.stderr)
        return 2
    dist.init_process_group("gloo")
    shape, names = autoshard.parse_mesh(args.mesh)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    if args.pipeline:
        train_pipelined(model, mesh, data, args)
        dist.barrier()
        dist.destroy_process_group()
        return 0
    box = [None]
    if dist.get_rank() == 0:
        if args.plan:
            box[0] = Plan.load(args.plan).to_json()
        else:
            plan = autoshard.plan(model, (data[0],), mesh, profile=args.profile, loss_fn=loss_fn, time_limit=60,
                                  recompute=args.recompute, pins=pins or None,
                                  input_specs=[args.input_spec] if args.input_spec else None)
            print(plan.describe(max_params=8), flush=True)
            box[0] = plan.to_json()
        if args.save_plan:
            Plan.from_json(box[0]).save(args.save_plan)
    dist.broadcast_object_list(box, src=0)
    plan = Plan.from_json(box[0])
    opt = None
    if args.resume:
        with torch.device("meta"):
            model = build(args.seed, args.dim, args.layers, args.vocab, args.model, args.seq)
        # Shards allocated, left for the checkpoint.
        model = autoshard.parallelize(model, plan, mesh, compile=args.compile or False)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        load_checkpoint(args.resume, model, opt)
    else:
        model = autoshard.parallelize(model, plan, mesh, compile=args.compile or False)
    planned = None
    if args.replay:
        from autoshard.runtime.replay import PlannedStep

        planned = PlannedStep(model, plan, mesh, (data[0],), loss_fn, profile=args.profile)
    opt = train(model, data, args.lr, report=dist.get_rank() == 0, opt=opt, start=args.start_step,
                planned_step=planned)
    if args.compile and dist.get_rank() == 0:
        compiled = [c for prog in model.forward.programs.values() for c in prog.compiled()]
        print(f"compiled programs ({args.compile}): {', '.join(compiled) or 'none'}", flush=True)
    if args.save:
        save_checkpoint(args.save, model, opt)
    # No rank may tear its gloo pairs down while a peer still talks to it: the last
    # collective of a step can finish on one rank before its peers have drained it.
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from costmodel.calibrate import exit_rank

    exit_rank(main())  # a gloo rank can abort in finalization after its work is done
