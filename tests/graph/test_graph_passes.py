"""Graph passes keep a model's results (checked with onnxruntime) while removing nodes."""

import numpy as np
import pytest
import toolchain

onnx = toolchain.module("onnx")
ort = toolchain.module("onnxruntime")

from onnx import helper  # noqa: E402
from onnx_models import float_model  # noqa: E402

from cuvil.frontend.onnx import import_model  # noqa: E402
from cuvil.graph.compile import compile_graph  # noqa: E402
from cuvil.graph.passes import graph_str, optimize  # noqa: E402

rng = np.random.default_rng(0)


_model = float_model  # tests/support/onnx_models.py


def _bn(prefix, c):
    return {f"{prefix}.s": rng.uniform(0.5, 1.5, c), f"{prefix}.b": rng.standard_normal(c),
            f"{prefix}.m": rng.standard_normal(c), f"{prefix}.v": rng.uniform(0.5, 2.0, c)}


def _check(model, feeds, expect_ops):
    dumps = []
    g = optimize(import_model(model), dump=lambda name, gr: dumps.append((name, graph_str(gr))))
    assert sorted(n.op_type for n in g.nodes) == sorted(expect_ops), graph_str(g)
    assert [d[0] for d in dumps if d[0] not in ("expand recurrent nodes", "embedding-bag loops")] == [
        "constants as initializers", "remove identities", "quantized operators", "element-wise before reshapes", "fold batch normalization", "common subexpressions",
                                     "dead nodes", "channels last", "flatten trailing reductions"]
    prog = compile_graph(g, {k: v.shape for k, v in feeds.items()}, {}, "llvm")
    got = prog.run(feeds)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for name, want in zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)):
        np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_conv_batchnorm_identity_duplicates_and_dead_nodes():
    inits = {"W": rng.standard_normal((8, 3, 3, 3)) * 0.3, "B": rng.standard_normal(8), **_bn("bn", 8)}
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "bn.s", "bn.b", "bn.m", "bn.v"], ["n"], epsilon=1e-3),
        helper.make_node("Relu", ["n"], ["r1"]),
        helper.make_node("Relu", ["n"], ["r2"]),  # the same as r1
        helper.make_node("Identity", ["r2"], ["i"]),
        helper.make_node("Add", ["r1", "i"], ["y"]),
        helper.make_node("Sigmoid", ["x"], ["unused"]),  # feeds no output
        helper.make_node("Dropout", ["y"], ["z"]),
    ]
    model = _model(nodes, [("x", [1, 3, 10, 10])], ["z"], inits)
    _check(model, {"x": rng.standard_normal((1, 3, 10, 10)).astype(np.float32)}, ["Conv", "Relu", "Add"])


def test_gemm_batchnorm_and_a_shared_conv_output_is_not_folded():
    inits = {"W": rng.standard_normal((16, 12)), "C": rng.standard_normal(16), **_bn("bn", 16),
             "K": rng.standard_normal((4, 2, 1, 1)), **_bn("bn2", 4)}
    nodes = [
        helper.make_node("Gemm", ["x", "W", "C"], ["g"], transB=1),
        helper.make_node("BatchNormalization", ["g", "bn.s", "bn.b", "bn.m", "bn.v"], ["y"]),
        helper.make_node("Conv", ["u", "K"], ["c"]),
        helper.make_node("BatchNormalization", ["c", "bn2.s", "bn2.b", "bn2.m", "bn2.v"], ["cb"]),
        helper.make_node("Add", ["c", "cb"], ["v"]),  # c is read twice: its BN stays
    ]
    model = _model(nodes, [("x", [5, 12]), ("u", [1, 2, 3, 3])], ["y", "v"], inits)
    feeds = {"x": rng.standard_normal((5, 12)).astype(np.float32), "u": rng.standard_normal((1, 2, 3, 3)).astype(np.float32)}
    _check(model, feeds, ["Gemm", "Conv", "BatchNormalization", "Add"])


