"""cuvil scalar expressions -> CUDA C expressions, and the device prelude they call.

The semantics are the LLVM back end's (see cuvil.codegen.llvm_expr): integer
``//`` and ``%`` floor like Python (and give 0 for a zero divisor), float
``min``/``max`` propagate NaN like numpy, ``!=`` on floats is unordered,
float16 is a storage type computed in float32, bool is stored as one byte.
Helpers that would repeat an operand (max, floordiv) are inline functions of
the prelude, so nested expressions never grow exponentially.

The prelude also compiles as plain C++ (the CPU emulation in the tests defines
``CUVIL_EMULATE``): only the float16 conversions differ.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from cuvil import dtype as dt
from cuvil.codegen.llvm_expr import InternalError
from cuvil.ir.expr import INDEX_CHECK, Binary, Call, Cast, Const, Expr, Load, Select, Unary, Var

C_TYPES = {
    "bool": "bool", "int8": "signed char", "int16": "short", "int32": "int", "int64": "long long",
    "uint8": "unsigned char", "uint16": "unsigned short", "uint32": "unsigned int", "uint64": "unsigned long long",
    "float16": "float", "float32": "float", "float64": "double",
}
MEM_TYPES = {**C_TYPES, "bool": "unsigned char", "float16": "unsigned short"}

PRELUDE = r"""
#define CUVIL_DEV static __device__ __forceinline__
template <typename T> CUVIL_DEV T cuvil_min(T a, T b) { return a < b ? a : b; }
template <typename T> CUVIL_DEV T cuvil_max(T a, T b) { return a > b ? a : b; }
CUVIL_DEV float cuvil_fmin(float a, float b) { return (a <= b || a != a) ? a : b; }
CUVIL_DEV float cuvil_fmax(float a, float b) { return (a >= b || a != a) ? a : b; }
CUVIL_DEV double cuvil_fmin(double a, double b) { return (a <= b || a != a) ? a : b; }
CUVIL_DEV double cuvil_fmax(double a, double b) { return (a >= b || a != a) ? a : b; }
/* Python's floor division and modulo; a zero divisor gives 0, x // -1 wraps like numpy */
template <typename T> CUVIL_DEV T cuvil_sfloordiv(T a, T d) {
  if (d == 0) return 0;
  if (d == -1) return (T)(0 - (unsigned long long)a);
  T q = a / d, r = a % d;
  return (r != 0 && ((r ^ d) < 0)) ? q - 1 : q;
}
template <typename T> CUVIL_DEV T cuvil_sfloormod(T a, T d) {
  if (d == 0 || d == -1) return 0;
  T r = a % d;
  return (r != 0 && ((r ^ d) < 0)) ? r + d : r;
}
template <typename T> CUVIL_DEV T cuvil_ufloordiv(T a, T d) { return d == 0 ? 0 : a / d; }
template <typename T> CUVIL_DEV T cuvil_ufloormod(T a, T d) { return d == 0 ? 0 : a % d; }
template <typename T> CUVIL_DEV T cuvil_ffloormod(T a, T d) {
  T m = fmod(a, d);
  if (d == 0) return m;
  if (m != 0) return ((d < 0) != (m < 0)) ? m + d : m;
  return copysign((T)0, d);
}
template <typename T> CUVIL_DEV T cuvil_ffloordiv(T a, T d) {
  if (d == 0) return a / d;
  T m = fmod(a, d);
  T q = (a - m) / d;
  if (m != 0 && ((d < 0) != (m < 0))) q -= 1;
  T f = floor(q);
  if (q - f > (T)0.5) f += 1;
  return q == 0 ? copysign((T)0, a / d) : f;
}
template <typename T> CUVIL_DEV T cuvil_sigmoid(T x) { return (T)1 / ((T)1 + exp(-x)); }
CUVIL_DEV unsigned long long cuvil_f2u64(double x) {
  return x < 0 ? (unsigned long long)(long long)x : (unsigned long long)x;
}
#ifdef CUVIL_EMULATE
CUVIL_DEV float cuvil_h2f(unsigned short h) { _Float16 v; memcpy(&v, &h, 2); return (float)v; }
CUVIL_DEV unsigned short cuvil_f2h(float f) { _Float16 v = (_Float16)f; unsigned short h; memcpy(&h, &v, 2);
  return h; }
