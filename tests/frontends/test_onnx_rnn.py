"""ConvTranspose and the recurrent operators (LSTM, GRU, RNN): ONNX's node cases, models exported from
PyTorch (both exporters) checked against onnxruntime and eager PyTorch, ConvTranspose attributes
against a numpy reference (hypothesis), and the errors a bad node gets."""

from __future__ import annotations

import io
import itertools
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from toolchain import IN_CI, missing, module

onnx = module("onnx")
ort = module("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from reference import budget  # noqa: E402

import cuvil.onnx  # noqa: E402
from cuvil.errors import CuvilError, ShapeError, UnsupportedOpError  # noqa: E402

OPS = {"ConvTranspose", "LSTM", "GRU", "RNN"}


def _node_cases() -> dict:
    from onnx.backend.test.case import node

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = node.collect_testcases()
    return {c.name: c for c in cases if {n.op_type for n in c.model.graph.node} & OPS}


NODE_CASES = _node_cases()


def _array(v: object) -> np.ndarray:
    return numpy_helper.to_array(v) if isinstance(v, TensorProto) else np.asarray(v)


@pytest.mark.parametrize("name", sorted(NODE_CASES))
def test_node_case(name: str) -> None:
    case = NODE_CASES[name]
    s = cuvil.onnx.InferenceSession(case.model.SerializeToString())
    for inputs, outputs in case.data_sets:
        got = s.run(None, {i.name: _array(v) for i, v in zip(case.model.graph.input, inputs)})
        assert len(got) == len(outputs)
        for g, r in zip(got, outputs):
            r = _array(r)
            assert g.dtype == r.dtype and g.shape == r.shape, (g.dtype, g.shape, r.dtype, r.shape)
            np.testing.assert_allclose(g, r, rtol=case.rtol, atol=case.atol)


def _close(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape, (g.shape, w.shape)
        assert np.allclose(g, w, rtol=1e-3, atol=1e-4), float(np.abs(g - w).max())


def _against_ort(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """cuvil's outputs, checked against onnxruntime's."""
    got = cuvil.onnx.InferenceSession(model).run(None, feeds)
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    _close(got, want)
    return got


# -- models exported from PyTorch ------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch():
    try:
        import torch
    except ImportError:
        if IN_CI:
            missing("torch is not installed")
        pytest.skip("torch is not installed")
    return torch


def _export(torch, module, x, dynamo: bool) -> bytes:
    module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            return torch.onnx.export(module, (x,), dynamo=True, verbose=False).model_proto.SerializeToString()
        f = io.BytesIO()
        torch.onnx.export(module, (x,), f, dynamo=False, opset_version=17)
        return f.getvalue()


def _check_export(torch, module, x, dynamo: bool) -> None:
    model = _export(torch, module, x, dynamo)
    feeds = {ort.InferenceSession(model, providers=["CPUExecutionProvider"]).get_inputs()[0].name: x.numpy()}
    got = _against_ort(model, feeds)
    with torch.no_grad():
        want = module(x)
    want = want if isinstance(want, tuple) else (want,)
    _close(got[:len(want)], [w.numpy() for w in want])


def _recurrent(torch, cell: str, bidirectional: bool, batch_first: bool):
    nn = torch.nn

    class Classifier(nn.Module):
        """``cell`` (2 layers) and a Linear head on the last step: the shape of a sequence classifier."""

        def __init__(self) -> None:
            super().__init__()
            self.rnn = getattr(nn, cell)(8, 16, 2, batch_first=batch_first, bidirectional=bidirectional)
            self.head = nn.Linear(32 if bidirectional else 16, 5)

        def forward(self, x):
            y, _ = self.rnn(x)
            return self.head(y[:, -1] if batch_first else y[-1])

    torch.manual_seed(0)
    return Classifier()


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("cell,bidirectional,batch_first", [
    ("LSTM", False, True), ("GRU", False, True), ("RNN", False, True), ("LSTM", True, False), ("GRU", True, True),
])
@pytest.mark.slow
def test_exported_recurrent(torch, cell: str, bidirectional: bool, batch_first: bool, dynamo: bool) -> None:
    # 11 steps: more than one Split / Concat of the step trees; batch 2
    x = torch.randn(2, 11, 8) if batch_first else torch.randn(11, 2, 8)
    _check_export(torch, _recurrent(torch, cell, bidirectional, batch_first), x, dynamo)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("kwargs", [
    {"kernel_size": 2, "stride": 2},  # the UNet upsampling: the kernel == stride path
    {"kernel_size": 3, "stride": 2, "padding": 1, "output_padding": 1},
    {"kernel_size": 3, "stride": 1, "padding": 1, "groups": 2, "dilation": 2},
])
@pytest.mark.slow
def test_exported_conv_transpose(torch, kwargs: dict, dynamo: bool) -> None:
    torch.manual_seed(0)
    _check_export(torch, torch.nn.ConvTranspose2d(4, 6, **kwargs), torch.randn(1, 4, 7, 9), dynamo)


# -- ConvTranspose against a numpy reference ---------------------------------------------------------


def _conv_transpose_ref(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, strides: list[int], dil: list[int],
                        begin: list[int], out: list[int], group: int) -> np.ndarray:
    """Scatter form: every input pixel adds its kernel-weighted copy of the filters into the output."""
    n, c = x.shape[:2]
    mg = w.shape[1]
    cg = c // group
    y = np.zeros((n, mg * group) + tuple(out), np.float64)
    for g in range(group):
        for src in itertools.product(*(range(s) for s in x.shape[2:])):
            for tap in itertools.product(*(range(k) for k in w.shape[2:])):
                dst = [src[d] * strides[d] + tap[d] * dil[d] - begin[d] for d in range(len(src))]
                if all(0 <= p < o for p, o in zip(dst, out)):
                    xs = x[(slice(None), slice(g * cg, (g + 1) * cg)) + src]  # (n, cg)
                    ws = w[(slice(g * cg, (g + 1) * cg), slice(None)) + tap]  # (cg, mg)
                    y[(slice(None), slice(g * mg, (g + 1) * mg)) + tuple(dst)] += xs @ ws
    if b is not None:
        y += b.reshape((1, -1) + (1,) * len(out))
    return y.astype(np.float32)


def _conv_transpose_model(xs: tuple[int, ...], ws: tuple[int, ...], bias: bool, const_w: bool, **attrs) -> bytes:
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, xs)]
    inits = []
    if const_w:
        rng = np.random.default_rng(1)
        inits.append(numpy_helper.from_array(rng.standard_normal(ws).astype(np.float32), "w"))
    else:
        inputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, ws))
    names = ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array(np.linspace(-1, 1, ws[1] * attrs.get("group", 1), dtype=np.float32), "b"))
        names.append("b")
    node = helper.make_node("ConvTranspose", names, ["y"], name="up", **attrs)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@budget(0.5)
