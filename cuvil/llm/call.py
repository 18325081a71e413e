"""Kernel calls bound once, run every step.

A generation loop calls the same kernels on the same buffers every step, so the arguments are checked and
packed once (:meth:`cuvil.runtime.call.CallPlan.pack`, which also refuses arrays of the wrong shape, dtype or
layout) and each step only calls the native function, after moving what changes between steps: the
pointer of a KV cache slot (:meth:`Bound.point`) or a size variable such as the attended length
(:meth:`Bound.size`).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from cuvil.errors import BoundsError, ShapeError

__all__ = ["Bound"]


class Bound:
    """``module(*args)`` with its arguments packed once; ``bound()`` runs it again."""

    def __init__(self, module: Any, *args: Any):
        self.module = module
        self.plan = module.plan
        self._ptrs, self._sizes, self._keep = self.plan.pack(tuple(args))
        self._keep = list(self._keep)
        self._cfunc = module._cfunc
        meta = self.plan.meta
        self._size_index = {n: j for j, n in enumerate(meta.get("size_vars", []))}
        self._slots = {pos: slot for pos, slot, *_ in self.plan.buffers}

    def __call__(self) -> None:
        rc = self._cfunc(self._ptrs, self._sizes)
        if rc:
            self.module(*self._keep)  # the checked call says what went wrong
            raise BoundsError(f"{self.plan.name}: the kernel returned status {rc}")

    def point(self, pos: int, array: np.ndarray) -> None:
        """Argument ``pos`` is now ``array`` (same shape, dtype and contiguity as when bound)."""
        old = self._keep[pos]
        if array.shape != old.shape or array.dtype != old.dtype or not array.flags.c_contiguous:
            raise ShapeError(f"{self.plan.name}: argument {pos} was bound to {old.dtype} {list(old.shape)}; "
                             f"got {array.dtype} {list(array.shape)}")
        self._keep[pos] = array
        self._ptrs[self._slots[pos]] = array.ctypes.data

    def size(self, name: str, value: int) -> None:
        """Set size variable ``name`` (the caller keeps the arrays consistent with it)."""
        self._sizes[self._size_index[name]] = ctypes.c_int64(int(value)).value
