"""ONNX's linear quantization operators: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear.

    QuantizeLinear:   y = saturate(round_half_even(x / y_scale) + y_zero_point)
    DequantizeLinear: y = (x - x_zero_point) * x_scale

The scale and zero point are one value (per tensor), a 1-D tensor along ``axis`` (per axis), or a
tensor of ``x``'s rank whose ``axis`` dimension is ``ceil(x.shape[axis] / block_size)`` (blocked).
QuantizeLinear divides (as ONNX says and onnxruntime does): multiplying by a reciprocal rounds a
quotient that lies exactly on a .5 tie to the wrong side.  Integer types cuvil does not have
(int4, uint4, int2, uint2) and the float8 / float4 types are refused with a DTypeError.
"""

from __future__ import annotations

import math
from typing import Any

from cuvil import dtype as dt
from cuvil import te
from cuvil.errors import DTypeError
from cuvil.graph.ops.base import NodeCtx, Shaped, elementwise, norm_axis, op

# the integer types a quantized tensor may have in cuvil, with their saturation limits
QRANGE = {"int8": (-128, 127), "uint8": (0, 255), "int16": (-32768, 32767), "uint16": (0, 65535),
          "int32": (-2**31, 2**31 - 1)}
# ONNX element types of quantized tensors that cuvil has no dtype for
_UNSUPPORTED = {16: "bfloat16", 17: "float8e4m3fn", 18: "float8e4m3fnuz", 19: "float8e5m2", 20: "float8e5m2fnuz",
                21: "uint4", 22: "int4", 23: "float4e2m1", 25: "uint2", 26: "int2"}


def _float_math(x: Any) -> Any:
    """``x`` as the float32 the arithmetic runs in (float16 computes in float32, as everywhere in cuvil)."""
    return x if x.dtype in ("float32", "float64") else te.cast(x, "float32")


def exact_div(a: Any, b: Any) -> Any:
    """``a / b`` of float32 values, correctly rounded to float32 as IEEE division is: computed in float64
    and rounded once to float32.  (cuvil's vector code divides by multiplying with a reciprocal, which
    can land a quotient one ulp off a .5 tie; the float64 quotient is within 2^-52 of the exact one,
    while a quotient of two float32 values that is not a float32 midpoint lies at least ~2^-48 from
    one, so the rounding to float32 is the same as from the exact quotient.)"""
    if a.dtype != "float32":
        return a / b
    b64 = te.cast(b, "float64") if not isinstance(b, float) else b
    return te.cast(te.cast(a, "float64") / b64, "float32")


def quantize_expr(x: Any, scale: Any, zero: Any, qtype: str) -> Any:
    """``saturate(round_half_even(x / scale) + zero)`` as a ``qtype`` expression (``x`` and ``scale``
    floats, ``zero`` an integer expression or None); the limits clamp in float, before the cast."""
    lo, hi = QRANGE[qtype]
    xf, sf = _float_math(x), _float_math(scale)
    if sf.dtype != xf.dtype:
        sf = te.cast(sf, xf.dtype)
    v = te.round(exact_div(xf, sf))
    if zero is not None:
        v = v + te.cast(zero, xf.dtype)
    v = te.min(te.max(v, te.const(float(lo), xf.dtype)), te.const(float(hi), xf.dtype))
    return te.cast(v, qtype)


def dequantize_expr(x: Any, scale: Any, zero: Any, out: str) -> Any:
    """``(x - zero) * scale`` in ``out`` (the difference exact in int32, the product in float)."""
    xi = te.cast(x, "int32") if x.dtype != "int32" else x
    if zero is not None:
        xi = xi - (te.cast(zero, "int32") if zero.dtype != "int32" else zero)
    sf = _float_math(scale)
    v = te.cast(xi, sf.dtype) * sf
    return v if v.dtype == out else te.cast(v, out)


def check_qtype(ctx: NodeCtx, dtype: str, what: str) -> None:
    if dtype not in QRANGE:
        raise DTypeError(f"{ctx.node}: {what} is {dtype}; cuvil quantizes to {', '.join(QRANGE)}")


def _quantized_type(ctx: NodeCtx) -> str:
    """QuantizeLinear's output type: the zero point's, else ``output_dtype``, else uint8."""
    if ctx.has(2):
        return ctx.dtype(2)
    code = int(ctx.attr("output_dtype", 0) or 0)
    if code in _UNSUPPORTED:
        raise DTypeError(f"{ctx.node}: output_dtype {_UNSUPPORTED[code]} is not supported; cuvil quantizes to "
                         f"{', '.join(QRANGE)}")
    if code:
        from cuvil.dtype import from_onnx_code

        return from_onnx_code(code, str(ctx.node))
    return "uint8"


