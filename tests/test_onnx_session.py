"""cuvil.onnx.InferenceSession: onnxruntime's calling convention, feed validation, errors before compiling."""

from __future__ import annotations

import numpy as np
import pytest
import toolchain

onnx = toolchain.module("onnx")
ort = toolchain.module("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402

import cuvil  # noqa: E402
import cuvil.onnx as connx  # noqa: E402
from cuvil.frontend.onnx import ModelError  # noqa: E402


def _model(nodes, inputs, outputs, inits=(), opset=17):
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _ort(model, feeds):
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def _mlp():
    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", TensorProto.FLOAT, [8, 4], rng.standard_normal((8, 4)).astype(np.float32).ravel())
    b = helper.make_tensor("b", TensorProto.FLOAT, [4], rng.standard_normal(4).astype(np.float32))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Add", ["h", "b"], ["hb"], name="add"),
             helper.make_node("Relu", ["hb"], ["y"], name="relu")]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], [w, b])


def test_run_matches_onnxruntime_for_each_batch():
    m = _mlp()
    s = connx.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    for n in (1, 3):
        x = np.random.default_rng(n).standard_normal((n, 8)).astype(np.float32)
        (y,) = s.run(None, {"x": x})
        np.testing.assert_allclose(y, _ort(m, {"x": x})[0], rtol=1e-5, atol=1e-6)
        assert s.run(["y"], {"x": x})[0].shape == (n, 4)


def test_inputs_and_outputs_describe_the_model():
    s = connx.InferenceSession(_mlp())
    (i,) = s.get_inputs()
    (o,) = s.get_outputs()
    assert (i.name, i.shape, i.type) == ("x", ["batch", 8], "tensor(float)")
    assert (o.name, o.shape, o.type) == ("y", ["batch", 4], "tensor(float)")


def test_one_native_call_per_run():
    s = connx.InferenceSession(_mlp())
    x = np.ones((2, 8), np.float32)
    s.run(None, {"x": x})
    (prog,) = s._cache.values()
    assert prog.n_calls == 1 and prog.module is not None  # MatMul + Add + Relu: one fused kernel
    calls = []
    real = prog.module._fn
    prog.module._fn = lambda *a: calls.append(a) or real(*a)
    s.run(None, {"x": x})
    assert len(calls) == 1


@pytest.mark.parametrize("feeds, err, text", [
    ({}, cuvil.ArgumentError, "missing input(s) 'x'"),
    ({"x": np.ones((2, 8), np.float32), "z": np.ones(1)}, cuvil.ArgumentError, "unknown input(s) 'z'"),
    ({"x": np.ones((2, 8), np.float64)}, cuvil.DTypeError, "input 'x': expected tensor(float)"),
    ({"x": np.ones((2, 7), np.float32)}, cuvil.ShapeError, "input 'x': dimension 1 must be 8"),
    ({"x": np.ones((8,), np.float32)}, cuvil.ShapeError, "input 'x': expected rank 2"),
    ({"x": [[1.0] * 8]}, cuvil.ArgumentError, "input 'x': expected a numpy array"),
])
def test_feeds_are_validated(feeds, err, text):
    s = connx.InferenceSession(_mlp())
    with pytest.raises(err) as e:
        s.run(None, feeds)
    assert text in str(e.value)


