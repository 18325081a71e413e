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
    (prog,) = s.programs()
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
    assert len(s.programs()) == 2  # one compilation per distinct value


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


# -- issue 17: SessionOptions, get_modelmeta, get_providers, run(outputs=), the errors exported ---------------


def _conv_bn_relu():
    """Conv -> BatchNormalization -> Relu -> Identity -> two outputs: what the optimisation levels differ on."""
    rng = np.random.default_rng(1)
    arr = onnx.numpy_helper.from_array
    inits = [arr(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
             arr(rng.standard_normal(4).astype(np.float32), "scale"), arr(rng.standard_normal(4).astype(np.float32), "bias"),
             arr(rng.standard_normal(4).astype(np.float32), "mean"), arr(rng.random(4).astype(np.float32) + 0.5, "var")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["bn"]),
             helper.make_node("Relu", ["bn"], ["r"]), helper.make_node("Identity", ["r"], ["y"]),
             helper.make_node("ReduceSum", ["r"], ["s"], keepdims=0)]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8]),
                   helper.make_tensor_value_info("s", TensorProto.FLOAT, [])], inits)


def test_errors_are_importable_from_cuvil_onnx():
    for name in ("CuvilError", "ModelError", "ShapeError", "DTypeError", "UnsupportedOpError", "ArgumentError",
                 "TargetError", "ScheduleError", "IslBudgetError"):
        assert getattr(connx, name) is getattr(cuvil, name)
    assert connx.ModelError is ModelError and issubclass(connx.ModelError, connx.CuvilError)


@pytest.mark.parametrize("level", ["ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL"])
def test_graph_optimization_levels_agree_with_onnxruntime(level):
    m = _conv_bn_relu()
    x = np.random.default_rng(2).standard_normal((1, 3, 8, 8)).astype(np.float32)
    ref = _ort(m, {"x": x})
    for opts in (connx.SessionOptions(), ort.SessionOptions()):  # onnxruntime's own options are read too
        opts.graph_optimization_level = getattr(type(opts.graph_optimization_level), level, None) or \
            getattr(connx.GraphOptimizationLevel, level)
        s = connx.InferenceSession(m, opts)
        for got, want in zip(s.run(None, {"x": x}), ref):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        (prog,) = s.programs()
        ops = {label.split(" ")[0] for label in prog.labels}
        if level == "ORT_DISABLE_ALL":
            assert "BatchNormalization" in ops and not any("+" in o for o in ops), ops  # no folding, no fusion
        elif level == "ORT_ENABLE_BASIC":
            assert "BatchNormalization" not in ops and not any("+" in o for o in ops), ops
        else:
            assert any("+" in o for o in ops), ops  # fused: Conv+Relu


def test_session_options_threads_and_mistakes():
    opts = connx.SessionOptions()
    opts.intra_op_num_threads = 1
    assert connx.InferenceSession(_mlp(), opts).num_threads == 1
    assert connx.InferenceSession(_mlp(), opts, num_threads=1).num_threads == 1
    with pytest.raises(cuvil.ArgumentError, match="disagree"):
        connx.InferenceSession(_mlp(), opts, num_threads=2)
    assert connx.InferenceSession(_mlp(), connx.SessionOptions()).num_threads is None
    with pytest.raises(AttributeError):
        opts.intra_op_threads = 2  # a misspelt field is not silently ignored
    opts.graph_optimization_level = 7
    with pytest.raises(cuvil.ArgumentError, match="graph_optimization_level 7"):
        connx.InferenceSession(_mlp(), opts)
    s = connx.InferenceSession(_mlp(), num_threads=1)
    assert s.get_session_options().intra_op_num_threads == 1


def test_profiling_records_each_run_and_kernel_call(tmp_path, monkeypatch):
    import json

    monkeypatch.chdir(tmp_path)
    opts = connx.SessionOptions()
    opts.enable_profiling = True
    opts.profile_file_prefix = "prof"
    m = _conv_bn_relu()
    s = connx.InferenceSession(m, opts)
    x = np.random.default_rng(3).standard_normal((1, 3, 8, 8)).astype(np.float32)
    for _ in range(2):
        for got, want in zip(s.run(None, {"x": x}), _ort(m, {"x": x})):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    path = s.end_profiling()
    assert path.startswith("prof_") and path.endswith(".json")
    events = json.loads((tmp_path / path).read_text())
    (prog,) = s.programs()
    runs = [e for e in events if e["cat"] == "Session"]
    calls = [e for e in events if e["cat"] == "Node"]
    assert len(runs) == 2 and len(calls) == 2 * prog.n_calls
    assert all(e["ph"] == "X" and e["dur"] >= 0 and e["name"].endswith("_kernel_time") for e in calls)
    assert {e["args"]["op_name"] for e in calls} == {label.split(" ")[0] for label in prog.labels}
    assert runs[0]["ts"] <= calls[0]["ts"] and calls[0]["ts"] + calls[0]["dur"] <= runs[0]["ts"] + runs[0]["dur"] + 1
    assert s.end_profiling() == ""  # profiling ended; a session without it returns "" as onnxruntime does
    assert connx.InferenceSession(m).end_profiling() == ""


