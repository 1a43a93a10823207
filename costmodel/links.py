"""The alpha-beta link model, the one formula every collective cost comes from.

nccl-tests conventions: algbw = bytes / time and busbw = algbw * f(n) with
f = 2(n-1)/n for all_reduce and (n-1)/n for all_gather, reduce_scatter and
all_to_all, so

    time(kind, bytes, n) = alpha + bytes * f_kind(n) / busbw        (0 when n <= 1)

``bytes`` is the size of the full (gathered / reduced) buffer, as nccl-tests reports it.
A leaf module: profiles, fits and collectives all import it, it imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from costmodel.errors import CostModelError

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
_BUS_FACTOR = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: np.ones_like(n, dtype=np.float64) if isinstance(n, np.ndarray) else 1.0,
}


def bus_factor(kind: str, n):
    """nccl-tests' busbw / algbw for ``kind`` on ``n`` ranks (a float, or an array for an array)."""
    if kind not in _BUS_FACTOR:
        raise ValueError(f"collective kind must be one of {KINDS}, found {kind!r}")
    if isinstance(n, np.ndarray):
        return _BUS_FACTOR[kind](n.astype(np.float64))
    return float(_BUS_FACTOR[kind](float(n)))


def alpha_beta_line(latency_us: float, busbw_gbps: float, kind: str, group_size):
    """``(alpha, us per byte)`` of the formula above for ``kind`` on ``group_size`` ranks."""
    return latency_us, bus_factor(kind, group_size) / (busbw_gbps * 1e3)


def alpha_beta_us(latency_us: float, busbw_gbps: float, kind: str, nbytes, group_size):
    """The formula above, vectorized over ``nbytes`` and ``group_size``: microseconds."""
    n = np.asarray(group_size, dtype=np.float64)
    alpha, per_byte = alpha_beta_line(latency_us, busbw_gbps, kind, n)
    return np.where(n <= 1, 0.0, alpha + np.asarray(nbytes, dtype=np.float64) * per_byte)


@dataclass(frozen=True)
class LinkModel:
    """Alpha-beta model of one class of links, in nccl-tests bus-bandwidth terms."""

    latency_us: float
    """Fixed cost per collective, microseconds."""
    busbw_gbps: float
    """Bus bandwidth, GB/s (1e9 bytes/s), as nccl-tests reports it."""

    def __post_init__(self):
        if self.latency_us < 0:
            raise CostModelError(f"latency_us must be >= 0, found {self.latency_us}")
        if not self.busbw_gbps > 0:
            raise CostModelError(f"busbw_gbps must be > 0, found {self.busbw_gbps}")

    def time_us(self, kind: str, nbytes, group_size):
        """:func:`alpha_beta_us` on this link."""
        return alpha_beta_us(self.latency_us, self.busbw_gbps, kind, nbytes, group_size)

    def line(self, kind: str, group_size: int) -> tuple[float, float]:
        """:func:`alpha_beta_line` on this link: ``(alpha us, us per byte)``."""
        return alpha_beta_line(self.latency_us, self.busbw_gbps, kind, group_size)
