"""InferenceSession.export_library: one .so with a C entry point, run from C (docs/examples/run_model.c,
compiled with gcc) and from cuvil.runtime.load (no islpy, no llvmlite), checked against onnxruntime."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from toolchain import module, require

onnx = module("onnx")
ort = module("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402

import cuvil  # noqa: E402
import cuvil.onnx as connx  # noqa: E402
from cuvil.models.zoo import mlp, resnet_block_model  # noqa: E402
from cuvil.runtime import load  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "docs", "examples", "run_model.c")
RTOL, ATOL = 1e-3, 1e-4


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _model(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    """The ResNet-style block (symbolic batch) exported for batch 2 as model.so, and the C example built on it."""
    gcc = require("gcc", "apt-get install gcc")
    d = tmp_path_factory.mktemp("resnet")
    m = resnet_block_model(16)
    lib = connx.InferenceSession(m).export_library(d / "model.so", input_shapes={"x": (2, 3, 16, 16)})
    exe = d / "run_model"
    subprocess.run([gcc, "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(exe), EXAMPLE, f"-I{d}", f"-L{d}",
                    "-l:model.so", "-Wl,-rpath,$ORIGIN"], check=True, capture_output=True, text=True)
    return m, d, lib, exe


def test_c_example_matches_onnxruntime_and_load(resnet):
    m, d, lib, exe = resnet
    x = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)
    x.tofile(d / "x.bin")
    proc = subprocess.run([str(exe), "--threads", "2", "--runs", "3", "--out", str(d), str(d / "x.bin")],
                          capture_output=True, text=True, cwd=d)
    assert proc.returncode == 0, proc.stderr
    assert "output logits: float32, 20 elements:" in proc.stdout and "latency:" in proc.stdout
    from_c = np.fromfile(d / "output0.bin", np.float32).reshape(2, 10)
    (ref,) = _ort(m, {"x": x})
    np.testing.assert_allclose(from_c, ref, rtol=RTOL, atol=ATOL)
    loaded = load(lib)
    (y,) = loaded.run(None, {"x": x})
    np.testing.assert_allclose(y, ref, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(y, from_c)  # the same machine code


def test_header_documents_the_interface(resnet):
    _, d, lib, _ = resnet
    h = (d / "model.h").read_text()
    assert "int32_t model_run(const float *x, float *logits);" in h
    assert "input [0] x      float[2, 3, 16, 16]" in h and "output[0] logits float[2, 10]" in h
    for text in ("#define MODEL_OK 0", "#define MODEL_ERR_NO_MEMORY 1", "#define MODEL_ERR_NULL_POINTER 2",
                 "void model_set_num_threads(int32_t n);", "int64_t model_workspace_size(void);",
                 "#define MODEL_INPUT_X_SHAPE {2, 3, 16, 16}", "Needs at run time: libc"):
        assert text in h, text
    # a library of one fixed signature (ABI 1) has no sizes: no size arguments, no status 3
    assert "int64_t N" not in h and "ERR_NO_SIGNATURE" not in h and "SIZE" not in h
    assert load(lib).meta["abi"] == 1 and "sizes" not in load(lib).meta
    # every symbol the library imports is named in the header
    nm = subprocess.run(["nm", "-D", str(lib)], capture_output=True, text=True, check=True).stdout
    imported = {line.split()[1].split("@")[0] for line in nm.splitlines() if line.split()[0] == "U"}
    listed = set(re.search(r"Symbols it imports: ([^\n]*)", h).group(1).replace(",", " ").split())
    assert imported <= listed | {"memcpy", "memset"}, imported - listed
    assert ("libgomp" in h) == ("GOMP_parallel" in imported)
    # only prefixed symbols (and the loader's index) are exported
    defined = {line.split()[2] for line in nm.splitlines() if len(line.split()) == 3 and line.split()[1] == "T"}
    assert defined == {"model_run", "model_run_array", "model_workspace_size", "model_set_num_threads",
                       "model_meta", "model_last_error", "cuvil_module_meta"}


def test_load_needs_neither_islpy_nor_llvmlite(resnet, tmp_path):
    m, _, lib, _ = resnet
    x = np.random.default_rng(1).standard_normal((2, 3, 16, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        import cuvil, cuvil.runtime
        m = cuvil.runtime.load({str(lib)!r})
        assert [(i.name, i.shape, i.type) for i in m.get_inputs()] == [("x", [2, 3, 16, 16], "tensor(float)")]
        assert [(o.name, o.shape, o.type) for o in m.get_outputs()] == [("logits", [2, 10], "tensor(float)")]
        (y,) = m.run(["logits"], {{"x": np.load({str(tmp_path / "x.npy")!r})}})
        cuvil.set_num_threads(1)
        (y1,) = m.run(None, {{"x": np.load({str(tmp_path / "x.npy")!r})}})
        np.save({str(tmp_path / "y.npy")!r}, y)
        np.testing.assert_allclose(y1, y, rtol=1e-5, atol=1e-6)
        bad = sorted(n for n in sys.modules if n.split(".")[0] in ("islpy", "llvmlite", "onnx"))
        assert not bad, bad
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), _ort(m, {"x": x})[0], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("feeds, err, text", [
    ({}, cuvil.ArgumentError, "missing input(s) 'x'"),
    ({"x": np.ones((2, 3, 16, 16), np.float32), "z": np.ones(1)}, cuvil.ArgumentError, "unknown input(s) 'z'"),
    ({"x": np.ones((2, 3, 16, 16), np.float64)}, cuvil.DTypeError, "input 'x': expected tensor(float)"),
    ({"x": np.ones((1, 3, 16, 16), np.float32)}, cuvil.ShapeError, "compiled for shape [2, 3, 16, 16], got [1,"),
    ({"x": [[1.0]]}, cuvil.ArgumentError, "input 'x': expected a numpy array"),
    ([1], cuvil.ArgumentError, "the feeds must be a dict"),
])
def test_loaded_model_validates_feeds(resnet, feeds, err, text):
    with pytest.raises(err) as e:
        load(resnet[2]).run(None, feeds)
    assert text in str(e.value)


def test_unknown_output_and_null_pointer_status(resnet):
    import ctypes

    m = load(resnet[2])
    with pytest.raises(cuvil.ArgumentError, match="'y' is not an output of the model; outputs: logits"):
        m.run(["y"], {"x": np.ones((2, 3, 16, 16), np.float32)})
    from cuvil.runtime import LoadedModule

    with pytest.raises(cuvil.ArgumentError, match="holds a whole model, not functions"):
        LoadedModule(str(resnet[2]))
    with pytest.raises(cuvil.ArgumentError, match="load it without name="):
        load(resnet[2], name="model_run")
    lib = ctypes.CDLL(str(resnet[2]))
    ptrs = (ctypes.c_void_p * 1)(None)
    assert lib.model_run_array(ptrs, ptrs, None) == 2  # MODEL_ERR_NULL_POINTER
    assert lib.model_workspace_size() == m.meta["workspace_bytes"] > 0


def test_non_contiguous_feed_is_accepted(resnet):
    m = load(resnet[2])
    x = np.asfortranarray(np.random.default_rng(2).standard_normal((2, 3, 16, 16)).astype(np.float32))
    np.testing.assert_allclose(m.run(None, {"x": x})[0], _ort(resnet[0], {"x": x})[0], rtol=RTOL, atol=ATOL)


def test_two_models_in_one_process_and_one_executable(tmp_path):
    """Two exports (prefixes from their file names) load side by side, from Python and linked into one C program."""
    gcc = require("gcc", "apt-get install gcc")
    a, b = mlp(64, (256, 64, 16), seed=3), mlp(64, (256, 1024, 10), seed=4)  # b's kernels call malloc
    la = connx.InferenceSession(a).export_library(tmp_path / "mlp_a.so")
    lb = connx.InferenceSession(b).export_library(tmp_path / "mlp-b.so")
    assert "int32_t mlp_b_run(const float *x, float *logits);" in (tmp_path / "mlp-b.h").read_text()
    nm = subprocess.run(["nm", "-D", str(lb)], capture_output=True, text=True, check=True).stdout
    assert re.search(r"U malloc", nm), nm
    x = np.random.default_rng(5).standard_normal((64, 256)).astype(np.float32)
    ya, yb = load(la).run(None, {"x": x})[0], load(lb).run(None, {"x": x})[0]
    np.testing.assert_allclose(ya, _ort(a, {"x": x})[0], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(yb, _ort(b, {"x": x})[0], rtol=RTOL, atol=ATOL)
    x.tofile(tmp_path / "x.bin")
    (tmp_path / "both.c").write_text(textwrap.dedent("""
        #include <stdio.h>
        #include "mlp_a.h"
        #include "mlp-b.h"
        int main(void) {
            static float x[MLP_A_INPUT_X_ELEMENTS], ya[MLP_A_OUTPUT_LOGITS_ELEMENTS], yb[MLP_B_OUTPUT_LOGITS_ELEMENTS];
            FILE *f = fopen("x.bin", "rb");
            if (!f || fread(x, sizeof x, 1, f) != 1) return 3;
            fclose(f);
            mlp_a_set_num_threads(1);
            if (mlp_a_run(x, ya) != MLP_A_OK || mlp_b_run(x, yb) != MLP_B_OK) return 4;
            f = fopen("y.bin", "wb");
            fwrite(ya, sizeof ya, 1, f);
            fwrite(yb, sizeof yb, 1, f);
            fclose(f);
            return 0;
        }
    """))
    subprocess.run([gcc, "-Wall", "-Werror", "-o", "both", "both.c", "-I.", "-L.", "-l:mlp_a.so", "-l:mlp-b.so",
                    "-Wl,-rpath,$ORIGIN"], check=True, cwd=tmp_path, capture_output=True, text=True)
    proc = subprocess.run(["./both"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    y = np.fromfile(tmp_path / "y.bin", np.float32)
    np.testing.assert_array_equal(y[:ya.size], ya.ravel())
    np.testing.assert_array_equal(y[ya.size:], yb.ravel())


def test_outputs_known_at_compile_time_or_fed_through(tmp_path):
    """An output computed from constants only (copied from the weights), an input returned as it is (a
    copy kernel) and one value returned twice, beside a computed output."""
    rng = np.random.default_rng(6)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    nodes = [helper.make_node("Add", ["w", "w"], ["two_w"], name="const_add"),
             helper.make_node("Identity", ["x"], ["same"], name="ident"),
             helper.make_node("Mul", ["x", "w"], ["prod"], name="mul"),
             helper.make_node("Identity", ["prod"], ["prod_again"], name="again")]
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3, 4]) for n in ("two_w", "same", "prod",
                                                                               "prod_again")]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])], vi,
               [helper.make_tensor("w", TensorProto.FLOAT, [3, 4], w.ravel())])
    lib = connx.InferenceSession(m).export_library(tmp_path / "odd.so", prefix="odd")
    x = rng.standard_normal((3, 4)).astype(np.float32)
    got = load(lib).run(None, {"x": x})
    for g, r in zip(got, _ort(m, {"x": x})):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=0)


@pytest.mark.slow
def test_symbolic_shapes_need_input_shapes(tmp_path):
    s = connx.InferenceSession(resnet_block_model(16))
    with pytest.raises(cuvil.ShapeError, match=r"input 'x' has a symbolic shape \['batch', 3, 16, 16\] "
                                               r"\(dimension 0 \(batch\)\).*input_shapes=\{'x': \(1, 3, 16, 16\)\}\), "
                                               "or a list of such dicts to compile several sizes"):
        s.export_library(tmp_path / "m.so")
    for shapes, err, text in [
        ({"y": (1, 3, 16, 16)}, cuvil.ArgumentError, "unknown input(s) 'y'"),
        ({"x": (1, 3, 16)}, cuvil.ShapeError, "has rank 3; the model declares ['batch', 3, 16, 16]"),
        ({"x": (1, 3, 16, 8)}, cuvil.ShapeError, "dimension 3 must be 16"),
        ({"x": (1, 3, 16, 16.0)}, cuvil.ShapeError, "must be a tuple of positive ints"),
        ({"x": (0, 3, 16, 16)}, cuvil.ShapeError, "must be a tuple of positive ints"),
        ([("x", (1, 3, 16, 16))], cuvil.ArgumentError, "input_shapes[0] must be a dict"),
        ("x", cuvil.ArgumentError, "input_shapes must be a dict {input name: shape} (or a list of them"),
    ]:
        with pytest.raises(err) as e:
            s.export_library(tmp_path / "m.so", input_shapes=shapes)
        assert text in str(e.value)
    with pytest.raises(cuvil.ArgumentError, match="prefix '9x' is not a C identifier"):
        s.export_library(tmp_path / "m.so", input_shapes={"x": (1, 3, 16, 16)}, prefix="9x")
    ran = connx.InferenceSession(resnet_block_model(16))
    x = np.ones((3, 3, 16, 16), np.float32)
    ran.run(None, {"x": x})  # the one signature the session ran with is the current one
    assert load(ran.export_library(tmp_path / "ran.so")).get_inputs()[0].shape == [3, 3, 16, 16]
    ran.run(None, {"x": x[:1]})
    with pytest.raises(cuvil.ShapeError, match=r"the session ran with 2 signatures \(\{'x': \(3, 3, 16, 16\)\}; "
                                               r"\{'x': \(1, 3, 16, 16\)\}\), so none is the current one"):
        ran.export_library(tmp_path / "m.so")
    with pytest.raises(cuvil.ArgumentError, match="the folder .* does not exist"):
        s.export_library(tmp_path / "no" / "m.so", input_shapes={"x": (1, 3, 16, 16)})
    assert not (tmp_path / "m.so").exists()


def test_symbols_shared_by_inputs_must_agree(tmp_path):
    nodes = [helper.make_node("Add", ["a", "b"], ["c"], name="add")]
    m = _model(nodes, [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", 4]) for n in "ab"],
               [helper.make_tensor_value_info("c", TensorProto.FLOAT, ["n", 4])])
    s = connx.InferenceSession(m)
    with pytest.raises(cuvil.ShapeError, match=r"input_shapes\['b'\]: dimension 0 \(n\) is 3, but n is 2 in input 'a'"):
        s.export_library(tmp_path / "add.so", input_shapes={"a": (2, 4), "b": (3, 4)})
    with pytest.raises(cuvil.ShapeError, match="input 'b' has a symbolic shape"):
        s.export_library(tmp_path / "add.so", input_shapes={"a": (2, 4)})
    lib = s.export_library(tmp_path / "add.so", input_shapes={"a": (2, 4), "b": (2, 4)})
    a, b = np.ones((2, 4), np.float32), np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(load(lib).run(None, {"a": a, "b": b})[0], a + b)


def test_cross_exported_model_runs_under_qemu(tmp_path):
    """A session for an AArch64 target compiles without running anything here; its library, linked by the
    cross compiler with the C example, runs under qemu-aarch64 and matches onnxruntime."""
    apt = "apt-get install -y gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user"
    cross = require("aarch64-linux-gnu-gcc", apt)
    qemu = require("qemu-aarch64", apt)
    m = resnet_block_model(16)
    s = connx.InferenceSession(m, target="llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a76 -mattr=+neon")
    x = np.random.default_rng(7).standard_normal((1, 3, 16, 16)).astype(np.float32)
    with pytest.raises(cuvil.TargetError, match="not this machine; export_library"):
        s.run(None, {"x": x})
    lib = s.export_library(tmp_path / "model.so", input_shapes={"x": (1, 3, 16, 16)})  # cc from the triple
    with pytest.raises(cuvil.TargetError, match="is a library for aarch64"):
        load(lib)
    subprocess.run([cross, "-O2", "-o", "run_model", EXAMPLE, "-I.", "-L.", "-l:model.so", "-Wl,-rpath,$ORIGIN"],
                   check=True, cwd=tmp_path, capture_output=True, text=True)
    x.tofile(tmp_path / "x.bin")
    proc = subprocess.run([qemu, "-L", "/usr/aarch64-linux-gnu", "./run_model", "--out", ".", "x.bin"],
                          cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    y = np.fromfile(tmp_path / "output0.bin", np.float32).reshape(1, 10)
    np.testing.assert_allclose(y, _ort(m, {"x": x})[0], rtol=RTOL, atol=ATOL)


def test_several_inputs_and_dtypes_through_the_c_example(tmp_path):
    """A float32 and an int64 input, two outputs: the generic C example reads one file per input."""
    gcc = require("gcc", "apt-get install gcc")
    nodes = [helper.make_node("Gather", ["table", "idx"], ["rows"], name="gather", axis=0),
             helper.make_node("Relu", ["table"], ["pos"], name="relu")]
    m = _model(nodes, [helper.make_tensor_value_info("table", TensorProto.FLOAT, [6, 4]),
                       helper.make_tensor_value_info("idx", TensorProto.INT64, [3])],
               [helper.make_tensor_value_info("rows", TensorProto.FLOAT, [3, 4]),
                helper.make_tensor_value_info("pos", TensorProto.FLOAT, [6, 4])])
    lib = connx.InferenceSession(m).export_library(tmp_path / "model.so")
    assert "int32_t model_run(const float *table, const int64_t *idx, float *rows, float *pos);" in \
        (tmp_path / "model.h").read_text()
    table = np.random.default_rng(8).standard_normal((6, 4)).astype(np.float32)
    idx = np.array([5, 0, 3], np.int64)
    table.tofile(tmp_path / "table.bin")
    idx.tofile(tmp_path / "idx.bin")
    subprocess.run([gcc, "-o", "run_model", EXAMPLE, "-I.", "-L.", "-l:model.so", "-Wl,-rpath,$ORIGIN"],
                   check=True, cwd=tmp_path, capture_output=True, text=True)
    proc = subprocess.run(["./run_model", "--out", ".", "table.bin", "idx.bin"], cwd=tmp_path, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    ref = _ort(m, {"table": table, "idx": idx})
    np.testing.assert_array_equal(np.fromfile(tmp_path / "output0.bin", np.float32).reshape(3, 4), ref[0])
    np.testing.assert_array_equal(np.fromfile(tmp_path / "output1.bin", np.float32).reshape(6, 4), ref[1])
    got = load(lib).run(["pos", "rows"], {"table": table, "idx": idx})
    np.testing.assert_array_equal(got[0], ref[1])
    np.testing.assert_array_equal(got[1], ref[0])
    with pytest.raises(cuvil.DTypeError, match=r"input 'idx': expected tensor\(int64\) \(int64\), got int32"):
        load(lib).run(None, {"table": table, "idx": idx.astype(np.int32)})


def test_a_shape_decided_by_an_input_value_cannot_be_exported(tmp_path):
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshape")]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6]),
                       helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    with pytest.raises(cuvil.ShapeError, match="the value of input\\(s\\) 'shape' decides a shape"):
        connx.InferenceSession(m).export_library(tmp_path / "r.so")


def test_tensor_names_that_are_not_c_identifiers(tmp_path):
    """Names that differ only in case, a C keyword, characters C does not allow, a comment end: the
    header still compiles (with -Werror) and names each tensor as the model does."""
    gcc = require("gcc", "apt-get install gcc")
    names = ["in:0", "In:0", "float", "x*/y"]
    nodes = [helper.make_node("Add", names[:2], [names[2]], name="add"),
             helper.make_node("Sub", names[:2], [names[3]], name="sub")]
    m = _model(nodes, [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in names[:2]],
               [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in names[2:]])
    connx.InferenceSession(m).export_library(tmp_path / "model.so")
    h = (tmp_path / "model.h").read_text()
    assert "int32_t model_run(const float *in_0, const float *In_0_2, float *t_float, float *x__y);" in h
    assert '#define MODEL_OUTPUT_NAMES {"float", "x*/y"}' in h
    subprocess.run([gcc, "-Wall", "-Wextra", "-Werror", "-o", "run_model", EXAMPLE, "-I.", "-L.", "-l:model.so",
                    "-Wl,-rpath,$ORIGIN"], check=True, cwd=tmp_path, capture_output=True, text=True)
    proc = subprocess.run(["./run_model"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0 and "output x*/y: float32, 2 elements: 0 0 sum 0" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_a_library_exported_again_is_loaded_afresh(tmp_path):
    """dlopen hands back the library already loaded under a name; load() sees the file changed."""
    s = connx.InferenceSession(resnet_block_model(16))
    path = tmp_path / "again.so"
    for batch in (1, 2):
        s.export_library(path, input_shapes={"x": (batch, 3, 16, 16)})
        m = load(path)
        assert m.get_inputs()[0].shape == [batch, 3, 16, 16]
        x = np.random.default_rng(batch).standard_normal((batch, 3, 16, 16)).astype(np.float32)
        np.testing.assert_allclose(m.run(None, {"x": x})[0], s.run(None, {"x": x})[0], rtol=1e-6, atol=1e-6)
    assert load(path) is not m and load(path).meta == m.meta


@pytest.mark.slow
def test_warm_cache_skips_llvm_and_exports_the_same_code(tmp_path):
    """A second process with the same kernels loads the linked module's machine code (no emission, no
    O3) and exports from its cached bitcode: the two libraries compute bit-identical outputs."""
    script = textwrap.dedent("""
        import sys
        import numpy as np
        import cuvil.onnx
        from cuvil.codegen import llvm as cg
        from cuvil.models.zoo import mlp
        runs = []
        real = cg.optimize
        cg.optimize = lambda text, *a, **k: runs.append(len(text)) or real(text, *a, **k)
        s = cuvil.onnx.InferenceSession(mlp(8, (64, 128, 10)), options=cuvil.onnx.CompileOptions(jobs=2))
        x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
        y = s.run(None, {"x": x})[0]
        s.export_library(sys.argv[1])
        np.save(sys.argv[1] + ".npy", y)
        print(len(runs))
    """)
    env = {**os.environ, "PYTHONPATH": ROOT, "CUVIL_CACHE_DIR": str(tmp_path / "cache")}
    counts = []
    for name in ("cold.so", "warm.so"):
        proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / name)], capture_output=True, text=True,
                              env=env)
        assert proc.returncode == 0, proc.stderr
        counts.append(int(proc.stdout.split()[-1]))
    # cold: the entry point's module (the kernels' are made by the workers), then the export's glue (its
    # slot-table entry, the C API: the kernels' object files are the JIT's); warm: the glue only
    assert counts == [3, 2]
    np.testing.assert_array_equal(np.load(tmp_path / "cold.so.npy"), np.load(tmp_path / "warm.so.npy"))
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    cold, warm = (load(tmp_path / n).run(None, {"x": x})[0] for n in ("cold.so", "warm.so"))
    np.testing.assert_array_equal(cold, warm)
    np.testing.assert_array_equal(cold, np.load(tmp_path / "cold.so.npy"))


def test_concurrent_runs_from_several_threads(resnet):
    """ctypes releases the GIL for the native call and each call allocates its own workspace: runs from
    several Python threads at once overlap in native code and each gets its own correct result."""
    from concurrent.futures import ThreadPoolExecutor

    m = load(resnet[2])
    xs = [np.random.default_rng(10 + k).standard_normal((2, 3, 16, 16)).astype(np.float32) for k in range(8)]
    refs = [m.run(None, {"x": x})[0] for x in xs]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            outs = list(pool.map(lambda x: m.run(None, {"x": x})[0], xs))
            for got, ref in zip(outs, refs):
                np.testing.assert_array_equal(got, ref)


def test_gpu_targets_are_not_exported(tmp_path):
    m = _model([helper.make_node("Relu", ["x"], ["y"], name="relu")],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    s = connx.InferenceSession(m, target="cuda -arch=sm_90")
    with pytest.raises(cuvil.TargetError, match="export_library writes CPU libraries"):
        s.export_library(tmp_path / "gpu.so")


def test_compile_o_builds_each_kernel_once(tmp_path, monkeypatch, capsys):
    """``cuvil compile model.onnx -o model.so`` makes each kernel's LLVM IR and machine code once (#31's
    floor): the library links the object files the compile made for the JIT (before, the export emitted
    and optimised the whole module a second time)."""
    from cuvil.cli import main
    from cuvil.codegen import llvm as cg
    from cuvil.graph import parallel

    monkeypatch.setenv("CUVIL_CACHE_DIR", "off")  # nothing from an earlier run
    emitted: list[str] = []  # a kernel's LLVM IR made (on the way to an object file)
    objects: list[str] = []  # a kernel's object file made
    real_emit, real_object = cg.emit_function, parallel.kernel_object
    monkeypatch.setattr(cg, "emit_function", lambda m, f, t: emitted.append(f.name) or real_emit(m, f, t))
    monkeypatch.setattr(parallel, "kernel_object",
                        lambda f, t, reloc="default": objects.append(f.name) or real_object(f, t, reloc))
    path = tmp_path / "block.onnx"
    onnx.save(resnet_block_model(16), path)
    # -j 1: every kernel is compiled in this process, where the counters are
    assert main(["compile", str(path), "--shapes", "x=2,3,16,16", "-j", "1", "-o", str(tmp_path / "block.so")]) == 0
    distinct = int(re.search(r"\((\d+) distinct kernels\)", capsys.readouterr().out).group(1))
    assert distinct > 3 and len(objects) == distinct and sorted(objects) == sorted(set(objects)), objects
    assert sorted(emitted) == sorted(objects), emitted
    x = np.random.default_rng(3).standard_normal((2, 3, 16, 16)).astype(np.float32)
    (y,) = load(tmp_path / "block.so").run(None, {"x": x})
    np.testing.assert_allclose(y, _ort(resnet_block_model(16), {"x": x})[0], rtol=RTOL, atol=ATOL)
