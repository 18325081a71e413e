"""The scalar expression IR shared by te bodies, index expressions and loop IR.

Nodes are small frozen dataclasses.  Python operators build new nodes
(``a + b``, ``a < b``, ``a == b``); ``bool()`` of an expression raises, and
structural comparison is :func:`cuvil.ir.functor.structural_equal`.  Hashing is
by identity, so variables can key substitution maps.

dtype rules (DESIGN.md): a Python scalar takes the other operand's dtype; two
expressions must have the same dtype, except in index arithmetic: integers of
different widths widen to the wider type when one side reads no tensor
(``i + idx[t]``); ``/`` is true division for floats; ``//`` and ``%`` floor
like Python and numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from cuvil import dtype as dt
from cuvil.errors import DTypeError

ARITH_OPS = ("add", "sub", "mul", "div", "floordiv", "floormod", "min", "max")
BIT_OPS = ("and", "or", "xor")
CMP_OPS = ("eq", "ne", "lt", "le", "gt", "ge")
SYMBOLS = {
    "add": "+", "sub": "-", "mul": "*", "div": "/", "floordiv": "//", "floormod": "%",
    "and": "&", "or": "|", "xor": "^",
    "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
}
# math functions: name -> number of arguments
MATH_FUNCS = {
    "exp": 1, "log": 1, "sqrt": 1, "rsqrt": 1, "tanh": 1, "sigmoid": 1, "erf": 1,
    "abs": 1, "floor": 1, "ceil": 1, "round": 1, "trunc": 1, "isnan": 1, "pow": 2,
    # C's fmod (the remainder with the dividend's sign), and the trigonometric and hyperbolic functions
    "fmod": 2, "sin": 1, "cos": 1, "tan": 1, "asin": 1, "acos": 1, "atan": 1,
    "sinh": 1, "cosh": 1, "asinh": 1, "acosh": 1, "atanh": 1,
}


@dataclass(frozen=True, eq=False, slots=True, repr=False)
class Expr:
    """Base class of scalar expressions; ``dtype`` is a cuvil dtype name."""

    dtype: str

    # -- arithmetic ---------------------------------------------------------
    def __add__(self, o: Any) -> Expr: return binary("add", self, o)
    def __radd__(self, o: Any) -> Expr: return binary("add", o, self)
    def __sub__(self, o: Any) -> Expr: return binary("sub", self, o)
    def __rsub__(self, o: Any) -> Expr: return binary("sub", o, self)
    def __mul__(self, o: Any) -> Expr: return binary("mul", self, o)
    def __rmul__(self, o: Any) -> Expr: return binary("mul", o, self)
    def __truediv__(self, o: Any) -> Expr: return binary("div", self, o)
    def __rtruediv__(self, o: Any) -> Expr: return binary("div", o, self)
    def __floordiv__(self, o: Any) -> Expr: return binary("floordiv", self, o)
    def __rfloordiv__(self, o: Any) -> Expr: return binary("floordiv", o, self)
    def __mod__(self, o: Any) -> Expr: return binary("floormod", self, o)
    def __rmod__(self, o: Any) -> Expr: return binary("floormod", o, self)
    def __pow__(self, o: Any) -> Expr: return power(self, o)
    def __rpow__(self, o: Any) -> Expr: return power(o, self)
    def __neg__(self) -> Expr: return unary("neg", self)
    def __pos__(self) -> Expr: return self
    def __abs__(self) -> Expr: return call("abs", self)

    # -- logic and bits -----------------------------------------------------
    def __and__(self, o: Any) -> Expr: return binary("and", self, o)
    def __rand__(self, o: Any) -> Expr: return binary("and", o, self)
    def __or__(self, o: Any) -> Expr: return binary("or", self, o)
    def __ror__(self, o: Any) -> Expr: return binary("or", o, self)
    def __xor__(self, o: Any) -> Expr: return binary("xor", self, o)
    def __rxor__(self, o: Any) -> Expr: return binary("xor", o, self)
    def __invert__(self) -> Expr: return unary("not", self)

    # -- comparisons build expressions -------------------------------------
    def __eq__(self, o: Any) -> Expr: return binary("eq", self, o)  # type: ignore[override]
    def __ne__(self, o: Any) -> Expr: return binary("ne", self, o)  # type: ignore[override]
    def __lt__(self, o: Any) -> Expr: return binary("lt", self, o)
    def __le__(self, o: Any) -> Expr: return binary("le", self, o)
    def __gt__(self, o: Any) -> Expr: return binary("gt", self, o)
    def __ge__(self, o: Any) -> Expr: return binary("ge", self, o)

    __hash__ = object.__hash__

    def __bool__(self) -> bool:
        raise DTypeError(
            "the truth value of a cuvil expression is unknown at trace time; use "
            "te.if_then_else, te.all, te.any, &, | or ~ instead of if/and/or/not, "
            "and te.structural_equal to compare expressions"
        )

    def astype(self, dtype: str) -> Expr:
        return cast(self, dtype)

    def __str__(self) -> str:
        from cuvil.ir.printer import expr_str

        return expr_str(self)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self}: {self.dtype}>"


@dataclass(frozen=True, eq=False, slots=True, repr=False)
class Const(Expr):
    value: int | float | bool


@dataclass(frozen=True, eq=False, slots=True, repr=False)
class Var(Expr):
    """A scalar variable: a loop iterator or a size known only at run time."""

    name: str


@dataclass(frozen=True, eq=False, slots=True, repr=False)
class IterVar(Var):
    """A te iteration axis: a variable with the range ``[min, min + extent)``.

    ``kind`` is "data" for the axes of a compute and "reduce" for reduction
    axes made with ``te.reduce_axis``.
    """

    min: Expr
    extent: Expr
    kind: str

    @property
    def var(self) -> IterVar:  # TVM spelling: axis.var
        return self

    @property
    def dom(self) -> tuple[Expr, Expr]:
        return (self.min, self.extent)


@dataclass(frozen=True, eq=False, slots=True, repr=False)
class Cast(Expr):
    value: Expr


@dataclass(frozen=True, eq=False, slots=True, repr=False)
class Binary(Expr):
    op: str
    a: Expr
    b: Expr


@dataclass(frozen=True, eq=False, slots=True, repr=False)
class Unary(Expr):
    op: str  # "neg" or "not" (logical for bool, bitwise for integers)
    a: Expr


@dataclass(frozen=True, eq=False, slots=True, repr=False)
class Call(Expr):
    name: str
    args: tuple[Expr, ...]


@dataclass(frozen=True, eq=False, slots=True, repr=False)
class Select(Expr):
    """``cond ? t : f``; only the chosen side is evaluated (it may read out of bounds)."""

    cond: Expr
    t: Expr
    f: Expr


@dataclass(frozen=True, eq=False, slots=True, repr=False)
class TensorRead(Expr):
    """``tensor[indices]`` in a te body; lowering turns it into a :class:`Load`."""

    tensor: Any  # cuvil.te.Tensor (kept untyped: te sits above ir)
    indices: tuple[Expr, ...]


@dataclass(frozen=True, eq=False, slots=True, repr=False)
class Load(Expr):
    """``buffer[indices]`` in loop IR (row-major, one index per dimension)."""

    buffer: Any  # cuvil.ir.stmt.Buffer
    indices: tuple[Expr, ...]


@dataclass(frozen=True, eq=False, slots=True, repr=False)
class Reduce(Expr):
    """A commutative reduction of ``source`` over ``axis``.

    ``combined`` is the combiner written over the two variables ``lhs`` (the
    accumulator) and ``rhs`` (the new value); ``identity`` starts the
    accumulator; only points where ``where`` holds contribute.
    """

    name: str
    lhs: Var
    rhs: Var
    combined: Expr
    identity: Expr
    source: Expr
    axis: tuple[IterVar, ...]
    where: Expr | None


# ---------------------------------------------------------------------------
# constructors with dtype checking
# ---------------------------------------------------------------------------


def const(value: Any, dtype: str | None = None) -> Const:
    """A constant; without a dtype an int is int32, a float float32, a bool bool."""
    if isinstance(value, Const):
        value = value.value
    if dtype is None:
        if isinstance(value, bool):
            dtype = "bool"
        elif isinstance(value, int):
            dtype = "int32"
        elif isinstance(value, float):
            dtype = "float32"
        else:
            raise DTypeError(f"te.const needs a Python bool, int or float, got {type(value).__name__}")
    dtype = dt.canonical(dtype)
    if dt.is_bool(dtype):
        value = bool(value)
    elif dt.is_int(dtype):
        if isinstance(value, float) and not value.is_integer():
            raise DTypeError(f"constant {value!r} is not an integer and cannot have dtype {dtype}")
        value = _wrap_int(int(value), dtype)
    else:
        value = float(value)
    return Const(dtype, value)


def _wrap_int(v: int, dtype: str) -> int:
    b = dt.bits(dtype)
    v &= (1 << b) - 1
    if dt.is_signed(dtype) and v >= 1 << (b - 1):
        v -= 1 << b
    return v


def as_expr(value: Any, like: str | None = None) -> Expr:
    """Turn ``value`` into an expression; Python scalars take dtype ``like``."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, (bool, int, float)) and not isinstance(value, Expr):
        if like is None:
            if isinstance(value, int) and not isinstance(value, bool):
                return const(value, "int64")
            return const(value)
        if isinstance(value, float) and not dt.is_float(like):
            if dt.is_int(like) and value.is_integer():
                return const(value, like)
            raise DTypeError(
                f"the Python float {value!r} cannot take the dtype {like} of the other operand; "
                "cast the expression with te.cast(x, 'float32') first"
            )
        if dt.is_bool(like) and not isinstance(value, bool) and value not in (0, 1):
            raise DTypeError(f"the Python number {value!r} cannot be a bool")
        return const(value, like)
    import numpy as np

    if isinstance(value, np.generic):
        return const(value.item(), value.dtype.name)
    raise DTypeError(f"cannot use a {type(value).__name__} ({value!r}) in a cuvil expression")


