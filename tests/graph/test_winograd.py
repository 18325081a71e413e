"""Winograd F(2x2, 3x3) convolutions (cuvil.graph.ops.nn.winograd.winograd_conv) against a float64 reference,
the switch that turns them off, and the scheduler and fusion pieces they rely on."""

from __future__ import annotations

import math

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import cuvil  # noqa: E402
import cuvil.onnx  # noqa: E402
from cuvil import te  # noqa: E402
from cuvil.graph.ops.base import _dim_groups  # noqa: E402
from cuvil.graph.ops.nn import winograd as nn  # noqa: E402
from cuvil.options import CompileOptions  # noqa: E402


def _model(c: int, k: int, h: int, w: int, n: int = 1, bias: bool = True, relu: bool = True,
           pads: tuple[int, int, int, int] = (1, 1, 1, 1), seed: int = 0) -> tuple[bytes, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    wt = rng.standard_normal((k, c, 3, 3)).astype(np.float32) * np.float32((2 / (9 * c)) ** 0.5)
    b = rng.standard_normal(k).astype(np.float32)
    inits = [numpy_helper.from_array(wt, "w")] + ([numpy_helper.from_array(b, "b")] if bias else [])
    nodes = [helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["c" if relu else "y"],
                              pads=list(pads), kernel_shape=[3, 3])]
    if relu:
        nodes.append(helper.make_node("Relu", ["c"], ["y"]))
    oh, ow = h + pads[0] + pads[2] - 2, w + pads[1] + pads[3] - 2
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, c, h, w])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, k, oh, ow])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m.SerializeToString(), wt, (b if bias else np.zeros(k, np.float32))


def _reference(x: np.ndarray, wt: np.ndarray, b: np.ndarray, pads: tuple[int, int, int, int], relu: bool
               ) -> np.ndarray:
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    n, _, hp, wp = xp.shape
    oh, ow = hp - 2, wp - 2
    y = np.zeros((n, wt.shape[0], oh, ow))
    for ky in range(3):
        for kx in range(3):
            y += np.einsum("nchw,kc->nkhw", xp[:, :, ky:ky + oh, kx:kx + ow], wt[:, :, ky, kx].astype(np.float64))
    y += b[None, :, None, None]
    return np.maximum(y, 0) if relu else y


def _tolerance(x: np.ndarray, wt: np.ndarray, c: int) -> float:
    """A rounding bound for fp32: each output sums 9C products (sqrt(9C) growth of random rounding errors),
    and F(2, 3)'s transforms add and subtract up to 4 inputs (B^T d B), scale filters by at most 9/4 (G g G^T)
    and sum 9 products (A^T m A): a factor 64 over a direct convolution's eps * max|x| * max|w| covers them."""
    eps = float(np.finfo(np.float32).eps)
    return 64 * math.sqrt(9 * c) * eps * float(np.abs(x).max()) * float(np.abs(wt).max())


SMALL_IMAGES = CompileOptions().with_heuristics(winograd_min_tiles=1)  # so small (fast to compile) images use it


def test_too_few_tiles_stay_direct() -> None:
    model, wt, b = _model(128, 128, 10, 10)  # 25 tiles: the slow case (YOLOv8n's 128-channel 10x10 convs)
    x = np.random.default_rng(4).standard_normal((1, 128, 10, 10)).astype(np.float32)
    y, prog = _run(model, x, CompileOptions())
    assert "wino_gemm" not in _stages(prog)


def _run(model: bytes, x: np.ndarray, options: CompileOptions = SMALL_IMAGES) -> tuple[np.ndarray, object]:
    s = cuvil.onnx.InferenceSession(model, num_threads=1, options=options)
    y = s.run(None, {"x": x})[0]
    return y, s.programs()[0]


def _stages(prog: object) -> str:
    return "\n".join(str(f) for f in prog.kernel_funcs)  # type: ignore[attr-defined]


@pytest.mark.parametrize("c,k,h,w,n,bias,relu,pads", [
    (128, 128, 8, 8, 1, True, True, (1, 1, 1, 1)),
    (128, 160, 6, 10, 1, False, False, (1, 1, 1, 1)),   # filters not a whole number of panels, no epilogue
    (136, 128, 9, 7, 1, True, False, (0, 1, 1, 0)),     # asymmetric padding: an 8 x 6 output
])
@pytest.mark.slow
def test_winograd_matches_direct(c: int, k: int, h: int, w: int, n: int, bias: bool, relu: bool,
                                 pads: tuple[int, int, int, int]) -> None:
    model, wt, b = _model(c, k, h, w, n, bias, relu, pads)
    x = np.random.default_rng(1).standard_normal((n, c, h, w)).astype(np.float32)
    y, prog = _run(model, x)
    assert "wino_gemm" in _stages(prog)
    ref = _reference(x, wt, b, pads, relu)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=_tolerance(x, wt, c))


def test_winograd_off_compiles_direct() -> None:
    model, wt, b = _model(128, 128, 8, 8)
    x = np.random.default_rng(2).standard_normal((1, 128, 8, 8)).astype(np.float32)
    y_w, prog_w = _run(model, x)
    y_d, prog_d = _run(model, x, SMALL_IMAGES.replace(winograd=False))
    assert "wino_gemm" in _stages(prog_w) and "wino_gemm" not in _stages(prog_d)
    np.testing.assert_allclose(y_w, y_d, rtol=1e-4, atol=_tolerance(x, wt, 128))


@pytest.mark.parametrize("c,k,h,stride", [(64, 64, 8, 1), (128, 128, 7, 1), (128, 128, 8, 2)])
def test_convolutions_it_does_not_pay_for_stay_direct(c: int, k: int, h: int, stride: int) -> None:
    """Fewer than Heuristics.winograd_min_channels channels, an odd output, a stride: direct."""
    rng = np.random.default_rng(3)
    wt = rng.standard_normal((k, c, 3, 3)).astype(np.float32)
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], strides=[stride] * 2)],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, h, h])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(wt, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    _, prog = _run(m.SerializeToString(), rng.standard_normal((1, c, h, h)).astype(np.float32))
    assert "wino_gemm" not in _stages(prog)


def test_dim_groups_split_dimensions() -> None:
    """A fused kernel whose contraction's output splits the graph's dimensions (Winograd's
    [n, k, y / 2, 2, x / 2, 2]) keeps its epilogue at that shape."""
    assert _dim_groups((1, 256, 32, 32), (1, 256, 16, 2, 16, 2)) == [[], [1], [2], [2], [3], [3]]
    assert _dim_groups((1, 256, 32, 32), (256, 1024)) == [[1], [2, 3]]
    assert _dim_groups((1, 6, 4), (4, 6)) is None
    assert _dim_groups((1, 6, 4), (1, 4, 3, 2)) is None  # a split must divide the dimension it splits


def test_selector_axes_are_unrolled() -> None:
    """An element-wise stage whose small axis chooses a formula gets one copy per value, no select left."""
    x = te.placeholder((4, 64), name="x")
    y = te.compute((3, 4, 64), lambda r, i, j: nn._choose(r, [x[i, j] + 1.0, x[i, j] * 2.0, -x[i, j]]), name="y")
    s = cuvil.auto_schedule([x, y], "llvm")
    text = str(cuvil.lower(s, [x, y]))
    assert "select" not in text and "y[0, " in text and "y[2, " in text
    f = cuvil.build(s, [x, y])
    a = np.random.default_rng(4).standard_normal((4, 64)).astype(np.float32)
    out = np.empty((3, 4, 64), np.float32)
    f(a, out)
    np.testing.assert_array_equal(out, np.stack([a + 1, a * 2, -a]))
