"""The HTTP JSON API (FastAPI; OpenAPI at ``/openapi.json``, docs at ``/docs``).

=======  ======================  ==========================================================
method   path                    what
=======  ======================  ==========================================================
POST     /v1/plans               submit a planning request: 200 with the plan when cached,
                                 else 202 with a job id (identical requests share one job)
GET      /v1/plans               stored plans (key, model, mesh, predicted step, status)
GET      /v1/plans/{key}         one stored plan
GET      /v1/jobs/{id}           job status, phase, error; the result once done
POST     /v1/problems            submit a raw solver problem (IOPDDL JSON) -> job / cached
POST     /v1/profiles            upload a calibration profile -> ``upload:<digest>``
GET      /v1/profiles            shipped and uploaded profiles
GET      /v1/health              liveness (never needs the token)
GET      /v1/stats               solves performed, jobs queued / running
=======  ======================  ==========================================================

Errors are JSON ``{"error": message}``. Limits: request body size (413), request
time limit (422), a bounded queue (503 with Retry-After), an optional bearer token
(401 on every endpoint but health).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Body, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from autoshard.errors import ConfigError
from autoshard.serve.jobs import JobRunner, QueueFull
from autoshard.serve.requests import PlanRequest, canonical_plan_request, fingerprint
from autoshard.serve.store import Store


@dataclass
class ServiceConfig:
    """How the service runs."""

    db: str = "plans.sqlite"
    """SQLite file for jobs, plans and profiles (created and migrated on start)."""
    workers: int = 2
    """Solve worker slots (one spawned process per running job)."""
    max_queue: int = 64
    """Queued jobs beyond this are refused with 503."""
    job_seconds: float = 600.0
    """A job's process is killed past this and the job marked failed."""
    max_time_limit: float = 300.0
    """Largest solver time limit a request may ask for."""
    max_body_bytes: int = 8 * 2**20
    """Largest request body (413 beyond)."""
    token: str | None = None
    """Bearer token every endpoint but health requires; None: no authentication."""

    def __post_init__(self):
        if self.workers < 1 or self.max_queue < 1:
            raise ConfigError(f"workers and max_queue must be >= 1, found {self.workers} and {self.max_queue}")
        if not 0 < self.max_time_limit <= self.job_seconds:
            raise ConfigError(f"need 0 < max_time_limit ({self.max_time_limit}) <= job_seconds ({self.job_seconds})")


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def create_app(cfg: ServiceConfig) -> FastAPI:
    store = Store(cfg.db)
    runner = JobRunner(store, cfg.db, cfg.workers, cfg.max_queue, cfg.job_seconds)

    @asynccontextmanager
    async def lifespan(_app):
        runner.start()
        yield
        runner.stop()

    import autoshard

    app = FastAPI(title="autoshard plan service", version=autoshard.__version__, lifespan=lifespan)
    app.state.store, app.state.runner = store, runner

    @app.middleware("http")
    async def limits_and_auth(request: Request, call_next):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > cfg.max_body_bytes:
            return _error(413, f"request body of {size} bytes exceeds the limit of {cfg.max_body_bytes} bytes")
        if cfg.token is not None and request.url.path != "/v1/health":
            got = request.headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {cfg.token}".encode()):
                return _error(401, "missing or wrong bearer token (header 'Authorization: Bearer <token>')")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        parts = []
        for e in exc.errors():
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
        return _error(422, "; ".join(parts) or "invalid request")

    @app.exception_handler(HTTPException)
    async def http_error(_request, exc: HTTPException):
        return _error(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    shipped_digests: dict[str, str] = {}

    def _profile_digest(name: str) -> str:
        from costmodel import builtin_profiles, load_profile

        if name in shipped_digests:
            return shipped_digests[name]
        if name.startswith("upload:"):
            if store.profile(name[len("upload:"):]) is None:
                raise HTTPException(422, f"profile {name!r}: no uploaded profile with that id (GET /v1/profiles)")
            return name
        if name not in builtin_profiles():
            raise HTTPException(422, f"profile {name!r}: expected a shipped profile {builtin_profiles()} "
                                     "or 'upload:<id>' of an uploaded one")
        shipped_digests[name] = load_profile(name).digest()
        return shipped_digests[name]

    def _submit(kind: str, key: str, request: dict):
        text = store.plan_text(key)
        if text is not None:
            head = json.dumps({"status": "done", "cached": True, "key": key})[:-1]
            return Response(content=f'{head}, "result": {text}}}', media_type="application/json")
        try:
            job_id, created = runner.submit(kind, key, request)
        except QueueFull as exc:
            raise HTTPException(503, f"busy: {exc}; retry later", headers={"Retry-After": "5"}) from None
        return JSONResponse({"status": "queued", "cached": False, "shared": not created, "key": key,
                             "job_id": job_id}, status_code=202)

    @app.post("/v1/plans")
    def submit_plan(req: PlanRequest):
        if req.time_limit > cfg.max_time_limit:
            raise HTTPException(422, f"time_limit: {req.time_limit:g} s exceeds this service's limit of "
                                     f"{cfg.max_time_limit:g} s")
        digest = _profile_digest(req.profile)
        key = fingerprint("plan", canonical_plan_request(req), digest)
        return _submit("plan", key, req.model_dump())

    @app.get("/v1/plans")
    def list_plans(limit: int = 100):
        return {"plans": store.plans(min(max(limit, 1), 1000))}

    @app.get("/v1/plans/{key}")
    def get_plan(key: str):
        text = store.plan_text(key)
        if text is None:
            raise HTTPException(404, f"no stored plan with key {key!r}")
        return Response(content=text, media_type="application/json")

    @app.get("/v1/jobs/{job_id}")
    def get_job(job_id: str):
        job = store.job(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id!r}")
        out = {k: job[k] for k in ("id", "kind", "key", "status", "phase", "error", "attempts", "created",
                                   "updated")}
        if job["status"] == "done":
            out["result"] = store.plan(job["key"])
        return out

    @app.post("/v1/problems")
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
        return _submit("problem", key, {"problem": problem, "time_limit": time_limit})

    @app.post("/v1/profiles")
    def upload_profile(profile: dict = Body(...)):
        from costmodel import Profile

        try:
            prof = Profile.from_json(profile)
        except (KeyError, TypeError, ValueError) as exc:
            raise HTTPException(422, f"profile: not a valid profile: {type(exc).__name__}: {exc}") from None
        pid = prof.digest().split(":", 1)[1]
        store.add_profile(pid, prof.name, prof.to_json())
        return {"id": f"upload:{pid}", "name": prof.name}

    @app.get("/v1/profiles")
    def list_profiles():
        from costmodel import builtin_profiles

        return {"shipped": builtin_profiles(),
                "uploaded": [dict(p, id=f"upload:{p['id']}") for p in store.profiles()]}

    @app.get("/v1/health")
    def health():
        return {"status": "ok", "version": autoshard.__version__, "schema": store.schema_version()}

    @app.get("/v1/stats")
    def stats():
        return {"solves": store.counter("solves"), "queued": store.count_status("queued"),
                "running": store.count_status("running"), "failed": store.count_status("failed")}

    return app
