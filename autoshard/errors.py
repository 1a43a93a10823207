"""Errors a user can act on: each names what was expected and what was found."""


class AutoshardError(ValueError):
    """Base class of autoshard's user-facing errors."""


class MeshError(AutoshardError):
    """The mesh does not match the world, the plan, or itself."""


class TraceError(AutoshardError):
    """The model could not be traced with the example inputs."""


class PlanError(AutoshardError):
    """A plan file that is malformed, of another version, or for another model or mesh."""