def reads_tensor(e: Expr) -> bool:
    """True if ``e`` reads a tensor or buffer anywhere."""
    from cuvil.ir.functor import collect

    return bool(collect(e, lambda n: isinstance(n, (TensorRead, Load))))


def _unify(op: str, a: Any, b: Any) -> tuple[Expr, Expr]:
    if not isinstance(a, Expr) and not isinstance(b, Expr):
        a = as_expr(a)
        b = as_expr(b)
    elif not isinstance(a, Expr):
        a = as_expr(a, b.dtype)
    elif not isinstance(b, Expr):
        b = as_expr(b, a.dtype)
    if a.dtype == b.dtype:
        return a, b
    if dt.is_int(a.dtype) and dt.is_int(b.dtype):
        # index arithmetic: an integer expression that reads no tensor widens
        wide = a.dtype if dt.bits(a.dtype) >= dt.bits(b.dtype) else b.dtype
        if not reads_tensor(a) or not reads_tensor(b):
            return (a if a.dtype == wide else Cast(wide, a)), (b if b.dtype == wide else Cast(wide, b))
    raise DTypeError(
        f"dtypes do not match in '{SYMBOLS.get(op, op)}': {a.dtype} ({a}) and {b.dtype} ({b}); "
        f"cuvil never mixes dtypes silently: use te.cast(x, '{a.dtype}') or x.astype(...)"
    )


