"""``cuvil compile`` (with ``--dump``), ``cuvil run`` and ``cuvil bench`` on a small ONNX model, compared
with onnxruntime."""

from __future__ import annotations

import re

import numpy as np
import pytest
import toolchain

onnx = toolchain.module("onnx")
ort = toolchain.module("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402

from cuvil.cli import main  # noqa: E402


@pytest.fixture
def model_path(tmp_path):
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 3], np.linspace(-1, 1, 12, dtype=np.float32))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h0"]), helper.make_node("Identity", ["h0"], ["h"]),
             helper.make_node("Sigmoid", ["h"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])], initializer=[w])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_compile_writes_llvm_ir(model_path, tmp_path, capsys):
    out = tmp_path / "m.ll"
    assert main(["compile", str(model_path), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"3 nodes \(2 after the graph passes\) -> [12] kernel calls", text), text
    assert "symbolic dimensions set to 1" in text and "memory plan:" in text
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


def test_compile_dump_shows_each_pass_and_the_calls(model_path, capsys):
    assert main(["compile", str(model_path), "--dump"]) == 0
    text = capsys.readouterr().out
    imported, after = text.split("== after remove identities")
    assert "h = Identity(h0)" in imported and "Identity" not in after.split("== after")[0]
    assert "== after dead nodes" in text and "(unchanged)" in text
    groups = text.split("== fusion groups (one kernel each)")[1].split("== kernel calls")[0]
    assert "MatMul" in groups and "Sigmoid" in groups
    calls = text.split("== kernel calls")[1]
    assert re.search(r"k0: \S*MatMul", calls) and "input 'x'" in calls and "constant" in calls
    assert "outputs: y = %" in calls and "func k0(" not in text
    assert main(["compile", str(model_path), "--dump", "loops"]) == 0
    assert "== kernel k0\nfunc k0(" in capsys.readouterr().out


def test_bench_a_model_beside_onnxruntime(model_path, capsys):
    assert main(["bench", str(model_path), "--threads", "1", "--rounds", "1", "--profile", "2"]) == 0
    out = capsys.readouterr().out
    assert "m at 1 thread(s):" in out and "by op: " in out  # --profile: the slowest kernel calls
    row = next(line for line in out.splitlines() if line.startswith("m "))
    cold, warm, here = re.findall(r"(\d+\.\d)s", row)[:3]
    assert float(cold) > 0 and float(warm) > 0 and float(here) >= 0
    assert re.search(r"\d+\.\d+ms +\d+\.\d+ms +\d+\.\d+ +0 +ok", row), row  # ... ratio, fallbacks, check


def test_bench_with_a_tuning_database_times_the_untuned_compilation_beside_it(model_path, tmp_path, capsys):
    from cuvil.autotune import Database

    db = tmp_path / "t.db"
    Database(str(db)).close()  # no records: both compilations are the untuned one, and both must agree with ort
    assert main(["bench", str(model_path), "--threads", "1", "--rounds", "1", "--no-cold", "--tuning-db",
                 str(db)]) == 0
    out = capsys.readouterr().out
    assert "tuning database" in out and "untuned" in out
    row = next(line for line in out.splitlines() if line.startswith("m "))
    assert re.search(r"\d+\.\d+ms +\d+\.\d+ms +\d+\.\d+ +\d+\.\d+ms +0 +ok", row), row


def test_bench_reports_an_unknown_model(capsys):
    assert main(["bench", "no_such_model", "--threads", "1", "--no-cold"]) == 1
    assert "no_such_model" in capsys.readouterr().out


def test_a_second_compile_comes_from_the_kernel_cache(model_path, tmp_path, monkeypatch, capsys):
    """Lowered kernels (.pkl) and the linked module's machine code (.o) are cached on disk; a second
    compile in a process that has not seen the model (in-memory kernels dropped) adds no entry."""
    import cuvil.graph.compile as fo

    cache = tmp_path / "kcache"
    monkeypatch.setenv("CUVIL_CACHE_DIR", str(cache))
    fo.clear_kernels()
    assert main(["compile", str(model_path), "-o", str(tmp_path / "a.ll")]) == 0
    entries = sorted(p.name for p in cache.rglob("*") if p.is_file())
    assert any(e.endswith(".pkl") for e in entries) and any(e.endswith(".o") for e in entries)
    fo.clear_kernels()
    assert main(["compile", str(model_path), "-o", str(tmp_path / "b.ll")]) == 0
    assert sorted(p.name for p in cache.rglob("*") if p.is_file()) == entries

    def ir(name: str) -> list[str]:  # the IR parsed back from cached bitcode names no module id
        return [x for x in (tmp_path / name).read_text().splitlines() if not x.startswith("; ModuleID")]

    assert ir("a.ll") == ir("b.ll")
    capsys.readouterr()


def test_compile_to_a_shared_library_for_two_batch_sizes(model_path, tmp_path, capsys):
    from cuvil.runtime import load

    out = tmp_path / "m.so"
    assert main(["compile", str(model_path), "-o", str(out), "--shapes", "x=2,4", "--shapes", "x=5,4"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out and (tmp_path / "m.h").exists()
    lib = load(str(out))
    sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    for n in (2, 5):
        x = np.linspace(-2, 2, n * 4, dtype=np.float32).reshape(n, 4)
        np.testing.assert_allclose(lib.run(None, {"x": x})[0], sess.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)
    assert main(["compile", str(model_path), "-o", str(out), "--shapes", "x=2,zero"]) != 0
    assert "--shapes 'x=2,zero'" in capsys.readouterr().err
