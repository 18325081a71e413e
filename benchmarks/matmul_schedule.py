"""Hand-scheduled fp32 matmuls beside numpy, at 1 and 2 threads.

Two schedules: issue #3's (a 4x64 register tile computed at the fused, parallel
tile loop) as written, and the same with B packed into 32-column panels
(cache_read with a layout), an 8x32 tile and the column tiles outermost, so
a panel stays in L2 while every row block uses it.

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

from cuvil.bench.ops import median_time


def schedule(n: int, pack: bool):
    from cuvil import te

    A = te.placeholder((n, n), name="A")
    B = te.placeholder((n, n), name="B")
    k = te.reduce_axis((0, n), name="k")
    C = te.compute((n, n), lambda i, j: te.sum(A[i, k] * B[k, j], axis=k), name="C")
    s = te.create_schedule(C)
    ti, tj = (8, 32) if pack else (4, 64)
    if pack:
        BP = s.cache_read(B, "global", [C], layout=lambda k, j: (j // tj, k, j % tj))
        s[BP].parallel(s[BP].op.axis[0])
    CC = s.cache_write(C, "local")
    i, j = s[C].op.axis
    io, jo, ii, ji = s[C].tile(i, j, ti, tj)
    if pack:
        s[C].reorder(jo, io)
        f = s[C].fuse(jo, io)
    else:
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
    gflop = 2 * n**3 / 1e9
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    threads = [int(x) for x in args.threads.split(",")]
    t_np = {th: numpy_time(n, th, args.repeat) for th in threads}
    print(f"matmul {n}^3 fp32; numpy pinned to the same thread count (fresh process)")
    print(f"{'schedule':<34}{'threads':>8}{'cuvil ms':>10}{'GFLOP/s':>9}{'numpy ms':>10}{'GFLOP/s':>9}"
          f"{'cuvil/numpy':>13}")
    for label, pack in (("issue #3 (4x64, no packing)", False), ("packed B panels, 8x32, j outer", True)):
        t0 = time.perf_counter()
        s, tensors = schedule(n, pack)
        f = cuvil.build(s, tensors)
        t_build = time.perf_counter() - t0
        c = np.empty((n, n), np.float32)
        f(a, b, c)
        err = float(np.max(np.abs(c - ref)) / np.max(np.abs(ref)))
        assert err < 1e-5, f"{label}: wrong result (max rel err {err:.1e})"
        for th in threads:
            cuvil.set_num_threads(th)
            t_c = median_time(lambda f=f, c=c: f(a, b, c), args.repeat)
            print(f"{label:<34}{th:>8}{t_c * 1e3:>10.2f}{gflop / t_c:>9.1f}{t_np[th] * 1e3:>10.2f}"
                  f"{gflop / t_np[th]:>9.1f}{t_np[th] / t_c:>13.2f}")
        cuvil.set_num_threads(None)
        print(f"{'':<34}(build {t_build:.2f} s, max rel err {err:.1e})")


if __name__ == "__main__":
    main()
