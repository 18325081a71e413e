"""ns/element of cuvil's vector math (float32) in a vectorised loop, against numpy.

    python benchmarks/vecmath.py [--n 1000000] [--repeat 20]

Each function runs as ``vectorize for (i = 0; i < N; i++) Y[i] = f(X[i])`` (hand-built
loop IR, one thread) over N float32 inputs spread over the function's interesting range.
numpy's column is its own float32 kernel where it has one (np.exp, np.log, np.tanh;
sigmoid as 1/(1+np.exp(-x)), three passes); erf has no numpy kernel (math.erf is only
the correctness reference in tests), so its ratio is left out.  Also printed: the same
loop with float64 (per-lane libm calls: cuvil's polynomials are float32 only).
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import numpy as np

RANGES = {"exp": (-80, 80), "log": (1e-3, 1e6), "tanh": (-10, 10), "erf": (-5, 5), "sigmoid": (-30, 30)}
NUMPY = {"exp": np.exp, "log": np.log, "tanh": np.tanh, "erf": None,
         "sigmoid": lambda x: np.divide(1, np.add(1, np.exp(np.negative(x))))}


def kernel(name: str, dtype: str):
    from cuvil.ir import expr as E
    from cuvil.ir.expr import Call, Load, Var
    from cuvil.ir.stmt import Buffer, For, LoweredFunc, Store
    from cuvil.runtime import Module

    n, i = Var("int64", "N"), Var("int64", "i")
    x, y = Buffer("X", (n,), dtype), Buffer("Y", (n,), dtype)
    body = Store(y, (i,), Call(dtype, name, (Load(dtype, x, (i,)),)))
    return Module(LoweredFunc(f"vm_{name}", (x, y), For(i, E.const(0, "int64"), n, body, "vectorize"), (n,), (y,)),
                  "llvm")


def best_ns(f, n: int, repeat: int) -> float:
    f()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times) / n * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'function':9} {'cuvil f32':>10} {'numpy f32':>10} {'numpy/cuvil':>12} {'cuvil f64 (libm)':>17}"
          "  (ns/element)")
    for name, (lo, hi) in RANGES.items():
        x = rng.uniform(lo, hi, args.n).astype(np.float32)
        y = np.empty_like(x)
        m = kernel(name, "float32")
        ours = best_ns(partial(m, x, y), args.n, args.repeat)
        x64, y64 = x.astype(np.float64), np.empty(args.n)
        m64 = kernel(name, "float64")
        ours64 = best_ns(partial(m64, x64, y64), args.n, max(3, args.repeat // 4))
        ref = NUMPY[name]
        if ref is None:
            print(f"{name:9} {ours:10.3f} {'-':>10} {'-':>12} {ours64:17.3f}")
            continue
        theirs = best_ns(partial(ref, x), args.n, args.repeat)
        print(f"{name:9} {ours:10.3f} {theirs:10.3f} {theirs / ours:11.2f}x {ours64:17.3f}")


if __name__ == "__main__":
    main()
