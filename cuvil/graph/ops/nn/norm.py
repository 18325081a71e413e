"""ONNX normalisations: BatchNormalization, LayerNormalization, RMSNormalization, GroupNormalization,
InstanceNormalization, MeanVarianceNormalization, LpNormalization; and Softmax, LogSoftmax, Hardmax.

RMS, group and instance normalisation compute their statistics in float32 when the input is float16
(ONNX's ``stash_type=1``, the default), over a 2-D view of the input: (rows, normalised elements).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cuvil import dtype as dt
from cuvil import te
from cuvil.errors import DTypeError
from cuvil.graph.ops.base import NodeCtx, Shaped, bcast_read, broadcast_shapes, norm_axis, op
from cuvil.graph.ops.nn.window import float_input
from cuvil.te.tensor import Tensor


def _float_dtype(ctx: NodeCtx) -> str:
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
    dtype = _float_dtype(ctx)
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
    dtype = _float_dtype(ctx)
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
    dtype = _float_dtype(ctx)
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
    dtype = _float_dtype(ctx)
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
    dtype = _float_dtype(ctx)
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


@op("BatchNormalization")
def batch_norm(ctx: NodeCtx) -> list:
    float_input(ctx)
    training = int(ctx.attr("training_mode", 0))
    if not training and ctx.opset < 14 and len(ctx.node.outputs) > 1 and any(ctx.node.outputs[1:]):
        raise ctx.unsupported("the training outputs of opsets before 14 are not supported")
    eps = float(ctx.attr("epsilon", 1e-5))
    xs = ctx.shape(0)
    shp = xs[:2] + (math.prod(xs[2:]),) if len(xs) > 2 else xs
    X = ctx.tensor(0, shp)
    s, b, mean, var = (ctx.tensor(i) for i in range(1, 5))
    if training:
        return _batch_norm_training(ctx, X, shp, xs, s, b, mean, var, eps)

    def body(*i: Any) -> Any:
        c = i[1] if len(shp) > 1 else 0
        return (X[i] - mean[c]) / te.sqrt(var[c] + eps) * s[c] + b[c]

    return [Shaped(te.compute(shp, body, name="batchnorm"), xs)]


def _batch_norm_training(ctx: NodeCtx, X: Tensor, shp: tuple[int, ...], xs: tuple[int, ...], s: Tensor, b: Tensor,
                         run_mean: Tensor, run_var: Tensor, eps: float) -> list:
    """Batch statistics (population variance) normalise; the running statistics move by ``momentum``."""
    momentum = float(ctx.attr("momentum", 0.9))
    count = math.prod(shp) // shp[1]
    red = [0] + ([2] if len(shp) > 2 else [])
    total = _reduce_keep(X, shp, red, "sum", name="bsum")
    mean = te.compute((shp[1],), lambda c: total[(0, c) + (0,) * (len(shp) - 2)] * (1.0 / count), name="bmean")

    def dev(*i: Any) -> Any:
        d = X[i] - mean[i[1]]
        return d * d

    d2 = te.compute(shp, dev, name="bdev2")
    sq = _reduce_keep(d2, shp, red, "sum", name="bvar")
    var = te.compute((shp[1],), lambda c: sq[(0, c) + (0,) * (len(shp) - 2)] * (1.0 / count), name="bvar_c")
    y = te.compute(shp, lambda *i: (X[i] - mean[i[1]]) / te.sqrt(var[i[1]] + eps) * s[i[1]] + b[i[1]],
                   name="batchnorm")
    outs: list = [Shaped(y, xs)]
    if len(ctx.node.outputs) > 1:
        outs.append(te.compute((shp[1],), lambda c: run_mean[c] * momentum + mean[c] * (1 - momentum),
                               name="running_mean"))
    if len(ctx.node.outputs) > 2:
        outs.append(te.compute((shp[1],), lambda c: run_var[c] * momentum + var[c] * (1 - momentum),
                               name="running_var"))
    return outs


# -- normalisations over a set of axes ---------------------------------------------------


def _reduce_keep(X: Any, shape: tuple[int, ...], axes: list[int], kind: str, f: Any = None, name: str = "r") -> Tensor:
    """``kind`` ("sum" | "max") of ``f(X)[i]`` over ``axes``, keeping them as size-1 dimensions."""
    rs = {a: te.reduce_axis((0, shape[a]), name=f"r{a}") for a in axes}
    out = tuple(1 if d in rs else s for d, s in enumerate(shape))
    f = f or (lambda v: v)

    def body(*i: Any) -> Any:
        src = tuple(rs[d] if d in rs else i[d] for d in range(len(shape)))
        v = f(X[src])
        return te.sum(v, axis=list(rs.values())) if kind == "sum" else te.max(v, axis=list(rs.values()))

    return te.compute(out, body, name=name)


def _kept(i: tuple[Any, ...], axes: list[int]) -> tuple[Any, ...]:
    return tuple(0 if d in axes else x for d, x in enumerate(i))


@op("Softmax", "LogSoftmax")
def softmax(ctx: NodeCtx) -> list:
    float_input(ctx)
    xs = ctx.shape(0)
    if math.prod(xs) == 0:
        return [np.zeros(xs, ctx.dtype(0))]
    if ctx.opset >= 13:
        a = norm_axis(ctx, int(ctx.attr("axis", -1)), len(xs))
        outer, n, inner = math.prod(xs[:a]), xs[a], math.prod(xs[a + 1:])
    else:  # opsets 1-12: the input is coerced to 2-D at the axis
        a = norm_axis(ctx, int(ctx.attr("axis", 1)), len(xs))
        outer, n, inner = math.prod(xs[:a]), math.prod(xs[a:]), 1
    shp = (outer, n, inner) if inner > 1 else (outer, n)
    axes = [1]
    X = ctx.tensor(0, shp)
    m = _reduce_keep(X, shp, axes, "max", name="smax")
    e = te.compute(shp, lambda *i: te.exp(X[i] - m[_kept(i, axes)]), name="sexp")
    s = _reduce_keep(e, shp, axes, "sum", name="ssum")
    if ctx.node.op_type == "LogSoftmax":
        y = te.compute(shp, lambda *i: X[i] - m[_kept(i, axes)] - te.log(s[_kept(i, axes)]), name="logsoftmax")
    else:
        y = te.compute(shp, lambda *i: e[i] / s[_kept(i, axes)], name="softmax")
    return [Shaped(y, xs)]


@op("LayerNormalization")
def layer_norm(ctx: NodeCtx) -> list:
    float_input(ctx)
    xs = ctx.shape(0)
    axis = norm_axis(ctx, int(ctx.attr("axis", -1)), len(xs))
    eps = float(ctx.attr("epsilon", 1e-5))
    dtype = ctx.dtype(0)
    work = "float32" if dtype == "float16" else dtype
    outer, n = math.prod(xs[:axis]), math.prod(xs[axis:])
    shp = (outer, n)
    kept = xs[:axis] + (1,) * (len(xs) - axis)
    X0 = ctx.tensor(0, shp)
    X = X0 if work == dtype else te.compute(shp, lambda *i: te.cast(X0[i], work), name="x32")
    total = _reduce_keep(X, shp, [1], "sum", name="lsum")
    mean = te.compute(total.shape, lambda *i: total[i] * (1.0 / n), name="mean")
    d2 = te.compute(shp, lambda i, j: (X[i, j] - mean[i, 0]) * (X[i, j] - mean[i, 0]), name="dev2")
    var = _reduce_keep(d2, shp, [1], "sum", name="lvar")
    inv = te.compute(total.shape, lambda *i: 1.0 / te.sqrt(var[i] * (1.0 / n) + eps), name="invstd")

    def param(i: int) -> Any:
        """Scale or bias over the normalised dimensions, read at (row, column) of the 2-D view."""
        ps = ctx.shape(i)
        full = broadcast_shapes(ctx, ps, xs)
        if full != xs:
            raise ctx.error(f"input {i} of shape {list(ps)} does not broadcast to {list(xs)}")
        if math.prod(ps) == n and len(ps) <= len(xs) - axis:
            t = ctx.tensor(i, (n,))
            return lambda r, c: t[c]
        t = ctx.tensor(i)
        tail = xs[axis:]

        def read(r: Any, c: Any) -> Any:
            idx, rest = [], c
            for d in reversed(range(len(xs))):  # unflatten (r, c) into the N-D index
                if d >= axis:
                    idx.append(rest % tail[d - axis])
                    rest = rest // tail[d - axis]
                else:
                    idx.append(r % xs[d])
                    r = r // xs[d]
            return bcast_read(t, xs, idx[::-1])

        return read

    scale = param(1)
    bias = param(2) if ctx.has(2) else None

    def body(i: Any, j: Any) -> Any:
        y = (X[i, j] - mean[i, 0]) * inv[i, 0] * te.cast(scale(i, j), work)
        if bias is not None:
            y = y + te.cast(bias(i, j), work)
        return te.cast(y, dtype) if work != dtype else y

    outs: list = [Shaped(te.compute(shp, body, name="layernorm"), xs)]
    if len(ctx.node.outputs) > 1:
        outs.append(Shaped(mean, kept))
    if len(ctx.node.outputs) > 2:
        outs.append(Shaped(inv, kept))
    return outs
