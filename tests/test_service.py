"""The plan service against a real server on loopback: submit, poll, cache, share, limits,
tokens, restart durability, raw problems, uploaded profiles."""

import json
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from helpers import SHARDING_PROFILE  # noqa: E402

from autoshard.client import PlanClient, ServiceError  # noqa: E402
from autoshard.serve.process import ServerProcess  # noqa: E402

DATA = Path(__file__).parent / "data"


def tiny_request(dim=32, mesh=((2, 2), ("dp", "tp")), **extra):
    return {"model": {"reference": "llama", "preset": "tiny", "overrides": {"dim": dim, "n_layers": 2}},
            "batch": 8, "seq": 16, "mesh": {"shape": list(mesh[0]), "axis_names": list(mesh[1])},
            "profile": "h100-sxm", "time_limit": 30, **extra}


def Server(tmp: Path, *extra: str) -> ServerProcess:
    return ServerProcess(str(tmp / "plans.sqlite"), *extra).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("svc"), "--max-body-bytes", "64KiB")
    yield s
    s.stop()


@pytest.mark.timeout(300)
def test_submit_poll_fetch_and_cache(server):
    c = PlanClient(server.url)
    before = c.stats()["solves"]
    first = c.submit(tiny_request())
    assert first["status"] == "queued" and first["job_id"]
    body = c.wait(first, timeout=240)
    assert body["mesh"]["shape"] == [2, 2] and body["params"]
    job = c.job(first["job_id"])
    assert job["status"] == "done" and job["attempts"] == 1
    t0 = time.perf_counter()
    again = c.submit(tiny_request(time_limit=10))  # the time limit does not change the answer
    assert time.perf_counter() - t0 < 2.0
    assert again["status"] == "done" and again["cached"] and again["result"] == body
    assert c.stats()["solves"] == before + 1
    listed = {p["key"]: p for p in c.plans()}
    assert first["key"] in listed and listed[first["key"]]["summary"]["mesh"] == [2, 2]
    assert c._call("GET", f"/v1/plans/{first['key']}")[1] == body
    plan = c.plan({"reference": "llama", "preset": "tiny", "overrides": {"dim": 32, "n_layers": 2}}, batch=8,
                  seq=16, mesh={"dp": 2, "tp": 2}, time_limit=30)
    assert plan.to_json() == body


@pytest.mark.timeout(300)
def test_concurrent_identical_requests_share_one_solve(server):
    c = PlanClient(server.url)
    before = c.stats()["solves"]
    answers = []

    def ask():
        answers.append(c.submit(tiny_request(dim=48)))

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    jobs = {a["job_id"] for a in answers if a["status"] == "queued"}
    assert len(jobs) == 1, answers
    results = [c.wait(a, timeout=240) for a in answers]
    assert all(r == results[0] for r in results)
    assert c.stats()["solves"] == before + 1


