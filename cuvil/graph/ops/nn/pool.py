"""ONNX pooling: MaxPool (with its indices), AveragePool, GlobalAveragePool, GlobalMaxPool, and LRN.
Strided 2-D max pools run as passes over unit-stride rows of the phase-split input."""

from __future__ import annotations

import math
from typing import Any

from cuvil import te
from cuvil.graph.ops.base import NodeCtx, op
from cuvil.graph.ops.nn.window import attr_ints, auto_pad, float_input, window
from cuvil.ir.expr import min_value
from cuvil.te.tensor import Tensor


def _pool(ctx: NodeCtx, kind: str) -> list:
    xs = ctx.shape(0)
    n_sp = len(xs) - 2
    kernel = [int(k) for k in ctx.attr("kernel_shape")]
    if len(kernel) != n_sp:
        raise ctx.error(f"kernel_shape {kernel} does not fit the input {list(xs)}")
    strides, dil, begin, out = window(ctx, xs[2:], kernel, bool(int(ctx.attr("ceil_mode", 0))))
    X = ctx.tensor(0)
    rk = [te.reduce_axis((0, kernel[d]), name=f"rk{d}") for d in range(n_sp)]
    shape = xs[:2] + tuple(out)

    def pos(sp: tuple[Any, ...], d: int) -> Any:
        return sp[d] * strides[d] - begin[d] + rk[d] * dil[d]

    def inside(sp: tuple[Any, ...], lo: list[int], hi: list[int]) -> Any:
        return te.all(*[c for d in range(n_sp) for c in (pos(sp, d) >= lo[d], pos(sp, d) < hi[d])])

    def read(n: Any, c: Any, sp: tuple[Any, ...]) -> Any:
        return X[(n, c) + tuple(pos(sp, d) for d in range(n_sp))]

    zeros, sizes = [0] * n_sp, list(xs[2:])
    if kind == "max" and n_sp == 2 and strides[0] == strides[1] > 1 and (len(ctx.node.outputs) < 2
                                                                           or not ctx.node.outputs[1]):
        return [_strided_max_pool(X, xs, kernel, strides[0], dil, begin, out)]
    if kind == "max":
        low = min_value(X.dtype)
        y = te.compute(shape, lambda n, c, *sp: te.max(
            te.if_then_else(inside(sp, zeros, sizes), read(n, c, sp), low), axis=rk), name="maxpool")
        if len(ctx.node.outputs) < 2 or not ctx.node.outputs[1]:
            return [y]
        return [y, _argmax_indices(ctx, X, y, xs, kernel, strides, dil, begin, shape)]
    total = te.compute(shape, lambda n, c, *sp: te.sum(
        te.if_then_else(inside(sp, zeros, sizes), read(n, c, sp), te.const(0, X.dtype)), axis=rk), name="pool_sum")
    if int(ctx.attr("count_include_pad", 0)):
        pads = attr_ints(ctx, "pads", 2 * n_sp, 0)
        lo = [-b for b in begin]
        hi = [xs[2 + d] + (pads[d + n_sp] if auto_pad(ctx) == "NOTSET" else begin[d]) for d in range(n_sp)]
    else:
        lo, hi = zeros, sizes
    rc = [te.reduce_axis((0, kernel[d]), name=f"rc{d}") for d in range(n_sp)]

    def count_body(*sp: Any) -> Any:
        ps = [sp[d] * strides[d] - begin[d] + rc[d] * dil[d] for d in range(n_sp)]
        ok = te.all(*[c for d in range(n_sp) for c in (ps[d] >= lo[d], ps[d] < hi[d])])
        return te.sum(te.if_then_else(ok, te.const(1, X.dtype), te.const(0, X.dtype)), axis=rc)

    count = te.compute(tuple(out), count_body, name="pool_count")
    return [te.compute(shape, lambda n, c, *sp: total[(n, c) + sp] / count[sp], name="avgpool")]


