"""Quantized operators on small hand-built models (cuvil/graph/ops/quant/), and QDQ matching
(cuvil/graph/qdq.py) on models quantized by onnxruntime's own tool, against the semantics of the
quantized operators (tests/support/quant_reference.py), never against a vendor's fused kernels:

- QuantizeLinear / DequantizeLinear and every QDQ model: onnxruntime with its graph optimizations off,
  so the float operators between DQ and Q run as written (no QDQ group fused into an integer kernel);
- QLinearConv, QLinearMatMul, MatMulInteger, ConvInteger: numpy in exact integers with ONNX's
  requantization (the float32 multiplier ``x_scale * w_scale / y_scale``, half-to-even rounding, the zero
  point, saturation), which cuvil computes the same way: its integer results must be equal, bit for bit;
- com.microsoft's QLinear operators, MatMulInteger / ConvInteger inside a model and onnxruntime's
  QOperator files: the same graph with each such operator written as DQ -> float operator -> Q (or as exact
  integer operators), run as above (``quant_reference.semantics_model``).

Where the reference is a float chain (a QDQ model's float Conv, a com.microsoft operator's formula in
float), a value that lands near a rounding tie may round the other way than in cuvil's exact integers:
one quantization step, no more.

onnxruntime's own result (its default session: fused integer kernels) is checked as well where a test says
so, second and labelled (``quant_reference.check_fused``): on an x86 CPU with VNNI it is held to cuvil's
bound; on one without VNNI its u8 x s8 kernels (``vpmaddubsw``: saturating 16-bit pair sums) lie 3-11 steps
off, which is reported as a warning, not failed.  ONNX's node cases of these operators run in
tests/frontends/test_onnx_node.py."""

from __future__ import annotations

import numpy as np
import pytest
import quant_reference as qr
import reference
import toolchain
from hypothesis import given
from hypothesis import strategies as st

onnx = toolchain.module("onnx")
toolchain.module("onnxruntime")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper as h  # noqa: E402
from onnx import numpy_helper as nh  # noqa: E402

import cuvil.onnx  # noqa: E402
from cuvil.errors import DTypeError, ShapeError  # noqa: E402
from cuvil.graph.qdq import integer_contractions  # noqa: E402

_ELEM = {"float32": T.FLOAT, "uint8": T.UINT8, "int8": T.INT8, "int32": T.INT32, "int16": T.INT16,
         "uint16": T.UINT16}


def _model(nodes: list, feeds: dict[str, np.ndarray], outs: list[tuple[str, str]], inits: dict[str, np.ndarray],
           opset: int = 21, ms: bool = False) -> bytes:
    g = h.make_graph(nodes, "q", [h.make_tensor_value_info(k, _ELEM[v.dtype.name], v.shape) for k, v in feeds.items()],
                     [h.make_tensor_value_info(n, _ELEM[d], None) for n, d in outs],
                     [nh.from_array(np.asarray(v), k) for k, v in inits.items()])
    ops = [h.make_opsetid("", opset)] + ([h.make_opsetid("com.microsoft", 1)] if ms else [])
    return h.make_model(g, opset_imports=ops, ir_version=10).SerializeToString()


def _semantics(model: bytes, feeds: dict[str, np.ndarray]) -> tuple[list, list]:
    """cuvil's outputs and the semantics': onnxruntime with its graph optimizations off, after
    ``quant_reference.semantics_model`` wrote any integer operator in its plain form."""
    ref = qr.run_semantics(qr.semantics_model(onnx.load_from_string(model)), feeds)
    got = cuvil.onnx.InferenceSession(model).run(None, feeds)
    return got, ref


def _equal(got: list, ref: list) -> None:
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape
        np.testing.assert_array_equal(g, r)


QT = st.sampled_from(["uint8", "int8"])
SHAPES = st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple)


