"""ONNX reductions: ReduceSum/Mean/Max/Min/Prod/L1/L2/SumSquare/LogSum/LogSumExp, ArgMax/ArgMin."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cuvil import dtype as dt
from cuvil import te
from cuvil.graph.ops.base import Alias, NodeCtx, norm_axis, op
from cuvil.ir.expr import max_value

_prod = te.comm_reducer(lambda a, b: a * b, lambda t: 1, name="prod")
# identity of each reduction over an empty set, as numpy gives it
_EMPTY = {"ReduceSum": 0.0, "ReduceMean": np.nan, "ReduceMax": -np.inf, "ReduceMin": np.inf, "ReduceProd": 1.0,
          "ReduceL1": 0.0, "ReduceL2": 0.0, "ReduceSumSquare": 0.0, "ReduceLogSum": -np.inf,
          "ReduceLogSumExp": -np.inf}


def _reduce_axes(ctx: NodeCtx, rank: int) -> list[int] | None:
    """The reduced axes, or None for the identity (noop_with_empty_axes)."""
    takes_input = ctx.opset >= (13 if ctx.node.op_type == "ReduceSum" else 18)
    if takes_input:
        axes = ctx.ints(1) if ctx.has(1) else []
    else:
        axes = [int(a) for a in ctx.attr("axes", [])]
    if not axes:
        return None if int(ctx.attr("noop_with_empty_axes", 0)) else list(range(rank))
    return sorted({norm_axis(ctx, a, rank) for a in axes})


@op(*_EMPTY)
def reduce(ctx: NodeCtx) -> list:
    name = ctx.node.op_type
    xs = ctx.shape(0)
    axes = _reduce_axes(ctx, len(xs))
    if axes is None:
        return [Alias(0, xs)]
    keep = int(ctx.attr("keepdims", 1))
    out = tuple(1 if d in axes else s for d, s in enumerate(xs)) if keep else tuple(
        s for d, s in enumerate(xs) if d not in axes)
    dtype = ctx.dtype(0)
    if math.prod(out) == 0:
        return [np.zeros(out, dtype)]
    n = math.prod(xs[a] for a in axes)
    if n == 0:
        v = _EMPTY[name]
        if not dt.is_float(dtype):
            v = {np.inf: np.iinfo(dtype).max if dtype != "bool" else 1,
                 -np.inf: np.iinfo(dtype).min if dtype != "bool" else 0}.get(v, 0 if np.isnan(v) else v)
        return [np.full(out, v, dtype)]
    X = ctx.tensor(0)
    rs = {a: te.reduce_axis((0, xs[a]), name=f"r{a}") for a in axes}
    # a rank-0 input reduces over no axis: one element, reduced over a unit axis its index ignores
    axis = list(rs.values()) or [te.reduce_axis((0, 1), name="r")]

    def src(i: tuple[Any, ...]) -> Any:
        it = iter(i)
        idx = []
        for d in range(len(xs)):
            if d in rs:
                idx.append(rs[d])
                if keep:
                    next(it)
            else:
                idx.append(next(it))
        return X[tuple(idx)]

    def body(*i: Any) -> Any:
        v = src(i)
        if name in ("ReduceMax", "ReduceMin"):
            return te.max(v, axis=axis) if name == "ReduceMax" else te.min(v, axis=axis)
        if name == "ReduceProd":
            return _prod(v, axis=axis)
        if name == "ReduceL1":
            v = te.abs(v) if dt.is_signed(dtype) or dt.is_float(dtype) else v
        elif name in ("ReduceL2", "ReduceSumSquare"):
            v = v * v
        elif name == "ReduceLogSumExp":
            return te.sum(te.exp(v - m[i]), axis=axis)
        return te.sum(v, axis=axis)

    m = None
    if name == "ReduceLogSumExp":  # subtract the max first: exp cannot overflow
        m = te.compute(out, lambda *i: te.max(src(i), axis=axis), name="rmax")
        rs = {a: te.reduce_axis((0, xs[a]), name=f"s{a}") for a in axes}
        axis = list(rs.values()) or [te.reduce_axis((0, 1), name="s")]
    r = te.compute(out, body, name="reduce")
    post = {
        "ReduceMean": lambda i: r[i] * (1.0 / n) if dt.is_float(dtype) else r[i] // n,
        "ReduceL2": lambda i: te.sqrt(r[i]) if dt.is_float(dtype) else te.cast(te.sqrt(te.cast(r[i], "float64")),
                                                                               dtype),
        "ReduceLogSum": lambda i: te.log(r[i]),
        "ReduceLogSumExp": lambda i: te.log(r[i]) + m[i],
    }.get(name)
    if post is not None:
        return [te.compute(out, lambda *i: post(i), name="reduce_out")]
    return [r]


@op("ArgMax", "ArgMin")
def arg_reduce(ctx: NodeCtx) -> list:
    xs = ctx.shape(0)
    axis = norm_axis(ctx, int(ctx.attr("axis", 0)), len(xs))
    keep = int(ctx.attr("keepdims", 1))
    last = int(ctx.attr("select_last_index", 0))
    X = ctx.tensor(0)
    kept = tuple(1 if d == axis else s for d, s in enumerate(xs))
    out = kept if keep else tuple(s for d, s in enumerate(xs) if d != axis)
    if math.prod(out) == 0:
        return [np.zeros(out, np.int64)]
    r1 = te.reduce_axis((0, xs[axis]), name="r")
    is_max = ctx.node.op_type == "ArgMax"

    def at(i: tuple[Any, ...], r: Any) -> Any:
        return X[tuple(r if d == axis else i[d] for d in range(len(xs)))]

    best = te.compute(kept, lambda *i: te.max(at(i, r1), axis=r1) if is_max else te.min(at(i, r1), axis=r1),
                      name="best")
    r2 = te.reduce_axis((0, xs[axis]), name="r2")

    def body(*i: Any) -> Any:
        full = list(i)
        if not keep:
            full.insert(axis, 0)
        k = tuple(0 if d == axis else full[d] for d in range(len(xs)))
        hit = at(tuple(full), r2) == best[k]
        if last:
            return te.max(te.if_then_else(hit, te.cast(r2, "int64"), te.const(-1, "int64")), axis=r2)
        return te.min(te.if_then_else(hit, te.cast(r2, "int64"), max_value("int64")), axis=r2)

    return [te.compute(out, body, name="argidx")]