def binary(op: str, a: Any, b: Any) -> Expr:
    a, b = _unify(op, a, b)
    t = a.dtype
    if op in CMP_OPS:
        return Binary("bool", op, a, b)
    if op in BIT_OPS:
        if dt.is_float(t):
            raise DTypeError(f"'{SYMBOLS[op]}' needs bool or integer operands, got {t} ({a}, {b})")
        return Binary(t, op, a, b)
    if dt.is_bool(t) and op not in ("min", "max"):
        raise DTypeError(f"arithmetic '{SYMBOLS.get(op, op)}' on bool values ({a}, {b}); cast them first")
    if op == "div" and not dt.is_float(t):
        raise DTypeError(
            f"'/' is true division and needs float operands, got {t} ({a} / {b}); "
            "use // for floor division of integers, or cast to a float dtype"
        )
    return Binary(t, op, a, b)


def unary(op: str, a: Any) -> Expr:
    a = as_expr(a)
    if op == "neg":
        if dt.is_bool(a.dtype):
            raise DTypeError(f"cannot negate the bool expression {a}; use ~")
        return Unary(a.dtype, "neg", a)
    if op == "not":
        if dt.is_float(a.dtype):
            raise DTypeError(f"'~' needs a bool or integer operand, got {a.dtype} ({a})")
        return Unary(a.dtype, "not", a)
    raise ValueError(op)


