"""ONNX operators that read or write at data-dependent positions: GatherElements, GatherND, ScatterND,
ScatterElements, OneHot.

Indices may be negative (``-n .. n-1`` counts from the end of the indexed dimension, as ONNX says).
Indices known at compile time are checked then (an index out of range is a ``ShapeError`` naming the
node).  Indices fed at run time are checked when the kernel runs (``NodeCtx.index``, one compare per
index where it is read): an index out of range stops the run with a ``BoundsError`` naming the node,
the input and the index, as onnxruntime refuses it; nothing is clamped, wrapped (beyond the
negative-index rule) or dropped.  ``bounds_checks=False`` (the session's, or ``compile_graph``'s)
leaves the checks out: an index out of range is then undefined behaviour, as in C.

The scatters copy ``data`` and then apply each update in order (``te.scatter``): ``out[p] (op)=
update`` where the update's index sends it, the last one winning for ``reduction="none"``, as
onnxruntime writes them.  That costs (output size) + (number of updates); a ScatterND whose indices
are known at compile time instead reads a table, built then, of the update that lands on each position.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cuvil import dtype as dt
from cuvil import te
from cuvil.errors import DTypeError
from cuvil.graph.ops.base import Alias, NodeCtx, Shaped, norm_axis, op

_INDEX_TYPES = ("int32", "int64")


def _index_input(ctx: NodeCtx, i: int, what: str = "indices") -> None:
    if ctx.dtype(i) not in _INDEX_TYPES:
        raise DTypeError(f"{ctx.node}: {what} (input {i}) are {ctx.dtype(i)}; ONNX wants int32 or int64")


def _check_known(ctx: NodeCtx, i: int, bounds: Sequence[int] | int) -> None:
    """Indices known at compile time must lie in ``-n .. n-1`` (``bounds``: n, or one n per last-axis entry)."""
    if not ctx.known(i):
        return
    v = np.asarray(ctx.entries[i]).astype(np.int64)
    n = np.asarray(bounds, np.int64)
    bad = (v < -n) | (v >= n)
    if bad.any():
        at = tuple(int(x) for x in np.argwhere(bad)[0])
        lim = int(n if n.ndim == 0 else n[at[-1]])
        raise ctx.error(f"index {int(v[at])} at {list(at)} of input {i} is out of range for a dimension of size {lim}")


def _reduction(ctx: NodeCtx) -> str:
    r = ctx.attr("reduction", "none")
    r = r.decode() if isinstance(r, bytes) else str(r)
    if r not in ("none", "add", "mul", "max", "min"):
        raise ctx.error(f"reduction {r!r} is not one of none, add, mul, max, min")
    if r != "none" and ctx.dtype(0) == "bool":
        raise DTypeError(f"{ctx.node}: reduction {r!r} on bool data")
    return r


def _combine(kind: str, d: Any, u: Any) -> Any:
    """``d (op) u`` for the scatter ``reduction`` ``kind`` (not "none")."""
    if kind == "add":
        return d + u
    if kind == "mul":
        return d * u
    return te.max(d, u) if kind == "max" else te.min(d, u)


# -- gathers ---------------------------------------------------------------------------------


@op("GatherElements")
def gather_elements(ctx: NodeCtx) -> list:
    """``out[i] = data[i with axis replaced by indices[i]]``; ``indices`` has the rank of ``data`` and
    the output its shape (each dimension at most ``data``'s, except along ``axis``)."""
    shp, ishp = ctx.shape(0), ctx.shape(1)
    _index_input(ctx, 1)
    if len(ishp) != len(shp):
        raise ctx.error(f"indices of rank {len(ishp)} for data of rank {len(shp)}: they must have the same rank")
    axis = norm_axis(ctx, int(ctx.attr("axis", 0)), len(shp))
    for d, (n, m) in enumerate(zip(shp, ishp)):
        if d != axis and m > n:
            raise ctx.error(f"indices {list(ishp)} are larger than data {list(shp)} in dimension {d}")
    if math.prod(ishp) == 0:
        return [np.zeros(ishp, ctx.dtype(0))]
    if shp[axis] == 0:
        raise ctx.error(f"gathers from an empty axis {axis} of data {list(shp)}")
    _check_known(ctx, 1, shp[axis])
    x, idx = ctx.tensor(0), ctx.tensor(1)
    n = shp[axis]
    return [te.compute(ishp, lambda *i: x[i[:axis] + (ctx.index(idx[i], n, 1),) + i[axis + 1:]], name="gather_el")]


def _nd_layout(ctx: NodeCtx, b: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """GatherND/ScatterND: data and indices shapes and ``k`` (the length of an index tuple), checked."""
    shp, ishp = ctx.shape(0), ctx.shape(1)
    _index_input(ctx, 1)
    if len(ishp) < 1 or len(shp) < 1:
        raise ctx.error(f"data {list(shp)} and indices {list(ishp)} must both have rank >= 1")
    k = ishp[-1]
    if not 0 <= b < min(len(shp), len(ishp)):
        raise ctx.error(f"batch_dims {b} must be less than the ranks of data ({len(shp)}) and indices ({len(ishp)})")
    if shp[:b] != ishp[:b]:
        raise ctx.error(f"the {b} batch dimensions of data {list(shp)} and indices {list(ishp)} differ")
    if k > len(shp) - b:
        raise ctx.error(f"index tuples of length {k} for data {list(shp)} with {b} batch dimensions")
    return shp, ishp, k


@op("GatherND")
def gather_nd(ctx: NodeCtx) -> list:
    """``out[i, j] = data[i[:b], indices[i], j]``: each index tuple (the last axis of ``indices``, of
    length k) picks a slice of ``data`` after its ``b = batch_dims`` leading (shared) dimensions; the
    output's shape is ``indices.shape[:-1] + data.shape[b + k:]``."""
    b = int(ctx.attr("batch_dims", 0))
    shp, ishp, k = _nd_layout(ctx, b)
    out = ishp[:-1] + shp[b + k:]
    if math.prod(out) == 0:
        return [np.zeros(out, ctx.dtype(0))]
    _check_known(ctx, 1, list(shp[b:b + k]))
    x, idx = ctx.tensor(0), ctx.tensor(1)
    q = len(ishp) - 1

    def body(*o: Any) -> Any:
        i, j = o[:q], o[q:]
        picked = tuple(ctx.index(idx[i + (c,)], shp[b + c], 1) for c in range(k))
        return x[i[:b] + picked + j]

    return [te.compute(out, body, name="gather_nd")]


# -- scatters --------------------------------------------------------------------------------


def _scatter_inputs(ctx: NodeCtx) -> None:
    if ctx.dtype(2) != ctx.dtype(0):
        raise DTypeError(f"{ctx.node}: updates are {ctx.dtype(2)} but data is {ctx.dtype(0)}")


@op("ScatterND")
def scatter_nd(ctx: NodeCtx) -> list:
    """``out = data`` with ``out[indices[u]] (op)= updates[u]`` for every update ``u``: index tuples of
    length k address slices ``data.shape[k:]``; ``updates`` has shape ``indices.shape[:-1] +
    data.shape[k:]``.  Computed over ``data`` seen as (positions P, slice R) and ``updates`` as
    (updates U, slice R)."""
    shp, ishp, k = _nd_layout(ctx, 0)
    _scatter_inputs(ctx)
    kind = _reduction(ctx)
    want = ishp[:-1] + shp[k:]
    if ctx.shape(2) != want:
        raise ctx.error(f"updates {list(ctx.shape(2))} must have shape {list(want)} (indices[:-1] + data[k:])")
    n_pos, n_upd, n_row = math.prod(shp[:k]), math.prod(ishp[:-1]), math.prod(shp[k:])
    if n_upd == 0 or n_row == 0:
        return [Alias(0, shp)]
    _check_known(ctx, 1, list(shp[:k]))
    data = ctx.tensor(0, (n_pos, n_row))
    upd = ctx.tensor(2, (n_upd, n_row))
    if ctx.known(1):
        table = _nd_table(ctx, shp[:k], kind)
        if table is not None:  # each position has at most one update to apply
            t = ctx.constant(table)
            body = (lambda p, r: te.if_then_else(t[p] >= 0, upd[t[p], r], data[p, r])) if kind == "none" else (
                lambda p, r: te.if_then_else(t[p] >= 0, _combine(kind, data[p, r], upd[t[p], r]), data[p, r]))
            return [Shaped(te.compute((n_pos, n_row), body, name="scatter_nd"), shp)]
    idx = ctx.tensor(1, (n_upd, k))

    def flat(u: Any) -> Any:  # the position update u writes (its index checked when the kernel runs)
        pos = te.const(0, "int64")
        for c in range(k):
            pos = pos * shp[c] + ctx.index(idx[u, c], shp[c], 1)
        return pos

    res = te.scatter(data, (n_upd, n_row), lambda u, r: (flat(u), r), lambda u, r: upd[u, r], _combiner(kind),
                     name="scatter_nd")
    return [Shaped(res, shp)]


def _nd_table(ctx: NodeCtx, dims: tuple[int, ...], kind: str) -> np.ndarray | None:
    """For indices known at compile time: per position, the update applied there (the last one for
    ``none``), -1 for none; None when a reduction meets a position twice."""
    v = np.asarray(ctx.value(1)).astype(np.int64).reshape(-1, len(dims))
    v = np.where(v < 0, v + np.asarray(dims, np.int64), v)
    pos = np.ravel_multi_index(tuple(v.T), dims) if len(dims) else np.zeros(len(v), np.int64)
    if kind != "none" and len(np.unique(pos)) != len(pos):
        return None
    table = np.full(math.prod(dims), -1, np.int64)
    table[pos] = np.arange(len(pos))  # numpy assigns in order: the last update to a position wins
    return table


def _combiner(kind: str) -> Callable[[Any, Any], Any] | None:
    """How an update meets the element it lands on: stored over it ("none"), or combined with it."""
    return None if kind == "none" else lambda old, new: _combine(kind, old, new)


@op("ScatterElements", "Scatter")
def scatter_elements(ctx: NodeCtx) -> list:
    """``out = data`` with ``out[u with axis replaced by indices[u]] (op)= updates[u]`` for every
    position ``u`` of ``indices`` (``updates`` has its shape, and it is at most ``data``'s in every
    dimension but ``axis``).  Scatter (opset 9-10) is the same operator without ``reduction``."""
    shp, ishp = ctx.shape(0), ctx.shape(1)
    _index_input(ctx, 1)
    _scatter_inputs(ctx)
    kind = _reduction(ctx)
    if len(ishp) != len(shp) or ctx.shape(2) != ishp:
        raise ctx.error(f"indices {list(ishp)} and updates {list(ctx.shape(2))} must have one shape, of the rank "
                        f"of data {list(shp)}")
    axis = norm_axis(ctx, int(ctx.attr("axis", 0)), len(shp))
    for d, (n, m) in enumerate(zip(shp, ishp)):
        if d != axis and m > n:
            raise ctx.error(f"indices {list(ishp)} are larger than data {list(shp)} in dimension {d}")
    if math.prod(ishp) == 0 or math.prod(shp) == 0:
        return [Alias(0, shp)]
    _check_known(ctx, 1, shp[axis])
    data, idx, upd = ctx.tensor(0), ctx.tensor(1), ctx.tensor(2)
    n = shp[axis]

    def at(*u: Any) -> tuple[Any, ...]:  # update u lands on u with axis replaced by its index
        return u[:axis] + (ctx.index(idx[u], n, 1),) + u[axis + 1:]

    return [te.scatter(data, ishp, at, lambda *u: upd[u], _combiner(kind), name="scatter")]


# -- OneHot ----------------------------------------------------------------------------------


@op("OneHot")
def one_hot(ctx: NodeCtx) -> list:
    """``out[..., j, ...] = values[1] if indices[...] == j else values[0]``, with ``j`` along a new axis
    ``axis`` of length ``depth`` (a constant); negative indices count from ``depth``; an index outside
    ``-depth .. depth-1`` gives a row of ``values[0]``."""
    ishp = ctx.shape(0)
    depth_v = np.asarray(ctx.value(1)).reshape(-1)
    if depth_v.size != 1:
        raise ctx.error(f"depth must be a scalar, got {depth_v.size} values")
    depth = int(depth_v[0])
    if depth < 1:
        raise ctx.error(f"depth {depth} must be at least 1")
    if ctx.shape(2) not in ((2,),):
        raise ctx.error(f"values must hold two entries [off, on], got shape {list(ctx.shape(2))}")
    rank = len(ishp) + 1
    axis = norm_axis(ctx, int(ctx.attr("axis", -1)), rank)
    out = ishp[:axis] + (depth,) + ishp[axis:]
    if math.prod(out) == 0:
        return [np.zeros(out, ctx.dtype(2))]
    ix, vals = ctx.tensor(0), ctx.tensor(2)
    itype = ctx.dtype(0)

    def body(*o: Any) -> Any:
        v = ix[o[:axis] + o[axis + 1:]]
        if dt.is_float(itype):  # ONNX casts float indices to integers (toward zero)
            v = te.trunc(v)
        v = te.cast(v, "int64") if v.dtype != "int64" else v
        v = te.if_then_else(v < 0, v + depth, v)
        return te.if_then_else(v == o[axis], vals[1], vals[0])

    return [te.compute(out, body, name="one_hot")]
