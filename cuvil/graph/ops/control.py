"""Control flow: ``CuvilEmbeddingBag`` (what :mod:`cuvil.graph.loops` makes of an embedding bag's ``Loop``),
and the ONNX control-flow and sequence operators the exporters write around it, which reach a builder
only when that pass did not recognise them (an UnsupportedOpError saying what cuvil compiles instead).

``CuvilEmbeddingBag(data, indices, offsets, bags, ends; mode, empty, start, end)``: bag ``b`` (of
``bags``, a scalar known when compiling) reduces the rows ``data[indices[i]]`` (``data[i]`` without
``indices``) for ``i`` in ``[offsets[b + start], ends[b + end])`` (``ends`` is ``offsets`` when absent) by
``mode`` (sum, mean or max); a bag with no rows is ``empty``::

    out[b, d] = sum(data[indices[i], d] for i in range(offsets[b + start], offsets[b + end]))

The kernel is a reduction over every row guarded by ``starts[b] <= i < ends[b]``; after lowering,
:mod:`cuvil.ir.guards` turns that guard into the bounds of the row loop, so bag ``b`` visits its own
``ends[b] - starts[b]`` rows (the work is that of the rows, not bags x rows).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cuvil import dtype as dt
from cuvil import te
from cuvil.graph.ops.base import NodeCtx, op

BAG_MODES = ("sum", "mean", "max")


@op("CuvilEmbeddingBag")
def embedding_bag(ctx: NodeCtx) -> list:
    mode = str(ctx.attr("mode", "sum"))
    if mode not in BAG_MODES:
        raise ctx.error(f"mode {mode!r} is not one of {', '.join(BAG_MODES)}")
    dtype = ctx.dtype(0)
    if not dt.is_float(dtype):
        raise ctx.unsupported(f"data of type {dtype}: the bags of a float table")
    ds = ctx.shape(0)
    gathered = ctx.has(1)
    bags = int(ctx.ints(3)[0])
    first, last = int(ctx.attr("start", 0)), int(ctx.attr("end", 1))
    ends = 4 if ctx.has(4) else 2
    if len(ds) < 1 or len(ctx.shape(2)) != 1 or len(ctx.shape(ends)) != 1 or (gathered and len(ctx.shape(1)) != 1):
        raise ctx.error(f"data {list(ds)}, indices {list(ctx.shape(1)) if gathered else None}, offsets "
                        f"{list(ctx.shape(2))} and ends {list(ctx.shape(ends))}: want rows x ..., a vector of row "
                        "numbers and vectors of offsets")
    if min(first, last) < 0 or bags < 0 or bags + first > ctx.shape(2)[0] or bags + last > ctx.shape(ends)[0]:
        raise ctx.error(f"{bags} bags from offset {first} of the starts and {last} of the ends do not fit in "
                        f"{ctx.shape(2)[0]} and {ctx.shape(ends)[0]} offsets")
    n = ctx.shape(1)[0] if gathered else ds[0]
    out_shape = (bags,) + tuple(ds[1:])
    default = {"sum": 0.0, "mean": 0.0, "max": -math.inf}[mode]
    empty = float(ctx.attr("empty", default))
    if math.prod(out_shape) == 0 or n == 0:
        return [np.full(out_shape, empty, dtype)]
    data = ctx.tensor(0)
    idx = ctx.tensor(1) if gathered else None
    offsets, stops = ctx.tensor(2), ctx.tensor(ends)
    vt = offsets.dtype
    if stops.dtype != vt:
        raise ctx.error(f"offsets of {vt} and ends of {stops.dtype}")
    i = te.reduce_axis((0, n), name="i")

    def row(rest: tuple[Any, ...]) -> Any:
        r = ctx.index(te.cast(idx[i], "int64"), ds[0], 1) if idx is not None else i
        return data[(r,) + rest]

    def inside(b: Any) -> Any:
        k = te.cast(i, vt)
        return te.all(offsets[b + first] <= k, k < stops[b + last])

    if mode == "max":
        red = te.compute(out_shape, lambda b, *r: te.max(row(r), axis=i, where=inside(b)), name="bag")
    else:
        red = te.compute(out_shape, lambda b, *r: te.sum(row(r), axis=i, where=inside(b)), name="bag")
    if mode == "sum" and empty == 0.0:
        return [red]

    def count(b: Any) -> Any:
        return te.min(stops[b + last], te.const(n, vt)) - te.max(offsets[b + first], te.const(0, vt))

    def finish(b: Any, *r: Any) -> Any:
        v = red[(b,) + r]
        if mode == "mean":
            v = v / te.cast(te.max(count(b), te.const(1, vt)), dtype)
        return te.if_then_else(count(b) > te.const(0, vt), v, te.const(empty, dtype))

    return [te.compute(out_shape, finish, name="bag_out")]


LOOP_PATTERNS = (
    "cuvil compiles a Loop as an embedding bag (iteration k slices the rows offsets[k]:offsets[k + 1] of a "
    "table, or of ids it gathers the table's rows by, reduces them with ReduceSum, ReduceMean or ReduceMax, "
    "an If may give an empty bag a constant, and emits the result as a scan output or appends it to a "
    "sequence that ConcatFromSequence stacks; the trip count is given with no exit condition, or a counter "
    "stepped by 1 is compared with a constant), or unrolled when its trip count is a constant, its "
    "condition stays true and its body has no sub-graphs; the sequence operators only inside such loops")


def _refuse(ctx: NodeCtx) -> list:
    raise ctx.unsupported(f"the graph pass 'embedding-bag loops' did not rewrite it; {LOOP_PATTERNS}")


op("Loop", "SequenceEmpty", "SequenceInsert", "ConcatFromSequence")(_refuse)
