"""Grouped convolutions through the ONNX importer (a batched contraction per group) against onnxruntime."""

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from cuvil.onnx import InferenceSession


def _check_grouped(rng, n, c, f, g, hw, kernel, out, bias, **attrs):
    """One grouped Conv node (random weights, bias if asked, ``attrs`` its strides / pads / dilations) on an
    input of ``n x c x hw``: cuvil's output against onnxruntime's."""
    w = rng.standard_normal((f, c // g) + tuple(kernel)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w")] + ([numpy_helper.from_array(
        rng.standard_normal(f).astype(np.float32), "b")] if bias else [])
    node = helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["y"], group=g, kernel_shape=list(kernel),
                            **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, c, *hw])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, f, *out])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    x = rng.standard_normal((n, c) + tuple(hw)).astype(np.float32)
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = InferenceSession(model).run(None, {"x": x})[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(c // g * int(np.prod(kernel))))


@pytest.mark.parametrize("c,h,f,k,g,stride,pad,bias,n", [
    (8, 9, 64, 3, 2, 1, 1, True, 2), (12, 10, 18, 3, 3, 2, 0, False, 2), (6, 7, 96, 1, 3, 1, 0, True, 2),
    (4, 6, 8, 2, 2, 1, 1, False, 2),
    # depthwise: each channel's padded copy is computed inside the channel loop (one batch element) or
    # the batch loop (two)
    (24, 7, 24, 3, 24, 1, 1, True, 1), (16, 9, 16, 3, 16, 2, 1, False, 1), (8, 12, 8, 3, 8, 1, 1, False, 2)])
@pytest.mark.slow
def test_grouped_conv_matches_onnxruntime(c, h, f, k, g, stride, pad, bias, n):
    oh = (h + 2 * pad - k) // stride + 1
    _check_grouped(np.random.default_rng(c * f + k), n, c, f, g, (h, h), (k, k), (oh, oh), bias,
                   strides=[stride] * 2, pads=[pad] * 4)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pg=st.integers(2, 7), cg=st.integers(1, 6), g=st.integers(2, 5), h=st.integers(3, 13), w=st.integers(3, 13),
       kh=st.integers(1, 5), kw=st.integers(1, 5), stride=st.integers(1, 3), dy=st.integers(1, 2),
       dx=st.integers(1, 2), pads=st.lists(st.integers(0, 2), min_size=4, max_size=4), bias=st.booleans(),
       n=st.integers(1, 2))
@pytest.mark.slow
def test_grouped_conv_over_flattened_phases_matches_onnxruntime(pg, cg, g, h, w, kh, kw, stride, dy, dx, pads,
                                                                 bias, n):
    """Few filters per group and narrow or strided rows: the contraction over the flattened, phase-split
    image (cuvil.graph.ops.nn.conv._grouped_flat), every stride, dilation and asymmetric padding."""
    oh = (h + pads[0] + pads[2] - dy * (kh - 1) - 1) // stride + 1
    ow = (w + pads[1] + pads[3] - dx * (kw - 1) - 1) // stride + 1
    assume(oh >= 1 and ow >= 1)
    rng = np.random.default_rng(pg * 100 + cg * 10 + g)
    _check_grouped(rng, n, cg * g, pg * g, g, (h, w), (kh, kw), (oh, ow), bias, strides=[stride] * 2, pads=pads,
                   dilations=[dy, dx])
