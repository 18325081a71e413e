"""Loop IR -> LLVM IR -> optimised machine code, through llvmlite.

One :class:`~cuvil.ir.stmt.LoweredFunc` becomes one LLVM module with two
functions::

    int32_t <name>(void **args, int64_t *sizes);          // the exported ABI
    internal void <name>.body(T0 *noalias A, ..., i64 N)   // the loop nest

``<name>`` unpacks ``args[i]`` (the data pointer of the i-th Buffer param) and
``sizes[j]`` (the value of ``size_vars[j]``) and calls the body, whose pointer
parameters are ``noalias`` (the runtime guarantees outputs overlap nothing);
O3 inlines it and keeps the aliasing facts.  It returns 0, 1 when a heap
allocation failed, or 4 when a bounds check failed (:mod:`cuvil.ir.checks`).
``int32_t <name>_checked(void **args, int64_t *sizes, int64_t err[3])`` is the
same call that also says which check failed: ``err[0]`` its site
(``func.checks[site - 1]``), ``err[1]`` the index value; ``err`` must hold
zeros before the call (a failing check fills it once, the first one wins).

A bounds check is one compare where the index is computed and a branch to a
cold block that fills ``err``, frees the heap buffers allocated so far and
returns 4: the kernel stops there and never reads or writes out of bounds.

Stages, each a plain function whose result can be printed:
``codegen_llvm(func, target)`` (unoptimised IR text) -> ``optimize(text,
target)`` (a parsed, verified, O3-optimised ``llvm.ModuleRef``) ->
``assembly(mod, target)`` / ``object_code(mod, target)``.
"""

from __future__ import annotations

import re
from typing import Any

import llvmlite.binding as llvm
from llvmlite import ir

from cuvil import dtype as dt
from cuvil.cache import BoundedCache
from cuvil.codegen.llvm_expr import I32, I64, PTR, ExprEmitter, InternalError, mem_type, reg_type
from cuvil.codegen.llvm_parallel import PARALLEL_STACK_LIMIT, ParallelLoops
from cuvil.codegen.llvm_vector import VectorLoops, simd_bits
from cuvil.errors import TargetError
from cuvil.ir.expr import Const, Expr, Var
from cuvil.ir.stmt import Allocate, Block, Buffer, For, If, LetStmt, LoweredFunc, Stmt, Store
from cuvil.target import Target, llvm_binding

BOUNDS_STATUS = 4  # the status of a failed bounds check
ERR = Var("ptr", "err")  # the error record (int64_t[3]) in a function's environment, captured by parallel loops
STACK_LIMIT = 64 * 1024  # Allocate buffers of constant size up to this many bytes live on the stack
_LOOP_MD = {
    "serial": (),
    "unroll": (),  # run-time extents stay loops; LLVM's own unrolling decides (metadata only made it warn)
    "vectorize": (("llvm.loop.vectorize.enable", True),),
}


def codegen_llvm(func: LoweredFunc, target: Target | str) -> str:
    """The LLVM IR text (unoptimised) of a module that defines ``func``'s entry point."""
    target = Target(target)
    if target.kind != "llvm":
        raise TargetError(f"the LLVM code generator cannot build for {target.canonical!r}")
    tm = target_machine(target)
    module = ir.Module(name=func.name)
    module.triple = target.triple
    module.data_layout = str(tm.target_data)
    emit_function(module, func, target)
    return finish_ir_text(str(module), target)


def emit_function(module: ir.Module, func: LoweredFunc, target: Target) -> None:
    """Add ``func`` (its body and its ``int32 name(void** args, int64* sizes)`` entry point) to
    ``module``; several functions of distinct names can share one module (cuvil.graph.link)."""
    _FuncEmitter(module, func, target).emit()


def finish_ir_text(text: str, target: Target) -> str:
    """Add what llvmlite cannot spell: CPU attributes and self-referencing loop ids."""
    attrs = f'"target-cpu"="{target.cpu}"'
    if target.features:
        attrs += f' "target-features"="{target.features}"'
    bits = simd_bits(target)
    if 0 < bits < target.vector_bits:  # keep LLVM from widening past the width cuvil chose
        attrs += f' "prefer-vector-width"="{bits}" "min-legal-vector-width"="{bits}"'
    text = re.sub(r"^(define .*\) nounwind)$", lambda m: f"{m.group(1)} {attrs}", text, flags=re.M)
    # loop ids are written as !{!"cuvil.loop.N", ...}; LLVM wants distinct !{<self>, ...}
    return re.sub(r'^(!\d+) = !\{ !"cuvil\.loop\.\d+"', lambda m: f"{m.group(1)} = distinct !{{ {m.group(1)}",
                  text, flags=re.M)


