"""The te user API: placeholder, compute, reductions and scalar helpers."""

from __future__ import annotations

import builtins
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cuvil import dtype as dt
from cuvil.errors import DTypeError, ShapeError
from cuvil.ir import expr as E
from cuvil.ir.expr import Expr, IterVar, Reduce, Var
from cuvil.ir.functor import structural_equal, walk
from cuvil.te.tensor import ComputeOp, PlaceholderOp, Tensor

_counter = [0]


def _fresh(prefix: str) -> str:
    _counter[0] += 1
    return f"{prefix}{_counter[0]}"


def var(name: str = "n", dtype: str = "int64") -> Var:
    """A size (or scalar) known only at run time."""
    dtype = dt.canonical(dtype)
    if not dt.is_int(dtype):
        raise DTypeError(f"te.var {name!r}: sizes must be integers, got {dtype}")
    return Var(dtype, name)


def _extent(value: Any, what: str) -> Expr:
    if isinstance(value, bool) or isinstance(value, float):
        raise ShapeError(f"{what}: extent {value!r} is not an integer")
    if isinstance(value, int):
        if value < 0:
            raise ShapeError(f"{what}: extent {value} is negative")
        return E.const(value, "int64")
    if isinstance(value, Expr):
        if not dt.is_int(value.dtype):
            raise ShapeError(f"{what}: extent {value} has dtype {value.dtype}, not an integer type")
        for n in walk(value):
            if isinstance(n, E.TensorRead):
                raise ShapeError(f"{what}: extent {value} reads a tensor; sizes must be ints or te.var")
        return value if value.dtype == "int64" else E.Cast("int64", value)
    if isinstance(value, np.integer):
        return _extent(int(value), what)
    raise ShapeError(f"{what}: extent {value!r} is not an int or a te.var expression")


def _shape(shape: Any, what: str) -> tuple[Expr, ...]:
    if isinstance(shape, (int, Expr)):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)):
        raise ShapeError(f"{what}: shape must be a tuple of ints or te.var expressions, got {shape!r}")
    return tuple(_extent(s, f"{what}, dimension {d}") for d, s in enumerate(shape))


def placeholder(shape: Any, dtype: str = "float32", name: str = "placeholder") -> Tensor:
    """An input tensor of the given shape and dtype."""
    dtype = dt.canonical(dtype)
    return PlaceholderOp(name, _shape(shape, f"placeholder {name}"), dtype).output(0)


def reduce_axis(dom: Any, name: str = "rv") -> IterVar:
    """A reduction axis over ``range(lo, hi)`` given as ``(lo, hi)``."""
    if not isinstance(dom, (tuple, list)) or len(dom) != 2:
        raise ShapeError(f"reduce_axis {name!r}: dom must be (min, max), got {dom!r}")
    lo = dom[0] if isinstance(dom[0], Expr) else _extent(dom[0], f"reduce_axis {name}")
    hi = dom[1]
    extent = E.as_expr(hi, "int64") - lo
    if isinstance(hi, int) and isinstance(dom[0], int):
        if hi < dom[0]:
            raise ShapeError(f"reduce_axis {name!r}: empty range {dom!r}")
        extent = E.const(hi - dom[0], "int64")
    return IterVar("int64", name, lo, extent, "reduce")


def compute(
    shape: Any,
    fcompute: Callable[..., Any],
    name: str = "compute",
    tag: str = "",
    attrs: dict | None = None,
) -> Tensor:
    """A tensor whose element ``[i, j, ...]`` is ``fcompute(i, j, ...)``.

    The lambda's argument names become the loop names; ``lambda *i:`` gets
    ``i0, i1, ...``.  A reduction (``te.sum`` ...) must be the whole body.
    """
    shp = _shape(shape, f"compute {name}")
    names = _arg_names(fcompute, len(shp), name)
    axis = tuple(IterVar("int64", n, E.const(0, "int64"), s, "data") for n, s in zip(names, shp))
    body = fcompute(*axis)
    if isinstance(body, (list, tuple)):
        if len(body) != 1:
            raise ShapeError(f"compute {name}: the function returned {len(body)} values; return one expression")
        body = body[0]
    if isinstance(body, Tensor):
        raise DTypeError(f"compute {name}: the function returned the tensor {body.name}; index it, e.g. T[i, j]")
    if not isinstance(body, Expr):
        body = E.const(body)
    _check_body(body, axis, name)
    return ComputeOp(name, axis, body, tag, attrs).output(0)


