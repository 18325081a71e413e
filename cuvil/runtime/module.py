"""The CPU runtime module: a LoweredFunc compiled by LLVM and callable with numpy arrays.

    m = Module(func, "llvm")        # codegen -> O3 -> MCJIT
    m(a, b, c)                      # arguments in func.params order; outputs written in place
    m.get_source("asm")             # "loops" | "llvm" | "llvm-unopt" | "asm"
    m.time(a, b, c)                 # median seconds per call
    m.export_library("k.so")        # k.so + k.h; cuvil.runtime.load("k.so") runs it without llvmlite

The native entry point of every module is ``int32_t <name>(void **args,
int64_t *sizes)`` (see docs/runtime.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from typing import Any

from cuvil.errors import ArgumentError, TargetError
from cuvil.runtime import threads
from cuvil.runtime.call import CFUNC, CFUNC_CHECKED, CallPlan, NativeFunction
from cuvil.runtime.meta import func_meta

_C_TYPES = {
    "float16": "uint16_t /* IEEE half */", "float32": "float", "float64": "double", "bool": "uint8_t /* 0 or 1 */",
    "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
    "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
}


class Module(NativeFunction):
    """A compiled function for a CPU target; JIT-compiled with MCJIT when the target is this host."""

    def __init__(self, func: Any, target: Any = "llvm"):
        from cuvil.codegen import llvm as cg
        from cuvil.target import Target

        self.func = func
        self.target = Target(target)
        bound = _gpu_bound_loop(func.body)
        if bound is not None and self.target.kind == "llvm":
            raise TargetError(f"loop {bound} is bound to a GPU thread (bind); build for a cuda target such as "
                              f"'cuda -arch=sm_90', or leave out bind for {self.target.canonical!r}")
        self.meta = func_meta(func, self.target.canonical)
        self.plan = CallPlan(self.meta)  # validates the signature before compiling anything
        self._ir_unopt = cg.codegen_llvm(func, self.target)
        self._llmod = cg.optimize(self._ir_unopt, self.target)
        self._ir_opt = str(self._llmod)
        self._engine = None
        self._cfunc = self._not_here
        if self.target.is_host:
            self._jit()

    def _jit(self) -> None:
        import llvmlite.binding as llvm

        from cuvil.codegen import llvm as cg

        if self.uses_threads:
            threads.load_libgomp()
        # the engine owns the module and the target machine: give it fresh ones
        mod = llvm.parse_assembly(self._ir_opt)
        tm = llvm.Target.from_triple(self.target.triple).create_target_machine(
            cpu=self.target.cpu, features=self.target.features, opt=3, codemodel="jitdefault")
        self._engine = llvm.create_mcjit_compiler(mod, tm)
        self._engine.finalize_object()
        addr = self._engine.get_function_address(self.func.name)
        if not addr:
            raise cg.InternalError(f"internal error: JIT did not produce the symbol {self.func.name!r}")
        self._cfunc = CFUNC(addr)
        if self.func.checks:  # (a function without checks never returns 4: the plain entry point is enough)
            self._cfunc_checked = CFUNC_CHECKED(self._engine.get_function_address(f"{self.func.name}_checked"))
        setter = self._engine.get_function_address(f"{self.func.name}_set_num_threads")
        if setter:
            threads.register(self, threads.SETTER(setter))

    @property
    def uses_threads(self) -> bool:
        """True if a parallel loop runs on libgomp (exported libraries then link -lgomp)."""
        return "@\"GOMP_parallel\"" in self._ir_unopt

    def _not_here(self, *_args: Any) -> int:
        raise TargetError(f"{self.func.name} was compiled for {self.target.canonical!r}, which is not this "
                          "machine; export_library() it and run it there")

    def get_source(self, fmt: str = "llvm") -> str:
        """The code at one stage: "loops", "llvm" (optimised), "llvm-unopt" or "asm"."""
        from cuvil.codegen import llvm as cg

        if fmt == "loops":
            return str(self.func)
        if fmt == "llvm":
            return self._ir_opt
        if fmt == "llvm-unopt":
            return self._ir_unopt
        if fmt in ("asm", "s"):
            return cg.assembly(self._llmod, self.target)
        raise ArgumentError(f"unknown source format {fmt!r}; use 'loops', 'llvm', 'llvm-unopt' or 'asm'")

    def export_library(self, path: str | os.PathLike[str], cc: str | None = None) -> str:
        """Write a shared library at ``path`` and a C header beside it (suffix ``.h``).

        ``cc`` links the object file (default ``cc`` on the host; a cross compiler such as
        ``aarch64-linux-gnu-gcc`` for another triple).  Returns the path of the library.
        """
        from cuvil.codegen import llvm as cg

        name = self.func.name
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ArgumentError(f"function name {name!r} is not a C identifier; cannot export it")
        if cc is None:
            cc = "cc" if self.target.is_host else cross_compiler(self.target.triple)
        if shutil.which(cc) is None:
            raise TargetError(f"cannot link a shared library: the C compiler {cc!r} is not on PATH")
        path = os.fspath(path)
        meta_json = json.dumps(self.meta, separators=(",", ":"))
        text = cg.add_string_constant(self._ir_unopt, f"cuvil_meta_{name}", meta_json)
        text = cg.add_string_constant(text, "cuvil_module_meta", json.dumps({"abi": self.meta["abi"],
                                                                              "functions": [name]}))
        obj = cg.object_code(cg.optimize(text, self.target, reloc="pic"), self.target)
        with tempfile.TemporaryDirectory(prefix="cuvil-") as tmp:
            obj_path = os.path.join(tmp, f"{name}.o")
            with open(obj_path, "wb") as f:
                f.write(obj)
            libs = ["-lm"] + (["-lgomp"] if self.uses_threads else [])
            proc = subprocess.run([cc, "-shared", "-o", path, obj_path, *libs], capture_output=True, text=True)
            if proc.returncode != 0:
                raise TargetError(f"linking {path} with {cc} failed:\n{proc.stderr.strip()}")
        with open(os.path.splitext(path)[0] + ".h", "w") as f:
            f.write(c_header(self.meta, self.uses_threads))
        return path


def _gpu_bound_loop(s: Any) -> str | None:
    """The name of a loop bound to blockIdx/threadIdx in ``s``, if any."""
    from cuvil.ir.stmt import GPU_TAGS, For, sub_stmts

    stack = [s]
    while stack:
        x = stack.pop()
        if isinstance(x, For) and x.kind in GPU_TAGS:
            return f"{x.var.name} ({x.kind})"
        stack.extend(sub_stmts(x))
    return None


def cross_compiler(triple: str) -> str:
    """The GNU cross compiler that links for ``triple`` (``aarch64-linux-gnu-gcc``), if it is on PATH."""
    arch = triple.split("-")[0]
    names = [f"{arch}-linux-gnu-gcc", f"{triple}-gcc"]
    for name in names:
        if shutil.which(name):
            return name
    raise TargetError(f"exporting for {triple!r} needs a cross linker: none of {', '.join(names)} is on PATH "
                      f"(Debian: apt-get install gcc-{arch.replace('_', '-')}-linux-gnu), or pass cc=...")


def c_header(meta: dict[str, Any], uses_threads: bool = False) -> str:
    """A C header declaring the entry point and documenting its arguments."""
    name = meta["name"]
    guard = f"CUVIL_{name.upper()}_H"
    lines = [
        f"/* Generated by cuvil for {meta['target']}. */",
        f"#ifndef {guard}", f"#define {guard}", "#include <stdint.h>", "", "#ifdef __cplusplus",
        'extern "C" {', "#endif", "", f"/* {name}: returns 0 on success, 1 if a temporary allocation failed, 4 if a",
        " * bounds check failed (an index read from an input, or sizes for which an access would leave its",
        f" * tensor: nothing outside the tensors was touched; {name}_checked says which check).",
        " *",
        " * args[i]: data pointer of the i-th tensor (dense, row-major, C-contiguous):",
    ]
    i = 0
    for p in meta["params"]:
        if p["kind"] == "buffer":
            role = "output" if p["output"] else "input"
            lines.append(f" *   args[{i}] = {p['name']}: {_C_TYPES[p['dtype']]}[{', '.join(p['shape_str'])}] ({role})")
            i += 1
    lines.append(" * sizes[j]: value of each size variable (int64_t):")
    for j, v in enumerate(meta["size_vars"]):
        lines.append(f" *   sizes[{j}] = {v}")
    lines += [
        " * Outputs must not overlap any other argument. */",
        f"int32_t {name}(void **args, int64_t *sizes);", "",
        f"/* {name} that also fills err (three zeros before the call) when it returns 4: err[0] the failed",
        f" * check, numbered from 1 as in the \"checks\" list of cuvil_meta_{name}(), err[1] the index. */",
        f"int32_t {name}_checked(void **args, int64_t *sizes, int64_t err[3]);", "",
        f"/* Threads for the parallel loops of {name} from now on; n <= 0 (the default) lets libgomp",
        " * choose (OMP_NUM_THREADS, else all cores). Each call runs one thread team; calls from",
        " * several threads at once are safe.",
        (" * Parallel loops run on libgomp (GCC's OpenMP runtime): the library is linked with -lgomp. */"
         if uses_threads else f" * ({name} has no parallel loop: this only records n.) */"),
        f"void {name}_set_num_threads(int32_t n);", "",
        "/* The signature above as JSON (what cuvil.runtime.load reads). */",
        f"const char *cuvil_meta_{name}(void);", "", "#ifdef __cplusplus", "}", "#endif", f"#endif /* {guard} */", "",
    ]
    return "\n".join(lines)