def cast(value: Any, dtype: str) -> Expr:
    dtype = dt.canonical(dtype)
    value = as_expr(value)
    if value.dtype == dtype:
        return value
    if isinstance(value, Const):
        v = value.value
        if dt.is_bool(dtype):
            return const(bool(v), dtype)
        if dt.is_int(dtype):
            if isinstance(v, float) and not math.isfinite(v):
                return Cast(dtype, value)
            return const(int(v), dtype)
        return const(float(v), dtype)
    return Cast(dtype, value)


def call(name: str, *args: Any) -> Expr:
    if name not in MATH_FUNCS:
        raise DTypeError(f"unknown math function {name!r}")
    if len(args) != MATH_FUNCS[name]:
        raise DTypeError(f"{name} takes {MATH_FUNCS[name]} argument(s), got {len(args)}")
    if name == "pow":
        return power(*args)
    if name == "fmod":
        a, b = _unify("fmod", *args)
        if not dt.is_float(a.dtype):
            raise DTypeError(f"fmod needs float operands, got {a.dtype}; integer % floors, as Python's")
        return Call(a.dtype, "fmod", (a, b))
    a = as_expr(args[0])
    t = a.dtype
    if name == "isnan":
        if not dt.is_float(t):
            raise DTypeError(f"isnan needs a float operand, got {t} ({a})")
        return Call("bool", name, (a,))
    if name == "abs":
        if dt.is_bool(t) or (dt.is_int(t) and not dt.is_signed(t)):
            return a
        if dt.is_int(t):
            return Select(t, binary("lt", a, 0), unary("neg", a), a)
        return Call(t, name, (a,))
    if name in ("floor", "ceil", "round", "trunc") and dt.is_int(t):
        return a
    if not dt.is_float(t):
        raise DTypeError(f"{name} needs a float operand, got {t} ({a}); cast it with te.cast(x, 'float32')")
    return Call(t, name, (a,))


def power(a: Any, b: Any) -> Expr:
    if isinstance(b, int) and not isinstance(b, bool) and isinstance(a, Expr) and dt.is_int(a.dtype):
        if b < 0:
            raise DTypeError(f"integer {a} to a negative power {b}; cast to float first")
        return _int_power(a, b)
    a, b = _unify("pow", a, b)
    if not dt.is_float(a.dtype):
        raise DTypeError(
            f"pow of {a.dtype} values needs a constant non-negative integer exponent, got {b}; "
            "cast to a float dtype for a general power"
        )
    return Call(a.dtype, "pow", (a, b))


def _int_power(a: Expr, n: int) -> Expr:
    result: Expr = const(1, a.dtype)
    base = a
    while n:
        if n & 1:
            result = base if (isinstance(result, Const) and result.value == 1) else result * base
        n >>= 1
        if n:
            base = base * base
    return result


