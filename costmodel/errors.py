"""Errors a caller of the cost model can act on (a bad spec, profile or calibration setting).

They subclass ``ValueError``, Python's convention for a bad argument, so that a plain
``except ValueError`` still catches them; the CLI reports only these (and the other
packages' user errors) as bad input, never an arbitrary ``ValueError`` from a bug.
"""


class CostModelError(ValueError):
    """Input to the cost model that is malformed or out of range; the message has the values."""
