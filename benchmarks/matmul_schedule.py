"""A hand-scheduled fp32 matmul (issue #3's schedule) beside numpy, at 1 and 2 threads.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/matmul_schedule.py [--size 1024]

numpy is pinned to the same thread count (threadpoolctl when installed, else
OPENBLAS_NUM_THREADS in a subprocess). Prints medians, GFLOP/s and the ratio
cuvil / numpy (1.0 = as fast as numpy).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def median_time(fn, repeat: int) -> float:
    fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def schedule(n: int, pack: bool):
    from cuvil import te

    A = te.placeholder((n, n), name="A")
    B = te.placeholder((n, n), name="B")
    k = te.reduce_axis((0, n), name="k")
    C = te.compute((n, n), lambda i, j: te.sum(A[i, k] * B[k, j], axis=k), name="C")
    s = te.create_schedule(C)
    CC = s.cache_write(C, "local")
    i, j = s[C].op.axis
    io, jo, ii, ji = s[C].tile(i, j, 4, 64)
    f = s[C].fuse(io, jo)
    s[C].parallel(f)
    s[C].vectorize(ji)
    s[CC].compute_at(s[C], f)
    ci, cj = s[CC].op.axis
    (ck,) = s[CC].op.reduce_axis
    s[CC].reorder(ck, ci, cj)
    s[CC].unroll(ci)
    s[CC].vectorize(cj)
    return s, [A, B, C]


def numpy_time(n: int, threads: int, repeat: int) -> float:
    """numpy's matmul time at ``threads`` threads, in a fresh process (the BLAS reads its env at start)."""
    code = (
        "import numpy as np, time, json\n"
        f"a = np.random.rand({n}, {n}).astype(np.float32); b = np.random.rand({n}, {n}).astype(np.float32)\n"
        "a @ b\n"
        "ts = []\n"
        f"for _ in range({repeat}):\n"
        "    t0 = time.perf_counter(); a @ b; ts.append(time.perf_counter() - t0)\n"
        "print(json.dumps(float(np.median(ts))))\n"
    )
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    import cuvil

    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    n = args.size
    t0 = time.perf_counter()
    s, tensors = schedule(n, pack=False)
    f = cuvil.build(s, tensors)
    t_build = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty((n, n), np.float32)
    f(a, b, c)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    err = float(np.max(np.abs(c - ref)) / np.max(np.abs(ref)))
    gflop = 2 * n**3 / 1e9
    print(f"matmul {n}^3 fp32, hand schedule (tile 4x64, register tile, vectorize, parallel); "
          f"build {t_build:.2f} s, max rel err {err:.1e}")
    print(f"{'threads':>8}{'cuvil ms':>11}{'GFLOP/s':>9}{'numpy ms':>11}{'GFLOP/s':>9}{'cuvil/numpy':>13}")
    for th in [int(x) for x in args.threads.split(",")]:
        cuvil.set_num_threads(th)
        t_c = median_time(lambda: f(a, b, c), args.repeat)
        t_n = numpy_time(n, th, args.repeat)
        print(f"{th:>8}{t_c * 1e3:>11.2f}{gflop / t_c:>9.1f}{t_n * 1e3:>11.2f}{gflop / t_n:>9.1f}{t_n / t_c:>13.2f}")
    cuvil.set_num_threads(None)


if __name__ == "__main__":
    main()
