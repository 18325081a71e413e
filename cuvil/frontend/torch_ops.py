"""The ATen -> graph IR table: one translation per ATen overload (``"aten::add.Tensor"``), each writing
nodes of the graph IR's operators (ONNX's, opset 18) through a :class:`~cuvil.frontend.torch.Builder`.

A translation is ``f(b, node, args, kwargs) -> value``: ``node`` is the FX node (its ``meta["val"]``
gives the result's dtype and shape), ``args`` / ``kwargs`` its arguments with every FX node replaced by
its value: a graph value's name (str), a :class:`~cuvil.frontend.torch.Sym` (a symbolic size), a
Python number, or a list / tuple of those.  It returns the node's value (a tuple for several results).
Type promotion follows torch: an element-wise node's inputs are cast to the dtype torch computes in.

This part holds the table, its helpers and the element-wise, comparison, symbolic-size and reduction
translations; :mod:`cuvil.frontend.torch_shape_ops` (data movement, indexing, creation) and
:mod:`cuvil.frontend.torch_nn_ops` (normalisation, linear algebra, attention, recurrent layers,
pooling) add theirs when this module is imported.
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


from cuvil.frontend import torch_nn_ops, torch_shape_ops  # noqa: E402, F401  (parts 2 and 3 of the table)
