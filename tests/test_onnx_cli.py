"""``cuvil compile`` and ``cuvil run`` on a small ONNX model, compared with onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402

from cuvil.cli import main  # noqa: E402


@pytest.fixture
def model_path(tmp_path):
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 3], np.linspace(-1, 1, 12, dtype=np.float32))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Sigmoid", ["h"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])], initializer=[w])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_compile_writes_llvm_ir(model_path, tmp_path, capsys):
    out = tmp_path / "m.ll"
    assert main(["compile", str(model_path), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 nodes -> 2 kernel calls" in text and "symbolic dimensions set to 1" in text
    ir = out.read_text()
    assert "define" in ir and "@graph(" in ir and "@graph_set_num_threads(" in ir


def test_run_saves_outputs_matching_onnxruntime(model_path, tmp_path):
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    assert main(["run", str(model_path), "--input", f"x={tmp_path / 'x.npy'}", "-o", str(tmp_path / "o.npz")]) == 0
    y = np.load(tmp_path / "o.npz")["y"]
    ref = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)


def test_run_reports_a_missing_input(model_path, capsys):
    assert main(["run", str(model_path)]) == 1
    assert "missing input(s) 'x'" in capsys.readouterr().err
