"""Fusion groups (cuvil.graph.fuse): which nodes become one kernel, and fused models still match onnxruntime."""

import math

import isa
import numpy as np
import pytest
import toolchain

onnx = toolchain.module("onnx")
ort = toolchain.module("onnxruntime")

from onnx import helper  # noqa: E402
from onnx_models import float_model  # noqa: E402

from cuvil.frontend.onnx import import_model  # noqa: E402
from cuvil.graph.compile import compile_graph  # noqa: E402
from cuvil.graph.fuse import fusion_groups, groups_str  # noqa: E402
from cuvil.graph.passes import PASSES, optimize  # noqa: E402

rng = np.random.default_rng(0)


_model = float_model  # tests/support/onnx_models.py


def _nchw(g):
    """The graph passes but the channels-last layout (these tests look at ONNX's own ops)."""
    for name, p in PASSES:
        if name != "channels last":
            g = p(g)
    return g


def _groups(model, layout=False):
    g = (optimize if layout else _nchw)(import_model(model))
    return g, [[g.nodes[k].op_type for k in grp.members] for grp in fusion_groups(g)]


def _check(model, feeds, rtol=1e-4, layout=False):
    """Fused and unfused compiles both match onnxruntime; returns (fused, unfused) programs."""
    g = (optimize if layout else _nchw)(import_model(model))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    progs = []
    for fuse in (True, False):
        prog = compile_graph(g, {k: v.shape for k, v in feeds.items()}, {}, "llvm", fuse=fuse)
        got = prog.run(feeds)
        for name, w in want.items():
            np.testing.assert_allclose(got[name], w, rtol=rtol, atol=rtol * 0.1 * max(1.0, np.abs(w).max()),
                                       err_msg=f"{name} (fuse={fuse})")
        progs.append(prog)
    return progs


def _conv_residual(c=16, size=12):
    inits = {"W1": rng.standard_normal((c, c, 3, 3)) / math.sqrt(9 * c), "B1": rng.standard_normal(c) * 0.1,
             "W2": rng.standard_normal((c, c, 3, 3)) / math.sqrt(9 * c), "B2": rng.standard_normal(c) * 0.1}
    nodes = [
        helper.make_node("Conv", ["x", "W1", "B1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "W2", "B2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "x"], ["a"]),
        helper.make_node("Relu", ["a"], ["y"]),
    ]
    return _model(nodes, [("x", [1, c, size, size])], ["y"], inits), {
        "x": rng.standard_normal((1, c, size, size)).astype(np.float32)}


def test_conv_bias_relu_add_residual_is_one_kernel_per_conv():
    model, feeds = _conv_residual()
    g, groups = _groups(model)
    assert groups == [["Conv", "Relu"], ["Conv", "Add", "Relu"]]
    assert "y = Conv+Add+Relu" in groups_str(g, fusion_groups(g))
    fused, unfused = _check(model, feeds)
    assert (fused.n_calls, unfused.n_calls) == (2, 5)
    assert fused.labels == ["Conv+Relu 'Conv_0'", "Conv+Add+Relu 'Conv_2'"]


def _gelu_ffn(seq=24, d=32, h=64):
    """MatMul + bias, erf GELU as PyTorch exports it (x read twice), MatMul + bias + residual."""
    inits = {"W1": rng.standard_normal((d, h)) / math.sqrt(d), "b1": rng.standard_normal(h) * 0.1,
             "W2": rng.standard_normal((h, d)) / math.sqrt(h), "b2": rng.standard_normal(d) * 0.1,
             "sqrt2": np.array(math.sqrt(2.0)), "one": np.array(1.0), "half": np.array(0.5)}
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["m1"]),
        helper.make_node("Add", ["m1", "b1"], ["h"]),
        helper.make_node("Div", ["h", "sqrt2"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["e1"]),
        helper.make_node("Mul", ["h", "e1"], ["p"]),
        helper.make_node("Mul", ["p", "half"], ["gelu"]),
        helper.make_node("MatMul", ["gelu", "W2"], ["m2"]),
        helper.make_node("Add", ["m2", "b2"], ["o"]),
        helper.make_node("Add", ["o", "x"], ["y"]),
    ]
    return _model(nodes, [("x", [1, seq, d])], ["y"], inits), {
        "x": rng.standard_normal((1, seq, d)).astype(np.float32)}


