"""Prometheus metrics of one replica, served at ``/metrics`` (text exposition format).

=================================  ========================================================
metric                             what
=================================  ========================================================
autoshard_requests_total           requests by endpoint (route template), method, status
autoshard_request_seconds          request latency by endpoint (histogram)
autoshard_cache_hits_total         requests answered from the store, by kind
autoshard_rate_limited_total       requests refused with 429, by client (token digest)
autoshard_solve_seconds            wall time of the solves this replica ran, by kind
autoshard_jobs_reclaimed_total     jobs this replica re-queued after another's lease passed
autoshard_plans_evicted_total      plans this replica's eviction removed
autoshard_jobs                     jobs by status in the shared store (all replicas)
autoshard_queue_depth              queued jobs in the shared store (all replicas)
autoshard_plans_bytes              size of all stored plans
=================================  ========================================================

Counters are per replica (sum them over replicas); the gauges read the shared store at
scrape time, so every replica reports the same values for them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_SOLVE = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self, store):
        # One registry per app: several services in one process (tests) keep apart.
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("autoshard_requests", "HTTP requests", ["endpoint", "method", "status"], registry=r)
        self.latency = Histogram("autoshard_request_seconds", "HTTP request latency", ["endpoint"],
                                 buckets=_LATENCY, registry=r)
        self.cache_hits = Counter("autoshard_cache_hits", "requests answered from the store", ["kind"], registry=r)
        self.rate_limited = Counter("autoshard_rate_limited", "requests refused by the rate limit", ["client"],
                                    registry=r)
        self.solve_seconds = Histogram("autoshard_solve_seconds", "solve wall time on this replica", ["kind"],
                                       buckets=_SOLVE, registry=r)
        self.reclaimed = Counter("autoshard_jobs_reclaimed", "jobs re-queued after their lease passed",
                                 registry=r)
        self.evicted = Counter("autoshard_plans_evicted", "plans removed by eviction", registry=r)
        r.register(_StoreGauges(store))


class _StoreGauges:
    """Queue depth and job counts read from the database when scraped."""

    def __init__(self, store):
        self.store = store

    def collect(self):
        counts = self.store.status_counts()
        jobs = GaugeMetricFamily("autoshard_jobs", "jobs in the shared store by status", labels=["status"])
        for status in ("queued", "running", "done", "failed"):
            jobs.add_metric([status], counts.get(status, 0))
        yield jobs
        yield GaugeMetricFamily("autoshard_queue_depth", "queued jobs (all replicas)", value=counts.get("queued", 0))
        yield GaugeMetricFamily("autoshard_plans_bytes", "bytes of stored plans", value=self.store.plans_bytes())
