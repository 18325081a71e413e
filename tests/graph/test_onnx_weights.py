"""Constant weights packed at compile time (panels the register tile reads whole) give onnxruntime's
results, with and without a bias input (the packed copy must never be taken for one)."""

import numpy as np
import pytest
import toolchain

onnx = toolchain.module("onnx")
ort = toolchain.module("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import cuvil.onnx  # noqa: E402

rng = np.random.default_rng(5)


def _compare(node, x_shape, inits):
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal(x_shape).astype(np.float32)
    got = cuvil.onnx.InferenceSession(model).run(None, {"x": x})[0]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_constant_weights(trans_b, bias):
    w = rng.standard_normal((70, 40) if trans_b else (40, 70))
    inits = {"W": w, **({"C": rng.standard_normal(70)} if bias else {})}
    node = helper.make_node("Gemm", ["x", "W"] + (["C"] if bias else []), ["y"], transB=trans_b)
    _compare(node, [9, 40], inits)


def test_matmul_constant_weights_rows_of_a_3d_input():
    _compare(helper.make_node("MatMul", ["x", "W"], ["y"]), [2, 5, 24], {"W": rng.standard_normal((24, 40))})


@pytest.mark.parametrize("bias", [False, True])
def test_conv_constant_filters(bias):
    inits = {"W": rng.standard_normal((40, 8, 3, 3)) * 0.3, **({"B": rng.standard_normal(40)} if bias else {})}
    node = helper.make_node("Conv", ["x", "W"] + (["B"] if bias else []), ["y"], pads=[1, 1, 1, 1], strides=[2, 2])
    _compare(node, [1, 8, 9, 9], inits)
