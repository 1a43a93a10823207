"""Running a plan: lowering the traced graph to per-rank programs
(:mod:`~autoshard.runtime.lower`), the passes that bucket and overlap their collectives
(:mod:`~autoshard.runtime.passes`, :mod:`~autoshard.runtime.buckets`), the step function that
runs them (:mod:`~autoshard.runtime.program`, :mod:`~autoshard.runtime.spmd`), the parameter
shards (:mod:`~autoshard.runtime.shards`) and the DTensor replay used as a reference
(:mod:`~autoshard.runtime.replay`).

It builds on :mod:`autoshard.graph` and never imports the planner (:mod:`autoshard.planning`).
"""
