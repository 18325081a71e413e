"""ONNX normalisations beside LayerNormalization (in ``nn``): RMSNormalization, GroupNormalization,
InstanceNormalization, MeanVarianceNormalization, LpNormalization, and Hardmax.

RMS, group and instance normalisation compute their statistics in float32 when the input is float16
(ONNX's ``stash_type=1``, the default), over a 2-D view of the input: (rows, normalised elements).
"""

from __future__ import annotations

import math
from typing import Any

from cuvil import dtype as dt
from cuvil import te
from cuvil.errors import DTypeError
from cuvil.graph.ops.base import NodeCtx, Shaped, broadcast_shapes, norm_axis, op


def _float_input(ctx: NodeCtx) -> str:
    dtype = ctx.dtype(0)
    if not dt.is_float(dtype):
        raise DTypeError(f"{ctx.node}: input 0 is {dtype}; this operator needs a float tensor")
    for i in range(1, ctx.n_inputs):
        if ctx.has(i) and ctx.dtype(i) != dtype:
            raise DTypeError(f"{ctx.node}: input {i} is {ctx.dtype(i)}, input 0 is {dtype}")
    return dtype


def _row_sum(x: Any, rows: int, n: int, f: Any, name: str) -> Any:
    r = te.reduce_axis((0, n), name="r")
    return te.compute((rows,), lambda i: te.sum(f(x[i, r], i), axis=r), name=name)


@op("RMSNormalization")
def rms_norm(ctx: NodeCtx) -> list:
    """``y = x / sqrt(mean(x^2) + epsilon) * scale``, the mean over the axes from ``axis`` (default -1)
    to the last; ``scale`` broadcasts to those axes."""
    dtype = _float_input(ctx)
    xs = ctx.shape(0)
    axis = norm_axis(ctx, int(ctx.attr("axis", -1)), len(xs))
    eps = float(ctx.attr("epsilon", 1e-5))
    work = "float32" if dtype == "float16" else dtype
    tail = xs[axis:]
    rows, n = math.prod(xs[:axis]), math.prod(tail)
    ws = ctx.shape(1)
    if len(ws) > len(tail) or broadcast_shapes(ctx, ws, tail) != tail:
        raise ctx.error(f"scale {list(ws)} does not broadcast to the normalised axes {list(tail)}")
    x0 = ctx.tensor(0, (rows, n))
    x = x0 if work == dtype else te.compute((rows, n), lambda i, j: te.cast(x0[i, j], work), name="x32")
    ss = _row_sum(x, rows, n, lambda v, i: v * v, "sumsq")
    inv = te.compute((rows,), lambda i: 1.0 / te.sqrt(ss[i] * (1.0 / n) + eps), name="invrms")
    w = ctx.tensor(1, (1,) * (len(tail) - len(ws)) + ws)
    wshape = (1,) * (len(tail) - len(ws)) + ws

    def scale(j: Any) -> Any:  # the scale at column j of the (rows, n) view, under broadcasting
        idx, rest = [], j
        for d in reversed(range(len(tail))):
            idx.append(0 if wshape[d] == 1 else rest % tail[d])
            rest = rest // tail[d]
        return te.cast(w[tuple(reversed(idx))], work)

    def body(i: Any, j: Any) -> Any:
        y = x[i, j] * inv[i] * scale(j)
        return te.cast(y, dtype) if work != dtype else y

    return [Shaped(te.compute((rows, n), body, name="rmsnorm"), xs)]


@op("GroupNormalization")
def group_norm(ctx: NodeCtx) -> list:
    """x of shape (N, C, ...) in ``num_groups`` groups of C/num_groups channels: each (sample, group)
    is normalised by its mean and variance, then ``y = xhat * scale + bias`` per channel (opset 21;
    per group before, opset 18)."""
    g = int(ctx.attr("num_groups", 0))
    return [_group_norm(ctx, g, ctx.opset >= 21)]


@op("InstanceNormalization")
def instance_norm(ctx: NodeCtx) -> list:
    """Each (sample, channel) of x (N, C, ...) normalised over its spatial elements, then scaled and
    shifted per channel: GroupNormalization with one group per channel."""
    xs = ctx.shape(0)
    if len(xs) < 3:
        raise ctx.error(f"the input {list(xs)} must have rank >= 3 (N, C, spatial...)")
    return [_group_norm(ctx, xs[1], True)]


