"""Fitting collective times: a robust alpha-beta line plus a monotone correction.

For one (kind, group) the samples are (bytes, microseconds). The fit is

    t(b) = alpha + beta * b                      (robust: Huber-weighted least squares
                                                  on relative residuals, so big messages
                                                  do not drown small ones, outliers are
                                                  down-weighted)
    t(b) = PL(b)     for b in [b_min, b_max]     (piecewise linear through the per-size
                                                  medians, made non-decreasing by
                                                  pool-adjacent-violators, interpolated
                                                  in log-log space)
    t(b) = PL(b_max) + beta * (b - b_max)        above the sweep (the line's slope)
    t(b) = alpha + (PL(b_min) - alpha) * b/b_min below it (down to the latency)

so predictions are monotone in bytes, exact on the sweep up to noise, and
extrapolate with the fitted bandwidth.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass, field

import numpy as np

from costmodel.errors import CostModelError
from costmodel.links import bus_factor


def _isotonic(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted pool-adjacent-violators: the closest non-decreasing sequence."""
    vals, weights, counts = [], [], []
    for yi, wi in zip(y.tolist(), w.tolist()):
        vals.append(yi)
        weights.append(wi)
        counts.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            wsum = weights[-2] + weights[-1]
            v = (vals[-2] * weights[-2] + vals[-1] * weights[-1]) / wsum
            c = counts[-2] + counts[-1]
            vals[-2:], weights[-2:], counts[-2:] = [v], [wsum], [c]
    return np.repeat(vals, counts)


def robust_alpha_beta(nbytes: np.ndarray, us: np.ndarray, iters: int = 30) -> tuple[float, float]:
    """alpha (us) and beta (us per byte) >= 0 minimizing a Huber loss on relative error."""
    b = np.asarray(nbytes, dtype=np.float64)
    t = np.asarray(us, dtype=np.float64)
    w = 1.0 / np.maximum(t, 1e-9) ** 2
    alpha, beta = float(t.min()), 0.0
    for _ in range(iters):
        sw = np.sqrt(w)
        A = np.stack([np.ones_like(b), b], axis=1) * sw[:, None]
        sol, *_ = np.linalg.lstsq(A, t * sw, rcond=None)
        alpha, beta = max(float(sol[0]), 0.0), max(float(sol[1]), 0.0)
        rel = (t - (alpha + beta * b)) / np.maximum(t, 1e-9)
        scale = 1.4826 * np.median(np.abs(rel - np.median(rel))) + 1e-6
        r = np.abs(rel) / (1.345 * scale)
        huber = np.where(r <= 1, 1.0, 1.0 / np.maximum(r, 1e-12))
        w = huber / np.maximum(t, 1e-9) ** 2
    return alpha, beta


@dataclass
class CollectiveFit:
    """Fitted time of one collective kind on one group."""

    kind: str
    group: str
    """Mesh axis names of the group, joined by '+' (a flattened group when several)."""
    group_size: int
    intra_node: bool
    """The group stays within one node."""
    alpha_us: float
    beta_us_per_byte: float
    knots_bytes: list[float] = field(default_factory=list)
    knots_us: list[float] = field(default_factory=list)
    """Monotone per-size medians the prediction interpolates."""

    def __post_init__(self):
        if self.alpha_us < 0 or self.beta_us_per_byte < 0:
            raise CostModelError(f"fit {self.kind}@{self.group}: alpha and beta must be >= 0")
        if len(self.knots_bytes) != len(self.knots_us):
            raise CostModelError(f"fit {self.kind}@{self.group}: {len(self.knots_bytes)} knot sizes but "
                             f"{len(self.knots_us)} knot times")
        if any(b2 <= b1 for b1, b2 in zip(self.knots_bytes, self.knots_bytes[1:])):
            raise CostModelError(f"fit {self.kind}@{self.group}: knot sizes must increase")
        if any(not b > 0 for b in self.knots_bytes) or any(not t >= 0 for t in self.knots_us):
            raise CostModelError(f"fit {self.kind}@{self.group}: knot sizes must be > 0 and knot times >= 0")
        if not self.group_size >= 1:
            raise CostModelError(f"fit {self.kind}@{self.group}: group_size must be >= 1, found {self.group_size}")
        self._logb = [math.log(b) for b in self.knots_bytes]
        self._logt = [math.log(max(t, 1e-9)) for t in self.knots_us]

    @property
    def busbw_gbps(self) -> float:
        """Bus bandwidth implied by beta, nccl-tests convention."""
        if self.beta_us_per_byte <= 0:
            return math.inf
        return bus_factor(self.kind, self.group_size) / self.beta_us_per_byte / 1e3

    def predict_one(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        kb, kt = self.knots_bytes, self.knots_us
        if not kb:
            return self.alpha_us + self.beta_us_per_byte * nbytes
        if nbytes >= kb[-1]:
            return kt[-1] + self.beta_us_per_byte * (nbytes - kb[-1])
        if nbytes <= kb[0]:
            floor = min(self.alpha_us, kt[0])
            return floor + (kt[0] - floor) * nbytes / kb[0]
        lb = math.log(nbytes)
        k = bisect.bisect_right(self._logb, lb) - 1
        f = (lb - self._logb[k]) / (self._logb[k + 1] - self._logb[k])
        return math.exp(self._logt[k] + f * (self._logt[k + 1] - self._logt[k]))

    def predict(self, nbytes) -> np.ndarray:
        """Vectorized :meth:`predict_one` (same pieces, numpy throughout)."""
        b = np.asarray(nbytes, dtype=np.float64)
        kb, kt = np.asarray(self.knots_bytes), np.asarray(self.knots_us)
        if kb.size == 0:
            return np.where(b > 0, self.alpha_us + self.beta_us_per_byte * b, 0.0)
        safe = np.maximum(b, 1e-300)
        mid = np.exp(np.interp(np.log(safe), np.log(kb), np.log(np.maximum(kt, 1e-9))))
        above = kt[-1] + self.beta_us_per_byte * (b - kb[-1])
        floor = min(self.alpha_us, kt[0])
        below = floor + (kt[0] - floor) * b / kb[0]
        out = np.where(b >= kb[-1], above, np.where(b <= kb[0], below, mid))
        return np.where(b > 0, out, 0.0)

    def to_json(self) -> dict:
        d = asdict(self)
        return d


def fit_collective(kind: str, group: str, group_size: int, intra_node: bool,
                   nbytes, us) -> CollectiveFit:
    """Fit samples of one (kind, group); several samples per size are summarized by their median."""
    b = np.asarray(nbytes, dtype=np.float64)
    t = np.asarray(us, dtype=np.float64)
    if b.shape != t.shape or b.size == 0:
        raise CostModelError(f"fit {kind}@{group}: expected equal, non-empty sample arrays, "
                             f"found {b.shape} and {t.shape}")
    if np.any(b <= 0) or np.any(t <= 0) or not np.all(np.isfinite(t)):
        raise CostModelError(f"fit {kind}@{group}: bytes and times must be positive and finite")
    alpha, beta = robust_alpha_beta(b, t)
    sizes = np.unique(b)
    med = np.array([np.median(t[b == s]) for s in sizes])
    counts = np.array([np.sum(b == s) for s in sizes], dtype=np.float64)
    mono = _isotonic(med, counts)
    mono = np.maximum(mono, 1e-6)
    return CollectiveFit(kind, group, int(group_size), bool(intra_node), alpha, beta,
                         sizes.tolist(), mono.tolist())
