"""Three ``autoshard serve`` replicas on one real PostgreSQL: any replica answers, identical
questions asked of different replicas share one job, and a replica SIGKILLed mid-solve
loses nothing: its job returns after the lease and another replica finishes it, once."""

import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("sqlalchemy")

from test_service import _metrics, _sample, tiny_request  # noqa: E402
from test_service_store import _need_pg  # noqa: E402

from autoshard.client import PlanClient  # noqa: E402
from autoshard.serve.postgres import LocalPostgres  # noqa: E402
from autoshard.serve.process import ServerProcess  # noqa: E402

LEASE = 3.0


@pytest.fixture(scope="module")
def replicas():
    _need_pg()
    with LocalPostgres() as pg:
        servers = [ServerProcess(pg.url, "--lease-seconds", str(LEASE), workers=1, replica=f"r{i}")
                   for i in range(3)]
        try:
            for s in servers:
                s.start()
            yield servers
        finally:
            for s in servers:
                s.stop()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_replicas_share_questions_and_survive_a_kill(replicas):
    a, b, c = (PlanClient(s.url) for s in replicas)
    assert {x.health()["database"] for x in (a, b, c)} == {"postgresql"}

    # The same question to three replicas at once: one job, one solve.
    answers = []
    threads = [threading.Thread(target=lambda x=x: answers.append(x.submit(tiny_request(dim=48))))
               for x in (a, b, c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({ans["job_id"] for ans in answers}) == 1, answers
    result = c.wait(answers[0], timeout=240)  # polled on another replica than the one asked
    assert b.submit(tiny_request(dim=48))["result"] == result
    assert a.stats()["solves"] == 1

    # Kill whichever replica runs a job, mid-solve.
    slow = a.submit(tiny_request(dim=64, mesh=((2, 2, 2), ("x", "y", "z"))))
    deadline = time.monotonic() + 120
    while (job := a.job(slow["job_id"]))["status"] != "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    owner = job["owner"]
    victim = next(s for s in replicas if s.replica == owner)
    victim.kill()
    survivors = [s for s in replicas if s is not victim]
    client = PlanClient([s.url for s in replicas], retries=10)  # a dead URL in the list is skipped
    body = client.wait(slow, timeout=300)
    assert body["mesh"]["shape"] == [2, 2, 2]
    job = client.job(slow["job_id"])
    assert job["status"] == "done" and job["attempts"] == 2 and job["owner"] != owner
    stored = {p["key"]: p for p in client.plans()}
    assert stored[slow["key"]]["solves"] == 1 and client.stats()["solves"] == 2
    assert client.stats()["running"] == 0
    assert sum(_sample(_metrics(s.url), "autoshard_jobs_reclaimed_total") for s in survivors) == 1
    victim.start()  # back under its name; nothing of its own is left to take
    assert PlanClient(victim.url).stats()["running"] == 0
