"""Native threads for ``For(kind="parallel")`` loops (a mixin of the LLVM function emitter).

A parallel loop ``parallel for (i = lo; i < lo + E; i++) body`` is outlined
into two internal functions and launched with libgomp's ``GOMP_parallel``::

    ; in the enclosing function
    closure = { status*, next*, lo, E, <every buffer pointer and dimension in scope>,
                <every variable in scope> }            ; a struct on the stack
    next = 0
    GOMP_parallel(@name.par0, &closure, @name.num_threads, 0)
    if (status != 0) return status                     ; 1: a worker's malloc failed, 4: a bounds check

    void name.par0(ptr closure)                        ; run by every thread of the team
      t = omp_get_thread_num(); R = min(omp_get_num_threads(), RANGES)
      grain = max(1, E / (GRAINS_PER_THREAD * R))
      if ((rc = name.par0.chunk(<closure fields>, next*, grain, E, t, R)) != 0) atomic max rc -> *status

    i32 name.par0.chunk(ptr noalias A, ..., ptr next, i64 grain, i64 E, i64 t, i64 R)
      <per-thread Allocates>                           ; see below
      for (k = 0; k < R; k++)                          ; its own range first, then the others'
        r = (t % R + k) % R                            ; range r: [r*E/R, (r+1)*E/R)
        while ((c0 = atomic next[r] += grain) < size(r))  ; the next grain of range r
          for (c = c0; c < min(c0 + grain, size(r)); c++) body with i = lo + r*E/R + c

Each thread owns one contiguous range of the iterations (``t*E/R`` up to ``(t+1)*E/R``) and takes it a
grain at a time (about GRAINS_PER_THREAD grains), then takes what is left of the other ranges.  When every
thread runs on time, thread t runs exactly the iterations it ran in the kernel before, and the one after:
a chain of kernels split the same way finds the rows it reads in its own core's cache (2 threads,
MobileNetV2's 3x3 depthwise convolutions at 14x14x384: 26.6 us at 1 thread, 37.5 at 2 when any thread
took any grain, 22.4 at 2 with owned ranges; quiet Zen 4).  A thread that starts late (woken from sleep, or descheduled
on a shared machine) finds its range taken by the others instead of holding the whole team at the closing
barrier with its share.  Grains of a quarter of a share keep each thread on neighbouring tiles (2 threads,
conv 3x3 64@56: 2 grains per thread 1.28 ms, 4 1.31, 8 1.50; the stride-2 conv 128@56 wants at least 4:
2 grains 2.08 ms, 4 1.56).

The chunk function takes the buffers as ``noalias`` pointers (as the main body
does), so after inlining LLVM keeps the aliasing facts across the closure.
An ``Allocate`` whose shape does not depend on ``i`` and that wraps the whole
loop body is hoisted to the chunk: one buffer per thread, not per iteration.
Other Allocates inside the body are made per iteration, inside the thread.
Stack buffers inside a parallel body are limited to ``PARALLEL_STACK_LIMIT``
bytes (worker threads have small stacks); larger ones go to the heap.

The thread count is the module global ``@"<name>.num_threads"`` (0: libgomp
chooses: ``OMP_NUM_THREADS`` or all cores), set through the exported
``void <name>_set_num_threads(int32_t n)``; ``cuvil.runtime.threads`` calls it.
A parallel loop inside another parallel loop is an internal error: the
schedule refuses nested parallelism.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir

from cuvil import dtype as dt
from cuvil.codegen.llvm_expr import I32, I64, PTR, InternalError, reg_type
from cuvil.ir.expr import Expr, Var
from cuvil.ir.functor import walk
from cuvil.ir.stmt import Allocate, For

PARALLEL_STACK_LIMIT = 16 * 1024  # bytes of one stack Allocate inside a parallel body
GRAINS_PER_THREAD = 4  # a parallel loop is handed out in about this many pieces per thread (see _grains)
RANGES = 64  # a parallel loop's iterations are split in at most this many owned ranges (threads share above)


def _uses(e: Expr, var: Var) -> bool:
    return any(n is var for n in walk(e))


class ParallelLoops:
    """Mixin of the LLVM function emitter: ``parallel_loop(s)`` outlines and launches a parallel loop."""

    module: ir.Module
    func: Any
    builder: ir.IRBuilder
    entry: ir.Block
    fail_bb: ir.Block
    env: dict[Var, ir.Value]
    buffers: dict[Any, tuple[ir.Value, list[ir.Value]]]
    in_parallel: bool
    stack_limit: int
    n_parallel: int
    heaps: list[ir.Value]
    bounds_exit: Any

    cast: Any

    def num_threads_global(self) -> ir.GlobalVariable:
        """``@"<name>.num_threads"`` (0 = libgomp's default) and its setter ``<name>_set_num_threads``."""
        name = f"{self.func.name}.num_threads"
        g = self.module.globals.get(name)
        if g is None:
            g = ir.GlobalVariable(self.module, I32, name)
            g.linkage = "internal"
            g.initializer = ir.Constant(I32, 0)
            setter = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [I32]),
                                 f"{self.func.name}_set_num_threads")
            setter.attributes.add("nounwind")
            b = ir.IRBuilder(setter.append_basic_block("entry"))
            n = setter.args[0]
            b.store(b.select(b.icmp_signed("<", n, ir.Constant(I32, 0)), ir.Constant(I32, 0), n), g)
            b.ret_void()
        return g

    def parallel_loop(self, s: For) -> None:
        if self.in_parallel:
            raise InternalError(
                f"internal error in LLVM codegen: parallel loop '{s.var.name}' is nested in another parallel "
                "loop; the schedule must refuse nested parallelism"
            )
        b = self.builder
        t = reg_type(s.var.dtype)
        signed = dt.is_signed(s.var.dtype)
        lo = self.cast(self.expr(s.min), s.min.dtype, s.var.dtype)
        ext = self.cast(self.expr(s.extent), s.extent.dtype, s.var.dtype)
        ext64 = b.sext(ext, I64) if signed and t.width < 64 else (b.zext(ext, I64) if t.width < 64 else ext)
        # the closure: status pointer, lo, extent, then every buffer and variable in scope
        bufs = list(self.buffers.items())
        envs = list(self.env.items())
        fields: list[ir.Value] = [lo, ext64]
        for _buf, (ptr, dims) in bufs:  # constants stay constants in the chunk (alias analysis needs them)
            fields += [ptr, *(d for d in dims if not isinstance(d, ir.Constant))]
        fields += [v for _var, v in envs if not isinstance(v, ir.Constant)]
        struct = ir.LiteralStructType([PTR, PTR] + [f.type for f in fields])
        idx = self.n_parallel
        self.n_parallel += 1
        with b.goto_block(self.entry):
            b.position_at_start(self.entry)
            closure = b.alloca(struct, name=f"par{idx}.closure")
            status = b.alloca(I32, name=f"par{idx}.status")
            nxt = b.alloca(ir.ArrayType(I64, RANGES), name=f"par{idx}.next")
        closure.type = status.type = nxt.type = PTR  # opaque pointers (llvmlite types allocas; LLVM has only ptr)
        b.store(ir.Constant(I32, 0), status)
        b.store(ir.Constant(ir.ArrayType(I64, RANGES), None), nxt)
        for k, v in enumerate([status, nxt, *fields]):
            b.store(v, b.gep(closure, [ir.Constant(I32, 0), ir.Constant(I32, k)], inbounds=True,
                             source_etype=struct))
        chunk_fn = self._chunk_function(s, idx, t, signed, bufs, envs)
        worker = self._worker_function(idx, struct, chunk_fn)
        run_bb, after_bb = b.append_basic_block(f"par{idx}.run"), b.append_basic_block(f"par{idx}.after")
        b.cbranch(b.icmp_signed(">", ext64, ir.Constant(I64, 0)), run_bb, after_bb)
        b.position_at_end(run_bb)
        gomp = self.libc("GOMP_parallel", ir.VoidType(), [PTR, PTR, I32, I32])
        b.call(gomp, [worker, closure, b.load(self.num_threads_global(), typ=I32), ir.Constant(I32, 0)])
        ok_bb, bad_bb = b.append_basic_block(f"par{idx}.ok"), b.append_basic_block(f"par{idx}.failed")
        rc = b.load(status, typ=I32)
        b.cbranch(b.icmp_signed("!=", rc, ir.Constant(I32, 0)), bad_bb, ok_bb)
        b.position_at_end(bad_bb)
        b.cbranch(b.icmp_signed("==", rc, ir.Constant(I32, 4)), self.bounds_exit(), self.fail_bb)
        b.position_at_end(ok_bb)
        b.branch(after_bb)
        b.position_at_end(after_bb)

    def _worker_function(self, idx: int, struct: ir.LiteralStructType, chunk_fn: ir.Function) -> ir.Function:
        fn = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [PTR]), f"{self.func.name}.par{idx}")
        fn.linkage = "internal"
        fn.attributes.add("nounwind")
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        closure = fn.args[0]
        vals = [b.load(b.gep(closure, [ir.Constant(I32, 0), ir.Constant(I32, k)], inbounds=True,
                             source_etype=struct), typ=ty) for k, ty in enumerate(struct.elements)]
        status, nxt, ext = vals[0], vals[1], vals[3]
        nth = b.sext(b.call(self.libc("omp_get_num_threads", I32, []), []), I64)
        tid = b.sext(b.call(self.libc("omp_get_thread_num", I32, []), []), I64)
        ranges = b.select(b.icmp_signed("<", nth, ir.Constant(I64, RANGES)), nth, ir.Constant(I64, RANGES))
        grain = b.sdiv(ext, b.mul(ranges, ir.Constant(I64, GRAINS_PER_THREAD)))
        grain = b.select(b.icmp_signed("<", grain, ir.Constant(I64, 1)), ir.Constant(I64, 1), grain)
        rc = b.call(chunk_fn, [vals[2], *vals[4:], nxt, grain, ext, tid, ranges])
        with b.if_then(b.icmp_signed("!=", rc, ir.Constant(I32, 0))):  # 1 out of memory, 4 a bounds check
            b.atomic_rmw("max", status, rc, "monotonic")
        b.ret_void()
        return fn

    def _chunk_function(self, s: For, idx: int, t: ir.IntType, signed: bool,
                        bufs: list[tuple[Any, tuple[ir.Value, list[ir.Value]]]],
                        envs: list[tuple[Var, ir.Value]]) -> ir.Function:
        types: list[ir.Type] = [t]
        for _buf, (_ptr, dims) in bufs:
            types += [PTR] + [d.type for d in dims if not isinstance(d, ir.Constant)]
        types += [v.type for _var, v in envs if not isinstance(v, ir.Constant)]
        fn = ir.Function(self.module, ir.FunctionType(I32, types + [PTR, I64, I64, I64, I64]),
                         f"{self.func.name}.par{idx}.chunk")
        fn.linkage = "internal"
        fn.attributes.add("nounwind")
        args = list(fn.args)
        saved = (self.builder, self.entry, self.fail_bb, self.env, self.buffers, self.in_parallel,
                 self.stack_limit, self.heaps)
        try:
            self.entry = fn.append_basic_block("entry")
            self.builder = ir.IRBuilder(self.entry)
            self.fail_bb = fn.append_basic_block("out_of_memory")
            ir.IRBuilder(self.fail_bb).ret(ir.Constant(I32, 1))
            self.in_parallel = True
            self.heaps = []
            self.stack_limit = min(self.stack_limit, PARALLEL_STACK_LIMIT)
            lo = args[0]
            pos = 1
            self.buffers = {}
            for buf, (_ptr, dims) in bufs:
                args[pos].add_attribute("noalias")
                args[pos].name = buf.name
                ptr, pos = args[pos], pos + 1
                inner_dims = []
                for d in dims:
                    if isinstance(d, ir.Constant):
                        inner_dims.append(d)
                    else:
                        inner_dims.append(args[pos])
                        pos += 1
                self.buffers[buf] = (ptr, inner_dims)
            self.env = {}
            for var, v in envs:
                if isinstance(v, ir.Constant):
                    self.env[var] = v
                else:
                    args[pos].name = var.name
                    self.env[var] = args[pos]
                    pos += 1
            nxt, grain, ext, tid, ranges = args[pos:pos + 5]

            def body(c: ir.Value) -> None:
                ci = c if t.width == 64 else self.builder.trunc(c, t)
                self.env[s.var] = self.builder.add(lo, ci)
                self.stmt(inner)
                del self.env[s.var]

            # Allocates around the whole body with a shape free of the loop variable: one per thread
            hoisted = []
            inner = s.body
            while isinstance(inner, Allocate) and not any(_uses(d, s.var) for d in inner.buffer.shape):
                hoisted.append(inner.buffer)
                inner = inner.body

            def run(k: int) -> None:
                if k < len(hoisted):
                    self.allocate_buffer(hoisted[k], lambda: run(k + 1))
                else:
                    self._grains(s.var.name, nxt, grain, ext, tid, ranges, body)

            run(0)
            self.builder.ret(ir.Constant(I32, 0))
        finally:
            (self.builder, self.entry, self.fail_bb, self.env, self.buffers, self.in_parallel,
             self.stack_limit, self.heaps) = saved
        return fn

    def _grains(self, name: str, nxt: ir.Value, grain: ir.Value, ext: ir.Value, tid: ir.Value, ranges: ir.Value,
                body: Any) -> None:
        """The iterations this thread takes: for each range r, its own (``tid % ranges``) first, ``while ((c0 =
        atomic_fetch_add(next[r], grain)) < size(r)) for (c = c0; c < min(c0 + grain, size(r)); c++)
        body(first(r) + c)``, where range r is ``[r*ext/ranges, (r+1)*ext/ranges)``."""
        b = self.builder
        one = ir.Constant(I64, 1)
        own = b.srem(tid, ranges)

        def each_range(k: ir.Value) -> None:
            r = b.add(own, k)
            r = b.select(b.icmp_signed("<", r, ranges), r, b.sub(r, ranges))
            first = b.sdiv(b.mul(r, ext), ranges)
            size = b.sub(b.sdiv(b.mul(b.add(r, one), ext), ranges), first)
            counter = b.gep(nxt, [r], inbounds=True, source_etype=I64)
            fn = b.function
            take, done = fn.append_basic_block(f"{name}.take"), fn.append_basic_block(f"{name}.taken")
            b.branch(take)
            b.position_at_end(take)
            start = b.atomic_rmw("add", counter, grain, "monotonic")
            run = fn.append_basic_block(f"{name}.grain")
            b.cbranch(b.icmp_signed("<", start, size), run, done)
            b.position_at_end(run)
            end = b.add(start, grain)
            end = b.select(b.icmp_signed("<", end, size), end, size)
            self.counted_loop(f"{name}.chunk", I64, b.add(first, start), b.add(first, end), 1, True, body)
            b.branch(take)
            b.position_at_end(done)

        self.counted_loop(f"{name}.range", I64, ir.Constant(I64, 0), ranges, 1, True, each_range)