@reference.budget(0.5)
@given(shape=SHAPES, qt=QT, per_axis=st.booleans(), seed=st.integers(0, 2**16), data=st.data())
@pytest.mark.slow
def test_quantize_dequantize(shape, qt, per_axis, seed, data):
    """Q then DQ, per tensor or per axis: ties exactly at .5 (power-of-two scales make x / s exact),
    values past both limits (saturation), arbitrary scales."""
    r = np.random.default_rng(seed)
    axis = data.draw(st.integers(-len(shape), len(shape) - 1)) if per_axis else 1
    n = shape[axis] if per_axis else 1
    ties = r.integers(-300, 300, shape) + 0.5
    scale = np.where(r.random(n) < 0.5, 2.0 ** r.integers(-4, 3, n), r.uniform(0.01, 2, n)).astype(np.float32)
    zp = r.integers(*((0, 256) if qt == "uint8" else (-128, 128)), n).astype(qt)
    bshape = [1] * len(shape)
    if per_axis:
        bshape[axis] = n
    x = (ties * scale.reshape(bshape)).astype(np.float32)
    x.reshape(-1)[: x.size // 3] = r.uniform(-400, 400, x.size // 3).astype(np.float32)
    if not per_axis:
        scale, zp = scale.reshape(()), zp.reshape(())
    nodes = [h.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], axis=axis),
             h.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], axis=axis)]
    got, ref = _semantics(_model(nodes, {"x": x}, [("q", qt), ("y", "float32")], {"s": scale, "z": zp}), {"x": x})
    _equal(got, ref)


def test_quantize_divides_not_multiplies():
    """x / s lands exactly on a tie where x * (1 / s) does not: round half to even of the quotient."""
    s = np.float32(1.8871624)
    k = np.arange(-100, 100, dtype=np.float32) + np.float32(0.5)
    x = (k * s).astype(np.float32)
    on_tie = (x / s) == k  # quotients exactly on the tie (numpy divides as IEEE says)
    x, k = x[on_tie], k[on_tie]
    assert (x * (np.float32(1) / s) != k).any()  # a reciprocal would miss some of them
    nodes = [h.make_node("QuantizeLinear", ["x", "s", "z"], ["q"])]
    model = _model(nodes, {"x": x}, [("q", "int8")], {"s": s, "z": np.int8(0)})
    got, ref = _semantics(model, {"x": x})
    _equal(got, ref)
    np.testing.assert_array_equal(got[0], np.rint(k).astype(np.int8))


def test_blocked_and_16_bit():
    r = np.random.default_rng(3)
    x = r.uniform(-50, 50, (4, 6)).astype(np.float32)
    s = r.uniform(0.1, 1, (2, 6)).astype(np.float32)
    z = r.integers(-5, 5, (2, 6)).astype(np.int16)
    nodes = [h.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], axis=0, block_size=2),
             h.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], axis=0, block_size=2)]
    got, ref = _semantics(_model(nodes, {"x": x}, [("q", "int16"), ("y", "float32")], {"s": s, "z": z}), {"x": x})
    _equal(got, ref)


def test_dynamic_quantize_matmul_integer():
    """quantize_dynamic's MatMul: DynamicQuantizeLinear, MatMulInteger with the run-time zero point,
    non-zero weight zero points per column.  The semantics: DynamicQuantizeLinear by onnxruntime with its
    optimizations off, MatMulInteger in exact integers (numpy, and the int32 MatMul of
    ``quant_reference.semantics_model``, checked against each other); then onnxruntime's fused kernels, second."""
    r = np.random.default_rng(4)
    x = r.standard_normal((5, 7)).astype(np.float32) * 3
    wu = r.integers(0, 256, (7, 4)).astype(np.uint8)
    zwu = r.integers(125, 131, 4).astype(np.uint8)
    nodes = [h.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             h.make_node("MatMulInteger", ["xq", "wu", "xz", "zwu"], ["acc"])]
    outs = [("acc", "int32"), ("xs", "float32"), ("xz", "uint8"), ("xq", "uint8")]
    model = _model(nodes, {"x": x}, outs, {"wu": wu, "zwu": zwu})
    got, ref = _semantics(model, {"x": x})
    np.testing.assert_array_equal(ref[0], qr.matmul_integer(ref[3], wu, ref[2], zwu))
    _equal(got, ref)
    qr.check_fused("DynamicQuantizeLinear + MatMulInteger", qr.run_fused(model, {"x": x}), ref)