def test_modelmeta_and_providers():
    m = _mlp()
    m.producer_name, m.domain, m.model_version, m.doc_string = "pytorch", "ai.example", 7, "an mlp"
    m.graph.doc_string = "its graph"
    onnx.helper.set_model_props(m, {"author": "me", "license": "MIT"})
    s = connx.InferenceSession(m)
    meta = s.get_modelmeta()
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).get_modelmeta()
    for field in ("producer_name", "graph_name", "domain", "description", "graph_description", "version",
                  "custom_metadata_map"):
        assert getattr(meta, field) == getattr(want, field), field
    assert meta.custom_metadata_map == {"author": "me", "license": "MIT"} and meta.graph_name == "g"
    assert s.get_providers() == ["CPUExecutionProvider"]
    assert s.get_provider_options()["CPUExecutionProvider"]["target"] == cuvil.Target("llvm").canonical


def test_run_into_caller_owned_outputs():
    m = _conv_bn_relu()
    s = connx.InferenceSession(m)
    x = np.random.default_rng(5).standard_normal((1, 3, 8, 8)).astype(np.float32)
    ref = s.run(None, {"x": x})
    y, total = np.full((1, 4, 8, 8), np.nan, np.float32), np.full((), np.nan, np.float32)
    got = s.run(None, {"x": x}, outputs=[y, total])
    assert got[0] is y and got[1] is total
    np.testing.assert_array_equal(y, ref[0])
    np.testing.assert_array_equal(total, ref[1])
    y2 = np.zeros_like(y)
    (only,) = s.run(["y"], {"x": x}, outputs={"y": y2})
    assert only is y2 and np.array_equal(y2, ref[0])
    got = s.run(None, {"x": x}, outputs={"s": total})  # some outputs in the caller's buffers, the rest new
    assert got[1] is total and np.array_equal(got[0], ref[0])


@pytest.mark.parametrize("bad,err,text", [
    ([np.zeros((1, 4, 8, 7), np.float32), np.zeros((), np.float32)], cuvil.ShapeError, "has shape [1, 4, 8, 8]"),
    ([np.zeros((1, 4, 8, 8), np.float64), np.zeros((), np.float32)], cuvil.DTypeError, "is float32, the buffer is "
                                                                                        "float64"),
    ([np.zeros((1, 4, 8, 16), np.float32)[..., ::2], np.zeros((), np.float32)], cuvil.ArgumentError,
     "C-contiguous"),
    ([np.zeros((1, 4, 8, 8), np.float32)], cuvil.ArgumentError, "1 buffer(s) for 2 output(s)"),
    ({"z": np.zeros(3, np.float32)}, cuvil.ArgumentError, "names 'z'"),
    ("y", cuvil.ArgumentError, "must be a list"),
])
def test_caller_owned_outputs_that_do_not_fit(bad, err, text):
    s = connx.InferenceSession(_conv_bn_relu())
    x = np.zeros((1, 3, 8, 8), np.float32)
    with pytest.raises(err) as info:
        s.run(None, {"x": x}, outputs=bad)
    assert text in str(info.value)


def test_caller_owned_outputs_must_be_writeable_and_apart():
    s = connx.InferenceSession(_mlp())
    x = np.ones((2, 8), np.float32)
    ro = np.zeros((2, 4), np.float32)
    ro.flags.writeable = False
    with pytest.raises(cuvil.ArgumentError, match="writeable"):
        s.run(None, {"x": x}, outputs=[ro])
    big = np.zeros(16, np.float32)
    with pytest.raises(cuvil.ArgumentError, match="shares memory with input 'x'"):
        s.run(None, {"x": big.reshape(2, 8)}, outputs=[big[:8].reshape(2, 4)])