def test_identity_chain_into_a_graph_output():
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Identity", ["a"], ["b"]),
             helper.make_node("Identity", ["b"], ["y"])]
    model = _model(nodes, [("x", [4, 4])], ["y"], {})
    _check(model, {"x": rng.standard_normal((4, 4)).astype(np.float32)}, ["Relu", "Identity"])


@pytest.mark.slow
def test_models_with_depthwise_convs_compute_channels_last():
    c = 24
    inits = {"Ws": rng.standard_normal((c, 3, 3, 3)) * 0.3, "Bs": rng.standard_normal(c),
             "Wd": rng.standard_normal((c, 1, 3, 3)), "Bd": rng.standard_normal(c),
             "Wp": rng.standard_normal((16, c, 1, 1)) * 0.3,  # fewer filters than a vector panel
             "We": rng.standard_normal((40, 16, 1, 1)) * 0.3, "Be": rng.standard_normal(40),
             "W5": rng.standard_normal((40, 1, 5, 5)) * 0.3,
             "Wq": rng.standard_normal((16, 40, 1, 1)) * 0.3, "lo": np.array(0.0), "hi": np.array(6.0)}
    nodes = [
        helper.make_node("Conv", ["x", "Ws", "Bs"], ["s"], pads=[1, 1, 1, 1], strides=[2, 2]),  # reads NCHW
        helper.make_node("Clip", ["s", "lo", "hi"], ["s6"]),
        helper.make_node("Conv", ["s6", "Wd", "Bd"], ["d"], group=c, pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["d"], ["dr"]),
        helper.make_node("Conv", ["dr", "Wp"], ["p"]),
        helper.make_node("Conv", ["p", "We", "Be"], ["e"]),
        helper.make_node("Conv", ["e", "W5"], ["e5"], group=40, pads=[2, 1, 2, 3]),  # 5x5, asymmetric pads
        helper.make_node("Conv", ["e5", "Wq"], ["q"]),
        helper.make_node("Add", ["q", "p"], ["r"]),
        helper.make_node("MaxPool", ["r"], ["m"], kernel_shape=[2, 2], strides=[2, 2]),  # reads NCHW again
        helper.make_node("GlobalAveragePool", ["r"], ["gap"]),
        helper.make_node("Relu", ["r"], ["y"]),  # a graph output: NCHW
    ]
    model = _model(nodes, [("x", [1, 3, 17, 18])], ["m", "gap", "y"], inits)
    _check(model, {"x": rng.standard_normal((1, 3, 17, 18)).astype(np.float32)},
           ["CuvilConvNHWC", "Clip", "CuvilConvNHWC", "Relu", "CuvilConvNHWC", "CuvilConvNHWC", "CuvilConvNHWC",
            "CuvilConvNHWC", "Add", "Transpose", "MaxPool", "CuvilGlobalAveragePoolNHWC", "Relu"])


