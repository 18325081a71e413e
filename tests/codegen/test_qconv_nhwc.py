"""Channels-last quantized convolutions (cuvil/graph/ops/quant/conv_nhwc.py), the int8 part of the
channels-last pass (cuvil.graph.channels_last.channels_last), and the requantization epilogue.

The kernel is checked bit-exact against numpy's integer convolution (every u8/s8 mix, the byte limits,
strides, dilations, padding with a pad value, groups and depthwise, an NCHW or NHWC input) on this host
(``vpdpbusd`` where it has VNNI) and on a target without a dot-product instruction (the plain int32
contraction).  Quantized models (onnxruntime's ``quantize_static``, QDQ and QOperator, u8 and s8) must give
the same bytes channels-last as channels-first, and lie within one step of their semantics: the QDQ form run
by onnxruntime with its optimizations off, or numpy's exact integer convolution requantized
(tests/support/quant_reference.py), never onnxruntime's fused kernels alone; those are a second, labelled check
(exact only on a CPU with VNNI: elsewhere their ``vpmaddubsw`` saturates, which is reported, not failed).
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh
from quant_reference import check_fused, qlinear_conv, run_fused, run_semantics, semantics_model, steps_apart
from reference import budget
from test_int8_kernels import HOST, INT8, NO_VNNI, _conv_ref, _run, conv_case, needs_avx512

import cuvil
import cuvil.graph.passes as passes
import cuvil.onnx
from cuvil import te
from cuvil.errors import ShapeError
from cuvil.graph.fuse import fusion_groups
from cuvil.graph.ops.quant.conv_nhwc import int_conv_nhwc
from cuvil.graph.qdq import integer_contractions

pytest.importorskip("onnxruntime")


@st.composite
def convs2d(draw):
    kind = draw(st.sampled_from(["dense", "dense", "grouped", "depthwise"]))
    if kind == "depthwise":
        c = draw(st.sampled_from([1, 5, 16, 33]))
        group, cg, per = c, 1, 1
    else:
        group = 1 if kind == "dense" else draw(st.sampled_from([2, 3]))
        cg = draw(st.sampled_from([1, 3, 4, 5, 8, 12]))
        per = draw(st.sampled_from([1, 7, 16, 33, 40]))
    return conv_case(draw, group, cg, per, 2)


def _nhwc_run(case, in_nhwc: bool, target=HOST) -> tuple[np.ndarray, np.ndarray]:
    x, w, strides, dil, pb, pe, group, pv = case
    xin = np.ascontiguousarray(x.transpose(0, 2, 3, 1)) if in_nhwc else x
    got = _run(lambda ctx, t: int_conv_nhwc(ctx, t, w, strides, dil, pb, pe, group, pad_value=pv,
                                            in_nhwc=in_nhwc), [xin], target)
    return got, _conv_ref(x, w, strides, dil, pb, pe, group, pv).transpose(0, 2, 3, 1)


@budget(0.75)
@given(convs2d(), st.booleans())
@pytest.mark.slow
def test_int_conv_nhwc_exact(case, in_nhwc):
    got, ref = _nhwc_run(case, in_nhwc)
    np.testing.assert_array_equal(got, ref)


@needs_avx512
@budget(0.4)
@given(convs2d(), st.booleans())
@pytest.mark.slow
def test_int_conv_nhwc_plain_path_exact(case, in_nhwc):
    """A target without a dot-product instruction: the plain int32 contraction, channels in lanes."""
    got, ref = _nhwc_run(case, in_nhwc, NO_VNNI)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("xd, wd", [(x, y) for x in INT8 for y in INT8])
@pytest.mark.parametrize("kernel, stride, pad", [(3, 1, 1), (1, 2, 0), (1, 1, 0), (7, 2, 3)])
@pytest.mark.slow
def test_int_conv_nhwc_resnet_like_layers(xd, wd, kernel, stride, pad):
    """ResNet's layers (3x3, strided 1x1, 1x1, the 7x7 / 2 stem reading 3 NCHW channels) at the byte
    limits, with the padding at the type's maximum."""
    rng = np.random.default_rng(4)
    c = 3 if kernel == 7 else 64
    x = rng.choice(np.array([np.iinfo(xd).min, np.iinfo(xd).max, 0], xd), (1, c, 12, 12))
    w = rng.choice(np.array([np.iinfo(wd).min, np.iinfo(wd).max, 1], wd), (64, c, kernel, kernel))
    case = (x, w, [stride] * 2, [1, 1], [pad] * 2, [pad] * 2, 1, int(np.iinfo(xd).max))
    got, ref = _nhwc_run(case, in_nhwc=kernel != 7)
    np.testing.assert_array_equal(got, ref)


