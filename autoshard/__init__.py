"""autoshard: cost-model-driven auto-sharding for PyTorch.

    plan = autoshard.plan(model, example_inputs, mesh)      # ILP over DTensor strategies
    plan.save("plan.json")
    model = autoshard.parallelize(model, plan, mesh)        # runs the plan's lowered per-rank programs
    model = autoshard.auto_parallel(model, example_inputs, mesh)  # both in one call

    planner = autoshard.Planner(model, example_inputs, mesh, memory_budget=70 * 2**30)  # traces once
    planner.solve(pins={"layers.*.attn.wq": "RS(0)"})       # ... and solves as often as asked
    planner.compare()                                       # ours and DDP, FSDP, TP, FSDP+TP, costed alike

Options are :class:`PlanOptions` fields, given as keywords. Progress goes to the
``autoshard`` and ``solver`` loggers (INFO).
"""

from autoshard.apply import auto_parallel, parallelize
from autoshard.errors import AutoshardError, ConfigError, MemoryBudgetError, MeshError, PlanError, TraceError
from autoshard.graph import attention as _attention
from autoshard.graph.tracing import trace
from autoshard.mesh import fake_mesh, parse_mesh
from autoshard.options import PlanOptions
from autoshard.planfile import PLAN_VERSION, ParamPlacement, Plan
from autoshard.planning.planner import Planner, compare, plan
from autoshard.runtime.replay import PlannedStep

__version__ = "0.1.0"

__all__ = [
    "PLAN_VERSION",
    "AutoshardError",
    "ConfigError",
    "MemoryBudgetError",
    "MeshError",
    "ParamPlacement",
    "Plan",
    "PlanError",
    "PlanOptions",
    "PlannedStep",
    "Planner",
    "TraceError",
    "auto_parallel",
    "compare",
    "fake_mesh",
    "parallelize",
    "parse_mesh",
    "plan",
    "trace",
]

# DTensor rules of the fused attention kernels that torch lacks (the CPU one), for planning and running.
_attention.register_rules()
