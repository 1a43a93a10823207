"""The HTTP JSON API (FastAPI; OpenAPI at ``/openapi.json``, docs at ``/docs``).

=======  ======================  ==========================================================
method   path                    what
=======  ======================  ==========================================================
POST     /v1/plans               submit a planning request: 200 with the plan when cached,
                                 else 202 with a job id (identical requests share one job)
GET      /v1/plans               stored plans (key, model, mesh, predicted step, status)
GET      /v1/plans/{key}         one stored plan
PUT      /v1/plans/{key}/pin     keep a plan through eviction (DELETE: unpin)
GET      /v1/jobs/{id}           job status, phase, error; the result once done
POST     /v1/problems            submit a raw solver problem (IOPDDL JSON) -> job / cached
POST     /v1/profiles            upload a calibration profile -> ``upload:<digest>``
GET      /v1/profiles            shipped and uploaded profiles
GET      /v1/health              liveness (never needs the token)
GET      /v1/stats               solves performed, jobs queued / running, re-claimed, evicted
GET      /metrics                Prometheus metrics (:mod:`autoshard.serve.metrics`)
=======  ======================  ==========================================================

Errors are JSON ``{"error": message}``. Limits: request body size (413), request
time limit (422), a bounded queue (503 with Retry-After), bearer tokens (401 on every
endpoint but health and metrics), a per-client rate (429 with Retry-After).
Several replicas may serve one PostgreSQL database: any of them answers any request
(:mod:`autoshard.serve.store` says how they share the jobs).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import APIRouter, Body, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from autoshard.errors import ConfigError
from autoshard.serve.jobs import JobRunner, QueueFull
from autoshard.serve.limits import RateLimiter
from autoshard.serve.metrics import Metrics
from autoshard.serve.requests import PlanRequest, canonical_plan_request, fingerprint
from autoshard.serve.store import Store


@dataclass
class ServiceConfig:
    """How one replica of the service runs."""

    db: str = "plans.sqlite"
    """Where jobs, plans and profiles live: a SQLite file (created and migrated on start) or a
    ``postgresql://user[:password]@host[:port]/database`` URL shared by every replica."""
    workers: int = 2
    """Solve worker slots of this replica (one spawned process per running job)."""
    max_queue: int = 64
    """Queued jobs (all replicas together) beyond this are refused with 503."""
    job_seconds: float = 600.0
    """A job's process is killed past this and the job marked failed."""
    max_time_limit: float = 300.0
    """Largest solver time limit a request may ask for."""
    max_body_bytes: int = 8 * 2**20
    """Largest request body (413 beyond)."""
    tokens: tuple[str, ...] = ()
    """Bearer tokens accepted on every endpoint but health and metrics; empty: no authentication."""
    replica: str | None = None
    """This replica's name in the store (who holds a job). A restarted replica under the same
    name takes back its jobs at once; others wait for the lease. None: ``host:pid``."""
    lease_seconds: float = 30.0
    """A running job's claim lasts this long unless renewed (every third of it); after that,
    another replica re-queues the job."""
    max_attempts: int = 3
    """A job whose replicas died this many times is failed, not re-queued (a request that kills
    its worker must not take down every replica in turn)."""
    poll_seconds: float = 0.25
    """How often idle slots look for queued jobs submitted to other replicas."""
    max_plan_age: float | None = None
    """Seconds after its last use that an unpinned plan is evicted; None: kept."""
    max_plan_bytes: int | None = None
    """Stored plans beyond this total size lose their least recently used unpinned members."""
    evict_every: float = 60.0
    """Seconds between eviction passes."""
    rate_limit: float | None = None
    """Requests per second per token (per client address without tokens); None: unlimited."""
    rate_burst: float = 20.0
    """Requests a client may send at once before the rate applies."""

    def __post_init__(self):
        if self.workers < 1 or self.max_queue < 1:
            raise ConfigError(f"workers and max_queue must be >= 1, found {self.workers} and {self.max_queue}")
        if not 0 < self.max_time_limit <= self.job_seconds:
            raise ConfigError(f"need 0 < max_time_limit ({self.max_time_limit}) <= job_seconds ({self.job_seconds})")
        if not 0 < self.poll_seconds < self.lease_seconds:
            raise ConfigError(f"need 0 < poll_seconds ({self.poll_seconds}) < lease_seconds ({self.lease_seconds})")
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, found {self.max_attempts}")
        if self.rate_limit is not None and not (self.rate_limit > 0 and self.rate_burst >= 1):
            raise ConfigError(f"need rate_limit > 0 and rate_burst >= 1, found {self.rate_limit} and "
                              f"{self.rate_burst}")
        if any(not t or t != t.strip() for t in self.tokens):
            raise ConfigError("tokens: expected non-empty tokens without surrounding whitespace")
        if self.replica is None:
            self.replica = f"{socket.gethostname()}:{os.getpid()}"


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