def test_int_conv_nhwc_bad_input_is_a_shape_error():
    x = np.zeros((1, 4, 4, 8), np.uint8)
    w = np.zeros((16, 3, 3, 3), np.int8)  # 3 input channels per group, the input has 8
    with pytest.raises(ShapeError, match="input channels do not fit"):
        _run(lambda ctx, t: int_conv_nhwc(ctx, t, w, [1, 1], [1, 1], [1, 1], [1, 1], 1), [x])


# -- whole models ----------------------------------------------------------------------------------------


def _cnn() -> bytes:
    """A small ResNet-like float model: stem conv, max pool, a residual block, global average pool, Gemm."""
    r = np.random.default_rng(2)
    inits = {"w1": r.standard_normal((16, 3, 3, 3)) * 0.3, "b1": r.standard_normal(16) * 0.1,
             "w2": r.standard_normal((16, 16, 3, 3)) * 0.15, "b2": r.standard_normal(16) * 0.1,
             "w3": r.standard_normal((32, 16, 1, 1)) * 0.3, "wd": r.standard_normal((32, 16, 1, 1)) * 0.3,
             "wg": r.standard_normal((10, 32)) * 0.3, "bg": r.standard_normal(10) * 0.1}
    inits = {k: v.astype(np.float32) for k, v in inits.items()}
    nodes = [h.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]),
             h.make_node("Relu", ["c1"], ["r1"]),
             h.make_node("MaxPool", ["r1"], ["mp"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
             h.make_node("Conv", ["mp", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
             h.make_node("Relu", ["c2"], ["r2"]),
             h.make_node("Conv", ["r2", "w3"], ["c3"]),
             h.make_node("Conv", ["mp", "wd"], ["down"]),
             h.make_node("Add", ["c3", "down"], ["a"]),
             h.make_node("Relu", ["a"], ["ra"]),
             h.make_node("GlobalAveragePool", ["ra"], ["gap"]),
             h.make_node("Flatten", ["gap"], ["f"]),
             h.make_node("Gemm", ["f", "wg", "bg"], ["y"], transB=1)]
    g = h.make_graph(nodes, "cnn", [h.make_tensor_value_info("x", T.FLOAT, [2, 3, 20, 20])],
                     [h.make_tensor_value_info("y", T.FLOAT, [2, 10])],
                     [nh.from_array(v, k) for k, v in inits.items()])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)]).SerializeToString()


class _Reader:
    def __init__(self) -> None:
        r = np.random.default_rng(1)
        self.data = iter([{"x": r.standard_normal((2, 3, 20, 20)).astype(np.float32)} for _ in range(4)])

    def get_next(self):
        return next(self.data, None)


@pytest.mark.parametrize("fmt, act", [("QDQ", "QUInt8"), ("QDQ", "QInt8"), ("QOperator", "QUInt8"),
                                      ("QOperator", "QInt8")])
