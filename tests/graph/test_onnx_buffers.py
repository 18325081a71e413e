"""A session keeps its arena and its output buffers between runs, never handing out memory the caller holds."""

import gc

import numpy as np
from onnx import TensorProto, helper

from cuvil.onnx import InferenceSession


def _model():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 256])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 256])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [64, 256])
    nodes = [helper.make_node("Exp", ["x"], ["t"]), helper.make_node("Neg", ["t"], ["u"]),
             helper.make_node("Relu", ["u"], ["v"]), helper.make_node("Add", ["v", "x"], ["y"]),
             helper.make_node("Mul", ["y", "x"], ["z"])]
    g = helper.make_graph(nodes, "g", [x], [y, z])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_outputs_the_caller_holds_are_never_reused():
    sess = InferenceSession(_model())
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((64, 256)).astype(np.float32) for _ in range(3)]
    held = [sess.run(None, {"x": x}) for x in xs]  # all three results kept
    for x, (y, z) in zip(xs, held):
        want_y = np.maximum(-np.exp(x), 0) + x
        np.testing.assert_allclose(y, want_y, rtol=1e-6)
        np.testing.assert_allclose(z, want_y * x, rtol=1e-6)
    views = [sess.run(None, {"x": x})[0][:10] for x in xs]  # a view of an output keeps it too
    for x, v in zip(xs, views):
        np.testing.assert_allclose(v, (np.maximum(-np.exp(x), 0) + x)[:10], rtol=1e-6)


def test_released_outputs_are_reused():
    sess = InferenceSession(_model())
    x = np.ones((64, 256), np.float32)
    a = sess.run(["y"], {"x": x})[0]
    addr = a.__array_interface__["data"][0]
    del a
    gc.collect()
    b = sess.run(["y"], {"x": x})[0]
    assert b.__array_interface__["data"][0] == addr  # no fresh pages (page faults) for a released output
    np.testing.assert_allclose(b, 1.0, rtol=1e-6)  # relu(-exp(1)) + 1