def _strided_max_pool(X: Tensor, xs: tuple[int, ...], kernel: list[int], st: int, dil: list[int], begin: list[int],
                      out: list[int]) -> Tensor:
    """A strided 2-D max pool in two passes: the window's column maximum for each output row at every
    column of the padded row (unit-stride reads, masked at the image's edges; the padding is the lowest
    value), then the row maximum of every ``st``-th window, whose stride-``st`` reads of the column maxima
    are one span load and a shuffle per vector (the LLVM code generator's strided loads).  Its passes take
    ``kh + kw`` taps per output instead of ``kh * kw``, and no tap tests a bound (SqueezeNet's 3x3 / 2 pool
    over 96 x 109 x 109 at 1 thread: 405 us in one pass, 270 in three passes over unit-stride rows, 185 in
    these two; ResNet's padded 3x3 / 2 over 64 x 112 x 112: 223 -> 134 us; onnxruntime's NCHW pools 254 and
    164).  A window with no more taps than that (2 x 2: 4 against 4, 1 x k) reads the phase-split input
    instead (:func:`_phase_max_pool`; U-Net's 2x2 / 2 pool over 256 x 64 x 64: 167 us, 267 in passes)."""
    if kernel[0] * kernel[1] <= kernel[0] + kernel[1]:
        return _phase_max_pool(X, xs, kernel, st, dil, begin, out)
    (kh, kw), (dy, dx), (a0, a1), (oh, ow) = kernel, dil, begin, out
    h, w = xs[2:]
    low = min_value(X.dtype)
    rx = te.reduce_axis((0, kw), name="rk1")
    wv = (ow - 1) * st + (kw - 1) * dx + 1  # the columns the windows span, padding included

    def rows(n: Any, c: Any, i: Any, v: Any) -> Any:
        x = v - a1  # column v of the padded row
        cols = ([x >= 0] if a1 > 0 else []) + ([x < w] if wv - a1 > w else [])
        out = None
        for t in range(kh):  # (the taps written out: a stage of its own that its reader computes per channel)
            y = i * st + t * dy - a0
            cond = cols + ([y >= 0] if a0 > t * dy else []) + ([y < h] if (oh - 1) * st + t * dy - a0 >= h else [])
            v_t = te.if_then_else(te.all(*cond), X[n, c, y, x], low) if cond else X[n, c, y, x]
            out = v_t if out is None else te.max(out, v_t)
        return out

    def cols(n: Any, c: Any, i: Any, j: Any) -> Any:
        return te.max(V[n, c, i, j * st + rx * dx], axis=rx)

    V = te.compute(xs[:2] + (oh, wv), rows, name="pool_cols")
    return te.compute(xs[:2] + (oh, ow), cols, name="maxpool")


