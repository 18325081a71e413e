"""Unscheduled cuvil matmul vs a naive C triple loop (gcc -O2) vs numpy.

The floor of issue #2: the default (unscheduled) loops carry no per-element
overhead, so they run at least as fast as the same loop nest written in C.

    python benchmarks/naive_c.py [--size 512] [--repeat 5]

Prints median times and the ratio naive-C / cuvil (>= 1 means cuvil is as
fast or faster). numpy (OpenBLAS) is shown for scale; unset OPENBLAS_CORETYPE
and OPENBLAS_L2_SIZE in this command's environment for a fair numpy figure.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile

import numpy as np

import cuvil
from cuvil import te
from cuvil.bench.ops import median_time
from cuvil.te import ops

C_SOURCE = r"""
#include <stdint.h>
void matmul(const float *A, const float *B, float *C, int64_t M, int64_t N, int64_t K) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            C[i * N + j] = 0.0f;
            for (int64_t k = 0; k < K; k++)
                C[i * N + j] += A[i * K + k] * B[k * N + j];
        }
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    n = args.size
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)

    A = te.placeholder((n, n), name="A")
    B = te.placeholder((n, n), name="B")
    C = ops.matmul(A, B)
    f = cuvil.build(te.create_schedule(C), [A, B, C])
    c1 = np.empty((n, n), np.float32)
    c2 = np.empty((n, n), np.float32)

    with tempfile.TemporaryDirectory() as d:
        src, lib = os.path.join(d, "m.c"), os.path.join(d, "m.so")
        with open(src, "w") as fh:
            fh.write(C_SOURCE)
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", lib, src], check=True)
        so = ctypes.CDLL(lib)
        so.matmul.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
        # interleaved runs: on a shared machine, whichever ran second was measured slower
        ours, theirs = [], []
        for _ in range(args.repeat):
            ours.append(median_time(lambda: f(a, b, c1), 1))
            theirs.append(median_time(lambda: so.matmul(a.ctypes.data, b.ctypes.data, c2.ctypes.data, n, n, n), 1))
        t_cuvil, t_c = float(np.median(ours)), float(np.median(theirs))
    t_np = median_time(lambda: a @ b, args.repeat)

    assert np.allclose(c1, c2, rtol=1e-4, atol=1e-4), "cuvil and C disagree"
    gflop = 2 * n**3 / 1e9
    print(f"matmul {n}^3 fp32, 1 thread, unscheduled loops (median of {args.repeat}, cuvil and C interleaved)")
    print(f"  cuvil        {t_cuvil * 1e3:9.2f} ms  {gflop / t_cuvil:7.2f} GFLOP/s")
    print(f"  naive C -O2  {t_c * 1e3:9.2f} ms  {gflop / t_c:7.2f} GFLOP/s")
    print(f"  numpy        {t_np * 1e3:9.2f} ms  {gflop / t_np:7.2f} GFLOP/s")
    print(f"  ratio naive-C / cuvil = {t_c / t_cuvil:.2f} (>= 1: cuvil at least as fast)")
    print(f"  ratio numpy / cuvil   = {t_np / t_cuvil:.3f}")


if __name__ == "__main__":
    main()