def _arg_names(f: Callable[..., Any], ndim: int, name: str) -> list[str]:
    try:
        params = list(inspect.signature(f).parameters.values())
    except (TypeError, ValueError):
        return [f"i{d}" for d in range(ndim)]
    if builtins.any(p.kind == p.VAR_POSITIONAL for p in params):
        fixed = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        star = next(p.name for p in params if p.kind == p.VAR_POSITIONAL)
        return fixed + [f"{star}{d}" for d in range(ndim - len(fixed))]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) != ndim:
        raise ShapeError(
            f"compute {name}: the shape has {ndim} dimension(s) but the function takes "
            f"{len(positional)} argument(s) ({', '.join(p.name for p in positional)})"
        )
    return [p.name for p in positional]


def _check_body(body: Expr, axis: tuple[IterVar, ...], name: str) -> None:
    own = {id(a) for a in axis}
    reduce_ids: set[int] = set()
    if isinstance(body, Reduce):
        reduce_ids = {id(a) for a in body.axis}
        inner: list[Expr] = [body.source] + ([body.where] if body.where is not None else [])
    else:
        inner = [body]
    for root in inner:
        for n in walk(root):
            if isinstance(n, Reduce):
                raise ShapeError(
                    f"compute {name}: a reduction must be the whole body of a compute; "
                    f"compute {n} in its own te.compute and read it"
                )
            if isinstance(n, IterVar) and id(n) not in own and id(n) not in reduce_ids:
                where = "a reduction axis not reduced over here" if n.kind == "reduce" else "an axis of another compute"
                raise ShapeError(f"compute {name}: {n.name} is {where}")


# ---------------------------------------------------------------------------
# reductions
# ---------------------------------------------------------------------------


def _axes(axis: Any, what: str) -> tuple[IterVar, ...]:
    if axis is None:
        raise ShapeError(f"{what}: give the reduction axis (axis=k or axis=[k1, k2])")
    if isinstance(axis, IterVar):
        axis = [axis]
    axes = tuple(axis)
    for a in axes:
        if not isinstance(a, IterVar) or a.kind != "reduce":
            raise ShapeError(f"{what}: {a} is not a reduction axis; make one with te.reduce_axis")
    if len({id(a) for a in axes}) != len(axes):
        raise ShapeError(f"{what}: an axis is repeated in {[a.name for a in axes]}")
    return axes


def _reduce(name: str, combine: Callable[[Expr, Expr], Any], identity: Callable[[str], Any],
            source: Any, axis: Any, where: Any = None) -> Reduce:
    source = E.as_expr(source)
    axes = _axes(axis, f"te.{name}")
    t = source.dtype
    lhs, rhs = Var(t, "acc"), Var(t, "x")
    combined = E.as_expr(combine(lhs, rhs), t)
    if combined.dtype != t:
        raise DTypeError(f"reducer {name}: the combiner returns {combined.dtype} for {t} inputs")
    ident = E.cast(E.as_expr(identity(t), t), t)
    if where is not None:
        where = E.as_expr(where)
        if where.dtype != "bool":
            raise DTypeError(f"te.{name}: where= must be a bool expression, got {where.dtype}")
    return Reduce(t, name, lhs, rhs, combined, ident, source, axes, where)


def sum(expr: Any, axis: Any = None, where: Any = None) -> Reduce:  # noqa: A001
    """Sum of ``expr`` over the reduction axis or axes."""
    if isinstance(expr, Expr) and expr.dtype == "bool":
        raise DTypeError("te.sum of a bool expression; cast it to an integer dtype first")
    return _reduce("sum", lambda a, b: a + b, lambda t: 0, expr, axis, where)


def _max_or_min(name: str, a: Any, b: Any, axis: Any, where: Any) -> Expr:
    is_reduce = axis is not None or isinstance(b, IterVar) and b.kind == "reduce" or (
        isinstance(b, (list, tuple)) and builtins.all(isinstance(x, IterVar) for x in b) and len(b) > 0
    )
    if is_reduce:
        ax = axis if axis is not None else b
        if name == "max":
            return _reduce("max", E.maximum, E.min_value, a, ax, where)
        return _reduce("min", E.minimum, E.max_value, a, ax, where)
    if b is None:
        raise ShapeError(f"te.{name} needs two expressions, or one and a reduction axis")
    return E.maximum(a, b) if name == "max" else E.minimum(a, b)


def max(a: Any, b: Any = None, axis: Any = None, where: Any = None) -> Expr:  # noqa: A001
    """``te.max(a, b)`` element-wise (NaN propagates), or ``te.max(x, axis=k)`` reduces."""
    return _max_or_min("max", a, b, axis, where)


def min(a: Any, b: Any = None, axis: Any = None, where: Any = None) -> Expr:  # noqa: A001
    """``te.min(a, b)`` element-wise (NaN propagates), or ``te.min(x, axis=k)`` reduces."""
    return _max_or_min("min", a, b, axis, where)


