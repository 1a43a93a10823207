"""The service's store: jobs, plans, profiles, on SQLite (embedded default) or PostgreSQL.

One schema for both dialects, written with SQLAlchemy Core; forward migrations are
alembic operations (``MIGRATIONS``), so each step is written once and rendered per
dialect. Every state change is one transaction: a plan is stored whole with its job
marked done, or not at all.

Replicas share the work through the database, never through a process's memory:

- **one active job per question**: a unique index on ``jobs.key`` over the active rows
  (``status IN ('queued', 'running')``); two replicas inserting the same key at once
  get one row, the loser reads the winner's job id (:meth:`Store.submit`);
- **a job runs on one replica**: :meth:`Store.claim` sets ``status = 'running'``,
  ``owner`` and ``lease_until`` in one ``UPDATE ... WHERE id = (SELECT ... FOR UPDATE
  SKIP LOCKED)`` (PostgreSQL: concurrent claimers skip each other's rows instead of
  waiting; SQLite: one writer at a time, the statement is atomic);
- **a dead replica's jobs come back**: its owner renews the lease while the job runs
  (:meth:`Store.renew`); any replica re-queues running jobs whose lease has passed
  (:meth:`Store.reap`), and gives up on a job after ``max_attempts`` claims;
- **results count once**: :meth:`Store.finish` stores the plan only if the finishing
  replica still owns the job, and counts the solve in the same transaction
  (``plans.solves`` per question, the ``solves`` counter in all).

Lease times are wall-clock seconds of the replica that writes them: replicas on
different hosts need clocks in sync to well within the lease (NTP does it).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import (
    Column,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    event,
    func,
    select,
    text,
    update,
)
from sqlalchemy.exc import IntegrityError

ACTIVE = ("queued", "running")


class QueueFull(RuntimeError):
    pass


meta = MetaData()
#: The current schema (after every migration), for queries; ``MIGRATIONS`` builds it.
jobs = Table("jobs", meta, Column("id", String(32), primary_key=True), Column("kind", String(16), nullable=False),
             Column("key", String(80), nullable=False), Column("status", String(16), nullable=False),
             Column("phase", Text), Column("request", Text, nullable=False), Column("error", Text),
             Column("created", Float), Column("updated", Float), Column("attempts", Integer, nullable=False),
             Column("owner", String(200)), Column("lease_until", Float))
plans = Table("plans", meta, Column("key", String(80), primary_key=True), Column("kind", String(16), nullable=False),
              Column("body", Text, nullable=False), Column("summary", Text), Column("created", Float),
              Column("size", Integer, nullable=False), Column("pinned", Integer, nullable=False),
              Column("last_used", Float), Column("solves", Integer, nullable=False))
profiles = Table("profiles", meta, Column("id", String(80), primary_key=True), Column("name", Text),
                 Column("body", Text, nullable=False), Column("created", Float))
counters = Table("counters", meta, Column("name", String(64), primary_key=True),
                 Column("value", Integer, nullable=False))


def _v1(op):
    op.create_table("jobs", Column("id", String(32), primary_key=True), Column("kind", String(16), nullable=False),
                    Column("key", String(80), nullable=False), Column("status", String(16), nullable=False),
                    Column("phase", Text), Column("request", Text, nullable=False), Column("error", Text),
                    Column("created", Float), Column("updated", Float))
    op.create_index("jobs_key", "jobs", ["key"])
    op.create_index("jobs_status", "jobs", ["status"])
    op.create_table("plans", Column("key", String(80), primary_key=True), Column("kind", String(16), nullable=False),
                    Column("body", Text, nullable=False), Column("summary", Text), Column("created", Float))
    op.create_table("profiles", Column("id", String(80), primary_key=True), Column("name", Text),
                    Column("body", Text, nullable=False), Column("created", Float))
    op.create_table("counters", Column("name", String(64), primary_key=True),
                    Column("value", Integer, nullable=False))


def _v2(op):
    # How many times a job was started (a restart or a lost lease re-runs it).
    op.add_column("jobs", Column("attempts", Integer, nullable=False, server_default="0"))


def _v3(op):
    # Replicas: who runs a job and until when its claim holds; one active job per question
    # enforced by the database; plan size, pin, last use and solve count for eviction and audits.
    op.add_column("jobs", Column("owner", String(200)))
    op.add_column("jobs", Column("lease_until", Float))
    active = text("status IN ('queued', 'running')")
    op.create_index("jobs_active_key", "jobs", ["key"], unique=True, sqlite_where=active, postgresql_where=active)
    op.add_column("plans", Column("size", Integer, nullable=False, server_default="0"))
    op.add_column("plans", Column("pinned", Integer, nullable=False, server_default="0"))
    op.add_column("plans", Column("last_used", Float))
    op.add_column("plans", Column("solves", Integer, nullable=False, server_default="1"))
    op.execute("UPDATE plans SET size = LENGTH(body), last_used = created")


#: Forward migrations, applied in order from the stored version: never edit one, append.
#: (v1 and v2 are the schema of the SQLite-only store, so its files migrate in place.)
MIGRATIONS = [_v1, _v2, _v3]

_JOB_FIELDS = ("id", "kind", "key", "status", "phase", "request", "error", "created", "updated", "attempts",
               "owner", "lease_until")
# The hot reads (cached answers, job polls) as plain SQL, the same in both dialects: on SQLite
# they skip SQLAlchemy entirely (:meth:`Store._hot_read`).
_PLAN_BY_KEY = "SELECT body, last_used FROM plans WHERE key = :key"
_JOB_BY_ID = f"SELECT {', '.join(_JOB_FIELDS)} FROM jobs WHERE id = :id"
_PLANS_BYTES = select(func.coalesce(func.sum(plans.c.size), 0))


def _held(job_id: str, owner: str | None = None) -> list:
    """The rows a state change of a running job may touch: that job, still running, still
    held by ``owner`` (when given): a replica that lost the job changes nothing."""
    cond = [jobs.c.id == job_id, jobs.c.status == "running"]
    if owner is not None:
        cond.append(jobs.c.owner == owner)
    return cond


def database_url(db: str) -> str:
    """A SQLAlchemy URL from what a user types: a file path (SQLite) or a database URL.
    ``postgresql://`` takes the psycopg (v3) driver."""
    if "://" not in db:
        return f"sqlite:///{Path(db).resolve()}"
    scheme, rest = db.split("://", 1)
    if scheme in ("postgresql", "postgres"):
        return f"postgresql+psycopg://{rest}"
    if scheme.split("+")[0] not in ("sqlite", "postgresql"):
        from autoshard.errors import ConfigError

        raise ConfigError(f"--db: expected a SQLite file path or a postgresql:// URL, found {redact(db)!r}")
    return db


