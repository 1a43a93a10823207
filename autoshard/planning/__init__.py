"""Choosing the plan: the integer program over the traced graph's strategies
(:mod:`~autoshard.planning.problem`), the planner that builds and solves it
(:mod:`~autoshard.planning.planner`), hand-written plans it is compared with
(:mod:`~autoshard.planning.baselines`), the step simulator that prices overlap
(:mod:`~autoshard.planning.simulate`, :mod:`~autoshard.planning.overlap`) and the search over
mesh shapes (:mod:`~autoshard.planning.meshsearch`, :mod:`~autoshard.planning.shapeworkers`).

It builds on :mod:`autoshard.graph` and reads the runtime's program passes
(:mod:`autoshard.runtime.passes`, :mod:`autoshard.runtime.buckets`) to price what will run;
the runtime never imports it.
"""
