"""export_library(path, input_shapes=[{...}, {...}]): one library with a signature per value of the model's
symbolic sizes, chosen at run time by sizes passed to C as integers (docs/examples/run_symbolic.c, compiled with
gcc -Wall -Werror) or by the fed shapes in cuvil.runtime.load; checked against onnxruntime."""

from __future__ import annotations

import os
import re
import subprocess
import textwrap

import numpy as np
import pytest
from toolchain import module, require

onnx = module("onnx")
ort = module("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import cuvil  # noqa: E402
import cuvil.onnx as connx  # noqa: E402
from cuvil.runtime import load  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "docs", "examples", "run_symbolic.c")
RTOL, ATOL = 1e-3, 1e-4
BATCHES = (1, 4)


def _model(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def mlp_model():
    """MatMul + Add + Relu on x: float[N, 64] -> y: float[N, 32]."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 32)) / 8).astype(np.float32)
    b = rng.standard_normal(32).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), helper.make_node("Add", ["h", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["y"], name="relu")]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 32])],
                  [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])


def conv_model():
    """Conv 3x3 (3 -> 8, pad 1) + bias + Relu + MaxPool 2x2 on x: float[N, 3, 16, 16] -> y: float[N, 8, 8, 8]."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((8, 3, 3, 3)) / 4).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("MaxPool", ["r"], ["y"], name="pool", kernel_shape=[2, 2], strides=[2, 2])]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8, 8, 8])],
                  [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])


MODELS = {"mlp": (mlp_model, (64,)), "conv": (conv_model, (3, 16, 16))}


@pytest.fixture(scope="module", params=sorted(MODELS))
def exported(request, tmp_path_factory):
    """The model exported for N in {1, 4} as model.so, and docs/examples/run_symbolic.c built on it."""
    gcc = require("gcc", "apt-get install gcc")
    make, rest = MODELS[request.param]
    d = tmp_path_factory.mktemp(request.param)
    m = make()
    lib = connx.InferenceSession(m).export_library(d / "model.so", input_shapes=[{"x": (n, *rest)} for n in BATCHES])
    subprocess.run([gcc, "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(d / "run_symbolic"), EXAMPLE, f"-I{d}",
                    f"-L{d}", "-l:model.so", "-Wl,-rpath,$ORIGIN"], check=True, capture_output=True, text=True)
    return m, d, lib, rest


def test_c_program_runs_each_compiled_size(exported):
    m, d, lib, rest = exported
    for n in BATCHES:
        x = np.random.default_rng(n).standard_normal((n, *rest)).astype(np.float32)
        x.tofile(d / f"x{n}.bin")
        proc = subprocess.run([str(d / "run_symbolic"), "--threads", "2", "--runs", "2", "--out", str(d), f"N={n}",
                               str(d / f"x{n}.bin")], capture_output=True, text=True, cwd=d)
        assert proc.returncode == 0, proc.stderr
        (ref,) = _ort(m, {"x": x})
        from_c = np.fromfile(d / "output0.bin", np.float32).reshape(ref.shape)
        np.testing.assert_allclose(from_c, ref, rtol=RTOL, atol=ATOL)
        (y,) = load(lib).run(None, {"x": x})
        np.testing.assert_array_equal(y, from_c)  # the same machine code


def test_a_size_not_compiled_is_status_3_from_c(exported):
    _, d, _, _ = exported
    proc = subprocess.run([str(d / "run_symbolic"), "N=2"], capture_output=True, text=True, cwd=d)
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert "status 3, no compiled signature for these sizes; compiled: N=1; N=4" in proc.stderr


def test_load_picks_the_signature_from_the_fed_shapes(exported):
    m, _, lib, rest = exported
    loaded = load(lib)
    assert [(i.name, i.shape, i.type) for i in loaded.get_inputs()] == [("x", ["N", *rest], "tensor(float)")]
    out = m.graph.output[0]
    declared = [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim]
    assert [(o.name, o.shape) for o in loaded.get_outputs()] == [("y", declared)]
    for n in (4, 1, 4):
        x = np.random.default_rng(10 + n).standard_normal((n, *rest)).astype(np.float32)
        (y,) = loaded.run(None, {"x": x})
        np.testing.assert_allclose(y, _ort(m, {"x": x})[0], rtol=RTOL, atol=ATOL)
    with pytest.raises(cuvil.ShapeError, match=r"has no compiled signature for N=2 \(inputs 'x' \[2, .*\); it was "
                                               r"compiled for N=1; N=4: export it again with input_shapes=\[\.\.\.\]"):
        loaded.run(None, {"x": np.ones((2, *rest), np.float32)})
    with pytest.raises(cuvil.ShapeError, match="input 'x': dimension 1 must be"):
        loaded.run(None, {"x": np.ones((1, rest[0] + 1, *rest[1:]), np.float32)})
    with pytest.raises(cuvil.ShapeError, match="input 'x': expected rank"):
        loaded.run(None, {"x": np.ones(rest, np.float32)})


