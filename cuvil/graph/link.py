"""Many lowered kernels -> one LLVM module with one entry point.

A compiled graph is a list of kernel calls over numbered *slots* (buffers)::

    int32_t <entry>(void **slots, int64_t err[3]);    // slots[s]: data pointer of buffer s
      k0_checked(args = {slots[0], slots[3]}, sizes = NULL, err)   // int32_t k_checked(void **, int64_t *, int64_t *)
      k1_checked(args = {slots[3], slots[1], slots[4]}, ...)
      ...                                             // returns the first non-zero status

A kernel whose bounds check fails (status 4) fills ``err[0]`` (the check's site in that kernel) and
``err[1]`` (the index); the entry point adds ``err[2]``, the number of the call, and returns 4.

Every kernel is a :class:`~cuvil.ir.stmt.LoweredFunc` of constant shapes, emitted by the LLVM code
generator into the same module under its own name; a kernel called several times is emitted once.
``void <entry>_set_num_threads(int32_t n)`` sets the thread count of every kernel's parallel loops.
To run here, each kernel is compiled (O3, machine code) into an object file of its own, in worker
processes (:mod:`cuvil.graph.parallel`) and kept in the kernel cache; the JIT loads them beside the entry
point's, and a run is one native call.  An export (:mod:`cuvil.graph.export`) links the same object files
into its ``.so`` (:meth:`LinkedModule.kernel_objects`): each kernel is compiled once.  ``get_source``
takes the whole module through one O3 run.

A kernel is named after its identity (``k`` and 12 hex digits of its cache key's digest, or of its loop
IR's fingerprint), so the kernels of several signatures link into one library side by side, and a
kernel equal in two of them is one object file.

Relocation model (:func:`kernel_reloc`): a shared library needs position-independent code.  On x86-64
the JIT's objects are PIC already (small code model: MCJIT puts each call to another object or a library
through a stub, and an object's code and constants are mapped next to each other), so the export reuses
them as they are; measured on the ResNet block: the same outputs bit for bit and the same run time as
the JIT's former static, large-code-model objects.  Elsewhere (AArch64 hosts, untested with PIC in MCJIT)
the JIT keeps its default model and an export compiles PIC objects of its own.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cuvil.ir.stmt import LoweredFunc

ENTRY = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p)


@dataclass(frozen=True)
class KernelCall:
    """One call of the entry function: ``kernel(slots[args[0]], slots[args[1]], ...)``."""

    kernel: str
    args: tuple[int, ...]


def link_ir(kernels: Sequence[LoweredFunc], calls: Sequence[KernelCall], target: Any, entry: str = "graph") -> str:
    """The LLVM IR text (unoptimised) of the kernels and an entry point that calls them in order."""
    from cuvil.codegen.llvm import finish_ir_text
    from cuvil.target import Target

    tgt = Target(target)
    module = new_module(entry, tgt)
    emit_graph(module, kernels, calls, tgt, entry)
    return finish_ir_text(str(module), tgt)


def new_module(name: str, target: Any) -> Any:
    """An empty llvmlite module with ``target``'s triple and data layout."""
    from llvmlite import ir

    from cuvil.codegen.llvm import target_machine

    module = ir.Module(name=name)
    module.triple = target.triple
    module.data_layout = str(target_machine(target).target_data)
    return module


def kernel_reloc(target: Any) -> str:
    """The relocation model of the kernels' object files the JIT loads: ``"pic"`` where the same objects
    also link into a shared library (x86-64), else LLVM's default for the JIT."""
    return "pic" if target.triple.startswith("x86_64") else "default"


def object_file(module: Any, target: Any, reloc: str = "default") -> bytes:
    """The machine code of llvmlite ``module`` for ``target``: O3, then an object file (``reloc="pic"``:
    position-independent, the small code model)."""
    from cuvil.codegen import llvm as cg

    mod = cg.optimize(cg.finish_ir_text(str(module), target), target, reloc)
    return bytes(cg.target_machine(target, reloc).emit_object(mod))


