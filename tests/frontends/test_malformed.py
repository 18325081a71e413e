"""Malformed ONNX models: each is refused with a CuvilError whose message names the field, tensor or
node at fault, and what onnxruntime refuses as invalid cuvil refuses too (issue 17, item 2).  A
failed ``cuvil compile -o`` leaves no file behind."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import cuvil.onnx  # noqa: E402
from cuvil.errors import CuvilError, ModelError, ShapeError  # noqa: E402

vi = helper.make_tensor_value_info


def model(nodes=None, inputs=None, outputs=None, inits=(), opset=17, ir=None):
    """A small valid model (y = relu(x), x float[2, 3]) with the parts given replaced."""
    nodes = nodes if nodes is not None else [helper.make_node("Relu", ["x"], ["y"])]
    inputs = inputs if inputs is not None else [vi("x", TensorProto.FLOAT, [2, 3])]
    outputs = outputs if outputs is not None else [vi("y", TensorProto.FLOAT, [2, 3])]
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits)),
                          opset_imports=[helper.make_opsetid("", opset)] if opset else [])
    if ir is not None:
        m.ir_version = ir
    return m


def add_w(w):
    """y = x + w for an initializer ``w`` (x float[6, 5])."""
    return model([helper.make_node("Add", ["x", "w"], ["y"])], [vi("x", TensorProto.FLOAT, [6, 5])],
                 [vi("y", TensorProto.FLOAT, [6, 5])], [w])


def ort_refuses(m) -> bool:
    try:
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001  # onnxruntime's own exception classes
        return True
    return False


def refused(m, error=ModelError):
    """The error cuvil raises for ``m`` (a ``error``, whatever else fails)."""
    with pytest.raises(CuvilError) as info:
        cuvil.onnx.InferenceSession(m.SerializeToString() if not isinstance(m, bytes) else m)
    assert isinstance(info.value, error), f"{type(info.value).__name__}: {info.value}"
    return str(info.value)


def _short_raw():
    w = numpy_helper.from_array(np.zeros((6, 5), np.float32), "w")
    w.raw_data = w.raw_data[:29 * 4]
    return add_w(w)


def _short_float_data():
    w = helper.make_tensor("w", TensorProto.FLOAT, [6, 5], np.zeros(30, np.float32))
    del w.float_data[-1]
    return add_w(w)


def _tensor_attr_without_tensor():
    n = helper.make_node("Constant", [], ["c"], name="const")
    n.attribute.append(onnx.AttributeProto(name="value", type=onnx.AttributeProto.TENSOR))
    return model([n, helper.make_node("Add", ["x", "c"], ["y"])])


def _negative_init_dim():
    w = numpy_helper.from_array(np.zeros((2, 3), np.float32), "w")
    w.dims[0] = -2
    return model([helper.make_node("Add", ["x", "w"], ["y"])], inits=[w])


def _defined_twice():
    return model([helper.make_node("Relu", ["x"], ["y"], name="a"), helper.make_node("Neg", ["x"], ["y"], name="b")])


# (case, model, the words the message must hold, whether onnxruntime refuses it too)
CASES = [
    ("raw data shorter than its dims", _short_raw, ["initializer 'w'", "raw_data holds 116 bytes", "need 120"], True),
    ("float_data shorter than its dims", _short_float_data, ["initializer 'w'", "float_data holds 29", "need 30"],
     True),
    ("TENSOR attribute without a tensor", _tensor_attr_without_tensor,
     ["Constant node 'const'", "attribute 'value'", "holds no tensor"], True),
    ("IR version 99", lambda: model(ir=99), ["ir_version 99", "versions 3 to"], True),
    ("opset 999", lambda: model(opset=999), ["opset 999", "supports opsets 1 to"], True),
    ("no opset import", lambda: model(opset=None), ["opset_import is empty"], True),
    ("negative initializer dimension", _negative_init_dim, ["initializer 'w'", "[-2, 3]", "negative"], True),
    ("unknown attribute", lambda: model([helper.make_node("Relu", ["x"], ["y"], name="r", foo=3)]),
     ["Relu node 'r'", "'foo' is not an attribute of Relu", "its attributes: none"], True),
    ("required attribute missing", lambda: model([helper.make_node("Cast", ["x"], ["y"], name="c")]),
     ["Cast node 'c'", "required attribute(s) 'to'"], True),
    ("attribute of the wrong type", lambda: model([helper.make_node("Cast", ["x"], ["y"], name="c", to=1.0)]),
     ["Cast node 'c'", "attribute 'to' must be INT, not FLOAT"], True),
    ("a value defined twice", _defined_twice, ["Neg node 'b'", "output 'y' is already defined"], True),
    ("an empty ModelProto", lambda: onnx.ModelProto(), ["no graph"], True),
    # onnxruntime 1.32 accepts these two; cuvil refuses them (issue 17): a graph that computes
    # nothing, a negative dimension
    ("no outputs", lambda: model(outputs=[]), ["graph 'g' has no outputs"], False),
    ("negative input dimension", lambda: model(inputs=[vi("x", TensorProto.FLOAT, [-2, 3])],
                                               outputs=[vi("y", TensorProto.FLOAT, None)]),
     ["graph input 'x'", "dimension 0 is -2"], False),
]


@pytest.mark.parametrize("case,make,words,ort_too", CASES, ids=[c[0] for c in CASES])
def test_malformed_model_is_a_model_error_naming_the_fault(case, make, words, ort_too):
    m = make()
    text = refused(m)
    for w in words:
        assert w in text, text
    assert ort_refuses(m) == ort_too


def test_empty_bytes_and_garbage_are_model_errors():
    assert "no graph" in refused(b"")
    assert "cannot load the ONNX model" in refused(b"\x08\x07\x12\xff\xff")


def test_unknown_element_type_is_a_cuvil_error():
    w = numpy_helper.from_array(np.zeros((6, 5), np.float32), "w")
    w.data_type = 999
    assert "initializer 'w'" in refused(add_w(w))
    m = model(inputs=[vi("x", TensorProto.FLOAT, [2, 3])])
    m.graph.input[0].type.tensor_type.elem_type = 999
    with pytest.raises(CuvilError, match="'x'"):
        cuvil.onnx.InferenceSession(m.SerializeToString())


def test_ai_onnx_ml_only_model_is_listed_as_unsupported():
    """A model that imports only another domain is not malformed (onnxruntime runs ai.onnx.ml models):
    its ops are what cuvil does not support."""
    n = helper.make_node("Binarizer", ["x"], ["y"], domain="ai.onnx.ml")
    m = helper.make_model(helper.make_graph([n], "g", [vi("x", TensorProto.FLOAT, [2])],
                                            [vi("y", TensorProto.FLOAT, [2])]),
                          opset_imports=[helper.make_opsetid("ai.onnx.ml", 1)])
    with pytest.raises(cuvil.onnx.UnsupportedOpError, match="ai.onnx.ml.Binarizer"):
        cuvil.onnx.InferenceSession(m)
    m.graph.node[0].domain = ""
    m.graph.node[0].op_type = "Relu"
    assert "is an ai.onnx operator, but the model imports no ai.onnx opset" in refused(m)


WINDOW = [
    ("Conv, output shape declared", lambda: model(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="conv")], [vi("x", TensorProto.FLOAT, [1, 1, 3, 3])],
        [vi("y", TensorProto.FLOAT, [1, 1, 1, 1])], [numpy_helper.from_array(np.ones((1, 1, 5, 5), np.float32), "w")])),
    ("Conv, output shape open", lambda: model(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="conv")], [vi("x", TensorProto.FLOAT, [1, 1, 3, 3])],
        [vi("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(np.ones((1, 1, 5, 5), np.float32), "w")])),
    ("MaxPool, padded", lambda: model(
        [helper.make_node("MaxPool", ["x"], ["y"], name="pool", kernel_shape=[6, 6], pads=[1, 1, 1, 1])],
        [vi("x", TensorProto.FLOAT, [1, 1, 3, 3])], [vi("y", TensorProto.FLOAT, [1, 1, 1, 1])])),
]


@pytest.mark.parametrize("case,make", WINDOW, ids=[c[0] for c in WINDOW])
def test_window_larger_than_its_padded_input_names_the_node(case, make):
    text = refused(make(), ShapeError)
    assert "node '" in text and "larger than the padded input" in text, text
    assert "ShapeInferenceError" not in text


def test_failed_compile_leaves_no_file(tmp_path, capsys):
    from cuvil.cli import main

    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    assert main(["compile", str(empty), "-o", str(tmp_path / "e.so")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cuvil: error: ") and "no graph" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.onnx"]


def test_a_failure_while_writing_the_library_leaves_no_partial_file(tmp_path, monkeypatch, capsys):
    """The header was written last and left 0 bytes behind when its text failed: now both files are
    written under temporary names and renamed at the end."""
    import cuvil.graph.export.library as export
    from cuvil.cli import main

    path = tmp_path / "m.onnx"
    onnx.save(model(), path)

    def broken(*args, **kwargs):
        raise ShapeError("the header cannot be written")

    monkeypatch.setattr(export, "model_header", broken)
    assert main(["compile", str(path), "-o", str(tmp_path / "m.so")]) == 1
    assert "the header cannot be written" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    monkeypatch.undo()
    assert main(["compile", str(path), "-o", str(tmp_path / "m.so")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.h", "m.onnx", "m.so"]