@given(st.data())
def test_conv_transpose_matches_numpy(data: st.DataObject) -> None:
    nd = data.draw(st.sampled_from([1, 2, 2, 3]))
    group = data.draw(st.sampled_from([1, 1, 2]))
    cg, mg = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    sp = [data.draw(st.integers(1, 5 if nd < 3 else 3)) for _ in range(nd)]
    k = [data.draw(st.integers(1, 3)) for _ in range(nd)]
    strides = [data.draw(st.integers(1, 3)) for _ in range(nd)]
    dil = [data.draw(st.integers(1, 2)) for _ in range(nd)]
    pads = [data.draw(st.integers(0, k[d % nd] - 1)) for d in range(2 * nd)]
    outpad = [data.draw(st.integers(0, max(strides[d], dil[d]) - 1)) for d in range(nd)]
    bias, const_w = data.draw(st.booleans()), data.draw(st.booleans())
    xs, ws = (data.draw(st.integers(1, 2)), cg * group, *sp), (cg * group, mg, *k)
    full = [strides[d] * (sp[d] - 1) + outpad[d] + dil[d] * (k[d] - 1) + 1 - pads[d] - pads[d + nd] for d in range(nd)]
    if min(full) < 1:
        return
    model = _conv_transpose_model(xs, ws, bias, const_w, strides=strides, dilations=dil, pads=pads,
                                  output_padding=outpad, group=group)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(xs).astype(np.float32)
    feeds = {"x": x}
    w = numpy_helper.to_array(onnx.load_from_string(model).graph.initializer[0]) if const_w else None
    if w is None:
        w = feeds["w"] = rng.standard_normal(ws).astype(np.float32)
    b = np.linspace(-1, 1, mg * group, dtype=np.float32) if bias else None
    [got] = cuvil.onnx.InferenceSession(model).run(None, feeds)
    want = _conv_transpose_ref(x, w, b, strides, dil, pads[:nd], full, group)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_conv_transpose_blocks_path_matches_numpy() -> None:
    """kernel == stride (3-D, with bias, weights fed at run time): the contraction + depth-to-space path."""
    model = _conv_transpose_model((1, 3, 2, 3, 2), (3, 2, 2, 2, 2), True, False, strides=[2, 2, 2])
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((1, 3, 2, 3, 2)).astype(np.float32), rng.standard_normal((3, 2, 2, 2, 2)).astype(
        np.float32)
    [got] = cuvil.onnx.InferenceSession(model).run(None, {"x": x, "w": w})
    want = _conv_transpose_ref(x, w, np.linspace(-1, 1, 2, dtype=np.float32), [2] * 3, [1] * 3, [0] * 3, [4, 6, 4], 1)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("auto_pad,output_shape", [("SAME_UPPER", None), ("SAME_LOWER", None),
                                                    ("NOTSET", [10, 9]), ("VALID", None)])