@pytest.mark.parametrize("k,stride,dil", [(5, 1, 1), (3, 2, 1), (3, 1, 2)])
@pytest.mark.slow
def test_a_channels_last_depthwise_conv_reads_a_padded_copy_and_keeps_its_channel_block_outside_the_row(k, stride,
                                                                                                          dil):
    """A depthwise convolution as a sum of taps over a padded NHWC copy: inlined, every tap tested the
    padding with a branch per vector (EfficientNet's 5x5 240@28 at 1 thread: 348 us); computed once, the
    taps are plain loads, summed in independent chains, with the channel block outside the row loop so its
    weights stay in registers (126 us).  SiLU (Sigmoid + Mul, as exporters write it) fuses."""
    c = 40
    inits = {"Wd": rng.standard_normal((c, 1, k, k)) * 0.3, "Bd": rng.standard_normal(c),
             "We": rng.standard_normal((c, 8, 1, 1)) * 0.3, "Wp": rng.standard_normal((8, c, 1, 1)) * 0.3}
    pad = dil * (k // 2)
    nodes = [
        helper.make_node("Conv", ["x", "We"], ["e"]),
        helper.make_node("Conv", ["e", "Wd", "Bd"], ["d"], group=c, pads=[pad] * 4, strides=[stride] * 2,
                         dilations=[dil] * 2),
        helper.make_node("Sigmoid", ["d"], ["sg"]),
        helper.make_node("Mul", ["d", "sg"], ["ds"]),
        helper.make_node("Conv", ["ds", "Wp"], ["y"]),
    ]
    model = _model(nodes, [("x", [1, 8, 13, 21])], ["y"], inits)
    feeds = {"x": rng.standard_normal((1, 8, 13, 21)).astype(np.float32)}
    _check(model, feeds, ["CuvilConvNHWC", "CuvilConvNHWC", "Sigmoid", "Mul", "Transpose", "Conv"])
    g = optimize(import_model(model))
    prog = compile_graph(g, {"x": (1, 8, 13, 21)}, {}, "llvm")
    [dw] = [str(f) for f in prog.kernel_funcs if "dw_pad" in str(f)]
    stores = [ln for ln in dw.splitlines() if ln.strip().startswith("out[")]
    assert stores and all("select" not in ln and "sigmoid" in ln for ln in stores), dw  # plain taps, SiLU fused
    lines = [ln.strip() for ln in dw.splitlines() if ln.strip().startswith(("for", "parallel for"))]
    assert any("outer" in a and b.startswith("for (") and "outer" not in b for a, b in zip(lines, lines[1:])), dw


def test_constant_nodes_become_initializers_so_a_clip_keeps_the_channels_last_layout():
    """TorchScript exports write Clip's bounds as Constant nodes: they must not cost a transpose back to
    NCHW and a Clip kernel of its own (MobileNetV2 ran 2.7x slower that way)."""
    c = 16
    inits = {"Wd": rng.standard_normal((c, 1, 3, 3)), "Wp": rng.standard_normal((8, c, 1, 1)) * 0.3}
    nodes = [
        helper.make_node("Conv", ["x", "Wd"], ["d"], group=c, pads=[1, 1, 1, 1]),
        helper.make_node("Constant", [], ["lo"], value=helper.make_tensor("lo", onnx.TensorProto.FLOAT, [], [0.0])),
        helper.make_node("Constant", [], ["hi"], value_float=6.0),
        helper.make_node("Clip", ["d", "lo", "hi"], ["d6"]),
        helper.make_node("Conv", ["d6", "Wp"], ["y"]),  # a graph output: NCHW, reading d6 transposed back
    ]
    model = _model(nodes, [("x", [1, c, 9, 9])], ["y"], inits)
    _check(model, {"x": rng.standard_normal((1, c, 9, 9)).astype(np.float32)},
           ["CuvilConvNHWC", "Clip", "Transpose", "Conv"])


def test_a_gelu_after_a_reshaped_gemm_computes_before_the_reshape_and_fuses_into_the_gemm():
    """Exporters write a linear layer on a 3-D input as Gemm (2-D) -> Reshape (3-D) -> activation; the
    tanh GELU reads its input three times (Pow 3, Add, Mul)."""
    from cuvil.graph.fuse import fusion_groups

    inits = {"W": rng.standard_normal((24, 16)) * 0.3, "B": rng.standard_normal(24), "shape": np.array([1, 6, 24]),
             "three": np.array(3.0), "a": np.array(0.044715), "c": np.array(0.7978845608), "one": np.array(1.0),
             "half": np.array(0.5), "flat": np.array([6, 16])}
    nodes = [
        helper.make_node("Reshape", ["x", "flat"], ["x2"]),
        helper.make_node("Gemm", ["x2", "W", "B"], ["g"], transB=1),
        helper.make_node("Reshape", ["g", "shape"], ["r"]),
        helper.make_node("Mul", ["r", "half"], ["h"]),
        helper.make_node("Pow", ["r", "three"], ["p"]),
        helper.make_node("Mul", ["p", "a"], ["pa"]),
        helper.make_node("Add", ["r", "pa"], ["s"]),
        helper.make_node("Mul", ["s", "c"], ["sc"]),
        helper.make_node("Tanh", ["sc"], ["t"]),
        helper.make_node("Add", ["t", "one"], ["t1"]),
        helper.make_node("Mul", ["h", "t1"], ["y"]),
    ]
    model = _model(nodes, [("x", [1, 6, 16])], ["y"], inits)
    for t in model.graph.initializer:  # shapes are int64
        if t.name in ("shape", "flat"):
            t.CopyFrom(onnx.numpy_helper.from_array(inits[t.name].astype(np.int64), t.name))
    expect = ["Reshape", "Gemm", "Mul", "Pow", "Mul", "Add", "Mul", "Tanh", "Add", "Mul", "Reshape"]
    _check(model, {"x": rng.standard_normal((1, 6, 16)).astype(np.float32)}, expect)
    g = optimize(import_model(model))
    assert [len(grp.members) for grp in fusion_groups(g) if len(grp.members) > 1] == [9]  # Gemm + the GELU


def test_a_squeeze_and_excitation_mean_reads_the_channels_last_value_as_it_is():
    """EfficientNet's SE block: ``x.mean((2, 3), keepdim=True)`` is ReduceMean (axes as an input since
    opset 18); on a channels-last value it is a global average pool, not a transpose back to NCHW."""
    c = 16
    inits = {"Wd": rng.standard_normal((c, 1, 3, 3)), "Wdown": rng.standard_normal((4, c, 1, 1)) * 0.3,
             "Wup": rng.standard_normal((c, 4, 1, 1)) * 0.3, "Wp": rng.standard_normal((8, c, 1, 1)) * 0.3,
             "axes": np.array([-2, -1])}
    nodes = [
        helper.make_node("Conv", ["x", "Wd"], ["d"], group=c, pads=[1, 1, 1, 1]),
        helper.make_node("ReduceMean", ["d", "axes"], ["m"]),
        helper.make_node("Conv", ["m", "Wdown"], ["s1"]),
        helper.make_node("Relu", ["s1"], ["s2"]),
        helper.make_node("Conv", ["s2", "Wup"], ["s3"]),
        helper.make_node("Sigmoid", ["s3"], ["s4"]),
        helper.make_node("Mul", ["d", "s4"], ["e"]),
        helper.make_node("Conv", ["e", "Wp"], ["p"]),
        helper.make_node("Relu", ["p"], ["y"]),
    ]
    model = _model(nodes, [("x", [1, c, 9, 9])], ["y"], inits)
    model.opset_import[0].version = 18
    for t in model.graph.initializer:
        if t.name == "axes":
            t.CopyFrom(onnx.numpy_helper.from_array(np.array([-2, -1], np.int64), "axes"))
    _check(model, {"x": rng.standard_normal((1, c, 9, 9)).astype(np.float32)},
           ["CuvilConvNHWC", "CuvilGlobalAveragePoolNHWC", "CuvilConvNHWC", "Relu", "CuvilConvNHWC", "Sigmoid",
            "Mul", "CuvilConvNHWC", "Transpose", "Relu"])


def test_the_models_own_transposes_around_a_layernorm_cancel_against_channels_last():
    """ConvNeXt: depthwise 7x7 (NCHW) -> permute(0, 2, 3, 1) -> LayerNorm -> Linear -> permute(0, 3, 1,
    2) -> residual Add: with the depthwise convolution channels-last, no transpose is left."""
    c = 8
    inits = {"Wd": rng.standard_normal((c, 1, 7, 7)) * 0.2, "Bd": rng.standard_normal(c),
             "g": rng.uniform(0.5, 1.5, c), "b": rng.standard_normal(c), "W": rng.standard_normal((c, c)) * 0.3,
             "Wd2": rng.standard_normal((c, 1, 3, 3)) * 0.3}
    nodes = [
        helper.make_node("Conv", ["x", "Wd2"], ["x1"], group=c, pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["x1", "Wd", "Bd"], ["d"], group=c, pads=[3, 3, 3, 3]),
        helper.make_node("Transpose", ["d"], ["t"], perm=[0, 2, 3, 1]),
        helper.make_node("LayerNormalization", ["t", "g", "b"], ["n"], axis=-1, epsilon=1e-6),
        helper.make_node("MatMul", ["n", "W"], ["m"]),
        helper.make_node("Transpose", ["m"], ["back"], perm=[0, 3, 1, 2]),
        helper.make_node("Add", ["x1", "back"], ["r"]),
        helper.make_node("Conv", ["r", "Wd2"], ["r2"], group=c, pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["r2"], ["y"]),
    ]
    model = _model(nodes, [("x", [1, c, 10, 10])], ["y"], inits)
    _check(model, {"x": rng.standard_normal((1, c, 10, 10)).astype(np.float32)},
           ["CuvilConvNHWC", "CuvilConvNHWC", "LayerNormalization", "MatMul", "Add", "CuvilConvNHWC", "Transpose",
            "Relu"])


def test_dense_3x3_convs_after_channels_last_values_read_them_back_in_nchw():
    c = 8
    inits = {"Ws": rng.standard_normal((c, 3, 3, 3)) * 0.3, "Wd": rng.standard_normal((c, 1, 3, 3)),
             "W3": rng.standard_normal((c, c, 3, 3)) * 0.3}
    nodes = [
        helper.make_node("Conv", ["x", "Ws"], ["s"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["s", "Wd"], ["d"], group=c, pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["d", "W3"], ["e"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["e"], ["y"]),
    ]
    model = _model(nodes, [("x", [1, 3, 10, 10])], ["y"], inits)
    _check(model, {"x": rng.standard_normal((1, 3, 10, 10)).astype(np.float32)},
           ["CuvilConvNHWC", "CuvilConvNHWC", "Transpose", "Conv", "Relu"])


def _mix_ffn(c, hw, extra_nodes=(), outputs=("y",)):
    """SegFormer's Mix-FFN as the exporters write it: tokens -> MatMul -> Transpose(0, 2, 1) -> Reshape to
    an image -> depthwise 3x3 -> Reshape to (N, C, HW) -> Transpose(0, 2, 1) -> GELU (Erf) -> MatMul."""
    from onnx import TensorProto, numpy_helper

    L = hw[0] * hw[1]
    f32 = {"W1": rng.standard_normal((4, c)) * 0.3, "B1": rng.standard_normal(c), "Wd": rng.standard_normal((c, 1, 3, 3)),
           "Bd": rng.standard_normal(c), "W2": rng.standard_normal((c, 4)) * 0.3, "sq": np.array(1.4142135),
           "one": np.array(1.0), "half": np.array(0.5)}
    i64 = {"s4": np.array([1, c, *hw]), "s3": np.array([1, c, L])}
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["m1"]), helper.make_node("Add", ["m1", "B1"], ["a1"]),
        helper.make_node("Transpose", ["a1"], ["t1"], perm=[0, 2, 1]), helper.make_node("Reshape", ["t1", "s4"], ["g"]),
        helper.make_node("Conv", ["g", "Wd", "Bd"], ["d"], group=c, pads=[1, 1, 1, 1]),
        helper.make_node("Reshape", ["d", "s3"], ["f"]), helper.make_node("Transpose", ["f"], ["t2"], perm=[0, 2, 1]),
        helper.make_node("Div", ["t2", "sq"], ["e0"]), helper.make_node("Erf", ["e0"], ["e1"]),
        helper.make_node("Add", ["e1", "one"], ["e2"]), helper.make_node("Mul", ["half", "e2"], ["e3"]),
        helper.make_node("Mul", ["t2", "e3"], ["gl"]), helper.make_node("MatMul", ["gl", "W2"], ["y"]),
        *extra_nodes]
    inits = [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in f32.items()]
    inits += [numpy_helper.from_array(np.asarray(v, np.int64), k) for k, v in i64.items()]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, L, 4])],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("hw", [(6, 5), (16, 16)])
