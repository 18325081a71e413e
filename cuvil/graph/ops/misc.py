"""ONNX operators without a larger family: Trilu, CumSum/CumProd, Mod, DepthToSpace, SpaceToDepth, the
trigonometric functions, TopK, Swish, IsInf, Shrink, EyeLike, CenterCropPad."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cuvil import dtype as dt
from cuvil import te
from cuvil.errors import DTypeError
from cuvil.graph.ops.base import NodeCtx, elementwise, norm_axis, op


def _scalar_int(ctx: NodeCtx, i: int, what: str) -> int:
    v = np.asarray(ctx.value(i)).reshape(-1)
    if v.size != 1 or not (dt.is_int(v.dtype.name)):
        raise ctx.error(f"{what} (input {i}) must be one integer, got {v.size} {v.dtype.name} value(s)")
    return int(v[0])


@op("Trilu")
def trilu(ctx: NodeCtx) -> list:
    """The upper (``upper=1``, default) or lower triangle of each matrix of the last two axes: element
    ``[i, j]`` is kept where ``j - i >= k`` (upper) or ``j - i <= k`` (lower), else 0; ``k`` (input 1,
    default 0) is known when compiling (it usually is a constant: causal masks)."""
    shp = ctx.shape(0)
    if len(shp) < 2:
        raise ctx.error(f"the input {list(shp)} must have rank >= 2")
    k = _scalar_int(ctx, 1, "k") if ctx.has(1) else 0
    upper = bool(int(ctx.attr("upper", 1)))
    if math.prod(shp) == 0:
        return [np.zeros(shp, ctx.dtype(0))]
    x = ctx.tensor(0)
    zero = te.const(0, ctx.dtype(0))

    def body(*i: Any) -> Any:
        d = i[-1] - i[-2]
        return te.if_then_else(d >= k if upper else d <= k, x[i], zero)

    return [te.compute(shp, body, name="trilu")]


_cumprod = te.comm_reducer(lambda a, b: a * b, lambda t: 1, name="prod")


@op("CumSum", "CumProd")
def cumulative(ctx: NodeCtx) -> list:
    """Running sums (CumSum) or products (CumProd) along ``axis`` (input 1, known when compiling):
    ``out[..., i, ...]`` combines ``x`` over ``j <= i`` (``j < i`` when ``exclusive``, giving 0 or 1 at
    the first place; ``j >= i`` / ``j > i`` when ``reverse``).  A reduction over the triangle ``j``-vs-``i``
    of the axis: n^2/2 steps for an axis of length n, fine for the sequence lengths models use
    (position ids, masks)."""
    shp = ctx.shape(0)
    dtype = ctx.dtype(0)
    if not (dt.is_float(dtype) or dt.is_int(dtype)):
        raise DTypeError(f"{ctx.node}: input 0 is {dtype}; {ctx.node.op_type} needs numbers")
    axis = norm_axis(ctx, _scalar_int(ctx, 1, "axis"), len(shp))
    exclusive, reverse = bool(int(ctx.attr("exclusive", 0))), bool(int(ctx.attr("reverse", 0)))
    if math.prod(shp) == 0:
        return [np.zeros(shp, dtype)]
    n = shp[axis]
    x = ctx.tensor(0)
    j = te.reduce_axis((0, n), name="j")
    combine = te.sum if ctx.node.op_type == "CumSum" else _cumprod

    def body(*i: Any) -> Any:
        a = i[axis]
        cond = (j > a if exclusive else j >= a) if reverse else (j < a if exclusive else j <= a)
        return combine(x[i[:axis] + (j,) + i[axis + 1:]], axis=j, where=cond)

    return [te.compute(shp, body, name="cumulative")]


@op("Mod")
def mod(ctx: NodeCtx) -> list:
    """Element-wise remainder with broadcasting.  ``fmod=0``: the sign of the divisor, as Python's
    ``%`` (numpy's ``mod``); ``fmod=1``: the sign of the dividend, as C's ``fmod``.  An integer
    remainder by 0 is 0 (no trap); a float one is NaN."""
    if ctx.dtype(0) != ctx.dtype(1):
        raise DTypeError(f"{ctx.node}: inputs have different dtypes ({ctx.dtype(0)}, {ctx.dtype(1)})")
    dtype = ctx.dtype(0)
    fmod = int(ctx.attr("fmod", 0))
    if dtype == "bool":
        raise DTypeError(f"{ctx.node}: Mod of bool tensors")

    def f(x: Any, y: Any) -> Any:
        if fmod and dt.is_float(dtype):
            return te.fmod(x, y)
        r = x % y  # floors: the sign of y
        if not fmod or not dt.is_signed(dtype):
            return r
        # a truncating remainder: where r is non-zero and its sign is not x's, move it back by one y
        return te.if_then_else((r != 0) & ((r < 0) != (x < 0)), r - y, r)

    return [elementwise(ctx, [0, 1], f)]


def _block(ctx: NodeCtx) -> tuple[tuple[int, ...], int, str]:
    shp = ctx.shape(0)
    if len(shp) != 4:
        raise ctx.error(f"the input {list(shp)} must be 4-D (N, C, H, W)")
    b = int(ctx.attr("blocksize", 0))
    if b < 1:
        raise ctx.error(f"blocksize {b} must be at least 1")
    mode = ctx.attr("mode", "DCR")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    if mode not in ("DCR", "CRD"):
        raise ctx.error(f"mode {mode!r} is not DCR or CRD")
    return shp, b, mode


@op("DepthToSpace")
def depth_to_space(ctx: NodeCtx) -> list:
    """(N, C*b*b, H, W) -> (N, C, H*b, W*b): output ``[n, c, h*b+y, w*b+x]`` reads channel
    ``(y*b + x)*C + c`` (mode DCR, default) or ``c*b*b + y*b + x`` (CRD)."""
    (n, c, h, w), b, mode = _block(ctx)
    if c % (b * b):
        raise ctx.error(f"channels {c} are not a multiple of blocksize^2 = {b * b}")
    oc = c // (b * b)
    x = ctx.tensor(0)

    def body(i: Any, ch: Any, yy: Any, xx: Any) -> Any:
        y, xo = yy % b, xx % b
        src = (y * b + xo) * oc + ch if mode == "DCR" else ch * (b * b) + y * b + xo
        return x[i, src, yy // b, xx // b]

    return [te.compute((n, oc, h * b, w * b), body, name="depth_to_space")]


@op("SpaceToDepth")
def space_to_depth(ctx: NodeCtx) -> list:
    """(N, C, H*b, W*b) -> (N, C*b*b, H, W), the inverse of DepthToSpace in DCR order: output channel
    ``(y*b + x)*C + c`` at ``[h, w]`` reads ``[c, h*b+y, w*b+x]``."""
    (n, c, h, w), b, mode = _block(ctx)
    if h % b or w % b:
        raise ctx.error(f"height {h} and width {w} must be multiples of blocksize {b}")
    x = ctx.tensor(0)

    def body(i: Any, ch: Any, y: Any, xo: Any) -> Any:
        if mode == "DCR":
            src_c, blk = ch % c, ch // c
        else:
            src_c, blk = ch // (b * b), ch % (b * b)
        return x[i, src_c, y * b + blk // b, xo * b + blk % b]

    return [te.compute((n, c * b * b, h // b, w // b), body, name="space_to_depth")]


# -- trigonometric and hyperbolic functions ---------------------------------------------------

_TRIG = {"Sin": te.sin, "Cos": te.cos, "Tan": te.tan, "Asin": te.asin, "Acos": te.acos, "Atan": te.atan,
         "Sinh": te.sinh, "Cosh": te.cosh, "Asinh": te.asinh, "Acosh": te.acosh, "Atanh": te.atanh}


@op(*_TRIG)
def trig(ctx: NodeCtx) -> list:
    """The element-wise function of the C library (float inputs; NaN outside its domain, as numpy).
    Computed by one libm call per element (``sinf``, ``acoshf``...): no vector code of cuvil's own."""
    if not dt.is_float(ctx.dtype(0)):
        raise DTypeError(f"{ctx.node}: input 0 is {ctx.dtype(0)}; {ctx.node.op_type} needs a float tensor")
    f = _TRIG[ctx.node.op_type]
    return [elementwise(ctx, [0], f)]


# -- TopK -------------------------------------------------------------------------------------


@op("TopK")
def top_k(ctx: NodeCtx) -> list:
    """The ``k`` largest (``largest=1``, default) or smallest elements along ``axis`` and their indices
    (int64), in order (``sorted`` is honoured by always sorting); equal values in the order of their
    indices (the lower index first).  ``k`` (input 1; the attribute before opset 10) is known when
    compiling.  By rank counting: element ``i``'s rank is the number of elements that go before it,
    and output slot ``s`` takes the element of rank ``s`` -- n^2 comparisons for an axis of length n,
    fine for the small n models use (a sort would be O(n log n))."""
    shp = ctx.shape(0)
    dtype = ctx.dtype(0)
    if dtype == "bool":
        raise DTypeError(f"{ctx.node}: TopK of a bool tensor")
    axis = norm_axis(ctx, int(ctx.attr("axis", -1)), len(shp))
    k = _scalar_int(ctx, 1, "k") if ctx.opset >= 10 else int(ctx.attr("k"))
    n = shp[axis]
    if not 0 <= k <= n:
        raise ctx.error(f"k {k} is out of range for axis {axis} of size {n}")
    largest = bool(int(ctx.attr("largest", 1)))
    out = shp[:axis] + (k,) + shp[axis + 1:]
    if math.prod(out) == 0:
        return [np.zeros(out, dtype), np.zeros(out, np.int64)]
    x = ctx.tensor(0)

    def at(i: tuple[Any, ...], a: Any) -> Any:
        return x[i[:axis] + (a,) + i[axis + 1:]]

    j = te.reduce_axis((0, n), name="j")

    def rank(*i: Any) -> Any:
        xi, xj = at(i, i[axis]), at(i, j)
        before, same = (xj > xi) if largest else (xj < xi), xj == xi
        if dt.is_float(dtype):  # a total order (NaN above every number, as numpy sorts): ranks stay a permutation
            ni, nj = te.isnan(xi), te.isnan(xj)
            before = (before | (nj & ~ni)) if largest else (before | (ni & ~nj))
            same = same | (ni & nj)
        return te.sum(te.cast(before | (same & (j < i[axis])), "int64"), axis=j)

    r = te.compute(shp, rank, name="topk_rank")
    e = te.reduce_axis((0, n), name="e")
    idx = te.compute(out, lambda *s: te.max(te.if_then_else(r[s[:axis] + (e,) + s[axis + 1:]] == s[axis],
                                                            te.cast(e, "int64"), te.const(-1, "int64")), axis=e),
                     name="topk_index")
    vals = te.compute(out, lambda *s: at(s, idx[s]), name="topk_value")
    return [vals, idx]


# -- small element-wise ones and EyeLike ------------------------------------------------------


def _float(ctx: NodeCtx) -> None:
    if not dt.is_float(ctx.dtype(0)):
        raise DTypeError(f"{ctx.node}: input 0 is {ctx.dtype(0)}; {ctx.node.op_type} needs a float tensor")


@op("Swish")
def swish(ctx: NodeCtx) -> list:
    """``x * sigmoid(alpha * x)`` (``alpha`` default 1)."""
    _float(ctx)
    alpha = float(ctx.attr("alpha", 1.0))
    return [elementwise(ctx, [0], lambda x: x * te.sigmoid(x * alpha) if alpha != 1.0 else x * te.sigmoid(x))]


@op("IsInf")
def is_inf(ctx: NodeCtx) -> list:
    """Whether each element is +inf (``detect_positive``, default 1) or -inf (``detect_negative``)."""
    _float(ctx)
    pos, neg = int(ctx.attr("detect_positive", 1)), int(ctx.attr("detect_negative", 1))

    def f(x: Any) -> Any:
        return te.any(*([x == math.inf] if pos else []), *([x == -math.inf] if neg else []))

    if not (pos or neg):
        return [np.zeros(ctx.shape(0), bool)]
    return [elementwise(ctx, [0], f)]


@op("Shrink")
def shrink(ctx: NodeCtx) -> list:
    """``x + bias`` where ``x < -lambd``, ``x - bias`` where ``x > lambd``, else 0."""
    lambd, bias = float(ctx.attr("lambd", 0.5)), float(ctx.attr("bias", 0.0))
    if ctx.dtype(0) == "bool":
        raise DTypeError(f"{ctx.node}: Shrink of a bool tensor")

    def f(x: Any) -> Any:
        z = te.const(0, x.dtype)
        if dt.is_float(x.dtype):
            lo, hi, b = -lambd, lambd, bias
        else:  # integers compare with the thresholds as numbers and add a whole bias
            lo, hi, b = math.ceil(-lambd) - 1, math.floor(lambd), int(bias)  # x < -lambd is x <= lo
            return te.if_then_else(x <= lo, x + b, te.if_then_else(x > hi, x - b, z))
        return te.if_then_else(x < lo, x + b, te.if_then_else(x > hi, x - b, z))

    return [elementwise(ctx, [0], f)]


@op("EyeLike")
def eye_like(ctx: NodeCtx) -> list:
    """A 2-D tensor of the input's shape with ones on the ``k``-th diagonal, of type ``dtype`` (default:
    the input's).  It depends only on the shape: a value known when compiling."""
    from cuvil.dtype import from_onnx_code

    shp = ctx.shape(0)
    if len(shp) != 2:
        raise ctx.error(f"the input {list(shp)} must be 2-D")
    code = ctx.attr("dtype")
    dtype = from_onnx_code(int(code), str(ctx.node)) if code is not None else ctx.dtype(0)
    return [np.eye(shp[0], shp[1], int(ctx.attr("k", 0)), dtype=dt.to_numpy(dtype))]


@op("CenterCropPad")
def center_crop_pad(ctx: NodeCtx) -> list:
    """Each axis in ``axes`` (default all) cropped or zero-padded to the length in ``shape`` (input 1,
    known when compiling), centred: a crop drops ``(n - m) // 2`` elements before, a pad adds
    ``(m - n) // 2`` before (the odd one goes after)."""
    shp = ctx.shape(0)
    target = ctx.ints(1)
    axes = [norm_axis(ctx, int(a), len(shp)) for a in ctx.attr("axes", range(len(shp)))]
    if len(target) != len(axes) or any(m < 0 for m in target):
        raise ctx.error(f"shape {target} must give one length >= 0 per axis of {axes}")
    out, off = list(shp), [0] * len(shp)
    for a, m in zip(axes, target):
        out[a] = m
        off[a] = (shp[a] - m) // 2 if m <= shp[a] else -((m - shp[a]) // 2)
    if math.prod(out) == 0 or math.prod(shp) == 0:
        return [np.zeros(out, ctx.dtype(0))]
    x = ctx.tensor(0)
    zero = te.const(0, ctx.dtype(0))

    def body(*i: Any) -> Any:
        src = tuple(ix + o for ix, o in zip(i, off))
        inside = [c for d, s in enumerate(src) if out[d] > shp[d] for c in (s >= 0, s < shp[d])]
        return te.if_then_else(te.all(*inside), x[src], zero) if inside else x[src]

    return [te.compute(tuple(out), body, name="center_crop_pad")]
