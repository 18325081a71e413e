"""How many threads a ``parallel`` loop uses, and the native library that runs them.

Precedence: ``set_num_threads(n)`` > the ``CUVIL_NUM_THREADS`` environment
variable > all cores this process may run on.  Every compiled or loaded
module exports ``void <name>_set_num_threads(int32_t n)`` (its thread count
lives in the module); this file keeps a weak registry of live modules and
pushes the count into each one when it is created or loaded and whenever
``set_num_threads`` changes it, so a call costs nothing extra.
``CUVIL_NUM_THREADS`` is read when a module is created or loaded.

Parallel loops run on libgomp (GCC's OpenMP runtime: ``GOMP_parallel``);
:func:`load_libgomp` makes its symbols visible to the JIT.  Only ctypes, os
and weakref are imported here (llvmlite only inside load_libgomp, for the JIT): a
library loaded without llvmlite uses this file too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import weakref
from typing import Any

from cuvil.errors import ArgumentError, TargetError

_explicit: int | None = None
_modules: weakref.WeakSet[Any] = weakref.WeakSet()
SETTER = ctypes.CFUNCTYPE(None, ctypes.c_int32)


def set_num_threads(n: int | None) -> None:
    """Use ``n`` threads in every parallel loop from now on (``None``: back to the default)."""
    global _explicit
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1 << 16):
        raise ArgumentError(f"set_num_threads needs an int between 1 and 65536 (or None), got {n!r}")
    _explicit = n
    count = get_num_threads()
    for m in list(_modules):
        m._set_threads(count)


def explicit_num_threads() -> int | None:
    """The count :func:`set_num_threads` gave, or None when it was not called (or was reset)."""
    return _explicit


def get_num_threads() -> int:
    """The thread count parallel loops use: set_num_threads > CUVIL_NUM_THREADS > all cores."""
    if _explicit is not None:
        return _explicit
    env = os.environ.get("CUVIL_NUM_THREADS", "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise ArgumentError(f"CUVIL_NUM_THREADS must be a positive integer, got {env!r}")
        return n
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def register(module: Any, setter: Any) -> None:
    """Give ``module`` (which holds ``setter``, its ``<name>_set_num_threads``) the current count."""
    module._threads_setter = setter
    setter(get_num_threads())
    _modules.add(module)


_GOMP: Any = None


SPIN_COUNT = "3000"  # libgomp's wait before sleeping, in pause instructions (~0.1-0.2 ms here)


def prefer_short_spins() -> None:
    """Make libgomp's idle threads spin briefly, then sleep (``GOMP_SPINCOUNT=3000``, ~0.1-0.2 ms),
    unless the user chose (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set).  libgomp reads it when it
    loads, so this runs before cuvil loads it (the JIT, or an exported library that links it).

    Why: libgomp's default spins ~300000 times (tens of ms) before sleeping, and a spinning thread
    takes the core a descheduled team member needs: on the shared 2-core machine at load 1-5,
    2-thread runs were 5-40x slower than 1-thread ones (a 128x768 softmax 8 ms instead of 0.08 ms).
    Sleeping at once (``OMP_WAIT_POLICY=passive``) costs a futex wake-up of 30-60 us per parallel
    loop instead, which small kernels cannot pay (2 threads, quiet machine, median of 5 runs,
    ratio onnxruntime / cuvil, passive -> 3000 spins: softmax 128x768 0.54 -> 0.93, depthwise 3x3
    384@14 0.63 -> 0.97, 960@7 0.47 -> 0.77; 10000 spins measured the same); a short spin keeps the
    team awake between kernels called back to back and bounds what an idle team takes from others.
    On a machine busy with other processes a spinning thread at the closing barrier still holds the
    core its late team member needs: there set ``OMP_WAIT_POLICY=passive``."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT


def load_libgomp() -> Any:
    """Load libgomp into the process with its symbols visible to the JIT (needs llvmlite)."""
    global _GOMP
    if _GOMP is None:
        prefer_short_spins()
        name = ctypes.util.find_library("gomp") or "libgomp.so.1"
        try:
            _GOMP = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise TargetError(
                f"parallel loops run on libgomp (GCC's OpenMP runtime), which cannot be loaded: {exc}; "
                "install it (Debian/Ubuntu: apt-get install libgomp1) or remove .parallel() from the schedule"
            ) from None
        import llvmlite.binding as llvm

        llvm.load_library_permanently(name)
    return _GOMP