def test_a_token_grid_is_the_channels_last_image_of_its_tokens(hw):
    """SegFormer's Mix-FFN: the image the depthwise convolution reads is the tokens' buffer seen as NHWC, and
    its output seen as tokens again is that convolution's NHWC buffer: no transpose is left (the depthwise
    3x3 over 128 channels at 128x128 read the NCHW image with a gather per tap and vector: 27 ms, 0.7
    GMAC/s)."""
    c = 24
    model = _mix_ffn(c, hw)
    feeds = {"x": rng.standard_normal((1, hw[0] * hw[1], 4)).astype(np.float32)}
    _check(model, feeds, ["MatMul", "Add", "Reshape", "CuvilConvNHWC", "Reshape", "Div", "Erf", "Add", "Mul", "Mul",
                          "MatMul"])


def test_a_token_grid_that_an_nchw_reader_needs_is_written_as_the_model_writes_it():
    """The same grid also read by a node that takes NCHW only (a MaxPool): the model's Transpose and Reshape
    are written for it, the depthwise convolution still reads the tokens' buffer."""
    model = _mix_ffn(16, (5, 7), [helper.make_node("MaxPool", ["g"], ["p"], kernel_shape=[2, 2])], ("y", "p"))
    feeds = {"x": rng.standard_normal((1, 35, 4)).astype(np.float32)}
    _check(model, feeds, ["MatMul", "Add", "Reshape", "CuvilConvNHWC", "Reshape", "Div", "Erf", "Add", "Mul", "Mul",
                          "MatMul", "Transpose", "Reshape", "MaxPool"])


