"""The service's store on SQLite and on a real PostgreSQL server (started from the
distribution's binaries): migrations, one active job per question, claims that never
hand a job to two replicas, leases, owner-checked results, eviction with pins."""

import json
import os
import sqlite3
import threading
import time

import pytest

pytest.importorskip("sqlalchemy")

from autoshard.serve.postgres import LocalPostgres, postgres_bin  # noqa: E402
from autoshard.serve.store import MIGRATIONS, QueueFull, Store, database_url  # noqa: E402


def _need_pg():
    if postgres_bin() is None:
        if os.environ.get("AUTOSHARD_REQUIRE_PG"):
            pytest.fail("AUTOSHARD_REQUIRE_PG is set but no PostgreSQL binaries were found")
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) on this machine")


@pytest.fixture(scope="module")
def pg():
    _need_pg()
    with LocalPostgres() as server:
        yield server


_fresh = iter(range(10**6))


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path):
    """A URL of an empty database of each dialect."""
    if request.param == "sqlite":
        return str(tmp_path / "plans.sqlite")
    server = request.getfixturevalue("pg")
    from sqlalchemy import create_engine, text

    name = f"t{next(_fresh)}_{os.getpid()}"
    eng = create_engine(database_url(server.url), isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.execute(text(f"CREATE DATABASE {name}"))
    eng.dispose()
    return server.url.rsplit("/", 1)[0] + "/" + name


def test_migrates_and_reopens(db):
    s = Store(db)
    assert s.schema_version() == len(MIGRATIONS)
    s.close()
    s = Store(db)  # a second start (or replica) finds it current
    assert s.schema_version() == len(MIGRATIONS)
    s.close()


def test_sqlite_file_of_the_previous_store_migrates_in_place(tmp_path):
    """A v2 file (the SQLite-only store's schema) keeps its plans and jobs."""
    path = tmp_path / "old.sqlite"
    con = sqlite3.connect(path)
    con.executescript("""
        CREATE TABLE schema (version INTEGER NOT NULL); INSERT INTO schema VALUES (2);
        CREATE TABLE jobs (id TEXT PRIMARY KEY, kind TEXT NOT NULL, key TEXT NOT NULL, status TEXT NOT NULL,
                           phase TEXT, request TEXT NOT NULL, error TEXT, created REAL, updated REAL,
                           attempts INTEGER NOT NULL DEFAULT 0);
        CREATE TABLE plans (key TEXT PRIMARY KEY, kind TEXT NOT NULL, body TEXT NOT NULL, summary TEXT, created REAL);
        CREATE TABLE profiles (id TEXT PRIMARY KEY, name TEXT, body TEXT NOT NULL, created REAL);
        CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
        INSERT INTO plans VALUES ('k1', 'plan', '{"x": 1}', '{}', 5.0);
        INSERT INTO jobs VALUES ('j1', 'plan', 'k2', 'queued', 'queued', '{}', NULL, 1.0, 1.0, 0);
        INSERT INTO counters VALUES ('solves', 7);
    """)
    con.close()
    s = Store(str(path))
    assert s.schema_version() == len(MIGRATIONS)
    assert s.plan("k1") == {"x": 1} and s.plans()[0]["size"] == len('{"x": 1}') and s.counter("solves") == 7
    assert s.submit("plan", "k2", {}, 10) == ("j1", False)  # the old active job is still shared
    assert s.claim("r", 30)["id"] == "j1"


def test_newer_schema_is_refused(tmp_path):
    path = str(tmp_path / "p.sqlite")
    Store(path).close()
    con = sqlite3.connect(path)
    con.execute("UPDATE schema SET version = 99")
    con.commit()
    con.close()
    with pytest.raises(RuntimeError, match="schema v99, newer than this autoshard"):
        Store(path)


def test_one_active_job_per_question_across_replicas(db):
    stores = [Store(db) for _ in range(4)]
    ids, errors = [], []

    def submit(s):
        try:
            ids.append(s.submit("plan", "same-question", {"q": 1}, 100))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=submit, args=(s,)) for s in stores for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len({i for i, _ in ids}) == 1 and sum(created for _, created in ids) == 1
    # Once it ends, the same question makes a new job.
    job = stores[0].claim("r0", 30)
    assert stores[0].finish(job["id"], "r0", "same-question", "plan", {"p": 1}, {})
    again, created = stores[1].submit("plan", "same-question", {"q": 1}, 100)
    assert created and again != job["id"]
    for s in stores:
        s.close()