CUVIL_DEV unsigned short cuvil_d2h(double f) { _Float16 v = (_Float16)f; unsigned short h; memcpy(&h, &v, 2);
  return h; }
#else
CUVIL_DEV float cuvil_h2f(unsigned short h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
CUVIL_DEV unsigned short cuvil_f2h(float f) {
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
CUVIL_DEV unsigned short cuvil_d2h(double f) {
  unsigned short h; asm("cvt.rn.f16.f64 %0, %1;" : "=h"(h) : "d"(f)); return h;
}
#endif
"""

_CMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_ARITH = {"add": "+", "sub": "-", "mul": "*", "div": "/", "and": "&", "or": "|", "xor": "^"}
_MATH32 = {"exp": "expf", "log": "logf", "sqrt": "sqrtf", "tanh": "tanhf", "erf": "erff", "abs": "fabsf",
           "floor": "floorf", "ceil": "ceilf", "round": "rintf", "trunc": "truncf", "pow": "powf"}
_MATH64 = {"exp": "exp", "log": "log", "sqrt": "sqrt", "tanh": "tanh", "erf": "erf", "abs": "fabs",
           "floor": "floor", "ceil": "ceil", "round": "rint", "trunc": "trunc", "pow": "pow"}
_TRIG = ("fmod", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh")
_MATH32.update({f: f + "f" for f in _TRIG})
_MATH64.update({f: f for f in _TRIG})


def ctype(dtype: str) -> str:
    return C_TYPES[dtype]


def float_literal(v: float, dtype: str) -> str:
    """An exact C literal of ``v`` as a float (float32/float16) or double."""
    single = dtype != "float64"
    if math.isnan(v):
        return "__int_as_float(0x7fc00000)" if single else "__longlong_as_double(0x7ff8000000000000LL)"
    if math.isinf(v):
        sign = "-" if v < 0 else ""
        if single:
            return f"({sign}__int_as_float(0x7f800000))"
        return f"({sign}__longlong_as_double(0x7ff0000000000000LL))"
    text = float(v).hex()
    return f"{text}f" if single else text


def int_literal(v: int, dtype: str) -> str:
    if dtype == "bool":
        return "true" if v else "false"
    if dtype == "uint64":
        return f"{int(v) & ((1 << 64) - 1)}ULL"
    if dtype == "int64":
        return f"{int(v)}LL" if v != -(1 << 63) else "(-9223372036854775807LL - 1)"
    if dtype in ("uint32",):
        return f"{int(v)}U"
    if dtype == "int32" and v == -(1 << 31):
        return "(-2147483647 - 1)"
    return f"(({C_TYPES[dtype]}){int(v)})" if dtype not in ("int32",) else str(int(v))


class CExpr:
    """Prints expressions; ``name_of(var)`` gives a variable's C name, ``access(load)`` a load's lvalue."""

    def __init__(self, name_of: Callable[[Var], str], access: Callable[[Any, tuple[Expr, ...]], str]):
        self.name_of = name_of
        self.access = access

    def __call__(self, e: Expr) -> str:
        return self.expr(e)

    def expr(self, e: Expr) -> str:
        if isinstance(e, Const):
            if dt.is_float(e.dtype):
                return float_literal(float(e.value), e.dtype)
            return int_literal(int(e.value), e.dtype)
        if isinstance(e, Var):
            return self.name_of(e)
        if isinstance(e, Load):
            ref = self.access(e.buffer, e.indices)
            if e.buffer.dtype == "float16":
                return f"cuvil_h2f({ref})"
            if e.buffer.dtype == "bool":
                return f"({ref} != 0)"
            return ref
        if isinstance(e, Cast):
            return self.cast(self.expr(e.value), e.value.dtype, e.dtype)
        if isinstance(e, Binary):
            return self.binary(e)
        if isinstance(e, Unary):
            a = self.expr(e.a)
            if e.op == "neg":
                return f"(-{a})" if dt.is_float(e.dtype) else f"(({ctype(e.dtype)})(0 - {a}))"
            return f"(!{a})" if e.dtype == "bool" else f"(({ctype(e.dtype)})~{a})"
        if isinstance(e, Select):
            return f"({self.expr(e.cond)} ? {self.expr(e.t)} : {self.expr(e.f)})"
        if isinstance(e, Call):
            return self.call(e)
        raise InternalError(f"internal error in CUDA codegen: cannot print {type(e).__name__} {e}")

    def cast(self, v: str, src: str, dst: str) -> str:
        if src == dst:
            return v
        if dst == "bool":
            return f"({v} != 0)"
        if dst == "float16":
            wide = src == "float64"
            return f"cuvil_h2f({'cuvil_d2h' if wide else 'cuvil_f2h'}(({'double' if wide else 'float'}){v}))"
        if dt.is_float(dst):
            return f"(({ctype(dst)}){v})"
        if dt.is_float(src):  # float -> int truncates; negative -> unsigned wraps like numpy on x86
            if dst == "uint64":
                return f"cuvil_f2u64({v})"
            if dst == "uint32":
                return f"((unsigned int)(long long){v})"
            if dst in ("int8", "int16", "uint8", "uint16"):
                return f"(({ctype(dst)})(int){v})"
            return f"(({ctype(dst)}){v})"
        return f"(({ctype(dst)}){v})"

    def binary(self, e: Binary) -> str:
        a, b = self.expr(e.a), self.expr(e.b)
        t = e.a.dtype
        if e.op in _CMP:
            return f"({a} {_CMP[e.op]} {b})"
        if dt.is_float(t):
            if e.op in ("min", "max"):
                return f"cuvil_f{e.op}({a}, {b})"
            if e.op in ("floordiv", "floormod"):
                return f"cuvil_f{e.op}<{ctype(t)}>({a}, {b})"
            if e.op in ("add", "sub", "mul", "div"):
                return f"({a} {_ARITH[e.op]} {b})"
        else:
            ct = ctype(t)
            if e.op in ("min", "max"):
                return f"cuvil_{e.op}<{ct}>({a}, {b})"
            if e.op in ("floordiv", "floormod"):
                kind = "s" if dt.is_signed(t) else "u"  # the compiler folds a constant divisor
                return f"cuvil_{kind}{e.op}<{ct}>({a}, {b})"
            if e.op in _ARITH and e.op != "div":
                if t in ("int32", "int64") and e.op in ("add", "sub", "mul"):
                    return f"({a} {_ARITH[e.op]} {b})"
                return f"(({ct})({a} {_ARITH[e.op]} {b}))"
        raise InternalError(f"internal error in CUDA codegen: operator {e.op!r} on {t}")

    def call(self, e: Call) -> str:
        if e.name == INDEX_CHECK:  # no bounds checks on the GPU yet: the index itself (negatives from the end)
            from cuvil.ir.checks import unchecked

            return self.expr(unchecked(e))
        args = [self.expr(a) for a in e.args]
        t = e.args[0].dtype
        if not dt.is_float(t):
            raise InternalError(f"internal error in CUDA codegen: {e.name} of non-float {e}")
        single = t != "float64"
        if e.name == "isnan":
            return f"({args[0]} != {args[0]})"
        if e.name == "rsqrt":
            return f"(1.0f / sqrtf({args[0]}))" if single else f"(1.0 / sqrt({args[0]}))"
        if e.name == "sigmoid":
            return f"cuvil_sigmoid<{'float' if single else 'double'}>({args[0]})"
        table = _MATH32 if single else _MATH64
        if e.name not in table:
            raise InternalError(f"internal error in CUDA codegen: unknown math function {e.name!r}")
        return f"{table[e.name]}({', '.join(args)})"


def c_name(name: str, used: set[str]) -> str:
    """A C identifier for ``name`` not in ``used`` (and then added to it)."""
    base = re.sub(r"[^A-Za-z0-9_]", "_", name) or "v"
    if base[0].isdigit():
        base = "v" + base
    if base.startswith("cuvil_") or base in _RESERVED:
        base = "u_" + base
    n, i = base, 1
    while n in used:
        n = f"{base}_{i}"
        i += 1
    used.add(n)
    return n


_RESERVED = {"threadIdx", "blockIdx", "blockDim", "gridDim", "int", "float", "double", "char", "short", "long",
             "unsigned", "signed", "bool", "true", "false", "if", "else", "for", "while", "do", "return", "const",
             "static", "void", "asm", "auto", "break", "case", "continue", "default", "goto", "switch", "sizeof",
             "struct", "union", "enum", "register", "volatile", "extern", "inline", "template", "typename",
             "class", "new", "delete", "this", "namespace", "using", "operator", "exp", "log", "main"}
