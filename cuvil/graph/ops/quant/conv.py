"""Quantized convolutions: ConvInteger and QLinearConv, as exact int32 convolutions (``int_conv`` of
:mod:`cuvil.graph.ops.quant.kernels`) with the zero points applied afterwards (see
:mod:`cuvil.graph.ops.quant.matmul`)::

    sum (x - zx)(w - zw) = conv(x_padded_with_zx, w)  -  zx colsum(w)[m]  -  zw[m] windowsum(x)  +  K zx zw[m]

The padding reads ``zx`` (a padded tap contributes 0 once the zero point is subtracted).  The window
sums exist only when ``zw`` is not 0: a convolution of ``x`` with a filter of ones per group, itself an
integer convolution.  Weights must be known when compiling (a session specialises on fed weights).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cuvil import te
from cuvil.errors import DTypeError
from cuvil.graph.ops.base import NodeCtx, op
from cuvil.graph.ops.nn.window import window
from cuvil.graph.ops.quant.conv_nhwc import int_conv_nhwc
from cuvil.graph.ops.quant.kernels import int_conv
from cuvil.graph.ops.quant.matmul import (
    _I8,
    check_int8,
    const_vector,
    fold_bias,
    requant_multiplier,
    requantize,
    scale_value,
    zero_point,
)
from cuvil.ir.expr import min_value
from cuvil.te.tensor import Tensor


def conv_corrected(ctx: NodeCtx, x_i: int, w_i: int, zx_i: int | None, zw_i: int | None, runtime_zero: bool,
                   name: str, bias: np.ndarray | None = None, layout: tuple[str, str] = ("NCHW", "NCHW")
                   ) -> tuple[tuple[int, ...], Any]:
    """``conv((x - zx), (w - zw)) + bias`` as int32: the output shape (N, M, spatial...) and a function
    ``idx -> int32 expression``.  ``layout`` (the input's, the output's): ``"NHWC"`` puts the channels
    last (2-D convolutions with a zero point known when compiling; :mod:`cuvil.graph.ops.quant.conv_nhwc`)."""
    tx, tw = check_int8(ctx, x_i, "x"), check_int8(ctx, w_i, "w")
    xs, ws = ctx.shape(x_i), ctx.shape(w_i)
    in_nhwc, out_nhwc = layout[0] == "NHWC", layout[1] == "NHWC"
    if in_nhwc:
        xs = (xs[0], xs[-1]) + tuple(xs[1:-1])  # the NCHW shape, for the checks and the window
    if len(xs) < 3 or len(ws) != len(xs):
        raise ctx.error(f"input {list(xs)} and weights {list(ws)} must be (N, C, ...) and (M, C/group, ...)")
    g = int(ctx.attr("group", 1))
    if g < 1 or xs[1] != ws[1] * g or ws[0] % g:
        raise ctx.error(f"{xs[1]} input channels do not fit weights {list(ws)} with group={g}")
    n_sp = len(xs) - 2
    kernel = list(ws[2:])
    ks = ctx.attr("kernel_shape")
    if ks is not None and [int(k) for k in ks] != kernel:
        raise ctx.error(f"kernel_shape {list(ks)} differs from the weights' {kernel}")
    strides, dil, begin, out = window(ctx, xs[2:], kernel)
    end = [max(0, (out[d] - 1) * strides[d] + dil[d] * (kernel[d] - 1) + 1 - begin[d] - xs[2 + d])
           for d in range(n_sp)]
    m = ws[0]
    w = np.asarray(ctx.value(w_i))
    zx = zero_point(ctx, zx_i, 1, "x's zero point", runtime_zero, tx) if zx_i is not None else None
    zw = zero_point(ctx, zw_i, m, "w's zero point", runtime_zero, tw) if zw_i is not None else None
    from cuvil.graph.ops.quant.matmul import Zero

    zx = zx or Zero(np.zeros(1, np.int64))
    zw = zw or Zero(np.zeros(1, np.int64))
    if zx.tensor is not None and math.prod(ctx.shape(zx_i)) != 1:
        raise ctx.error("x's zero point must be one value")
    X = ctx.tensor(x_i)
    if out_nhwc:
        if zx.known is None or n_sp != 2:
            raise ctx.error("internal error: a channels-last quantized convolution is 2-D with a known zero point")
        acc = int_conv_nhwc(ctx, X, w, strides, dil, begin, end, g, name, int(zx.known[0]), in_nhwc)
    elif zx.known is not None:
        acc = int_conv(ctx, X, w, strides, dil, begin, end, g, name, pad_value=int(zx.known[0]))
    else:
        acc = int_conv(ctx, _pad(X, begin, end, lambda: zx.read(0), name), w, strides, dil, [0] * n_sp,
                       [0] * n_sp, g, name)
    k = ws[1] * math.prod(kernel)
    colsum = w.astype(np.int64).reshape(m, -1).sum(axis=1)
    const, terms = fold_bias(ctx, m, k, zx, zw, colsum, bias)
    cvec = const_vector(ctx, const) if const.any() else None
    wsum = None
    if not zw.is_zero:  # window sums of x (padded with zx) per group: a convolution with ones
        ones = np.ones((g, ws[1]) + tuple(kernel), np.uint8 if tx == "uint8" else np.int8)
        if out_nhwc:
            wsum = int_conv_nhwc(ctx, X, ones, strides, dil, begin, end, g, f"{name}_wsum", int(zx.known[0]),
                                 in_nhwc)
        elif zx.known is not None:
            wsum = int_conv(ctx, X, ones, strides, dil, begin, end, g, f"{name}_wsum", pad_value=int(zx.known[0]))
        else:
            wsum = int_conv(ctx, _pad(X, begin, end, lambda: zx.read(0), f"{name}_ws"), ones, strides, dil,
                            [0] * n_sp, [0] * n_sp, g, f"{name}_wsum")
        zwv = const_vector(ctx, zw.known * np.ones(m, np.int64)) if zw.known is not None else zw.read
    per_group = m // g

    def value(idx: tuple) -> Any:
        c = idx[-1] if out_nhwc else idx[1]
        v = acc[idx]
        if cvec is not None:
            v = v + cvec(c)
        for t in terms:
            v = v + t(c)
        if wsum is not None:
            gi = c // per_group if g > 1 else 0
            v = v - zwv(c) * wsum[(idx[0],) + tuple(idx[1:-1]) + (gi,) if out_nhwc else (idx[0], gi) + tuple(idx[2:])]
        return v

    return ((xs[0],) + tuple(out) + (m,) if out_nhwc else (xs[0], m) + tuple(out)), value


def _pad(X: Tensor, begin: list[int], end: list[int], fill: Any, name: str) -> Tensor:
    """``X`` padded in its spatial dimensions with the run-time value ``fill()``."""
    xs = tuple(int(d.value) for d in X.shape)
    if not any(begin) and not any(end):
        return X
    n_sp = len(xs) - 2
    shape = xs[:2] + tuple(xs[2 + d] + begin[d] + end[d] for d in range(n_sp))

    def body(*i: Any) -> Any:
        inside = [c for d in range(n_sp) for c in (i[2 + d] >= begin[d], i[2 + d] < xs[2 + d] + begin[d])]
        src = tuple(i[:2]) + tuple(i[2 + d] - begin[d] for d in range(n_sp))
        return te.if_then_else(te.all(*inside), X[src], te.cast(fill(), X.dtype))

    return te.compute(shape, body, name=f"{name}_pad")


@op("ConvInteger")
def conv_integer(ctx: NodeCtx) -> list:
    shape, value = conv_corrected(ctx, 0, 1, 2, 3, True, "convinteger")
    return [te.compute(shape, lambda *i: value(i), name="convinteger_out")]


def qlinear_conv_build(ctx: NodeCtx, y_scale: int | None, y_zero: int | None, bias_i: int | None,
                       layout: tuple[str, str] = ("NCHW", "NCHW")) -> Tensor:
    """QLinearConv's computation (inputs x, x_scale, x_zero_point, w, w_scale, w_zero_point, then the
    output's scale and zero point at ``y_scale`` / ``y_zero`` and the int32 bias at ``bias_i``); with
    ``y_scale`` None the result is the float32 ``acc * sx * sw[m]`` (a convolution whose output the model
    does not quantize).  ``layout``: as :func:`conv_corrected`'s."""
    bias = None
    if bias_i is not None and ctx.has(bias_i):
        if ctx.dtype(bias_i) != "int32":
            raise DTypeError(f"{ctx.node}: the bias is {ctx.dtype(bias_i)}; it must be int32")
        bias = np.asarray(ctx.value(bias_i)).reshape(-1)
        if bias.size != ctx.shape(3)[0]:
            raise ctx.error(f"the bias has {bias.size} values, the weights {ctx.shape(3)[0]} output channels")
    shape, value = conv_corrected(ctx, 0, 3, 2, 5, False, "qlinearconv", bias, layout)
    sx, sw = scale_value(ctx, 1, "x_scale"), scale_value(ctx, 4, "w_scale")
    ci = len(shape) - 1 if layout[1] == "NHWC" else 1
    m = shape[ci]
    if y_scale is None:
        mult = requant_multiplier(ctx, sx, sw, np.ones(1, np.float32), m)
        return te.compute(shape, lambda *i: te.cast(value(i), "float32") * mult(i[ci]), name="qconv_float")
    qy = ctx.dtype(y_zero) if y_zero is not None and ctx.has(y_zero) else "uint8"
    if qy not in _I8:
        raise DTypeError(f"{ctx.node}: y_zero_point is {qy}; the output is uint8 or int8")
    mult = requant_multiplier(ctx, sx, sw, scale_value(ctx, y_scale, "y_scale"), m)
    zy = int(np.asarray(ctx.value(y_zero)).reshape(-1)[0]) if y_zero is not None and ctx.has(y_zero) else 0
    return te.compute(shape, lambda *i: requantize(value(i), mult(i[ci]), zy, qy, mult.small), name="qlinearconv_out")


