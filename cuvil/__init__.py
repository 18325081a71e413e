"""cuvil: a tensor compiler.

Tensor expressions (``cuvil.te``) become an exact polyhedral model (isl), a
schedule, a loop IR and native code (LLVM).  ``cuvil.lower`` shows the loops,
``cuvil.build`` compiles them into a callable module.

``import cuvil`` stays light: islpy and llvmlite load on first use, so an
exported library runs through ``cuvil.runtime.load`` without either.
"""

from __future__ import annotations

from cuvil.errors import (
    ArgumentError,
    BoundsError,
    CuvilError,
    DTypeError,
    IslBudgetError,
    ModelError,
    ScheduleError,
    ShapeError,
    TargetError,
    UnsupportedOpError,
)
from cuvil.lazy import lazy_attributes

__version__ = "0.1.0"

_LAZY = {
    "te": ("cuvil.te", None),
    "lower": ("cuvil.pipeline", "lower"),
    "build": ("cuvil.pipeline", "build"),
    "Target": ("cuvil.target", "Target"),
    "CompileOptions": ("cuvil.options", "CompileOptions"),
    "auto_schedule": ("cuvil.schedule.auto", "auto_schedule"),
    "compile": ("cuvil.decorator", "compile"),
    "runtime": ("cuvil.runtime", None),
    "set_num_threads": ("cuvil.runtime.threads", "set_num_threads"),
    "get_num_threads": ("cuvil.runtime.threads", "get_num_threads"),
    "autotune": ("cuvil.autotune", None),
}

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "ArgumentError", "BoundsError", "CompileOptions", "CuvilError", "DTypeError", "IslBudgetError", "ModelError",
    "ScheduleError", "ShapeError", "Target", "TargetError", "UnsupportedOpError", "__version__", "auto_schedule",
    "autotune", "build", "compile", "get_num_threads", "lower", "runtime", "set_num_threads", "te",
]
