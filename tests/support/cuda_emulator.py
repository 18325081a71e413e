"""Run the CUDA C that cuvil generates on the CPU, with CUDA's execution model, to check its results.

Without a GPU the PTX can only be assembled; this runs the same CUDA C source
compiled as C++ (g++): each block of the grid in turn, each of its threads a
real thread (``threadIdx``/``blockIdx`` are thread-local), ``__syncthreads()`` a
barrier of the block's threads, ``__shared__`` arrays one per block (blocks run
one after the other).  A missing barrier or a wrong thread guard shows up as a
wrong result or a race, as it would on a GPU; only the float16 conversions
and the math library differ from the device's.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
from typing import Any

import numpy as np

from cuvil.codegen.cuda_expr import MEM_TYPES

_HEADER = r"""
#include <barrier>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>
#include <math.h>
struct cuvil_dim3 { unsigned x, y, z; };
static thread_local cuvil_dim3 threadIdx, blockIdx;
static thread_local std::barrier<>* cuvil_bar;
#define CUVIL_EMULATE 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(n)
static inline void __syncthreads() { cuvil_bar->arrive_and_wait(); }
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline double __longlong_as_double(long long i) { double f; memcpy(&f, &i, 8); return f; }
"""


def _runner(program: Any) -> str:
    out = []
    for k in program.kernels:
        args = [f"({MEM_TYPES[b.dtype]} *)bufs[{i}]" for i, b in enumerate(program.buffers)]
        args += [f"sizes[{j}]" for j in range(len(program.size_vars))]
        out.append(f"""
extern "C" void run_{k.name}(void **bufs, long long *sizes, unsigned gx, unsigned gy, unsigned gz,
                              unsigned bx, unsigned by, unsigned bz) {{
  for (unsigned z = 0; z < gz; z++) for (unsigned y = 0; y < gy; y++) for (unsigned x = 0; x < gx; x++) {{
    std::barrier<> bar(bx * by * bz);
    std::vector<std::thread> team;
    for (unsigned tz = 0; tz < bz; tz++) for (unsigned ty = 0; ty < by; ty++) for (unsigned tx = 0; tx < bx; tx++)
      team.emplace_back([&, tx, ty, tz] {{
        threadIdx = {{tx, ty, tz}}; blockIdx = {{x, y, z}}; cuvil_bar = &bar;
        {k.name}({", ".join(args)});
      }});
    for (auto &t : team) t.join();
  }}
}}""")
    return "\n".join(out)


def emulate(module: Any, *arrays: np.ndarray) -> None:
    """Call a CudaModule on numpy arrays (outputs written in place) by running its CUDA C on the CPU."""
    program = module.program
    _ptrs, sizes, _keep = module.plan.pack(arrays)  # the same argument checks as on a GPU
    launches, env = module._launches(sizes)
    from cuvil.runtime.cuda import _eval

    with tempfile.TemporaryDirectory(prefix="cuvil-emu-") as tmp:
        src, lib = os.path.join(tmp, "k.cpp"), os.path.join(tmp, "k.so")
        with open(src, "w") as f:
            f.write(_HEADER + program.source + _runner(program))
        proc = subprocess.run(["g++", "-std=c++20", "-O1", "-w", "-shared", "-fPIC", "-pthread", src, "-o", lib],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise AssertionError(f"the generated CUDA C does not compile as C++:\n{proc.stderr[:4000]}")
        dll = ctypes.CDLL(lib)
        bufs = [np.ascontiguousarray(a) if not a.flags.writeable or not a.flags.c_contiguous else a for a in arrays
                if isinstance(a, np.ndarray)]
        for t in program.temporaries:
            n = 1
            for d in t.shape:
                n *= max(0, _eval(d, env))
            junk = np.empty(max(n, 1) * np.dtype(t.dtype).itemsize, np.uint8)
            junk.fill(0xA5)  # an element read before it is written shows
            bufs.append(junk)
        ptrs = (ctypes.c_void_p * max(1, len(bufs)))(*[b.ctypes.data for b in bufs])
        size_arr = (ctypes.c_longlong * max(1, len(program.size_vars)))(
            *[int(sizes[j]) for j in range(len(program.size_vars))])
        for name, grid, block in launches:
            if 0 in grid:
                continue
            getattr(dll, f"run_{name}")(ptrs, size_arr, *[ctypes.c_uint(g) for g in grid],
                                        *[ctypes.c_uint(b) for b in block])