@pytest.mark.slow
def test_quantized_cnn_is_channels_last_and_byte_identical(tmp_path, monkeypatch, fmt, act):
    """Every quantized convolution runs channels-last, the residual add and the pools stay in that
    layout (no transpose between convolutions), and the output is the same bytes as channels-first and
    within one step of the semantics (the QDQ form run by onnxruntime with its optimizations off: its float
    Conv may round a value near a tie the other way than cuvil's exact integers); then onnxruntime's fused
    kernels on the same file, second."""
    q = pytest.importorskip("onnxruntime.quantization")
    src, dst = tmp_path / "f.onnx", tmp_path / "q.onnx"
    src.write_bytes(_cnn())
    q.quantize_static(str(src), str(dst), _Reader(), quant_format=getattr(q.QuantFormat, fmt),
                      activation_type=getattr(q.QuantType, act), weight_type=q.QuantType.QInt8)
    x = np.random.default_rng(9).standard_normal((2, 3, 20, 20)).astype(np.float32)
    s = cuvil.onnx.InferenceSession(str(dst))
    got = s.run(None, {"x": x})[0]
    ops = [n.op_type for n in s._graph.nodes]
    assert ops.count("CuvilQLinearConvNHWC") == 4, ops
    assert "Transpose" not in ops, ops
    counts = integer_contractions(s)
    assert counts["float"] == [] and len(counts["integer"]) == 5, counts
    groups = [[s._graph.nodes[k].op_type for k in grp.members] for grp in fusion_groups(s._graph)]
    assert ["CuvilQLinearConvNHWC", "QLinearAdd"] in groups, groups  # the residual add in a conv's epilogue
    monkeypatch.setattr(passes, "PASSES", tuple(p for p in passes.PASSES if p[0] != "channels last"))
    first = cuvil.onnx.InferenceSession(str(dst))
    assert "CuvilQLinearConvNHWC" not in {n.op_type for n in first._graph.nodes}
    np.testing.assert_array_equal(got, first.run(None, {"x": x})[0])
    model = onnx.load(str(dst))
    ref = run_semantics(str(dst) if fmt == "QDQ" else semantics_model(model), {"x": x})[0]
    last = next(n for n in model.graph.node if n.output[0] == "y")  # the DequantizeLinear of the output
    step = float(nh.to_array(next(t for t in model.graph.initializer if t.name == last.input[1])))
    assert steps_apart(got, ref, step) <= 1.0001, (steps_apart(got, ref, step), step)
    check_fused(f"channels-last {fmt} {act} CNN", run_fused(str(dst), {"x": x}), [ref], within=1.0001, steps=step)


@pytest.mark.slow
def test_float_model_without_depthwise_stays_nchw():
    """The int8 part of the pass leaves float models alone: a plain float CNN keeps ONNX's Conv."""
    s = cuvil.onnx.InferenceSession(_cnn())
    ops = {n.op_type for n in s._graph.nodes}
    assert "Conv" in ops and "CuvilConvNHWC" not in ops and "CuvilQLinearConvNHWC" not in ops


# -- the requantization epilogue --------------------------------------------------------------------------


@pytest.mark.parametrize("qtype, zy", [("uint8", 0), ("uint8", 131), ("int8", 0), ("int8", -7)])
@pytest.mark.parametrize("mult", [0.25, 0.4999, 0.003])
def test_requantize_rounds_half_to_even_and_saturates(qtype, zy, mult):
    """``requantize(small=True)`` (rounded straight to int32, saturated in integers: ``vcvtps2dq`` and a
    saturating narrowing on x86) gives numpy's float32 values: ties to even, the int32 extremes saturate."""
    from cuvil.graph.ops.quant.matmul import requantize

    ties = np.arange(-40, 40, dtype=np.int64) * 2  # with mult 0.25: -20, -19.5, ... every other one a tie
    extremes = np.array([-2**31, -2**31 + 1, 2**31 - 1, 2**30, -2**30, 1000, -1000, 511, 512, 513], np.int64)
    acc = np.concatenate([ties, extremes, np.random.default_rng(3).integers(-2**31, 2**31, 200)]).astype(np.int32)
    a = te.placeholder(acc.shape, dtype="int32", name="a")
    outs = {}

    def epilogue(small: bool):
        return te.compute(acc.shape, lambda i: requantize(a[i], te.const(mult, "float32"), zy, qtype, small), name="y")

    for small in (False, True):
        y = epilogue(small)
        mod = cuvil.build(cuvil.auto_schedule([a, y], HOST), [a, y], target=HOST)
        out = np.zeros(acc.shape, qtype)
        mod(acc, out)
        outs[small] = out
        if small and "avx512f" in HOST.enabled_features:
            asm = mod.get_source("asm")
            assert "vcvtps2dq" in asm and "vrndscaleps" not in asm
    info = np.iinfo(qtype)
    ref = np.clip(np.rint(acc.astype(np.float32) * np.float32(mult)).astype(np.float64) + zy, info.min, info.max)
    np.testing.assert_array_equal(outs[False], ref.astype(qtype))
    np.testing.assert_array_equal(outs[True], ref.astype(qtype))