class _Gate:
    """What every request passes before its route: the body size, the bearer token (all but
    ``OPEN_PATHS``) and the per-client rate."""

    OPEN_PATHS = ("/v1/health", "/metrics")

    def __init__(self, cfg: ServiceConfig, metrics: Metrics):
        self.cfg, self.metrics = cfg, metrics
        self.accepted = [f"Bearer {t}".encode() for t in cfg.tokens]
        self.limiter = RateLimiter(cfg.rate_limit, cfg.rate_burst) if cfg.rate_limit else None

    @staticmethod
    def client(request: Request) -> str:
        """Who a request counts against: its token's digest, else its address."""
        auth = request.headers.get("authorization", "")
        if auth:
            return "token:" + hashlib.sha256(auth.encode()).hexdigest()[:12]
        return "addr:" + (request.client.host if request.client else "unknown")

    def refuse(self, request: Request) -> JSONResponse | None:
        """The error response ``request`` gets, or None where it may pass."""
        cfg = self.cfg
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > cfg.max_body_bytes:
            return _error(413, f"request body of {size} bytes exceeds the limit of {cfg.max_body_bytes} bytes")
        if request.url.path in self.OPEN_PATHS:
            return None
        if self.accepted:
            got = request.headers.get("authorization", "").encode()
            # Every token compared, constant time each: no early exit tells which one is close.
            if not sum(hmac.compare_digest(got, t) for t in self.accepted):
                return _error(401, "missing or wrong bearer token (header 'Authorization: Bearer <token>')")
        if self.limiter is not None:
            client = self.client(request)
            wait = self.limiter.take(client)
            if wait > 0:
                self.metrics.rate_limited.labels(client=client).inc()
                return _error(429, f"rate limit: {cfg.rate_limit:g} requests/s (bursts of {cfg.rate_burst:g}) per "
                                   f"client; retry in {wait:.2f} s", {"Retry-After": RateLimiter.retry_after(wait)})
        return None

    def install(self, app: FastAPI) -> None:
        metrics = self.metrics

        @app.middleware("http")
        async def limits_auth_and_metrics(request: Request, call_next):
            t0 = time.perf_counter()
            response = self.refuse(request) or await call_next(request)
            route = request.scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            metrics.requests.labels(endpoint=endpoint, method=request.method, status=str(response.status_code)).inc()
            metrics.latency.labels(endpoint=endpoint).observe(time.perf_counter() - t0)
            return response


def _install_error_handlers(app: FastAPI) -> None:
    """Every error as JSON ``{"error": message}``."""

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        parts = []
        for e in exc.errors():
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
        return _error(422, "; ".join(parts) or "invalid request")

    @app.exception_handler(OperationalError)
    async def database_away(_request, exc: OperationalError):
        # A replica that lost its database answers like a full one: come back later.
        return _error(503, f"database unavailable: {str(exc.orig).strip()[:300]}; retry later", {"Retry-After": "2"})

    @app.exception_handler(StarletteHTTPException)  # FastAPI's own and the router's (404, 405)
    async def http_error(_request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), getattr(exc, "headers", None))


class _Submissions:
    """A request answered from the store where its plan is cached, else queued as a job."""

    def __init__(self, store: Store, runner: JobRunner, metrics: Metrics):
        self.store, self.runner, self.metrics = store, runner, metrics
        self.shipped_digests: dict[str, str] = {}

    def profile_digest(self, name: str) -> str:
        from costmodel import builtin_profiles, load_profile

        if name in self.shipped_digests:
            return self.shipped_digests[name]
        if name.startswith("upload:"):
            if self.store.profile(name[len("upload:"):]) is None:
                raise HTTPException(422, f"profile {name!r}: no uploaded profile with that id (GET /v1/profiles)")
            return name
        if name not in builtin_profiles():
            raise HTTPException(422, f"profile {name!r}: expected a shipped profile {builtin_profiles()} "
                                     "or 'upload:<id>' of an uploaded one")
        self.shipped_digests[name] = load_profile(name).digest()
        return self.shipped_digests[name]

    def submit(self, kind: str, key: str, request: dict):
        text = self.store.plan_text(key)
        if text is not None:
            self.metrics.cache_hits.labels(kind=kind).inc()
            head = json.dumps({"status": "done", "cached": True, "key": key})[:-1]
            return Response(content=f'{head}, "result": {text}}}', media_type="application/json")
        try:
            job_id, created = self.runner.submit(kind, key, request)
        except QueueFull as exc:
            raise HTTPException(503, f"busy: {exc}; retry later", headers={"Retry-After": "5"}) from None
        return JSONResponse({"status": "queued", "cached": False, "shared": not created, "key": key,
                             "job_id": job_id}, status_code=202)