def test_header_names_the_sizes(exported):
    _, d, lib, rest = exported
    h = (d / "model.h").read_text()
    dims = "".join(f"[{k}]" for k in rest)
    for text in ("int32_t model_run(int64_t N, const float *x, float *y);",
                 "int32_t model_run_array(const int64_t *sizes, const void *const *inputs, void *const *outputs, "
                 "void *workspace);",
                 "int64_t model_workspace_size(int64_t N);", "#define MODEL_ERR_NO_SIGNATURE 3",
                 f"input [0] x    float[N]{dims}", " * Compiled for: N=1; N=4.", "#define MODEL_NUM_SIZES 1",
                 '#define MODEL_SIZE_NAMES {"N"}', "#define MODEL_SIGNATURE_SIZES {{1}, {4}}",
                 f"#define MODEL_INPUT_X_SHAPES {{{{1, {', '.join(map(str, rest))}}}, {{4, "
                 f"{', '.join(map(str, rest))}}}}}", "int64_t N  (input 'x', dimension 0)"):
        assert text in h, text
    nm = subprocess.run(["nm", "-D", str(lib)], capture_output=True, text=True, check=True).stdout
    defined = {line.split()[2] for line in nm.splitlines() if len(line.split()) == 3 and line.split()[1] == "T"}
    assert defined == {"model_run", "model_run_array", "model_workspace_size", "model_set_num_threads",
                       "model_meta", "model_last_error", "cuvil_module_meta"}
    meta = load(lib).meta
    assert meta["abi"] == 2 and [s["sizes"] for s in meta["signatures"]] == [[1], [4]]


