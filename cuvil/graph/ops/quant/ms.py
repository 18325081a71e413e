"""com.microsoft's quantized operators, as onnxruntime's quantizer writes them (QOperator format):
QGemm, QLinearAdd, QLinearMul, QLinearGlobalAveragePool, QLinearConcat, QLinearSigmoid,
QLinearLeakyRelu.  The importer gives these nodes cuvil's default domain (:data:`MS_OPS`; ai.onnx has
no operators of these names).

Their arithmetic follows onnxruntime's kernels, so that results agree to the step:

- QLinearAdd / QLinearMul: ``round((a - za) * (sa / sc) + (b - zb) * (sb / sc)) + zc`` (the ratios in
  float32), and ``round((a - za)(b - zb) * (sa * sb / sc)) + zc``.
- QLinearGlobalAveragePool: the exact int32 sum over the image, ``- zx * size``, times
  ``sx / (sy * size)``.
- QLinearSigmoid / QLinearLeakyRelu / QLinearConcat (an input whose scale or zero point differs from
  the output's): a 256-entry table computed when compiling (dequantize, apply, quantize) and read at run
  time: an 8-bit input has only 256 values.
- QLinearSoftmax: softmax of the dequantized values along ``axis`` (before opset 13 over the flattened
  dimensions from ``axis`` on: the node's ``opset`` attribute), quantized, through a table of exponentials.
- QGemm: the integer product of :mod:`cuvil.graph.ops.quant.matmul` with an int32 bias ``C``, scaled by
  ``alpha * sa * sb[c]`` and requantized by ``y_scale`` / ``y_zero_point`` (a float32 result without them).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cuvil import te
from cuvil.errors import DTypeError
from cuvil.graph.ops.base import NodeCtx, Shaped, broadcast_shapes, elementwise, norm_axis, op
from cuvil.graph.ops.quant.linear import QRANGE
from cuvil.graph.ops.quant.matmul import (
    _I8,
    matmul_corrected,
    requant_multiplier,
    requantize,
    scale_value,
    small_multiplier,
)

MS_OPS = frozenset({"QGemm", "QLinearAdd", "QLinearMul", "QLinearGlobalAveragePool", "QLinearConcat",
                    "QLinearSigmoid", "QLinearLeakyRelu", "QLinearSoftmax",
                    # onnxruntime-genai's LLM operators (cuvil.graph.ops.quant.nbits)
                    "MatMulNBits", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
                    "RotaryEmbedding", "GroupQueryAttention"})


def _zp(ctx: NodeCtx, i: int, qtype: str) -> int:
    """A per-tensor zero point known when compiling (absent: 0)."""
    if not ctx.has(i):
        return 0
    if ctx.dtype(i) != qtype:
        raise DTypeError(f"{ctx.node}: zero point {i} is {ctx.dtype(i)}, its tensor {qtype}; they must agree")
    v = np.asarray(ctx.value(i)).reshape(-1)
    if v.size != 1:
        raise ctx.error(f"zero point {i} has {v.size} values; this operator takes one")
    return int(v[0])


def _scale(ctx: NodeCtx, i: int) -> np.float32:
    v = scale_value(ctx, i, f"scale {i}")
    if v.size != 1:
        raise ctx.error(f"scale {i} has {v.size} values; this operator takes one")
    return v[0]


def _qtype(ctx: NodeCtx, i: int) -> str:
    d = ctx.dtype(i)
    if d not in _I8:
        raise DTypeError(f"{ctx.node}: input {i} is {d}; this operator takes uint8 or int8")
    return d


def _quantize_np(v: np.ndarray, scale: np.float32, zero: int, qtype: str) -> np.ndarray:
    """QuantizeLinear at compile time (float32 division, half to even, saturation)."""
    lo, hi = QRANGE[qtype]
    q = np.rint(v.astype(np.float32) / np.float32(scale)).astype(np.float64) + zero
    return np.clip(q, lo, hi).astype(qtype)


def _table_map(ctx: NodeCtx, x_i: int, sx: np.float32, zx: int, sy: np.float32, zy: int, qy: str,
               f: Any) -> Any:
    """The element-wise map ``q -> quantize(f(dequantize(q)))`` of input ``x_i`` as a 256-entry table."""
    qx = _qtype(ctx, x_i)
    lo = QRANGE[qx][0]
    codes = np.arange(lo, lo + 256, dtype=np.int64)
    with np.errstate(all="ignore"):
        table = _quantize_np(f((codes - zx).astype(np.float32) * np.float32(sx)), sy, zy, qy)
    T = ctx.constant(table, keyed=True)
    return lambda x: T[te.cast(x, "int32") - lo]


@op("CuvilQLinearLookup")
def qlinear_lookup(ctx: NodeCtx) -> list:
    """``table[code - lowest code]``: a chain of float ops between a DQ and a Q, tabulated over the 256
    codes when compiling (:mod:`cuvil.graph.qdq_table`); inputs: the 8-bit codes and the table."""
    qx = _qtype(ctx, 0)
    table = np.asarray(ctx.value(1)) if ctx.known(1) else None
    if table is None or table.shape != (256,) or table.dtype.name not in _I8:
        raise ctx.error("the table (input 1) must be 256 uint8 or int8 values known when compiling")
    T = ctx.constant(table, keyed=True)
    lo = QRANGE[qx][0]
    return [elementwise(ctx, [0], lambda x: T[te.cast(x, "int32") - lo], name="qlookup")]


@op("QLinearSigmoid")
def qlinear_sigmoid(ctx: NodeCtx) -> list:
    qy = ctx.dtype(4) if ctx.has(4) else _qtype(ctx, 0)
    read = _table_map(ctx, 0, _scale(ctx, 1), _zp(ctx, 2, _qtype(ctx, 0)), _scale(ctx, 3), _zp(ctx, 4, qy), qy,
                      lambda v: (1.0 / (1.0 + np.exp(-v.astype(np.float64)))).astype(np.float32))
    return [elementwise(ctx, [0], read, name="qsigmoid")]


@op("QLinearLeakyRelu")
def qlinear_leaky_relu(ctx: NodeCtx) -> list:
    alpha = np.float32(ctx.attr("alpha", 0.01))
    qy = ctx.dtype(4) if ctx.has(4) else _qtype(ctx, 0)
    read = _table_map(ctx, 0, _scale(ctx, 1), _zp(ctx, 2, _qtype(ctx, 0)), _scale(ctx, 3), _zp(ctx, 4, qy), qy,
                      lambda v: np.where(v < 0, v * alpha, v).astype(np.float32))
    return [elementwise(ctx, [0], read, name="qleakyrelu")]


def _binary(ctx: NodeCtx, mul: bool) -> list:
    qa, qb = _qtype(ctx, 0), _qtype(ctx, 3)
    qc = ctx.dtype(7) if ctx.has(7) else qa
    if qc not in _I8 or qb != qa:
        raise DTypeError(f"{ctx.node}: A is {qa}, B {qb}, C {qc}; they must be one 8-bit type")
    sa, sb, sc = _scale(ctx, 1), _scale(ctx, 4), _scale(ctx, 6)
    za, zb, zc = _zp(ctx, 2, qa), _zp(ctx, 5, qb), _zp(ctx, 7, qc)
    lo, hi = QRANGE[qc]

    def f(a: Any, b: Any) -> Any:
        da = te.cast(te.cast(a, "int32") - za, "float32")
        db = te.cast(te.cast(b, "int32") - zb, "float32")
        if mul:
            v = da * db * float(np.float32(sa * sb / sc))
        else:
            v = da * float(np.float32(sa / sc)) + db * float(np.float32(sb / sc))
        v = te.round(v) + float(zc)
        return te.cast(te.min(te.max(v, te.const(float(lo), "float32")), te.const(float(hi), "float32")), qc)

    broadcast_shapes(ctx, ctx.shape(0), ctx.shape(3))
    return [elementwise(ctx, [0, 3], f, name="qmul" if mul else "qadd")]


@op("QLinearAdd")
def qlinear_add(ctx: NodeCtx) -> list:
    return _binary(ctx, mul=False)


@op("QLinearMul")
def qlinear_mul(ctx: NodeCtx) -> list:
    return _binary(ctx, mul=True)


@op("QLinearGlobalAveragePool")
def qlinear_global_average_pool(ctx: NodeCtx) -> list:
    last = bool(int(ctx.attr("channels_last", 0)))
    return _global_average_pool(ctx, last, last)


@op("CuvilQLinearGlobalAveragePoolNHWC")
def qlinear_global_average_pool_nhwc(ctx: NodeCtx) -> list:
    """QLinearGlobalAveragePool of a channels-last input (:func:`cuvil.graph.channels_last.channels_last`) whose
    readers take the NCHW ``(N, C, 1, 1)`` (the same bytes as NHWC)."""
    return _global_average_pool(ctx, True, False)


def _global_average_pool(ctx: NodeCtx, last: bool, out_last: bool) -> list:
    qx = _qtype(ctx, 0)
    qy = ctx.dtype(4) if ctx.has(4) else qx
    xs = ctx.shape(0)
    if len(xs) < 3:
        raise ctx.error(f"the input {list(xs)} must be (N, C, spatial...)")
    sx, sy = _scale(ctx, 1), _scale(ctx, 3)
    zx, zy = _zp(ctx, 2, qx), _zp(ctx, 4, qy)
    n, c = xs[0], xs[-1] if last else xs[1]
    size = math.prod(xs[1:-1] if last else xs[2:])
    mult = float(np.float32(sx / (sy * np.float32(size))))
    if last:
        X = ctx.tensor(0, (n, size, c))
        k = te.reduce_axis((0, size), name="k")
        s = te.compute((n, c), lambda i, j: te.sum(te.cast(X[i, k, j], "int32"), axis=k), name="qgap_sum")
    else:
        X = ctx.tensor(0, (n, c, size))
        k = te.reduce_axis((0, size), name="k")
        s = te.compute((n, c), lambda i, j: te.sum(te.cast(X[i, j, k], "int32"), axis=k), name="qgap_sum")
    y = te.compute((n, c), lambda i, j: requantize(s[i, j] - zx * size, te.const(mult, "float32"), zy, qy,
                                                        small_multiplier(mult)),
                   name="qgap")
    out = (n,) + (1,) * (len(xs) - 2) + (c,) if out_last else (n, c) + (1,) * (len(xs) - 2)
    return [Shaped(y, out)]


@op("QLinearConcat")
def qlinear_concat(ctx: NodeCtx) -> list:
    if ctx.n_inputs < 5 or (ctx.n_inputs - 2) % 3:
        raise ctx.error(f"QLinearConcat takes Y_scale, Y_zero_point and triples (X, X_scale, X_zero_point); got "
                        f"{ctx.n_inputs} inputs")
    qy = ctx.dtype(1)
    sy, zy = _scale(ctx, 0), _zp(ctx, 1, qy)
    firsts = list(range(2, ctx.n_inputs, 3))
    rank = len(ctx.shape(firsts[0]))
    axis = norm_axis(ctx, int(ctx.attr("axis")), rank)
    shapes = [ctx.shape(i) for i in firsts]
    for s in shapes:
        if len(s) != rank or any(a != b for d, (a, b) in enumerate(zip(s, shapes[0])) if d != axis):
            raise ctx.error(f"inputs of shapes {[list(x) for x in shapes]} do not concatenate along axis {axis}")
    pre, post = math.prod(shapes[0][:axis]), math.prod(shapes[0][axis + 1:])
    reads, offsets, total = [], [], 0
    for i, s in zip(firsts, shapes):
        if _qtype(ctx, i) != qy:
            raise DTypeError(f"{ctx.node}: input {i} is {ctx.dtype(i)}, the output {qy}; they must agree")
        X = ctx.tensor(i, (pre, s[axis], post))
        sx, zx = _scale(ctx, i + 1), _zp(ctx, i + 2, qy)
        if sx == sy and zx == zy:
            reads.append((X, None))
        else:
            reads.append((X, _table_map(ctx, i, sx, zx, sy, zy, qy, lambda v: v)))
        offsets.append(total)
        total += s[axis]

    def body(p: Any, a: Any, q: Any) -> Any:
        v = None
        for (X, f), off, s in reversed(list(zip(reads, offsets, shapes))):
            x = X[p, a - off, q]
            x = f(x) if f is not None else x
            v = x if v is None else te.if_then_else(a < off + s[axis], x, v)
        return v

    y = te.compute((pre, total, post), body, name="qconcat")
    return [Shaped(y, shapes[0][:axis] + (total,) + shapes[0][axis + 1:])]


@op("QGemm")
def qgemm(ctx: NodeCtx) -> list:
    if int(ctx.attr("transA", 0)):
        raise ctx.unsupported("transA=1 is not supported (onnxruntime's quantizer writes transA=0)")
    if len(ctx.shape(0)) != 2 or len(ctx.shape(3)) != 2:
        raise ctx.error(f"A {list(ctx.shape(0))} and B {list(ctx.shape(3))} must be matrices")
    if int(ctx.attr("transB", 0)):
        if not ctx.known(3):
            raise ctx.unsupported("transB=1 with B computed at run time is not supported")
        ctx.entries[3] = np.ascontiguousarray(np.asarray(ctx.value(3)).T)
    n = ctx.shape(3)[1]
    bias = None
    if ctx.has(6):
        if ctx.dtype(6) != "int32":
            raise DTypeError(f"{ctx.node}: C is {ctx.dtype(6)}; QGemm's bias is int32")
        bias = np.broadcast_to(np.asarray(ctx.value(6)).reshape(-1), (n,)) if math.prod(ctx.shape(6)) in (1, n) \
            else None
        if bias is None or (len(ctx.shape(6)) == 2 and ctx.shape(6)[0] != 1):
            raise ctx.unsupported(f"a bias C of shape {list(ctx.shape(6))} (only one value per column is supported)")
    acc, out, value = matmul_corrected(ctx, 0, 3, 2, 5, False, "qgemm", bias)
    shp = tuple(int(d.value) for d in acc.shape)
    alpha = np.float32(ctx.attr("alpha", 1.0))
    sa, sb = scale_value(ctx, 1, "a_scale"), scale_value(ctx, 4, "b_scale")
    if not ctx.has(7):
        mult = requant_multiplier(ctx, sa * alpha, sb, np.ones(1, np.float32), n)
        y = te.compute(shp, lambda *i: te.cast(value(i), "float32") * mult(i[-1]), name="qgemm_float")
        return [Shaped(y, out)]
    qy = ctx.dtype(8) if ctx.has(8) else "uint8"
    if qy not in _I8:
        raise DTypeError(f"{ctx.node}: y_zero_point is {qy}; QGemm writes uint8, int8 or float32")
    mult = requant_multiplier(ctx, sa * alpha, sb, scale_value(ctx, 7, "y_scale"), n)
    zy = _zp(ctx, 8, qy)
    y = te.compute(shp, lambda *i: requantize(value(i), mult(i[-1]), zy, qy, mult.small), name="qgemm_out")
    return [Shaped(y, out)]


@op("QLinearSoftmax")
def qlinear_softmax(ctx: NodeCtx) -> list:
    """Softmax of 8-bit codes: ``exp(sx (x - max))`` depends only on ``max - x`` in 0..255, so it is a
    256-entry table computed when compiling (onnxruntime does the same); each row sums its table
    values once and scales them by ``1 / (sum * y_scale)``."""
    qx = _qtype(ctx, 0)
    qy = ctx.dtype(4) if ctx.has(4) else qx
    if qy not in _I8:
        raise DTypeError(f"{ctx.node}: y_zero_point is {qy}; the output is uint8 or int8")
    xs = ctx.shape(0)
    axis = norm_axis(ctx, int(ctx.attr("axis", -1)), len(xs))
    sx, sy, zy = _scale(ctx, 1), _scale(ctx, 3), _zp(ctx, 4, qy)
    _zp(ctx, 2, qx)  # checked; it cancels: softmax(s (x - z)) = softmax(s x)
    if int(ctx.attr("opset", 13)) >= 13:
        pre, n, post = math.prod(xs[:axis]), xs[axis], math.prod(xs[axis + 1:])
    else:
        pre, n, post = math.prod(xs[:axis]), math.prod(xs[axis:]), 1
    X = ctx.tensor(0, (pre, n, post))
    table = np.exp(-np.arange(256, dtype=np.float64) * float(sx)).astype(np.float32)
    T = ctx.constant(table, keyed=True)
    k = te.reduce_axis((0, n), name="k")
    mx = te.compute((pre, post), lambda p, q: te.max(te.cast(X[p, k, q], "int32"), axis=k), name="qsm_max")

    # the row's table values, looked up once into a buffer: the sum and the output both read them (a gather
    # in each of the two passes took 0.33 ms per 1536 x 128 call, one gather and two plain reads 0.19 ms)
    E = te.compute((pre, n, post), lambda p, c, q: T[mx[p, q] - te.cast(X[p, c, q], "int32")], name="qsm_exp")

    def e(p: Any, c: Any, q: Any) -> Any:
        return E[p, c, q]

    k2 = te.reduce_axis((0, n), name="k2")
    total = te.compute((pre, post), lambda p, q: te.sum(e(p, k2, q), axis=k2), name="qsm_sum")
    inv = te.compute((pre, post), lambda p, q: 1.0 / (total[p, q] * float(sy)), name="qsm_scale")
    lo, hi = QRANGE[qy]

    def body(p: Any, c: Any, q: Any) -> Any:
        v = te.round(e(p, c, q) * inv[p, q]) + float(zy)
        return te.cast(te.min(te.max(v, te.const(float(lo), "float32")), te.const(float(hi), "float32")), qy)

    return [Shaped(te.compute((pre, n, post), body, name="qsoftmax"), xs)]
