"""Element-wise ONNX operators: activations, arithmetic with broadcasting, comparisons, logic, Cast, Where."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cuvil import dtype as dt
from cuvil import te
from cuvil.errors import DTypeError
from cuvil.graph.ops.base import NodeCtx, elementwise, op

# -- unary ------------------------------------------------------------------------------


def _zero(x: Any) -> Any:
    return te.const(0, x.dtype)


def _float(ctx: NodeCtx, i: int = 0) -> None:
    if not dt.is_float(ctx.dtype(i)):
        raise DTypeError(f"{ctx.node}: input {i} is {ctx.dtype(i)}; this operator needs a float tensor")


_UNARY = {
    "Relu": lambda c, x: te.max(x, _zero(x)),
    "Sigmoid": lambda c, x: te.sigmoid(x),
    "Tanh": lambda c, x: te.tanh(x),
    "Erf": lambda c, x: te.erf(x),
    "Sqrt": lambda c, x: te.sqrt(x),
    "Exp": lambda c, x: te.exp(x),
    "Log": lambda c, x: te.log(x),
    "Neg": lambda c, x: -x,
    "Abs": lambda c, x: te.abs(x) if not dt.is_bool(x.dtype) and dt.is_signed(x.dtype) or dt.is_float(x.dtype) else x,
    "Reciprocal": lambda c, x: 1.0 / x,
    "Floor": lambda c, x: te.floor(x),
    "Ceil": lambda c, x: te.ceil(x),
    "Round": lambda c, x: te.round(x),
    "Not": lambda c, x: ~x,
    "IsNaN": lambda c, x: te.isnan(x),
    # NaN's sign is NaN (onnxruntime, numpy): the last branch keeps x when it is not equal to itself
    "Sign": lambda c, x: te.if_then_else(x > 0, te.const(1, x.dtype),
                                         te.if_then_else(x < 0, te.const(-1, x.dtype) if x.dtype != "uint8"
                                                         else _zero(x),
                                                         te.if_then_else(x == x, _zero(x), x)
                                                         if dt.is_float(x.dtype) else _zero(x))),
    "LeakyRelu": lambda c, x: te.if_then_else(x < 0, x * float(c.attr("alpha", 0.01)), x),
    "HardSigmoid": lambda c, x: te.max(_zero(x), te.min(te.const(1, x.dtype),
                                                        x * float(c.attr("alpha", 0.2)) + float(c.attr("beta", 0.5)))),
    "HardSwish": lambda c, x: x * te.max(_zero(x), te.min(te.const(1, x.dtype), x * (1.0 / 6.0) + 0.5)),
    # log(1 + exp(x)) without overflow: max(x, 0) + log(1 + exp(-|x|))
    "Softplus": lambda c, x: te.max(x, _zero(x)) + te.log(te.exp(-te.abs(x)) + 1.0),
    "Softsign": lambda c, x: x / (te.abs(x) + 1.0),
    "Elu": lambda c, x: te.if_then_else(x < 0, (te.exp(x) - 1.0) * float(c.attr("alpha", 1.0)), x),
    "Selu": lambda c, x: te.if_then_else(
        x <= 0, (te.exp(x) * float(c.attr("alpha", 1.6732632423543772)) - float(c.attr("alpha", 1.6732632423543772))),
        x) * float(c.attr("gamma", 1.0507009873554805)),
    "Celu": lambda c, x: te.max(x, _zero(x)) + te.min(
        _zero(x), (te.exp(x / float(c.attr("alpha", 1.0))) - 1.0) * float(c.attr("alpha", 1.0))),
    "ThresholdedRelu": lambda c, x: te.if_then_else(x > float(c.attr("alpha", 1.0)), x, _zero(x)),
    "Mish": lambda c, x: x * te.tanh(te.max(x, _zero(x)) + te.log(te.exp(-te.abs(x)) + 1.0)),
}
_FLOAT_ONLY = {"Sigmoid", "Tanh", "Erf", "Sqrt", "Exp", "Log", "Reciprocal", "HardSigmoid", "HardSwish", "Softplus",
               "Softsign", "Elu", "Selu", "Celu", "LeakyRelu", "Gelu", "Mish", "ThresholdedRelu", "IsNaN"}

for _name, _f in _UNARY.items():
    def _make(name: str, f: Any) -> Any:
        def build(ctx: NodeCtx) -> list:
            if name in _FLOAT_ONLY:
                _float(ctx)
            return [elementwise(ctx, [0], lambda x: f(ctx, x))]

        return build

    op(_name)(_make(_name, _f))


@op("Gelu")
def gelu(ctx: NodeCtx) -> list:
    _float(ctx)
    if ctx.attr("approximate", "none") == "tanh":
        c = math.sqrt(2.0 / math.pi)
        return [elementwise(ctx, [0], lambda x: x * 0.5 * (te.tanh((x + x * x * x * 0.044715) * c) + 1.0))]
    return [elementwise(ctx, [0], lambda x: x * 0.5 * (te.erf(x * (1.0 / math.sqrt(2.0))) + 1.0))]


@op("Identity", "Dropout")
def identity(ctx: NodeCtx) -> list:
    from cuvil.graph.ops.base import Alias

    outs: list = [Alias(0, ctx.shape(0))]
    if ctx.node.op_type == "Dropout":
        training = ctx.has(2) and bool(np.asarray(ctx.value(2)).reshape(-1)[0])
        ratio = float(np.asarray(ctx.value(1)).reshape(-1)[0]) if ctx.has(1) else float(ctx.attr("ratio", 0.5))
        if training and ratio != 0.0:
            raise ctx.unsupported("training_mode=True with a non-zero ratio is random; cuvil compiles inference")
        if len(ctx.node.outputs) > 1:
            outs.append(np.ones(ctx.shape(0), bool))
    return outs


# -- binary and variadic ----------------------------------------------------------------


def _same_dtype(ctx: NodeCtx, inputs: list[int]) -> None:
    types = {ctx.dtype(i) for i in inputs}
    if len(types) > 1:
        raise DTypeError(f"{ctx.node}: inputs have different dtypes ({', '.join(sorted(types))})")


def _div(x: Any, y: Any) -> Any:
    if dt.is_float(x.dtype):
        return x / y
    if not dt.is_signed(x.dtype):
        return te.if_then_else(y == 0, te.const(0, x.dtype), x // y)
    q = x // y  # floor; ONNX (like C) truncates toward zero
    return te.if_then_else((x % y != 0) & ((x < 0) != (y < 0)), q + te.const(1, x.dtype), q)


_BINARY = {
    "Add": lambda x, y: x + y,
    "Sub": lambda x, y: x - y,
    "Mul": lambda x, y: x * y,
    "Div": _div,
    "Equal": lambda x, y: x == y,
    "Less": lambda x, y: x < y,
    "Greater": lambda x, y: x > y,
    "LessOrEqual": lambda x, y: x <= y,
    "GreaterOrEqual": lambda x, y: x >= y,
    "And": lambda x, y: x & y,
    "Or": lambda x, y: x | y,
    "Xor": lambda x, y: x ^ y,
}

for _name, _f in _BINARY.items():
    def _make2(f: Any) -> Any:
        def build(ctx: NodeCtx) -> list:
            _same_dtype(ctx, [0, 1])
            if ctx.dtype(0) == "bool" and f in (_BINARY["Add"], _BINARY["Sub"], _BINARY["Mul"], _BINARY["Div"]):
                raise DTypeError(f"{ctx.node}: arithmetic on bool tensors")
            return [elementwise(ctx, [0, 1], f)]

        return build

    op(_name)(_make2(_f))


@op("Pow")
def pow_(ctx: NodeCtx) -> list:
    base, expo = ctx.dtype(0), ctx.dtype(1)
    if dt.is_float(base):
        def f(x: Any, y: Any) -> Any:
            if ctx.known(1) and np.asarray(ctx.value(1)).size == 1:
                v = float(np.asarray(ctx.value(1)).reshape(-1)[0])
                if v in (1.0, 2.0, 3.0, 4.0):  # (tanh GELU cubes its input) products: within 2 ulp of pow
                    p = x
                    for _ in range(int(v) - 1):
                        p = p * x
                    return p
                if v == 0.5:
                    return te.sqrt(x)
            return te.power(x, y if expo == base else te.cast(y, base))
    else:
        def f(x: Any, y: Any) -> Any:
            return te.cast(te.power(te.cast(x, "float64"), te.cast(y, "float64")), base)
    return [elementwise(ctx, [0, 1], f)]


@op("Min", "Max", "Sum", "Mean")
def variadic(ctx: NodeCtx) -> list:
    ins = [i for i in range(ctx.n_inputs) if ctx.has(i)]
    _same_dtype(ctx, ins)
    name = ctx.node.op_type

    def f(*xs: Any) -> Any:
        acc = xs[0]
        for x in xs[1:]:
            acc = te.min(acc, x) if name == "Min" else te.max(acc, x) if name == "Max" else acc + x
        return acc / float(len(xs)) if name == "Mean" else acc

    return [elementwise(ctx, ins, f)]


@op("PRelu")
def prelu(ctx: NodeCtx) -> list:
    _same_dtype(ctx, [0, 1])
    return [elementwise(ctx, [0, 1], lambda x, s: te.if_then_else(x < 0, x * s, x))]


@op("Where")
def where(ctx: NodeCtx) -> list:
    _same_dtype(ctx, [1, 2])
    return [elementwise(ctx, [0, 1, 2], lambda c, x, y: te.if_then_else(c, x, y))]


@op("Clip")
def clip(ctx: NodeCtx) -> list:
    ins = [0]
    lo_attr, hi_attr = ctx.attr("min"), ctx.attr("max")
    if ctx.opset >= 11:
        ins += [i for i in (1, 2) if ctx.has(i)]

    def f(x: Any, *bounds: Any) -> Any:
        it = iter(bounds)
        if ctx.opset >= 11:
            lo = next(it) if ctx.has(1) else None
            hi = next(it) if ctx.has(2) else None
        else:
            lo = te.const(float(lo_attr), x.dtype) if lo_attr is not None else te.const(-3.4028234663852886e38, x.dtype)
            hi = te.const(float(hi_attr), x.dtype) if hi_attr is not None else te.const(3.4028234663852886e38, x.dtype)
        # max/min, not selects: in a vector loop a select whose sides read memory is evaluated lane by
        # lane (so that the unchosen side never reads out of bounds), and as the epilogue of a fused
        # kernel the whole body would be; max/min stay vector code.  Both keep a NaN input NaN.
        if lo is not None:
            x = te.max(x, lo)
        if hi is not None:
            x = te.min(x, hi)
        return x

    return [elementwise(ctx, ins, f)]


# -- Cast -------------------------------------------------------------------------------


def _cast(x: Any, to: str) -> Any:
    if x.dtype == to:
        return x
    if to == "bool":
        return x != te.const(0, x.dtype)
    return te.cast(x, to)


@op("Cast")
def cast(ctx: NodeCtx) -> list:
    to = dt.from_onnx_code(int(ctx.attr("to")), str(ctx.node))
    return [elementwise(ctx, [0], lambda x: _cast(x, to))]


@op("CastLike")
def cast_like(ctx: NodeCtx) -> list:
    to = ctx.dtype(1)
    return [elementwise(ctx, [0], lambda x: _cast(x, to))]
