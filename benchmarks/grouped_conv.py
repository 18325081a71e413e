"""Grouped 3x3 convolutions (+ Relu) of RegNet-like stages, cuvil beside onnxruntime on the same one-node models.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/grouped_conv.py [rounds, default 60]
    CUVIL_HOST_TARGET=x86-64-v3 python benchmarks/grouped_conv.py        # the AVX2 code on an AVX-512 machine

At 1 thread, the two engines called in turn call by call on the same input; per case the median process CPU
time of each, cuvil's GFLOP/s and the ratio cuvil / onnxruntime (> 1: cuvil slower), the outputs compared
(``allclose(rtol=1e-4, atol=1e-4)``), and the load average at the end.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

# (channels, image size, group width, stride): RegNetY-400MF's stages (group width 8) and a group width of 16
CASES = [(48, 56, 8, 1), (104, 28, 8, 1), (208, 14, 8, 1), (440, 7, 8, 1), (104, 56, 8, 2), (208, 28, 8, 2),
         (224, 56, 16, 1), (232, 14, 8, 1)]


def model(c: int, hw: int, gw: int, stride: int) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((c, gw, 3, 3)) * 0.1).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["h"], group=c // gw, pads=[1, 1, 1, 1],
                              strides=[stride, stride]),
             helper.make_node("Relu", ["h"], ["y"])]
    o = (hw - 1) // stride + 1
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, o, o])],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def main() -> None:
    import onnxruntime as ort

    import cuvil
    import cuvil.onnx
    from cuvil.target import Target

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    cuvil.set_num_threads(1)
    print(f"cuvil on {Target('llvm').cpu}, 1 thread, median process CPU time of {rounds} calls each, in turn")
    for c, hw, gw, stride in CASES:
        m = model(c, hw, gw, stride)
        so = ort.SessionOptions()
        so.intra_op_num_threads = so.inter_op_num_threads = 1
        theirs = ort.InferenceSession(m, so, providers=["CPUExecutionProvider"])
        ours = cuvil.onnx.InferenceSession(m)
        x = np.random.default_rng(1).standard_normal((1, c, hw, hw)).astype(np.float32)
        ok = np.allclose(ours.run(None, {"x": x})[0], theirs.run(None, {"x": x})[0], rtol=1e-4, atol=1e-4)
        tc, to = [], []
        for _ in range(rounds):
            t = time.process_time()
            ours.run(None, {"x": x})
            tc.append(time.process_time() - t)
            t = time.process_time()
            theirs.run(None, {"x": x})
            to.append(time.process_time() - t)
        mc, mo = float(np.median(tc)) * 1e6, float(np.median(to)) * 1e6
        o = (hw - 1) // stride + 1
        flops = 2 * c * gw * 9 * o * o
        print(f"C={c:4d} {hw:3d}x{hw:<3d} group width {gw:2d} stride {stride}: cuvil {mc:8.1f} us "
              f"({flops / mc / 1e3:5.1f} GFLOP/s)  onnxruntime {mo:8.1f} us  cuvil/ort {mc / mo:5.2f}  "
              f"{'ok' if ok else 'MISMATCH'}")
    print("load average: " + ", ".join(f"{v:.1f}" for v in os.getloadavg()))


if __name__ == "__main__":
    main()