def test_quantized_fusion_groups():
    """A residual QLinearAdd joins the quantized convolution before it; SiLU's table lookup and
    QLinearMul group with each other but not into the convolution (a depthwise one's taps would be
    computed once per read) and nothing quantized joins a matrix product."""
    from cuvil.graph.ir import Graph, Node, ValueInfo

    def graph(nodes: list[Node], out: str) -> Graph:
        return Graph("g", [ValueInfo("x", "uint8", (1, 4, 4, 8))], [ValueInfo(out, "uint8", (1, 4, 4, 8))], {},
                     nodes, 17)

    conv = Node("CuvilQLinearConvNHWC", "c", ("x",), ("y",))
    silu = [conv, Node("CuvilQLinearLookup", "l", ("y", "t"), ("s",)), Node("QLinearMul", "m", ("y", "s"), ("z",))]
    assert [[n.op_type for n in (silu[k] for k in grp.members)] for grp in fusion_groups(graph(silu, "z"))] == [
        ["CuvilQLinearConvNHWC"], ["CuvilQLinearLookup", "QLinearMul"]]
    res = [conv, Node("QLinearAdd", "a", ("y", "x"), ("z",))]
    assert [len(grp.members) for grp in fusion_groups(graph(res, "z"))] == [2]
    mm = [Node("CuvilQLinearMatMul", "mm", ("x",), ("y",)), Node("QLinearAdd", "a", ("y", "x"), ("z",))]
    assert [len(grp.members) for grp in fusion_groups(graph(mm, "z"))] == [1, 1]