class _FuncEmitter(VectorLoops, ParallelLoops, ExprEmitter):
    def __init__(self, module: ir.Module, func: LoweredFunc, target: Target):
        self.module = module
        self.func = func
        self.target = target
        self.env: dict[Var, ir.Value] = {}
        self.buffers: dict[Any, tuple[ir.Value, list[ir.Value]]] = {}
        self.loops = 0
        self.stack_limit = STACK_LIMIT
        self.in_parallel = False
        self.n_parallel = 0
        self.heaps: list[ir.Value] = []  # heap buffers allocated at this point (a failed check frees them)
        self.exits: dict[tuple, ir.Block] = {}

    def emit(self) -> None:
        f = self.func
        bufs = [p for p in f.params if isinstance(p, Buffer)]
        for p in f.params:
            if isinstance(p, Var) and not any(p is v for v in f.size_vars):
                raise InternalError(f"internal error in LLVM codegen: Var param {p.name!r} is not in size_vars")
        body_ty = ir.FunctionType(I32, [PTR] * len(bufs) + [reg_type(v.dtype) for v in f.size_vars] + [PTR])
        body_fn = ir.Function(self.module, body_ty, f"{f.name}.body")
        body_fn.linkage = "internal"
        body_fn.attributes.add("nounwind")
        for arg, buf in zip(body_fn.args, bufs):
            arg.add_attribute("noalias")
            arg.name = buf.name
        for arg, v in zip(body_fn.args[len(bufs):], f.size_vars):
            arg.name = v.name
            self.env[v] = arg
        body_fn.args[-1].name = "err"
        body_fn.args[-1].add_attribute("noalias")
        self.env[ERR] = body_fn.args[-1]
        self.entry = body_fn.append_basic_block("entry")
        self.builder = ir.IRBuilder(self.entry)
        for arg, buf in zip(body_fn.args, bufs):
            self.buffers[buf] = (arg, [self.dim(d) for d in buf.shape])
        self.fail_bb = body_fn.append_basic_block("out_of_memory")
        self.num_threads_global()
        for cond, site in f.entry_checks:  # sizes under which an affine access would leave its tensor
            self.fail_unless(self.builder.not_(self.expr(cond)), site, ir.Constant(I64, 0))
        self.stmt(f.body)
        self.builder.ret(ir.Constant(I32, 0))
        ir.IRBuilder(self.fail_bb).ret(ir.Constant(I32, 1))
        self.emit_entry_point(body_fn, bufs, checked=False)
        self.emit_entry_point(body_fn, bufs, checked=True)

    # -- bounds checks ------------------------------------------------------------
    def fail_unless(self, ok: ir.Value, site: int, value: ir.Value) -> None:
        """Go on where ``ok``; else record (``site``, ``value``) in the error record and stop (status 4)."""
        b = self.builder
        fn = b.function
        fail, cont = fn.append_basic_block(f"check{site}.fail"), fn.append_basic_block(f"check{site}.ok")
        br = b.cbranch(ok, cont, fail)
        br.set_weights([1 << 20, 1])
        b.position_at_end(fail)
        err = self.env[ERR]
        pair = b.cmpxchg(err, ir.Constant(I64, 0), ir.Constant(I64, site), "monotonic", "monotonic")
        with b.if_then(b.extract_value(pair, 1)):  # the first failing check (of any thread) says what failed
            b.store(value, b.gep(err, [ir.Constant(I64, 1)], inbounds=True, source_etype=I64))
        b.branch(self.bounds_exit())
        b.position_at_end(cont)

    def bounds_exit(self) -> ir.Block:
        """The block that frees the heap buffers live here and returns status 4 (one per scope)."""
        fn = self.builder.function
        key = (id(fn), tuple(id(h) for h in self.heaps))
        if key not in self.exits:
            bb = fn.append_basic_block("bounds_error")
            eb = ir.IRBuilder(bb)
            for h in reversed(self.heaps):
                eb.call(self.libc("free", ir.VoidType(), [PTR]), [h])
            eb.ret(ir.Constant(I32, BOUNDS_STATUS))
            self.exits[key] = bb
        return self.exits[key]

    def emit_entry_point(self, body_fn: ir.Function, bufs: list[Buffer], checked: bool) -> None:
        """``int32_t name(void **args, int64_t *sizes)``, or with ``checked`` ``name_checked(..., int64_t *err)``."""
        f = self.func
        fn = ir.Function(self.module, ir.FunctionType(I32, [PTR] * (3 if checked else 2)),
                         f"{f.name}_checked" if checked else f.name)
        fn.attributes.add("nounwind")
        fn.args[0].name, fn.args[1].name = "args", "sizes"
        for a in fn.args:
            a.add_attribute("noalias")
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        if checked:
            fn.args[2].name = "err"
            err = fn.args[2]
        else:  # nobody reads which check failed: a record of the call's own
            err = b.alloca(ir.ArrayType(I64, 3), name="err")
            err.type = PTR
            b.store(ir.Constant(ir.ArrayType(I64, 3), [0, 0, 0]), err)
        vals = []
        for i, buf in enumerate(bufs):
            slot = b.gep(fn.args[0], [ir.Constant(I64, i)], inbounds=True, source_etype=PTR)
            vals.append(b.load(slot, name=buf.name, typ=PTR))
        for j, v in enumerate(f.size_vars):
            slot = b.gep(fn.args[1], [ir.Constant(I64, j)], inbounds=True, source_etype=I64)
            x = b.load(slot, name=v.name, typ=I64)
            vals.append(self.cast_size(b, x, v.dtype))
        b.ret(b.call(body_fn, vals + [err]))

    @staticmethod
    def cast_size(b: ir.IRBuilder, x: ir.Value, dtype: str) -> ir.Value:
        if not dt.is_int(dtype):
            raise InternalError(f"internal error in LLVM codegen: size variable of dtype {dtype}")
        t = reg_type(dtype)
        return x if t.width == 64 else b.trunc(x, t)

    def dim(self, e: Expr) -> ir.Value:
        return self.to_i64(self.expr(e), e.dtype)

    # -- statements -------------------------------------------------------------
    def stmt(self, s: Stmt) -> None:
        b = self.builder
        if isinstance(s, Block):
            for x in s.stmts:
                self.stmt(x)
        elif isinstance(s, Store):
            if s.value.dtype != s.buffer.dtype:
                raise InternalError(f"internal error in LLVM codegen: storing a {s.value.dtype} value into "
                                    f"{s.buffer.name}: {s.buffer.dtype} needs a Cast")
            value = self.to_memory(self.expr(s.value), s.buffer.dtype)
            b.store(value, self.address(s.buffer, s.indices))
        elif isinstance(s, For):
            self.loop(s)
        elif isinstance(s, If):
            self.branch(s)
        elif isinstance(s, LetStmt):
            self.env[s.var] = self.expr(s.value)
            self.stmt(s.body)
            del self.env[s.var]
        elif isinstance(s, Allocate):
            self.allocate_buffer(s.buffer, lambda: self.stmt(s.body))
        else:
            raise InternalError(f"internal error in LLVM codegen: unknown statement {type(s).__name__}")

    def loop(self, s: For) -> None:
        if s.kind == "parallel":
            self.parallel_loop(s)
        elif s.kind == "vectorize":
            self.vector_loop(s)
        elif s.kind in _LOOP_MD:
            if s.kind == "serial" and self.lane_fold(s):
                return
            self.serial_loop(s)
        else:
            raise InternalError(f"internal error in LLVM codegen: unknown loop kind {s.kind!r}")

    def counted_loop(self, name: str, t: ir.IntType, start: ir.Value, stop: ir.Value, step: int,
                     signed: bool, emit: Any) -> None:
        """``for (c = start; c < stop; c += step) emit(c)`` (``step`` divides ``stop - start``)."""
        b = self.builder
        pre = b.block
        fn = b.function
        head, body, done = (fn.append_basic_block(f"{name}.{n}") for n in ("head", "body", "done"))
        b.branch(head)
        b.position_at_end(head)
        c = b.phi(t, name=name)
        c.add_incoming(start, pre)
        b.cbranch((b.icmp_signed if signed else b.icmp_unsigned)("<", c, stop), body, done)
        b.position_at_end(body)
        emit(c)
        nxt = b.add(c, ir.Constant(t, step), flags=("nsw",) if signed else ("nuw",))
        c.add_incoming(nxt, b.block)
        b.branch(head)
        b.position_at_end(done)

    def serial_loop(self, s: For, kind: str | None = None) -> None:
        """A counted loop; ``kind`` (default the loop's) picks the LLVM loop metadata."""
        kind = kind or s.kind
        b = self.builder
        t = reg_type(s.var.dtype)
        lo = self.cast(self.expr(s.min), s.min.dtype, s.var.dtype)
        hi = b.add(lo, self.cast(self.expr(s.extent), s.extent.dtype, s.var.dtype))
        fn = b.function
        pre = b.block
        head, body, done = (fn.append_basic_block(f"{s.var.name}.{n}") for n in ("head", "body", "done"))
        b.branch(head)
        b.position_at_end(head)
        i = b.phi(t, name=s.var.name)
        i.add_incoming(lo, pre)
        cmp = b.icmp_unsigned if s.var.dtype.startswith("uint") else b.icmp_signed
        b.cbranch(cmp("<", i, hi), body, done)
        b.position_at_end(body)
        self.env[s.var] = i
        self.stmt(s.body)
        del self.env[s.var]
        nxt = b.add(i, ir.Constant(t, 1), flags=("nsw",) if not s.var.dtype.startswith("uint") else ())
        i.add_incoming(nxt, b.block)
        latch = b.branch(head)
        if _LOOP_MD[kind]:
            latch.set_metadata("llvm.loop", self.loop_id(kind))
        b.position_at_end(done)

    def loop_id(self, kind: str) -> ir.MDValue:
        self.loops += 1
        ops: list[Any] = [ir.MetaDataString(self.module, f"cuvil.loop.{self.loops}")]
        for key, val in _LOOP_MD[kind]:
            item: list[Any] = [ir.MetaDataString(self.module, key)]
            if val is not None:
                item.append(ir.Constant(ir.IntType(1), int(val)))
            ops.append(self.module.add_metadata(item))
        return self.module.add_metadata(ops)

    def branch(self, s: If) -> None:
        b = self.builder
        cond = self.expr(s.cond)
        if s.else_body is None:
            with b.if_then(cond):
                self.stmt(s.then_body)
            return
        with b.if_else(cond) as (then, otherwise):
            with then:
                self.stmt(s.then_body)
            with otherwise:
                self.stmt(s.else_body)

    def allocate_buffer(self, buf: Buffer, emit_body: Any) -> None:
        """Storage for ``buf`` while ``emit_body()`` emits the statements that use it."""
        b = self.builder
        elem = mem_type(buf.dtype)
        dims = [self.dim(d) for d in buf.shape]
        count = _const_size(buf.shape)
        heap = None
        if count is not None and count * dt.nbytes(buf.dtype) <= self.stack_limit:
            with b.goto_block(self.entry):
                b.position_at_start(self.entry)
                ptr = b.alloca(elem, size=ir.Constant(I64, max(count, 1)), name=buf.name)
                ptr.align = 64
            ptr.type = PTR  # opaque pointers (llvmlite types allocas; LLVM has only ptr)
        else:
            # bytes = prod(dims) * element size; a negative dim or an overflow fails like malloc
            nbytes: ir.Value = ir.Constant(I64, dt.nbytes(buf.dtype))
            bad: ir.Value = ir.Constant(ir.IntType(1), 0)
            for d in dims:
                prod = b.smul_with_overflow(nbytes, d)
                nbytes = b.extract_value(prod, 0)
                bad = b.or_(bad, b.or_(b.extract_value(prod, 1), b.icmp_signed("<", d, ir.Constant(I64, 0))))
            nbytes = b.select(b.icmp_signed(">", nbytes, ir.Constant(I64, 0)), nbytes, ir.Constant(I64, 1))
            sized, ok = b.append_basic_block(f"{buf.name}.sized"), b.append_basic_block(f"{buf.name}.ok")
            b.cbranch(bad, self.fail_bb, sized)
            b.position_at_end(sized)
            # 64-byte aligned (a cache line, one AVX-512 vector) like the stack buffers: with malloc's 16 bytes
            # whether a packed panel's rows straddled cache lines depended on the process's heap (8x48 tiles of
            # an A^T B^T 512^3 matmul: 2.11 -> 1.90 ms)
            nbytes = b.and_(b.add(nbytes, ir.Constant(I64, 63)), ir.Constant(I64, -64))
            ptr = heap = b.call(self.libc("aligned_alloc", PTR, [I64, I64]), [ir.Constant(I64, 64), nbytes],
                                name=buf.name)
            b.cbranch(b.icmp_unsigned("==", ptr, ir.Constant(PTR, None)), self.fail_bb, ok)
            b.position_at_end(ok)
        self.buffers[buf] = (ptr, dims)
        if heap is not None:
            self.heaps.append(heap)
        emit_body()
        del self.buffers[buf]
        if heap is not None:
            self.heaps.pop()
            b.call(self.libc("free", ir.VoidType(), [PTR]), [heap])

    def libc(self, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
        fn = self.module.globals.get(name)
        if fn is None:
            fn = ir.Function(self.module, ir.FunctionType(ret, args), name)
            fn.attributes.add("nounwind")
        return fn


def _const_size(shape: tuple[Expr, ...]) -> int | None:
    n = 1
    for d in shape:
        if not isinstance(d, Const):
            return None
        n *= int(d.value)
    return n


# -- target machines and the optimisation pipeline ---------------------------------


# (canonical target, relocation model) -> its TargetMachine: a process compiles for a few targets
_MACHINES: BoundedCache[tuple[str, str], llvm.TargetMachine] = BoundedCache("cuvil.codegen.llvm._MACHINES", 32)


def target_machine(target: Target | str, reloc: str = "default") -> llvm.TargetMachine:
    """An LLVM TargetMachine for ``target`` at -O3 (``reloc="pic"`` for shared libraries)."""
    target = Target(target)
    key = (target.canonical, reloc)
    tm = _MACHINES.get(key)
    if tm is None:
        lt = llvm_binding().Target.from_triple(target.triple)
        tm = _MACHINES[key] = lt.create_target_machine(
            cpu=target.cpu, features=target.features, opt=3, reloc=reloc, codemodel="jitdefault" if
            reloc == "default" else "default")
    return tm


def optimize(ir_text: str, target: Target | str, reloc: str = "default") -> llvm.ModuleRef:
    """Parse and verify ``ir_text``, then run LLVM's O3 pipeline for ``target``."""
    llvm_binding()
    mod = llvm.parse_assembly(ir_text)
    mod.verify()
    tm = target_machine(target, reloc)
    pto = llvm.create_pipeline_tuning_options(speed_level=3)
    pto.loop_vectorization = True
    pto.slp_vectorization = True
    pto.loop_unrolling = True
    pb = llvm.create_pass_builder(tm, pto)
    pb.getModulePassManager().run(mod, pb)
    return mod


def assembly(mod: llvm.ModuleRef, target: Target | str) -> str:
    return target_machine(target).emit_assembly(mod)


def object_code(mod: llvm.ModuleRef, target: Target | str) -> bytes:
    """Position-independent object code (for linking into a shared library)."""
    return target_machine(target, "pic").emit_object(mod)


def add_string_constant(ir_text: str, symbol: str, value: str) -> str:
    """Append ``const char *symbol(void)`` returning ``value`` (a NUL-terminated string) to a module."""
    data = value.encode() + b"\0"
    esc = "".join(chr(c) if 32 <= c < 127 and c not in (34, 92) else f"\\{c:02X}" for c in data)
    n = len(data)
    return ir_text + (
        f'\n@"{symbol}.data" = private unnamed_addr constant [{n} x i8] c"{esc}", align 1\n'
        f'define ptr @"{symbol}"() nounwind {{\n  ret ptr @"{symbol}.data"\n}}\n'
    )


__all__ = ["PARALLEL_STACK_LIMIT", "STACK_LIMIT", "InternalError", "add_string_constant", "assembly", "codegen_llvm",
           "object_code", "optimize", "simd_bits", "target_machine"]
