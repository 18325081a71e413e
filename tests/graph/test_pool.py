"""Strided 2-D max pooling over the phase-split input (cuvil/graph/ops/nn/pool.py _strided_max_pool) against
onnxruntime: strides, dilations, asymmetric padding, ceil mode."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from cuvil.onnx import InferenceSession


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(h=st.integers(3, 14), w=st.integers(3, 14), kh=st.integers(1, 4), kw=st.integers(1, 4),
       stride=st.integers(2, 3), dy=st.integers(1, 2), dx=st.integers(1, 2), ceil=st.booleans(),
       pads=st.lists(st.integers(0, 1), min_size=4, max_size=4), n=st.integers(1, 2))
@pytest.mark.slow
def test_strided_max_pool_matches_onnxruntime(h, w, kh, kw, stride, dy, dx, ceil, pads, n):
    assume(all(p < k for p, k in zip(pads, [kh, kw, kh, kw])))  # onnxruntime: a pad smaller than the window
    assume(h + pads[0] + pads[2] >= dy * (kh - 1) + 1 and w + pads[1] + pads[3] >= dx * (kw - 1) + 1)
    node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[kh, kw], strides=[stride, stride], pads=pads,
                            dilations=[dy, dx], ceil_mode=int(ceil))
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, 3, h, w])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    x = np.random.default_rng(h * 16 + w).standard_normal((n, 3, h, w)).astype(np.float32)
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = InferenceSession(model).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)  # a maximum is one of the inputs: exact
