"""``precision="bf16"``: contractions with constant weights on ``vdpbf16ps`` (cuvil/graph/ops/nn/bf16.py).

The rounding (compile time in numpy, run time in the kernel's ``bf16_pair``) is checked bit for bit
against ml_dtypes' bfloat16, ties, infinities and NaN included; ``dot2_bf16`` in its scalar and vector
code against float64 sums of the rounded operands; whole ONNX nodes (MatMul, Gemm, Conv) against the
error bound of docs/precision.md computed from the inputs: ``(2^-8 + 2^-18 + (K + 2) 2^-24) * sum |a||w|``
per output (plus float32's rounding of the bias add), and never within float32's own error (so the
bf16 path really ran).  Tests that need the instruction skip on a CPU without ``avx512bf16`` and say so.
"""

from __future__ import annotations

import warnings

import isa
import numpy as np
import pytest
import toolchain

import cuvil
import cuvil.onnx
from cuvil import te
from cuvil.errors import ArgumentError
from cuvil.graph.ops.nn.bf16 import PrecisionWarning, bf16_panel, resolve_precision, round_bf16
from cuvil.ir.expr import bf16_pair, dot2_bf16

onnx = toolchain.module("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

HOST = cuvil.Target("llvm")
HAS_BF16 = "avx512bf16" in HOST.enabled_features
needs_bf16 = isa.needs("avx512bf16")
needs_avx512 = isa.needs("avx512f")
NO_BF16 = "llvm -mcpu=skylake-avx512 -mattr=+avx512f,+avx512bw,+avx512vl,+avx512dq"  # AVX-512 without BF16
RNG = np.random.default_rng(19)


def _awkward(n: int) -> np.ndarray:
    """float32 values that exercise the rounding: ties to even both ways, carries into the exponent,
    overflow to infinity, infinities, zeros of both signs, subnormals, NaNs, and random ones."""
    bits = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF, 0x3FFFFFFF, 0x7F7FFFFF, 0x7F7F7FFF,
                     0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x00000001, 0x007FFFFF, 0x7FC00000,
                     0x7F800001, 0xFFA00001, 0xBF808000], np.uint32)
    rnd = RNG.standard_normal(n).astype(np.float32) * np.float32(10.0) ** RNG.integers(-30, 30, n).astype(np.float32)
    return np.concatenate([bits.view(np.float32), rnd])


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    ml = toolchain.module("ml_dtypes")
    with np.errstate(invalid="ignore"):  # (ml_dtypes' cast of a NaN)
        return np.asarray(x, np.float32).astype(ml.bfloat16).view(np.uint16)


def _same_bits(ours: np.ndarray, ref: np.ndarray, x: np.ndarray) -> None:
    """Equal bit patterns, except that any quiet NaN matches a NaN (ml_dtypes keeps more payload)."""
    nan = np.isnan(x)
    assert np.array_equal(ours[~nan], ref[~nan])
    assert np.all((ours[nan] & 0x7FC0) == 0x7FC0)


def test_round_bf16_matches_ml_dtypes():
    x = _awkward(4000)
    _same_bits(round_bf16(x), _bf16_bits(x), x)


