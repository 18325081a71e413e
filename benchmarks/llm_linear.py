"""The weight contractions of an LLM decoder (cuvil.llm.qlinear, issue 30) on TinyLlama-1.1B's shapes
(K x N: the fused q/k/v projection 2048 x 2560, o 2048 x 2048, the fused gate/up 2048 x 11264, down
5632 x 2048, the head 2048 x 32000), Q4 in groups of 32, symmetric (GGUF Q4_0: float16 scales, which the
kernels then store as float16), rows = 1 (a decode step) and 128 (a prefill), 1 and 2 threads.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/llm_linear.py \\
        [--shapes 2048x2048,...] [--rows 1,128] [--threads 1,2] [--weight q4|q4-f32scales|q8|dense] \\
        [--activations int8|float32] [--reps 7]

Per line: the time of one call (bound once, ``Linear.bind``: the activations' quantization and the
contraction), the weight bytes it streams (``Linear.nbytes``: packed values, scales [, offsets]) per
second, that over the streaming bandwidth of the same thread count (:func:`cuvil.graph.profile.
stream_bandwidth`, a 64 MiB copy compiled by cuvil; at 1 thread also timed in CPU time: the larger),
GFLOP/s (2 rows K N per call) and its share of the float32 FMA peak of the cores used (measured,
:func:`cuvil.codegen.calibrate.fma_peak`), and numpy's float32 ``x @ W.T`` with the dequantized weight at
the same thread count (its OpenBLAS set to it) and numpy's time over cuvil's.

Timing: 1 thread in process CPU time (the machine is shared: another process's work does not count), 2
threads in wall time; the median of ``--reps`` rounds (the fastest round in parentheses).  For rows = 1
the weights come from memory, as in a decoder that streams every layer once per token: each round calls
the kernel on copies of the weights (the same kernel, other buffers, as another layer would) until more
than 3 x the last-level cache has streamed, for cuvil and for numpy alike.  The load average is printed
with every line: quote it.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import time
from collections.abc import Callable

import numpy as np

SHAPES = [(2048, 2560), (2048, 2048), (2048, 11264), (5632, 2048), (2048, 32000)]


def _openblas_threads() -> Callable[[int], None] | None:
    """numpy's OpenBLAS thread setter (None if it cannot be found)."""
    here = os.path.dirname(np.__file__)
    for lib in glob.glob(os.path.join(here, "..", "numpy.libs", "*openblas*")) + \
            glob.glob(os.path.join(here, ".libs", "*openblas*")):
        dll = ctypes.CDLL(lib)
        for name in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads"):
            f = getattr(dll, name, None)
            if f is not None:
                f.argtypes = [ctypes.c_int]
                return lambda n: f(n)
    return None