def _param_layout(ctx: NodeCtx, xs: tuple[int, ...]) -> tuple[str, int, int]:
    """How the scale (input 1) and zero point (input 2) apply to ``x``: ("tensor", 0, 0), ("axis", axis,
    0) or ("block", axis, block_size); refuses shapes that fit none."""
    ss = ctx.shape(1)
    if ctx.has(2) and ctx.shape(2) != ss and not (math.prod(ss) == math.prod(ctx.shape(2)) == 1):
        raise ctx.error(f"the zero point's shape {list(ctx.shape(2))} differs from the scale's {list(ss)}")
    block = int(ctx.attr("block_size", 0) or 0)
    if math.prod(ss) == 1 and len(ss) <= 1 and not block:
        return "tensor", 0, 0
    axis = norm_axis(ctx, int(ctx.attr("axis", 1)), len(xs))
    if not block:
        if len(ss) != 1 or ss[0] != xs[axis]:
            raise ctx.error(f"a per-axis scale has shape [{xs[axis]}] (x {list(xs)}, axis {axis}), not {list(ss)}")
        return "axis", axis, 0
    if block < 0:
        raise ctx.error(f"block_size {block} is negative")
    want = tuple(-(-n // block) if d == axis else n for d, n in enumerate(xs))
    if ss != want:
        raise ctx.error(f"a blocked scale (block_size {block}, axis {axis}, x {list(xs)}) has shape {list(want)}, "
                        f"not {list(ss)}")
    return "block", axis, block


def per_element(ctx: NodeCtx, f: Any, name: str) -> Shaped:
    """``f(x, scale, zero)`` at every element of input 0, with input 1 (scale) and input 2 (zero
    point, optional) applied per tensor, per axis or per block (:func:`_param_layout`)."""
    xs = ctx.shape(0)
    kind, axis, block = _param_layout(ctx, xs)
    has_zero = ctx.has(2)
    if kind == "tensor":
        ins = [0, 1] + ([2] if has_zero else [])
        return elementwise(ctx, ins, lambda x, s, *z: f(x, s, z[0] if z else None), name=name)
    pre, n, post = math.prod(xs[:axis]), xs[axis], math.prod(xs[axis + 1:])
    X = ctx.tensor(0, (pre, n, post))
    if kind == "axis":
        S = ctx.tensor(1, (n,))
        Z = ctx.tensor(2, (n,)) if has_zero else None

        def body(p: Any, c: Any, q: Any) -> Any:
            return f(X[p, c, q], S[c], Z[c] if Z is not None else None)
    else:
        nb = -(-n // block)
        S = ctx.tensor(1, (pre, nb, post))
        Z = ctx.tensor(2, (pre, nb, post)) if has_zero else None

        def body(p: Any, c: Any, q: Any) -> Any:
            at = (p, c // block, q)
            return f(X[p, c, q], S[at], Z[at] if Z is not None else None)
    return Shaped(te.compute((pre, n, post), body, name=name), xs)


@op("QuantizeLinear")
def quantize_linear(ctx: NodeCtx) -> list:
    qtype = _quantized_type(ctx)
    check_qtype(ctx, qtype, "the quantized type")
    if not dt.is_float(ctx.dtype(0)) and ctx.dtype(0) != "int32":
        raise DTypeError(f"{ctx.node}: x is {ctx.dtype(0)}; QuantizeLinear takes float or int32 values")
    if not dt.is_float(ctx.dtype(1)):
        raise DTypeError(f"{ctx.node}: y_scale is {ctx.dtype(1)}; it must be a float tensor")

    def f(x: Any, s: Any, z: Any) -> Any:
        return quantize_expr(x if dt.is_float(x.dtype) else te.cast(x, "float32"), s, z, qtype)

    return [per_element(ctx, f, "quantize")]


@op("DequantizeLinear")
def dequantize_linear(ctx: NodeCtx) -> list:
    check_qtype(ctx, ctx.dtype(0), "x")
    if ctx.has(2) and ctx.dtype(2) != ctx.dtype(0):
        raise DTypeError(f"{ctx.node}: the zero point is {ctx.dtype(2)}, x is {ctx.dtype(0)}; they must agree")
    out = ctx.dtype(1)
    if not dt.is_float(out):
        raise DTypeError(f"{ctx.node}: x_scale is {out}; it must be a float tensor")
    code = int(ctx.attr("output_dtype", 0) or 0)
    if code:
        from cuvil.dtype import from_onnx_code

        out = from_onnx_code(code, str(ctx.node))
    return [per_element(ctx, lambda x, s, z: dequantize_expr(x, s, z, out), "dequantize")]


@op("DynamicQuantizeLinear")
def dynamic_quantize_linear(ctx: NodeCtx) -> list:
    """uint8 quantization of ``x`` over its own range widened to hold 0: ``scale = (max(x, 0) -
    min(x, 0)) / 255``, ``zero_point = saturate(round_half_even(-min(x, 0) / scale))``, then
    QuantizeLinear with them (a zero scale, all of x being 0, quantizes to 0, as onnxruntime does)."""
    if ctx.dtype(0) != "float32":
        raise DTypeError(f"{ctx.node}: x is {ctx.dtype(0)}; DynamicQuantizeLinear takes float32")
    xs = ctx.shape(0)
    total = math.prod(xs)
    X = ctx.tensor(0, (total,))
    zero = te.const(0.0, "float32")
    if total:
        k = te.reduce_axis((0, total), name="k")
        hi = te.compute((1,), lambda _: te.max(X[k], axis=k), name="xmax")
        k2 = te.reduce_axis((0, total), name="k2")
        lo = te.compute((1,), lambda _: te.min(X[k2], axis=k2), name="xmin")
        hi_v, lo_v = (lambda i: te.max(hi[i], zero)), (lambda i: te.min(lo[i], zero))
    else:
        hi_v = lo_v = (lambda i: zero)
    scale = te.compute((1,), lambda i: exact_div(hi_v(i) - lo_v(i), 255.0), name="scale")

    def zp_body(i: Any) -> Any:
        s = scale[i]
        z = te.round(te.min(te.max(exact_div(-lo_v(i), s), zero), te.const(255.0, "float32")))
        return te.if_then_else(s == zero, te.const(0, "uint8"), te.cast(z, "uint8"))

    zp = te.compute((1,), zp_body, name="zero_point")

    def q_body(i: Any) -> Any:
        s = scale[0]
        q = quantize_expr(X[i], s, zp[0], "uint8")
        return te.if_then_else(s == zero, zp[0], q)

    y = te.compute((total,), q_body, name="dynquant")
    return [Shaped(y, xs), Shaped(te.compute((), lambda: scale[0], name="y_scale"), ()),
            Shaped(te.compute((), lambda: zp[0], name="y_zero_point"), ())]
