"""Scalar expressions -> LLVM IR (llvmlite.ir), with numpy's semantics.

Types: float16 is a storage type (``half`` in memory, ``float`` in registers);
bool is ``i8`` 0/1 in memory and ``i1`` in registers; unsigned integers are
plain ``iN`` values whose operations pick the unsigned instruction.

Rules that differ from C (and are the point of this file):
- integer ``//`` and ``%`` floor like Python; a zero divisor gives 0 and
  ``INT_MIN // -1`` wraps, so no division instruction can trap;
- float ``//`` and ``%`` follow ``np.floor_divide`` / ``np.remainder``;
- float ``min``/``max`` propagate NaN like ``np.minimum``/``np.maximum``;
- ``!=`` on floats is unordered (NaN != NaN), the other comparisons ordered;
- ``select`` evaluates only the chosen side when a side reads memory or divides.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir

from cuvil import dtype as dt
from cuvil.codegen import vecmath
from cuvil.errors import CuvilError
from cuvil.ir.expr import (
    BF16_PAIR,
    DOT2_BF16,
    DOT2_I16,
    DOT4_KINDS,
    INDEX_CHECK,
    Binary,
    Call,
    Cast,
    Const,
    Expr,
    Load,
    Reduce,
    Select,
    TensorRead,
    Unary,
    Var,
    index_check_parts,
)
from cuvil.ir.functor import walk

I1, I8, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(32), ir.IntType(64)
HALF, FLOAT, DOUBLE = ir.HalfType(), ir.FloatType(), ir.DoubleType()
PTR = ir.PointerType()
# FMA contraction, in vector code only: explicit SIMD loops are register tiles with independent
# accumulators (throughput-bound, where an FMA is one instruction for two), while a scalar loop is
# usually a serial chain that an FMA's latency slows down (a naive matmul ran ~20% slower with it).
# Never reassociation.
FAST = ("contract",)

_INT_CMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_LIBM = {"tanh": ("tanhf", "tanh"), "erf": ("erff", "erf"),
         # no vector code of cuvil's own: one libm call per lane (rare in models but for rotary tables)
         **{f: (f + "f", f) for f in ("sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh",
                                      "atanh")}}
_INTRINSIC = {"exp": "exp", "log": "log", "sqrt": "sqrt", "abs": "fabs", "floor": "floor", "ceil": "ceil",
              "round": "roundeven", "trunc": "trunc", "pow": "pow"}


def rint_cast(e: Cast, target: Any) -> bool:
    """``int32(round(x))`` of a float32 ``x`` on x86: emitted as one ``llvm.lrint`` (``cvtps2dq``) instead
    of a rounding and a truncating conversion.  The same values wherever the conversion is defined
    (``|x| < 2**31``; outside, both are unspecified); x86 code never changes the rounding mode."""
    v = e.value
    return (e.dtype == "int32" and isinstance(v, Call) and v.name == "round" and v.dtype == "float32"
            and str(getattr(target, "triple", "")).startswith("x86_64"))


class InternalError(CuvilError):
    """The loop IR handed to codegen is malformed (a bug in an earlier stage)."""


def reg_type(dtype: str) -> ir.Type:
    """The LLVM type that holds a value of ``dtype`` in registers."""
    if dtype in ("float16", "float32"):
        return FLOAT
    if dtype == "float64":
        return DOUBLE
    if dtype == "bool":
        return I1
    return ir.IntType(dt.bits(dtype))


def elem(t: ir.Type) -> ir.Type:
    """The element type of a vector type, or ``t`` itself."""
    return t.element if isinstance(t, ir.VectorType) else t


def like(v: ir.Value, t: ir.Type) -> ir.Type:
    """``t``, or a vector of ``t`` with as many lanes as ``v`` has."""
    return ir.VectorType(t, v.type.count) if isinstance(v.type, ir.VectorType) else t


def mem_type(dtype: str) -> ir.Type:
    """The LLVM type of one element of ``dtype`` in memory."""
    if dtype == "float16":
        return HALF
    if dtype == "bool":
        return I8
    return reg_type(dtype)


def _unsigned(dtype: str) -> bool:
    return dtype == "bool" or (dt.is_int(dtype) and not dt.is_signed(dtype))


def needs_branch(e: Expr) -> bool:
    """True if evaluating ``e`` speculatively could read memory, divide or fail a bounds check."""
    for n in walk(e):
        if isinstance(n, Load) or (isinstance(n, Call) and n.name == INDEX_CHECK):
            return True
        if isinstance(n, Binary) and n.op in ("floordiv", "floormod") and not dt.is_float(n.dtype) \
                and pow2_divisor(n) is None:
            return True
    return False


def pow2_divisor(e: Binary) -> int | None:
    """``k`` when ``e`` is an integer ``x // 2**k`` or ``x % 2**k`` (a constant divisor, k >= 0): an
    arithmetic (signed) or logical shift right by k, or a mask of k bits, in two's complement exactly
    Python's floor division and modulo (-7 // 4 == -7 >> 2 == -2; -7 % 4 == -7 & 3 == 1)."""
    d = e.b
    if not isinstance(d, Const) or dt.is_float(e.dtype) or not isinstance(d.value, int) or isinstance(d.value, bool):
        return None
    v = int(d.value)
    return v.bit_length() - 1 if v > 0 and v & (v - 1) == 0 and v.bit_length() <= dt.bits(e.dtype) - (
        1 if dt.is_signed(e.dtype) else 0) else None


