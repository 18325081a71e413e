"""cuvil: a tensor compiler.

Tensor expressions (``cuvil.te``) become an exact polyhedral model (isl), a
schedule, a loop IR and native code (LLVM).  ``cuvil.lower`` shows the loops,
``cuvil.build`` compiles them into a callable module.
"""

from cuvil.errors import (
    ArgumentError,
    CuvilError,
    DTypeError,
    ScheduleError,
    ShapeError,
    TargetError,
    UnsupportedOpError,
)

__version__ = "0.1.0"

__all__ = [
    "ArgumentError", "CuvilError", "DTypeError", "ScheduleError", "ShapeError", "TargetError",
    "UnsupportedOpError", "__version__",
]