def test_conv_transpose_output_shape_and_auto_pad(auto_pad: str, output_shape: list[int] | None) -> None:
    attrs = {"strides": [2, 2], "auto_pad": auto_pad}
    if output_shape is not None:
        attrs["output_shape"] = output_shape
    model = _conv_transpose_model((1, 2, 4, 4), (2, 3, 3, 3), True, True, **attrs)
    _against_ort(model, {"x": np.random.default_rng(0).standard_normal((1, 2, 4, 4)).astype(np.float32)})


# -- recurrent attributes and inputs (against onnxruntime) ----------------------------------------------


def _recurrent_model(op: str, t: int, b: int, i: int, h: int, *, direction: str = "forward", layout: int = 0,
                     seq_lens: bool = False, initial: bool = False, peepholes: bool = False, outputs: int = 3,
                     **attrs) -> tuple[bytes, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    g = {"LSTM": 4, "GRU": 3, "RNN": 1}[op]
    d = 2 if direction == "bidirectional" else 1
    xs = (t, b, i) if layout == 0 else (b, t, i)
    hs = (d, b, h) if layout == 0 else (b, d, h)
    inits = {"W": rng.standard_normal((d, g * h, i)) * 0.5, "R": rng.standard_normal((d, g * h, h)) * 0.5,
             "B": rng.standard_normal((d, 2 * g * h)) * 0.5}
    names = ["X", "W", "R", "B", "", "", "", ""]
    feeds = {"X": rng.standard_normal(xs).astype(np.float32)}
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, xs)]
    if seq_lens:
        names[4] = "L"
        feeds["L"] = rng.integers(1, t + 1, b).astype(np.int32)
        inputs.append(helper.make_tensor_value_info("L", TensorProto.INT32, (b,)))
    if initial:
        names[5] = "H0"
        feeds["H0"] = rng.standard_normal(hs).astype(np.float32)
        inputs.append(helper.make_tensor_value_info("H0", TensorProto.FLOAT, hs))
        if op == "LSTM":
            names[6] = "C0"
            inits["C0"] = rng.standard_normal(hs)
    if peepholes:
        names[7] = "P"
        inits["P"] = rng.standard_normal((d, 3 * h)) * 0.5
    while names[-1] == "":
        names.pop()
    outs = ["Y", "Y_h", "Y_c"][:outputs if op == "LSTM" else min(outputs, 2)]
    node = helper.make_node(op, names, outs, name="rec", hidden_size=h, direction=direction, layout=layout, **attrs)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                                                    for o in outs],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)]).SerializeToString(), feeds


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_recurrent_batch_first_layout(op: str) -> None:
    """layout=1 (onnxruntime refuses it: checked against ONNX's reference implementation)."""
    from onnx.reference import ReferenceEvaluator

    model, feeds = _recurrent_model(op, 4, 3, 5, 6, direction="bidirectional", layout=1, initial=True)
    _close(cuvil.onnx.InferenceSession(model).run(None, feeds), ReferenceEvaluator(model).run(None, feeds))


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("options", [
    {"direction": "bidirectional", "initial": True},
    {"direction": "reverse", "seq_lens": True, "initial": True},
    {"direction": "bidirectional", "seq_lens": True},
    {"clip": 0.5, "t": 10},
])
def test_recurrent_against_onnxruntime(op: str, options: dict) -> None:
    options = dict(options)
    model, feeds = _recurrent_model(op, options.pop("t", 4), 3, 5, 6, **options)
    _against_ort(model, feeds)