@pytest.mark.parametrize("vector", [False, True], ids=["scalar", "vector"])
def test_bf16_pair_in_the_kernel_rounds_as_numpy(vector):
    x = _awkward(1000)
    x = x[: len(x) // 2 * 2]
    n = len(x) // 2
    X = te.placeholder((2 * n,), "float32", name="X")
    Y = te.compute((n,), lambda i: bf16_pair(X[2 * i], X[2 * i + 1]), name="Y")
    s = te.create_schedule(Y)
    if vector:
        io, ii = s[Y].split(Y.op.axis[0], 16)
        s[Y].vectorize(ii)
    y = np.zeros(n, np.int32)
    cuvil.build(s, [X, Y])(x, y)
    halves = y.view(np.uint16)  # little endian: half 0 of word i is x[2 i]
    _same_bits(halves, _bf16_bits(x), x)


def _pack(a: np.ndarray) -> np.ndarray:
    """``a[..., 2k]`` (even length) as int32 words of bf16 pairs."""
    return round_bf16(a).reshape(a.shape[:-1] + (-1, 2)).view("<i4")[..., 0]


def _widen(a: np.ndarray) -> np.ndarray:
    return (round_bf16(a).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("vector, target", [(False, "llvm"), (True, "llvm"), (True, NO_BF16)],
                         ids=["scalar", "vector", "vector-without-avx512bf16"])
def test_dot2_sums_the_rounded_products(vector, target):
    if target == NO_BF16 and "avx512f" not in HOST.enabled_features:
        pytest.skip(isa.lacks("avx512f"))
    k2, n = 37, 48
    u = RNG.standard_normal(2 * k2).astype(np.float32)
    w = RNG.standard_normal((2 * k2, n)).astype(np.float32)
    U = te.placeholder((k2,), "int32", name="U")
    W = te.placeholder((n, k2), "int32", name="W")
    r = te.reduce_axis((0, k2), name="r")
    Y = te.compute((n,), lambda j: te.sum(dot2_bf16(U[r], W[j, r]), axis=r), name="Y")
    s = te.create_schedule(Y)
    if vector:
        jo, ji = s[Y].split(Y.op.axis[0], 16)
        s[Y].reorder(jo, r, ji)
        s[Y].vectorize(ji)
    mod = cuvil.build(s, [U, W, Y], target=target)
    assert ("vdpbf16ps" in mod.get_source("asm")) == (vector and target == "llvm" and HAS_BF16)
    y = np.zeros(n, np.float32)
    mod(_pack(u), np.ascontiguousarray(_pack(w.T)), y)
    exact = _widen(u) @ _widen(w)  # products of bf16 are exact; only float32's additions round
    bound = (2 * k2 + 2) * 2.0**-24 * (np.abs(_widen(u)) @ np.abs(_widen(w)))
    assert np.all(np.abs(y - exact) <= bound)


# -- whole nodes through a session --------------------------------------------------------------------


def _model(node: onnx.NodeProto, inputs: dict[str, tuple[int, ...]], consts: dict[str, np.ndarray]) -> bytes:
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
                          [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(v, n) for n, v in consts.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _asm(sess: cuvil.onnx.InferenceSession) -> str:
    return "".join(p.module.get_source("asm") for p in sess.programs())


def _conv_ref(x: np.ndarray, w: np.ndarray, stride: int, pad: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(exact output, sum |x||w| per output, K) of a 2-D convolution of one group, in float64."""
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    oh, ow = (h + 2 * pad - kh) // stride + 1, (wd + 2 * pad - kw) // stride + 1
    cols = np.stack([xp[:, :, i:i + stride * oh:stride, j:j + stride * ow:stride] for i in range(kh) for j in range(kw)],
                    axis=2)  # [n, c, taps, oh, ow]
    wf = w.astype(np.float64).reshape(o, c, kh * kw)
    exact = np.einsum("nctyx,oct->noyx", cols, wf)
    mag = np.einsum("nctyx,oct->noyx", np.abs(cols), np.abs(wf))
    return exact, mag, c * kh * kw


def _check_bound(y: np.ndarray, exact: np.ndarray, mag: np.ndarray, k: int, bias_mag: np.ndarray | float = 0.0
                 ) -> float:
    """Assert the documented bound and return the largest error in units of the bound's leading term."""
    bound = (2.0**-8 + 2.0**-18 + (k + 2) * 2.0**-24) * mag + 2.0**-24 * (np.abs(exact) + bias_mag)
    err = np.abs(y.astype(np.float64) - exact)
    assert np.all(err <= bound), f"worst error / bound {np.max(err / bound):.3f}"
    return float(np.max(err / (2.0**-8 * mag + 1e-30)))


def _sessions(model: bytes) -> tuple[cuvil.onnx.InferenceSession, cuvil.onnx.InferenceSession]:
    return (cuvil.onnx.InferenceSession(model, num_threads=1),
            cuvil.onnx.InferenceSession(model, num_threads=1, precision="bf16"))


@needs_bf16
def test_matmul_within_the_bound_on_vdpbf16ps():
    m, k, n = 33, 77, 70  # odd K (a half-empty last pair), N off the 32-column panels
    a = RNG.standard_normal((m, k)).astype(np.float32)
    w = RNG.standard_normal((k, n)).astype(np.float32)
    fp32, bf16 = _sessions(_model(helper.make_node("MatMul", ["a", "w"], ["y"]), {"a": (m, k)}, {"w": w}))
    exact, mag = a.astype(np.float64) @ w, np.abs(a.astype(np.float64)) @ np.abs(w)
    worst = _check_bound(bf16.run(None, {"a": a})[0], exact, mag, k)
    assert worst > 2.0**-8, "the bf16 result is as accurate as float32: the bf16 path did not run"
    assert _check_bound(fp32.run(None, {"a": a})[0], exact, mag, k) < 2.0**-12  # fp32 stays fp32
    assert "vdpbf16ps" in _asm(bf16) and "vdpbf16ps" not in _asm(fp32)


@needs_bf16
def test_batched_matmul_rows_of_a_3d_activation():
    a = RNG.standard_normal((2, 9, 64)).astype(np.float32)
    w = RNG.standard_normal((64, 40)).astype(np.float32)
    _, bf16 = _sessions(_model(helper.make_node("MatMul", ["a", "w"], ["y"]), {"a": a.shape}, {"w": w}))
    _check_bound(bf16.run(None, {"a": a})[0], a.astype(np.float64) @ w, np.abs(a.astype(np.float64)) @ np.abs(w), 64)


@needs_bf16
def test_gemm_transposed_weights_bias_and_alpha():
    m, k, n = 16, 50, 36
    a = RNG.standard_normal((m, k)).astype(np.float32)
    w = RNG.standard_normal((n, k)).astype(np.float32)
    c = RNG.standard_normal(n).astype(np.float32)
    node = helper.make_node("Gemm", ["a", "w", "c"], ["y"], transB=1, alpha=0.5)
    _, bf16 = _sessions(_model(node, {"a": (m, k)}, {"w": w, "c": c}))
    y = bf16.run(None, {"a": a})[0]
    exact = 0.5 * (a.astype(np.float64) @ w.T) + c
    mag = 0.5 * (np.abs(a.astype(np.float64)) @ np.abs(w.T))
    _check_bound(y, exact, mag, k, np.abs(c))
    assert "vdpbf16ps" in _asm(bf16)


@needs_bf16
@pytest.mark.parametrize("c, o, size, kernel, stride, pad", [
    (5, 40, 9, 3, 1, 1),  # odd channels, 3x3 with padding
    (16, 64, 8, 1, 1, 0),  # 1x1: over flattened pixels
    (32, 48, 9, 1, 2, 0),  # 1x1 of stride 2 (a ResNet downsample)
    (3, 32, 15, 7, 2, 3),  # a 7x7 stem
], ids=["3x3-odd-c", "1x1", "1x1-s2", "7x7-s2"])
@pytest.mark.slow
def test_conv_within_the_bound(c, o, size, kernel, stride, pad):
    x = RNG.standard_normal((1, c, size, size)).astype(np.float32)
    w = RNG.standard_normal((o, c, kernel, kernel)).astype(np.float32)
    b = RNG.standard_normal(o).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], strides=[stride, stride], pads=[pad] * 4)
    fp32, bf16 = _sessions(_model(node, {"x": x.shape}, {"w": w, "b": b}))
    exact, mag, k = _conv_ref(x, w, stride, pad)
    exact = exact + b[None, :, None, None]
    worst = _check_bound(bf16.run(None, {"x": x})[0], exact, mag, k, np.abs(b)[None, :, None, None])
    assert worst > 2.0**-8
    assert "vdpbf16ps" in _asm(bf16)


@needs_bf16
@pytest.mark.slow
def test_grouped_conv_and_activation_matmul_stay_float32():
    x = RNG.standard_normal((1, 8, 6, 6)).astype(np.float32)
    w = RNG.standard_normal((8, 4, 3, 3)).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], group=2)
    _, bf16 = _sessions(_model(node, {"x": x.shape}, {"w": w}))
    y = bf16.run(None, {"x": x})[0]
    ref = np.concatenate([_conv_ref(x[:, 4 * g:4 * g + 4], w[4 * g:4 * g + 4], 1, 0)[0] for g in range(2)], axis=1)
    assert np.allclose(y, ref, rtol=1e-5, atol=1e-5)
    a, b = RNG.standard_normal((8, 16)).astype(np.float32), RNG.standard_normal((16, 8)).astype(np.float32)
    mm = helper.make_node("MatMul", ["a", "b"], ["y"])
    _, sess = _sessions(_model(mm, {"a": (8, 16), "b": (16, 8)}, {}))
    assert np.allclose(sess.run(None, {"a": a, "b": b})[0], a @ b, rtol=1e-5, atol=1e-5)
    assert "vdpbf16ps" not in _asm(sess)


