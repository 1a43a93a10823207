"""What a solve worker process runs: one job, start to stored result.

Each job runs in its own spawned process (the service kills it at the job time
limit), opens its own connection to the store, reports its phase as it goes, and
stores the result and marks the job done in one transaction, or marks it failed
with the error. Nothing partial is ever stored, and nothing at all once the job's
replica lost it to another (the store checks the owner).
"""

from __future__ import annotations

import logging
import math
import os
import traceback

from autoshard.serve.store import Store
from costmodel.calibrate import exit_rank

_PHASES = (("traced", "building problem"), ("built problem", "solving"), ("solved", "assembling plan"))


class _PhaseHandler(logging.Handler):
    """The job's phase from the planner's progress messages, for clients polling its status."""

    def __init__(self, store: Store, job_id: str):
        super().__init__(logging.INFO)
        self.store, self.job_id = store, job_id

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        for prefix, phase in _PHASES:
            if msg.startswith(prefix):
                self.store.set_phase(self.job_id, phase)


def _die_with_parent(parent: int) -> None:
    """Linux: end this worker when the service process dies (even by SIGKILL), so the job
    is re-run by a replica instead of raced by an orphan."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before the line above took effect
        os._exit(1)


def run_job(db: str, job_id: str, owner: str, parent: int) -> None:
    _die_with_parent(parent)
    try:
        os.nice(10)  # solves yield the CPU to the API process: cached answers stay fast under load
    except OSError:
        pass
    store = Store(db, pool_size=1)
    job = store.job(job_id)
    if job is None or job["owner"] != owner:
        return
    try:
        if job["kind"] == "plan":
            body, summary = _plan(store, job)
        else:
            body, summary = _solve(store, job)
        store.finish(job_id, owner, job["key"], job["kind"], body, summary)
    except Exception as exc:  # the job's own failure, reported to the client
        store.fail(job_id, owner, f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
    finally:
        store.close()
    # The result is stored: end now. The interpreter's teardown (torch, the fake process
    # group) takes seconds on a busy host, CPU the API process needs, and the slot waits
    # for this process to end before it claims the next job.
    exit_rank(0)


def _profile(store: Store, name: str):
    from costmodel import Profile, load_profile

    if name.startswith("upload:"):
        return Profile.from_json(store.profile(name[len("upload:"):]))
    return load_profile(name)


def _plan(store: Store, job: dict):
    import torch

    import autoshard
    from autoshard.serve.requests import PlanRequest, build_model

    torch.set_num_threads(1)
    req = PlanRequest(**job["request"])
    store.set_phase(job["id"], "tracing")
    model, inputs = build_model(req.model, req.batch, req.seq)
    mesh = autoshard.fake_mesh(tuple(req.mesh.shape), tuple(req.mesh.axis_names))

    phases = _PhaseHandler(store, job["id"])
    loggers = [logging.getLogger(name) for name in ("autoshard", "solver")]
    for logger in loggers:
        logger.addHandler(phases)
        logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
    try:
        plan = autoshard.plan(model, inputs, mesh, profile=_profile(store, req.profile),
                              memory_budget=req.memory_budget, time_limit=req.time_limit, pins=req.pins or None,
                              compute_dtype=req.compute_dtype)
    finally:
        for logger in loggers:
            logger.removeHandler(phases)
    s = plan.summary
    summary = {"model": plan.model.get("class"), "mesh": plan.mesh_shape, "step_us": s["step_us"],
               "peak_mem_bytes": s["peak_mem_bytes"], "status": plan.solver.get("status")}
    return plan.to_json(), summary


def _solve(store: Store, job: dict):
    import solver
    from solver import iopddl

    req = job["request"]
    store.set_phase(job["id"], "solving")
    problem = iopddl.from_dict(req["problem"], name="request")
    sol = solver.solve(problem, time_limit=float(req["time_limit"]))
    body = {"choice": sol.to_list(), "cost": sol.cost, "status": sol.status.value,
            "lower_bound": sol.lower_bound if sol.lower_bound is None or math.isfinite(sol.lower_bound) else None,
            "seconds": sol.seconds}
    return body, {"nodes": problem.num_nodes, "cost": sol.cost, "status": sol.status.value}
