"""MatMulNBits (4-bit weights, com.microsoft) in cuvil against onnxruntime's CPU kernel, on the
TinyLlama-1.1B shapes (issue 30): the attention projections K = N = 2048, the KV projections N = 256,
the MLP's 2048 -> 5632 and 5632 -> 2048; block 32, no zero points (onnxruntime-genai's int4 models);
M = 1 (decode) and M = 128 (prefill).

    python benchmarks/matmul_nbits.py [--reps 15] [--shapes 2048x2048,2048x256] [--m 1,128] [--warm]

One-node models, one session each, 1 thread.  Each call is timed in process CPU time (the machine is
shared: another process's work does not count), median of ``--reps`` calls, the two engines
interleaved.  Before each timed call a 64 MiB buffer is read, so the weights come from memory as they do
in a decoder that streams every layer once per token (``--warm``: they stay in the caches instead).

``cuvil`` and ``ort`` time ``session.run`` (their ratio: ``ort/cuvil``); ``kernel`` times cuvil's compiled
program alone on bound buffers (``CompiledGraph.run_buffers``: no Python feeds check, no output array).
The bandwidth bound of a call is (bytes of packed weights + scales) / the streaming bandwidth
:func:`cuvil.graph.profile.stream_bandwidth` measures (a 64 MiB copy at 1 thread); ``bound`` is that time
over the kernel's, 1.0 at the bound.  The load average is printed: quote it with the figures.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import numpy as np

SHAPES = [(2048, 2048), (2048, 256), (2048, 5632), (5632, 2048)]


def model(K: int, N: int, bs: int, seed: int = 0) -> bytes:
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(seed)
    nb = -(-K // bs)
    B = rng.integers(0, 256, (N, nb, bs // 2), dtype=np.uint8)
    S = (rng.random(N * nb, dtype=np.float32) * 0.02 + 0.001).astype(np.float32)
    node = h.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain="com.microsoft", K=K, N=N, bits=4,
                       block_size=bs, accuracy_level=0)
    g = h.make_graph([node], "mnb", [h.make_tensor_value_info("A", T.FLOAT, ["M", K])],
                     [h.make_tensor_value_info("Y", T.FLOAT, ["M", N])],
                     [nh.from_array(B, "B"), nh.from_array(S, "S")])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 21), h.make_opsetid("com.microsoft", 1)], ir_version=10)
    return m.SerializeToString()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    ap.add_argument("--m", default="1,128")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--warm", action="store_true", help="leave the weights in the caches between calls")
    args = ap.parse_args()
    os.environ.setdefault("CUVIL_NUM_THREADS", "1")
    import onnxruntime as ort

    import cuvil
    import cuvil.onnx
    from cuvil.graph.profile import stream_bandwidth

    cuvil.set_num_threads(1)
    bw = stream_bandwidth("llvm")
    flush = np.ones(64 << 18, np.float32)  # 64 MiB
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    print(f"streaming bandwidth (1 thread): {bw / 1e9:.1f} GB/s; weights {'warm' if args.warm else 'from memory'}")
    print(f"{'K':>5} {'N':>5} {'M':>4} {'cuvil ms':>9} {'kernel ms':>9} {'ort ms':>8} {'ort/cuvil':>9} "
          f"{'bound ms':>8} {'bound':>6}")
    for shape in args.shapes.split(","):
        K, N = (int(x) for x in shape.split("x"))
        mb = model(K, N, args.block)
        nb = -(-K // args.block)
        weight_bytes = N * nb * args.block // 2 + N * nb * 4
        for M in (int(x) for x in args.m.split(",")):
            a = np.random.default_rng(1).standard_normal((M, K), dtype=np.float32)
            ours = cuvil.onnx.InferenceSession(mb)
            theirs = ort.InferenceSession(mb, so, providers=["CPUExecutionProvider"])
            got, ref = ours.run(None, {"A": a})[0], theirs.run(None, {"A": a})[0]
            err = float(np.abs(got - ref).max() / max(1e-30, np.abs(ref).max()))
            prog = ours.programs()[0]
            buffers = prog.buffers({"A": a})
            feeds = {"A": a}
            calls = {"cuvil": functools.partial(ours.run, None, feeds),
                     "kernel": functools.partial(prog.run_buffers, buffers),
                     "ort": functools.partial(theirs.run, None, feeds)}
            times: dict[str, list[float]] = {k: [] for k in calls}
            for _ in range(args.reps):
                for name, call in calls.items():
                    if not args.warm:
                        flush.sum()  # (read, not written: no dirty lines left to write back during the call)
                    c = time.process_time()
                    call()
                    times[name].append(time.process_time() - c)
            t_c, t_k, t_o = (float(np.median(times[k])) for k in calls)
            bound = weight_bytes / bw
            print(f"{K:>5} {N:>5} {M:>4} {t_c * 1e3:>9.3f} {t_k * 1e3:>9.3f} {t_o * 1e3:>8.3f} {t_o / t_c:>9.2f} "
                  f"{bound * 1e3:>8.3f} {bound / t_k:>6.2f}   (max rel. difference {err:.1e})")
    print("load average:", " ".join(f"{x:.2f}" for x in os.getloadavg()), f"({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