def test_typed_entry_point_from_c(tmp_path):
    """model_run(N, x, y) with the sizes first; workspace sizes per N; status 3 and -1 for N = 2, status 2 for
    NULL sizes; the weights are stored once for both signatures."""
    gcc = require("gcc", "apt-get install gcc")
    m = mlp_model()
    lib = connx.InferenceSession(m).export_library(tmp_path / "mlp.so", input_shapes=[{"x": (n, 64)} for n in BATCHES])
    assert load(lib).meta["constant_bytes"] == 64 * 32 * 4 + 32 * 4
    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    x.tofile(tmp_path / "x.bin")
    (tmp_path / "typed.c").write_text(textwrap.dedent("""
        #include <stdio.h>
        #include "mlp.h"
        int main(void) {
            static float x[MLP_INPUT_X_MAX_ELEMENTS], y[MLP_OUTPUT_Y_MAX_ELEMENTS];
            static const int64_t ws[] = MLP_SIGNATURE_WORKSPACE_BYTES;
            FILE *f = fopen("x.bin", "rb");
            if (!f || fread(x, sizeof x, 1, f) != 1) return 10;
            fclose(f);
            if (mlp_run(2, x, y) != MLP_ERR_NO_SIGNATURE || mlp_workspace_size(2) != -1) return 11;
            if (mlp_workspace_size(1) != ws[0] || mlp_workspace_size(4) != ws[1]) return 12;
            const void *in[1] = {x};
            void *out[1] = {y};
            if (mlp_run_array(NULL, in, out, NULL) != MLP_ERR_NULL_POINTER) return 13;
            if (mlp_run(4, x, NULL) != MLP_ERR_NULL_POINTER) return 14;
            if (mlp_run(4, x, y) != MLP_OK) return 15;
            f = fopen("y.bin", "wb");
            fwrite(y, sizeof(float), 4 * 32, f);
            fclose(f);
            return 0;
        }
    """))
    subprocess.run([gcc, "-Wall", "-Werror", "-o", "typed", "typed.c", "-I.", "-L.", "-l:mlp.so",
                    "-Wl,-rpath,$ORIGIN"], check=True, cwd=tmp_path, capture_output=True, text=True)
    proc = subprocess.run(["./typed"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.returncode
    y = np.fromfile(tmp_path / "y.bin", np.float32).reshape(4, 32)
    np.testing.assert_allclose(y, _ort(m, {"x": x})[0], rtol=RTOL, atol=ATOL)


def test_sizes_without_names_and_shared_between_inputs(tmp_path):
    """Two inputs share the size 'batch size' (one argument, a C identifier), a dimension with no name is
    its own size (x_dim1); an output dimension that is twice a size reads 2*...; feeds must agree."""
    nodes = [helper.make_node("Add", ["x", "z"], ["s"], name="add"),
             helper.make_node("Concat", ["s", "s"], ["y"], name="cat", axis=0)]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch size", None]),
                       helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch size", 1])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    shapes = [{"x": (1, 3), "z": (1, 1)}, {"x": (2, 3), "z": (2, 1)}, {"x": (2, 5), "z": (2, 1)}]
    lib = connx.InferenceSession(m).export_library(tmp_path / "model.so", input_shapes=shapes)
    h = (tmp_path / "model.h").read_text()
    assert "int32_t model_run(int64_t batch_size, int64_t x_dim1, const float *x, const float *z, float *y);" in h
    assert "Compiled for: batch_size=1, x_dim1=3; batch_size=2, x_dim1=3; batch_size=2, x_dim1=5." in h
    loaded = load(lib)
    assert loaded.get_inputs()[0].shape == ["batch size", None]
    assert loaded.get_outputs()[0].shape == ["2*batch size", "x_dim1"]
    for sh in shapes:
        feeds = {n: np.random.default_rng(len(s)).standard_normal(s).astype(np.float32) for n, s in sh.items()}
        (y,) = loaded.run(None, feeds)
        np.testing.assert_array_equal(y, _ort(m, feeds)[0])
    with pytest.raises(cuvil.ShapeError, match=r"input 'z': dimension 0 \(batch size\) is 1, but batch size is 2"):
        loaded.run(None, {"x": np.ones((2, 3), np.float32), "z": np.ones((1, 1), np.float32)})
    with pytest.raises(cuvil.ShapeError, match="no compiled signature for batch size=1, x_dim1=5"):
        loaded.run(None, {"x": np.ones((1, 5), np.float32), "z": np.ones((1, 1), np.float32)})


def test_a_kernel_equal_in_two_signatures_is_linked_once(tmp_path):
    """A branch on a fixed-shape input compiles to the same kernel at every N: a kernel is named after its
    identity, so both signatures call one kernel of one name, and the library links its object file once."""
    from cuvil.graph.export.library import kernel_objects

    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu"),
             helper.make_node("Sigmoid", ["t"], ["u"], name="sig")]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8]),
                       helper.make_tensor_value_info("t", TensorProto.FLOAT, [16, 16])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8]),
                helper.make_tensor_value_info("u", TensorProto.FLOAT, [16, 16])])
    s = connx.InferenceSession(m)
    shapes = [{"x": (n, 8), "t": (16, 16)} for n in BATCHES]
    progs = [s._compiler.program(sh) for sh in shapes]
    names = [[k.name for k in p.kernel_funcs] for p in progs]
    assert [len(n) for n in names] == [2, 2] and names[0][0] != names[1][0] and names[0][1] == names[1][1], names
    assert len(kernel_objects(progs)) == 3
    lib = s.export_library(tmp_path / "two.so", input_shapes=shapes)
    t = np.random.default_rng(4).standard_normal((16, 16)).astype(np.float32)
    for n in BATCHES:
        x = np.random.default_rng(n).standard_normal((n, 8)).astype(np.float32)
        got = load(lib).run(None, {"x": x, "t": t})
        for g, r in zip(got, _ort(m, {"x": x, "t": t})):
            np.testing.assert_allclose(g, r, rtol=RTOL, atol=ATOL)


