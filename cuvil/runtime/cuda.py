"""The CUDA runtime module: a LoweredFunc as CUDA C, compiled to PTX by NVRTC, run on a GPU.

    m = CudaModule(func, "cuda -arch=sm_90")   # CUDA C -> PTX (no GPU needed)
    m.get_source("cuda"), m.get_source("ptx")  # also "loops"
    m.check_ptx()                               # ptxas -arch=sm_90 (no GPU needed)
    m(a, b, c)                                  # numpy arrays: copied in, kernels launched, outputs copied out
    m.time(a, b, c)                             # median seconds of the kernels alone (CUDA events)

Calls take the same arguments as a CPU module (shapes and dtypes checked by
the same CallPlan).  Without a GPU, a call raises TargetError saying why.
"""

from __future__ import annotations

import ctypes
import statistics
from typing import Any

import numpy as np

from cuvil.errors import ArgumentError, TargetError
from cuvil.runtime.call import CallPlan
from cuvil.runtime.meta import func_meta


def _eval(e: Any, env: dict[int, int]) -> int:
    """An integer expression of the sizes (a launch dimension or a buffer size), on the host."""
    from cuvil.ir.expr import Binary, Cast, Const, Var

    if isinstance(e, Const):
        return int(e.value)
    if isinstance(e, Var):
        if id(e) not in env:
            raise TargetError(f"the launch shape needs {e.name}, which is not known before the kernels run")
        return env[id(e)]
    if isinstance(e, Cast):
        return _eval(e.value, env)
    if isinstance(e, Binary):
        a, b = _eval(e.a, env), _eval(e.b, env)
        ops = {"add": lambda: a + b, "sub": lambda: a - b, "mul": lambda: a * b, "min": lambda: min(a, b),
               "max": lambda: max(a, b), "floordiv": lambda: a // b if b else 0, "floormod": lambda: a % b if b else 0}
        if e.op in ops:
            return ops[e.op]()
    raise TargetError(f"cannot evaluate the launch expression {e} on the host")


class CudaModule:
    """A compiled function for an NVIDIA GPU (PTX through NVRTC)."""

    def __init__(self, func: Any, target: Any = "cuda -arch=sm_90"):
        from cuvil.codegen.cuda import codegen_cuda
        from cuvil.codegen.nvrtc import compile_ptx
        from cuvil.target import Target

        self.func = func
        self.target = Target(target)
        if self.target.kind != "cuda":
            raise TargetError(f"CudaModule needs a cuda target, got {self.target.canonical!r}")
        self.meta = func_meta(func, self.target.canonical)
        self.plan = CallPlan(self.meta)
        self.program = codegen_cuda(func)
        self.ptx = compile_ptx(self.program.source, self.target.arch, f"{func.name}.cu")
        self._functions: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return self.plan.name

    def __repr__(self) -> str:
        return f"<cuvil CudaModule {self.plan.signature()} for {self.target.canonical}: " \
               f"{len(self.program.kernels)} kernel(s)>"

    def get_source(self, fmt: str = "cuda") -> str:
        """The code at one stage: "loops", "cuda" (CUDA C) or "ptx"."""
        if fmt == "loops":
            return str(self.func)
        if fmt in ("cuda", "cu"):
            return self.program.source
        if fmt == "ptx":
            return self.ptx
        raise ArgumentError(f"unknown source format {fmt!r} for a CUDA module; use 'loops', 'cuda' or 'ptx'")

    def check_ptx(self) -> str:
        """Assemble the PTX with ptxas for the target's arch; returns ptxas's -v report."""
        from cuvil.codegen.nvrtc import check_ptx

        return check_ptx(self.ptx, self.target.arch)

    def export_library(self, path: Any, cc: str | None = None) -> str:
        raise TargetError("a CUDA module exports no shared library yet; get_source('ptx') gives its PTX")

    # -- running ------------------------------------------------------------------
    def _launches(self, sizes: Any) -> list[tuple[str, tuple[int, int, int], tuple[int, int, int]]]:
        env = {id(v): int(sizes[j]) for j, v in enumerate(self.program.size_vars)}
        for v, value in self.program.lets:
            try:
                env[id(v)] = _eval(value, env)
            except TargetError:
                pass
        out = []
        for k in self.program.kernels:
            grid = tuple(max(0, _eval(g, env)) for g in k.grid)
            out.append((k.name, grid, k.block))
        return out, env  # type: ignore[return-value]

    def _prepare(self, args: tuple[Any, ...]) -> tuple[Any, list[Any], list[int], list[np.ndarray], Any]:
        from cuvil.runtime.cuda_driver import device

        _ptrs, sizes, _keep = self.plan.pack(args)  # checks the arguments like a CPU module
        dev = device()
        if self._functions is None:
            self._functions = dev.load(self.ptx, [k.name for k in self.program.kernels])
        launches, env = self._launches(sizes)
        arrays = [a for a in args if isinstance(a, np.ndarray)]
        ptrs = []
        for a in arrays:
            p = dev.alloc(a.nbytes)
            ptrs.append(p)
            dev.to_device(p, np.ascontiguousarray(a))
        for buf in self.program.temporaries:
            n = 1
            for d in buf.shape:
                n *= max(0, _eval(d, env))
            ptrs.append(dev.alloc(n * np.dtype(buf.dtype).itemsize))
        params = [ctypes.c_uint64(p) for p in ptrs] + [ctypes.c_longlong(int(sizes[j]))
                                                      for j in range(len(self.program.size_vars))]
        return dev, launches, ptrs, arrays, params

    def _run(self, dev: Any, launches: Any, params: list[Any]) -> None:
        assert self._functions is not None
        for name, grid, block in launches:
            if 0 in grid:
                continue  # an empty grid: nothing to compute
            dev.launch(self._functions[name], grid, block, params)

    def __call__(self, *args: Any) -> None:
        dev, launches, ptrs, arrays, params = self._prepare(args)
        try:
            self._run(dev, launches, params)
            dev.synchronize()
            for slot in self.plan.outputs:
                dev.to_host(arrays[slot], ptrs[slot])
        finally:
            for p in ptrs:
                dev.free(p)

    def time(self, *args: Any, number: int = 10, repeat: int = 5) -> float:
        """Median seconds per call of the kernels (device buffers copied in once; CUDA events)."""
        dev, launches, ptrs, _arrays, params = self._prepare(args)
        try:
            self._run(dev, launches, params)  # warm up
            dev.synchronize()
            runs = []
            for _ in range(max(1, repeat)):
                start, stop = dev.timer()
                start()
                for _ in range(max(1, number)):
                    self._run(dev, launches, params)
                runs.append(stop() / 1e3 / max(1, number))
            return statistics.median(runs)
        finally:
            for p in ptrs:
                dev.free(p)


__all__ = ["CudaModule"]
