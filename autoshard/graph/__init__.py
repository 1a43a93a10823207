"""The traced training graph and how its ops shard: tracing a model and its backward
(:mod:`~autoshard.graph.tracing`), folding repeated layers (:mod:`~autoshard.graph.unroll`,
:mod:`~autoshard.graph.layers`), each op's sharding strategies (:mod:`~autoshard.graph.strategies`,
:mod:`~autoshard.graph.attention` for the fused attention kernels), what an op costs whatever
its sharding (:mod:`~autoshard.graph.pricing`), what a recomputation mode recomputes
(:mod:`~autoshard.graph.recompute`) and how random ops draw per shard (:mod:`~autoshard.graph.rng`).

Both the planner (:mod:`autoshard.planning`) and the runtime (:mod:`autoshard.runtime`) build
on this layer; it imports neither.
"""
