"""Per-call Python overhead of a compiled module: a 3-argument element-wise kernel on 16 floats.

Prints the median time of one validated call (argument checks + packing + the
native call), of the native call alone, and of a call to an exported library
loaded with cuvil.runtime.load.  Target: under 10 microseconds per call.

    python benchmarks/call_overhead.py
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import numpy as np

from cuvil.ir import expr as E
from cuvil.ir.expr import Load, Var
from cuvil.ir.stmt import Buffer, For, LoweredFunc, Store
from cuvil.runtime import Module, load


def tiny_kernel() -> LoweredFunc:
    n = Var("int64", "N")
    a, b, c = (Buffer(x, (n,), "float32") for x in "ABC")
    i = Var("int64", "i")
    body = For(i, E.const(0, "int64"), n, Store(c, (i,), Load("float32", a, (i,)) + Load("float32", b, (i,))))
    return LoweredFunc("add3", (a, b, c), body, (n,), (c,))


def median_call(fn, *args, batch: int = 2000, repeat: int = 25) -> float:
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn(*args)
        runs.append((time.perf_counter() - t0) / batch)
    return statistics.median(runs)


def main() -> None:
    m = Module(tiny_kernel(), "llvm")
    a = np.ones(16, np.float32)
    b = np.ones(16, np.float32)
    c = np.empty(16, np.float32)
    ptrs, sizes, _keep = m.plan.pack((a, b, c))
    native = median_call(m._cfunc, ptrs, sizes)
    full = median_call(m, a, b, c)
    with tempfile.TemporaryDirectory() as tmp:
        lib = load(m.export_library(os.path.join(tmp, "add3.so")))
        loaded = median_call(lib, a, b, c)
    print(f"native call only (ctypes):         {native * 1e6:6.2f} us")
    print(f"Module call, 3 arguments:          {full * 1e6:6.2f} us")
    print(f"loaded .so call, 3 arguments:      {loaded * 1e6:6.2f} us")
    print(f"median call time: {full * 1e6:.2f} us (target < 10 us)")


if __name__ == "__main__":
    main()
