"""Errors a user can act on: each names what was expected and what was found.

``AutoshardError`` is not a ``ValueError``: an internal bug that raises ``ValueError``
must surface as a traceback (CLI exit 1), never as "bad input" (exit 2). The cost model's
and the solver's own user errors (a malformed spec or profile, a malformed problem, a
budget proved infeasible) are listed in :data:`USER_ERRORS` beside autoshard's.
"""

from costmodel.errors import CostModelError
from solver.problem import ProblemError


class AutoshardError(Exception):
    """Base class of autoshard's user-facing errors."""


class ConfigError(AutoshardError, ValueError):
    """An argument or config field out of range. Also a ``ValueError``, Python's convention
    for a bad argument, so ``except ValueError`` around a config still catches it."""


class MeshError(AutoshardError):
    """The mesh does not match the world, the plan, or itself."""


class TraceError(AutoshardError):
    """The model could not be traced with the example inputs."""


class PlanError(AutoshardError):
    """A plan file that is malformed, of another version, or for another model or mesh."""


class MemoryBudgetError(AutoshardError):
    """No plan fits the memory budget (with the pins given)."""

    def __init__(self, message: str, budget_bytes: float, min_feasible_bytes: float):
        super().__init__(message)
        self.budget_bytes = budget_bytes
        """The budget asked for, bytes per device."""
        self.min_feasible_bytes = min_feasible_bytes
        """A proved lower bound on the smallest feasible budget, bytes per device."""

    def __reduce__(self):
        # Raised in a mesh search's worker process and re-raised here: pickled with its fields.
        return type(self), (str(self), self.budget_bytes, self.min_feasible_bytes)


def first_line(exc: BaseException) -> str:
    """``"KeyError: 'x'"``: an exception's type and first line, for summaries and logs."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


USER_ERRORS: tuple[type[Exception], ...] = (AutoshardError, CostModelError, ProblemError, FileNotFoundError)
"""What the CLI reports as bad input (exit 2, one line). Anything else is a bug: a traceback, exit 1."""