@op("QLinearConv")
def qlinear_conv(ctx: NodeCtx) -> list:
    return [qlinear_conv_build(ctx, 6, 7, 8)]


@op("CuvilQLinearConv")
def cuvil_qlinear_conv(ctx: NodeCtx) -> list:
    """QLinearConv as :func:`cuvil.graph.qdq.match_qdq` writes it: inputs x, x_scale, x_zero_point, w,
    w_scale, w_zero_point, y_scale, y_zero_point, B; without y_scale the result is float32."""
    return [qlinear_conv_build(ctx, 6 if ctx.has(6) else None, 7, 8)]


@op("CuvilQLinearConvNHWC")
def cuvil_qlinear_conv_nhwc(ctx: NodeCtx) -> list:
    """``CuvilQLinearConv`` (and QLinearConv: the same inputs) computed channels-last, as
    :func:`cuvil.graph.channels_last.channels_last` writes it: the output NHWC ``(N, H', W', M)``, the input NHWC
    or, with ``in_layout="NCHW"``, the model's NCHW (a network's first convolution)."""
    return [qlinear_conv_build(ctx, 6 if ctx.has(6) else None, 7, 8, (ctx.attr("in_layout", "NHWC"), "NHWC"))]


@op("CuvilConvIntegerToFloat")
def conv_integer_to_float(ctx: NodeCtx) -> list:
    """``float32(ConvInteger(x, w, x_zero_point, w_zero_point)) * scale`` in one kernel (ConvInteger ->
    Cast -> Mul, as ``quantize_dynamic`` writes it; the scale one float32 value, computed at run time)."""
    from cuvil.graph.ops.quant.matmul import scale_reader

    shape, value = conv_corrected(ctx, 0, 1, 2, 3, True, "convinteger")
    s = scale_reader(ctx, 4, 1)
    return [te.compute(shape, lambda *i: te.cast(value(i), "float32") * s(0), name="convinteger_float")]


