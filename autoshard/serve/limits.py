"""Per-client rate limits: a token bucket per bearer token (per client address without one).

``rate`` requests per second on average, bursts up to ``burst``. A refused request is
told when the next one would pass (``Retry-After``, whole seconds, at least 1). The
buckets live in the replica's memory: behind a load balancer over R replicas a client
can reach up to R times the rate, which the operator sizes for.
"""

from __future__ import annotations

import math
import threading
import time


class RateLimiter:
    def __init__(self, rate: float, burst: float, max_clients: int = 100_000):
        self.rate, self.burst, self.max_clients = rate, burst, max_clients
        self.buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, last refill time)
        self.lock = threading.Lock()

    def take(self, client: str, now: float | None = None) -> float:
        """0 when the request may pass (one token spent), else seconds until it would."""
        now = time.monotonic() if now is None else now
        with self.lock:
            tokens, last = self.buckets.get(client, (self.burst, now))
            tokens = min(self.burst, tokens + (now - last) * self.rate)
            if tokens >= 1.0:
                if len(self.buckets) >= self.max_clients and client not in self.buckets:
                    self._forget_full(now)
                self.buckets[client] = (tokens - 1.0, now)
                return 0.0
            self.buckets[client] = (tokens, now)
            return (1.0 - tokens) / self.rate

    def _forget_full(self, now: float) -> None:
        """Drop buckets that have refilled (they hold nothing a new bucket would not)."""
        for client, (tokens, last) in list(self.buckets.items()):
            if tokens + (now - last) * self.rate >= self.burst:
                del self.buckets[client]

    @staticmethod
    def retry_after(seconds: float) -> str:
        return str(max(1, math.ceil(seconds)))
