"""``PlanClient``: ask a plan service (``autoshard serve``) for plans, like the local planner.

    client = PlanClient("http://127.0.0.1:8000", token=None)
    plan = client.plan({"reference": "llama", "preset": "8b"}, batch=64, seq=2048,
                       mesh={"dp": 8, "tp": 8}, profile="h100-sxm")

Several replicas (``"http://a:8000,http://b:8000"`` or a list): a request that gets no
answer, a 503 (busy, database away) or a 429 (rate limit) moves on to the next replica
and is retried, up to ``retries`` times, waiting as ``Retry-After`` says (capped).
Every request is safe to repeat: a submit of the same question shares one job.

Standard library only (urllib): a training script needs nothing more than autoshard.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from autoshard.errors import AutoshardError
from autoshard.planfile import Plan


class ServiceError(AutoshardError):
    """The service refused a request or a job failed; ``status`` is the HTTP status (0: no answer)."""

    def __init__(self, message: str, status: int = 0, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


_RETRY_STATUS = (0, 429, 503)


class PlanClient:
    def __init__(self, url: str | list[str], token: str | None = None, timeout: float = 30.0, retries: int = 0,
                 max_wait: float = 5.0, first: int = 0):
        """``first``: index of the replica asked first (clients spread over replicas)."""
        urls = url.split(",") if isinstance(url, str) else list(url)
        self.urls = [u.strip().rstrip("/") for u in urls if u.strip()]
        if not self.urls:
            raise ValueError(f"PlanClient: expected at least one service URL, found {url!r}")
        self.token = token
        self.timeout = timeout
        self.retries = retries
        self.max_wait = max_wait
        self._next = first

    @property
    def url(self) -> str:
        """The replica the next request goes to."""
        return self.urls[self._next % len(self.urls)]

    def _call(self, method: str, path: str, body=None, query: str = "") -> tuple[int, dict]:
        for attempt in range(self.retries + 1):
            try:
                return self._call_once(self.url, method, path, body, query)
            except ServiceError as exc:
                if exc.status not in _RETRY_STATUS or attempt == self.retries:
                    raise
                self._next += 1  # the next replica
                # A whole round of replicas refused: wait before the next round.
                if (attempt + 1) % len(self.urls) == 0:
                    time.sleep(min(self.max_wait, exc.retry_after or 0.2 * 2 ** min(attempt, 5)))
        raise AssertionError("unreachable")

    def _call_once(self, base: str, method: str, path: str, body, query: str) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(base + path + (f"?{query}" if query else ""), data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            try:
                msg = json.loads(exc.read()).get("error", exc.reason)
            except ValueError:
                msg = exc.reason
            after = exc.headers.get("Retry-After") if exc.headers else None
            raise ServiceError(f"{method} {path}: HTTP {exc.code}: {msg}", exc.code,
                               float(after) if after and after.isdigit() else None) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ServiceError(f"{method} {path}: no answer from {base}: {reason}") from None

    # -- raw endpoints ----------------------------------------------------------
    def health(self) -> dict:
        return self._call("GET", "/v1/health")[1]

    def stats(self) -> dict:
        return self._call("GET", "/v1/stats")[1]

    def submit(self, request: dict) -> dict:
        """POST /v1/plans: ``{"status": "done", "result": plan}`` when cached, else a job id."""
        return self._call("POST", "/v1/plans", request)[1]

    def job(self, job_id: str) -> dict:
        return self._call("GET", f"/v1/jobs/{job_id}")[1]

    def wait(self, answer: dict, timeout: float = 600.0, poll: float = 0.2) -> dict:
        """The result of a submit answer: at once when cached, else polled until done."""
        if answer.get("status") == "done":
            return answer["result"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(answer["job_id"])
            if job["status"] == "done":
                return job["result"]
            if job["status"] == "failed":
                raise ServiceError(f"job {job['id']} failed: {job['error']}")
            time.sleep(poll)
        raise ServiceError(f"job {answer['job_id']} not done after {timeout:g} s")

    def plans(self) -> list[dict]:
        return self._call("GET", "/v1/plans")[1]["plans"]

    def upload_profile(self, profile) -> str:
        """Upload a profile (a ``costmodel.Profile``, its JSON dict, or a file path); returns its id."""
        from costmodel import Profile, load_profile

        if isinstance(profile, Profile):
            profile = profile.to_json()
        elif not isinstance(profile, dict):
            profile = load_profile(profile).to_json()
        return self._call("POST", "/v1/profiles", profile)[1]["id"]

    def solve_problem(self, problem: dict, time_limit: float = 10.0, timeout: float = 600.0) -> dict:
        """A raw IOPDDL problem -> ``{"choice", "cost", "status", "lower_bound", "seconds"}``."""
        answer = self._call("POST", "/v1/problems", problem, query=f"time_limit={time_limit}")[1]
        return self.wait(answer, timeout)

    # -- like the local planner ---------------------------------------------------
    def plan(self, model: dict, batch: int, seq: int, mesh: dict, profile: str = "h100-sxm",
             memory_budget="auto", pins: dict | None = None, time_limit: float = 60.0,
             timeout: float = 600.0, compute_dtype: str | None = "bfloat16") -> Plan:
        """A ``Plan`` for a model described as data (see :mod:`autoshard.serve.requests`);
        ``mesh`` maps axis names to sizes, in order; ``compute_dtype``: the dtype every op is
        priced in (None: as traced, float32)."""
        request = {"model": model, "batch": batch, "seq": seq,
                   "mesh": {"shape": list(mesh.values()), "axis_names": list(mesh)},
                   "profile": profile, "memory_budget": memory_budget, "pins": pins or {},
                   "time_limit": time_limit, "compute_dtype": compute_dtype}
        return Plan.from_json(self.wait(self.submit(request), timeout))