@op("CuvilMaxPool8")
def max_pool_8bit(ctx: NodeCtx) -> list:
    """MaxPool of 8-bit values (a QDQ model's ``DQ -> MaxPool -> Q`` of one scale, as
    :func:`cuvil.graph.qdq.match_qdq` writes it): the input padded once with the type's least value, then
    every window's maximum as one element-wise expression of its taps.  Without the per-tap bounds tests
    and the reduction loop the rows vectorise (ResNet's 3x3 / 2 pool of 1x64x112x112 uint8, 1 thread:
    2.0 ms as MaxPool's generic reduction, 0.08 ms this way).  With ``layout="NHWC"`` (set by
    :func:`cuvil.graph.channels_last.channels_last`) the input and output are channels-last."""
    X = ctx.tensor(0)
    last = ctx.attr("layout", "NCHW") == "NHWC"
    xs = ctx.shape(0)
    if X.dtype not in _I8 or len(xs) < 3:
        raise DTypeError(f"{ctx.node}: CuvilMaxPool8 takes an 8-bit (N, C, ...) input; got {X.dtype} {list(xs)}")
    n_sp = len(xs) - 2
    sizes = xs[1:-1] if last else xs[2:]

    def at(n: Any, c: Any, sp: tuple) -> tuple:  # an index of the layout
        return (n,) + sp + (c,) if last else (n, c) + sp

    kernel = [int(k) for k in ctx.attr("kernel_shape")]
    if len(kernel) != n_sp:
        raise ctx.error(f"kernel_shape {kernel} does not fit the input {list(xs)}")
    strides, dil, begin, out = window(ctx, sizes, kernel, bool(int(ctx.attr("ceil_mode", 0))))
    span = [(out[d] - 1) * strides[d] + dil[d] * (kernel[d] - 1) + 1 for d in range(n_sp)]
    low = min_value(X.dtype)
    P = X
    channels = xs[-1] if last else xs[1]
    if any(begin) or any(span[d] > sizes[d] + begin[d] for d in range(n_sp)):
        def pad(*i: Any) -> Any:
            n, c, sp = (i[0], i[-1], i[1:-1]) if last else (i[0], i[1], i[2:])
            inside = [cond for d in range(n_sp) for cond in (sp[d] >= begin[d], sp[d] < sizes[d] + begin[d])]
            return te.if_then_else(te.all(*inside), X[at(n, c, tuple(sp[d] - begin[d] for d in range(n_sp)))], low)

        P = te.compute(at(xs[0], channels, tuple(span)), pad, name="maxpool8_pad")

    def body(*i: Any) -> Any:
        n, c, sp = (i[0], i[-1], i[1:-1]) if last else (i[0], i[1], i[2:])
        best = None
        for tap in np.ndindex(*kernel):
            v = P[at(n, c, tuple(sp[d] * strides[d] + tap[d] * dil[d] for d in range(n_sp)))]
            best = v if best is None else te.max(best, v)
        return best

    return [te.compute(at(xs[0], channels, tuple(out)), body, name="maxpool8")]