@pytest.mark.slow
def test_matmul_add_gelu_subgraph_reads_its_input_twice_and_fuses_whole():
    model, feeds = _gelu_ffn()
    _, groups = _groups(model)
    assert groups == [["MatMul", "Add", "Div", "Erf", "Add", "Mul", "Mul"], ["MatMul", "Add", "Add"]]
    fused, unfused = _check(model, feeds)
    assert (fused.n_calls, unfused.n_calls) == (2, 10)


@pytest.mark.slow
def test_clip6_after_depthwise_and_pointwise_convs():
    c, size = 24, 14
    inits = {"We": rng.standard_normal((c, 8, 1, 1)) * 0.5, "Be": rng.standard_normal(c) * 0.1,
             "Wd": rng.standard_normal((c, 1, 3, 3)), "Bd": rng.standard_normal(c) * 0.1,
             "lo": np.array(0.0), "hi": np.array(6.0)}
    nodes = [
        helper.make_node("Conv", ["x", "We", "Be"], ["e"]),  # 1x1: a matmul over pixels (kernel shape (c, p))
        helper.make_node("Clip", ["e", "lo", "hi"], ["e6"]),
        helper.make_node("Conv", ["e6", "Wd", "Bd"], ["dw"], group=c, pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Clip", ["dw", "lo", "hi"], ["y"]),
    ]
    model = _model(nodes, [("x", [1, 8, size, size])], ["y"], inits)
    feeds = {"x": (rng.standard_normal((1, 8, size, size)) * 3).astype(np.float32)}
    _, groups = _groups(model)
    assert groups == [["Conv", "Clip"], ["Conv", "Clip"]]
    fused, unfused = _check(model, feeds)
    assert (fused.n_calls, unfused.n_calls) == (2, 4)
    # channels-last (the model has a depthwise conv): the same groups over NHWC kernels; y, a graph
    # output, is computed NCHW after a Transpose back
    _, groups = _groups(model, layout=True)
    assert groups == [["CuvilConvNHWC", "Clip"], ["CuvilConvNHWC"], ["Transpose", "Clip"]]
    fused, unfused = _check(model, feeds, layout=True)
    assert (fused.n_calls, unfused.n_calls) == (3, 5)


def test_shared_or_returned_intermediates_are_not_fused_into_one_reader():
    inits = {"W": rng.standard_normal((8, 8)), "b": rng.standard_normal(8)}
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("Relu", ["m"], ["r"]),  # m is read twice: Relu and Sigmoid
        helper.make_node("Sigmoid", ["m"], ["s"]),
        helper.make_node("Add", ["r", "b"], ["a"]),  # a is a graph output and read by Mul
        helper.make_node("Mul", ["a", "s"], ["y"]),
    ]
    model = _model(nodes, [("x", [4, 8])], ["y", "a"], inits)
    _, groups = _groups(model)
    # m has two readers that no group with one exit covers; a is returned, so its group ends with it
    assert groups == [["MatMul"], ["Relu", "Add"], ["Sigmoid", "Mul"]]
    _check(model, {"x": rng.standard_normal((4, 8)).astype(np.float32)})


@pytest.mark.slow
def test_operand_order_and_broadcasts_key_distinct_kernels():
    """Sub(conv, r) and Sub(r, conv) have the same nodes and shapes: their fused kernels differ."""
    c, size = 16, 6
    inits = {"W": rng.standard_normal((c, c, 3, 3)) * 0.2, "row": rng.standard_normal((1, 1, 1, size))}
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Sub", ["c1", "x"], ["s1"]),
        helper.make_node("Conv", ["s1", "W"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Sub", ["s1", "c2"], ["s2"]),
        helper.make_node("Mul", ["s2", "row"], ["y"]),  # broadcast along the last axis only
    ]
    model = _model(nodes, [("x", [1, c, size, size])], ["y"], inits)
    fused, unfused = _check(model, {"x": rng.standard_normal((1, c, size, size)).astype(np.float32)})
    assert fused.n_calls == 2 and fused.n_kernels == 2


def test_element_wise_chain_on_a_graph_input_and_a_broadcasting_member():
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["s"]),
        helper.make_node("Mul", ["s", "x"], ["silu"]),
        helper.make_node("Add", ["silu", "z"], ["y"]),  # (3, 5) + (2, 3, 5): the output is larger
        helper.make_node("Tanh", ["y"], ["t"]),
    ]
    model = _model(nodes, [("x", [3, 5]), ("z", [2, 3, 5])], ["t"], {})
    _, groups = _groups(model)
    assert groups == [["Sigmoid", "Mul", "Add", "Tanh"]]
    fused, unfused = _check(model, {"x": rng.standard_normal((3, 5)).astype(np.float32),
                                    "z": rng.standard_normal((2, 3, 5)).astype(np.float32)})
    assert (fused.n_calls, unfused.n_calls) == (1, 4)