def _plan_routes(cfg: ServiceConfig, store: Store, sub: _Submissions) -> APIRouter:
    """Plans, pins and jobs."""
    router = APIRouter()

    @router.post("/v1/plans")
    def submit_plan(req: PlanRequest):
        if req.time_limit > cfg.max_time_limit:
            raise HTTPException(422, f"time_limit: {req.time_limit:g} s exceeds this service's limit of "
                                     f"{cfg.max_time_limit:g} s")
        digest = sub.profile_digest(req.profile)
        key = fingerprint("plan", canonical_plan_request(req), digest)
        return sub.submit("plan", key, req.model_dump())

    @router.get("/v1/plans")
    def list_plans(limit: int = 100):
        return {"plans": store.plans(min(max(limit, 1), 1000))}

    @router.get("/v1/plans/{key}")
    def get_plan(key: str):
        text = store.plan_text(key)
        if text is None:
            raise HTTPException(404, f"no stored plan with key {key!r}")
        return Response(content=text, media_type="application/json")

    def _pin(key: str, pinned: bool):
        if not store.pin(key, pinned):
            raise HTTPException(404, f"no stored plan with key {key!r}")
        return {"key": key, "pinned": pinned}

    @router.put("/v1/plans/{key}/pin")
    def pin_plan(key: str):
        return _pin(key, True)

    @router.delete("/v1/plans/{key}/pin")
    def unpin_plan(key: str):
        return _pin(key, False)

    @router.get("/v1/jobs/{job_id}")
    def get_job(job_id: str):
        job = store.job(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id!r}")
        out = {k: job[k] for k in ("id", "kind", "key", "status", "phase", "error", "attempts", "owner",
                                   "created", "updated")}
        if job["status"] == "done":
            out["result"] = store.plan(job["key"])
            if out["result"] is None:
                out["phase"] = "done (its plan was evicted since: submit the request again)"
        return out

    return router


def _problem_and_profile_routes(cfg: ServiceConfig, store: Store, sub: _Submissions) -> APIRouter:
    """Raw solver problems and calibration profiles."""
    router = APIRouter()

    @router.post("/v1/problems")
    def submit_problem(problem: dict = Body(...), time_limit: float = 10.0):
        from solver import iopddl
        from solver.problem import ProblemError

        if not 0 < time_limit <= cfg.max_time_limit:
            raise HTTPException(422, f"time_limit: expected 0 < t <= {cfg.max_time_limit:g} s, found {time_limit}")
        try:
            iopddl.from_dict(problem)
        except (ProblemError, KeyError, TypeError, ValueError) as exc:
            raise HTTPException(422, f"problem: not a valid IOPDDL problem: {type(exc).__name__}: {exc}") from None
        canonical = json.dumps(problem, sort_keys=True)
        key = fingerprint("problem", {"problem": hashlib.sha256(canonical.encode()).hexdigest(),
                                      "time_limit": time_limit}, "")
        return sub.submit("problem", key, {"problem": problem, "time_limit": time_limit})

    @router.post("/v1/profiles")
    def upload_profile(profile: dict = Body(...)):
        from costmodel import Profile

        try:
            prof = Profile.from_json(profile)
        except (KeyError, TypeError, ValueError) as exc:
            raise HTTPException(422, f"profile: not a valid profile: {type(exc).__name__}: {exc}") from None
        pid = prof.digest().split(":", 1)[1]
        store.add_profile(pid, prof.name, prof.to_json())
        return {"id": f"upload:{pid}", "name": prof.name}

    @router.get("/v1/profiles")
    def list_profiles():
        from costmodel import builtin_profiles

        return {"shipped": builtin_profiles(),
                "uploaded": [dict(p, id=f"upload:{p['id']}") for p in store.profiles()]}

    return router


def _operations_routes(cfg: ServiceConfig, store: Store, metrics: Metrics) -> APIRouter:
    """Health, counters and Prometheus metrics."""
    import autoshard

    router = APIRouter()

    @router.get("/v1/health")
    def health():
        return {"status": "ok", "version": autoshard.__version__, "schema": store.schema_version(),
                "replica": cfg.replica, "database": store.dialect}

    @router.get("/v1/stats")
    def stats():
        counts = store.status_counts()
        return {"solves": store.counter("solves"), "queued": counts.get("queued", 0),
                "running": counts.get("running", 0), "failed": counts.get("failed", 0),
                "reclaimed": store.counter("reclaimed"), "evicted": store.counter("evicted"),
                "replica": cfg.replica}

    @router.get("/metrics", include_in_schema=False)
    def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(content=generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return router


def create_app(cfg: ServiceConfig, run_jobs: bool = True) -> FastAPI:
    """The service's app. ``run_jobs=False``: an API-only replica that queues jobs but runs
    none (another replica runs them; the API's fuzz tests use it)."""
    import autoshard

    store = Store(cfg.db)
    metrics = Metrics(store)
    runner = JobRunner(store, cfg.db, cfg, metrics)

    @asynccontextmanager
    async def lifespan(_app):
        if run_jobs:
            runner.start()
        yield
        if run_jobs:
            runner.stop()

    app = FastAPI(title="autoshard plan service", version=autoshard.__version__, lifespan=lifespan)
    app.state.store, app.state.runner, app.state.metrics = store, runner, metrics
    _Gate(cfg, metrics).install(app)
    _install_error_handlers(app)
    sub = _Submissions(store, runner, metrics)
    app.include_router(_plan_routes(cfg, store, sub))
    app.include_router(_problem_and_profile_routes(cfg, store, sub))
    app.include_router(_operations_routes(cfg, store, metrics))
    return app
