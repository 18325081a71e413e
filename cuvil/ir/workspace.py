"""A kernel's large scratch buffers become arguments its caller places (a pure pass on the loop IR).

A kernel lowered from several stages keeps the intermediate ones in ``global`` buffers: a Winograd
convolution's padded input, transformed tiles and products (3.7 MB for ResNet-18's 128 @ 28 x 28).  The code
generator puts a buffer above its stack limit on the heap, one ``aligned_alloc``/``free`` per call, and glibc
returns the freed megabytes to the system at once (its trim threshold follows the largest block freed, and
three such blocks together exceed it): the next call faults every page in again (ResNet-18 at 1 thread:
~2250 page faults and ~3.4 ms of system time per 29 ms run; at 2 threads the two threads' faults queue on
the process's memory map, and a 1.1 ms Winograd convolution ran 1.13x faster instead of ~1.9x).

:func:`hoist_workspace` turns each such buffer that the body allocates outside every loop, with a constant
shape, into a trailing parameter listed in ``LoweredFunc.workspace``::

    func k(X: ..., out: ...) {                          func k(X: ..., out: ..., wino_in: float32[4, 4, 1, 128, 196]) {
      global float32 wino_in[4, 4, 1, 128, 196];   ->     parallel for (c = 0; c < 128; c++) { ... }
      parallel for (c = 0; c < 128; c++) { ... }        ...

The graph compiler gives each workspace parameter a temporary that lives for that call only, in the
memory plan's arena (cuvil/graph/memplan.py), so kernels called one after the other share its bytes and no
call allocates.  Buffers inside loops (a parallel loop's per-thread tiles), of run-time size, or small
enough for the stack stay where they are.
"""

from __future__ import annotations

import dataclasses
import math

from cuvil import dtype as dt
from cuvil.ir.expr import Const
from cuvil.ir.stmt import Allocate, Block, Buffer, LoweredFunc, Stmt

MIN_BYTES = 64 * 1024  # smaller buffers live on the stack (cuvil.codegen.llvm.STACK_LIMIT): nothing to save


def _size(buf: Buffer) -> int | None:
    if not all(isinstance(d, Const) for d in buf.shape):
        return None
    return math.prod(int(d.value) for d in buf.shape) * dt.nbytes(buf.dtype)


def _hoist(s: Stmt, found: list[Buffer], min_bytes: int) -> Stmt:
    """``s`` without the Allocates it makes outside every loop (those big enough), which go to ``found``."""
    if isinstance(s, Allocate):
        size = _size(s.buffer)
        body = _hoist(s.body, found, min_bytes)
        if s.buffer.scope == "global" and size is not None and size > min_bytes:
            found.append(s.buffer)
            return body
        return s if body is s.body else Allocate(s.buffer, body)
    if isinstance(s, Block):
        stmts = tuple(_hoist(x, found, min_bytes) for x in s.stmts)
        return s if all(a is b for a, b in zip(stmts, s.stmts)) else Block(stmts)
    return s


def hoist_workspace(func: LoweredFunc, min_bytes: int = MIN_BYTES) -> LoweredFunc:
    """``func`` with its loop-free, constant-size ``global`` Allocates above ``min_bytes`` as trailing
    parameters (``workspace``), in the order the body allocated them."""
    found: list[Buffer] = []
    body = _hoist(func.body, found, min_bytes)
    if not found:
        return func
    return dataclasses.replace(func, params=func.params + tuple(found), body=body,
                               workspace=func.workspace + tuple(found))


def workspace_bytes(func: LoweredFunc) -> int:
    """The bytes of ``func``'s workspace parameters."""
    return sum(_size(b) or 0 for b in func.workspace)