@pytest.mark.slow
def test_dynamic_integer_to_float():
    """quantize_dynamic's MatMulInteger / ConvInteger -> Cast -> Mul(x_scale * w_scale) become one kernel
    each (the int32 sums scaled in its epilogue, the bias Add fused after it), against the semantics (the
    integer operators as exact integer ones, ``quant_reference.semantics_model``: the ConvInteger's sums,
    at most 18 * 255 * 255 here, are exact in its float Conv); then onnxruntime's fused kernels, second."""
    r = np.random.default_rng(6)
    x = r.standard_normal((4, 6)).astype(np.float32)
    img = r.standard_normal((1, 2, 5, 5)).astype(np.float32)
    inits = {"w": r.integers(0, 256, (6, 3)).astype(np.uint8), "zw": np.uint8(128), "sw": np.float32(0.02),
             "b": r.standard_normal(3).astype(np.float32), "wc": r.integers(0, 256, (3, 2, 3, 3)).astype(np.uint8),
             "zwc": np.uint8(120), "swc": np.float32(0.01)}
    nodes = [h.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             h.make_node("MatMulInteger", ["xq", "w", "xz", "zw"], ["acc"]),
             h.make_node("Cast", ["acc"], ["accf"], to=T.FLOAT),
             h.make_node("Mul", ["xs", "sw"], ["s"]),
             h.make_node("Mul", ["accf", "s"], ["m"]),
             h.make_node("Add", ["m", "b"], ["y"]),
             h.make_node("DynamicQuantizeLinear", ["img"], ["iq", "is", "iz"]),
             h.make_node("ConvInteger", ["iq", "wc", "iz", "zwc"], ["cacc"], pads=[1, 1, 1, 1]),
             h.make_node("Cast", ["cacc"], ["caccf"], to=T.FLOAT),
             h.make_node("Mul", ["is", "swc"], ["cs"]),
             h.make_node("Mul", ["cs", "caccf"], ["cy"])]
    feeds = {"x": x, "img": img}
    model = _model(nodes, feeds, [("y", "float32"), ("cy", "float32")], inits)
    s = cuvil.onnx.InferenceSession(model)
    ops = {n.op_type for n in s._graph.nodes}
    assert {"CuvilMatMulIntegerToFloat", "CuvilConvIntegerToFloat"} <= ops and "Cast" not in ops, ops
    assert integer_contractions(s)["float"] == []
    ref = qr.run_semantics(qr.semantics_model(onnx.load_from_string(model)), feeds)
    got = s.run(None, feeds)
    # the int32 sums and the scale are equal; cuvil's vector code may fuse the scale multiply with the bias
    # add (one rounding instead of two): a few float32 ulp
    for g, want in zip(got, ref):
        np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    # the same few ulp, measured against the largest value of each output
    qr.check_fused("MatMulInteger / ConvInteger to float", qr.run_fused(model, feeds), ref, within=2e-6,
                   steps=[float(np.abs(v).max()) for v in ref])


@reference.budget(0.25)
@given(m=st.integers(1, 6), k=st.integers(1, 9), n=st.integers(1, 7), qa=QT, qb=QT, batch=st.booleans(),
       a_batched=st.booleans(), seed=st.integers(0, 2**16))
def test_qlinear_matmul(m, k, n, qa, qb, batch, a_batched, seed):
    """QLinearMatMul (constant or fed weights, batched, A broadcast over B's batches or not) and
    MatMulInteger with both zero points (onnxruntime takes int8 A only with int8 B), equal to the exact
    integer product requantized in numpy; then onnxruntime's fused kernels, second."""
    qb = "int8" if qa == "int8" else qb
    r = np.random.default_rng(seed)
    lo = {"uint8": 0, "int8": -128}
    a = r.integers(lo[qa], lo[qa] + 256, ((2,) if batch and a_batched else ()) + (m, k)).astype(qa)
    b = r.integers(lo[qb], lo[qb] + 256, ((2,) if batch else ()) + (k, n)).astype(qb)
    za, zb, zy = (np.array(r.integers(lo[t], lo[t] + 256), t) for t in (qa, qb, qa))
    sa, sb, sy = (np.array(r.uniform(0.001, 0.05), np.float32) for _ in range(3))
    inits = {"sa": sa, "za": za, "sb": sb, "zb": zb, "sy": sy, "zy": zy}
    feeds = {"a": a}
    if batch:
        feeds["b"] = b
    else:
        inits["b"] = b
    nodes = [h.make_node("QLinearMatMul", ["a", "sa", "za", "b", "sb", "zb", "sy", "zy"], ["y"]),
             h.make_node("MatMulInteger", ["a", "b", "za", "zb"], ["acc"])]
    model = _model(nodes, feeds, [("y", qa), ("acc", "int32")], inits)
    ref = [qr.qlinear_matmul(a, sa, za, b, sb, zb, sy, zy), qr.matmul_integer(a, b, za, zb)]
    _equal(cuvil.onnx.InferenceSession(model).run(None, feeds), ref)
    qr.check_fused("QLinearMatMul / MatMulInteger", qr.run_fused(model, feeds), ref)