def _weight(kind: str, K: int, N: int, rng: np.random.Generator):  # noqa: ANN202
    from cuvil.llm.weights import Q4, Q8, Dense

    if kind == "dense":
        return Dense(rng.standard_normal((N, K), dtype=np.float32) * 0.02)
    s = (rng.random((N, K // 32), dtype=np.float32) * 0.02 + 1e-3).astype(np.float32)
    if kind == "q8":
        return Q8(rng.integers(-128, 128, (N, K), dtype=np.int8), s.astype(np.float16).astype(np.float32), 32)
    if kind == "q4":
        s = s.astype(np.float16).astype(np.float32)  # GGUF's scales are float16
    return Q4(rng.integers(0, 256, (N, K // 2), dtype=np.uint8), s, (-8 * s).astype(np.float32), 32, True)


def _clock(threads: int) -> Callable[[], float]:
    return time.process_time if threads == 1 else time.perf_counter


def _time(calls: list[Callable[[], object]], threads: int, reps: int, min_calls: int) -> tuple[float, float]:
    """(median, fastest) seconds per call over ``reps`` rounds; each round runs every call of ``calls`` in
    turn, at least ``min_calls`` calls in all."""
    clock = _clock(threads)
    rounds = max(1, -(-min_calls // len(calls)))
    for c in calls:
        c()
    ts = []
    for _ in range(reps):
        t0 = clock()
        for _ in range(rounds):
            for c in calls:
                c()
        ts.append((clock() - t0) / (rounds * len(calls)))
    return float(np.median(ts)), float(min(ts))


def _bandwidth(tgt: object, threads: int, tries: int = 3) -> float:
    """The streaming bandwidth the %bw column divides by: the fastest of ``tries`` measurements of
    :func:`cuvil.graph.profile.stream_bandwidth` (a busy machine only ever slows a copy down), and at 1
    thread at least the same 64 MiB copy timed in process CPU time, as the kernels are (on a loaded machine
    the wall-clock copy reads low and would flatter them)."""
    import cuvil
    from cuvil import te
    from cuvil.graph import profile
    from cuvil.runtime.threads import get_num_threads

    best = 0.0
    for _ in range(tries):
        key = (tgt.canonical, get_num_threads())  # type: ignore[attr-defined]
        if key in profile._BANDWIDTH:
            del profile._BANDWIDTH[key]
        best = max(best, profile.stream_bandwidth(tgt))
    if threads == 1:  # the same copy as stream_bandwidth's, in process CPU time
        n = 64 * 1024 * 1024 // 4
        x = te.placeholder((n,), name="x")
        y = te.compute((n,), lambda i: x[i], name="y")
        mod = cuvil.build(cuvil.auto_schedule([x, y], tgt), [x, y], tgt)
        a, b = np.ones(n, np.float32), np.empty(n, np.float32)
        for _ in range(5):
            t0 = time.process_time()
            mod(a, b)
            best = max(best, 2 * 4 * n / max(time.process_time() - t0, 1e-9))
    return best


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    ap.add_argument("--rows", default="1,128")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--weight", default="q4", choices=["q4", "q4-f32scales", "q8", "dense"])
    ap.add_argument("--activations", default=None, choices=["int8", "float32"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-numpy", action="store_true", help="leave out numpy's reference")
    args = ap.parse_args()

    import cuvil
    from cuvil.codegen.calibrate import fma_peak
    from cuvil.llm.call import Bound
    from cuvil.llm.qlinear import linear
    from cuvil.target import Target

    blas = _openblas_threads()
    tgt = Target("llvm")
    llc = max(32 << 20, int(getattr(tgt, "l3_size", 0) or 0))
    stream = 3 * llc
    peak1 = max(fma_peak(tgt, 0.05 + 0.001 * i) for i in range(5))  # (each a fresh measurement)
    rng = np.random.default_rng(0)
    print(f"cuvil.llm.qlinear, weight {args.weight}, activations {args.activations or 'default'}; target "
          f"{tgt.canonical.split(' -mattr')[0]}; float32 peak {peak1 / 1e9:.0f} GFLOP/s per core; numpy threads "
          f"{'set' if blas else 'NOT controlled'}")
    print(f"{'K':>5} {'N':>6} {'rows':>4} {'thr':>3} {'us':>9} {'GB/s':>6} {'%bw':>5} {'GFLOP/s':>8} {'%peak':>6} "
          f"{'numpy us':>9} {'np/cuvil':>8}  load")
    for shape in args.shapes.split(","):
        K, N = (int(v) for v in shape.split("x"))
        w = _weight(args.weight, K, N, rng)
        wd = np.ascontiguousarray(w.dequantize())
        for rows in (int(r) for r in args.rows.split(",")):
            t0 = time.perf_counter()
            L = linear(w, rows, tgt, activations=args.activations)
            compile_s = time.perf_counter() - t0
            x = rng.standard_normal((rows, K), dtype=np.float32)
            out = np.zeros((rows, N), np.float32)
            calls: list[Callable[[], object]] = [L.bind(x, out)]
            copies = max(1, -(-stream // L.nbytes)) if rows == 1 else 1
            for _ in range(copies - 1):  # the same kernels on other weights, as another layer would be
                consts = [a.copy() for a in L._weights]
                if L.quantizer is None:
                    calls.append(Bound(L.module, *consts, x, out))
                else:
                    quant, main = Bound(L.quantizer, x, *L._xq), Bound(L.module, *consts, *L._scratch, out)
                    calls.append(lambda q=quant, m=main: (q(), m()))
            np_copies = [wd] + ([wd.copy() for _ in range(max(0, -(-stream // wd.nbytes) - 1))] if rows == 1 else [])
            np_out = np.empty((rows, N), np.float32)
            np_calls = [lambda m=m, x=x, o=np_out: np.matmul(x, m.T, out=o) for m in np_copies]
            for threads in (int(t) for t in args.threads.split(",")):
                cuvil.set_num_threads(threads)
                if blas:
                    blas(threads)
                bw = _bandwidth(tgt, threads)
                min_calls = 3 * copies if rows == 1 else 5
                t, t_min = _time(calls, threads, args.reps, min_calls)
                tn = None if args.no_numpy else _time(np_calls, threads, max(3, args.reps // 2),
                                                      3 * len(np_calls) if rows == 1 else 3)[0]
                gbs = L.nbytes / t / 1e9
                flops = 2 * rows * K * N / t
                nps = f"{tn * 1e6:>9.0f} {tn / t:>8.2f}" if tn is not None else f"{'-':>9} {'-':>8}"
                print(f"{K:>5} {N:>6} {rows:>4} {threads:>3} {t * 1e6:>9.1f} {gbs:>6.1f} {gbs * 1e9 / bw * 100:>5.0f} "
                      f"{flops / 1e9:>8.1f} {flops / (peak1 * threads) * 100:>6.0f} {nps}  {_load()}"
                      f"   (fastest {t_min * 1e6:.1f} us, bw {bw / 1e9:.1f} GB/s, {L.nbytes / 1e6:.2f} MB, "
                      f"{L.activations}, compile {compile_s:.1f} s)", flush=True)
    cuvil.set_num_threads(None)


if __name__ == "__main__":
    main()
