"""What things cost: collectives, compute, redistributes; hardware profiles."""

from costmodel.collectives import MeshTopology, collective_time_us
from costmodel.compute import compute_time_us
from costmodel.errors import CostModelError
from costmodel.executor import execute_plan, group_mesh, make_groups, start_step
from costmodel.links import KINDS, LinkModel
from costmodel.profile import Profile, builtin_profiles, load_profile
from costmodel.redistribute import (
    RedistributePlanner,
    local_plan,
    plan_redistribute,
    plan_steps,
    redistribute_cost_us,
)
from costmodel.reference import price_path, torch_path
from costmodel.spec import Spec
from costmodel.states import RedistributeError, RedistributePlan, Step

__all__ = [
    "CostModelError",
    "KINDS",
    "LinkModel",
    "MeshTopology",
    "Profile",
    "RedistributeError",
    "RedistributePlan",
    "RedistributePlanner",
    "Spec",
    "Step",
    "builtin_profiles",
    "collective_time_us",
    "execute_plan",
    "group_mesh",
    "make_groups",
    "local_plan",
    "start_step",
    "compute_time_us",
    "load_profile",
    "plan_redistribute",
    "plan_steps",
    "price_path",
    "redistribute_cost_us",
    "torch_path",
]