def redact(url: str) -> str:
    """The URL with its password hidden, for logs and errors."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True) if "://" in url else url


class Store:
    def __init__(self, db: str, pool_size: int = 8):
        self.url = database_url(db)
        self.dialect = self.url.split(":", 1)[0].split("+")[0]
        if self.dialect == "sqlite":
            engine = create_engine(self.url, connect_args={"check_same_thread": False, "timeout": 30})
            _sqlite_transactions(engine)
        else:
            engine = create_engine(self.url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True)
        self.engine = engine
        self._local = threading.local()
        self._raw: list = []  # every thread's raw SQLite connection, closed with the store
        # Writes take SQLite's write lock at BEGIN (no deadlock upgrading a read lock);
        # PostgreSQL ignores the option.
        self._writer = engine.execution_options(sqlite_immediate=True)
        self._migrate()

    def close(self) -> None:
        for raw in self._raw:
            raw.close()
        self._raw.clear()
        self.engine.dispose()

    @contextmanager
    def _write(self):
        with self._writer.begin() as conn:
            yield conn

    def _hot_read(self, sql: str, params: dict):
        """One-row lookup on the hot path. SQLite: a raw connection per thread (a lookup in
        microseconds; SQLAlchemy's pool and statement layers cost ten times the query).
        PostgreSQL: through the pool (the network round trip dominates)."""
        if self.dialect != "sqlite":
            with self._read() as conn:
                return conn.execute(text(sql), params).fetchone()
        raw = getattr(self._local, "conn", None)
        if raw is None:
            import sqlite3

            raw = sqlite3.connect(self.url[len("sqlite:///"):], isolation_level=None, check_same_thread=False,
                                  timeout=30)
            raw.execute("PRAGMA busy_timeout=30000")
            self._local.conn = raw
            self._raw.append(raw)
        # fetchall, not fetchone: a statement left unfinished would hold its read snapshot
        # open, and every later lookup on this thread would see the past.
        rows = raw.execute(sql, params).fetchall()
        return rows[0] if rows else None

    @contextmanager
    def _read(self):
        with self.engine.connect() as conn:
            yield conn

    def _migrate(self) -> None:
        from alembic.migration import MigrationContext
        from alembic.operations import Operations

        with self._write() as conn:
            if self.dialect == "postgresql":
                # Replicas starting together: one migrates, the others wait and find it done.
                conn.execute(text("SELECT pg_advisory_xact_lock(7216354211)"))
            conn.execute(text("CREATE TABLE IF NOT EXISTS schema (version INTEGER NOT NULL)"))
            row = conn.execute(text("SELECT version FROM schema")).fetchone()
            version = row[0] if row else 0
            if row is None:
                conn.execute(text("INSERT INTO schema VALUES (0)"))
            if version > len(MIGRATIONS):
                raise RuntimeError(f"database {redact(self.url)} has schema v{version}, newer than this autoshard "
                                   f"(v{len(MIGRATIONS)}): upgrade autoshard")
            op = Operations(MigrationContext.configure(conn))
            for v in range(version, len(MIGRATIONS)):
                MIGRATIONS[v](op)
                conn.execute(text("UPDATE schema SET version = :v"), {"v": v + 1})

    def schema_version(self) -> int:
        with self._read() as conn:
            return conn.execute(text("SELECT version FROM schema")).scalar_one()

    # -- jobs -------------------------------------------------------------
    def submit(self, kind: str, key: str, request: dict, max_queue: int) -> tuple[str, bool]:
        """(job id, whether a new job was made): the active job for ``key`` is shared, on any replica."""
        for _ in range(3):
            try:
                with self._write() as conn:
                    existing = conn.execute(select(jobs.c.id).where(jobs.c.key == key,
                                                                    jobs.c.status.in_(ACTIVE))).scalar()
                    if existing is not None:
                        return existing, False
                    queued = conn.execute(select(func.count()).select_from(jobs)
                                          .where(jobs.c.status == "queued")).scalar_one()
                    if queued >= max_queue:
                        raise QueueFull(f"the queue holds {queued} jobs (limit {max_queue})")
                    job_id = uuid.uuid4().hex[:16]
                    now = time.time()
                    conn.execute(jobs.insert().values(id=job_id, kind=kind, key=key, status="queued",
                                                      phase="queued", request=json.dumps(request), created=now,
                                                      updated=now, attempts=0))
                    return job_id, True
            except IntegrityError:
                continue  # another replica inserted the same question first: share its job
        raise RuntimeError(f"could not submit or find an active job for {key} (three insert conflicts)")

    def job(self, job_id: str) -> dict | None:
        row = self._hot_read(_JOB_BY_ID, {"id": job_id})
        if row is None:
            return None
        out = dict(zip(_JOB_FIELDS, row))
        out["request"] = json.loads(out["request"])
        return out

    def has_queued(self) -> bool:
        with self._read() as conn:
            return conn.execute(select(jobs.c.id).where(jobs.c.status == "queued").limit(1)).first() is not None

    def claim(self, owner: str, lease_seconds: float) -> dict | None:
        """The oldest queued job, now running on ``owner`` with a lease; None when none is queued."""
        now = time.time()
        oldest = (select(jobs.c.id).where(jobs.c.status == "queued").order_by(jobs.c.created, jobs.c.id).limit(1)
                  .with_for_update(skip_locked=True).scalar_subquery())
        with self._write() as conn:
            row = conn.execute(
                update(jobs).where(jobs.c.id == oldest, jobs.c.status == "queued")
                .values(status="running", owner=owner, lease_until=now + lease_seconds, phase="starting",
                        attempts=jobs.c.attempts + 1, updated=now)
                .returning(jobs.c.id)).scalar()
        return self.job(row) if row is not None else None

    def renew(self, job_id: str, owner: str, lease_seconds: float) -> bool:
        """Extend the lease; False when ``owner`` no longer holds the job (it was re-claimed)."""
        with self._write() as conn:
            return conn.execute(update(jobs).where(*_held(job_id, owner))
                                .values(lease_until=time.time() + lease_seconds)).rowcount == 1

    def set_phase(self, job_id: str, phase: str) -> None:
        with self._write() as conn:
            conn.execute(update(jobs).where(*_held(job_id)).values(phase=phase, updated=time.time()))

    def fail(self, job_id: str, owner: str | None, error: str) -> bool:
        """Mark a running job failed (only if ``owner`` still holds it, when given)."""
        with self._write() as conn:
            return conn.execute(update(jobs).where(*_held(job_id, owner)).values(
                status="failed", phase="failed", error=error[:2000], updated=time.time(),
                lease_until=None)).rowcount == 1

    def done_from_store(self, job_id: str, owner: str) -> bool:
        """A claimed job whose question was answered meanwhile: done without a solve."""
        with self._write() as conn:
            return conn.execute(update(jobs).where(*_held(job_id, owner))
                                .values(status="done", phase="done", updated=time.time(),
                                        lease_until=None)).rowcount == 1

    def finish(self, job_id: str, owner: str, key: str, kind: str, body: dict, summary: dict) -> bool:
        """Store the result, mark the job done and count the solve, atomically; False (nothing
        stored) when ``owner`` lost the job to another replica."""
        now = time.time()
        text_body = json.dumps(body)
        with self._write() as conn:
            n = conn.execute(update(jobs).where(*_held(job_id, owner))
                             .values(status="done", phase="done", error=None, updated=now,
                                     lease_until=None)).rowcount
            if n != 1:
                return False
            self._upsert(conn, plans, {"key": key, "kind": kind, "body": text_body, "summary": json.dumps(summary),
                                       "created": now, "size": len(text_body), "pinned": 0, "last_used": now,
                                       "solves": 1},
                         ["key"], {"body": text_body, "summary": json.dumps(summary), "size": len(text_body),
                                   "last_used": now, "solves": plans.c.solves + 1})
            self._bump(conn, "solves")
        return True

    def requeue_owned(self, owner: str, note: str) -> int:
        """Put back the running jobs ``owner`` held (its restart, or its orderly stop)."""
        with self._write() as conn:
            return conn.execute(update(jobs).where(jobs.c.owner == owner, jobs.c.status == "running")
                                .values(status="queued", phase=note, owner=None, lease_until=None,
                                        updated=time.time())).rowcount

    def reap(self, max_attempts: int) -> tuple[int, int]:
        """Running jobs whose lease has passed: re-queued, or failed after ``max_attempts`` claims.
        Returns (re-queued, failed); both are counted in ``counters``."""
        now = time.time()
        expired = [jobs.c.status == "running", jobs.c.lease_until < now]
        with self._write() as conn:
            failed = conn.execute(update(jobs).where(*expired, jobs.c.attempts >= max_attempts).values(
                status="failed", phase="failed", updated=now, lease_until=None,
                error=f"given up after {max_attempts} attempts: each replica that claimed it stopped renewing "
                      "its lease (killed, or out of memory?)")).rowcount
            requeued = conn.execute(update(jobs).where(*expired).values(
                status="queued", phase="queued (re-claimed: its replica stopped renewing the lease)",
                owner=None, lease_until=None, updated=now)).rowcount
            if requeued:
                self._bump(conn, "reclaimed", requeued)
        return requeued, failed

    def status_counts(self) -> dict[str, int]:
        with self._read() as conn:
            rows = conn.execute(select(jobs.c.status, func.count()).group_by(jobs.c.status)).fetchall()
        return {s: n for s, n in rows}

    def counter(self, name: str) -> int:
        with self._read() as conn:
            return conn.execute(select(counters.c.value).where(counters.c.name == name)).scalar() or 0

    # -- plans ------------------------------------------------------------
    def plan(self, key: str) -> dict | None:
        text_ = self.plan_text(key)
        return json.loads(text_) if text_ is not None else None

    def plan_text(self, key: str) -> str | None:
        """The stored JSON text, served as is (no parse and re-serialize on the hot path). Marks
        the plan used, at most once a minute (a write per read would serialize cached answers)."""
        row = self._hot_read(_PLAN_BY_KEY, {"key": key})
        if row is None:
            return None
        now = time.time()
        if row[1] is None or now - row[1] > 60:
            with self._write() as conn:
                conn.execute(update(plans).where(plans.c.key == key).values(last_used=now))
        return row[0]

    def plans(self, limit: int = 100) -> list[dict]:
        with self._read() as conn:
            rows = conn.execute(select(plans.c.key, plans.c.kind, plans.c.summary, plans.c.created, plans.c.size,
                                       plans.c.pinned, plans.c.last_used, plans.c.solves)
                                .order_by(plans.c.created.desc(), plans.c.key).limit(limit)).fetchall()
        return [{"key": k, "kind": kind, "summary": json.loads(s or "{}"), "created": c, "size": size,
                 "pinned": bool(pin), "last_used": used, "solves": solves}
                for k, kind, s, c, size, pin, used, solves in rows]

    def pin(self, key: str, pinned: bool) -> bool:
        with self._write() as conn:
            return conn.execute(update(plans).where(plans.c.key == key)
                                .values(pinned=int(pinned))).rowcount == 1

    def evict(self, max_age: float | None, max_bytes: int | None) -> int:
        """Delete unpinned plans unused for ``max_age`` seconds, then the least recently used
        unpinned ones while all plans together exceed ``max_bytes``. Returns how many went."""
        gone = 0
        with self._write() as conn:
            if max_age is not None:
                cutoff = time.time() - max_age
                gone += conn.execute(plans.delete().where(plans.c.pinned == 0,
                                                          func.coalesce(plans.c.last_used, plans.c.created)
                                                          < cutoff)).rowcount
                conn.execute(jobs.delete().where(jobs.c.status.in_(("done", "failed")), jobs.c.updated < cutoff))
            if max_bytes is not None:
                total = conn.execute(_PLANS_BYTES).scalar_one()
                if total > max_bytes:
                    rows = conn.execute(select(plans.c.key, plans.c.size).where(plans.c.pinned == 0)
                                        .order_by(func.coalesce(plans.c.last_used, plans.c.created),
                                                  plans.c.key)).fetchall()
                    doomed = []
                    for key, size in rows:
                        if total <= max_bytes:
                            break
                        doomed.append(key)
                        total -= size
                    for i in range(0, len(doomed), 500):
                        conn.execute(plans.delete().where(plans.c.key.in_(doomed[i:i + 500])))
                    gone += len(doomed)
            if gone:
                self._bump(conn, "evicted", gone)
        return gone

    def plans_bytes(self) -> int:
        with self._read() as conn:
            return conn.execute(_PLANS_BYTES).scalar_one()

    # -- profiles ---------------------------------------------------------
    def add_profile(self, profile_id: str, name: str, body: dict) -> None:
        with self._write() as conn:
            self._upsert(conn, profiles, {"id": profile_id, "name": name, "body": json.dumps(body),
                                          "created": time.time()}, ["id"], None)

    def profile(self, profile_id: str) -> dict | None:
        with self._read() as conn:
            row = conn.execute(select(profiles.c.body).where(profiles.c.id == profile_id)).scalar()
        return json.loads(row) if row is not None else None

    def profiles(self) -> list[dict]:
        with self._read() as conn:
            rows = conn.execute(select(profiles.c.id, profiles.c.name, profiles.c.created)
                                .order_by(profiles.c.created, profiles.c.id)).fetchall()
        return [{"id": i, "name": n, "created": c} for i, n, c in rows]

    # -- helpers ----------------------------------------------------------
    def _upsert(self, conn, table: Table, values: dict, keys: list[str], updates: dict | None) -> None:
        if self.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert
        stmt = insert(table).values(**values)
        stmt = (stmt.on_conflict_do_nothing(index_elements=keys) if updates is None
                else stmt.on_conflict_do_update(index_elements=keys, set_=updates))
        conn.execute(stmt)

    def _bump(self, conn, name: str, by: int = 1) -> None:
        self._upsert(conn, counters, {"name": name, "value": by}, ["name"], {"value": counters.c.value + by})


def _sqlite_transactions(engine) -> None:
    """SQLite as a multi-process store: WAL (readers beside the writer), a busy timeout, and
    transactions begun by us (pysqlite's own handling defers BEGIN and commits DDL on its own),
    ``BEGIN IMMEDIATE`` for writes."""

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn):
        # Reads run in autocommit: one SELECT is its own consistent snapshot, and skipping
        # BEGIN/ROLLBACK keeps cached answers fast. Every read that needs more than one
        # statement to agree goes through a write transaction.
        if conn.get_execution_options().get("sqlite_immediate"):
            conn.exec_driver_sql("BEGIN IMMEDIATE")
