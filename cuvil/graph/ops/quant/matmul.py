"""Quantized contractions: MatMulInteger, ConvInteger, QLinearMatMul, QLinearConv (and the shared parts
of com.microsoft's QGemm, :mod:`cuvil.graph.ops.quant.ms`).

Every product runs as an exact int32 contraction of the 8-bit values (``int_matmul`` / ``int_conv`` of
:mod:`cuvil.graph.ops.quant.kernels`); zero points apply afterwards, by expanding the product::

    sum (x - zx)(w - zw) = sum x w  -  zx colsum(w)  -  zw rowsum(x)  +  K zx zw

Terms whose factors are compile-time constants fold into one int32 bias per output column (with the
operator's own int32 bias); ``rowsum(x)`` is a separate small reduction, built only when ``zw`` is not
known to be 0 (symmetric weights: the usual case).  The QLinear operators then requantize in float32::

    y = saturate(round_half_even(acc * (sx * sw[c] / sy)) + zy)

with the multiplier computed in float32 as onnxruntime does.  Scales (and the zero points of the
QLinear operators) must be known when compiling: constants in real models; a session specialises on
them when a model feeds them.  The zero points of MatMulInteger / ConvInteger may be computed at run
time (DynamicQuantizeLinear's).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cuvil import te
from cuvil.errors import DTypeError
from cuvil.graph.ops.base import NodeCtx, Shaped, broadcast_shapes, op
from cuvil.graph.ops.quant.kernels import int_matmul
from cuvil.graph.ops.quant.linear import QRANGE
from cuvil.te.tensor import Tensor

_I8 = ("uint8", "int8")


def _i32(x: Any) -> Any:
    return x if x.dtype == "int32" else te.cast(x, "int32")


@dataclass(frozen=True)
class Zero:
    """A zero point: ``known`` (int64 values, one or one per column) or a te tensor read at run time."""

    known: np.ndarray | None
    tensor: Tensor | None = None

    @property
    def is_zero(self) -> bool:
        return self.known is not None and not self.known.any()

    def read(self, c: Any) -> Any:
        """The zero point of column ``c`` as an int32 expression (run-time zero points only)."""
        t = self.tensor
        n = int(math.prod(int(d.value) for d in t.shape))
        return _i32(t[(0,) * t.ndim] if n == 1 else t[c])


def zero_point(ctx: NodeCtx, i: int, n: int, what: str, runtime_ok: bool, qtype: str) -> Zero:
    """Input ``i`` (absent: 0) as the zero point of a ``qtype`` tensor: one value or ``n`` (per column)."""
    if not ctx.has(i):
        return Zero(np.zeros(1, np.int64))
    if ctx.dtype(i) != qtype:
        raise DTypeError(f"{ctx.node}: {what} is {ctx.dtype(i)}, its tensor is {qtype}; they must agree")
    size = math.prod(ctx.shape(i))
    if size not in (1, n):
        raise ctx.error(f"{what} has {size} values; it must have 1 or {n} (one per output column)")
    if ctx.known(i) or not runtime_ok:
        return Zero(np.asarray(ctx.value(i)).astype(np.int64).reshape(-1))
    return Zero(None, ctx.tensor(i, (size,)))


def scale_value(ctx: NodeCtx, i: int, what: str) -> np.ndarray:
    """A scale (known when compiling) as float32 values."""
    from cuvil import dtype as dt

    if not dt.is_float(ctx.dtype(i)):
        raise DTypeError(f"{ctx.node}: {what} is {ctx.dtype(i)}; it must be a float tensor")
    return np.asarray(ctx.value(i)).astype(np.float32).reshape(-1)


def check_int8(ctx: NodeCtx, i: int, what: str) -> str:
    d = ctx.dtype(i)
    if d not in _I8:
        raise DTypeError(f"{ctx.node}: {what} is {d}; a quantized contraction takes uint8 or int8")
    return d


def fold_bias(ctx: NodeCtx, n: int, k: int, zx: Zero, zw: Zero, colsum: np.ndarray | None,
              bias: np.ndarray | None) -> tuple[np.ndarray, list[Callable[[Any], Any]]]:
    """The compile-time part of ``- zx colsum(w) + K zx zw + bias`` as int64 per column, and the run-time
    parts as functions of the column (their values added to it).  ``colsum`` None: weights at run time
    (the caller adds ``-zx colsum`` itself)."""
    const = np.zeros(n, np.int64) if bias is None else bias.astype(np.int64).reshape(-1) * np.ones(n, np.int64)
    terms: list[Callable[[Any], Any]] = []
    zw_known = zw.known * np.ones(n, np.int64) if zw.known is not None else None
    if zx.known is not None:
        zxv = int(zx.known[0])
        if colsum is not None:
            const -= zxv * colsum
        if zw_known is not None:
            const += k * zxv * zw_known
        elif zxv:
            terms.append(lambda c: zw.read(c) * (k * zxv))
    else:
        if colsum is not None:
            cs = const_vector(ctx, colsum)
            terms.append(lambda c: -(zx.read(0) * cs(c)))
        if zw_known is not None and zw_known.any():
            zk = const_vector(ctx, zw_known * k)
            terms.append(lambda c: zx.read(0) * zk(c))
        elif zw_known is None:
            terms.append(lambda c: zx.read(0) * zw.read(c) * k)
    if np.abs(const).max(initial=0) >= 2**31:
        raise ctx.error("the folded int32 bias overflows int32 (zero points, weights or bias out of range)")
    return const, terms


def const_vector(ctx: NodeCtx, v: np.ndarray, dtype: str = "int32") -> Callable[[Any], Any]:
    """A per-column constant as a read function: a te constant when all values agree."""
    v = np.asarray(v).reshape(-1)
    if v.size and (v == v[0]).all():
        c = te.const(v[0].item(), dtype)
        return lambda _c: c
    t = ctx.constant(v.astype(dtype), keyed=False)
    return lambda c: t[c]


def requantize(acc: Any, mult: Any, zy: int, qtype: str, small: bool = False) -> Any:
    """``saturate(round_half_even(float(acc) * mult) + zy)`` as a ``qtype`` expression.

    ``small``: ``|mult| < 0.5`` (:attr:`Multiplier.small`), so ``float(acc) * mult`` of an int32 ``acc``
    lies inside int32: it is rounded straight to int32 (one ``vcvtps2dq``: the code generator emits
    ``int32(round(x))`` as ``llvm.lrint``) and saturated in integers (a saturating narrowing store), the
    same values as rounding and clamping in float32 (four instructions fewer per vector)."""
    lo, hi = QRANGE[qtype]
    if small:
        v = te.cast(te.round(te.cast(acc, "float32") * mult), "int32")
        if zy:
            v = v + te.const(int(zy), "int32")
        return te.cast(te.min(te.max(v, te.const(lo, "int32")), te.const(hi, "int32")), qtype)
    v = te.round(te.cast(acc, "float32") * mult) + float(zy)
    return te.cast(te.min(te.max(v, te.const(float(lo), "float32")), te.const(float(hi), "float32")), qtype)


# -- matrix products ------------------------------------------------------------------------


def _batched_products(ctx: NodeCtx, a_i: int, b_i: int, name: str) -> tuple[Tensor, tuple[int, ...], Any]:
    """The int32 products of inputs ``a_i`` and ``b_i`` (numpy matmul shapes), as a tensor of
    ``(rows, N)`` (2-D weights) or ``(batch, M, N)``, the ONNX output shape, and the weights (a numpy
    array when known, else None)."""
    a_s, b_s = ctx.shape(a_i), ctx.shape(b_i)
    if len(a_s) < 1 or len(b_s) < 1:
        raise ctx.error(f"inputs of shapes {list(a_s)} and {list(b_s)} do not multiply")
    a2 = a_s if len(a_s) > 1 else (1,) + a_s
    b2 = b_s if len(b_s) > 1 else b_s + (1,)
    if a2[-1] != b2[-2]:
        raise ctx.error(f"shapes {list(a_s)} and {list(b_s)} do not multiply")
    batch = broadcast_shapes(ctx, a2[:-2], b2[:-2])
    out = batch + ((a2[-2],) if len(a_s) > 1 else ()) + ((b2[-1],) if len(b_s) > 1 else ())
    kk, n = b2[-2], b2[-1]
    for what, s in (("A", a2), ("B", b2)):
        lead = (1,) * (len(batch) - len(s) + 2) + s[:-2]
        if lead != batch and any(d != 1 for d in lead):
            raise ctx.unsupported(f"{what}'s batch dimensions {list(s[:-2])} broadcast partly against "
                                  f"{list(batch)}; a quantized product takes full or single batches")
    w_known = np.asarray(ctx.value(b_i)).reshape(b2) if ctx.known(b_i) else None
    if all(d == 1 for d in b2[:-2]):  # one weight matrix for every row of every batch
        rows = math.prod(batch) * a2[-2]
        A = ctx.tensor(a_i, (rows, kk))
        w = w_known.reshape(kk, n) if w_known is not None else ctx.tensor(b_i, (kk, n))
        return int_matmul(ctx, A, w, name), out, w_known
    # batched weights: one integer contraction over every batch (an operand with one batch is broadcast)
    nb, m = math.prod(batch), a2[-2]
    if math.prod(a2[:-2]) == nb:
        A3 = ctx.tensor(a_i, (nb, m, kk))
    else:
        A2 = ctx.tensor(a_i, (m, kk))
        A3 = te.compute((nb, m, kk), lambda b, i, k: A2[i, k], name=f"{name}_a")
    # (B has every batch here: a single one took the branch above)
    w3: Any = w_known.reshape(nb, kk, n) if w_known is not None else ctx.tensor(b_i, (nb, kk, n))
    return int_matmul(ctx, A3, w3, name), out, w_known


def _rowsum(acc_shape: tuple[int, ...], ctx: NodeCtx, a_i: int, kk: int) -> Callable[..., Any]:
    """Per row of A: sum_k int32(a[row, k]) (read at the product's row index)."""
    rows = math.prod(ctx.shape(a_i)) // kk
    A = ctx.tensor(a_i, (rows, kk))
    k = te.reduce_axis((0, kk), name="rk")
    rs = te.compute((rows,), lambda r: te.sum(_i32(A[r, k]), axis=k), name="rowsum")
    m = acc_shape[-2] if len(acc_shape) == 3 else rows
    if len(acc_shape) == 3:  # (batch, M, N) with A broadcast over batches or not
        per_batch = rows // m
        return lambda idx: rs[(idx[0] % per_batch) * m + idx[1]] if per_batch > 1 else rs[idx[1]]
    return lambda idx: rs[idx[0]]


def _colsum_runtime(ctx: NodeCtx, b_i: int) -> Tensor:
    b2 = ctx.shape(b_i) if len(ctx.shape(b_i)) > 1 else ctx.shape(b_i) + (1,)
    nb = math.prod(b2[:-2])
    B = ctx.tensor(b_i, (nb, b2[-2], b2[-1]))
    k = te.reduce_axis((0, b2[-2]), name="ck")
    return te.compute((nb, b2[-1]), lambda b, j: te.sum(_i32(B[b, k, j]), axis=k), name="colsum")


def matmul_corrected(ctx: NodeCtx, a_i: int, b_i: int, za_i: int | None, zb_i: int | None, runtime_zero: bool,
                     name: str, bias: np.ndarray | None = None) -> tuple[Tensor, tuple[int, ...], Callable]:
    """``sum_k (a - za)(b - zb) + bias`` as int32: the product tensor, the ONNX output shape, and a
    function ``idx -> int32 expression`` over the product's indices (the column is the last)."""
    ta, tb = check_int8(ctx, a_i, "A"), check_int8(ctx, b_i, "B")
    b_s = ctx.shape(b_i)
    kk, n = (b_s[-2], b_s[-1]) if len(b_s) > 1 else (b_s[0], 1)
    za = zero_point(ctx, za_i, 1, "A's zero point", runtime_zero, ta) if za_i is not None else Zero(np.zeros(1))
    zb = zero_point(ctx, zb_i, n, "B's zero point", runtime_zero, tb) if zb_i is not None else Zero(np.zeros(1))
    if za.tensor is not None and math.prod(ctx.shape(za_i)) != 1:
        raise ctx.error("A's zero point must be one value (per-row zero points are not supported)")
    acc, out, w_known = _batched_products(ctx, a_i, b_i, name)
    acc_shape = tuple(int(d.value) for d in acc.shape)
    colsum = None
    if w_known is not None and all(d == 1 for d in w_known.shape[:-2]):
        colsum = w_known.reshape(kk, n).astype(np.int64).sum(axis=0)
    const, terms = fold_bias(ctx, n, kk, za, zb, colsum, bias)
    cvec = const_vector(ctx, const) if const.any() else None
    extra: list[Callable[[tuple], Any]] = [lambda idx, t=t: t(idx[-1]) for t in terms]
    if colsum is None and not za.is_zero:  # weights batched or at run time: -za * colsum(b) as a stage
        cs = _colsum_runtime(ctx, b_i) if w_known is None else None
        if cs is not None:
            nbw = int(cs.shape[0].value)
            zread = (lambda: te.const(int(za.known[0]), "int32")) if za.known is not None else (lambda: za.read(0))
            extra.append(lambda idx: -(zread() * cs[(idx[0] % nbw if len(idx) == 3 and nbw > 1 else 0, idx[-1])]))
        else:
            csk = w_known.astype(np.int64).sum(axis=-2).reshape(-1, n)
            cst = ctx.constant(csk.astype(np.int32), keyed=False)
            nbw = csk.shape[0]
            zread = (lambda: te.const(int(za.known[0]), "int32")) if za.known is not None else (lambda: za.read(0))
            extra.append(lambda idx: -(zread() * cst[(idx[0] % nbw if nbw > 1 else 0, idx[-1])]))
    if not zb.is_zero:
        rs = _rowsum(acc_shape, ctx, a_i, kk)
        if zb.known is not None:
            zbv = const_vector(ctx, zb.known * np.ones(n, np.int64))
            extra.append(lambda idx: -(zbv(idx[-1]) * rs(idx)))
        else:
            extra.append(lambda idx: -(zb.read(idx[-1]) * rs(idx)))

    def value(idx: tuple) -> Any:
        v = acc[idx]
        if cvec is not None:
            v = v + cvec(idx[-1])
        for f in extra:
            v = v + f(idx)
        return v

    return acc, out, value


@op("MatMulInteger")
def matmul_integer(ctx: NodeCtx) -> list:
    acc, out, value = matmul_corrected(ctx, 0, 1, 2, 3, True, "matmulinteger")
    shp = tuple(int(d.value) for d in acc.shape)
    return [Shaped(te.compute(shp, lambda *i: value(i), name="matmulinteger_out"), out)]


@dataclass(frozen=True)
class Multiplier:
    """A requantization multiplier per column: ``mult(c)`` reads it; ``small`` when every value's
    magnitude is below 0.5 (see :func:`requantize`)."""

    read: Callable[[Any], Any]
    small: bool

    def __call__(self, c: Any) -> Any:
        return self.read(c)


def requant_multiplier(ctx: NodeCtx, sx: np.ndarray, sw: np.ndarray, sy: np.ndarray, n: int) -> Multiplier:
    """``sx * sw[c] / sy`` in float32 (onnxruntime's order), per column."""
    if sx.size != 1 or sy.size != 1 or sw.size not in (1, n):
        raise ctx.error(f"the scales have {sx.size}, {sw.size} and {sy.size} values; the input's and the output's "
                        f"must be one value, the weights' 1 or {n}")
    m = (sx[0] * sw / sy[0]).astype(np.float32) * np.ones(n, np.float32)
    return Multiplier(const_vector(ctx, m, "float32"), small_multiplier(m))


def small_multiplier(m: Any) -> bool:
    """Whether every requantization multiplier in ``m`` has a magnitude below 0.5 (``requantize``'s
    ``small``)."""
    return bool(np.abs(np.asarray(m, np.float64)).max(initial=0) < 0.5)


@op("QLinearMatMul")
def qlinear_matmul(ctx: NodeCtx) -> list:
    qy = ctx.dtype(7) if ctx.has(7) else "uint8"
    if qy not in _I8:
        raise DTypeError(f"{ctx.node}: y_zero_point is {qy}; QLinearMatMul writes uint8 or int8")
    acc, out, value = matmul_corrected(ctx, 0, 3, 2, 5, False, "qlinearmatmul")
    shp = tuple(int(d.value) for d in acc.shape)
    mult = requant_multiplier(ctx, scale_value(ctx, 1, "a_scale"), scale_value(ctx, 4, "b_scale"),
                              scale_value(ctx, 6, "y_scale"), shp[-1])
    zy = int(np.asarray(ctx.value(7)).reshape(-1)[0]) if ctx.has(7) else 0
    y = te.compute(shp, lambda *i: requantize(value(i), mult(i[-1]), zy, qy, mult.small),
                   name="qlinearmatmul_out")
    return [Shaped(y, out)]


@op("CuvilQLinearMatMul")
def cuvil_qlinear_matmul(ctx: NodeCtx) -> list:
    """A quantized MatMul (or Gemm with its weights transposed at compile time) as
    :func:`cuvil.graph.qdq.match_qdq` writes it: inputs a, a_scale, a_zero_point, b, b_scale,
    b_zero_point, y_scale, y_zero_point, bias (int32 at a_scale * b_scale); without y_scale the result
    is float32 ``acc * a_scale * b_scale[c]``."""
    bias = None
    if ctx.has(8):
        if ctx.dtype(8) != "int32":
            raise DTypeError(f"{ctx.node}: the bias is {ctx.dtype(8)}; it must be int32")
        bias = np.asarray(ctx.value(8)).reshape(-1)
    acc, out, value = matmul_corrected(ctx, 0, 3, 2, 5, False, "qmatmul", bias)
    shp = tuple(int(d.value) for d in acc.shape)
    sa, sb = scale_value(ctx, 1, "a_scale"), scale_value(ctx, 4, "b_scale")
    if not ctx.has(6):
        mult = requant_multiplier(ctx, sa, sb, np.ones(1, np.float32), shp[-1])
        return [Shaped(te.compute(shp, lambda *i: te.cast(value(i), "float32") * mult(i[-1]), name="qmatmul_float"),
                       out)]
    qy = ctx.dtype(7) if ctx.has(7) else "uint8"
    if qy not in _I8:
        raise DTypeError(f"{ctx.node}: y_zero_point is {qy}; the output is uint8 or int8")
    mult = requant_multiplier(ctx, sa, sb, scale_value(ctx, 6, "y_scale"), shp[-1])
    zy = int(np.asarray(ctx.value(7)).reshape(-1)[0]) if ctx.has(7) else 0
    y = te.compute(shp, lambda *i: requantize(value(i), mult(i[-1]), zy, qy, mult.small), name="qmatmul_out")
    return [Shaped(y, out)]


def scale_reader(ctx: NodeCtx, i: int, n: int) -> Callable[[Any], Any]:
    """Input ``i`` (a float32 scale computed at run time or known: one value, or ``n``, one per column)
    as a read function of the column."""
    size = math.prod(ctx.shape(i))
    if ctx.dtype(i) != "float32" or size not in (1, n):
        raise ctx.error(f"the scale (input {i}) is {ctx.dtype(i)} with {size} values; it must be float32 with 1 or "
                        f"{n}")
    S = ctx.tensor(i, (size,))
    return (lambda c: S[0]) if size == 1 else (lambda c: S[c])


@op("CuvilMatMulIntegerToFloat")
def matmul_integer_to_float(ctx: NodeCtx) -> list:
    """``float32(MatMulInteger(a, b, a_zero_point, b_zero_point)) * scale`` in one kernel (what
    ``quantize_dynamic`` writes as MatMulInteger -> Cast -> Mul, :func:`cuvil.graph.qdq.match_qdq`):
    inputs a, b, a_zero_point, b_zero_point, scale (run-time zero points and scale allowed)."""
    acc, out, value = matmul_corrected(ctx, 0, 1, 2, 3, True, "matmulinteger")
    shp = tuple(int(d.value) for d in acc.shape)
    s = scale_reader(ctx, 4, shp[-1])
    return [Shaped(te.compute(shp, lambda *i: te.cast(value(i), "float32") * s(i[-1]), name="matmulinteger_float"),
                   out)]
