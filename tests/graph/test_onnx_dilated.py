"""Convolutions whose taps reach past the image (dilated windows wider than the image, padding larger than
it): computed region by region over the taps that read the image (cuvil.graph.ops.nn.conv._tap_regions), against
onnxruntime."""

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from cuvil.graph.ops.nn.conv import _axis_intervals, _tap_regions
from cuvil.onnx import InferenceSession


def _check_conv(rng, c, f, hw, kernel, bias, relu=False, **attrs):
    """One Conv node (+ Relu) on a 1 x c x hw input: cuvil's output against onnxruntime's."""
    w = (rng.standard_normal((f, c) + tuple(kernel)) / np.sqrt(c * np.prod(kernel))).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w")] + ([numpy_helper.from_array(
        rng.standard_normal(f).astype(np.float32), "b")] if bias else [])
    nodes = [helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["c" if relu else "y"],
                              kernel_shape=list(kernel), **attrs)]
    if relu:
        nodes.append(helper.make_node("Relu", ["c"], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, *hw])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    x = rng.standard_normal((1, c) + tuple(hw)).astype(np.float32)
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = InferenceSession(model).run(None, {"x": x})[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_the_aspp_rates_cut_the_window_into_regions_and_a_3x3_with_padding_1_stays_whole():
    """DeepLab's ASPP on its 33x33 map: rates 12 and 18 lose whole tap rows and columns over long stretches
    of outputs; rate 6's stretches (6 outputs) are narrower than 8 (Zen 4's FMA pipes x latency) and stay
    whole; a plain 3x3 with padding 1, dilation 2 on 33x33 and GoogLeNet's 5x5 with padding 2 stay whole."""
    from cuvil.schedule.heuristics import Heuristics

    assert Heuristics.for_target("llvm -mcpu=znver4").region_rows == 8
    assert Heuristics.for_target("llvm -mcpu=x86-64-v3").region_rows == 8
    cut = _tap_regions((33, 33), [3, 3], [1, 1], [18, 18], [18, 18], [33, 33], 8)
    assert cut is not None and all(len(c) == 2 for c in cut)
    assert all(x1 - x0 >= 8 for c in cut for x0, x1, _, _ in c)
    assert _tap_regions((33, 33), [3, 3], [1, 1], [12, 12], [12, 12], [33, 33], 8) == [
        [(0, 12, 1, 3), (12, 21, 0, 3), (21, 33, 0, 2)]] * 2
    assert _tap_regions((33, 33), [3, 3], [1, 1], [6, 6], [6, 6], [33, 33], 8) is None
    assert _tap_regions((33, 33), [3, 3], [1, 1], [6, 6], [6, 6], [33, 33], 4) == [
        [(0, 6, 1, 3), (6, 27, 0, 3), (27, 33, 0, 2)]] * 2
    for size in (7, 28):
        assert _tap_regions((size, size), [5, 5], [1, 1], [1, 1], [2, 2], [size, size], 8) is None
    for size in (7, 14, 56):
        assert _tap_regions((size, size), [3, 3], [1, 1], [1, 1], [1, 1], [size, size], 8) is None
    assert _tap_regions((33, 33), [3, 3], [1, 1], [2, 2], [2, 2], [33, 33], 8) is None
    assert _tap_regions((224, 224), [7, 7], [2, 2], [1, 1], [3, 3], [112, 112], 8) is None


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 40), k=st.integers(1, 7), stride=st.integers(1, 3), dil=st.integers(1, 20),
       begin=st.integers(0, 25), end=st.integers(0, 25), min_len=st.integers(1, 8))
def test_axis_intervals_cover_every_output_with_every_tap_that_reads_the_image(size, k, stride, dil, begin, end,
                                                                              min_len):
    span = dil * (k - 1) + 1
    assume(size + begin + end >= span)
    out = (size + begin + end - span) // stride + 1
    cut, cost = _axis_intervals(size, k, stride, dil, begin, out, min_len)
    assert cut[0][0] == 0 and cut[-1][1] == out and all(a[1] == b[0] for a, b in zip(cut, cut[1:]))
    assert all(x1 - x0 >= min_len for x0, x1, _, _ in cut) or len(cut) == 1
    assert cost == sum((x1 - x0) * (k1 - k0) for x0, x1, k0, k1 in cut) <= out * k
    for o0, o1, k0, k1 in cut:
        assert 0 <= k0 < k1 <= k
        for o in range(o0, o1):
            reach = [t for t in range(k) if 0 <= o * stride + t * dil - begin < size]
            assert all(k0 <= t < k1 for t in reach)


@pytest.mark.parametrize("c,f,hw,rate,bias", [
    (16, 32, (33, 33), 18, True), (16, 32, (33, 33), 12, False), (8, 40, (33, 33), 6, True),
    (8, 16, (9, 13), 12, True),  # padding larger than the image: outputs that only see padding (the bias)
    (4, 8, (5, 5), 30, False),  # every tap but the centre in the padding
])
@pytest.mark.slow
def test_dilated_aspp_convs_match_onnxruntime(c, f, hw, rate, bias):
    _check_conv(np.random.default_rng(rate * 10 + c), c, f, hw, (3, 3), bias, relu=True, dilations=[rate] * 2,
                pads=[rate] * 4)


def test_padding_past_the_image_with_a_stride_and_asymmetric_padding():
    _check_conv(np.random.default_rng(5), 6, 20, (10, 23), (3, 5), True, strides=[2, 1], dilations=[7, 6],
                pads=[14, 12, 9, 20])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=st.integers(1, 9), f=st.integers(1, 40), h=st.integers(1, 20), w=st.integers(1, 20),
       kh=st.integers(1, 4), kw=st.integers(1, 4), stride=st.integers(1, 3), dy=st.integers(1, 12),
       dx=st.integers(1, 12), pads=st.lists(st.integers(0, 24), min_size=4, max_size=4), bias=st.booleans())
@pytest.mark.slow
def test_convs_with_taps_past_the_image_match_onnxruntime(c, f, h, w, kh, kw, stride, dy, dx, pads, bias):
    """Any kernel, dilation, padding (up to larger than the image) and stride: whole or region by region."""
    oh = (h + pads[0] + pads[2] - dy * (kh - 1) - 1) // stride + 1
    ow = (w + pads[1] + pads[3] - dx * (kw - 1) - 1) // stride + 1
    assume(oh >= 1 and ow >= 1)
    _check_conv(np.random.default_rng(c * 1000 + f), c, f, (h, w), (kh, kw), bias, strides=[stride] * 2,
                dilations=[dy, dx], pads=pads)
