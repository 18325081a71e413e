"""The cuvil error hierarchy.

Every public entry point raises one of these with a message that says what is
wrong, where (tensor, dimension, argument, dependence) and, where it helps,
what would be legal instead.
"""

from __future__ import annotations


class CuvilError(Exception):
    """Base class of every error cuvil raises on purpose."""


class ScheduleError(CuvilError):
    """A schedule primitive was malformed or would change the results."""


class ShapeError(CuvilError, ValueError):
    """A tensor, index or argument has the wrong rank or extent."""


class BoundsError(ShapeError, IndexError):
    """A run-time index (read from data, such as a Gather's) or run-time sizes for which an access would
    leave its tensor: found by a bounds check before any memory outside the tensor is touched."""


class DTypeError(CuvilError, TypeError):
    """Data types that do not fit together, or an unsupported dtype."""


class TargetError(CuvilError):
    """An unknown or unsupported target string, or a toolchain problem."""


class IslBudgetError(CuvilError):
    """isl ran out of its operation bound on a program (too large or too irregular to model exactly)."""


class ModelError(CuvilError, ValueError):
    """An invalid model: a dangling input, a failed shape inference, a malformed attribute."""


class UnsupportedOpError(CuvilError):
    """An operation cuvil cannot compile (yet)."""


class ArgumentError(CuvilError, TypeError):
    """A compiled module was called with the wrong arguments."""
