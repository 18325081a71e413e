"""Windows computed in passes over unit-stride rows, checked against onnxruntime: the strided 2-D max pool
(cuvil/graph/ops/nn/pool.py _strided_max_pool) on rows longer than a vector, Resize with its gathered pass on
either side (cuvil/graph/ops/resize.py), global pools over the flattened image, and reductions over the
last axes read flattened (cuvil/graph/passes.py flatten_trailing_reductions)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil.frontend.onnx import import_model
from cuvil.graph.passes import flatten_trailing_reductions, optimize
from cuvil.onnx import InferenceSession


def _run(nodes, shape, inits=(), opset=18, dtype=TensorProto.FLOAT, np_dtype=np.float32, seed=0):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", dtype, shape)],
                          [helper.make_tensor_value_info("y", dtype, None)], list(inits))
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np_dtype) if np_dtype == np.float32 else \
        rng.integers(0, 255, shape).astype(np_dtype)
    b = model.SerializeToString()
    want = ort.InferenceSession(b, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = InferenceSession(b).run(None, {"x": x})[0]
    return model, got, want


@pytest.mark.parametrize("shape,kernel,stride,pads,ceil,dil", [
    ((1, 5, 109, 109), 3, 2, [0, 0, 0, 0], 0, 1),      # SqueezeNet's pools: no bound tested
    ((1, 4, 57, 57), 3, 2, [1, 1, 1, 1], 0, 1),        # ResNet's stem pool: padding on every side
    ((1, 3, 54, 54), 3, 2, [0, 0, 0, 0], 1, 1),        # ceil mode: the last window past the image
    ((2, 3, 40, 70), 2, 2, [0, 0, 0, 0], 0, 1),        # U-Net's 2x2 pools
    ((1, 2, 35, 53), 3, 3, [1, 0, 2, 1], 1, 2),        # stride 3, dilation, asymmetric padding
])
@pytest.mark.slow
def test_strided_max_pool_on_long_rows(shape, kernel, stride, pads, ceil, dil):
    node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[kernel, kernel], strides=[stride, stride],
                            pads=pads, ceil_mode=ceil, dilations=[dil, dil])
    _, got, want = _run([node], shape)
    np.testing.assert_array_equal(got, want)  # a maximum is one of the inputs: exact


def test_strided_max_pool_propagates_nan():
    node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2])
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 9, 40])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    b = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()
    x = np.zeros((1, 1, 9, 40), np.float32)
    x[0, 0, 4, 21] = np.nan
    got = InferenceSession(b).run(None, {"x": x})[0]
    assert np.isnan(got[0, 0, 1:3, 10]).all() and np.isnan(got).sum() == 2  # the two windows holding it


@pytest.mark.parametrize("shape,out,coord", [
    ((1, 3, 9, 9), (1, 3, 140, 140), "half_pixel"),      # DeepLab's last upsampling: the gathered pass first
    ((1, 4, 1, 1), (1, 4, 9, 9), "half_pixel"),          # ASPP's pooled branch
    ((1, 2, 16, 16), (1, 2, 32, 32), "align_corners"),
    ((1, 2, 40, 36), (1, 2, 17, 20), "half_pixel"),      # downsampling: the gathered pass last, no copy after
    ((1, 2, 6, 30), (1, 2, 18, 11), "asymmetric"),       # the outer axis grows, the last shrinks
    ((1, 2, 30, 6), (1, 2, 11, 18), "pytorch_half_pixel"),
])
def test_resize_either_pass_first(shape, out, coord):
    node = helper.make_node("Resize", ["x", "", "", "s"], ["y"], mode="linear", coordinate_transformation_mode=coord)
    _, got, want = _run([node], list(shape), [numpy_helper.from_array(np.array(out, np.int64), "s")])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("out", [(1, 2, 19, 23), (1, 2, 5, 6)])
def test_resize_crop_and_extrapolate(out):
    """tf_crop_and_resize masks the outputs outside the region of interest with the extrapolation value:
    the pass after the gathered one is then a stage of its own, in either order."""
    roi = numpy_helper.from_array(np.array([0, 0, 0.1, -0.2, 1, 1, 0.8, 1.3], np.float32), "roi")
    node = helper.make_node("Resize", ["x", "roi", "", "s"], ["y"], mode="linear",
                            coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=-7.0)
    _, got, want = _run([node], [1, 2, 10, 12], [roi, numpy_helper.from_array(np.array(out, np.int64), "s")])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_resize_uint8_rounds_after_both_passes():
    node = helper.make_node("Resize", ["x", "", "", "s"], ["y"], mode="linear")
    s = numpy_helper.from_array(np.array([1, 2, 21, 19], np.int64), "s")
    _, got, want = _run([node], [1, 2, 7, 8], [s], dtype=TensorProto.UINT8, np_dtype=np.uint8)
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
@pytest.mark.parametrize("shape", [(1, 30, 12, 12), (2, 5, 7, 9, 3), (1, 4, 33)])
def test_global_pools_over_the_flattened_image(op, shape):
    _, got, want = _run([helper.make_node(op, ["x"], ["y"])], list(shape))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin"])
@pytest.mark.parametrize("keep", [0, 1])
@pytest.mark.parametrize("opset", [13, 18])
def test_reductions_over_the_last_axes_read_flattened(op, keep, opset):
    shape = [1, 20, 9, 12]
    as_input = opset >= 18 or op == "ReduceSum"
    axes = numpy_helper.from_array(np.array([-1, 2], np.int64), "axes")
    node = (helper.make_node(op, ["x", "axes"], ["y"], keepdims=keep) if as_input else
            helper.make_node(op, ["x"], ["y"], keepdims=keep, axes=[-1, 2]))
    model, got, want = _run([node], shape, [axes] if as_input else [], opset=opset)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    g = optimize(import_model(model))
    reduced = [n for n in g.nodes if n.op_type == op]
    assert len(reduced) == 1 and [n.op_type for n in g.nodes].count("Reshape") == 1 + keep


def test_reductions_not_over_the_last_axes_are_left_alone():
    node = helper.make_node("ReduceMean", ["x", "axes"], ["y"], keepdims=1)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 5])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(np.array([1, 2], np.int64), "axes")])
    graph = import_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))
    assert flatten_trailing_reductions(graph) is graph


def test_reductions_of_an_empty_value_are_left_alone():
    """(A fuzzed graph: ReduceMax over both axes of a [1, 0] input is -inf, as onnxruntime says.)"""
    node = helper.make_node("ReduceMax", ["x"], ["y"], axes=[0, 1], keepdims=0)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 0])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    graph = import_model(model)
    assert flatten_trailing_reductions(graph) is graph
    x = np.zeros((1, 0), np.float32)
    [got] = InferenceSession(model.SerializeToString()).run(None, {"x": x})
    [want] = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    np.testing.assert_array_equal(got, want)