@reference.budget(0.25)
@given(c=st.integers(1, 4), m=st.integers(1, 5), size=st.integers(3, 7), kern=st.integers(1, 3),
       stride=st.integers(1, 2), pad=st.integers(0, 1), qx=QT, per_channel=st.booleans(), seed=st.integers(0, 2**16))
@pytest.mark.slow
def test_qlinear_conv(c, m, size, kern, stride, pad, qx, per_channel, seed):
    """QLinearConv (s8 weights, per-tensor or per-channel scales, int32 bias, padding with zx) and
    ConvInteger (u8 weights with a zero point per channel), equal to the exact integer convolution
    requantized in numpy; then onnxruntime's fused kernels, second (on a CPU without VNNI they are off
    here by a step or more: cuvil 79 where onnxruntime gives 80 on a Zen 3)."""
    r = np.random.default_rng(seed)
    lo = {"uint8": 0, "int8": -128}[qx]
    x = r.integers(lo, lo + 256, (2, c, size, size)).astype(qx)
    w = r.integers(-127, 128, (m, c, kern, kern)).astype(np.int8)
    nm = m if per_channel else 1
    sw = r.uniform(0.001, 0.02, nm).astype(np.float32).reshape((nm,) if per_channel else ())
    bias = r.integers(-5000, 5000, m).astype(np.int32)
    zx = np.array(r.integers(lo, lo + 256), qx)
    wu = r.integers(0, 256, (m, c, kern, kern)).astype(np.uint8)
    zwu = np.array(r.integers(0, 256), np.uint8)  # onnxruntime's ConvInteger: one weight zero point
    inits = {"sx": np.float32(0.02), "zx": zx, "w": w, "sw": sw, "sy": np.float32(0.3),
             "zy": np.array(lo + 100, qx), "B": bias, "wu": wu, "zwu": zwu}
    attrs = {"pads": [pad] * 4, "strides": [stride] * 2}
    nodes = [h.make_node("QLinearConv", ["x", "sx", "zx", "w", "sw", "zx_w", "sy", "zy", "B"], ["y"], **attrs),
             h.make_node("ConvInteger", ["x", "wu", "zx", "zwu"], ["acc"], **attrs)] if qx == "uint8" else \
        [h.make_node("QLinearConv", ["x", "sx", "zx", "w", "sw", "zx_w", "sy", "zy", "B"], ["y"], **attrs)]
    inits["zx_w"] = np.zeros(sw.shape, np.int8)
    outs = [("y", qx)] + ([("acc", "int32")] if qx == "uint8" else [])
    model = _model(nodes, {"x": x}, outs, inits)
    ref = [qr.qlinear_conv(x, inits["sx"], zx, w, sw, inits["zx_w"], inits["sy"], inits["zy"], bias, **attrs)]
    if qx == "uint8":
        ref.append(qr.conv_integer(x, wu, zx, zwu, **attrs))
    _equal(cuvil.onnx.InferenceSession(model).run(None, {"x": x}), ref)
    qr.check_fused("QLinearConv / ConvInteger", qr.run_fused(model, {"x": x}), ref)


