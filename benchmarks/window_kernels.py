"""One-node ONNX models of the strided pools and convolutions of real CNNs, cuvil beside onnxruntime (NCHW),
1 thread, process CPU time (the 20th percentile of 200 calls, three rounds, each engine in turn):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/window_kernels.py [--only NAME]

The rows are SqueezeNet's, ResNet's and GoogLeNet's max pools (3x3 / 2, padded or ceil-mode), a 5x5 / 2
pool, and SqueezeNet's 7x7 / 2 stem and a 3x3 expand convolution (both with their ReLU).  Each result is
checked against onnxruntime first.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("CUVIL_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import cuvil.onnx as co  # noqa: E402


def _pool(shape: list[int], out: list[int], **attrs: object) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, out)
    node = helper.make_node("MaxPool", ["x"], ["y"], **attrs)
    return helper.make_model(helper.make_graph([node], "pool", [x], [y]), opset_imports=[helper.make_opsetid("", 18)])


def _conv(c: int, size: int, f: int, k: int, stride: int, pad: int) -> onnx.ModelProto:
    out = (size + 2 * pad - k) // stride + 1
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, size, size])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, f, out, out])
    w = numpy_helper.from_array((rng.standard_normal((f, c, k, k)) * 0.1).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(f).astype(np.float32), "b")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["t"], kernel_shape=[k, k], strides=[stride] * 2,
                              pads=[pad] * 4), helper.make_node("Relu", ["t"], ["y"])]
    graph = helper.make_graph(nodes, "conv", [x], [y], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


CASES = {
    "squeezenet pool 3x3/2 96x109x109": lambda: _pool([1, 96, 109, 109], [1, 96, 54, 54], kernel_shape=[3, 3],
                                                       strides=[2, 2]),
    "resnet pool 3x3/2 pad 1 64x112x112": lambda: _pool([1, 64, 112, 112], [1, 64, 56, 56], kernel_shape=[3, 3],
                                                         strides=[2, 2], pads=[1, 1, 1, 1]),
    "ceil-mode pool 3x3/2 256x54x54": lambda: _pool([1, 256, 54, 54], [1, 256, 27, 27], kernel_shape=[3, 3],
                                                     strides=[2, 2], ceil_mode=1),
    "pool 5x5/2 pad 1 64x57x57": lambda: _pool([1, 64, 57, 57], [1, 64, 28, 28], kernel_shape=[5, 5],
                                                strides=[2, 2], pads=[1, 1, 1, 1]),
    "squeezenet stem conv 7x7/2 3->96 224": lambda: _conv(3, 224, 96, 7, 2, 0),
    "squeezenet expand conv 3x3 32->128 54": lambda: _conv(32, 54, 128, 3, 1, 1),
}


def _cpu_us(run, calls: int = 200) -> float:
    times = []
    for _ in range(calls):
        t0 = time.process_time()
        run()
        times.append(time.process_time() - t0)
    return float(np.percentile(times, 20)) * 1e6


def _rounds(ours: co.InferenceSession, ref: ort.InferenceSession, feeds: dict) -> tuple[float, float]:
    """The medians over three rounds (each engine in turn) of each engine's time per call."""
    rounds = [(_cpu_us(lambda: ours.run(None, feeds)), _cpu_us(lambda: ref.run(None, feeds))) for _ in range(3)]
    return float(np.median([r[0] for r in rounds])), float(np.median([r[1] for r in rounds]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="only the rows whose name contains this text")
    args = ap.parse_args()
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"1 thread, process CPU time per call (us), load {load}; ratio = cuvil / onnxruntime")
    print(f"{'kernel':40s} {'cuvil':>9s} {'ort':>9s} {'ratio':>6s}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in CASES.items():
            if args.only not in name:
                continue
            path = os.path.join(tmp, "model.onnx")
            onnx.save(make(), path)
            so = ort.SessionOptions()
            so.intra_op_num_threads = 1
            ref = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
            ours = co.InferenceSession(path)
            shape = [d.dim_value for d in onnx.load(path).graph.input[0].type.tensor_type.shape.dim]
            feeds = {"x": np.random.default_rng(1).standard_normal(shape).astype(np.float32)}
            np.testing.assert_allclose(ours.run(None, feeds)[0], ref.run(None, feeds)[0], rtol=1e-4, atol=1e-4)
            c, o = _rounds(ours, ref, feeds)
            print(f"{name:40s} {c:9.1f} {o:9.1f} {c / o:6.2f}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