def test_claims_never_hand_a_job_to_two_replicas(db):
    seed = Store(db)
    want = {seed.submit("plan", f"q{i}", {}, 1000)[0] for i in range(60)}
    stores = [Store(db) for _ in range(4)]
    got: list[tuple[str, str]] = []

    def drain(k, s):
        while (job := s.claim(f"r{k}", 30)) is not None:
            got.append((job["id"], job["owner"]))

    threads = [threading.Thread(target=drain, args=(k, s)) for k, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = [i for i, _ in got]
    assert sorted(ids) == sorted(want), "every job claimed exactly once"
    assert seed.status_counts() == {"running": 60}
    for s in [seed, *stores]:
        s.close()


def test_results_count_once_and_only_from_the_owner(db):
    s = Store(db)
    job_id, _ = s.submit("plan", "k", {}, 10)
    job = s.claim("alive", 30)
    assert job["id"] == job_id and job["attempts"] == 1
    assert not s.finish(job_id, "someone-else", "k", "plan", {"bad": 1}, {})
    assert s.plan("k") is None
    assert s.finish(job_id, "alive", "k", "plan", {"good": 1}, {"n": 1})
    assert not s.finish(job_id, "alive", "k", "plan", {"twice": 1}, {})  # already done
    assert s.plan("k") == {"good": 1} and s.counter("solves") == 1 and s.plans()[0]["solves"] == 1
    assert s.job(job_id)["status"] == "done"


def test_leases_requeue_a_dead_replicas_job_then_give_up(db):
    s = Store(db)
    job_id, _ = s.submit("plan", "k", {}, 10)
    s.claim("dies", 0.05)
    assert s.renew(job_id, "dies", 0.05)
    assert not s.renew(job_id, "other", 30)
    time.sleep(0.1)
    assert s.reap(max_attempts=2) == (1, 0)
    job = s.job(job_id)
    assert job["status"] == "queued" and job["owner"] is None and "re-claimed" in job["phase"]
    assert not s.renew(job_id, "dies", 30)  # the dead owner cannot take it back
    assert s.claim("dies-too", 0.05)["attempts"] == 2
    time.sleep(0.1)
    assert s.reap(max_attempts=2) == (0, 1)
    job = s.job(job_id)
    assert job["status"] == "failed" and "2 attempts" in job["error"]
    assert s.counter("reclaimed") == 1


def test_restart_and_orderly_stop_requeue_own_jobs(db):
    s = Store(db)
    a, _ = s.submit("plan", "a", {}, 10)
    b, _ = s.submit("plan", "b", {}, 10)
    s.claim("r1", 30)
    s.claim("r2", 30)
    assert s.requeue_owned("r1", "queued (restart)") == 1
    assert s.job(a)["status"] == "queued" and s.job(b)["status"] == "running"


def test_queue_limit_counts_all_replicas(db):
    s1, s2 = Store(db), Store(db)
    s1.submit("plan", "a", {}, 2)
    s2.submit("plan", "b", {}, 2)
    with pytest.raises(QueueFull, match="holds 2 jobs"):
        s1.submit("plan", "c", {}, 2)


def test_eviction_by_age_and_size_keeps_pins(db):
    s = Store(db)
    for i in range(5):
        job_id, _ = s.submit("plan", f"k{i}", {}, 10)
        s.claim("r", 30)
        assert s.finish(job_id, "r", f"k{i}", "plan", {"pad": "x" * 100, "i": i}, {})
        time.sleep(0.01)
    size = s.plans()[0]["size"]
    assert s.pin("k0", True) and not s.pin("nope", True)
    # Over a budget of three plans: the oldest unpinned go (k1, k2), the pinned k0 stays.
    assert s.evict(None, 3 * size) == 2
    assert {p["key"] for p in s.plans()} == {"k0", "k3", "k4"} and s.plans_bytes() == 3 * size
    assert s.evict(0.0, None) == 2  # everything unused "for 0 s" but the pin
    assert [p["key"] for p in s.plans()] == ["k0"] and s.counter("evicted") == 4
    assert s.pin("k0", False) and s.evict(0.0, None) == 1


def test_profiles_are_stored_once(db):
    s = Store(db)
    s.add_profile("abc", "mine", {"name": "mine"})
    s.add_profile("abc", "mine", {"name": "mine"})
    assert [p["id"] for p in s.profiles()] == ["abc"] and s.profile("abc") == {"name": "mine"}
    assert json.dumps(s.profile("zzz")) == "null"


def test_database_url():
    assert database_url("plans.sqlite").startswith("sqlite:////")
    assert database_url("postgresql://u@h:5/d") == "postgresql+psycopg://u@h:5/d"
    with pytest.raises(ValueError, match="expected a SQLite file path or a postgresql:// URL"):
        database_url("mysql://u@h/d")


def test_reads_see_other_writers_at_once(db):
    """A lookup after another process's commit sees it (the hot path's per-thread reads must
    not keep an old snapshot open)."""
    reader, writer = Store(db), Store(db)
    for key in ("k1", "k2"):
        job_id, _ = writer.submit("plan", key, {}, 10)
        writer.claim("w", 30)
        assert reader.job(job_id)["status"] == "running"
        assert reader.plan_text(key) is None
        assert writer.finish(job_id, "w", key, "plan", {"key": key}, {})
        assert reader.plan(key) == {"key": key} and reader.job(job_id)["status"] == "done"


def test_serve_refuses_a_bad_database_clearly(tmp_path):
    import subprocess
    import sys

    from costmodel.calibrate import free_port

    for db, words in (("mysql://u:pw@h/d", "expected a SQLite file path or a postgresql:// URL"),
                      (f"postgresql://u:pw@127.0.0.1:{free_port()}/d", "cannot open the database")):
        out = subprocess.run([sys.executable, "-m", "autoshard", "serve", "--db", db, "--port", "1"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and words in out.stderr and "pw" not in out.stderr, out.stderr


class _LingeringWorker:
    """A worker process that stores its result at once and then takes ``linger`` seconds to
    exit, as a torch process tearing down on a busy host does."""

    def __init__(self, store, linger, target, args, daemon):
        self.store, self.linger, self.args = store, linger, args
        self.killed = False
        self.exitcode = None

    def start(self):
        _db, job_id, owner, _parent = self.args
        job = self.store.job(job_id)
        assert self.store.finish(job_id, owner, job["key"], job["kind"], {"plan": 1}, {})
        self.ends = time.monotonic() + self.linger

    def is_alive(self):
        return not self.killed and time.monotonic() < self.ends

    def join(self, timeout=None):
        time.sleep(max(0.0, min(timeout if timeout is not None else 1e9, self.ends - time.monotonic())))

    def kill(self):
        self.killed = True


def test_a_worker_slow_to_exit_after_storing_is_not_a_lost_lease(tmp_path, caplog):
    """The lease renewal fails once the job is done; a slot that read that as "lost to another
    replica" killed its own finished worker, logged a false warning and dropped the solve from
    the metrics (every job of the replicated load benchmark did so)."""
    from autoshard.serve.app import ServiceConfig
    from autoshard.serve.jobs import JobRunner

    store = Store(str(tmp_path / "s.sqlite"))
    cfg = ServiceConfig(db=str(tmp_path / "s.sqlite"), workers=1, lease_seconds=0.3, poll_seconds=0.05,
                        replica="r0")
    observed = []

    class _Hist:
        def labels(self, **_):
            return self

        def observe(self, seconds):
            observed.append(seconds)

    class _Metrics:
        solve_seconds = _Hist()

    runner = JobRunner(store, cfg.db, cfg, metrics=_Metrics())
    workers = []

    class _Ctx:
        def Process(self, target, args, daemon):  # noqa: N802 (multiprocessing's name)
            workers.append(_LingeringWorker(store, 0.2, target, args, daemon))
            return workers[-1]

    runner.ctx = _Ctx()
    job_id, _ = store.submit("plan", "k", {}, max_queue=10)
    caplog.set_level("WARNING", logger="autoshard.serve")
    runner.start()
    try:
        deadline = time.monotonic() + 10
        while not observed and time.monotonic() < deadline:
            time.sleep(0.05)
        status = store.job(job_id)["status"]
    finally:
        runner.stop()
        store.close()
    assert status == "done"
    assert len(workers) == 1 and not workers[0].killed, "the slot killed its own finished worker"
    assert not [r for r in caplog.records if "lease lost" in r.getMessage()], caplog.text
    assert len(observed) == 1, "the finished solve is missing from the solve-seconds metric"