def select(cond: Any, t: Any, f: Any) -> Expr:
    cond = as_expr(cond)
    if not dt.is_bool(cond.dtype):
        raise DTypeError(f"the condition of if_then_else must be bool, got {cond.dtype} ({cond})")
    t, f = _unify("if_then_else", t, f)
    return Select(t.dtype, cond, t, f)


def minimum(a: Any, b: Any) -> Expr:
    return binary("min", a, b)


def maximum(a: Any, b: Any) -> Expr:
    return binary("max", a, b)


def max_value(dtype: str) -> Const:
    if dt.is_float(dtype):
        return const(math.inf, dtype)
    if dt.is_bool(dtype):
        return const(True, dtype)
    import numpy as np

    return const(int(np.iinfo(dtype).max), dtype)


def min_value(dtype: str) -> Const:
    if dt.is_float(dtype):
        return const(-math.inf, dtype)
    if dt.is_bool(dtype):
        return const(False, dtype)
    import numpy as np

    return const(int(np.iinfo(dtype).min), dtype)


# ---------------------------------------------------------------------------
# packed 8-bit dot products
# ---------------------------------------------------------------------------

DOT4 = "dot4_u8s8"
# the dot4 calls: name -> (first operand's bytes signed, second operand's bytes signed)
DOT4_KINDS = {"dot4_u8s8": (False, True), "dot4_u8u8": (False, False), "dot4_s8s8": (True, True)}


def dot4(u: Expr, s: Expr, signs: str = "us") -> Call:
    """The int32 sum of the four products of bytes ``u.byte[t] * s.byte[t]`` (t = 0..3, byte 0 the least
    significant) of two int32 values that each hold four 8-bit integers, unsigned or signed as ``signs``
    says ("us": unsigned ``u``, signed ``s``; "uu"; "ss"). Exact (at most 4 * 255 * 255 in magnitude).

    An integer contraction packs four reduction steps per int32 and sums ``dot4`` over them, because
    LLVM does not find the dot-product instructions in the byte-wise loop: the LLVM code generator emits
    one lane of x86's ``vpdpbusd`` ("us", VNNI) or AArch64's ``udot`` / ``sdot`` ("uu" / "ss", +dotprod)
    and ``usdot`` ("us", +i8mm) for it in a vector loop; elsewhere it is the byte arithmetic."""
    u, s = as_expr(u), as_expr(s)
    name = f"dot4_{signs[:1]}8{signs[1:]}8"
    if name not in DOT4_KINDS:
        raise DTypeError(f"dot4's signs are 'us', 'uu' or 'ss', got {signs!r}")
    if u.dtype != "int32" or s.dtype != "int32":
        raise DTypeError(f"dot4 takes two int32 values of four packed bytes, got {u.dtype} and {s.dtype}")
    return Call("int32", name, (u, s))


DOT2_I16 = "dot2_i16"


def dot2_i16(u: Expr, s: Expr) -> Call:
    """The int32 sum of the two products ``u.half[t] * s.half[t]`` (t = 0, 1; half 0 the low 16 bits) of
    two int32 values that each hold two signed 16-bit integers.  Exact for 8-bit operands widened to 16
    bits (at most 2 * 255 * 128 in magnitude: an integer contraction on a CPU without an 8-bit dot
    product packs two reduction steps per int32 and sums ``dot2_i16`` over them).

    The LLVM code generator emits one lane of x86's ``vpmaddwd`` (SSE2 / AVX2 / AVX512-BW) for it in a
    vector loop, which multiplies 16-bit pairs and adds them in 32 bits, never saturating (unlike the
    8-bit ``vpmaddubsw``, whose 16-bit pair sums clamp); elsewhere it is the 32-bit arithmetic."""
    u, s = as_expr(u), as_expr(s)
    if u.dtype != "int32" or s.dtype != "int32":
        raise DTypeError(f"dot2_i16 takes two int32 values of two packed int16, got {u.dtype} and {s.dtype}")
    return Call("int32", DOT2_I16, (u, s))


# ---------------------------------------------------------------------------
# packed bf16 dot products
# ---------------------------------------------------------------------------

