"""What things cost: collectives, compute, redistributes; hardware profiles."""

from costmodel.collectives import KINDS, MeshTopology, collective_time_us
from costmodel.compute import compute_time_us
from costmodel.profile import LinkModel, Profile, builtin_profiles, load_profile
from costmodel.redistribute import (
                                    RedistributeError,
                                    RedistributePlan,
                                    RedistributePlanner,
                                    Step,
                                    local_plan,
                                    plan_redistribute,
                                    plan_steps,
                                    redistribute_cost_us,
)
from costmodel.reference import execute_plan, make_groups, price_path, start_step, torch_path
from costmodel.spec import Spec

__all__ = [
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