def _phase_max_pool(X: Tensor, xs: tuple[int, ...], kernel: list[int], st: int, dil: list[int], begin: list[int],
                    out: list[int]) -> Tensor:
    """A strided 2-D max pool over the input split into ``st x st`` phases (pixel ``(st * i + py, st * j + px)`` at
    ``(i, j)`` of phase ``(py, px)``, the padding as the lowest value): each tap then reads a unit-stride run of
    its phase instead of every other pixel, and tests no bounds (ResNet's 3x3 / 2 stem pool over 64 x 112 x 112:
    2.5x -> 1.9x onnxruntime's time at 1 thread; a gather through a table of source offsets ran slower)."""
    (kh, kw), (dy, dx), (a0, a1), (oh, ow) = kernel, dil, begin, out
    h, w = xs[2:]
    hq, wq = oh + (kh - 1) * dy // st, ow + (kw - 1) * dx // st
    low = min_value(X.dtype)

    def phase(n: Any, c: Any, py: Any, px: Any, i: Any, j: Any) -> Any:
        y, x = i * st + py - a0, j * st + px - a1
        inside = te.all(y >= 0, y < h, x >= 0, x < w)
        return te.if_then_else(inside, X[n, c, te.max(te.min(y, h - 1), 0), te.max(te.min(x, w - 1), 0)], low)

    P = te.compute(xs[:2] + (st, st, hq, wq), phase, name="pool_phases")
    ry, rx = te.reduce_axis((0, kh), name="rk0"), te.reduce_axis((0, kw), name="rk1")
    return te.compute(xs[:2] + (oh, ow), lambda n, c, y, x: te.max(
        P[n, c, (ry * dy) % st, (rx * dx) % st, y + ry * dy // st, x + rx * dx // st], axis=[ry, rx]), name="maxpool")


def _argmax_indices(ctx: NodeCtx, X: Tensor, y: Tensor, xs: tuple[int, ...], kernel: list[int], strides: list[int],
                    dil: list[int], begin: list[int], shape: tuple[int, ...]) -> Tensor:
    """MaxPool's Indices: the first window position (row-major) holding the maximum, as an index into the
    flattened input (row-major, or column-major over the spatial axes with storage_order=1)."""
    n_sp = len(kernel)
    rk = [te.reduce_axis((0, kernel[d]), name=f"ri{d}") for d in range(n_sp)]
    big = te.const(math.prod(kernel), "int64")

    def first(n: Any, c: Any, *sp: Any) -> Any:
        p = [sp[d] * strides[d] - begin[d] + rk[d] * dil[d] for d in range(n_sp)]
        ok = te.all(*[x for d in range(n_sp) for x in (p[d] >= 0, p[d] < xs[2 + d])])
        hit = te.if_then_else(ok, X[(n, c) + tuple(p)] == y[(n, c) + sp], te.const(False))
        k = te.const(0, "int64")
        for d in range(n_sp):
            k = k * kernel[d] + te.cast(rk[d], "int64")
        return te.min(te.if_then_else(hit, k, big), axis=rk)

    win = te.compute(shape, first, name="argwin")
    col_major = int(ctx.attr("storage_order", 0)) == 1

    def index(n: Any, c: Any, *sp: Any) -> Any:
        k = win[(n, c) + sp]
        coords = []
        for d in reversed(range(n_sp)):
            coords.append(te.cast(sp[d], "int64") * strides[d] - begin[d] + (k % kernel[d]) * dil[d])
            k = k // kernel[d]
        coords = coords[::-1]
        order = list(reversed(range(n_sp))) if col_major else list(range(n_sp))
        flat = te.cast(n, "int64") * xs[1] + te.cast(c, "int64")
        for d in order:
            flat = flat * xs[2 + d] + coords[d]
        return flat

    return te.compute(shape, index, name="maxpool_indices")


@op("MaxPool")
def max_pool(ctx: NodeCtx) -> list:
    return _pool(ctx, "max")


@op("AveragePool")
def average_pool(ctx: NodeCtx) -> list:
    float_input(ctx)
    return _pool(ctx, "avg")


@op("GlobalAveragePool", "GlobalMaxPool")
def global_pool(ctx: NodeCtx) -> list:
    """Over the image flattened (``N x C x H*W``, a view of the same buffer): one unit-stride reduction axis,
    which the scheduler reduces in vector lanes (over ``H`` and ``W`` as two axes it summed one element at a
    time: 1000 x 12 x 12, 71 -> 9 us)."""
    xs = ctx.shape(0)
    pixels = math.prod(xs[2:])
    X = ctx.tensor(0, xs[:2] + (pixels,))
    rk = te.reduce_axis((0, pixels), name="rk")
    shape = xs[:2] + (1,) * (len(xs) - 2)
    if ctx.node.op_type == "GlobalMaxPool":
        return [te.compute(shape, lambda n, c, *_: te.max(X[n, c, rk], axis=rk), name="gmaxpool")]
    float_input(ctx)
    total = te.compute(shape, lambda n, c, *_: te.sum(X[n, c, rk], axis=rk), name="gsum")
    inv = 1.0 / pixels
    return [te.compute(shape, lambda *i: total[i] * inv, name="gavgpool")]


@op("LRN")
def lrn(ctx: NodeCtx) -> list:
    float_input(ctx)
    xs = ctx.shape(0)
    size = int(ctx.attr("size"))
    alpha, beta, bias = float(ctx.attr("alpha", 1e-4)), float(ctx.attr("beta", 0.75)), float(ctx.attr("bias", 1.0))
    X = ctx.tensor(0)
    lo = (size - 1) // 2
    r = te.reduce_axis((0, size), name="r")

    def sq(n: Any, c: Any, *s: Any) -> Any:
        cc = c - lo + r
        v = X[(n, cc) + s]
        return te.sum(te.if_then_else(te.all(cc >= 0, cc < xs[1]), v * v, te.const(0, X.dtype)), axis=r)

    ss = te.compute(xs, sq, name="lrn_sq")
    return [te.compute(xs, lambda *i: X[i] / te.power(ss[i] * (alpha / size) + bias, te.const(beta, X.dtype)),
                       name="lrn")]
