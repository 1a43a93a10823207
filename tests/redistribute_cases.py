"""Spec enumeration shared by the redistribute tests and benchmark."""

import itertools

from costmodel import Spec


def all_specs(mesh_ndim: int, ndim: int, partials=("P(sum)", "P(avg)")) -> list[Spec]:
    """Every spec: R, S(d), partials per axis, and every shard order of multiply-sharded dims."""
    opts = ["R"] + [f"S({d})" for d in range(ndim)] + list(partials)
    out = []
    for combo in itertools.product(opts, repeat=mesh_ndim):
        per_dim = [[a for a, p in enumerate(combo) if p == f"S({d})"] for d in range(ndim)]
        choices = [list(itertools.permutations(axes)) if len(axes) > 1 else [tuple(axes)] for axes in per_dim]
        for orders in itertools.product(*choices):
            order = tuple((d, o) for d, o in enumerate(orders) if len(o) > 1 and list(o) != sorted(o))
            out.append(Spec(tuple(combo), order))
    return out