def test_bad_requests_get_clear_4xx(server):
    c = PlanClient(server.url)
    cases = [
        (tiny_request() | {"model": {"reference": "llama", "preset": "9b"}}, 422, "expected one of"),
        (tiny_request() | {"model": {"reference": "llama", "overrides": {"depth": 3}}}, 422, "not LlamaConfig fields"),
        (tiny_request() | {"model": {}}, 422, "exactly one of"),
        (tiny_request() | {"profile": "tpu-v9"}, 422, "expected a shipped profile"),
        (tiny_request() | {"time_limit": 10_000}, 422, "exceeds this service's limit"),
        (tiny_request() | {"mesh": {"shape": [2, 2], "axis_names": ["dp"]}}, 422, "one distinct name per axis"),
        (tiny_request() | {"batch": -1}, 422, "batch"),
        (tiny_request() | {"compute_dtype": "int8"}, 422, "compute_dtype: expected a floating-point torch dtype"),
    ]
    for body, status, words in cases:
        with pytest.raises(ServiceError) as err:
            c.submit(body)
        assert err.value.status == status and words in str(err.value), (body, str(err.value))
    import urllib.error
    import urllib.request

    req = urllib.request.Request(server.url + "/v1/plans", data=b"{not json", method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 422 and "error" in json.loads(err.value.read())
    big = tiny_request() | {"pins": {f"p{i}": "RR" * 50 for i in range(900)}}
    with pytest.raises(ServiceError) as err:
        c.submit(big)
    assert err.value.status == 413 and "exceeds the limit" in str(err.value)
    with pytest.raises(ServiceError) as err:
        c.job("nope")
    assert err.value.status == 404


@pytest.mark.timeout(300)
def test_raw_problem_and_uploaded_profile(server):
    c = PlanClient(server.url)
    problem = json.loads((DATA / "iopddl_example.json").read_text())
    sol = c.solve_problem(problem, time_limit=5, timeout=240)
    assert sol["status"] == "optimal" and len(sol["choice"]) == len(problem["problem"]["nodes"]["costs"])
    with pytest.raises(ServiceError) as err:
        c.solve_problem({"problem": {"nodes": {}}}, time_limit=5)
    assert err.value.status == 422
    pid = c.upload_profile(SHARDING_PROFILE)
    assert pid.startswith("upload:") and pid in {p["id"] for p in c._call("GET", "/v1/profiles")[1]["uploaded"]}
    plan = c.wait(c.submit(tiny_request(profile=pid)), timeout=240)
    assert plan["profile"]["name"] == SHARDING_PROFILE.name


def test_token_is_enforced(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    s = Server(tmp_path, "--token-file", str(token))
    try:
        assert PlanClient(s.url).health()["status"] == "ok"  # health needs no token
        with pytest.raises(ServiceError) as err:
            PlanClient(s.url).stats()
        assert err.value.status == 401 and "bearer token" in str(err.value)
        with pytest.raises(ServiceError):
            PlanClient(s.url, token="wrong").plans()
        assert PlanClient(s.url, token="s3cret").plans() == []
    finally:
        s.stop()


@pytest.mark.timeout(400)
def test_restart_keeps_plans_and_reruns_interrupted_jobs(tmp_path):
    s = Server(tmp_path)
    try:
        c = PlanClient(s.url)
        done = c.wait(c.submit(tiny_request()), timeout=240)
        slow = c.submit(tiny_request(dim=64, mesh=((2, 2, 2), ("a", "b", "c"))))
        deadline = time.monotonic() + 120
        while c.job(slow["job_id"])["status"] != "running" and time.monotonic() < deadline:
            time.sleep(0.1)
        s.kill()  # SIGKILL mid-solve: no shutdown hook runs
        s.start()
        c = PlanClient(s.url)
        assert c.wait(c.submit(tiny_request()), timeout=10) == done  # the stored plan survived
        job = c.job(slow["job_id"])
        assert job["status"] in ("queued", "running", "done"), job
        result = c.wait(slow, timeout=300)
        assert result["mesh"]["shape"] == [2, 2, 2]
        assert c.job(slow["job_id"])["attempts"] >= 2
        assert c.stats()["running"] == 0 and c.stats()["queued"] == 0
    finally:
        s.stop()


def _metrics(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        return resp.read().decode()


def _sample(text: str, name: str, **labels) -> float:
    """The value of one Prometheus sample (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.timeout(300)
def test_metrics_count_requests_hits_and_queue(server):
    c = PlanClient(server.url)
    answer = c.submit(tiny_request(dim=40))
    c.wait(answer, timeout=240)
    before = _metrics(server.url)
    c.submit(tiny_request(dim=40))  # from the store
    with pytest.raises(ServiceError):
        c.job("missing")
    text = _metrics(server.url)
    assert _sample(text, "autoshard_cache_hits_total", kind="plan") == \
        _sample(before, "autoshard_cache_hits_total", kind="plan") + 1
    assert _sample(text, "autoshard_requests_total", endpoint="/v1/jobs/{job_id}", method="GET", status="404") >= 1
    assert _sample(text, "autoshard_requests_total", endpoint="/v1/plans", method="POST", status="200") >= 1
    deadline = time.monotonic() + 30  # the slot records the solve once the worker process has exited
    while _sample(text, "autoshard_solve_seconds_count", kind="plan") < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
        text = _metrics(server.url)
    assert _sample(text, "autoshard_solve_seconds_count", kind="plan") >= 1
    assert "autoshard_queue_depth " in text and _sample(text, "autoshard_jobs", status="done") >= 1
    assert _sample(text, "autoshard_plans_bytes") > 0
    assert 'autoshard_request_seconds_bucket{endpoint="/v1/plans",le="0.05"}' in text


def test_pins_through_the_api(server):
    c = PlanClient(server.url)
    body = c.wait(c.submit(tiny_request()), timeout=240)
    key = c.submit(tiny_request())["key"]
    assert c._call("PUT", f"/v1/plans/{key}/pin")[1] == {"key": key, "pinned": True}
    assert {p["key"]: p for p in c.plans()}[key]["pinned"]
    assert c._call("DELETE", f"/v1/plans/{key}/pin")[1]["pinned"] is False
    with pytest.raises(ServiceError) as err:
        c._call("PUT", "/v1/plans/sha256:nope/pin")
    assert err.value.status == 404
    assert body["params"]


def test_rate_limit_answers_429_with_retry_after(tmp_path):
    token = tmp_path / "tokens"
    token.write_text("# two tenants\nalpha\nbeta\n")
    s = Server(tmp_path, "--rate-limit", "0.5", "--rate-burst", "2", "--token-file", str(token))
    try:
        a = PlanClient(s.url, token="alpha")
        a.plans()
        a.plans()
        with pytest.raises(ServiceError) as err:
            a.plans()
        assert err.value.status == 429 and err.value.retry_after >= 1 and "rate limit" in str(err.value)
        PlanClient(s.url, token="beta").plans()  # another token has its own bucket
        PlanClient(s.url).health()  # health and metrics are never limited
        assert "autoshard_rate_limited_total" in _metrics(s.url)
        assert PlanClient(s.url, token="alpha", retries=3).plans() == []  # waits as told, then passes
    finally:
        s.stop()


@pytest.mark.timeout(400)
def test_orderly_stop_hands_running_jobs_back(tmp_path):
    """SIGTERM mid-solve: the replica's running job goes back to the queue (not failed), and
    the next start runs it to the end."""
    from autoshard.serve.store import Store

    s = Server(tmp_path)
    try:
        c = PlanClient(s.url)
        slow = c.submit(tiny_request(dim=64, mesh=((2, 2, 2), ("a", "b", "c"))))
        deadline = time.monotonic() + 120
        while c.job(slow["job_id"])["status"] != "running" and time.monotonic() < deadline:
            time.sleep(0.1)
        s.stop()  # SIGTERM: the service shuts down in order
        job = Store(s.db).job(slow["job_id"])
        assert job["status"] == "queued" and job["owner"] is None and "stopped" in job["phase"], job
        s.start()
        c = PlanClient(s.url)
        assert c.wait(slow, timeout=300)["mesh"]["shape"] == [2, 2, 2]
        assert c.job(slow["job_id"])["attempts"] == 2
    finally:
        s.stop()
