"""Explicit SIMD for ``For(kind="vectorize")`` loops (a mixin of the LLVM function emitter).

A vectorised loop ``for (j = lo; j < lo + E; j++) body`` becomes::

    for (c = 0; c < E - E % V; c += V)     // vector part: V lanes, j = <lo+c, lo+c+1, ...>
      body, lane-wise, statement by statement
    for (c = E - E % V; c < E; c++)        // scalar epilogue (absent when V divides a constant E)
      body with j = lo + c

``V`` is the lane count: for a non-constant extent, one SIMD register of the
widest element type the body loads or stores (:func:`simd_bits` bits); for a
constant extent ``E``, the largest power of two <= ``E`` and <= ``MAX_REGS``
registers (LLVM splits a wide vector into registers, which gives a register
block for free: a 64-float row is 8 ymm accumulators).

Inside the vector part every expression is evaluated once for all lanes, with
the same semantics as the scalar path (the scalar emitter's operators accept
vectors).  A value is kept as cheaply as possible (:class:`Lanes`): *uniform*
(one scalar for all lanes), *affine* (an integer ``base + stride * lane``:
the loop variable and index arithmetic on it) or a *vector*.  Memory (:mod:`cuvil.codegen.llvm_vector_memory`):

- a Load/Store whose flattened index is affine with stride 1 is one
  (unaligned: ``align`` = element size) vector load/store;
- a uniform index is a scalar load (then broadcast when combined with
  vectors); a Store to a uniform index stores the last lane's value;
- any other index is a gather/scatter of per-lane scalar loads/stores, in
  lane order;
- elements 2-4 apart are one masked load of the span and a shuffle (the
  bytes an int8 contraction packs four to an int32, a stride-2 pool's columns);
- float16 is ``<V x half>`` in memory and ``<V x float>`` in registers, bool
  ``<V x i8>`` / ``<V x i1>``.

``acc + dot4(u, s)`` (:func:`cuvil.ir.expr.dot4`, four byte products per int32)
is one dot-product instruction per register of lanes where the target has one
(:mod:`cuvil.codegen.llvm_dot`: x86 ``vpdpbusd``, AArch64 ``udot`` / ``sdot`` / ``usdot``),
the byte arithmetic elsewhere.

A ``Select`` whose condition varies across lanes and whose sides read memory
reads through masked loads, or else per lane with the scalar (branching) code,
so the unchosen side never reads out of bounds; before going lane by lane, a
full vector tests whether every lane chooses the true side (then plain vector
code); with a uniform condition it branches once for all lanes.  Integer
``//``/``%`` cannot trap (zero and -1 divisors are replaced before dividing)
and is evaluated lane-wise.  On float32 (and float16, held as float32) ``exp
log tanh erf sigmoid`` are cuvil's own polynomial code
(:mod:`cuvil.codegen.vecmath`, the same IR as the scalar path); ``sqrt floor
ceil round trunc abs`` are native vector intrinsics; ``pow`` and the float64
``exp log`` are vector intrinsics that LLVM expands into per-lane libm calls,
float64 ``tanh``/``erf`` per-lane libm calls.

The body may contain Stores, Blocks, and Ifs and LetStmts whose condition or
value does not depend on the loop variable.  Anything else (a nested loop, an
Allocate, an If or LetStmt that depends on the lane) makes the loop a serial
loop (no vectorize metadata: LLVM could not do better and would print warnings)
and a comment in the LLVM IR saying why (``; cuvil: vectorize loop 'j' stays serial: ...``).
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir

from cuvil import dtype as dt
from cuvil.codegen.llvm_dot import bf16_pair_arith, dot_vector
from cuvil.codegen.llvm_expr import I32, InternalError, mem_type, pow2_divisor, reg_type, rint_cast
from cuvil.codegen.llvm_vector_memory import Lanes, VectorMemory, _signed
from cuvil.ir.expr import BF16_PAIR, DOT_CALLS, INDEX_CHECK, Binary, Call, Cast, Const, Expr, Load, Select, Unary, Var
from cuvil.ir.functor import children, structural_equal, walk
from cuvil.ir.stmt import Block, For, If, LetStmt, Stmt, Store
from cuvil.target import SPAN_STRIDE

# Width of the vectors cuvil emits on x86 with AVX-512: 512 measured faster than 256 for the
# register-blocked matmul micro-kernel on emeraldrapids (benchmarks/simd_kernel.py), so no cap.
PREFERRED_BITS = 512
MAX_REGS = 8  # a constant-extent vector loop uses vectors of up to this many registers


def simd_bits(target: Any) -> int:
    """The vector register width cuvil generates code for on ``target`` (0: no SIMD)."""
    return min(target.vector_bits, PREFERRED_BITS)


def vector_obstacle(s: Stmt, var: Var) -> str | None:
    """Why ``s`` cannot be emitted as vector code over ``var``, or None when it can."""
    if isinstance(s, Store):
        return None
    if isinstance(s, Block):
        for x in s.stmts:
            why = vector_obstacle(x, var)
            if why:
                return why
        return None
    if isinstance(s, If):
        if uses(s.cond, var):
            return "an If whose condition depends on the loop variable"
        return vector_obstacle(s.then_body, var) or (
            None if s.else_body is None else vector_obstacle(s.else_body, var))
    if isinstance(s, LetStmt):
        if uses(s.value, var):
            return f"a LetStmt ({s.var.name}) whose value depends on the loop variable"
        return vector_obstacle(s.body, var)
    if isinstance(s, For):
        return f"a nested loop ({s.var.name})"
    return f"a {type(s).__name__}"


def uses(e: Expr, var: Var) -> bool:
    return any(n is var for n in walk(e))


def _reads_memory(e: Expr) -> bool:
    """True if ``e`` reads memory or checks an index (neither may run for a lane the select does not choose)."""
    return any(isinstance(n, Load) or (isinstance(n, Call) and n.name == INDEX_CHECK) for n in walk(e))


def _elem_bits(s: Stmt) -> int:
    """Bits of the widest element (in registers) that ``s`` loads or stores; 32 when none."""
    bits = 0

    def see(dtype: str) -> None:
        nonlocal bits
        bits = max(bits, 32 if dtype == "float16" else dt.bits(dtype))

    def visit_expr(e: Expr) -> None:
        for n in walk(e):
            if isinstance(n, Load):
                see(n.buffer.dtype)

    def visit(x: Stmt) -> None:
        if isinstance(x, Store):
            see(x.buffer.dtype)
            visit_expr(x.value)
            for i in x.indices:
                visit_expr(i)
        elif isinstance(x, Block):
            for y in x.stmts:
                visit(y)
        elif isinstance(x, If):
            visit(x.then_body)
            if x.else_body is not None:
                visit(x.else_body)
        elif isinstance(x, LetStmt):
            visit(x.body)

    visit(s)
    return bits or 32


class VectorLoops(VectorMemory):
    """Mixin of the LLVM function emitter: ``vector_loop(s)`` emits a vectorize loop."""

    module: ir.Module
    builder: ir.IRBuilder
    env: dict[Var, ir.Value]
    buffers: dict[Any, tuple[ir.Value, list[ir.Value]]]
    target: Any

    cast: Any
    branched: Any
    binary: Any
    unary: Any
    math: Any
    to_memory: Any
    to_i64: Any

    def vector_loop(self, s: For) -> None:
        why = vector_obstacle(s.body, s.var)
        ext_const = int(s.extent.value) if isinstance(s.extent, Const) else None
        native = max(1, simd_bits(self.target) // _elem_bits(s.body))
        if ext_const is None:
            lanes = native
        else:
            lanes = 1
            while lanes * 2 <= min(ext_const, native * MAX_REGS):
                lanes *= 2
        if why is not None:
            why = f"its body contains {why}"
        elif lanes < 2:
            why = "fewer than 2 iterations or no SIMD on this target"
        if why is not None:
            self.builder.comment(f"cuvil: vectorize loop '{s.var.name}' stays serial: {why}")
            self.serial_loop(s, "serial")  # no vectorize metadata: LLVM would only warn that it cannot
            return
        b = self.builder
        t = reg_type(s.var.dtype)
        signed = dt.is_signed(s.var.dtype)
        lo = self.cast(self.expr(s.min), s.min.dtype, s.var.dtype)
        ext = self.cast(self.expr(s.extent), s.extent.dtype, s.var.dtype)
        if ext_const is not None:
            n_vec: ir.Value = ir.Constant(t, ext_const // lanes * lanes)
            has_tail = ext_const % lanes != 0
        else:
            if signed:
                ext = b.select(b.icmp_signed("<", ext, ir.Constant(t, 0)), ir.Constant(t, 0), ext)
            n_vec = b.and_(ext, ir.Constant(t, -lanes & ((1 << t.width) - 1)))
            has_tail = True

        def vector_body(c: ir.Value, width: int = lanes, valid: int | None = None) -> None:
            self.vector_stmt(s.body, s.var, self.builder.add(lo, c), width, valid)

        def scalar_body(c: ir.Value) -> None:
            self.env[s.var] = self.builder.add(lo, c)
            self.stmt(s.body)
            del self.env[s.var]

        rem = ext_const % lanes if ext_const is not None else 0
        if rem < 3 or not rem & (rem - 1):
            rem = 0  # a power of two (or 1-2 lanes): the pieces below are as cheap as a masked vector
        if rem and ext_const < native:  # (lanes <= E < 2 lanes here: E is the rest)
            n_vec, has_tail = ir.Constant(t, 0), True  # one register, not a power of two: one masked vector
            rem = ext_const
        if ext_const is not None and ext_const // lanes == 1 and int(n_vec.constant) == lanes:
            vector_body(ir.Constant(t, 0))
        elif ext_const is None or int(n_vec.constant) > 0:
            self.counted_loop(f"{s.var.name}.vec", t, ir.Constant(t, 0), n_vec, lanes, signed, vector_body)
        if has_tail and rem:
            # the rest (3 or more lanes, not a power of two: 7 of a 7-wide row) as one vector whose lanes past
            # the end are neither loaded nor stored (masked), instead of 4 + 2 + 1
            width = 1 << (rem - 1).bit_length()
            vector_body(n_vec, width, rem)
        elif has_tail:
            # the remainder in narrower vectors (lanes/2, lanes/4, ... down to 2), then scalars
            pos: ir.Value = n_vec
            width = lanes // 2
            while width >= 2:
                if ext_const is not None:
                    if ext_const - int(pos.constant) >= width:  # type: ignore[union-attr]
                        vector_body(pos, width)
                        pos = ir.Constant(t, int(pos.constant) + width)  # type: ignore[union-attr]
                else:
                    fits = (b.icmp_signed if signed else b.icmp_unsigned)(">=", b.sub(ext, pos), ir.Constant(t, width))
                    with b.if_then(fits):
                        vector_body(pos, width)
                    pos = b.select(fits, b.add(pos, ir.Constant(t, width)), pos)
                width //= 2
            if ext_const is None or int(pos.constant) < ext_const:  # type: ignore[union-attr]
                self.counted_loop(f"{s.var.name}.tail", t, pos, ext, 1, signed, scalar_body)

    def lane_fold(self, s: For) -> bool:
        """Emit ``for (l < E) S[i] = S[i] op R[.., l]`` (``op`` add, max or min on floats, ``E`` a power of
        two up to a vector register, ``S[i]`` free of ``l``) as one vector of ``R`` folded in halves
        (log2 E steps instead of E dependent ones), then ``S[i] = S[i] op fold``: the last step of a row
        reduction whose partial results sit in vector lanes (``S[i] = reduce(l) S.rf[i, l]``).  max and
        min give the serial loop's result; a sum is reassociated as a tree (rounding differs within the
        reduction's tolerance).  False when ``s`` is not of that form (emit it as a loop)."""
        body = s.body
        if not (isinstance(s.extent, Const) and isinstance(s.min, Const) and isinstance(body, Store)):
            return False
        e = int(s.extent.value)
        v = body.value
        native = simd_bits(self.target) // max(1, dt.bits(body.buffer.dtype))
        if e < 2 or e & (e - 1) or e > native or not dt.is_float(body.buffer.dtype):
            return False
        if not (isinstance(v, Binary) and v.op in ("add", "max", "min") and v.dtype == body.buffer.dtype):
            return False
        acc, other = v.a, v.b
        if not (isinstance(acc, Load) and acc.buffer is body.buffer and len(acc.indices) == len(body.indices)
                and all(structural_equal(x, y) for x, y in zip(acc.indices, body.indices))):
            return False
        if any(uses(x, s.var) for x in body.indices) or uses(acc, s.var) or not uses(other, s.var):
            return False
        if any(isinstance(n, Load) and n.buffer is body.buffer for n in walk(other)):
            return False
        b = self.builder
        lo = self.cast(self.expr(s.min), s.min.dtype, s.var.dtype)
        saved = getattr(self, "_vec", None), getattr(self, "_valid", None)
        self._vec, self._valid = (s.var, lo, e, {}), None
        try:
            lanes = self.vec(self.vexpr(other))
        finally:
            self._vec, self._valid = saved
        while e > 1:  # fold the upper half onto the lower half
            e //= 2
            low = b.shuffle_vector(lanes, lanes, ir.Constant(ir.VectorType(I32, e), list(range(e))))
            high = b.shuffle_vector(lanes, lanes, ir.Constant(ir.VectorType(I32, e), list(range(e, 2 * e))))
            lanes = self.binary(v.op, low, high, v.dtype)
        folded = b.extract_element(lanes, ir.Constant(I32, 0))
        total = self.binary(v.op, self.expr(acc), folded, v.dtype)
        b.store(self.to_memory(total, body.buffer.dtype), self.address(body.buffer, body.indices))
        return True

    # -- statements in a vector body --------------------------------------------------------
    def vector_stmt(self, s: Stmt, var: Var, base: ir.Value, lanes: int, valid: int | None = None) -> None:
        """``s`` for ``lanes`` values of ``var`` from ``base``; only the first ``valid`` lanes (all when None)
        touch memory (the masked tail of a row)."""
        saved = getattr(self, "_vec", None), getattr(self, "_valid", None)
        self._vec, self._valid = (var, base, lanes, {}), valid
        try:
            self._vstmt(s)
        finally:
            self._vec, self._valid = saved

    def _valid_mask(self, lanes: int) -> ir.Constant | None:
        """The constant mask of the lanes that exist (None: all of them)."""
        valid = getattr(self, "_valid", None)
        if valid is None or valid >= lanes:
            return None
        return ir.Constant(ir.VectorType(ir.IntType(1), lanes), [1] * valid + [0] * (lanes - valid))

    def _live(self, lanes: int) -> int:
        valid = getattr(self, "_valid", None)
        return lanes if valid is None else min(valid, lanes)

    def _vstmt(self, s: Stmt) -> None:
        b = self.builder
        if isinstance(s, Block):
            for x in s.stmts:
                self._vstmt(x)
        elif isinstance(s, Store):
            self._vstore(s)
        elif isinstance(s, If):
            cond = self.expr(s.cond)
            if s.else_body is None:
                with b.if_then(cond):
                    self._vstmt(s.then_body)
            else:
                with b.if_else(cond) as (then, otherwise):
                    with then:
                        self._vstmt(s.then_body)
                    with otherwise:
                        self._vstmt(s.else_body)
        elif isinstance(s, LetStmt):
            self.env[s.var] = self.expr(s.value)
            self._vstmt(s.body)
            del self.env[s.var]
        else:
            raise InternalError(f"internal error in LLVM codegen: {type(s).__name__} in a vector body")

    # -- expressions --------------------------------------------------------------------
    def varying(self, e: Expr) -> bool:
        var, _, _, memo = self._vec
        key = id(e)
        if key not in memo:
            memo[key] = e is var or any(self.varying(c) for c in children(e))
        return memo[key]

    def vexpr(self, e: Expr) -> Lanes:
        if not self.varying(e):
            return Lanes(self.expr(e), 0)
        var, base, lanes, _ = self._vec
        b = self.builder
        if isinstance(e, Var):
            return Lanes(base, 1)
        if isinstance(e, Cast):
            if rint_cast(e, self.target):
                return Lanes(self.lrint(self.vec(self.vexpr(e.value.args[0]))), None)  # type: ignore[attr-defined]
            x = self.vexpr(e.value)
            src, dst = e.value.dtype, e.dtype
            if x.stride is not None and dt.is_int(src) and dt.is_int(dst) and dt.bits(src) == dt.bits(dst):
                return x
            return Lanes(self.cast(self.vec(x), src, dst), None)
        if isinstance(e, Binary) and e.op == "add" and e.dtype in ("int32", "float32"):
            for acc, d in ((e.a, e.b), (e.b, e.a)):
                if isinstance(d, Call) and d.name in DOT_CALLS:  # acc + dot4(u, s): one vpdpbusd / sdot ...
                    return Lanes(self.vdot4(d, self.vec(self.vexpr(acc))), None)
        if isinstance(e, Call) and e.name in DOT_CALLS:
            return Lanes(self.vdot4(e, None), None)
        if isinstance(e, Call) and e.name == BF16_PAIR:
            return Lanes(bf16_pair_arith(b, *(self.vec(self.vexpr(a)) for a in e.args)), None)
        if isinstance(e, Binary):
            x, y = self.vexpr(e.a), self.vexpr(e.b)
            if dt.is_int(e.dtype) and x.stride is not None and y.stride is not None:
                w = reg_type(e.dtype).width
                if e.op in ("add", "sub"):
                    op = b.add if e.op == "add" else b.sub
                    stride = x.stride + y.stride if e.op == "add" else x.stride - y.stride
                    return Lanes(op(x.value, y.value), _signed(stride, w))
                if e.op == "mul":
                    for p, q in ((x, y), (y, x)):
                        if q.stride == 0 and isinstance(q.value, ir.Constant):
                            return Lanes(b.mul(p.value, q.value), _signed(p.stride * int(q.value.constant), w))
            k = pow2_divisor(e) if e.op in ("floordiv", "floormod") else None
            if k is not None:  # a shift or a mask (the divisor's splat is not needed)
                return Lanes(self.pow2_floordiv(e.op, self.vec(x), k, e.a.dtype), None)
            return Lanes(self.binary(e.op, self.vec(x), self.vec(y), e.a.dtype), None)
        if isinstance(e, Unary):
            return Lanes(self.unary(e.op, self.vec(self.vexpr(e.a)), e.dtype), None)
        if isinstance(e, Call) and e.name == INDEX_CHECK:
            return self._per_lane(e)  # an index that varies across lanes: checked lane by lane, like a gather
        if isinstance(e, Call):
            return Lanes(self.math(e, [self.vec(self.vexpr(a)) for a in e.args]), None)
        if isinstance(e, Select):
            return self._vselect(e)
        if isinstance(e, Load):
            return self._vload(e)
        raise InternalError(f"internal error in LLVM codegen: cannot vectorise {e!r}")

    def vdot4(self, e: Call, acc: ir.Value | None) -> ir.Value:
        """``acc + dot4(u, s)`` (or ``dot2_bf16``) over the lanes (:func:`cuvil.codegen.llvm_dot.dot_vector`)."""
        u, s = self.vec(self.vexpr(e.args[0])), self.vec(self.vexpr(e.args[1]))
        return dot_vector(self.builder, self.target, e.name, u, s, acc, _bytes_below_128(e.args[0]))

    def vec(self, x: Lanes) -> ir.Value:
        """``x`` as a vector value."""
        if x.stride is None:
            return x.value
        _, _, lanes, _ = self._vec
        b = self.builder
        vt = ir.VectorType(x.value.type, lanes)
        one = b.insert_element(ir.Constant(vt, ir.Undefined), x.value, ir.Constant(I32, 0))
        splat = b.shuffle_vector(one, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(I32, lanes), 0))
        if x.stride == 0:
            return splat
        mask = (1 << x.value.type.width) - 1
        return b.add(splat, ir.Constant(vt, [(x.stride * lane) & mask for lane in range(lanes)]))

    def _per_lane(self, e: Expr) -> Lanes:
        """``e`` evaluated lane by lane with the scalar code (which branches where it must)."""
        var, base, lanes, _ = self._vec
        b = self.builder
        out: ir.Value = ir.Constant(ir.VectorType(reg_type(e.dtype), lanes), ir.Undefined)
        self._vec = None  # scalar code from here: the loop variable is a scalar per lane
        try:
            for lane in range(self._live(lanes)):
                self.env[var] = b.add(base, ir.Constant(base.type, lane))
                out = b.insert_element(out, self.expr(e), ir.Constant(I32, lane))
        finally:
            self.env.pop(var, None)
            self._vec = (var, base, lanes, {})
        return Lanes(out, None)

    def _vselect(self, e: Select) -> Lanes:
        b = self.builder
        lazy = _reads_memory(e.t) or _reads_memory(e.f)
        cond = self.vexpr(e.cond)
        if cond.stride is not None and lazy:  # one condition for all lanes: branch once
            return Lanes(self.branched(cond.value, lambda: self.vec(self.vexpr(e.t)),
                                       lambda: self.vec(self.vexpr(e.f)), "vsel"), None)
        if lazy:
            mask = self.vec(cond)
            if self._valid_mask(mask.type.count) is not None or self._maskable(e):
                return self._mixed_select(e, mask)
            return self._select_all_or_mixed(e, mask)
        return Lanes(b.select(cond.value, self.vec(self.vexpr(e.t)), self.vec(self.vexpr(e.f))), None)

    def _maskable(self, e: Select) -> bool:
        """Whether both sides of ``e`` read no memory or are one load of elements up to ``SPAN_STRIDE`` apart
        (:meth:`_masked_side`; the index arithmetic this emits to find out is pure, and dropped when unused)."""
        def one(x: Expr) -> bool:
            if not _reads_memory(x):
                return True
            if not isinstance(x, Load) or x.dtype != x.buffer.dtype or not x.indices:
                return isinstance(x, Load) and not x.indices
            stride = self._vflat(x.buffer, x.indices)[1].stride
            return stride is not None and 1 <= stride <= SPAN_STRIDE and x.dtype != "bool"

        return one(e.t) and one(e.f)

    def _mixed_select(self, e: Select, mask: ir.Value) -> Lanes:
        """A select whose lanes choose different sides: masked loads (a lane off the mask reads nothing),
        else lane by lane."""
        b = self.builder
        sides = [self._masked_side(e.t, mask), self._masked_side(e.f, b.not_(mask))]
        if sides[0] is None or sides[1] is None:
            return self._per_lane(e)
        return Lanes(b.select(mask, sides[0], sides[1]), None)

    def _select_all_or_mixed(self, e: Select, mask: ir.Value) -> Lanes:
        """A select whose condition varies across lanes and whose sides cannot be masked loads (a strided or
        computed read), in a full vector: when every lane chooses the true side (a padded window's
        interior: all vectors but the edges'), that side as plain vector code, else lane by lane
        (:meth:`_mixed_select`).  (Testing every lane before masked loads too lost on AVX2: a 5x5 / 2 pool's
        five taps each branched, 64 -> 90 us; ResNet's 3x3 / 2 pool 233 -> 211 us.)"""
        b = self.builder
        n = mask.type.count
        reduce_and = self.module.globals.get(f"llvm.vector.reduce.and.v{n}i1")
        if reduce_and is None:
            reduce_and = ir.Function(self.module, ir.FunctionType(ir.IntType(1), [mask.type]),
                                     f"llvm.vector.reduce.and.v{n}i1")
        every = b.call(reduce_and, [mask])
        return Lanes(self.branched(every, lambda: self.vec(self.vexpr(e.t)),
                                   lambda: self.vec(self._mixed_select(e, mask)), "vall"), None)

    def _masked_side(self, e: Expr, mask: ir.Value) -> ir.Value | None:
        """One side of a select whose condition varies across lanes: as a vector when it reads no memory,
        a masked load (lanes off the mask are not read: a padded window's edge) when it is one load of
        elements up to ``SPAN_STRIDE`` apart (a span load); None otherwise (the select is then evaluated
        lane by lane)."""
        if not _reads_memory(e):
            return self.vec(self.vexpr(e))
        if not isinstance(e, Load) or e.dtype != e.buffer.dtype:
            return None
        if not e.indices:  # a 0-d buffer: one value for every lane, always there to read
            return self.vec(self.vexpr(e))
        if any(isinstance(n, Call) and n.name == INDEX_CHECK for i in e.indices for n in walk(i)):
            return None  # a checked index must not be computed for a lane the select does not choose
        b = self.builder
        ptr, flat = self._vflat(e.buffer, e.indices)
        if flat.stride != 1:  # elements 2-4 apart: a span load masked by the lanes (None beyond)
            spread = self._span_load(ptr, flat, mask.type.count, e.dtype, mask)
            return None if spread is None else self._from_memory(spread, e.dtype)
        mt = mem_type(e.dtype)
        vt = ir.VectorType(mt, mask.type.count)
        valid = self._valid_mask(mask.type.count)
        if valid is not None:
            mask = b.and_(mask, valid)
        return self._from_memory(self._masked_load(ptr, flat.value, vt, mask, dt.nbytes(e.dtype)), e.dtype)


def _bytes_below_128(e: Expr) -> bool:
    """Whether every byte of the int32 ``e`` is below 128: ``x & c`` with no byte of ``c`` above 127
    (the 4-bit weights' ``w & 0x0F0F0F0F``)."""
    if isinstance(e, Binary) and e.op == "and":
        for c in (e.a, e.b):
            if isinstance(c, Const) and isinstance(c.value, int) and not int(c.value) & 0x80808080:
                return True
    return False