@pytest.mark.parametrize("pad", [0, 1, 2])
@pytest.mark.slow
def test_a_channels_last_depthwise_conv_reading_nchw_reads_a_transposed_copy(pad):
    """A depthwise convolution whose input stays NCHW (here the output of a Resize, which only takes NCHW)
    reads an NHWC copy made once (a blocked transpose, padded), not the NCHW image a gather per tap."""
    c = 32
    from onnx import TensorProto, numpy_helper

    inits = [numpy_helper.from_array(rng.standard_normal((c, 1, 3, 3)).astype(np.float32), "Wd"),
             numpy_helper.from_array(rng.standard_normal((c, c, 1, 1)).astype(np.float32) * 0.2, "Wp"),
             numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")]
    nodes = [helper.make_node("Resize", ["x", "", "scales"], ["r"], mode="nearest"),
             helper.make_node("Conv", ["r", "Wd"], ["d"], group=c, pads=[pad] * 4),
             helper.make_node("Conv", ["d", "Wp"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 9, 11])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": rng.standard_normal((1, c, 9, 11)).astype(np.float32)}
    _check(model, feeds, ["Resize", "CuvilConvNHWC", "Transpose", "Conv"])
    prog = compile_graph(optimize(import_model(model)), {"x": (1, c, 9, 11)}, {}, "llvm")
    [dw] = [str(f) for f in prog.kernel_funcs if "dw_pad" in str(f)]
    taps = [ln for ln in dw.splitlines() if ln.strip().startswith(("out[", "conv_dw["))]
    assert taps and all("dw_pad[" in ln and "in0" not in ln for ln in taps), dw  # the taps read the NHWC copy