DOT2_BF16 = "dot2_bf16"
BF16_PAIR = "bf16_pair"
# every packed dot-product call a contraction may sum (:mod:`cuvil.schedule.contraction`)
DOT_CALLS = frozenset(DOT4_KINDS) | {DOT2_BF16, DOT2_I16}


def dot2_bf16(u: Expr, s: Expr) -> Call:
    """The float32 sum of the two products ``u.half[t] * s.half[t]`` (t = 0, 1; half 0 the low 16 bits)
    of two int32 values that each hold two bfloat16 numbers (see :func:`bf16_pair`).  Each product of
    two bf16 is exact in float32 (8 + 8 significant bits); the two additions round.

    A bf16 contraction (:mod:`cuvil.graph.ops.nn.bf16`) packs two reduction steps per int32 and sums
    ``dot2_bf16`` over them: the LLVM code generator emits one float32 lane of x86's ``vdpbf16ps``
    (AVX512-BF16) for ``acc + dot2_bf16(u, s)`` in a vector loop; elsewhere it is float32 arithmetic on
    the widened halves (the same result up to the order of the two roundings)."""
    u, s = as_expr(u), as_expr(s)
    if u.dtype != "int32" or s.dtype != "int32":
        raise DTypeError(f"dot2_bf16 takes two int32 values of two packed bfloat16, got {u.dtype} and {s.dtype}")
    return Call("float32", DOT2_BF16, (u, s))


def bf16_pair(lo: Expr, hi: Expr) -> Call:
    """The int32 whose low 16 bits are ``lo`` and high 16 bits ``hi``, both float32 rounded to bfloat16
    (round to nearest, ties to even, as x86's ``vcvtne2ps2bf16``; a NaN stays a quiet NaN): the operand
    of :func:`dot2_bf16` for two consecutive reduction steps of an activation."""
    lo, hi = as_expr(lo), as_expr(hi)
    if lo.dtype != "float32" or hi.dtype != "float32":
        raise DTypeError(f"bf16_pair rounds two float32 values, got {lo.dtype} and {hi.dtype}")
    return Call("int32", BF16_PAIR, (lo, hi))


# ---------------------------------------------------------------------------
# bounds checks
# ---------------------------------------------------------------------------

INDEX_CHECK = "index_check"


def index_check(value: Expr, extent: Expr, wrap: bool = False, tag: int = -1, site: int = 0) -> Call:
    """``value`` (as int64), which must lie in ``[0, extent)``; with ``wrap``, in ``[-extent, extent)``,
    a negative value counting from the end (ONNX's indices), and the result is then in ``[0, extent)``.

    A value outside stops the kernel with a bounds error (status 4) instead of reading or writing out
    of bounds; ``site`` numbers the check in its function (set by ``cuvil.ir.checks``), ``tag`` is the
    caller's (the graph compiler's fused member).  Loop IR spells it ``Call("index_check", (value,
    extent, wrap, tag, site))``, so every pass treats it as an opaque integer function.
    """
    value = as_expr(value, "int64")
    if not dt.is_int(value.dtype):
        raise DTypeError(f"an index must be an integer, got {value.dtype} ({value})")
    if value.dtype != "int64":
        value = Cast("int64", value)
    extent = as_expr(extent, "int64")
    if extent.dtype != "int64":
        extent = Cast("int64", extent)
    return Call("int64", INDEX_CHECK, (value, extent, Const("bool", bool(wrap)), Const("int64", int(tag)),
                                       Const("int64", int(site))))


def index_check_parts(e: Expr) -> tuple[Expr, Expr, bool, int, int] | None:
    """``(value, extent, wrap, tag, site)`` of an :func:`index_check` call, None for anything else."""
    if not (isinstance(e, Call) and e.name == INDEX_CHECK):
        return None
    v, n, wrap, tag, site = e.args
    return v, n, bool(wrap.value), int(tag.value), int(site.value)  # type: ignore[attr-defined]