def comm_reducer(fcombine: Callable[[Expr, Expr], Any], fidentity: Callable[[str], Any],
                 name: str = "reduce") -> Callable[..., Reduce]:
    """Make a commutative reducer: ``r = comm_reducer(lambda x, y: x * y, lambda t: 1)``,
    then ``r(expr, axis=k)``."""

    def reducer(expr: Any, axis: Any = None, where: Any = None) -> Reduce:
        return _reduce(name, fcombine, fidentity, expr, axis, where)

    reducer.__name__ = name
    return reducer


# ---------------------------------------------------------------------------
# scalar helpers
# ---------------------------------------------------------------------------


def const(value: Any, dtype: str | None = None) -> E.Const:
    return E.const(value, dtype)


def cast(value: Any, dtype: str) -> Expr:
    return E.cast(value, dtype)


def if_then_else(cond: Any, t: Any, f: Any) -> Expr:
    """``t`` where ``cond`` holds, else ``f``; only the chosen side is evaluated."""
    return E.select(cond, t, f)


def all(*conds: Any) -> Expr:  # noqa: A001
    if len(conds) == 1 and isinstance(conds[0], (list, tuple)):
        conds = tuple(conds[0])
    if not conds:
        return E.const(True)
    out = E.as_expr(conds[0])
    for c in conds[1:]:
        out = E.binary("and", out, c)
    _bool(out, "te.all")
    return out


def any(*conds: Any) -> Expr:  # noqa: A001
    if len(conds) == 1 and isinstance(conds[0], (list, tuple)):
        conds = tuple(conds[0])
    if not conds:
        return E.const(False)
    out = E.as_expr(conds[0])
    for c in conds[1:]:
        out = E.binary("or", out, c)
    _bool(out, "te.any")
    return out


def _bool(e: Expr, what: str) -> None:
    if e.dtype != "bool":
        raise DTypeError(f"{what} needs bool conditions, got {e.dtype} ({e})")


def _math(name: str) -> Callable[[Any], Expr]:
    def f(x: Any) -> Expr:
        return E.call(name, x)

    f.__name__ = name
    f.__doc__ = f"Element-wise {name}."
    return f


exp = _math("exp")
log = _math("log")
sqrt = _math("sqrt")
rsqrt = _math("rsqrt")
tanh = _math("tanh")
sigmoid = _math("sigmoid")
erf = _math("erf")
abs = _math("abs")  # noqa: A001
floor = _math("floor")
ceil = _math("ceil")
round = _math("round")  # noqa: A001
trunc = _math("trunc")
isnan = _math("isnan")
sin = _math("sin")
cos = _math("cos")
tan = _math("tan")
asin = _math("asin")
acos = _math("acos")
atan = _math("atan")
sinh = _math("sinh")
cosh = _math("cosh")
asinh = _math("asinh")
acosh = _math("acosh")
atanh = _math("atanh")


def fmod(a: Any, b: Any) -> Expr:
    """C's ``fmod``: the float remainder of ``a / b`` with the sign of ``a`` (``%`` has ``b``'s)."""
    return E.call("fmod", a, b)


def power(a: Any, b: Any) -> Expr:
    return E.power(a, b)


pow = power  # noqa: A001


