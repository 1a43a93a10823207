"""The step as the lowered program runs it: one compute stream, one communication stream.

The plan's own prediction adds every op's compute and every redistribute's time. The program
that runs is different: torch's bucketing merged collectives (one latency per bucket), and the
overlap scheduler issues each collective early and waits for it late. This walks a rank's
lowered forward and backward programs in their order, with the plan's profile pricing each node
(:class:`autoshard.passes.Estimator`, the same figures the scheduler used):

    compute node      c   : t_c <- t_c + compute(c)
    collective k issued   : start_k = max(t_c, t_m);  t_m <- start_k + collective(k)
    wait for k            : exposed += max(0, t_m(k) - t_c);  t_c <- max(t_c, end_k)
    step                  = t_c after the last node (every collective has been waited for)

``t_c`` is the compute stream's clock and ``t_m`` the communication stream's: collectives run
one after another, beside compute. The compute of the step is the sum over compute nodes;
``exposed`` is the communication the compute did not hide.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autoshard.passes import KIND, Estimator
from costmodel.profile import Profile

_WAIT = torch.ops._c10d_functional.wait_tensor.default


@dataclass
class Timeline:
    """One program's simulated run, microseconds."""

    step_us: float = 0.0
    compute_us: float = 0.0
    comm_us: float = 0.0
    """Every collective's time, hidden or not."""
    exposed_us: float = 0.0
    """Communication the compute stream waited for."""
    collectives: int = 0

    def __add__(self, other: Timeline) -> Timeline:
        return Timeline(*(a + b for a, b in zip(vars(self).values(), vars(other).values())))


def _source(node):
    """The collective a wait reads (through the getitem of a multi-output collective)."""
    while isinstance(node, fx.Node) and node.target not in KIND and node.op == "call_function" and node.args:
        node = node.args[0]
    return node


def simulate(gm: fx.GraphModule, profile: Profile, estimator: Estimator | None = None) -> Timeline:
    """Run ``gm``'s nodes on a compute and a communication stream (see the module doc)."""
    est = estimator or Estimator(profile)
    t_compute = t_comm = 0.0
    ends: dict[fx.Node, float] = {}
    tl = Timeline()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in KIND:
            start = max(t_compute, t_comm)
            us = est.collective_us(node)
            t_comm = ends[node] = start + us
            tl.comm_us += us
            tl.collectives += 1
        elif node.target is _WAIT:
            end = ends.get(_source(node.args[0]), 0.0)
            if end > t_compute:
                tl.exposed_us += end - t_compute
                t_compute = end
        else:
            us = est.compute_us(node)
            t_compute += us
            tl.compute_us += us
    tl.step_us = max(t_compute, t_comm)
    return tl


def simulate_step(program, rank: int, profile: Profile | None = None) -> Timeline:
    """Forward then backward of a :class:`autoshard.runtime.PlannedProgram` for ``rank``, priced
    by ``profile`` (default: the plan's, which the programs were scheduled with)."""
    profile = profile or program.lowering.profile
    est = Estimator(profile)
    return (simulate(program.forward_program(rank).gm, profile, est)
            + simulate(program.backward_program(rank).gm, profile, est))
