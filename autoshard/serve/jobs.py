"""The job runner of one replica: N worker slots that claim jobs from the shared store.

The queue is the database (:mod:`autoshard.serve.store`): any replica may take a
request, every replica's slots claim the oldest queued job, so the work spreads over
replicas with no coordinator. A slot runs its job in a spawned process, renews the
job's lease while the process runs, kills it at the job time limit (job failed) or
when the lease was lost to another replica (its result would not be stored anyway).

A maintenance thread re-queues jobs whose lease passed (their replica died: it
cannot renew; its worker processes died with it) and evicts old plans. On start a
replica re-queues at once the jobs it held under the same name before a crash; on an
orderly stop it hands its running jobs back to the queue.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time

from autoshard.serve.store import QueueFull, Store
from autoshard.serve.worker import run_job

__all__ = ["JobRunner", "QueueFull"]

log = logging.getLogger("autoshard.serve")


class JobRunner:
    def __init__(self, store: Store, db: str, cfg, metrics=None):
        self.store, self.db, self.cfg, self.metrics = store, db, cfg, metrics
        self.replica = cfg.replica
        self.ctx = multiprocessing.get_context("spawn")
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.procs: dict[str, multiprocessing.Process] = {}

    def start(self) -> int:
        """Re-queue what this replica held when it died; start the slots and the maintenance
        thread. Returns how many jobs were re-queued."""
        n = self.store.requeue_owned(self.replica, "queued (re-run: its replica restarted while it ran)")
        for _ in range(self.cfg.workers):
            self.threads.append(threading.Thread(target=self._slot, daemon=True))
        self.threads.append(threading.Thread(target=self._maintain, daemon=True))
        for t in self.threads:
            t.start()
        return n

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()
        with self.lock:
            for p in self.procs.values():
                if p.is_alive():
                    p.kill()
        for t in self.threads:
            t.join(5)
        # Other replicas need not wait for the leases to pass.
        self.store.requeue_owned(self.replica, "queued (re-run: its replica stopped while it ran)")

    def submit(self, kind: str, key: str, request: dict) -> tuple[str, bool]:
        """(job id, whether a new job was made): the active job for the same key is shared."""
        job_id, created = self.store.submit(kind, key, request, self.cfg.max_queue)
        if created:
            self.wake.set()
        return job_id, created

    # -- slots ------------------------------------------------------------
    def _slot(self) -> None:
        while not self.stopping.is_set():
            job = None
            try:
                if self.store.has_queued():
                    job = self.store.claim(self.replica, self.cfg.lease_seconds)
            except Exception:  # the database away for a moment: retry, do not kill the slot
                log.exception("claiming a job failed")
            if job is None:
                self.wake.wait(self.cfg.poll_seconds)
                self.wake.clear()
                continue
            try:
                self._run(job)
            except Exception:
                log.exception("job %s: the slot failed", job["id"])
                try:
                    self.store.fail(job["id"], self.replica, "the service failed running this job (see its log)")
                except Exception:
                    log.exception("job %s: could not mark it failed", job["id"])

    def _run(self, job: dict) -> None:
        job_id = job["id"]
        if self.store.plan_text(job["key"]) is not None:
            self.store.done_from_store(job_id, self.replica)
            return
        t0 = time.monotonic()
        p = self.ctx.Process(target=run_job, args=(self.db, job_id, self.replica, os.getpid()),
                             daemon=True)
        with self.lock:
            self.procs[job_id] = p
        p.start()
        lost = False
        try:
            renew = self.cfg.lease_seconds / 3
            while p.is_alive() and not self.stopping.is_set():
                left = self.cfg.job_seconds - (time.monotonic() - t0)
                if left <= 0:
                    break
                p.join(min(renew, left))
                if p.is_alive() and not self._renew(job_id):
                    # The renewal fails once the job is no longer running: either another
                    # replica took it, or our worker stored its result and is still exiting
                    # (a torch process takes a moment to tear down). Only the first is a loss.
                    after = self.store.job(job_id)
                    if after is not None and after["status"] != "running" and after["owner"] == self.replica:
                        p.join(self.cfg.lease_seconds)
                        if p.is_alive():  # stuck in its exit: its result is stored already
                            p.kill()
                            p.join()
                        break
                    lost = True
                    break
            if self.stopping.is_set():
                # An orderly stop: the job goes back to the queue (stop()), it did not fail.
                p.kill()
                p.join()
                return
            if p.is_alive():
                p.kill()
                p.join()
                if lost:
                    log.warning("job %s: lease lost to another replica; stopped here", job_id)
                else:
                    self.store.fail(job_id, self.replica,
                                    f"time limit: the job ran past {self.cfg.job_seconds:g} s and was stopped")
            else:
                after = self.store.job(job_id)
                if after is not None and after["status"] == "running" and after["owner"] == self.replica:
                    self.store.fail(job_id, self.replica, f"the worker process exited with code {p.exitcode} "
                                                          "before storing a result")
                elif after is not None and after["status"] == "done" and self.metrics is not None:
                    self.metrics.solve_seconds.labels(kind=job["kind"]).observe(time.monotonic() - t0)
        finally:
            with self.lock:
                self.procs.pop(job_id, None)

    def _renew(self, job_id: str) -> bool:
        try:
            return self.store.renew(job_id, self.replica, self.cfg.lease_seconds)
        except Exception:  # keep running through a database hiccup; the next renewal may pass
            log.exception("job %s: renewing the lease failed", job_id)
            return True

    # -- maintenance --------------------------------------------------------
    def _maintain(self) -> None:
        last_evict = 0.0
        while not self.stopping.wait(min(self.cfg.lease_seconds / 3, 5.0)):
            try:
                requeued, failed = self.store.reap(self.cfg.max_attempts)
                if requeued:
                    log.warning("re-queued %d job(s) whose replica stopped renewing the lease", requeued)
                    self.wake.set()
                if requeued and self.metrics is not None:
                    self.metrics.reclaimed.inc(requeued)
                if time.monotonic() - last_evict > self.cfg.evict_every:
                    last_evict = time.monotonic()
                    if self.cfg.max_plan_age is not None or self.cfg.max_plan_bytes is not None:
                        gone = self.store.evict(self.cfg.max_plan_age, self.cfg.max_plan_bytes)
                        if gone and self.metrics is not None:
                            self.metrics.evicted.inc(gone)
            except Exception:
                log.exception("service maintenance failed (will retry)")
