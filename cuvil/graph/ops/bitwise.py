"""ONNX bit operators on integer tensors: BitwiseAnd/Or/Xor/Not and BitShift, with broadcasting."""

from __future__ import annotations

from typing import Any

import numpy as np

from cuvil import dtype as dt
from cuvil import te
from cuvil.errors import DTypeError
from cuvil.graph.ops.base import NodeCtx, elementwise, op


def _ints(ctx: NodeCtx, inputs: list[int]) -> str:
    types = {ctx.dtype(i) for i in inputs}
    if len(types) > 1:
        raise DTypeError(f"{ctx.node}: inputs have different dtypes ({', '.join(sorted(types))})")
    t = types.pop()
    if not dt.is_int(t):
        raise DTypeError(f"{ctx.node}: inputs are {t}; {ctx.node.op_type} needs integers")
    return t


_BITWISE = {"BitwiseAnd": lambda x, y: x & y, "BitwiseOr": lambda x, y: x | y, "BitwiseXor": lambda x, y: x ^ y}


@op(*_BITWISE)
def bitwise(ctx: NodeCtx) -> list:
    """Element-wise and / or / xor of the two's-complement bits."""
    _ints(ctx, [0, 1])
    return [elementwise(ctx, [0, 1], _BITWISE[ctx.node.op_type])]


@op("BitwiseNot")
def bitwise_not(ctx: NodeCtx) -> list:
    """Every bit flipped (``~x``)."""
    _ints(ctx, [0])
    return [elementwise(ctx, [0], lambda x: ~x)]


@op("BitShift")
def bit_shift(ctx: NodeCtx) -> list:
    """``x << y`` or ``x >> y`` (``direction`` LEFT / RIGHT) element-wise.  Bits shifted out are lost
    (the result wraps in the type's width); a shift by a negative amount or by the width or more gives
    0, or -1 for a right shift of a negative signed value (numpy's saturating rule, which ONNX states).
    A shift by ``y`` is a product or floor quotient by ``2**y`` read from a table of the type."""
    t = _ints(ctx, [0, 1])
    d = ctx.attr("direction", "")
    d = d.decode() if isinstance(d, bytes) else str(d)
    if d not in ("LEFT", "RIGHT"):
        raise ctx.error(f"direction {d!r} is not LEFT or RIGHT")
    bits = dt.bits(t)
    signed = dt.is_signed(t)
    # 2**k for k < bits, wrapped to the type (2**(bits-1) is negative in a signed type: a left shift by
    # it still wraps right, and a right shift by bits-1 takes the saturating branch below)
    pow2 = ctx.constant(np.array([1 << k for k in range(bits)], np.uint64).astype(dt.to_numpy(t)), keyed=False)
    limit = bits - 1 if signed and d == "RIGHT" else bits
    zero = te.const(0, t)

    def f(x: Any, y: Any) -> Any:
        ok = ((y >= 0) & (y < limit)) if signed else (y < limit)
        k = te.cast(y, "int64")
        if d == "LEFT":
            return te.if_then_else(ok, x * pow2[k], zero)
        out = te.if_then_else(x < 0, te.const(-1, t), zero) if signed else zero
        return te.if_then_else(ok, x // pow2[k], out)

    return [elementwise(ctx, [0, 1], f)]
