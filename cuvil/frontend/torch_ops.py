"""The ATen -> graph IR table: one translation per ATen overload (``"aten::add.Tensor"``), each writing
nodes of the graph IR's operators (ONNX's, opset 18) through a :class:`~cuvil.frontend.torch.Builder`.

A translation is ``f(b, node, args, kwargs) -> value``: ``node`` is the FX node (its ``meta["val"]``
gives the result's dtype and shape), ``args`` / ``kwargs`` its arguments with every FX node replaced by
its value: a graph value's name (str), a :class:`~cuvil.frontend.torch.Sym` (a symbolic size), a
Python number, or a list / tuple of those.  It returns the node's value (a tuple for several results).
Type promotion follows torch: an element-wise node's inputs are cast to the dtype torch computes in.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from cuvil.errors import UnsupportedOpError
from cuvil.frontend.torch import Builder, Sym, _dim, node_meta, torch_dtype_name

TABLE: dict[str, Callable] = {}


def aten(*names: str) -> Callable[[Callable], Callable]:
    def deco(f: Callable) -> Callable:
        for n in names:
            TABLE[n if "::" in n or n.startswith("_operator") else f"aten::{n}"] = f
        return f

    return deco


def _dt(n: Any) -> str:
    """The dtype of FX node ``n``'s (first) result."""
    m = node_meta(n)
    if isinstance(m, (list, tuple)):
        m = m[0]
    return torch_dtype_name(m.dtype)


def _shape(a: Any) -> tuple:
    """The meta shape of FX argument ``a`` (ints, and names for symbolic sizes)."""
    return tuple(_dim(d) for d in node_meta(a).shape)


def _rank(a: Any) -> int:
    return len(node_meta(a).shape)