class ExprEmitter:
    """Emits expressions at ``self.builder``; ``self.env`` maps Vars to values.

    ``self.buffers`` maps a Buffer to ``(pointer, [dims as i64 values])``.
    """

    module: ir.Module
    builder: ir.IRBuilder
    env: dict[Var, ir.Value]
    buffers: dict[Any, tuple[ir.Value, list[ir.Value]]]

    # -- entry point ------------------------------------------------------------
    def expr(self, e: Expr) -> ir.Value:
        if isinstance(e, Const):
            return self.const(e.value, e.dtype)
        if isinstance(e, Var):  # IterVar included
            if e not in self.env:
                raise InternalError(f"internal error in LLVM codegen: variable {e.name!r} is not bound here")
            return self.env[e]
        if isinstance(e, Cast):
            if rint_cast(e, self.target):
                return self.lrint(self.expr(e.value.args[0]))  # type: ignore[attr-defined]
            return self.cast(self.expr(e.value), e.value.dtype, e.dtype)
        if isinstance(e, Binary):
            k = pow2_divisor(e) if e.op in ("floordiv", "floormod") else None
            if k is not None:
                return self.pow2_floordiv(e.op, self.expr(e.a), k, e.a.dtype)
            return self.binary(e.op, self.expr(e.a), self.expr(e.b), e.a.dtype)
        if isinstance(e, Unary):
            return self.unary(e.op, self.expr(e.a), e.dtype)
        if isinstance(e, Call):
            return self.call(e)
        if isinstance(e, Select):
            return self.select(e)
        if isinstance(e, Load):
            if e.dtype != e.buffer.dtype:
                raise InternalError(f"internal error in LLVM codegen: {e} has dtype {e.dtype}, "
                                    f"its buffer {e.buffer.dtype}")
            return self.load(e.buffer, e.indices)
        if isinstance(e, (TensorRead, Reduce)):
            raise InternalError(
                f"internal error in LLVM codegen: {type(e).__name__} {e} reached codegen; "
                "lowering must turn tensor reads into Loads and reductions into loops"
            )
        raise InternalError(f"internal error in LLVM codegen: unknown expression {e!r}")

    def unary(self, op: str, a: ir.Value, dtype: str) -> ir.Value:
        if op == "not":
            return self.builder.not_(a)
        return self.builder.fneg(a) if dt.is_float(dtype) else self.builder.neg(a)

    def const(self, value: Any, dtype: str) -> ir.Constant:
        t = reg_type(dtype)
        if dtype == "float16":  # round to half first, then hold as float
            import numpy as np

            value = float(np.float16(value))
        if dt.is_float(dtype):
            return ir.Constant(t, float(value))
        return ir.Constant(t, int(value) & ((1 << t.width) - 1))

    # -- memory -----------------------------------------------------------------
    def storage(self, buffer: Any, indices: tuple[Expr, ...]) -> tuple[ir.Value, list[ir.Value]]:
        """The pointer and dimensions of an allocated buffer indexed with ``indices``."""
        if buffer not in self.buffers:
            raise InternalError(f"internal error in LLVM codegen: buffer {buffer.name!r} is not allocated here")
        ptr, dims = self.buffers[buffer]
        if len(indices) != len(dims):
            raise InternalError(
                f"internal error in LLVM codegen: {buffer.name} has {len(dims)} dims, indexed with {len(indices)}"
            )
        return ptr, dims

    def address(self, buffer: Any, indices: tuple[Expr, ...]) -> ir.Value:
        ptr, dims = self.storage(buffer, indices)
        b = self.builder
        flat: ir.Value = ir.Constant(I64, 0)
        for k, (idx, dim) in enumerate(zip(indices, dims)):
            i = self.to_i64(self.expr(idx), idx.dtype)
            flat = i if k == 0 else b.add(b.mul(flat, dim, flags=("nsw",)), i, flags=("nsw",))
        return b.gep(ptr, [flat], inbounds=True, source_etype=mem_type(buffer.dtype))

    def load(self, buffer: Any, indices: tuple[Expr, ...]) -> ir.Value:
        v = self.builder.load(self.address(buffer, indices), typ=mem_type(buffer.dtype))
        if buffer.dtype == "float16":
            return self.builder.fpext(v, FLOAT)
        if buffer.dtype == "bool":
            return self.builder.icmp_unsigned("!=", v, ir.Constant(I8, 0))
        return v

    def to_memory(self, v: ir.Value, dtype: str) -> ir.Value:
        if dtype == "float16":
            return self.builder.fptrunc(v, like(v, HALF))
        if dtype == "bool":
            return self.builder.zext(v, like(v, I8))
        return v

    def to_i64(self, v: ir.Value, dtype: str) -> ir.Value:
        if not isinstance(v.type, ir.IntType):
            raise InternalError(f"internal error in LLVM codegen: index of dtype {dtype} is not an integer")
        if v.type.width == 64:
            return v
        if v.type.width > 64:
            return self.builder.trunc(v, I64)
        return self.builder.zext(v, I64) if _unsigned(dtype) else self.builder.sext(v, I64)

    # -- casts ------------------------------------------------------------------
    def cast(self, v: ir.Value, src: str, dst: str) -> ir.Value:
        b = self.builder
        if src == dst:
            return v
        st, tt = like(v, reg_type(src)), like(v, reg_type(dst))
        if dst == "bool":
            if dt.is_float(src):
                return b.fcmp_unordered("!=", v, ir.Constant(st, 0.0))
            return b.icmp_unsigned("!=", v, ir.Constant(st, 0))
        if dt.is_float(dst):
            if dst == "float16":  # round to half precision, then hold the value as float
                half = like(v, HALF)
                if dt.is_float(src):
                    h = b.fptrunc(v, half)
                else:
                    h = b.uitofp(v, half) if _unsigned(src) else b.sitofp(v, half)
                return b.fpext(h, like(v, FLOAT))
            if dt.is_float(src):
                if st == tt:
                    return v
                return b.fpext(v, tt) if elem(tt) == DOUBLE else b.fptrunc(v, tt)
            return b.uitofp(v, tt) if _unsigned(src) else b.sitofp(v, tt)
        # integer destination
        if dt.is_float(src):
            return self.float_to_int(v, dst)
        if elem(st).width == elem(tt).width:
            return v
        if elem(st).width > elem(tt).width:
            return b.trunc(v, tt)
        return b.zext(v, tt) if _unsigned(src) else b.sext(v, tt)

    def lrint(self, v: ir.Value) -> ir.Value:
        """float32 -> int32 rounded half to even in one instruction (``llvm.lrint``: x86's ``cvtps2dq``
        under the default rounding mode; see :func:`rint_cast`)."""
        t = v.type
        i32 = like(v, I32)
        fname = f"llvm.lrint.v{t.count}i32.v{t.count}f32" if isinstance(t, ir.VectorType) else "llvm.lrint.i32.f32"
        fn = self.module.globals.get(fname)
        if fn is None:
            fn = ir.Function(self.module, ir.FunctionType(i32, [t]), fname)
        return self.builder.call(fn, [v])

    def float_to_int(self, v: ir.Value, dst: str) -> ir.Value:
        """float -> integer by truncation, wrapping like numpy's C casts on x86 for negative -> unsigned.

        Out-of-range values (beyond the 32/64-bit conversion used) give an unspecified result.
        """
        b = self.builder
        tt = like(v, reg_type(dst))
        i64 = like(v, I64)
        if dst == "uint64":  # negative values wrap (numpy: -1.0 -> 2**64 - 1)
            neg = b.fcmp_ordered("<", v, ir.Constant(v.type, 0.0))
            return b.select(neg, b.fptosi(v, i64), b.fptoui(v, i64))
        if elem(tt).width >= 32 and dt.is_signed(dst):
            return b.fptosi(v, tt)
        wide = i64 if dst == "uint32" else like(v, I32)  # convert in a wider signed type, then wrap
        return b.trunc(b.fptosi(v, wide), tt)

    # -- binary operators -------------------------------------------------------
    def binary(self, op: str, a: ir.Value, b_: ir.Value, dtype: str) -> ir.Value:
        b = self.builder
        if dt.is_float(dtype):
            return self.float_binary(op, a, b_)
        unsigned = _unsigned(dtype)
        if op in _INT_CMP:
            cmp = b.icmp_unsigned if unsigned else b.icmp_signed
            return cmp(_INT_CMP[op], a, b_)
        if op == "add":
            return b.add(a, b_)
        if op == "sub":
            return b.sub(a, b_)
        if op == "mul":
            return b.mul(a, b_)
        if op == "and":
            return b.and_(a, b_)
        if op == "or":
            return b.or_(a, b_)
        if op == "xor":
            return b.xor(a, b_)
        if op in ("min", "max"):
            cmp = b.icmp_unsigned if unsigned else b.icmp_signed
            return b.select(cmp("<" if op == "min" else ">", a, b_), a, b_)
        if op in ("floordiv", "floormod"):
            return self.int_floordiv(op, a, b_, unsigned)
        raise InternalError(f"internal error in LLVM codegen: operator {op!r} on {dtype}")

    def pow2_floordiv(self, op: str, a: ir.Value, k: int, dtype: str) -> ir.Value:
        """``a // 2**k`` (a shift right: arithmetic for a signed type) or ``a % 2**k`` (a mask of k bits)
        on an integer scalar or vector: see :func:`pow2_divisor`."""
        b = self.builder
        t = a.type
        if op == "floormod":
            return b.and_(a, ir.Constant(t, (1 << k) - 1) if not isinstance(t, ir.VectorType)
                          else ir.Constant(t, [(1 << k) - 1] * t.count))
        amount = ir.Constant(t, k) if not isinstance(t, ir.VectorType) else ir.Constant(t, [k] * t.count)
        return b.lshr(a, amount) if _unsigned(dtype) else b.ashr(a, amount)

    def int_floordiv(self, op: str, a: ir.Value, d: ir.Value, unsigned: bool) -> ir.Value:
        """Python's floor division / modulo on integers; x // 0 == x % 0 == 0; never traps."""
        b = self.builder
        t = a.type
        zero, one = ir.Constant(t, 0), ir.Constant(t, 1)
        is_zero = b.icmp_unsigned("==", d, zero)
        if unsigned:
            safe = b.select(is_zero, one, d)
            r = b.udiv(a, safe) if op == "floordiv" else b.urem(a, safe)
            return b.select(is_zero, zero, r)
        minus_one = ir.Constant(t, -1 & ((1 << elem(t).width) - 1))
        is_m1 = b.icmp_signed("==", d, minus_one)
        safe = b.select(b.or_(is_zero, is_m1), one, d)  # INT_MIN / -1 would trap: divide by 1 instead
        q, r = b.sdiv(a, safe), b.srem(a, safe)
        # C truncates; floor differs when the remainder is non-zero and its sign differs from the divisor's
        fix = b.and_(b.icmp_signed("!=", r, zero), b.icmp_signed("<", b.xor(r, safe), zero))
        if op == "floordiv":
            q = b.sub(q, b.zext(fix, t))
            q = b.select(is_m1, b.neg(a), q)  # wraps for INT_MIN, like numpy
            return b.select(is_zero, zero, q)
        r = b.select(fix, b.add(r, safe), r)
        return b.select(b.or_(is_zero, is_m1), zero, r)

    def float_binary(self, op: str, a: ir.Value, c: ir.Value) -> ir.Value:
        b = self.builder
        flags = FAST if isinstance(a.type, ir.VectorType) else ()
        if op == "add":
            return b.fadd(a, c, flags=flags)
        if op == "sub":
            return b.fsub(a, c, flags=flags)
        if op == "mul":
            return b.fmul(a, c, flags=flags)
        if op == "div":
            return b.fdiv(a, c, flags=("arcp",) if flags else ())  # vectors: x / y -> x * (1 / y), hoisted
        if op == "ne":
            return b.fcmp_unordered("!=", a, c)
        if op in _INT_CMP:
            return b.fcmp_ordered(_INT_CMP[op], a, c)
        if op in ("min", "max"):
            # np.maximum: NaN in either operand wins, otherwise (c > a) ? c : a (a on ties, so -0/+0 keep a)
            # written so that a reduction's accumulator ``a`` goes through one vmaxps and one blend per step:
            # (c > a) ? c : a is x86's max(c, a) (a when either is NaN); the NaN test on c is off that chain
            take_c = b.fcmp_ordered(">" if op == "max" else "<", c, a)
            return b.select(b.fcmp_unordered("uno", c, c), c, b.select(take_c, c, a))
        if op in ("floordiv", "floormod"):
            return self.float_floordiv(op, a, c)
        raise InternalError(f"internal error in LLVM codegen: operator {op!r} on floats")

    def float_floordiv(self, op: str, a: ir.Value, d: ir.Value) -> ir.Value:
        """np.floor_divide / np.remainder on floats, built on fmod (LLVM's frem)."""
        b = self.builder
        t = a.type
        zero, one = ir.Constant(t, 0.0), ir.Constant(t, 1.0)
        mod = b.frem(a, d)
        d_is_zero = b.fcmp_ordered("==", d, zero)
        mod_nonzero = b.fcmp_unordered("!=", mod, zero)
        signs_differ = b.xor(b.fcmp_ordered("<", d, zero), b.fcmp_ordered("<", mod, zero))
        adjust = b.and_(mod_nonzero, signs_differ)
        if op == "floormod":
            fixed = b.select(adjust, b.fadd(mod, d), mod)
            # a zero remainder takes the divisor's sign; a zero divisor gives fmod's NaN
            fixed = b.select(mod_nonzero, fixed, self.intrinsic("copysign", [zero, d]))
            return b.select(d_is_zero, mod, fixed)
        quot = b.fdiv(b.fsub(a, mod), d)
        quot = b.select(adjust, b.fsub(quot, one), quot)
        fl = self.intrinsic("floor", [quot])
        fl = b.select(b.fcmp_ordered(">", b.fsub(quot, fl), ir.Constant(t, 0.5)), b.fadd(fl, one), fl)
        quot_zero = b.fcmp_ordered("==", quot, zero)
        fl = b.select(quot_zero, self.intrinsic("copysign", [zero, b.fdiv(a, d)]), fl)
        return b.select(d_is_zero, b.fdiv(a, d), fl)

    # -- calls and select -------------------------------------------------------
    def intrinsic(self, name: str, args: list[ir.Value]) -> ir.Value:
        t = args[0].type
        suffix = "f32" if elem(t) == FLOAT else "f64"
        if isinstance(t, ir.VectorType):
            suffix = f"v{t.count}{suffix}"
        fname = f"llvm.{name}.{suffix}"
        fn = self.module.globals.get(fname)
        if fn is None:
            fn = ir.Function(self.module, ir.FunctionType(t, [t] * len(args)), fname)
        return self.builder.call(fn, args)

    def libm(self, name: str, arg: ir.Value) -> ir.Value:
        """A libm call (float64 tanh/erf, trigonometric functions); on a vector, one scalar call per lane."""
        if isinstance(arg.type, ir.VectorType):
            b = self.builder
            out: ir.Value = ir.Constant(arg.type, None)
            for lane in range(arg.type.count):
                k = ir.Constant(I32, lane)
                out = b.insert_element(out, self.libm(name, b.extract_element(arg, k)), k)
            return out
        fname = _LIBM[name][0 if arg.type == FLOAT else 1]
        fn = self.module.globals.get(fname)
        if fn is None:
            fn = ir.Function(self.module, ir.FunctionType(arg.type, [arg.type]), fname)
            fn.attributes.add("nounwind")
            fn.attributes.add("readnone")
        return self.builder.call(fn, [arg])

    def call(self, e: Call) -> ir.Value:
        if e.name == INDEX_CHECK:
            return self.index_check(e)
        if e.name in DOT4_KINDS:
            from cuvil.codegen.llvm_dot import dot4_bytes

            return dot4_bytes(self.builder, self.expr(e.args[0]), self.expr(e.args[1]), *DOT4_KINDS[e.name])
        if e.name == DOT2_I16:
            from cuvil.codegen.llvm_dot import dot2_i16_arith

            return dot2_i16_arith(self.builder, self.expr(e.args[0]), self.expr(e.args[1]))
        if e.name in (DOT2_BF16, BF16_PAIR):
            from cuvil.codegen.llvm_dot import bf16_pair_arith, dot2_bf16_arith

            f = dot2_bf16_arith if e.name == DOT2_BF16 else bf16_pair_arith
            return f(self.builder, self.expr(e.args[0]), self.expr(e.args[1]))
        return self.math(e, [self.expr(a) for a in e.args])


    def index_check(self, e: Call) -> ir.Value:
        """The checked index (cuvil.ir.checks): one unsigned compare (``-n <= v < n`` is ``v + n < 2n``),
        a cold branch to the error exit, and with ``wrap`` a negative index counted from the end."""
        v, n, wrap, _tag, site = index_check_parts(e)  # type: ignore[misc]
        b = self.builder
        x = self.to_i64(self.expr(v), v.dtype)
        ext = self.to_i64(self.expr(n), n.dtype)
        if wrap:
            ok = b.icmp_unsigned("<", b.add(x, ext), b.shl(ext, ir.Constant(I64, 1)))
        else:
            ok = b.icmp_unsigned("<", x, ext)
        self.fail_unless(ok, site, x)  # type: ignore[attr-defined]
        if wrap:
            return b.select(b.icmp_signed("<", x, ir.Constant(I64, 0)), b.add(x, ext), x)
        return x

    def math(self, e: Call, args: list[ir.Value]) -> ir.Value:
        """The math function ``e.name`` applied to the already evaluated (scalar or vector) ``args``."""
        b = self.builder
        if not all(dt.is_float(a.dtype) for a in e.args):
            raise InternalError(f"internal error in LLVM codegen: {e.name} of non-float {e}")
        x = args[0]
        one = ir.Constant(x.type, 1.0)
        if e.name == "isnan":
            return b.fcmp_unordered("uno", x, x)
        if e.name == "rsqrt":
            return b.fdiv(one, self.intrinsic("sqrt", [x]))
        if e.name == "fmod":
            return b.frem(x, args[1])
        if elem(x.type) == FLOAT and e.name in vecmath.FUNCTIONS:  # float32 (and float16): cuvil's own code
            return vecmath.FUNCTIONS[e.name](b, x, avx512="avx512f" in self.target.enabled_features)
        if e.name == "sigmoid":
            return b.fdiv(one, b.fadd(one, self.intrinsic("exp", [b.fneg(x)])))
        if e.name in _LIBM:
            return self.libm(e.name, x)
        if e.name in _INTRINSIC:
            return self.intrinsic(_INTRINSIC[e.name], args)
        raise InternalError(f"internal error in LLVM codegen: unknown math function {e.name!r}")

    def select(self, e: Select) -> ir.Value:
        b = self.builder
        cond = self.expr(e.cond)
        if not (needs_branch(e.t) or needs_branch(e.f)):
            return b.select(cond, self.expr(e.t), self.expr(e.f))
        # evaluate only the chosen side: the other may index out of bounds (padding)
        return self.branched(cond, lambda: self.expr(e.t), lambda: self.expr(e.f), "sel")

    def branched(self, cond: ir.Value, then: Any, otherwise: Any, name: str) -> ir.Value:
        """``cond ? then() : otherwise()`` as a branch: each side's code is emitted in a block of its own and
        runs only when chosen; the value is the phi of the two (blocks ``<name>.t``, ``.f``, ``.end``)."""
        b = self.builder
        fn = b.function
        then_bb, else_bb, merge_bb = (fn.append_basic_block(f"{name}.{x}") for x in ("t", "f", "end"))
        b.cbranch(cond, then_bb, else_bb)
        b.position_at_end(then_bb)
        tv = then()
        t_end = b.block
        b.branch(merge_bb)
        b.position_at_end(else_bb)
        fv = otherwise()
        f_end = b.block
        b.branch(merge_bb)
        b.position_at_end(merge_bb)
        phi = b.phi(tv.type)
        phi.add_incoming(tv, t_end)
        phi.add_incoming(fv, f_end)
        return phi
