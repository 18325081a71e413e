"""A kernel's large scratch buffers become workspace parameters placed in the graph's arena."""

import numpy as np
import onnx
from onnx import TensorProto, helper

import cuvil
from cuvil import te
from cuvil.frontend.onnx import import_model
from cuvil.graph.compile import compile_model
from cuvil.ir.stmt import Allocate, sub_stmts
from cuvil.ir.workspace import MIN_BYTES, hoist_workspace, workspace_bytes
from cuvil.runtime.module import Module


def _two_stage(n: int, m: int):
    A = te.placeholder((n, m), name="A")
    B = te.compute((n, m), lambda i, j: A[i, j] * 2.0 + 1.0, name="B")
    C = te.compute((n, m), lambda i, j: B[i, j] + B[n - 1 - i, m - 1 - j], name="C")
    return A, C, te.create_schedule(C)


def _allocated(func):
    out, todo = [], [func.body]
    while todo:
        s = todo.pop()
        out += [s.buffer.name] if isinstance(s, Allocate) else []
        todo.extend(sub_stmts(s))
    return out


def test_big_intermediate_becomes_a_parameter_and_computes_the_same():
    A, C, s = _two_stage(128, 256)  # B: 128 KiB
    func = cuvil.lower(s, [A, C], name="two")
    hoisted = hoist_workspace(func)
    assert [b.name for b in hoisted.workspace] == ["B"] and "B" in _allocated(func)
    assert "B" not in _allocated(hoisted) and hoisted.params[-1] is hoisted.workspace[0]
    assert workspace_bytes(hoisted) == 128 * 256 * 4
    a = np.random.default_rng(0).standard_normal((128, 256)).astype(np.float32)
    want, got = np.empty_like(a), np.full_like(a, np.nan)
    Module(func, "llvm")(a, want)
    Module(hoisted, "llvm")(a, got, np.full((128, 256), np.nan, np.float32))
    np.testing.assert_array_equal(got, want)
    b = a * 2 + 1
    np.testing.assert_allclose(got, b + b[::-1, ::-1], rtol=1e-6)


def test_small_intermediates_stay_on_the_stack():
    A, C, s = _two_stage(8, 16)
    func = cuvil.lower(s, [A, C], name="small")
    assert 8 * 16 * 4 <= MIN_BYTES and hoist_workspace(func) is func


def test_a_graph_kernel_gets_its_workspace_from_the_arena():
    """A Winograd convolution keeps its padded input, transformed tiles and products as workspace: the
    arena holds them, the output matches onnxruntime's, and two runs give the same bits."""
    import onnxruntime as ort

    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 64, 3, 3)).astype(np.float32) * 0.05
    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 28, 28])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 28, 28])],
                          [onnx.numpy_helper.from_array(w, "w")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    prog = compile_model(import_model(model), {"x": (1, 64, 28, 28)})
    ws = sum(workspace_bytes(f) for f in prog.kernel_funcs)
    assert ws > MIN_BYTES and prog.memory.arena_bytes >= ws
    x = rng.standard_normal((1, 64, 28, 28)).astype(np.float32)
    first = prog.run({"x": x})["y"].copy()
    np.testing.assert_array_equal(prog.run({"x": x})["y"], first)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(first, want, rtol=1e-4, atol=1e-4)  # Winograd F(2,3) rounding over 576 terms
    folded = compile_model(import_model(model), {}, {"x": x})  # the kernel runs while compiling (_fold)
    np.testing.assert_allclose(folded.run({})["y"], first, rtol=1e-5, atol=1e-5)