def test_input_shapes_lists_are_checked(tmp_path):
    s = connx.InferenceSession(mlp_model())
    for shapes, err, text in [
        ([], cuvil.ArgumentError, "input_shapes is an empty list"),
        ([{"x": (1, 64)}, (4, 64)], cuvil.ArgumentError, "input_shapes[1] must be a dict"),
        ([{"x": (1, 64)}, {"x": (4, 65)}], cuvil.ShapeError, "input_shapes[1]: input_shapes['x']: dimension 1 must "
                                                              "be 64"),
        ([{"x": (1, 64)}, {"x": (4, 64)}, {"x": (1, 64)}], cuvil.ShapeError,
         "input_shapes[2] repeats the sizes of input_shapes[0] (N=1)"),
    ]:
        with pytest.raises(err) as e:
            s.export_library(tmp_path / "m.so", input_shapes=shapes)
        assert text in str(e.value)
    fixed = _model([helper.make_node("Relu", ["x"], ["y"], name="relu")],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    with pytest.raises(cuvil.ShapeError, match="has no symbolic dimension, so it has one signature"):
        connx.InferenceSession(fixed).export_library(tmp_path / "f.so", input_shapes=[{}, {}])
    # a list of one for a model without symbolic dimensions: today's API
    lib = connx.InferenceSession(fixed).export_library(tmp_path / "f.so", input_shapes=[{}])
    assert "int32_t f_run(const float *x, float *y);" in (tmp_path / "f.h").read_text()
    assert load(lib).meta["abi"] == 1
    # a list of one for a model with a symbolic dimension: the sizes API with one signature
    lib = s.export_library(tmp_path / "one.so", input_shapes=[{"x": (3, 64)}])
    assert "int32_t one_run(int64_t N, const float *x, float *y);" in (tmp_path / "one.h").read_text()
    x = np.random.default_rng(5).standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_allclose(load(lib).run(None, {"x": x})[0], _ort(mlp_model(), {"x": x})[0], rtol=RTOL,
                               atol=ATOL)


def test_cross_exported_sizes_run_under_qemu(tmp_path):
    """A library of two signatures for AArch64, linked with the cross compiler and the C example, runs
    under qemu-aarch64: N=4 matches onnxruntime, N=2 is status 3."""
    apt = "apt-get install -y gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user"
    cross = require("aarch64-linux-gnu-gcc", apt)
    qemu = require("qemu-aarch64", apt)
    m = mlp_model()
    s = connx.InferenceSession(m, target="llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a76 -mattr=+neon")
    s.export_library(tmp_path / "model.so", input_shapes=[{"x": (n, 64)} for n in BATCHES])
    subprocess.run([cross, "-O2", "-Wall", "-Werror", "-o", "run_symbolic", EXAMPLE, "-I.", "-L.", "-l:model.so",
                    "-Wl,-rpath,$ORIGIN"], check=True, cwd=tmp_path, capture_output=True, text=True)
    x = np.random.default_rng(6).standard_normal((4, 64)).astype(np.float32)
    x.tofile(tmp_path / "x.bin")
    run = [qemu, "-L", "/usr/aarch64-linux-gnu", "./run_symbolic", "--out", "."]
    proc = subprocess.run([*run, "N=4", "x.bin"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    y = np.fromfile(tmp_path / "output0.bin", np.float32).reshape(4, 32)
    np.testing.assert_allclose(y, _ort(m, {"x": x})[0], rtol=RTOL, atol=ATOL)
    assert subprocess.run([*run, "N=2"], cwd=tmp_path, capture_output=True, text=True).returncode == 3


def test_only_the_c_api_is_exported(tmp_path):
    """The kernels, their thread counts and the slot-table entries of two signatures are local to the
    library (a linker version script): two models load into one process without a clash."""
    w = np.random.default_rng(7).standard_normal((256, 256)).astype(np.float32)
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu"),
             helper.make_node("MatMul", ["t", "w"], ["u"], name="mm")]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8]),
                       helper.make_tensor_value_info("t", TensorProto.FLOAT, [256, 256])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8]),
                helper.make_tensor_value_info("u", TensorProto.FLOAT, [256, 256])], [numpy_helper.from_array(w, "w")])
    lib = connx.InferenceSession(m).export_library(tmp_path / "mm.so",
                                                   input_shapes=[{"x": (n, 8), "t": (256, 256)} for n in BATCHES])
    nm = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    exported = sorted(line.split()[-1] for line in nm.splitlines() if line.strip())
    api = ["run", "run_array", "workspace_size", "set_num_threads", "meta", "last_error"]
    assert exported == sorted(["cuvil_module_meta"] + [f"mm_{x}" for x in api]), exported
    local = subprocess.run(["nm", str(lib)], capture_output=True, text=True, check=True).stdout
    assert re.search(r" [bBdD] k[0-9a-f]{12}\.num_threads$", local, re.M), local  # the matmul's thread count
