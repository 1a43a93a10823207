"""What a solve worker process runs: one job, start to stored result.

Each job runs in its own spawned process (the service kills it at the job time
limit), opens its own connection to the store, reports its phase as it goes, and
stores the result and marks the job done in one transaction, or marks it failed
with the error. Nothing partial is ever stored.
"""

from __future__ import annotations

import logging
import math
import os
import traceback

from autoshard.serve.store import Store

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


def _die_with_parent() -> None:
    """Linux: end this worker when the service process dies (even by SIGKILL), so a
    restarted service re-runs the job instead of racing an orphan."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_job(db_path: str, job_id: str) -> None:
    _die_with_parent()
    try:
        os.nice(10)  # solves yield the CPU to the API process: cached answers stay fast under load
    except OSError:
        pass
    store = Store(db_path)
    job = store.job(job_id)
    if job is None:
        return
    try:
        if job["kind"] == "plan":
            body, summary = _plan(store, job)
        else:
            body, summary = _solve(store, job)
        store.finish(job_id, job["key"], job["kind"], body, summary)
    except Exception as exc:  # the job's own failure, reported to the client
        msg = f"{type(exc).__name__}: {exc}"
        store.set_status(job_id, "failed", phase="failed", error=msg[:2000])
        traceback.print_exc()


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
                              memory_budget=req.memory_budget, time_limit=req.time_limit, pins=req.pins or None)
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
