"""Compute time: a roofline with an efficiency factor and a launch floor."""

from __future__ import annotations

from costmodel.profile import Profile


def compute_time_us(flops: float, nbytes: float, profile: Profile, dtype: str | None = None,
                    pattern: str | None = None, side: float | None = None, kernel: str | None = None) -> float:
    """max(FLOPs / (peak(dtype) * efficiency * share(side)), bytes / bandwidth(pattern)), at
    least one kernel launch.

    ``dtype``: the torch dtype name the op computes in (``Profile.tflops``); None prices it at
    the planning dtype's peak. ``pattern``: a memory-bound op's access pattern
    (``Profile.bandwidth_gbps``); None a copy's bandwidth. ``side``: a matmul's size, the side
    of the cube of its M x N x K (``Profile.matmul_share``); None: at the calibrated rate.
    ``kernel``: a fused kernel's name (``Profile.kernel_share``: fused attention). Zero
    work costs nothing: views and metadata ops launch no kernel.
    """
    if flops <= 0 and nbytes <= 0:
        return 0.0
    t_flops = flops / (profile.tflops(dtype) * 1e6 * profile.compute_efficiency * profile.matmul_share(side)
                          * profile.kernel_share(kernel))
    t_mem = nbytes / (profile.bandwidth_gbps(pattern) * 1e3)
    return max(t_flops, t_mem, profile.kernel_launch_us)


def causal_share(q_len: int, k_len: int) -> float:
    """Share of the ``q_len x k_len`` attention scores a causal mask keeps (query ``i`` sees
    keys ``0..i``, the top-left alignment of torch's ``is_causal``)."""
    if q_len <= 0 or k_len <= 0:
        return 0.0
    m = min(q_len, k_len)
    kept = m * (m + 1) // 2 + (q_len - m) * k_len
    return kept / (q_len * k_len)


def causal_split_share(q_len: int, k_len: int, parts: int) -> float:
    """The busiest part's share of a causal kernel's kept scores when its ``q_len`` queries are
    split into ``parts`` contiguous parts of ``ceil(q_len / parts)`` (DTensor's split), every
    part seeing all ``k_len`` keys (top-left alignment): the last full part, whose queries see
    the most keys. A balanced split would give ``1 / parts``; contiguous parts of a long causal
    sequence give about ``(2 parts - 1) / parts**2``."""
    if q_len <= 0 or k_len <= 0 or parts <= 1:
        return 1.0
    chunk = -(-q_len // parts)
    best = max(_kept(min(start + chunk, q_len), k_len) - _kept(start, k_len) for start in range(0, q_len, chunk))
    return best / _kept(q_len, k_len)


def _kept(n: int, k_len: int) -> int:
    """Kept scores of causal queries ``0 .. n-1`` over ``k_len`` keys (query i keeps min(i+1, k_len))."""
    m = min(n, k_len)
    return m * (m + 1) // 2 + (n - m) * k_len


def balanced_split_share(q_len: int, k_len: int, parts: int) -> float:
    """The busiest part's share of a causal kernel's kept scores when its queries are cut into
    ``2 parts`` chunks and part ``r`` runs chunks ``2r`` and ``2 parts - 1 - 2r`` (each part
    its contiguous run's first half and its mirror's second half: the mirror exchange of
    :mod:`autoshard.graph.attention`); ``q_len`` a multiple of ``2 parts``. Near ``1 / parts``."""
    if q_len <= 0 or k_len <= 0 or parts <= 1:
        return 1.0
    c = q_len // (2 * parts)

    def chunk(j: int) -> int:
        return _kept((j + 1) * c, k_len) - _kept(j * c, k_len)

    return max(chunk(2 * r) + chunk(2 * parts - 1 - 2 * r) for r in range(parts)) / _kept(q_len, k_len)


def attention_flops(batch: int, heads: int, q_len: int, k_len: int, head_dim: int, v_dim: int, causal: bool,
                    backward: bool) -> float:
    """FLOPs of fused attention over ``heads`` query heads: forward ``2 B H L S (E + Ev)`` (the
    scores and their product with the values), backward ``2 B H L S (3 E + 2 Ev)`` (the scores
    recomputed, then dP, dV, dQ, dK), times the share of the scores a causal mask keeps (the
    kernels skip masked blocks)."""
    per = 2.0 * batch * heads * q_len * k_len * (causal_share(q_len, k_len) if causal else 1.0)
    return per * (3 * head_dim + 2 * v_dim if backward else head_dim + v_dim)
