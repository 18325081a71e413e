"""Window reductions (depthwise convolutions, pooling) under auto_schedule: the padded copy a
depthwise convolution reads is computed per channel inside the channel loop, and the results match numpy."""

import isa
import numpy as np
import pytest

import cuvil
from cuvil import te
from cuvil.te import ops


def _depthwise_ref(x: np.ndarray, w: np.ndarray, stride: int, pad: int) -> np.ndarray:
    n, c, h, _ = x.shape
    k = w.shape[-1]
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    oh = (h + 2 * pad - k) // stride + 1
    out = np.zeros((n, c, oh, oh))
    for ry in range(k):
        for rx in range(k):
            out += xp[:, :, ry:ry + stride * oh:stride, rx:rx + stride * oh:stride] * w[None, :, 0, ry, rx, None, None]
    return out


@pytest.mark.parametrize("n,c,h,stride", [(1, 40, 7, 1), (1, 16, 20, 1), (2, 8, 9, 1), (1, 12, 11, 2), (1, 6, 40, 1)])
def test_depthwise_pads_each_channel_inside_its_loop(n, c, h, stride):
    X = te.placeholder((n, c, h, h), name="X")
    W = te.placeholder((c, 1, 3, 3), name="W")
    Y = ops.conv2d_nchw(X, W, stride=stride, padding=1, groups=c)
    s = cuvil.auto_schedule([X, W, Y])
    steps = [(st.op, st.stage) for st in s.trace]
    mod = cuvil.build(s, [X, W, Y])
    rng = np.random.default_rng(c * h)
    x = rng.standard_normal((n, c, h, h)).astype(np.float32)
    w = rng.standard_normal((c, 1, 3, 3)).astype(np.float32)
    y = np.empty([int(d.value) for d in Y.shape], np.float32)
    mod(x, w, y)
    np.testing.assert_allclose(y, _depthwise_ref(x, w, stride, 1), rtol=1e-5, atol=1e-5 * 3)
    loops = str(cuvil.lower(s, [X, W, Y]))
    if stride == 1 and h >= 2 * isa.lanes(32):  # rows of two vectors or more: the padding inlined, masked loads
        assert "conv_pad" not in loops, loops
    elif stride == 1:  # a unit-stride window: vectorised rows, the padding computed per channel (or batch element)
        assert any(op == "compute_at" for op, _ in steps), s.trace
        assert "global float32 conv_pad" not in loops and "local float32 conv_pad" in loops, loops


def test_seven_tap_window_is_unrolled_and_matches_numpy():
    # a 7x7 stride-2 convolution (ResNet's stem, small): the innermost window loop (7 taps) is unrolled
    # whole (ku = 8), the tile stored a column at a time; the result is numpy's
    X = te.placeholder((1, 3, 20, 20), name="X")
    W = te.placeholder((16, 3, 7, 7), name="W")
    Y = ops.conv2d_nchw(X, W, stride=2, padding=3)
    s = cuvil.auto_schedule([X, W, Y])
    assert any(st.op == "unroll" and st.stage.endswith("local") and st.args == ("rx",) for st in s.trace), s.trace
    mod = cuvil.build(s, [X, W, Y])
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, 3, 20, 20)).astype(np.float32)
    w = rng.standard_normal((16, 3, 7, 7)).astype(np.float32)
    y = np.empty([int(d.value) for d in Y.shape], np.float32)
    mod(x, w, y)
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (3, 3), (3, 3)))
    want = np.zeros((1, 16, 10, 10))
    for ry in range(7):
        for rx in range(7):
            patch = xp[:, :, ry:ry + 20:2, rx:rx + 20:2]  # (1, 3, 10, 10)
            want += np.einsum("nchw,fc->nfhw", patch, w[:, :, ry, rx])
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.sqrt(147) * 4)
