"""The job runner: a bounded queue, N worker slots, one spawned process per job.

Identical requests share a job (same key, while it is queued or running), and a
finished key is answered from the store without a job. Each slot thread starts
the job's process and waits at most the job time limit, then kills it and marks
the job failed. On start, jobs that a dead service left queued or running are
queued again (their process died with the service; nothing partial was stored).
"""

from __future__ import annotations

import multiprocessing
import queue
import threading

from autoshard.serve.store import Store
from autoshard.serve.worker import run_job


class QueueFull(RuntimeError):
    pass


class JobRunner:
    def __init__(self, store: Store, db_path: str, workers: int, max_queue: int, job_seconds: float):
        self.store, self.db_path = store, db_path
        self.workers, self.max_queue, self.job_seconds = workers, max_queue, job_seconds
        self.queue: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.ctx = multiprocessing.get_context("spawn")
        self.threads: list[threading.Thread] = []
        self.procs: dict[str, multiprocessing.Process] = {}

    def start(self) -> int:
        """Re-queue what a previous run left unfinished; start the slots. Returns how many were re-queued."""
        leftover = self.store.jobs_with_status("running", "queued")
        for job_id in leftover:
            job = self.store.job(job_id)
            note = "queued (re-run: the service restarted while it ran)" if job["status"] == "running" else None
            self.store.set_status(job_id, "queued", phase=note or "queued")
            self.queue.put(job_id)
        for _ in range(self.workers):
            t = threading.Thread(target=self._loop, daemon=True)
            t.start()
            self.threads.append(t)
        return len(leftover)

    def stop(self) -> None:
        for _ in self.threads:
            self.queue.put(None)
        with self.lock:
            for p in self.procs.values():
                if p.is_alive():
                    p.kill()

    def submit(self, kind: str, key: str, request: dict) -> tuple[str, bool]:
        """(job id, whether a new job was made): an active job for the same key is shared."""
        with self.lock:
            existing = self.store.active_job_for(key)
            if existing is not None:
                return existing, False
            if self.queue.qsize() >= self.max_queue:
                raise QueueFull(f"the queue holds {self.queue.qsize()} jobs (limit {self.max_queue})")
            job_id = self.store.new_job(kind, key, request)
            self.queue.put(job_id)
            return job_id, True

    def _loop(self) -> None:
        while True:
            job_id = self.queue.get()
            if job_id is None:
                return
            job = self.store.job(job_id)
            if job is None or job["status"] != "queued":
                continue  # done by a shared job in the meantime
            if self.store.plan(job["key"]) is not None:
                self.store.set_status(job_id, "done", phase="done")
                continue
            self.store.set_status(job_id, "running", phase="starting", started=True)
            p = self.ctx.Process(target=run_job, args=(self.db_path, job_id), daemon=True)
            with self.lock:
                self.procs[job_id] = p
            p.start()
            p.join(self.job_seconds)
            if p.is_alive():
                p.kill()
                p.join()
                self.store.set_status(job_id, "failed", phase="failed",
                                      error=f"time limit: the job ran past {self.job_seconds:g} s and was stopped")
            else:
                after = self.store.job(job_id)
                if after is not None and after["status"] == "running":
                    self.store.set_status(job_id, "failed", phase="failed",
                                          error=f"the worker process exited with code {p.exitcode} before "
                                                "storing a result")
            with self.lock:
                self.procs.pop(job_id, None)
