"""Concatenations written in place by their producers: the Concat call is gone, its inputs are bytes of its
output in the memory plan, and the values match onnxruntime (in the session and in an exported library)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import cuvil.onnx as connx
from cuvil.frontend.onnx import import_model
from cuvil.graph.compile import compile_model
from cuvil.runtime import load

RNG = np.random.default_rng(7)


def _w(*shape):
    return numpy_helper.from_array((RNG.standard_normal(shape) * 0.2).astype(np.float32))


def _model(nodes, outputs, inits, shape=(1, 8, 6, 6)):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _fire(concat_axis=1, extra_outputs=(), inner=False):
    """squeeze 1x1 + relu -> (expand 1x1 + relu, expand 3x3 + relu) -> concat -> conv (SqueezeNet's fire
    module); ``inner``: the concatenation and that conv's output joined again (DenseNet), then a conv."""
    relu = [helper.make_node("Relu", [f"{v}0"], [v]) for v in ("s", "e1", "e3")]
    nodes = [helper.make_node("Conv", ["x", "ws"], ["s0"]), relu[0],
             helper.make_node("Conv", ["s", "we1"], ["e10"]), relu[1],
             helper.make_node("Conv", ["s", "we3"], ["e30"], pads=[1, 1, 1, 1]), relu[2],
             helper.make_node("Concat", ["e1", "e3"], ["c"], axis=concat_axis)]
    if inner:
        nodes += [helper.make_node("Conv", ["c", "wn"], ["n"]),
                  helper.make_node("Concat", ["c", "n"], ["c2"], axis=1), helper.make_node("Conv", ["c2", "wy"], ["y"])]
    else:
        nodes.append(helper.make_node("Conv", ["c", "wn"], ["y"]))
    joined = 12 if concat_axis == 1 else 6  # the channels the conv after the concatenation reads
    inits = [_w(4, 8, 1, 1), _w(6, 4, 1, 1), _w(6, 4, 3, 3), _w(5, joined, 1, 1), _w(3, 17, 1, 1)]
    for t, name in zip(inits, ["ws", "we1", "we3", "wn", "wy"]):
        t.name = name
    return _model(nodes, ["y", *extra_outputs], inits)


def _check(model, n_concats_left):
    x = RNG.standard_normal((1, 8, 6, 6)).astype(np.float32)
    prog = compile_model(import_model(model), {"x": (1, 8, 6, 6)})
    left = sum("Concat" in label for label in prog.labels)
    assert left == n_concats_left, prog.labels
    got = prog.run({"x": x})
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    names = [o.name for o in model.graph.output]
    for name, w in zip(names, want):
        np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(prog.run({"x": x})["y"], got["y"])  # a second run: the same bits
    return prog


def test_a_fire_module_concatenation_is_written_in_place():
    prog = _check(_fire(), 0)
    offs = prog.memory.offsets
    (e1, e3) = [s for s in offs if prog.slots[s].size == 6 * 36]  # the two expand outputs
    assert abs(offs[e3] - offs[e1]) == 6 * 36 * 4  # side by side: the concatenation's two halves


def test_concatenations_of_concatenations_chain():
    _check(_fire(inner=True), 0)


@pytest.mark.parametrize("why, model, left", [
    ("an input is also a graph output", lambda: _fire(extra_outputs=("e1",)), 1),
    ("the output is a graph output", lambda: _fire(extra_outputs=("c",)), 1),
    ("joined on an axis after one of extent > 1", lambda: _fire(concat_axis=2), 1),
])
def test_concatenations_that_keep_their_copy(why, model, left):
    _check(model(), left)


def test_the_same_input_twice_keeps_the_copy():
    w = _w(3, 16, 1, 1)
    w.name = "w"
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Concat", ["r", "r"], ["c"], axis=1),
             helper.make_node("Conv", ["c", "w"], ["y"])]
    _check(_model(nodes, ["y"], [w]), 1)


def test_an_exported_library_places_the_views_in_its_workspace(tmp_path):
    model = _fire(inner=True)
    x = RNG.standard_normal((1, 8, 6, 6)).astype(np.float32)
    lib = connx.InferenceSession(model).export_library(tmp_path / "fire.so")
    (y,) = load(lib).run(None, {"x": x})
    (want,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    assert onnx.checker.check_model(model) is None