@pytest.mark.parametrize("qt", ["uint8", "int8"])
@pytest.mark.slow
def test_com_microsoft_ops(qt):
    """The com.microsoft QLinear operators onnxruntime's quantizer writes, each against its semantics: the
    QDQ form (DQ -> Add / Mul / Sigmoid / LeakyRelu / GlobalAveragePool / Concat / Softmax -> Q) run by
    onnxruntime with its optimizations off.  cuvil computes some of them another way (QLinearAdd with the
    scale ratios folded, tables for the unary ones, the exact integer sum of the pool, a table of
    exponentials for the softmax), so a value within float32's rounding of a tie may round the other way:
    one step, in fewer than 1% of the elements (measured: 1 element of 120 at one seed of five, none at
    this one).  Then onnxruntime's own kernels, second: none of them is a u8 x s8 contraction, so they are
    held to the same bound on every CPU."""
    r = np.random.default_rng(7)
    lo = {"uint8": 0, "int8": -128}[qt]
    a = r.integers(lo, lo + 256, (2, 3, 4, 5)).astype(qt)
    b = r.integers(lo, lo + 256, (2, 3, 4, 5)).astype(qt)
    ms = "com.microsoft"
    inits = {"sa": np.float32(0.05), "za": np.array(lo + 120, qt), "sb": np.float32(0.03), "zb": np.array(lo + 7, qt),
             "sc": np.float32(0.07), "zc": np.array(lo + 130, qt), "sd": np.float32(1 / 256), "zd": np.array(lo, qt)}
    nodes = [h.make_node("QLinearAdd", ["a", "sa", "za", "b", "sb", "zb", "sc", "zc"], ["add"], domain=ms),
             h.make_node("QLinearMul", ["a", "sa", "za", "b", "sb", "zb", "sc", "zc"], ["mul"], domain=ms),
             h.make_node("QLinearSigmoid", ["a", "sa", "za", "sd", "zd"], ["sig"], domain=ms),
             h.make_node("QLinearLeakyRelu", ["a", "sa", "za", "sc", "zc"], ["lrelu"], domain=ms, alpha=0.1),
             h.make_node("QLinearGlobalAveragePool", ["a", "sa", "za", "sc", "zc"], ["gap"], domain=ms,
                         channels_last=0),
             h.make_node("QLinearConcat", ["sc", "zc", "a", "sa", "za", "b", "sc", "zc"], ["cat"], domain=ms, axis=1),
             h.make_node("QLinearSoftmax", ["a", "sa", "za", "sd", "zd"], ["sm"], domain=ms, axis=-1, opset=13)]
    names = ["add", "mul", "sig", "lrelu", "gap", "cat", "sm"]
    feeds = {"a": a, "b": b}
    model = _model(nodes, feeds, [(n, qt) for n in names], inits, ms=True)
    got, ref = _semantics(model, feeds)
    _near(got, ref, names)
    fused = qr.run_fused(model, feeds)
    qr.check_fused("com.microsoft QLinear operators", fused, ref, within=1, u8s8=False)
    assert sum(int((f != r).sum()) for f, r in zip(fused, ref)) < 0.01 * sum(r.size for r in ref)


def _near(got: list, ref: list, names: list[str]) -> None:
    """Every output within one step of the semantics, and fewer than 1% of all elements a step away."""
    for g, r, n in zip(got, ref, names):
        assert qr.steps_apart(g, r) <= 1, (n, qr.steps_apart(g, r))
    off = sum(int((g != r).sum()) for g, r in zip(got, ref))
    assert off < 0.01 * sum(r.size for r in ref), f"{off} elements a step from the semantics"


# -- models quantized by onnxruntime's tool -------------------------------------------------------------


def _float_model() -> bytes:
    r = np.random.default_rng(0)
    inits = {"w1": r.standard_normal((8, 3, 3, 3)) * 0.3, "b1": r.standard_normal(8) * 0.1,
             "w2": r.standard_normal((8, 8, 3, 3)) * 0.2, "wg": r.standard_normal((10, 16)) * 0.3,
             "bg": r.standard_normal(10) * 0.1, "wm": r.standard_normal((10, 6)) * 0.3}
    inits = {k: v.astype(np.float32) for k, v in inits.items()}
    nodes = [h.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             h.make_node("Relu", ["c1"], ["r1"]),
             h.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             h.make_node("Add", ["c2", "r1"], ["a"]),
             h.make_node("Sigmoid", ["a"], ["s"]),
             h.make_node("Concat", ["s", "r1"], ["cat"], axis=1),
             h.make_node("MaxPool", ["cat"], ["mp"], kernel_shape=[2, 2], strides=[2, 2]),
             h.make_node("GlobalAveragePool", ["mp"], ["gap"]),
             h.make_node("Flatten", ["gap"], ["f"]),
             h.make_node("Gemm", ["f", "wg", "bg"], ["g"], transB=1),
             h.make_node("Relu", ["g"], ["gr"]),
             h.make_node("MatMul", ["gr", "wm"], ["y"])]
    g = h.make_graph(nodes, "m", [h.make_tensor_value_info("x", T.FLOAT, [2, 3, 8, 8])],
                     [h.make_tensor_value_info("y", T.FLOAT, [2, 6])],
                     [nh.from_array(v, k) for k, v in inits.items()])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)]).SerializeToString()