def _axis(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _operand(b: Builder, v: Any, dt: str) -> str:
    """``v`` (a value or a Python number) as a value of ``dt``; an integer that ``dt`` cannot hold wraps
    around, as torch casts it (``uint8_tensor + (-3)`` adds 253)."""
    if isinstance(v, int) and not isinstance(v, bool) and dt != "bool" and not dt.startswith("float"):
        v = np.asarray(v).astype(dt)[()]
    return b.tensor(v, dt)


def _compute_dtype(n: Any) -> str:
    """The dtype torch computes an element-wise node in (its inputs' promoted type)."""
    import torch

    vals = [node_meta(a) if isinstance(a, torch.fx.Node) else a for a in n.args if isinstance(a, (torch.fx.Node, int,
                                                                                              float, bool))]
    vals = [v for v in vals if isinstance(v, (torch.Tensor, int, float, bool))]
    return torch_dtype_name(torch.result_type(*vals[:2])) if len(vals) >= 2 else _dt(n)


# -- element-wise -----------------------------------------------------------------------------

_UNARY = {"relu": "Relu", "sigmoid": "Sigmoid", "tanh": "Tanh", "neg": "Neg", "abs": "Abs", "log": "Log",
          "exp": "Exp", "sqrt": "Sqrt", "cos": "Cos", "sin": "Sin", "erf": "Erf", "reciprocal": "Reciprocal",
          "floor": "Floor", "ceil": "Ceil", "round": "Round", "sign": "Sign", "tan": "Tan", "atan": "Atan",
          "logical_not": "Not", "hardswish": "HardSwish"}


def _unary(op_type: str) -> Callable:
    def f(b: Builder, n: Any, args: tuple, kw: dict) -> str:
        dt = _dt(n)
        return b.one(op_type, [b.tensor(args[0], dt)], dt)

    return f


for _k, _v in _UNARY.items():
    aten(f"{_k}.default")(_unary(_v))


@aten("rsqrt.default")
def _rsqrt(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dt = _dt(n)
    return b.one("Reciprocal", [b.one("Sqrt", [b.tensor(args[0], dt)], dt)], dt)


@aten("silu.default")
def _silu(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dt = _dt(n)
    x = b.tensor(args[0], dt)
    return b.one("Mul", [x, b.one("Sigmoid", [x], dt)], dt)


@aten("hardsigmoid.default")
def _hardsigmoid(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dt = _dt(n)
    return b.one("HardSigmoid", [b.tensor(args[0], dt)], dt, alpha=1.0 / 6.0, beta=0.5)


@aten("leaky_relu.default")
def _leaky_relu(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dt = _dt(n)
    slope = args[1] if len(args) > 1 else kw.get("negative_slope", 0.01)
    return b.one("LeakyRelu", [b.tensor(args[0], dt)], dt, alpha=float(slope))


@aten("elu.default")
def _elu(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    """``scale * (x if x > 0 else alpha * (exp(input_scale * x) - 1))`` (SELU: scale and alpha; CELU:
    input_scale = 1 / alpha)."""
    dt = _dt(n)
    alpha, scale, input_scale = (args[k] if len(args) > k else kw.get(name, 1.0)
                                 for k, name in ((1, "alpha"), (2, "scale"), (3, "input_scale")))
    x = b.tensor(args[0], dt)
    if input_scale == 1:
        y = b.one("Elu", [x], dt, alpha=float(alpha))
    else:
        neg = b.one("Mul", [b.one("Sub", [b.one("Exp", [b.one("Mul", [x, b.const(input_scale, dt)], dt)], dt),
                                          b.const(1, dt)], dt), b.const(alpha, dt)], dt)
        y = b.one("Where", [b.one("Greater", [x, b.const(0, dt)], "bool"), x, neg], dt)
    return y if scale == 1 else b.one("Mul", [y, b.const(scale, dt)], dt)


@aten("softplus.default")
def _softplus(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    """``log(1 + exp(beta * x)) / beta``, and ``x`` where ``beta * x > threshold``."""
    dt = _dt(n)
    beta = args[1] if len(args) > 1 else kw.get("beta", 1.0)
    threshold = args[2] if len(args) > 2 else kw.get("threshold", 20.0)
    x = b.tensor(args[0], dt)
    bx = x if beta == 1 else b.one("Mul", [x, b.const(beta, dt)], dt)
    y = b.one("Softplus", [bx], dt)
    if beta != 1:
        y = b.one("Div", [y, b.const(beta, dt)], dt)
    return b.one("Where", [b.one("Greater", [bx, b.const(threshold, dt)], "bool"), x, y], dt)


@aten("gelu.default")
def _gelu(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dt = _dt(n)
    return b.one("Gelu", [b.tensor(args[0], dt)], dt, approximate=kw.get("approximate", "none"))


# op -> (ONNX operator, the overloads ATen has)
_BINARY = {"add": ("Add", "Tensor Scalar"), "sub": ("Sub", "Tensor Scalar"), "mul": ("Mul", "Tensor Scalar"),
           "div": ("Div", "Tensor Scalar Tensor_mode Scalar_mode"), "maximum": ("Max", "default"),
           "minimum": ("Min", "default"), "pow": ("Pow", "Tensor_Tensor Tensor_Scalar Scalar"),
           "remainder": ("Mod", "Tensor Scalar Scalar_Tensor"), "fmod": ("Mod", "Tensor Scalar")}
_COMPARE = {"eq": "Equal", "ne": "Equal", "lt": "Less", "le": "LessOrEqual", "gt": "Greater", "ge": "GreaterOrEqual"}
# op -> (the operator on bools, the operator on integers)
_LOGICAL = {"bitwise_and": ("And", "BitwiseAnd"), "bitwise_or": ("Or", "BitwiseOr"),
            "bitwise_xor": ("Xor", "BitwiseXor"), "logical_and": ("And", None), "logical_or": ("Or", None),
            "logical_xor": ("Xor", None)}
_BOOL_ARITH = {"Add": "Or", "Mul": "And", "Max": "Or", "Min": "And"}  # torch's arithmetic on bool tensors


def _binary(name: str, op_type: str) -> Callable:
    def f(b: Builder, n: Any, args: tuple, kw: dict) -> str:
        dt = _dt(n)
        x, y = _operand(b, args[0], dt), _operand(b, args[1], dt)
        alpha = kw.get("alpha", 1)
        if alpha != 1:
            y = b.one("Mul", [y, b.const(alpha, dt)], dt)
        if dt == "bool":
            if op_type not in _BOOL_ARITH:
                raise UnsupportedOpError(f"{name} of bool tensors")
            return b.one(_BOOL_ARITH[op_type], [x, y], dt)
        mode = kw.get("rounding_mode")
        if name == "div" and mode is not None:
            if mode == "floor":
                return _floor_div(b, x, y, dt)
            q = b.one("Div", [x, y], dt)  # integer Div truncates
            return _trunc(b, q, dt) if dt.startswith("float") else q
        extra = {"fmod": 1} if name == "fmod" else ({"fmod": 0} if name == "remainder" else {})
        return b.one(op_type, [x, y], dt, **extra)

    return f


def _trunc(b: Builder, q: str, dt: str) -> str:
    """Round towards zero: sign(q) * floor(|q|)."""
    return b.one("Mul", [b.one("Sign", [q], dt), b.one("Floor", [b.one("Abs", [q], dt)], dt)], dt)


def _floor_div(b: Builder, x: str, y: str, dt: str) -> str:
    """``x // y`` rounded down, as torch (and Python) compute it: ``(x - x mod y) / y`` with the remainder
    that takes the divisor's sign (Mod, fmod=0), a whole multiple of ``y``.  On integers Div's truncation
    is then exact; on floats the quotient is rounded to that whole number (``floor(x / y)`` differs where
    ``x / y`` rounds up to an integer: 1 // 0.1 is 9), and a division by zero is ``x / y``."""
    q = b.one("Div", [b.one("Sub", [x, b.one("Mod", [x, y], dt, fmod=0)], dt), y], dt)
    if not dt.startswith("float"):
        return q
    return b.one("Where", [b.one("Equal", [y, b.const(0, dt)], "bool"), b.one("Div", [x, y], dt),
                           b.one("Round", [q], dt)], dt)


for _k, (_v, _overloads) in _BINARY.items():
    for _ov in _overloads.split():
        aten(f"{_k}.{_ov}")(_binary(_k, _v))


def _compare(name: str, op_type: str) -> Callable:
    def f(b: Builder, n: Any, args: tuple, kw: dict) -> str:
        dt = _compute_dtype(n)
        r = b.one(op_type, [_operand(b, args[0], dt), _operand(b, args[1], dt)], "bool")
        return b.one("Not", [r], "bool") if name == "ne" else r

    return f


for _k, _v in _COMPARE.items():
    for _ov in ("Tensor", "Scalar"):
        aten(f"{_k}.{_ov}")(_compare(_k, _v))


def _logical(name: str, ops: tuple) -> Callable:
    def f(b: Builder, n: Any, args: tuple, kw: dict) -> str:
        dt = _dt(n)
        op_type = ops[0] if dt == "bool" or name.startswith("logical") else ops[1]
        cdt = "bool" if op_type in ("And", "Or", "Xor") else dt
        return b.one(op_type, [_operand(b, args[0], cdt), _operand(b, args[1], cdt)], dt)

    return f


for _k, _v in _LOGICAL.items():
    for _ov in ("default",) if _k.startswith("logical") else ("Tensor", "Scalar", "Scalar_Tensor"):
        aten(f"{_k}.{_ov}")(_logical(_k, _v))


@aten("bitwise_not.default")
def _bitwise_not(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dt = _dt(n)
    return b.one("Not" if dt == "bool" else "BitwiseNot", [b.tensor(args[0], dt)], dt)


@aten("isnan.default")
def _isnan(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    return b.one("IsNaN", [args[0]], "bool")


@aten("where.self", "where.ScalarSelf", "where.ScalarOther", "where.Scalar")
def _where(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dt = _dt(n)
    return b.one("Where", [b.tensor(args[0], "bool"), b.tensor(args[1], dt), b.tensor(args[2], dt)], dt)


@aten("masked_fill.Scalar", "masked_fill.Tensor")
def _masked_fill(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dt = _dt(n)
    return b.one("Where", [b.tensor(args[1], "bool"), b.tensor(args[2], dt), b.tensor(args[0], dt)], dt)


@aten("clamp.default", "clamp.Tensor", "hardtanh.default", "clamp_min.default", "clamp_max.default")
def _clamp(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dt = _dt(n)
    name = str(n.target)
    if "hardtanh" in name:
        lo, hi = (args[1] if len(args) > 1 else -1.0), (args[2] if len(args) > 2 else 1.0)
    elif "clamp_min" in name:
        lo, hi = args[1], None
    elif "clamp_max" in name:
        lo, hi = None, args[1]
    else:
        lo = args[1] if len(args) > 1 else kw.get("min")
        hi = args[2] if len(args) > 2 else kw.get("max")
    ins = [b.tensor(args[0], dt), b.tensor(lo, dt) if lo is not None else "",
           b.tensor(hi, dt) if hi is not None else ""]
    while ins[-1] == "":
        ins.pop()
    return b.one("Clip", ins, dt)


@aten("_to_copy.default", "clone.default", "alias.default", "detach.default", "lift_fresh_copy.default",
      "native_dropout.default")
def _copy(b: Builder, n: Any, args: tuple, kw: dict) -> Any:
    dt = _dt(n)
    dropout = "dropout" in str(n.target)
    if dropout and (args[2] if len(args) > 2 else kw.get("train", False)):
        raise UnsupportedOpError("dropout in training mode is random; cuvil compiles inference")
    x = b.tensor(args[0], dt)
    out = x if x != args[0] else b.one("Identity", [x], dt)
    return (out, None) if str(n.target).startswith("aten.native_dropout") else out


@aten("_assert_tensor_metadata.default", "_assert_scalar.default", "_assert_async.msg")
def _noop(b: Builder, n: Any, args: tuple, kw: dict) -> None:
    return None


# -- sizes and Python arithmetic on them ----------------------------------------------------------


@aten("sym_size.int")
def _sym_size(b: Builder, n: Any, args: tuple, kw: dict) -> Any:
    axis = _axis(args[1], _rank(n.args[0]))
    d = _shape(n.args[0])[axis]
    return d if isinstance(d, int) else b.size(args[0], axis)


def _sym_arith(op_type: str, py: Callable) -> Callable:
    def f(b: Builder, n: Any, args: tuple, kw: dict) -> Any:
        x, y = args
        if not isinstance(x, Sym) and not isinstance(y, Sym):
            return py(x, y)
        x, y = b.tensor(x, "int64"), b.tensor(y, "int64")
        return Sym(_floor_div(b, x, y, "int64") if py is operator.floordiv else b.one(op_type, [x, y], "int64"))

    return f


def _sym_compare(op_type: str, py: Callable) -> Callable:
    """A comparison of sizes (the condition of an ``_assert_scalar``): a Python bool, or a bool Sym."""
    def f(b: Builder, n: Any, args: tuple, kw: dict) -> Any:
        x, y = args
        if not isinstance(x, Sym) and not isinstance(y, Sym):
            return py(x, y)
        r = b.one(op_type, [b.tensor(x, "int64"), b.tensor(y, "int64")], "bool")
        return Sym(b.one("Not", [r], "bool") if py is operator.ne else r)

    return f


for _f, _o in ((operator.add, "Add"), (operator.sub, "Sub"), (operator.mul, "Mul"), (operator.floordiv, "Div"),
               (operator.mod, "Mod")):
    TABLE[f"_operator.{_f.__name__}"] = _sym_arith(_o, _f)
for _f, _o in ((operator.eq, "Equal"), (operator.ne, "Equal"), (operator.lt, "Less"), (operator.le, "LessOrEqual"),
               (operator.gt, "Greater"), (operator.ge, "GreaterOrEqual")):
    TABLE[f"_operator.{_f.__name__}"] = _sym_compare(_o, _f)


@aten("_operator.getitem")
def _getitem(b: Builder, n: Any, args: tuple, kw: dict) -> Any:
    v = args[0][args[1]]
    if v is None:
        raise UnsupportedOpError(f"result {args[1]} of {n.args[0].name!r} is not computed (a training output)")
    return v


# -- reductions and normalisation -------------------------------------------------------------


def _reduce(op_type: str) -> Callable:
    def f(b: Builder, n: Any, args: tuple, kw: dict) -> str:
        dt = _dt(n)
        rank = _rank(n.args[0])
        dims = args[1] if len(args) > 1 else kw.get("dim")
        if isinstance(dims, int):
            dims = [dims]
        keep = bool(args[2] if len(args) > 2 else kw.get("keepdim", False))
        x = b.tensor(args[0], dt)
        if not dims:
            dims = list(range(rank))
        axes = b.const([_axis(d, rank) for d in dims], "int64")
        return b.one(op_type, [x, axes], dt, keepdims=int(keep))

    return f


aten("mean.dim", "mean.default")(_reduce("ReduceMean"))
aten("sum.dim_IntList", "sum.default")(_reduce("ReduceSum"))
aten("amax.default")(_reduce("ReduceMax"))
aten("amin.default")(_reduce("ReduceMin"))
aten("prod.dim_int")(_reduce("ReduceProd"))


@aten("linalg_vector_norm.default")
def _vector_norm(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    """``||x||_p`` over ``dim`` (all dimensions when None): ``(sum |x|^p)^(1/p)``; p = 2 and 1 are
    ReduceL2 / ReduceL1, +-inf the max / min of ``|x|``, 0 the count of non-zero elements."""
    dt = _dt(n)
    rank = _rank(n.args[0])
    p = args[1] if len(args) > 1 else kw.get("ord", 2)
    dims = args[2] if len(args) > 2 else kw.get("dim")
    keep = int(bool(args[3] if len(args) > 3 else kw.get("keepdim", False)))
    dims = list(range(rank)) if dims is None else [dims] if isinstance(dims, int) else list(dims)
    axes = b.const([_axis(d, rank) for d in dims] or list(range(rank)), "int64")
    x = b.tensor(args[0], dt)  # (the ``dtype`` keyword: the result's dtype, which the input is cast to)
    p = float(p)
    if p == 2.0:
        return b.one("ReduceL2", [x, axes], dt, keepdims=keep)
    if p == 1.0:
        return b.one("ReduceL1", [x, axes], dt, keepdims=keep)
    if math.isinf(p):
        return b.one("ReduceMax" if p > 0 else "ReduceMin", [b.one("Abs", [x], dt), axes], dt, keepdims=keep)
    if p == 0.0:
        nonzero = b.cast(b.one("Not", [b.one("Equal", [x, b.const(0, dt)], "bool")], "bool"), dt)
        return b.one("ReduceSum", [nonzero, axes], dt, keepdims=keep)
    powered = b.one("Pow", [b.one("Abs", [x], dt), b.const(p, dt)], dt)
    return b.one("Pow", [b.one("ReduceSum", [powered, axes], dt, keepdims=keep), b.const(1.0 / p, dt)], dt)


@aten("any.dim", "any.dims", "any.default")
def _any(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    """Whether any element along ``dim`` is non-zero: a max of the values as 0 / 1 (``all`` decomposes
    to ``not any(not x)``)."""
    rank = _rank(n.args[0])
    dims = args[1] if len(args) > 1 else kw.get("dim")
    dims = list(range(rank)) if dims is None else ([dims] if isinstance(dims, int) else list(dims))
    keep = bool(args[2] if len(args) > 2 else kw.get("keepdim", False))
    flags = b.one("Cast", [b.tensor(args[0], "bool")], "int32", to=6)
    r = b.one("ReduceMax", [flags, b.const([_axis(d, rank) for d in dims], "int64")], "int32", keepdims=int(keep))
    return b.one("Cast", [r], "bool", to=9)


@aten("argmax.default", "argmin.default")
def _argmax(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dim = args[1] if len(args) > 1 else kw.get("dim")
    keep = bool(args[2] if len(args) > 2 else kw.get("keepdim", False))
    x, rank = args[0], _rank(n.args[0])
    op_type = "ArgMax" if "argmax" in str(n.target) else "ArgMin"
    if dim is not None:
        return b.one(op_type, [x], "int64", axis=_axis(dim, rank), keepdims=int(keep), select_last_index=0)
    flat = b.one("Reshape", [x, b.const([-1], "int64")], b.dtypes[x])
    r = b.one(op_type, [flat], "int64", axis=0, keepdims=int(keep), select_last_index=0)
    return b.one("Reshape", [r, b.const([1] * rank, "int64")], "int64") if keep else r  # keepdim: all sizes 1


@aten("_softmax.default", "softmax.int", "_log_softmax.default", "log_softmax.int")
def _softmax(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dt = _dt(n)
    op_type = "LogSoftmax" if "log_softmax" in str(n.target) else "Softmax"
    return b.one(op_type, [b.tensor(args[0], dt)], dt, axis=_axis(args[1], _rank(n.args[0])))


@aten("layer_norm.default")
def _layer_norm(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dt = _dt(n)
    shape = list(args[1])
    w = args[2] if len(args) > 2 else kw.get("weight")
    bias = args[3] if len(args) > 3 else kw.get("bias")
    eps = args[4] if len(args) > 4 else kw.get("eps", 1e-5)
    w = w if w is not None else b.const(np.ones(shape, dt))
    bias = bias if bias is not None else b.const(np.zeros(shape, dt))
    return b.one("LayerNormalization", [b.tensor(args[0], dt), w, bias], dt, axis=-len(shape), epsilon=float(eps))


@aten("native_layer_norm.default")
def _native_layer_norm(b: Builder, n: Any, args: tuple, kw: dict) -> tuple:
    """What aot_autograd leaves of ``layer_norm``: the normalised value (the mean and reciprocal standard
    deviation it also returns are for the backward pass, not computed)."""
    return _layer_norm(b, n, args, kw), None, None


@aten("_native_batch_norm_legit_no_training.default")
def _batch_norm(b: Builder, n: Any, args: tuple, kw: dict) -> tuple:
    """Inference: the running statistics.  Of the three results only the first is computed."""
    dt = _dt(n)
    x, w, bias, mean, var = args[:5]
    eps = args[6] if len(args) > 6 else kw.get("eps", 1e-5)
    c = _shape(n.args[0])[1]
    w = w if w is not None else b.const(np.ones(c, dt))
    bias = bias if bias is not None else b.const(np.zeros(c, dt))
    out = b.one("BatchNormalization", [x, w, bias, mean, var], dt, epsilon=float(eps))
    return (out, None, None)


@aten("_native_batch_norm_legit.no_stats")
def _batch_norm_no_stats(b: Builder, n: Any, args: tuple, kw: dict) -> tuple:
    """Normalised by the input's own statistics per channel (dimension 1), as InstanceNorm writes it
    (on the input reshaped to ``1 x N*C x ...``): ``(x - mean) / sqrt(var + eps) * w + bias``, with the
    biased variance.  Of the three results only the first is computed."""
    dt = _dt(n)
    x, w, bias = b.tensor(args[0], dt), args[1], args[2]
    eps = args[5] if len(args) > 5 else kw.get("eps", 1e-5)
    rank = _rank(n.args[0])
    out = _normalised(b, x, b.const([0] + list(range(2, rank)), "int64"), eps, dt)
    return (_per_channel_affine(b, out, w, bias, rank, dt), None, None)


def _normalised(b: Builder, x: str, axes: str, eps: float, dt: str) -> str:
    """``(x - mean) / sqrt(var + eps)`` over ``axes``, the variance biased (what the norms of training mode
    compute)."""
    d = b.one("Sub", [x, b.one("ReduceMean", [x, axes], dt, keepdims=1)], dt)
    var = b.one("ReduceMean", [b.one("Mul", [d, d], dt), axes], dt, keepdims=1)
    return b.one("Div", [d, b.one("Sqrt", [b.one("Add", [var, b.const(eps, dt)], dt)], dt)], dt)


def _per_channel_affine(b: Builder, out: str, w: Any, bias: Any, rank: int, dt: str) -> str:
    """``out * w + bias`` with ``w`` and ``bias`` (each optional) per channel, dimension 1 of ``rank``."""
    per_channel = b.const([-1] + [1] * (rank - 2), "int64")
    if w is not None:
        out = b.one("Mul", [out, b.one("Reshape", [b.tensor(w, dt), per_channel], dt)], dt)
    if bias is not None:
        out = b.one("Add", [out, b.one("Reshape", [b.tensor(bias, dt), per_channel], dt)], dt)
    return out


@aten("native_group_norm.default")
def _group_norm(b: Builder, n: Any, args: tuple, kw: dict) -> tuple:
    """``GroupNorm``: x (N, C, ...) seen as (N, groups, rest), each row normalised by its mean and biased
    variance, ``(x - mean) / sqrt(var + eps)``, reshaped back, then ``* w + bias`` per channel
    (dimension 1).  Of the three results (the mean and reciprocal standard deviation are for the
    backward pass) only the first is computed."""
    dt = _dt(n)
    x, w, bias = b.tensor(args[0], dt), args[1], args[2]
    groups, eps = int(args[6]), float(args[7])
    rank = _rank(n.args[0])
    rows = b.one("Reshape", [x, b.const([0, groups, -1], "int64")], dt)
    normed = _normalised(b, rows, b.const([2], "int64"), eps, dt)
    out = b.one("Reshape", [normed, b.one("Shape", [x], "int64")], dt)
    return (_per_channel_affine(b, out, w, bias, rank, dt), None, None)


# -- contractions and convolutions -----------------------------------------------------------


def _transposed(b: Builder, w: str) -> str:
    """``w.T`` of a 2-D weight: a constant when ``w`` is one (folded here, once per weight: an unrolled
    LSTM's steps share it, and so its packed copy), else a Transpose."""
    if ("T", w) not in b.memo:
        b.memo["T", w] = b.const(np.ascontiguousarray(b.inits[w].T)) if w in b.inits else \
            b.one("Transpose", [w], b.dtypes[w], perm=[1, 0])
    return b.memo["T", w]


@aten("linear.default")
def _linear(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dt = _dt(n)
    x, w = b.tensor(args[0], dt), args[1]
    bias = args[2] if len(args) > 2 else kw.get("bias")
    if _rank(n.args[0]) == 2:
        return b.one("Gemm", [x, w] + ([bias] if bias is not None else []), dt, transB=1)
    y = b.one("MatMul", [x, _transposed(b, w)], dt)
    return b.one("Add", [y, bias], dt) if bias is not None else y


@aten("addmm.default")
def _addmm(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dt = _dt(n)
    beta, alpha = float(kw.get("beta", 1)), float(kw.get("alpha", 1))
    return b.one("Gemm", [args[1], args[2], args[0]], dt, alpha=alpha, beta=beta)


@aten("mm.default", "bmm.default", "matmul.default")
def _matmul(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    return b.one("MatMul", [args[0], args[1]], _dt(n))


@aten("convolution.default")
def _convolution(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = args
    dt = _dt(n)
    k = len(_shape(n.args[1])) - 2
    stride, padding, dilation = (list(v) * (k if len(v) == 1 else 1) for v in (stride, padding, dilation))
    attrs: dict[str, Any] = {"strides": stride, "pads": padding + padding, "dilations": dilation, "group": groups,
                             "kernel_shape": list(_shape(n.args[1])[2:])}
    ins = [x, w] + ([bias] if bias is not None else [])
    if transposed:
        attrs["output_padding"] = list(output_padding) * (k if len(output_padding) == 1 else 1)
        return b.one("ConvTranspose", ins, dt, **attrs)
    return b.one("Conv", ins, dt, **attrs)


@aten("scaled_dot_product_attention.default")
def _sdpa(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    """softmax(q @ k^T * scale + mask) @ v, as the ONNX exporters write it (the graph compiler's
    contraction, softmax and fusion passes apply)."""
    dt = _dt(n)
    q, k, v = args[:3]
    mask = args[3] if len(args) > 3 else kw.get("attn_mask")
    dropout = args[4] if len(args) > 4 else kw.get("dropout_p", 0.0)
    causal = args[5] if len(args) > 5 else kw.get("is_causal", False)
    scale = kw.get("scale", args[6] if len(args) > 6 else None)
    if kw.get("enable_gqa", False):
        raise UnsupportedOpError("enable_gqa=True (repeat the key/value heads before the call)")
    if dropout:
        raise UnsupportedOpError("dropout_p > 0 is random; cuvil compiles inference")
    qs, ks = _shape(n.args[0]), _shape(n.args[1])
    if scale is None:
        if not isinstance(qs[-1], int):
            raise UnsupportedOpError("a symbolic head size without an explicit scale")
        scale = 1.0 / math.sqrt(qs[-1])
    rank = len(ks)
    kt = b.one("Transpose", [k], dt, perm=list(range(rank - 2)) + [rank - 1, rank - 2])
    s = b.one("MatMul", [b.one("Mul", [q, b.const(scale, dt)], dt), kt], dt)
    if causal:
        lq, lk = qs[-2], ks[-2]
        if not (isinstance(lq, int) and isinstance(lk, int)):
            ones = b.one("Expand", [b.const(1, "bool"), b.ints([_sym(b, n.args[0], -2), _sym(b, n.args[1], -2)])],
                         "bool")
            keep = b.one("Trilu", [ones], "bool", upper=0)
        else:
            keep = b.const(np.tril(np.ones((lq, lk), bool)))
        mask = keep if mask is None else b.one("And", [keep, b.tensor(mask, "bool")], "bool")
    if mask is not None:
        if b.dtypes.get(mask) == "bool":
            s = b.one("Where", [mask, s, b.const(-np.inf, dt)], dt)
        else:
            s = b.one("Add", [s, b.tensor(mask, dt)], dt)
    p = b.one("Softmax", [s], dt, axis=-1)
    return b.one("MatMul", [p, v], dt)


@aten("_scaled_dot_product_flash_attention_for_cpu.default")
def _sdpa_cpu(b: Builder, n: Any, args: tuple, kw: dict) -> tuple:
    """The CPU attention kernel aot_autograd lowers ``scaled_dot_product_attention`` to: (query, key,
    value, dropout_p, is_causal; attn_mask, scale) -> (output, logsumexp), the second for the backward
    pass (not computed)."""
    q, k, v = args[:3]
    dropout = args[3] if len(args) > 3 else kw.get("dropout_p", 0.0)
    causal = args[4] if len(args) > 4 else kw.get("is_causal", False)
    return _sdpa(b, n, (q, k, v, kw.get("attn_mask"), dropout, causal), {"scale": kw.get("scale")}), None


@aten("mkldnn_rnn_layer.default")
def _rnn_layer(b: Builder, n: Any, args: tuple, kw: dict) -> tuple:
    """One LSTM layer as aot_autograd writes ``nn.LSTM`` on the CPU (under dynamo's ``allow_rnn``):
    (input [seq, batch, in], w_ih, w_hh, b_ih, b_hh, hx, cx, reverse, batch_sizes, mode, hidden_size,
    num_layers, has_biases, bidirectional, batch_first, train) -> (output, hy, cy, workspace), as one
    ONNX LSTM node (the graph compiler unrolls it as it does an imported LSTM).  torch's gates are
    (i, f, g, o), ONNX's (i, o, f, c): the constant weights are reordered here."""
    x, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse = args[:8]
    # one layer and direction per call (num_layers and bidirectional describe the whole module)
    mode, hidden, _layers, has_bias, _bidir, batch_first, train = args[9:16]
    if mode != 2 or batch_first or train or args[8]:
        raise UnsupportedOpError("only inference LSTM layers in time-major layout without packed sequences")
    weights = [w_ih, w_hh] + ([b_ih, b_hh] if has_bias else [])
    if any(w not in b.inits for w in weights):
        raise UnsupportedOpError("LSTM weights that are not constants (frozen parameters)")
    dt = _dt(n)

    def gates(w: str) -> np.ndarray:  # (i, f, g, o) -> (i, o, f, g) blocks of the rows
        i, f, g, o = np.split(b.inits[w], 4, axis=0)
        return np.concatenate([i, o, f, g], axis=0)

    bias = np.concatenate([gates(b_ih), gates(b_hh)]) if has_bias else np.zeros(8 * hidden, dt)
    axis0 = b.const([0], "int64")
    states = [b.one("Unsqueeze", [s, axis0], dt) if _rank(a) == 2 else s for s, a in ((hx, n.args[5]), (cx, n.args[6]))]
    ins = [x, b.const(gates(w_ih)[None]), b.const(gates(w_hh)[None]), b.const(bias[None]), "", *states]
    y, yh, yc = b.emit("LSTM", ins, dt, 3, hidden_size=int(hidden), direction="reverse" if reverse else "forward")
    y = b.one("Squeeze", [y, b.const([1], "int64")], dt)
    outs = [b.one("Squeeze", [s, axis0], dt) if len(m.shape) == 2 else s for s, m in zip((yh, yc), node_meta(n)[1:3])]
    return y, *outs, None


def _sym(b: Builder, a: Any, axis: int) -> Any:
    """Size ``axis`` of FX argument ``a``: an int, or a Sym read from the value's shape."""
    d = _shape(a)[axis]
    if isinstance(d, int):
        return d
    raise UnsupportedOpError(f"a symbolic size ({d}) here")


@aten("max_pool2d_with_indices.default", "max_pool2d.default", "max_pool1d.default", "max_pool3d_with_indices.default")
def _max_pool(b: Builder, n: Any, args: tuple, kw: dict) -> Any:
    x, kernel = args[0], list(args[1])
    k = len(kernel)
    stride = list(args[2]) if len(args) > 2 and args[2] else kernel
    padding = list(args[3]) if len(args) > 3 else [0]
    dilation = list(args[4]) if len(args) > 4 else [1]
    ceil = bool(args[5]) if len(args) > 5 else False
    stride, padding, dilation = (v * (k if len(v) == 1 else 1) for v in (stride, padding, dilation))
    out = b.one("MaxPool", [x], _dt(n), kernel_shape=kernel, strides=stride, pads=padding + padding,
                dilations=dilation, ceil_mode=int(ceil))
    return (out, None) if "with_indices" in str(n.target) else out


@aten("avg_pool2d.default", "avg_pool1d.default", "avg_pool3d.default")
def _avg_pool(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    x, kernel = args[0], list(args[1])
    k = len(kernel)
    stride = list(args[2]) if len(args) > 2 and args[2] else kernel
    padding = list(args[3]) if len(args) > 3 else [0]
    ceil = bool(args[4]) if len(args) > 4 else False
    include = bool(args[5]) if len(args) > 5 else True
    if len(args) > 6 and args[6] is not None:
        raise UnsupportedOpError("divisor_override")
    stride, padding = (v * (k if len(v) == 1 else 1) for v in (stride, padding))
    return b.one("AveragePool", [x], _dt(n), kernel_shape=kernel, strides=stride, pads=padding + padding,
                 ceil_mode=int(ceil), count_include_pad=int(include))


@aten("_adaptive_avg_pool2d.default", "adaptive_avg_pool2d.default")
def _adaptive_avg_pool(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    out = list(args[1])
    h, w = _shape(n.args[0])[-2:]
    if out == [1, 1]:
        return b.one("GlobalAveragePool", [args[0]], _dt(n))
    if isinstance(h, int) and isinstance(w, int) and h % out[0] == 0 and w % out[1] == 0:
        kern = [h // out[0], w // out[1]]
        return b.one("AveragePool", [args[0]], _dt(n), kernel_shape=kern, strides=kern)
    raise UnsupportedOpError(f"adaptive pooling of {h}x{w} to {out[0]}x{out[1]} (not a whole window)")


from cuvil.frontend import torch_shape_ops  # noqa: E402, F401  (part 2 of the table)
