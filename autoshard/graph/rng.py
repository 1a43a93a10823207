"""Random ops in lowered programs: the same draws on every rank that holds the same shard.

A plan may replicate a tensor that a random op fills (dropout's mask): every rank that
holds a copy must draw the same values, or the copies silently diverge; ranks that hold
different shards must draw different ones. Each rank's own generator guarantees neither
(ranks are seeded independently; under LocalTensorMode all ranks share one generator).

So the lowering replaces each random op (``bernoulli``, ``native_dropout``, ``rand_like``,
``randn_like``, ``uniform_``, ``normal_``) on a DTensor by :func:`random_fill` on the local
shard, keyed by

    key = (op's ordinal in the program, this rank's coordinate on each mesh axis that
           shards the tensor, 0 on the axes that replicate it)

and seeded at run time by ``hash(run seed, key)``, where the run seed is the same on all
ranks and advances with every forward call (:func:`next_run`). Replicas therefore share a
key and a mask; shards differ. The draws differ from a single device's (another stream),
as any sharded random op's do.
"""

from __future__ import annotations

import hashlib

import torch

_RUN = {"seed": 0}


@torch.library.custom_op("autoshard::random_fill", mutates_args=())
def random_fill(like: torch.Tensor, kind: str, p: float, key: int) -> torch.Tensor:
    """A tensor shaped like ``like``: Bernoulli(``p``) (``kind="bernoulli"``), U[0, 1)
    (``"uniform"``) or N(0, 1) (``"normal"``), drawn from a generator seeded by the current run
    seed and ``key``."""
    digest = hashlib.blake2b(f"{_RUN['seed']}:{key}".encode(), digest_size=8).digest()
    gen = torch.Generator(device=like.device).manual_seed(int.from_bytes(digest, "little") >> 1)
    if kind == "bernoulli":
        u = torch.rand(like.shape, generator=gen, device=like.device, dtype=torch.float32)
        return (u < p).to(like.dtype)
    if kind == "uniform":
        return torch.rand(like.shape, generator=gen, device=like.device, dtype=like.dtype)
    if kind == "normal":
        return torch.randn(like.shape, generator=gen, device=like.device, dtype=like.dtype)
    raise ValueError(f"random_fill kind: expected bernoulli, uniform or normal, found {kind!r}")


@random_fill.register_fake
def _(like, kind, p, key):
    return torch.empty_like(like)


def next_run(seed: int) -> None:
    """Set the run seed for the next program run (the same on every rank)."""
    _RUN["seed"] = int(seed)


_A = torch.ops.aten
RANDOM_OPS = {
    _A.bernoulli_.float, _A.bernoulli.p, _A.bernoulli.default, _A.native_dropout.default, _A.rand_like.default,
    _A.randn_like.default, _A.uniform_.default, _A.normal_.default,
}
"""The random ops the lowering keys (others run on each rank's own generator)."""
RANDOM_FACTORIES = {_A.rand.default, _A.randn.default, _A.randint.default, _A.randint.low, _A.randperm.default}
"""Random ops that read no tensor (``torch.rand(batch, seq)``: ViTMAE's masking noise). Lowered as
any constant built inside forward, the same full value on every rank (a consumer takes its shard
locally), so every rank draws it whole with one key: on its own generator each would draw
another."""


def run_factory(op, args: tuple, kwargs: dict, key: int) -> torch.Tensor:
    """``op`` (one of :data:`RANDOM_FACTORIES`) drawn whole by :func:`random_fill`: the same value
    on every rank that runs it with ``key``."""
    fill = torch.ops.autoshard.random_fill
    options = {k: kwargs[k] for k in ("dtype", "device") if kwargs.get(k) is not None}
    if op is _A.randperm.default:
        n = int(args[0])
        u = fill(torch.empty(n, device=options.get("device")), "uniform", 0.0, key)
        return u.argsort().to(options.get("dtype", torch.int64))
    if op in (_A.randint.default, _A.randint.low):
        low, high, size = (0, args[0], args[1]) if op is _A.randint.default else args[:3]
        u = fill(torch.empty(tuple(size), device=options.get("device")), "uniform", 0.0, key)
        return (low + (u * (high - low)).floor()).to(options.get("dtype", torch.int64))
    like = torch.empty(tuple(args[0]), **options)
    return fill(like, "uniform" if op is _A.rand.default else "normal", 0.0, key)


def shard_key(ordinal: int, placements, coordinate: list[int], mesh_shape) -> int:
    """``key`` of the module doc: equal on ranks that hold the same shard."""
    key = ordinal
    for p, c, n in zip(placements, coordinate, mesh_shape):
        key = key * n + (c if p.is_shard() else 0)
    return key


def run_local(op, local: torch.Tensor, args: tuple, key: int):
    """``op`` (one of :data:`RANDOM_OPS`) on the local shard ``local`` by :func:`random_fill`:
    the result on local tensors (a pair for ``native_dropout``)."""
    fill = torch.ops.autoshard.random_fill
    if op in (_A.bernoulli_.float, _A.bernoulli.p):
        p = float(args[1]) if len(args) > 1 else 0.5
        drawn = fill(local, "bernoulli", p, key)
        return local.copy_(drawn) if op is _A.bernoulli_.float else drawn
    if op is _A.bernoulli.default:  # probabilities elementwise
        return (fill(local, "uniform", 0.0, key) < local).to(local.dtype)
    if op is _A.native_dropout.default:
        p, train = float(args[1]), args[2]
        if train is False or p == 0:
            return local.clone(), torch.ones_like(local, dtype=torch.bool)
        keep = fill(local, "bernoulli", 1.0 - p, key).to(torch.bool)
        return local * keep * (1.0 / (1.0 - p)), keep
    if op is _A.rand_like.default:
        return fill(local, "uniform", 0.0, key)
    if op is _A.randn_like.default:
        return fill(local, "normal", 0.0, key)
    if op is _A.uniform_.default:
        lo, hi = (float(args[1]) if len(args) > 1 else 0.0), (float(args[2]) if len(args) > 2 else 1.0)
        return local.copy_(fill(local, "uniform", 0.0, key) * (hi - lo) + lo)
    if op is _A.normal_.default:
        mean, std = (float(args[1]) if len(args) > 1 else 0.0), (float(args[2]) if len(args) > 2 else 1.0)
        return local.copy_(fill(local, "normal", 0.0, key) * std + mean)
    raise ValueError(f"{op} is not a keyed random op")
