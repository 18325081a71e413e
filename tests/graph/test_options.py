"""One frozen CompileOptions from every entry point to the graph compiler and the scheduler, part of the
kernel-cache key; one driver (cuvil.graph.driver.ModelCompiler) for the session, ``cuvil bench`` and
``cuvil compile``."""

from __future__ import annotations

import numpy as np
import pytest
import toolchain

onnx = toolchain.module("onnx")
ort = toolchain.module("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402

import cuvil.graph.compile as gc  # noqa: E402
from cuvil.cli import main  # noqa: E402
from cuvil.errors import ArgumentError  # noqa: E402
from cuvil.frontend.onnx import import_model  # noqa: E402
from cuvil.graph.driver import ModelCompiler  # noqa: E402
from cuvil.onnx import InferenceSession  # noqa: E402
from cuvil.options import CompileOptions  # noqa: E402
from cuvil.schedule.heuristics import Heuristics  # noqa: E402
from cuvil.target import Target  # noqa: E402


def _matmul_model(tmp_path=None):
    w = helper.make_tensor("w", TensorProto.FLOAT, [64, 48], np.linspace(-1, 1, 64 * 48, dtype=np.float32))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 48])], initializer=[w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    if tmp_path is None:
        return model
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    return path


def _reshape_by_input_model():
    """y = reshape(x, shape): the value of the input ``shape`` decides the output's shape."""
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("Relu", ["r"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6]),
                                       helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_options_are_checked_with_cuvil_errors():
    with pytest.raises(ArgumentError, match="precision must be one of 'fp32', 'bf16'"):
        CompileOptions(precision="fp16")
    with pytest.raises(ArgumentError, match="target must be a target string"):
        CompileOptions(target=3)
    with pytest.raises(ArgumentError, match="winograd must be a bool"):
        CompileOptions(winograd="no")
    with pytest.raises(ArgumentError, match="tuning_db must be a path"):
        CompileOptions(tuning_db=3.5)
    with pytest.raises(ArgumentError, match="unknown compile option"):
        CompileOptions.of(None, winogard=False)
    with pytest.raises(ArgumentError, match="unknown threshold"):
        CompileOptions().with_heuristics(tall_rows=3)


def test_options_are_frozen_and_fill_in_the_targets_thresholds():
    opts = CompileOptions(target="llvm -mcpu=x86-64-v3")
    with pytest.raises(AttributeError):
        opts.winograd = False  # type: ignore[misc]
    assert opts.resolved().heuristics == Heuristics.for_target(opts.target)
    assert CompileOptions.of(opts, precision=None) is opts  # None: not given
    assert CompileOptions.of("llvm").target == "llvm"
    assert CompileOptions(target=Target("llvm")).target == Target("llvm").canonical
    assert "heuristics=Heuristics(parallel_min_work=" in str(opts)


def test_the_key_changes_with_every_setting_that_changes_code():
    base = CompileOptions()
    keys = {base.key(), base.replace(winograd=False).key(), base.replace(bounds_checks=False).key(),
            base.with_heuristics(wide_row=64).key(), base.replace(target="llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a53").key()}
    assert len(keys) == 5
    assert base.replace(fuse=False).key() == base.key()  # a kernel is the same kernel with or without fusion


def test_a_threshold_is_part_of_the_kernel_key(tmp_path):
    graph = gc.prepare(import_model(str(_matmul_model(tmp_path))))
    keys = []
    for opts in (CompileOptions(), CompileOptions().with_heuristics(parallel_min_work=1)):
        seen: list = []
        gc.compile_graph(graph, {"x": (8, 64)}, {}, opts, on_kernel=lambda key, args, label, seen=seen: seen.append(key))
        keys.append(seen)
    assert len(keys[0]) == len(keys[1]) == 1 and keys[0] != keys[1]


def test_the_session_takes_options_and_keywords_replace_them():
    model = _matmul_model()
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    opts = CompileOptions(bounds_checks=False, winograd=False)
    sess = InferenceSession(model.SerializeToString(), options=opts)
    assert sess.options.bounds_checks is False and sess.options.winograd is False and not sess.bounds_checks
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], ref, rtol=1e-5, atol=1e-5)
    sess2 = InferenceSession(model.SerializeToString(), options=opts, bounds_checks=True)
    assert sess2.bounds_checks is True and sess2.options.winograd is False
    with pytest.raises(ArgumentError, match="options must be a cuvil.options.CompileOptions"):
        InferenceSession(model.SerializeToString(), options={"winograd": False})


def test_the_driver_specialises_on_an_input_that_decides_a_shape():
    mc = ModelCompiler(import_model(_reshape_by_input_model()), CompileOptions())
    assert mc.program({"x": (2, 6), "shape": (2,)}) is None  # needs the value of "shape"
    assert mc.specialised == {"shape"}
    x = np.arange(12, dtype=np.float32).reshape(2, 6) - 6
    for shape in ([3, 4], [4, 3]):
        feeds = {"x": x, "shape": np.array(shape, np.int64)}
        prog = mc.for_feeds(feeds)
        y = prog.run(feeds)["y"]
        np.testing.assert_array_equal(y, np.maximum(x.reshape(shape), 0))
    assert len(mc.programs()) == 2 and mc.for_feeds(feeds) is prog  # cached by the value


def test_compile_to_a_library_compiles_the_model_once(tmp_path, monkeypatch, capsys):
    path = _matmul_model(tmp_path)
    calls = []
    real = gc.compile_graph

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(gc, "compile_graph", counting)
    assert main(["compile", str(path), "-o", str(tmp_path / "m.so")]) == 0
    assert len(calls) == 1, capsys.readouterr().out
    assert (tmp_path / "m.so").exists() and (tmp_path / "m.h").exists()


def test_the_cli_builds_options_from_its_flags(tmp_path, capsys):
    path = _matmul_model(tmp_path)
    assert main(["compile", str(path), "--dump", "--no-winograd", "--threshold", "parallel_min_work=1",
                 "--threshold", "pack_gain=1.5"]) == 0
    out = capsys.readouterr().out
    assert "winograd=False" in out and "parallel_min_work=1," in out and "pack_gain=1.5" in out
    assert main(["compile", str(path), "--threshold", "no_such=1"]) == 1
    assert "unknown threshold(s): no_such" in capsys.readouterr().err