@pytest.mark.slow
def test_profile_times_every_call():
    model, feeds = _conv_residual(8, 8)
    g = _nchw(import_model(model))
    prog = compile_graph(g, {"x": (1, 8, 8, 8)}, {}, "llvm")
    prof = prog.profile(feeds, repeat=3)
    assert [c.label.split(" ")[0] for c in prof.calls] == ["Conv+Relu", "Conv+Add+Relu"]
    assert all(c.seconds > 0 for c in prof.calls) and prof.run_seconds > 0
    assert "1x8x8x8" in prof.calls[0].shapes
    text = prof.table()
    assert "Conv+Add+Relu" in text and "whole run" in text
    # each call's work: 2 x 8 filters x 8 channels x 9 taps x 64 pixels, float32; against the measured peak
    assert [(c.flops, c.kind) for c in prof.calls] == [(2 * 8 * 8 * 9 * 64, "fp32")] * 2
    assert prof.peak > 1e9 and "float32 contractions: " in text and "of the measured peak" in text
    assert prof.contractions() == (sum(c.flops for c in prof.calls), sum(c.seconds for c in prof.calls))
    np.testing.assert_allclose(prog.run(feeds)["y"], compile_graph(g, {"x": (1, 8, 8, 8)}, {}, "llvm",
                                                                      fuse=False).run(feeds)["y"], rtol=1e-5)


def test_a_fused_kernel_that_does_not_compile_falls_back_to_one_kernel_per_node(monkeypatch, caplog, fresh_kernels):
    import cuvil.graph.compile as fo
    from cuvil.errors import CuvilError

    model, feeds = _conv_residual(8, 6)
    real = fo.lower_kernel

    def refuse_fused(what, *args):
        if "+" in what.split(" ")[0]:
            raise CuvilError("the fused kernel fails (simulated)")
        return real(what, *args)

    monkeypatch.setattr(fo, "lower_kernel", refuse_fused)
    g = _nchw(import_model(model))
    with caplog.at_level("WARNING", logger="cuvil.schedule"):
        prog = compile_graph(g, {"x": (1, 8, 6, 6)}, {}, "llvm")
    assert prog.n_calls == 5
    lines = [r.getMessage() for r in caplog.records if r.name == "cuvil.schedule"]
    assert len(lines) == 2 and all("compiled one by one" in x and "simulated" in x for x in lines)
    assert [f.split(":")[0] for f in prog.fallbacks] == ["Conv+Relu 'Conv_0'", "Conv+Add+Relu 'Conv_2'"]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(prog.run(feeds)["y"], want, rtol=1e-4, atol=1e-5)


def test_an_nchw_conv_tile_keeps_its_accumulators_at_constant_indices():
    """A 3x3 NCHW convolution tiled over filters (rows) and pixels (columns) under a loop over output
    rows: with the row tiles fused into that loop, isl wrote the tile's local indices as nested divisions
    of the fused index, which LLVM cannot keep in registers (every multiply-add loaded and stored its
    accumulator on the stack: 2.8x slower for 128 -> 128 channels at 64x64)."""
    import re

    from onnx import TensorProto, helper, numpy_helper

    w = (rng.standard_normal((16, 32, 3, 3)) * 0.2).astype(np.float32)
    g = helper.make_graph([helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
                           helper.make_node("Relu", ["c"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 8, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(w, "W")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    prog = compile_graph(import_model(model), {"x": (1, 32, 8, 64)}, {}, "llvm")
    [func] = [f for f in prog.kernel_funcs if "conv" in str(f)]
    text = str(func)
    # each of the tile's filter rows (8 with AVX-512, fewer where the register file or lanes are smaller)
    # is initialised at a constant index
    rows = sorted({int(k) for k in re.findall(r"conv\[0, 0, (\d+), sp1\] = 0\.0f", text)})
    assert len(rows) >= 2 and rows == list(range(len(rows))), text[:2000]
    assert not isa.IS_512 or len(rows) == 8, rows
    x = rng.standard_normal((1, 32, 8, 64)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(prog.run({"x": x})["y"], want, rtol=1e-4, atol=1e-4)