# -- the switch ---------------------------------------------------------------------------------------


@needs_avx512
def test_a_cpu_without_avx512bf16_computes_float32_and_says_so():
    target = cuvil.Target(NO_BF16)
    assert bf16_panel(target) == 0
    with pytest.warns(PrecisionWarning, match="avx512bf16"):
        assert resolve_precision("bf16", target) == "fp32"
    a = RNG.standard_normal((4, 40)).astype(np.float32)
    w = RNG.standard_normal((40, 64)).astype(np.float32)
    model = _model(helper.make_node("MatMul", ["a", "w"], ["y"]), {"a": (4, 40)}, {"w": w})
    with pytest.warns(PrecisionWarning, match="avx512bf16"):
        sess = cuvil.onnx.InferenceSession(model, target=NO_BF16, precision="bf16")
    assert sess.precision == "fp32"
    assert np.allclose(sess.run(None, {"a": a})[0], a @ w, rtol=1e-5, atol=1e-5)
    assert "vdpbf16ps" not in _asm(sess)


def test_fp32_is_the_default_and_bad_precisions_are_refused():
    w = RNG.standard_normal((8, 8)).astype(np.float32)
    model = _model(helper.make_node("MatMul", ["a", "w"], ["y"]), {"a": (2, 8)}, {"w": w})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cuvil.onnx.InferenceSession(model).precision == "fp32"
    assert cuvil.onnx.InferenceSession(model, precision=None).precision == "fp32"  # None: not given, the default
    for bad in ("fp16", "BF16", 16):
        with pytest.raises(ArgumentError, match="precision must be one of 'fp32', 'bf16'"):
            cuvil.onnx.InferenceSession(model, precision=bad)


@needs_bf16
def test_cli_compile_precision_bf16(tmp_path, capsys):
    from cuvil.cli import main

    w = RNG.standard_normal((64, 64)).astype(np.float32)
    path = tmp_path / "m.onnx"
    path.write_bytes(_model(helper.make_node("MatMul", ["a", "w"], ["y"]), {"a": (8, 64)}, {"w": w}))
    ll = tmp_path / "m.ll"
    assert main(["compile", str(path), "--precision", "bf16", "-o", str(ll)]) == 0
    assert "dpbf16ps" in ll.read_text()
    assert main(["compile", str(path), "-o", str(ll)]) == 0
    assert "dpbf16ps" not in ll.read_text()