def emit_graph(module: Any, kernels: Sequence[LoweredFunc], calls: Sequence[KernelCall], target: Any,
               entry: str = "graph", declare: bool = False) -> tuple[Any, Any]:
    """Add the kernels, ``int32_t <entry>(void **slots)`` and ``void <entry>_set_num_threads(int32_t)``
    to the llvmlite ``module``; returns those two functions.  With ``declare`` the kernels are only
    declared (each is compiled into an object file of its own, :func:`cuvil.graph.parallel.kernel_object`)."""
    from llvmlite import ir

    from cuvil.codegen.llvm import emit_function
    from cuvil.codegen.llvm_expr import I32, I64, PTR

    for f in kernels:
        if f.size_vars:
            raise ValueError(f"kernel {f.name}: linked kernels have constant shapes, got sizes {f.size_vars}")
        if not declare:
            emit_function(module, f, target)
        elif f"{f.name}_checked" not in module.globals:  # (another entry in this module declared it)
            ir.Function(module, ir.FunctionType(I32, [PTR, PTR, PTR]), f"{f.name}_checked")
            ir.Function(module, ir.FunctionType(ir.VoidType(), [I32]), f"{f.name}_set_num_threads")
    fn = ir.Function(module, ir.FunctionType(I32, [PTR, PTR]), entry)
    fn.attributes.add("nounwind")
    slots, err = fn.args
    slots.name, err.name = "slots", "err"
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    width = max([len(c.args) for c in calls] + [1])
    argv = b.alloca(ir.ArrayType(PTR, width), name="argv")
    fail = fn.append_basic_block("fail") if calls else None
    status = ir.IRBuilder(fail).phi(I32, name="status") if fail is not None else None
    for n, call in enumerate(calls):
        kfn = module.globals[f"{call.kernel}_checked"]
        for i, s in enumerate(call.args):
            src = b.gep(slots, [ir.Constant(I64, s)], inbounds=True, source_etype=PTR)
            dst = b.gep(argv, [ir.Constant(I64, 0), ir.Constant(I64, i)], inbounds=True)
            b.store(b.load(src, typ=PTR), dst)
        kfn.attributes.add("noinline")
        rc = b.call(kfn, [b.bitcast(argv, PTR), ir.Constant(PTR, None), err])
        ok, failed = fn.append_basic_block(f"call{n}.ok"), fn.append_basic_block(f"call{n}.failed")
        b.cbranch(b.icmp_signed("!=", rc, ir.Constant(I32, 0)), failed, ok)
        fb = ir.IRBuilder(failed)  # which call failed
        fb.store(ir.Constant(I64, n), fb.gep(err, [ir.Constant(I64, 2)], inbounds=True, source_etype=I64))
        fb.branch(fail)
        status.add_incoming(rc, failed)
        b.position_at_end(ok)
    b.ret(ir.Constant(I32, 0))
    if fail is not None:
        ir.IRBuilder(fail).ret(status)
    setter = ir.Function(module, ir.FunctionType(ir.VoidType(), [I32]), f"{entry}_set_num_threads")
    setter.attributes.add("nounwind")
    sb = ir.IRBuilder(setter.append_basic_block("entry"))
    for f in kernels:
        ks = module.globals.get(f"{f.name}_set_num_threads")
        if ks is not None:
            sb.call(ks, [setter.args[0]])
    sb.ret_void()
    return fn, setter