def test_symbolic_dimension_must_agree_across_inputs():
    m = _model([helper.make_node("Add", ["a", "b"], ["c"])],
               [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n"]),
                helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n"])],
               [helper.make_tensor_value_info("c", TensorProto.FLOAT, ["n"])])
    s = connx.InferenceSession(m)
    with pytest.raises(cuvil.ShapeError, match="dimension 0 \\(n\\) is 3, but n is 2 in input 'a'"):
        s.run(None, {"a": np.ones(2, np.float32), "b": np.ones(3, np.float32)})


def test_every_unsupported_op_is_listed_before_compiling():
    nodes = [helper.make_node("Bernoulli", ["x"], ["a"], name="s1"),
             helper.make_node("Bernoulli", ["a"], ["b"], name="s2"),
             helper.make_node("Relu", ["b"], ["c"], name="r"), helper.make_node("Det", ["c"], ["y"], name="d")]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    with pytest.raises(cuvil.UnsupportedOpError) as e:
        connx.InferenceSession(m)
    msg = str(e.value)
    assert "2 operator type(s)" in msg and "Det (node 'd')" in msg and "Bernoulli (nodes 's1', 's2')" in msg


def test_dangling_input_is_a_model_error():
    m = _model([helper.make_node("Relu", ["nowhere"], ["y"], name="r")],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    with pytest.raises(cuvil.CuvilError, match="nowhere"):
        connx.InferenceSession(m)


def test_bad_shapes_are_a_model_error():
    m = _model([helper.make_node("MatMul", ["a", "b"], ["y"], name="mm")],
               [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3]),
                helper.make_tensor_value_info("b", TensorProto.FLOAT, [4, 5])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    with pytest.raises(ModelError, match="shape inference"):
        connx.InferenceSession(m)


def test_unsupported_dtype_is_refused():
    m = _model([helper.make_node("Relu", ["x"], ["y"])],
               [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2])],
               [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2])])
    with pytest.raises(cuvil.DTypeError, match="'x' has type tensor\\(bfloat16\\)"):
        connx.InferenceSession(m)


def test_not_a_model():
    with pytest.raises(ModelError, match="cannot load"):
        connx.InferenceSession(b"not a model")
    with pytest.raises(ModelError, match="no ONNX model"):
        connx.InferenceSession("/nonexistent/model.onnx")


def test_reshape_shape_input_is_specialised_on_its_value():
    m = _model([helper.make_node("Reshape", ["x", "s"], ["y"]), helper.make_node("Relu", ["y"], ["z"])],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6]),
                helper.make_tensor_value_info("s", TensorProto.INT64, [2])],
               [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)])
    s = connx.InferenceSession(m)
    x = np.random.default_rng(1).standard_normal((2, 6)).astype(np.float32)
    for shape in ([3, 4], [4, -1], [3, 4]):
        feeds = {"x": x, "s": np.array(shape, np.int64)}
        (z,) = s.run(None, feeds)
        np.testing.assert_array_equal(z, _ort(m, feeds)[0])
    assert len(s._cache) == 2  # one compilation per distinct value


def test_num_threads_and_tuning_db_arguments(tmp_path):
    with pytest.raises(cuvil.ArgumentError):
        connx.InferenceSession(_mlp(), num_threads=0)
    with pytest.raises(cuvil.ArgumentError, match="tuning_db"):
        connx.InferenceSession(_mlp(), tuning_db=3.5)
    x = np.ones((5, 8), np.float32)
    s = connx.InferenceSession(_mlp(), num_threads=1)
    np.testing.assert_allclose(s.run(None, {"x": x})[0], _ort(_mlp(), {"x": x})[0], rtol=1e-5)
    # a database that does not exist (yet): every kernel as it would be built without one
    s = connx.InferenceSession(_mlp(), tuning_db=str(tmp_path / "absent.db"))
    np.testing.assert_allclose(s.run(None, {"x": x})[0], _ort(_mlp(), {"x": x})[0], rtol=1e-5)


def test_import_cuvil_does_not_import_onnx():
    import subprocess
    import sys

    code = "import sys, cuvil, cuvil.te; assert 'onnx' not in sys.modules and 'onnxruntime' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_external_data_model_loads(tmp_path):
    rng = np.random.default_rng(4)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    m = _model([helper.make_node("MatMul", ["x", "w"], ["y"])],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32])],
               [onnx.numpy_helper.from_array(w, "w")])
    path = tmp_path / "ext.onnx"
    onnx.save_model(m, str(path), save_as_external_data=True, location="ext.bin", size_threshold=0)
    assert (tmp_path / "ext.bin").exists()
    x = rng.standard_normal((2, 64)).astype(np.float32)
    (y,) = connx.InferenceSession(str(path)).run(None, {"x": x})
    np.testing.assert_allclose(y, x @ w, rtol=1e-4, atol=1e-5)