def _group_norm(ctx: NodeCtx, g: int, per_channel: bool) -> Shaped:
    dtype = _float_input(ctx)
    xs = ctx.shape(0)
    if len(xs) < 2:
        raise ctx.error(f"the input {list(xs)} must have rank >= 2 (N, C, ...)")
    c = xs[1]
    if g < 1 or c % g:
        raise ctx.error(f"num_groups {g} must divide the {c} channels")
    eps = float(ctx.attr("epsilon", 1e-5))
    want = (c,) if per_channel else (g,)
    for i in (1, 2):
        if ctx.shape(i) != want:
            raise ctx.error(f"input {i} has shape {list(ctx.shape(i))}, expected {list(want)}")
    work = "float32" if dtype == "float16" else dtype
    cg, spatial = c // g, math.prod(xs[2:])
    rows, n = xs[0] * g, cg * spatial
    x0 = ctx.tensor(0, (rows, n))
    x = x0 if work == dtype else te.compute((rows, n), lambda i, j: te.cast(x0[i, j], work), name="x32")
    total = _row_sum(x, rows, n, lambda v, i: v, "gsum")
    mean = te.compute((rows,), lambda i: total[i] * (1.0 / n), name="mean")
    var = _row_sum(x, rows, n, lambda v, i: (v - mean[i]) * (v - mean[i]), "gvar")
    inv = te.compute((rows,), lambda i: 1.0 / te.sqrt(var[i] * (1.0 / n) + eps), name="invstd")
    scale, bias = ctx.tensor(1), ctx.tensor(2)

    def body(i: Any, j: Any) -> Any:
        p = (i % g) * cg + j // spatial if per_channel else i % g
        y = (x[i, j] - mean[i]) * inv[i] * te.cast(scale[p], work) + te.cast(bias[p], work)
        return te.cast(y, dtype) if work != dtype else y

    return Shaped(te.compute((rows, n), body, name="groupnorm"), xs)


# -- over arbitrary axes -------------------------------------------------------------------------


def _over(x: Any, xs: tuple[int, ...], axes: list[int], f: Any, kind: str, name: str) -> Any:
    """``kind`` (sum / max) of ``f(x[...], kept index)`` over ``axes``, which stay as size-1 dimensions."""
    rs = {a: te.reduce_axis((0, xs[a]), name=f"r{a}") for a in axes}
    out = tuple(1 if d in rs else n for d, n in enumerate(xs))

    def body(*i: Any) -> Any:
        v = f(x[tuple(rs.get(d, i[d]) for d in range(len(xs)))], i)
        return te.sum(v, axis=list(rs.values())) if kind == "sum" else te.max(v, axis=list(rs.values()))

    return te.compute(out, body, name=name)


def _kept(i: tuple[Any, ...], axes: list[int]) -> tuple[Any, ...]:
    return tuple(0 if d in axes else x for d, x in enumerate(i))


@op("MeanVarianceNormalization")
def mean_variance_norm(ctx: NodeCtx) -> list:
    """``(x - mean) / (sqrt(var) + 1e-9)``, mean and (biased) variance over ``axes`` (default 0, 2, 3)."""
    dtype = _float_input(ctx)
    xs = ctx.shape(0)
    axes = sorted({norm_axis(ctx, int(a), len(xs)) for a in ctx.attr("axes", [0, 2, 3])})
    n = math.prod(xs[a] for a in axes)
    x = ctx.tensor(0)
    total = _over(x, xs, axes, lambda v, i: v, "sum", "msum")
    mean = te.compute(total.shape, lambda *i: total[i] * (1.0 / n), name="mean")
    dev = _over(x, xs, axes, lambda v, i: (v - mean[_kept(i, axes)]) * (v - mean[_kept(i, axes)]), "sum",
                "mvar")
    std = te.compute(total.shape, lambda *i: te.sqrt(dev[i] * (1.0 / n)) + 1e-9, name="std")
    return [te.compute(xs, lambda *i: te.cast((x[i] - mean[_kept(i, axes)]) / std[_kept(i, axes)], dtype),
                       name="mvn")]


@op("LpNormalization")
def lp_norm(ctx: NodeCtx) -> list:
    """``x / ||x||_p`` along ``axis`` (default -1), p = 1 or 2 (default); 0 where the norm is 0."""
    dtype = _float_input(ctx)
    xs = ctx.shape(0)
    axis = norm_axis(ctx, int(ctx.attr("axis", -1)), len(xs))
    p = int(ctx.attr("p", 2))
    if p not in (1, 2):
        raise ctx.error(f"p {p} is not 1 or 2")
    x = ctx.tensor(0)
    s = _over(x, xs, [axis], (lambda v, i: te.abs(v)) if p == 1 else (lambda v, i: v * v), "sum", "lpsum")
    nrm = s if p == 1 else te.compute(s.shape, lambda *i: te.sqrt(s[i]), name="l2")
    zero = te.const(0, dtype)
    return [te.compute(xs, lambda *i: te.if_then_else(nrm[_kept(i, [axis])] == zero, zero,
                                                      x[i] / nrm[_kept(i, [axis])]), name="lpnorm")]


@op("Hardmax")
def hardmax(ctx: NodeCtx) -> list:
    """1 at the first largest element along ``axis`` (default -1, opset 13), 0 elsewhere."""
    dtype = _float_input(ctx)
    xs = ctx.shape(0)
    if ctx.opset < 13:
        raise ctx.unsupported("Hardmax before opset 13 (over flattened axes) is not supported")
    axis = norm_axis(ctx, int(ctx.attr("axis", -1)), len(xs))
    x = ctx.tensor(0)
    best = _over(x, xs, [axis], lambda v, i: v, "max", "best")
    r = te.reduce_axis((0, xs[axis]), name="r")
    first = te.compute(best.shape, lambda *i: te.min(
        te.if_then_else(x[i[:axis] + (r,) + i[axis + 1:]] == best[i], te.cast(r, "int64"),
                        te.const(xs[axis], "int64")), axis=r), name="first")
    return [te.compute(xs, lambda *i: te.if_then_else(first[_kept(i, [axis])] == i[axis], te.const(1, dtype),
                                                      te.const(0, dtype)), name="hardmax")]