def scan(init: Tensor, update: Tensor, state_placeholder: Tensor, inputs: Any = None,
         name: str = "scan") -> Tensor:
    """A recurrence over the first axis, as in TVM: ``out[t] = init[t]`` for ``t < init.shape[0]``,
    else ``update[t]``, where ``update`` reads earlier steps through ``state_placeholder``::

        X = te.placeholder((T, n)); s = te.placeholder((T, n))
        init = te.compute((1, n), lambda _, i: X[0, i])
        update = te.compute((T, n), lambda t, i: s[t - 1, i] + X[t, i])
        cumsum = te.scan(init, update, s, inputs=[X])

    ``s[init]`` and ``s[update]`` of a schedule are the loops inside one time step of each part
    (split, reorder, fuse, vectorize, unroll, parallel); the time axis stays the outermost loop.
    """
    from cuvil.ir.expr import TensorRead
    from cuvil.ir.functor import ExprMutator, substitute
    from cuvil.te.tensor import ScanOp

    for what, t in (("init", init), ("update", update)):
        if not isinstance(t, Tensor) or not isinstance(t.op, ComputeOp):
            raise ShapeError(f"te.scan {name}: {what} must be a te.compute tensor")
        if t.op.reduce_axis:
            raise ShapeError(f"te.scan {name}: {what} is a reduction; compute it in a stage the scan reads")
        if t.ndim != state_placeholder.ndim:
            raise ShapeError(f"te.scan {name}: {what} has {t.ndim} dimensions, the state has {state_placeholder.ndim}")
        if t.dtype != state_placeholder.dtype:
            raise DTypeError(f"te.scan {name}: {what} is {t.dtype} but the state is {state_placeholder.dtype}")
    if not isinstance(state_placeholder.op, PlaceholderOp):
        raise ShapeError(f"te.scan {name}: the state must be a te.placeholder")
    for d in range(1, update.ndim):
        for what, t in (("init", init), ("update", update)):
            if not structural_equal(t.shape[d], state_placeholder.shape[d]):
                raise ShapeError(f"te.scan {name}: {what} dimension {d} is {t.shape[d]}, the state's is "
                                 f"{state_placeholder.shape[d]}")
    axis = tuple(IterVar("int64", a.name, E.const(0, "int64"), ext, "data")
                 for a, ext in zip(update.op.axis, state_placeholder.shape))
    op = ScanOp(name, axis, init.shape[0], E.const(0, update.dtype), E.const(0, update.dtype),
                parts=(init.op, update.op))
    out = op.output(0)

    class _State(ExprMutator):
        def visit_TensorRead(self, e: TensorRead) -> Expr:
            idx = tuple(self.visit(i) for i in e.indices)
            return TensorRead(e.dtype, out if e.tensor is state_placeholder else e.tensor, idx)

    op.init_body = _State().visit(substitute(init.op.body, dict(zip(init.op.axis, axis))))
    op.update_body = _State().visit(substitute(update.op.body, dict(zip(update.op.axis, axis))))
    return out


def scatter(data: Tensor, shape: Any, index: Callable[..., Any], value: Callable[..., Any],
            combine: Callable[[Expr, Expr], Expr] | None = None, name: str = "scatter") -> Tensor:
    """A copy of ``data`` updated in place at data-dependent positions: for every point ``u`` of
    ``shape``, in row-major order, ``out[index(*u)] = combine(out[index(*u)], value(*u))`` (without
    ``combine``, a plain store: the last update to a position wins).  The loop nest::

        for (i0, i1) out[i0, i1] = data[i0, i1]
        for (e, f)   out[idx[e], f] = out[idx[e], f] + upd[e, f]

    from (``index_add`` along axis 0)::

        out = te.scatter(X, (E, F), lambda e, f: (idx[e], f), lambda e, f: upd[e, f],
                         lambda old, new: old + new)

    The work is linear in the updates.  An index read from memory is checked when the kernel runs.
    """
    from cuvil.ir.expr import TensorRead
    from cuvil.te.tensor import ScatterOp

    if not isinstance(data, Tensor):
        raise ShapeError(f"te.scatter {name}: data must be a te tensor, got {type(data).__name__}")
    shp = _shape(shape, f"te.scatter {name}")
    unames = _arg_names(index, len(shp), name)
    update_axis = tuple(IterVar("int64", n, E.const(0, "int64"), s, "data") for n, s in zip(unames, shp))
    onames, taken = [], set(unames)
    for d in range(data.ndim):
        n = f"i{d}"
        while n in taken:
            n += "_"
        onames.append(n)
    axis = tuple(IterVar("int64", n, E.const(0, "int64"), s, "data") for n, s in zip(onames, data.shape))
    idx = index(*update_axis)
    idx = tuple(idx) if isinstance(idx, (tuple, list)) else (idx,)
    if len(idx) != data.ndim:
        raise ShapeError(f"te.scatter {name}: index gives {len(idx)} indices for data of rank {data.ndim}")
    idx = tuple(E.as_expr(i, "int64") for i in idx)
    new = value(*update_axis)
    new = new if isinstance(new, Expr) else E.const(new, data.dtype)
    if new.dtype != data.dtype:
        raise DTypeError(f"te.scatter {name}: the updates are {new.dtype} but data is {data.dtype}")
    for root in (*idx, new):
        _check_body(root, update_axis, f"te.scatter {name}")
    op = ScatterOp(name, axis, data[axis], update_axis, idx)
    if combine is not None:
        new = combine(TensorRead(data.dtype, op.output(0), idx), new)
        if not isinstance(new, Expr) or new.dtype != data.dtype:
            raise DTypeError(f"te.scatter {name}: combine must give a {data.dtype} expression")
    op.value = new
    return op.output(0)


def create_schedule(outputs: Tensor | Any | Sequence[Any]) -> Any:
    """A default schedule of ``outputs`` (a Tensor, its op, or a list)."""
    from cuvil.schedule import Schedule

    return Schedule(outputs)