@pytest.mark.parametrize("qx, group", [("uint8", 1), ("int8", 1), ("uint8", 4)])
@pytest.mark.slow
def test_weight_zero_point_and_groups_channels_last(monkeypatch, qx, group):
    """Two chained QLinearConvs (the first's output internal, so it goes channels-last) with uint8
    weights whose zero point is not 0 (the window sums of x, channels-last too) and with groups: the
    same bytes as channels-first and as numpy's exact integer convolutions requantized; then, for
    uint8 x uint8, onnxruntime's fused kernels, second."""
    r = np.random.default_rng(5)
    lo = {"uint8": 0, "int8": -128}[qx]
    c = 8
    x = r.integers(lo, lo + 256, (2, c, 7, 7)).astype(qx)
    inits = {"sx": np.float32(0.02), "zx": np.array(lo + 37, qx), "sy": np.float32(0.3), "zy": np.array(lo + 90, qx),
             "w1": r.integers(0, 256, (c, c // group, 3, 3)).astype(np.uint8), "sw": np.float32(0.004),
             "zw": np.array(119, np.uint8), "w2": r.integers(0, 256, (6, c, 1, 1)).astype(np.uint8),
             "B": r.integers(-3000, 3000, c).astype(np.int32)}
    nodes = [h.make_node("QLinearConv", ["x", "sx", "zx", "w1", "sw", "zw", "sy", "zy", "B"], ["y1"],
                         pads=[1, 1, 1, 1], group=group),
             h.make_node("QLinearConv", ["y1", "sy", "zy", "w2", "sw", "zw", "sx", "zx"], ["y2"], strides=[2, 2])]
    g = h.make_graph(nodes, "q", [h.make_tensor_value_info("x", getattr(T, qx.upper()), list(x.shape))],
                     [h.make_tensor_value_info("y2", getattr(T, qx.upper()), None)],
                     [nh.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)]).SerializeToString()
    s = cuvil.onnx.InferenceSession(model)
    assert [n.op_type for n in s._graph.nodes].count("CuvilQLinearConvNHWC") == 1
    got = s.run(None, {"x": x})[0]
    monkeypatch.setattr(passes, "PASSES", tuple(p for p in passes.PASSES if p[0] != "channels last"))
    np.testing.assert_array_equal(got, cuvil.onnx.InferenceSession(model).run(None, {"x": x})[0])
    i = inits
    y1 = qlinear_conv(x, i["sx"], i["zx"], i["w1"], i["sw"], i["zw"], i["sy"], i["zy"], i["B"], pads=[1, 1, 1, 1],
                      group=group)
    ref = qlinear_conv(y1, i["sy"], i["zy"], i["w2"], i["sw"], i["zw"], i["sx"], i["zx"], strides=[2, 2])
    np.testing.assert_array_equal(got, ref)
    if qx == "uint8":  # (onnxruntime has no QLinearConv of int8 x uint8)
        check_fused("two QLinearConvs, u8 x u8", run_fused(model, {"x": x}), [ref])


@pytest.mark.parametrize("xd, wd, instr", [(np.uint8, np.int8, "sdot"), (np.uint8, np.uint8, "udot")])
@pytest.mark.slow
def test_aarch64_channels_last_conv_under_qemu(tmp_path, xd, wd, instr):
    """The channels-last convolution on AArch64 (+dotprod): ``sdot`` / ``udot`` from the same loop IR,
    exact under qemu (a 3x3 window over a padded, strided NHWC input)."""
    from test_aarch64 import _run_under_qemu
    from test_int8_kernels import A76_DOT, _ctx

    rng = np.random.default_rng(8)
    x = rng.integers(np.iinfo(xd).min, np.iinfo(xd).max + 1, (1, 7, 9, 12)).astype(xd)  # NHWC
    w = rng.integers(np.iinfo(wd).min, np.iinfo(wd).max + 1, (20, 12, 3, 3)).astype(wd)
    tgt = cuvil.Target(A76_DOT)
    ctx = _ctx(tgt)
    X = te.placeholder(x.shape, dtype=x.dtype.name, name="X")
    y = int_conv_nhwc(ctx, X, w, [2, 1], [1, 1], [1, 1], [1, 1], 1, pad_value=int(np.iinfo(xd).max))
    args = [X] + [p for _, p in ctx.placeholders] + [y]
    mod = cuvil.build(cuvil.auto_schedule(args, tgt), args, target=tgt, name="kernel")
    assert re.search(rf"\b{instr}\s+v\d+\.4s", mod.get_source("asm")), f"no {instr} in the AArch64 kernel"
    out = np.zeros([int(d.value) for d in y.shape], np.int32)
    arrays = [x] + [ctx.entries[i] for i, _ in ctx.placeholders] + [out]
    (got,) = _run_under_qemu(tmp_path, mod, arrays, {len(arrays) - 1})
    ref = _conv_ref(x.transpose(0, 3, 1, 2), w, [2, 1], [1, 1], [1, 1], [1, 1], 1, int(np.iinfo(xd).max))
    np.testing.assert_array_equal(got, ref.transpose(0, 2, 3, 1))


@pytest.mark.slow
def test_exported_library_of_a_quantized_cnn(tmp_path):
    """``export_library`` of a quantized model (channels-last int8 convolutions, vpdpbusd where the target
    has it): the .so, loaded by cuvil.runtime.load, gives the session's bytes."""
    from cuvil.runtime import load

    q = pytest.importorskip("onnxruntime.quantization")
    src, dst = tmp_path / "f.onnx", tmp_path / "q.onnx"
    src.write_bytes(_cnn())
    q.quantize_static(str(src), str(dst), _Reader(), quant_format=q.QuantFormat.QDQ,
                      activation_type=q.QuantType.QUInt8, weight_type=q.QuantType.QInt8)
    x = np.random.default_rng(4).standard_normal((2, 3, 20, 20)).astype(np.float32)
    s = cuvil.onnx.InferenceSession(str(dst))
    lib = s.export_library(tmp_path / "qcnn.so")
    (got,) = load(lib).run(None, {"x": x})
    np.testing.assert_array_equal(got, s.run(None, {"x": x})[0])