class _Reader:
    """A seeded random calibration reader (onnxruntime's CalibrationDataReader protocol)."""

    def __init__(self, seed: int = 1, n: int = 6):
        r = np.random.default_rng(seed)
        self.data = iter([{"x": r.standard_normal((2, 3, 8, 8)).astype(np.float32)} for _ in range(n)])

    def get_next(self):
        return next(self.data, None)

    def __iter__(self):
        return self

    def __next__(self):
        item = self.get_next()
        if item is None:
            raise StopIteration
        return item


@pytest.mark.parametrize("fmt", ["QDQ", "QOperator"])
@pytest.mark.parametrize("act", ["QUInt8", "QInt8"])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.slow
def test_quantize_static_models(tmp_path, fmt, act, per_channel):
    """Every Conv / Gemm / MatMul of the quantized model runs as an integer contraction, and the output is
    within one step of the last QuantizeLinear's scale of the semantics: a QDQ file run by onnxruntime with
    its optimizations off; a QOperator file written as that QDQ form (``quant_reference.semantics_model``),
    itself checked against the QDQ file the quantizer writes from the same float model and calibration
    (the same scales and zero points).  The semantics' float Conv / Gemm / MatMul may round a value near a
    tie the other way than cuvil's exact integers: one step.  Then onnxruntime's fused kernels on the same
    file, second (on a CPU without VNNI they were off by more than a step here: a reported warning)."""
    q = pytest.importorskip("onnxruntime.quantization")
    src, dst = tmp_path / "f.onnx", tmp_path / "q.onnx"
    src.write_bytes(_float_model())

    def quantize(fmt: str, out) -> str:
        q.quantize_static(str(src), str(out), _Reader(), quant_format=getattr(q.QuantFormat, fmt),
                          activation_type=getattr(q.QuantType, act), weight_type=q.QuantType.QInt8,
                          per_channel=per_channel)
        return str(out)

    quantize(fmt, dst)
    x = np.random.default_rng(9).standard_normal((2, 3, 8, 8)).astype(np.float32)
    s = cuvil.onnx.InferenceSession(str(dst))
    got = s.run(None, {"x": x})[0]
    counts = integer_contractions(s)
    assert counts["float"] == [] and len(counts["integer"]) == 4, counts
    model = onnx.load(str(dst))
    last_q = next(n for n in model.graph.node if n.output[0] == "y")  # the DequantizeLinear of the output
    step = float(nh.to_array([t for t in model.graph.initializer if t.name == last_q.input[1]][0]))
    ref = qr.run_semantics(str(dst) if fmt == "QDQ" else qr.semantics_model(model), {"x": x})[0]
    if fmt == "QOperator":
        qdq = quantize("QDQ", tmp_path / "qdq.onnx")
        qr.same_quantization(str(dst), qdq)
        assert qr.steps_apart(ref, qr.run_semantics(qdq, {"x": x})[0], step) <= 1
    assert qr.steps_apart(got, ref, step) <= 1.0001, (qr.steps_apart(got, ref, step), step)
    fused = qr.run_fused(str(dst), {"x": x})
    qr.check_fused(f"{fmt} {act} per_channel={per_channel}", fused, [ref], within=1.0001, steps=step)


def test_qdq_relu_kept_and_float_output():
    """A Relu the quantizer kept between the contraction and its Q becomes Max(y, zy) on the integer
    output; a contraction whose output is not quantized keeps a float output from the integer product."""
    r = np.random.default_rng(8)
    x = r.integers(0, 256, (3, 16)).astype(np.uint8)
    inits = {"sx": np.float32(0.02), "zx": np.uint8(120), "w": r.integers(-127, 128, (16, 8)).astype(np.int8),
             "sw": r.uniform(0.005, 0.02, 8).astype(np.float32), "zw": np.zeros(8, np.int8),
             "sy": np.float32(0.05), "zy": np.uint8(100), "w2": r.integers(-127, 128, (8, 4)).astype(np.int8),
             "sw2": np.float32(0.01), "zw2": np.int8(0)}
    nodes = [h.make_node("DequantizeLinear", ["x", "sx", "zx"], ["xd"]),
             h.make_node("DequantizeLinear", ["w", "sw", "zw"], ["wd"], axis=1),
             h.make_node("MatMul", ["xd", "wd"], ["m"]),
             h.make_node("Relu", ["m"], ["mr"]),
             h.make_node("QuantizeLinear", ["mr", "sy", "zy"], ["q"]),
             h.make_node("DequantizeLinear", ["q", "sy", "zy"], ["qd"]),
             h.make_node("DequantizeLinear", ["w2", "sw2", "zw2"], ["w2d"]),
             h.make_node("MatMul", ["qd", "w2d"], ["y"])]
    model = _model(nodes, {"x": x}, [("q", "uint8"), ("y", "float32")], inits)
    s = cuvil.onnx.InferenceSession(model)
    counts = integer_contractions(s)
    assert counts["float"] == [] and len(counts["integer"]) == 2, counts
    assert "Max" in {n.op_type for n in s._graph.nodes}
    got = s.run(None, {"x": x})
    ref = qr.run_semantics(model, {"x": x})  # the float QDQ semantics
    # the semantics' float MatMul may round a value near a tie the other way than cuvil's exact integers
    assert qr.steps_apart(got[0], ref[0]) <= 1
    # the float product of dequantized values rounds each term; the integer one is exact until the last multiply
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5, atol=1e-5 * np.abs(ref[1]).max())


