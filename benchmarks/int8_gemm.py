"""cuvil's integer contractions (cuvil.graph.ops.quant.kernels) beside cuvil fp32 and onnxruntime, 1 thread.

    python benchmarks/int8_gemm.py              # every shape
    python benchmarks/int8_gemm.py --quick      # fewer repeats

Shapes (M x K -> N): the BERT FFN's 128 x 768 -> 3072 and 128 x 3072 -> 768, a ResNet 3x3 convolution as
im2col (3136 pixels x 576 -> 64), and that convolution itself (1x64x56x56, 3x3, 64 filters, padding 1).
Per engine: median milliseconds of process CPU time and of wall time per call, GOP/s (2 M N K / CPU time).

- cuvil int8: ``int_matmul`` / ``int_conv`` (u8 activations, s8 constant weights; VNNI where the CPU has
  it), compiled as the graph compiler compiles a kernel (auto-scheduled);
- cuvil fp32: the same shape as an fp32 ONNX MatMul / Conv with constant weights, through cuvil's session;
- onnxruntime: MatMulInteger and QLinearMatMul (ConvInteger and QLinearConv for the convolution), u8 x s8,
  one intra-op thread.

The calls alternate between engines, round by round, so a busy machine slows them alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

os.environ.setdefault("CUVIL_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cuvil  # noqa: E402
from cuvil import te  # noqa: E402
from cuvil.graph.ir import Node  # noqa: E402
from cuvil.graph.ops.base import NodeCtx  # noqa: E402
from cuvil.graph.ops.quant.kernels import int_conv, int_matmul  # noqa: E402

GEMMS = [(128, 768, 3072), (128, 3072, 768), (3136, 576, 64)]
CONV = (1, 64, 56, 56, 64, 3)  # N, C, H, W, O, kernel


def _cuvil_int8(make, inputs: list[np.ndarray], out_shape: tuple[int, ...]):
    tgt = cuvil.Target("llvm")
    ctx = NodeCtx(Node("QLinearMatMul", "bench", (), ("y",)), [], 13)
    ctx.target = tgt
    phs = [te.placeholder(a.shape, dtype=a.dtype.name, name=f"x{i}") for i, a in enumerate(inputs)]
    y = make(ctx, *phs)
    args = phs + [p for _, p in ctx.placeholders] + [y]
    mod = cuvil.build(cuvil.auto_schedule(args, tgt), args, target=tgt)
    vals = list(inputs) + [ctx.entries[i] for i, _ in ctx.placeholders] + [np.zeros(out_shape, np.int32)]
    return lambda: mod(*vals), vals[-1]


def _onnx_model(nodes, inits, inputs, outputs):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    types = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.uint8): TensorProto.UINT8,
             np.dtype(np.int8): TensorProto.INT8, np.dtype(np.int32): TensorProto.INT32}
    ins = [helper.make_tensor_value_info(n, types[a.dtype], a.shape) for n, a in inputs]
    g = helper.make_graph(nodes, "bench", ins,
                          [helper.make_tensor_value_info(n, types[np.dtype(d)], s) for n, d, s in outputs],
                          [numpy_helper.from_array(a, n) for n, a in inits])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m.SerializeToString()


def _ort(model: bytes, feeds: dict):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    return lambda: sess.run(None, feeds)


def _cuvil_fp32(model: bytes, feeds: dict):
    from cuvil.onnx import InferenceSession

    sess = InferenceSession(model, num_threads=1)
    return lambda: sess.run(None, feeds)


def _gemm_engines(m: int, k: int, n: int) -> tuple[dict, float]:
    from onnx import helper

    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (m, k)).astype(np.uint8)
    w = rng.integers(-128, 128, (k, n)).astype(np.int8)
    run8, out = _cuvil_int8(lambda ctx, x: int_matmul(ctx, x, w), [a], (m, n))
    run8()
    assert np.array_equal(out, a.astype(np.int32) @ w.astype(np.int32)), "cuvil int8 is wrong"
    af, wf = a.astype(np.float32), w.astype(np.float32)
    fp = _onnx_model([helper.make_node("MatMul", ["a", "w"], ["y"])], [("w", wf)], [("a", af)],
                     [("y", np.float32, (m, n))])
    mi = _onnx_model([helper.make_node("MatMulInteger", ["a", "w"], ["y"])], [("w", w)], [("a", a)],
                     [("y", np.int32, (m, n))])
    scales = [("sa", np.array(0.02, np.float32)), ("za", np.array(128, np.uint8)), ("sw", np.array(0.01, np.float32)),
              ("zw", np.array(0, np.int8)), ("sy", np.array(0.5, np.float32)), ("zy", np.array(128, np.uint8))]
    ql = _onnx_model([helper.make_node("QLinearMatMul", ["a", "sa", "za", "w", "sw", "zw", "sy", "zy"], ["y"])],
                     [("w", w)] + scales, [("a", a)], [("y", np.uint8, (m, n))])
    engines = {"cuvil int8": run8, "cuvil fp32": _cuvil_fp32(fp, {"a": af}),
               "ort MatMulInteger": _ort(mi, {"a": a}), "ort QLinearMatMul": _ort(ql, {"a": a})}
    return engines, 2.0 * m * n * k


def _conv_engines() -> tuple[dict, float]:
    from onnx import helper

    nb, c, h, wd, o, kk = CONV
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (nb, c, h, wd)).astype(np.uint8)
    w = rng.integers(-128, 128, (o, c, kk, kk)).astype(np.int8)
    run8, _ = _cuvil_int8(lambda ctx, t: int_conv(ctx, t, w, [1, 1], [1, 1], [1, 1], [1, 1], 1, pad_value=0),
                          [x], (nb, o, h, wd))
    xf, wf = x.astype(np.float32), w.astype(np.float32)
    attrs = {"pads": [1, 1, 1, 1], "kernel_shape": [kk, kk]}
    ys = (nb, o, h, wd)
    fp = _onnx_model([helper.make_node("Conv", ["x", "w"], ["y"], **attrs)], [("w", wf)], [("x", xf)],
                     [("y", np.float32, ys)])
    ci = _onnx_model([helper.make_node("ConvInteger", ["x", "w"], ["y"], **attrs)], [("w", w)], [("x", x)],
                     [("y", np.int32, ys)])
    scales = [("sx", np.array(0.02, np.float32)), ("zx", np.array(0, np.uint8)), ("sw", np.array(0.01, np.float32)),
              ("zw", np.array(0, np.int8)), ("sy", np.array(0.5, np.float32)), ("zy", np.array(128, np.uint8))]
    ql = _onnx_model([helper.make_node("QLinearConv", ["x", "sx", "zx", "w", "sw", "zw", "sy", "zy"], ["y"], **attrs)],
                     [("w", w)] + scales, [("x", x)], [("y", np.uint8, ys)])
    engines = {"cuvil int8": run8, "cuvil fp32": _cuvil_fp32(fp, {"x": xf}),
               "ort ConvInteger": _ort(ci, {"x": x}), "ort QLinearConv": _ort(ql, {"x": x})}
    return engines, 2.0 * nb * o * h * wd * c * kk * kk


def measure(engines: dict, rounds: int, target_s: float = 0.05) -> dict[str, tuple[float, float]]:
    """Median (CPU seconds, wall seconds) per call of each engine, calls alternating round by round."""
    per_round = {}
    for name, fn in engines.items():
        fn()
        t0 = time.perf_counter()
        fn()
        per_round[name] = max(1, int(target_s / max(time.perf_counter() - t0, 1e-6)))
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, fn in engines.items():
            n = per_round[name]
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append(((time.process_time() - c0) / n, (time.perf_counter() - w0) / n))
    return {name: (statistics.median(s[0] for s in v), statistics.median(s[1] for s in v))
            for name, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 rounds instead of 15")
    args = ap.parse_args()
    cuvil.set_num_threads(1)
    rounds = 5 if args.quick else 15
    feats = [f for f in cuvil.Target("llvm").enabled_features if "vnni" in f or f.startswith("amx")]
    print(f"cuvil int8 beside cuvil fp32 and onnxruntime, 1 thread; CPU {cuvil.Target('llvm').cpu}, "
          f"features {', '.join(feats) or 'no VNNI'}; medians of {rounds} rounds")
    cases = [(f"matmul {m}x{k} -> {n}", lambda m=m, k=k, n=n: _gemm_engines(m, k, n)) for m, k, n in GEMMS]
    cases.append(("conv 1x64x56x56 3x3 -> 64", _conv_engines))
    for label, make in cases:
        engines, ops = make()
        res = measure(engines, rounds)
        print(f"\n{label}  ({ops / 1e9:.2f} GOP)")
        print(f"  {'engine':<20} {'CPU ms':>9} {'wall ms':>9} {'GOP/s':>8} {'vs cuvil fp32':>14}")
        base = res["cuvil fp32"][0]
        for name, (cpu, wall) in res.items():
            print(f"  {name:<20} {cpu * 1e3:9.3f} {wall * 1e3:9.3f} {ops / cpu / 1e9:8.1f} {base / cpu:13.2f}x")


if __name__ == "__main__":
    main()
