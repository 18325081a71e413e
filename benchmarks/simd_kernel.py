"""What the codegen reaches before the schedule exists: a hand-written register-blocked matmul.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/simd_kernel.py [--size 512] [--bits 256,512]

The loop nest (built by hand as loop IR, then ``unroll_loops``)::

    parallel for (io = 0; io < M / 4; io++)
      for (jo = 0; jo < N / 64; jo++) {
        unroll for (ii = 0; ii < 4; ii++) vectorize for (ji = 0; ji < 64; ji++) C[4io+ii, 64jo+ji] = 0
        for (k = 0; k < K; k++)
          unroll for (ii = 0; ii < 4; ii++)
            vectorize for (ji = 0; ji < 64; ji++)
              C[4io+ii, 64jo+ji] = C[4io+ii, 64jo+ji] + A[4io+ii, k] * B[k, 64jo+ji]
      }

a 4x64 tile of C in vector registers over the whole k loop (LLVM promotes the
loads/stores of C out of the k loop). Prints GFLOP/s of cuvil at 1 and 2
threads and of numpy (OpenBLAS, pinned to the same thread count through
threadpoolctl when installed, else OPENBLAS_NUM_THREADS before numpy loads),
for each SIMD width in ``--bits``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def kernel(size: int):
    from cuvil.ir import expr as E
    from cuvil.ir.expr import Load, Var
    from cuvil.ir.stmt import Block, Buffer, For, LoweredFunc, Store
    from cuvil.ir.unroll import unroll_loops

    def c(v):
        return E.const(v, "int64")

    m = n = k_ = c(size)
    a, b, cc = Buffer("A", (m, k_), "float32"), Buffer("B", (k_, n), "float32"), Buffer("C", (m, n), "float32")
    io, jo, ii, ji, k = (Var("int64", x) for x in ("io", "jo", "ii", "ji", "k"))
    row, col = io * c(4) + ii, jo * c(64) + ji
    init = For(ii, c(0), c(4), For(ji, c(0), c(64), Store(cc, (row, col), E.const(0.0, "float32")), "vectorize"),
               "unroll")
    upd = Store(cc, (row, col), Load("float32", cc, (row, col)) + Load("float32", a, (row, k)) *
                Load("float32", b, (k, col)))
    acc = For(k, c(0), k_, For(ii, c(0), c(4), For(ji, c(0), c(64), upd, "vectorize"), "unroll"))
    body = For(io, c(0), c(size // 4), For(jo, c(0), c(size // 64), Block((init, acc))), "parallel")
    return unroll_loops(LoweredFunc("mm_kernel", (a, b, cc), body, (), (cc,)))


def best(f, repeat: int) -> float:
    f()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def child(size: int, threads: int, bits: int, repeat: int) -> None:
    import numpy as np

    import cuvil.codegen.llvm_vector as lv
    from cuvil.runtime import Module
    from cuvil.runtime.threads import set_num_threads

    lv.PREFERRED_BITS = bits
    set_num_threads(threads)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size)).astype(np.float32)
    b = rng.standard_normal((size, size)).astype(np.float32)
    c = np.zeros((size, size), np.float32)
    mod = Module(kernel(size), "llvm")
    mod(a, b, c)
    np.testing.assert_allclose(c, a @ b, rtol=1e-3, atol=1e-3)
    flops = 2.0 * size ** 3
    t_cuvil = best(lambda: mod(a, b, c), repeat)
    try:
        from threadpoolctl import threadpool_limits

        with threadpool_limits(threads):
            t_np = best(lambda: a @ b, repeat)
    except ImportError:
        t_np = best(lambda: a @ b, repeat)  # OPENBLAS_NUM_THREADS was set before numpy loaded
    asm = mod.get_source("asm")
    regs = "zmm" if "zmm" in asm else "ymm" if "ymm" in asm else "xmm"
    print(f"  {bits}-bit ({regs}) threads={threads}: cuvil {flops / t_cuvil / 1e9:7.1f} GFLOP/s   "
          f"numpy {flops / t_np / 1e9:7.1f} GFLOP/s   cuvil/numpy {t_np / t_cuvil:5.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=512, help="M = N = K (a multiple of 64)")
    ap.add_argument("--bits", default="256,512", help="SIMD widths to compare")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)  # threads bits
    args = ap.parse_args()
    if args.child:
        child(args.size, args.child[0], args.child[1], args.repeat)
        return
    if args.size % 64:
        ap.error("--size must be a multiple of 64")
    print(f"matmul {args.size}^3 float32, 4x64 register tile, vectorised j, parallel over row blocks")
    for threads in map(int, args.threads.split(",")):
        for bits in map(int, args.bits.split(",")):
            env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads))
            subprocess.run([sys.executable, __file__, "--size", str(args.size), "--repeat", str(args.repeat),
                            "--child", str(threads), str(bits)], env=env, check=True)


if __name__ == "__main__":
    main()