class LinkedModule:
    """The kernels and calls compiled into one JIT-ed native function ``run(slot_pointers)``
    (JIT-ed only when the target is this machine; otherwise only its sources and an export)."""

    def __init__(self, kernels: Sequence[LoweredFunc], calls: Sequence[KernelCall], target: Any,
                 entry: str = "graph", workers: Any = None, kernel_ids: Sequence[str | None] | None = None):
        import llvmlite.binding as llvm

        from cuvil.graph import kernel_cache
        from cuvil.runtime import threads
        from cuvil.target import Target

        self.target = Target(target)
        self.entry = entry
        self.kernels = tuple(kernels)
        self.calls = tuple(calls)
        self.n_slots = 1 + max((s for c in calls for s in c.args), default=-1)
        self.session_threads: int | None = None
        # the same kernels and calls compiled before (kernel_cache): their machine code skips LLVM
        # altogether, their optimised bitcode skips emission and O3 for get_source and export
        # each kernel's identity: its cache key's digest where the graph compiler gives one (the kernel is a
        # function of it), else the fingerprint of its loop IR
        ids = list(kernel_ids) if kernel_ids is not None else [None] * len(self.kernels)
        self.kernel_ids = [i if i is not None else kernel_cache.module_key([k], [], self.target, "kernel")
                           for k, i in zip(self.kernels, ids)]
        self._key = kernel_cache.module_key(self.kernel_ids, self.calls, self.target, entry)
        self._unopt: str | None = None
        self._opt: tuple[Any, str] | None = None  # the O3 module and its IR text, built on first use
        self._pic: list[bytes] | None = None  # the kernels' PIC object files (for an export)
        if not self.target.is_host:  # compiled for another machine: export it (cuvil.graph.export), run it there
            self._engine = None
            self._fn = self._not_here
            return
        tm = llvm.Target.from_triple(self.target.triple).create_target_machine(
            cpu=self.target.cpu, features=self.target.features, opt=3, codemodel="jitdefault")
        objects = self._objects(workers)
        empty = llvm.parse_assembly(f'target triple = "{self.target.triple}"')
        self._engine = llvm.create_mcjit_compiler(empty, tm)
        for obj in objects:
            self._engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
        if any(b"GOMP_parallel" in obj for obj in objects):  # an undefined symbol of the object file
            threads.load_libgomp()
        self._engine.finalize_object()
        self._fn = ENTRY(self._engine.get_function_address(entry))
        self._setter = threads.SETTER(self._engine.get_function_address(f"{entry}_set_num_threads"))
        threads.register(self, self._setter)
        self._set_threads(threads.get_num_threads())

    def _objects(self, workers: Any) -> list[bytes]:
        """The machine code to run: the entry point's object file and one per kernel, each from the
        kernel cache or compiled now (the kernels by ``workers``, :class:`cuvil.graph.parallel.Workers`).
        A kernel's object is keyed by its identity (:attr:`kernel_ids`), its name and the target, so a
        kernel another model compiled before under the same name is not compiled again."""
        from cuvil.graph import kernel_cache

        reloc = kernel_reloc(self.target)
        objects = self._kernel_objects(reloc, workers)
        if reloc == "pic":
            self._pic = objects
        entry = kernel_cache.load_object(f"{self._key}.entry.{reloc}")
        if entry is None:
            module = new_module(self.entry, self.target)
            emit_graph(module, self.kernels, self.calls, self.target, self.entry, declare=True)
            entry = object_file(module, self.target, reloc)
            kernel_cache.store_object(f"{self._key}.entry.{reloc}", entry)
        return [entry, *objects]

    def _kernel_objects(self, reloc: str, workers: Any) -> list[bytes]:
        """Each kernel's object file (relocation model ``reloc``), from the kernel cache or compiled now."""
        from cuvil.graph import kernel_cache, parallel

        keys = [kernel_cache.module_key([f"{k.name} {i}"], [], self.target, f"kernel.{reloc}")
                for k, i in zip(self.kernels, self.kernel_ids)]
        objects = [kernel_cache.load_object(k) for k in keys]
        missing = [i for i, o in enumerate(objects) if o is None]
        todo = [self.kernels[i] for i in missing]
        if workers is None:
            made = [parallel.kernel_object(k, self.target.canonical, reloc) for k in todo]
        else:
            made = workers.map_kernel_objects(todo, self.target.canonical, reloc)
        for i, obj in zip(missing, made):
            objects[i] = obj
            kernel_cache.store_object(keys[i], obj)
        return objects  # type: ignore[return-value]

    def kernel_objects(self) -> list[bytes]:
        """The kernels' position-independent object files, in :attr:`kernels` order, for a shared library:
        those the JIT loaded where they are PIC (each kernel compiled once), else (another machine's
        target, an AArch64 host) from the kernel cache or compiled now, in worker processes."""
        if self._pic is None:
            from cuvil.graph import parallel

            with parallel.Workers(parallel.workers_for(None)) as workers:
                self._pic = self._kernel_objects("pic", workers)
        return self._pic

    def unoptimized(self) -> str:
        """The LLVM IR text of the kernels and the entry point before optimisation."""
        if self._unopt is None:
            self._unopt = link_ir(self.kernels, self.calls, self.target, self.entry)
        return self._unopt

    def optimized(self) -> tuple[Any, str]:
        """The O3-optimised module (llvmlite ModuleRef) and its IR text: from the cached bitcode of
        an earlier compile of the same kernels and calls, else emitted and optimised now (and cached)."""
        if self._opt is None:
            import llvmlite.binding as llvm

            from cuvil.codegen import llvm as cg
            from cuvil.graph import kernel_cache

            bitcode = kernel_cache.load_object(f"{self._key}.bc")
            mod = None
            if bitcode is not None:
                try:
                    mod = llvm.parse_bitcode(bitcode)
                except RuntimeError:  # a damaged entry is a miss
                    mod = None
            if mod is None:
                mod = cg.optimize(self.unoptimized(), self.target)
                kernel_cache.store_object(f"{self._key}.bc", mod.as_bitcode())
            self._opt = (mod, str(mod))
        return self._opt

    def _not_here(self, *_args: Any) -> int:
        from cuvil.errors import TargetError

        raise TargetError(f"this model was compiled for {self.target.canonical!r}, which is not this machine; "
                          "export_library() it and run it there")

    def _set_threads(self, count: int) -> None:
        """Called by cuvil.runtime.threads; a session's own count wins unless set_num_threads was called."""
        from cuvil.runtime import threads

        if self._engine is None:
            return
        if self.session_threads is not None and threads.explicit_num_threads() is None:
            count = self.session_threads
        self._setter(count)

    def get_source(self, fmt: str = "llvm") -> str:
        """"loops" (every kernel's loop nest), "llvm" (optimised), "llvm-unopt" or "asm"."""
        from cuvil.codegen import llvm as cg

        if fmt == "loops":
            return "\n\n".join(str(k) for k in self.kernels)
        if fmt == "llvm":
            return self.optimized()[1]
        if fmt == "llvm-unopt":
            return self.unoptimized()
        if fmt == "asm":
            return cg.assembly(self.optimized()[0], self.target)
        from cuvil.errors import ArgumentError

        raise ArgumentError(f"unknown source format {fmt!r}; use 'loops', 'llvm', 'llvm-unopt' or 'asm'")

    def __call__(self, pointers: Sequence[int], err: Any = None) -> int:
        """One native call with the slots' data pointers; returns the status (0: success)."""
        return self.call_array((ctypes.c_void_p * max(1, len(pointers)))(*pointers), err)

    def call_array(self, arr: Any, err: Any = None) -> int:
        """One native call with the slots' data pointers already in a ctypes array (``void *[n]``);
        ``err`` (``int64_t[3]``, zeros) says which bounds check failed when the status is 4."""
        if err is None:
            err = (ctypes.c_int64 * 3)()
        return int(self._fn(ctypes.addressof(arr), ctypes.addressof(err)))
