"""autoshard: cost-model-driven auto-sharding for PyTorch.

    plan = autoshard.plan(model, example_inputs, mesh)      # ILP over DTensor strategies
    plan.save("plan.json")
    model = autoshard.parallelize(model, plan, mesh)        # runs the plan's lowered per-rank programs
    model = autoshard.auto_parallel(model, example_inputs, mesh)  # both in one call
"""

from autoshard.api import compare, plan
from autoshard.errors import AutoshardError, MeshError, PlanError, TraceError
from autoshard.mesh import fake_mesh, parse_mesh
from autoshard.parallelize import auto_parallel, parallelize
from autoshard.plan import PLAN_VERSION, ParamPlacement, Plan
from autoshard.replay import PlannedStep
from autoshard.trace import trace

__version__ = "0.1.0"

__all__ = [
    "PLAN_VERSION",
    "AutoshardError",
    "MeshError",
    "ParamPlacement",
    "Plan",
    "PlanError",
    "PlannedStep",
    "TraceError",
    "auto_parallel",
    "fake_mesh",
    "compare",
    "parallelize",
    "parse_mesh",
    "plan",
    "trace",
]
