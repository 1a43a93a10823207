"""Strategy-graph optimizer. Never imports torch.

``Problem`` (the graph) -> ``solve`` -> ``Solution`` (one strategy per node).
"""

from solver.evaluate import Evaluation, evaluate
from solver.iopddl import load as load_iopddl
from solver.iopddl import save as save_iopddl
from solver.overlap import OverlapWindows, WindowsAnswer, solve_windows
from solver.problem import FORBIDDEN, Problem, ProblemError
from solver.schedule import Schedule
from solver.solve import BACKENDS, InfeasibleError, MemoryFree, Solution, Status, memory_free, solve

__all__ = [
    "BACKENDS",
    "FORBIDDEN",
    "Evaluation",
    "InfeasibleError",
    "MemoryFree",
    "OverlapWindows",
    "Problem",
    "ProblemError",
    "Schedule",
    "Solution",
    "Status",
    "evaluate",
    "load_iopddl",
    "memory_free",
    "save_iopddl",
    "solve",
    "solve_windows",
    "WindowsAnswer",
]