@pytest.mark.parametrize("qt", ["uint8", "int8"])
@pytest.mark.parametrize("kern,stride,pads,dil,ceil", [([3, 3], [2, 2], [1, 1, 1, 1], [1, 1], 0),
                                                      ([2, 3], [1, 2], [0, 1, 1, 0], [2, 1], 0),
                                                      ([3, 3], [2, 2], [0, 0, 0, 0], [1, 1], 1)])
def test_qdq_maxpool_on_8_bit_values(qt, kern, stride, pads, dil, ceil):
    """DQ -> MaxPool -> Q of one scale runs as CuvilMaxPool8 on the 8-bit values (padded with the type's
    least value), equal to the semantics (the float MaxPool between DQ and Q, which rounds nothing), windows
    over the padding and ceil_mode's partial ones included."""
    r = np.random.default_rng(5)
    lo, hi = np.iinfo(qt).min, np.iinfo(qt).max
    x = r.integers(lo, hi + 1, (2, 5, 9, 11)).astype(qt)
    inits = {"s": np.float32(0.03), "z": np.array(7, qt)}
    nodes = [h.make_node("DequantizeLinear", ["x", "s", "z"], ["d"]),
             h.make_node("MaxPool", ["d"], ["m"], kernel_shape=kern, strides=stride, pads=pads, dilations=dil,
                         ceil_mode=ceil),
             h.make_node("QuantizeLinear", ["m", "s", "z"], ["y"])]
    model = _model(nodes, {"x": x}, [("y", qt)], inits)
    assert [n.op_type for n in cuvil.onnx.InferenceSession(model)._graph.nodes] == ["CuvilMaxPool8"]
    got, ref = _semantics(model, {"x": x})
    _equal(got, ref)


def test_unmatched_qdq_stays_correct():
    """A DQ -> Softmax -> Q chain (no QLinear form) stays element-wise and agrees with the semantics to one
    step (cuvil's float exp and sum round differently from onnxruntime's: a value near a tie may flip)."""
    r = np.random.default_rng(2)
    x = r.integers(0, 256, (3, 10)).astype(np.uint8)
    nodes = [h.make_node("DequantizeLinear", ["x", "s", "z"], ["d"]),
             h.make_node("Softmax", ["d"], ["sm"]),
             h.make_node("QuantizeLinear", ["sm", "so", "zo"], ["y"])]
    inits = {"s": np.float32(0.05), "z": np.uint8(128), "so": np.float32(1 / 256), "zo": np.uint8(0)}
    got, ref = _semantics(_model(nodes, {"x": x}, [("y", "uint8")], inits), {"x": x})
    assert np.abs(got[0].astype(int) - ref[0].astype(int)).max() <= 1


def test_errors_name_the_node():
    x = np.zeros((2, 3), np.float32)
    bad_axis = _model([h.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], axis=1)], {"x": x}, [("q", "uint8")],
                      {"s": np.ones(2, np.float32), "z": np.zeros(2, np.uint8)})
    with pytest.raises(ShapeError, match="QuantizeLinear node .*per-axis scale has shape \\[3\\]"):
        cuvil.onnx.InferenceSession(bad_axis).run(None, {"x": x})
    fp8 = _model([h.make_node("QuantizeLinear", ["x", "s"], ["q"], output_dtype=T.FLOAT8E4M3FN)], {"x": x},
                 [("q", "uint8")], {"s": np.float32(1)})
    with pytest.raises((DTypeError, cuvil.errors.ModelError)):
        cuvil.onnx.InferenceSession(fp8).run(None, {"x": x})