def test_lstm_peepholes_and_gru_before_reset() -> None:
    _against_ort(*_recurrent_model("LSTM", 5, 2, 3, 4, peepholes=True, initial=True))
    _against_ort(*_recurrent_model("GRU", 5, 2, 3, 4, initial=True, linear_before_reset=1))


@pytest.mark.parametrize("op,acts", [("LSTM", ["Relu", "Tanh", "Sigmoid"]), ("GRU", ["Sigmoid", "Relu"]),
                                     ("RNN", ["Relu"]), ("RNN", ["Sigmoid"])])
def test_recurrent_activations(op: str, acts: list[str]) -> None:
    model, feeds = _recurrent_model(op, 4, 2, 3, 4, initial=True, activations=acts)
    _against_ort(model, feeds)


def test_recurrent_steps_share_kernels() -> None:
    """64 unrolled LSTM steps compile a handful of kernels, not one per step."""
    from cuvil.frontend.onnx import import_model
    from cuvil.graph.compile import kernel_programs

    model, _ = _recurrent_model("LSTM", 64, 1, 4, 8, outputs=1)
    kernels = kernel_programs(import_model(onnx.load_from_string(model)))
    assert len(kernels) <= 20, len(kernels)
    assert sum(n for _, n in kernels) > 64 * 3


# -- errors name the node ---------------------------------------------------------------------------------


def test_unknown_activation_is_unsupported_naming_the_node() -> None:
    model, feeds = _recurrent_model("RNN", 3, 1, 2, 2, activations=["Gelu"])
    with pytest.raises(UnsupportedOpError, match="RNN node 'rec'.*'Gelu'"):
        cuvil.onnx.InferenceSession(model).run(None, feeds)


def test_symbolic_sequence_length_is_unsupported_naming_the_node() -> None:
    model, feeds = _recurrent_model("GRU", 3, 1, 2, 2)
    m = onnx.load_from_string(model)
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "T"
    with pytest.raises(UnsupportedOpError, match="GRU node 'rec'.*static"):
        cuvil.onnx.InferenceSession(m.SerializeToString()).run(None, feeds)


def test_conv_transpose_bad_channels_name_the_node() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, 3, 4, 4))
    w = numpy_helper.from_array(np.zeros((2, 2, 2, 2), np.float32), "w")
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="up")
    graph = helper.make_graph([node], "g", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(CuvilError, match="ConvTranspose node 'up'") as exc:
        cuvil.onnx.InferenceSession(model.SerializeToString())
    assert isinstance(exc.value, (ShapeError, CuvilError))
