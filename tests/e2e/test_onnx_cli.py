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
    assert re.search(r"k[0-9a-f]{12}: \S*MatMul", calls) and "input 'x'" in calls and "constant" in calls
    assert "outputs: y = %" in calls and "func k" not in text
    assert main(["compile", str(model_path), "--dump", "loops"]) == 0
    assert re.search(r"== kernel (k[0-9a-f]{12})\nfunc \1\(", capsys.readouterr().out)


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


# -- issue 17: --shapes everywhere, CLI errors, run --random and its summary, compile without -o, demo --------


@pytest.fixture
def embedding_path(tmp_path):
    """y = E[ids] * mask: int32 token ids through a Cast into a 10-row embedding, an int64 mask."""
    E = helper.make_tensor("E", TensorProto.FLOAT, [10, 4], np.arange(40, dtype=np.float32))
    nodes = [helper.make_node("Cast", ["ids"], ["ids64"], to=TensorProto.INT64),
             helper.make_node("Gather", ["E", "ids64"], ["e"]),
             helper.make_node("Cast", ["mask"], ["mf"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["mf", "ax"], ["mf2"]), helper.make_node("Mul", ["e", "mf2"], ["y"])]
    g = helper.make_graph(nodes, "emb", [helper.make_tensor_value_info("ids", TensorProto.INT32, ["b", "s"]),
                                         helper.make_tensor_value_info("mask", TensorProto.INT64, ["b", "s"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", 4])],
                          initializer=[E, helper.make_tensor("ax", TensorProto.INT64, [1], [2])])
    path = tmp_path / "emb.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_compile_without_output_says_it_only_compiled(model_path, tmp_path, capsys):
    assert main(["compile", str(model_path)]) == 0
    out = capsys.readouterr().out
    assert "compiled only: nothing written" in out and "-o model.so" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_a_library_of_a_symbolic_model_asks_for_shapes_on_the_command_line(model_path, tmp_path, capsys):
    assert main(["compile", str(model_path), "-o", str(tmp_path / "x.so")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cuvil: error: ") and len(err.strip().splitlines()) == 1, err
    assert "pass --shapes name=d0,d1,..." in err and "--shapes x=1,4" in err and "export_library" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_shapes_of_several_inputs_in_one_flag(embedding_path, tmp_path, capsys):
    from cuvil.runtime import load

    out = tmp_path / "emb.so"
    assert main(["compile", str(embedding_path), "--shapes", "ids=2,5", "mask=2,5", "-o", str(out)]) == 0
    ids = np.array([[1, 2, 3, 4, 9], [0, 0, 1, 1, 2]], np.int32)
    mask = np.ones((2, 5), np.int64)
    (y,) = load(str(out)).run(None, {"ids": ids, "mask": mask})
    np.testing.assert_array_equal(y, np.arange(40, dtype=np.float32).reshape(10, 4)[ids])
    capsys.readouterr()


@pytest.mark.parametrize("argv,words", [
    (["--shapes", "nope=1,4"], ["'nope', not an input of the model", "x ['n', 4]"]),
    (["--shapes", "x=2,5"], ["dimension 1 must be 4"]),
    (["--shapes", "x=2"], ["rank 1"]),
    (["--shapes", "x=2,zero"], ["--shapes 'x=2,zero'"]),
])
def test_shapes_mistakes_are_one_line_errors(model_path, argv, words, capsys):
    assert main(["compile", str(model_path), *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cuvil: error: ") and "Traceback" not in err, err
    for w in words:
        assert w in err, err


def test_run_random_makes_inputs_of_the_right_kind_and_prints_a_summary(embedding_path, capsys):
    assert main(["run", str(embedding_path), "--random", "--shapes", "ids=2,5"]) == 0
    out = capsys.readouterr().out
    assert "input ids: random int32[2, 5], uniform in 0..9 (it indexes a table of 10 rows)" in out
    assert "input mask: random int64[2, 5], 0 or 1" in out
    assert re.search(r"y: float32\[2, 5, 4\]  min \S+  max \S+  mean \S+  values \[", out), out


def test_random_feeds_index_within_the_table():
    from cuvil.frontend.onnx import import_model
    from cuvil.graph.feeds import index_rows, random_feeds

    g = helper.make_graph([helper.make_node("Gather", ["E", "ids"], ["e"]),
                           helper.make_node("Gather", ["F", "ids"], ["f"], axis=1),
                           helper.make_node("Not", ["flag"], ["nf"])], "g",
                          [helper.make_tensor_value_info("ids", TensorProto.INT64, [3, 100]),
                           helper.make_tensor_value_info("flag", TensorProto.BOOL, [4]),
                           helper.make_tensor_value_info("h", TensorProto.FLOAT16, [2])],
                          [helper.make_tensor_value_info(n, t, None) for n, t in
                           (("e", TensorProto.FLOAT), ("f", TensorProto.FLOAT), ("nf", TensorProto.BOOL))],
                          initializer=[helper.make_tensor("E", TensorProto.FLOAT, [50, 2], np.zeros(100)),
                                       helper.make_tensor("F", TensorProto.FLOAT, [2, 7], np.zeros(14))])
    graph = import_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    assert index_rows(graph) == {"ids": 7}  # the smaller of the two tables it indexes (F along axis 1)
    feeds = random_feeds(graph, {"ids": (3, 100), "flag": (4,), "h": (2,)}, seed=1)
    assert feeds["ids"].dtype == np.int64 and feeds["ids"].min() >= 0 and feeds["ids"].max() == 6
    assert feeds["flag"].dtype == np.bool_ and feeds["h"].dtype == np.float16


def test_run_prints_the_summary_of_given_inputs_and_refuses_bad_ones(model_path, tmp_path, capsys):
    x = np.array([[0, 0, 0, 0], [1, 1, 1, 1]], np.float32)
    np.save(tmp_path / "x.npy", x)
    assert main(["run", str(model_path), "--input", f"x={tmp_path / 'x.npy'}"]) == 0
    out = capsys.readouterr().out
    assert "y: float32[2, 3]  min 0.32579  max 0.67421  mean 0.5  values [0.5, 0.5, 0.5, 0.32579, 0.5, 0.67421]" in out
    assert main(["run", str(model_path), "--input", f"x={tmp_path / 'x.npy'}", "--shapes", "x=3,4"]) == 1
    assert "but --shapes gives x=3,4" in capsys.readouterr().err
    assert main(["run", str(model_path), "--input", f"x={tmp_path / 'nope.npy'}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cuvil: error: --input") and "cannot read" in err
    assert main(["run", str(model_path), "--input", f"z={tmp_path / 'x.npy'}"]) == 1
    assert "'z' is not an input of the model" in capsys.readouterr().err


def test_run_summary_of_special_values():
    from cuvil.cli.run import summary

    line = summary("y", np.array([np.nan, 1.0, -np.inf, 3.0], np.float32))
    assert "min 1  max 3" in line and "nan 1" in line and "inf 1" in line
    assert summary("b", np.array([True, False, True])).startswith("b: bool[3]  true 2 of 3")
    assert summary("e", np.zeros((0, 3), np.int64)) == "e: int64[0, 3]  (empty)"


def test_bench_takes_shapes(model_path, capsys):
    assert main(["bench", str(model_path), "--shapes", "x=3,4", "--threads", "1", "--rounds", "1", "--no-cold"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("m "))
    assert row.rstrip().endswith(")") and "ok" in row, row


def test_an_internal_error_is_one_line_and_traceback_shows_it(model_path, monkeypatch, capsys):
    import cuvil.cli.compile as cli_compile

    def boom(args):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cli_compile, "compile_cmd", boom)
    assert main(["compile", str(model_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cuvil: error: internal error: ZeroDivisionError: a bug") and "--traceback" in err
    with pytest.raises(ZeroDivisionError):
        main(["--traceback", "compile", str(model_path)])


@pytest.mark.slow
def test_demo_shows_the_auto_scheduler_beside_numpy_and_onnxruntime(capsys):
    assert main(["demo", "--size", "64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("cuvil ") and "target: " in lines[0] and len(lines[0]) < 120
    assert "auto_schedule" in lines[1]
    rows = [ln for ln in lines if ln.startswith(("matmul 64x64x64", "conv2d "))]
    assert len(rows) == 2 and all(len(re.findall(r"\d+\.\d\dms", r)) == 3 for r in rows), lines
    assert lines[-1] == "results match numpy and onnxruntime"
