"""The CPU runtime: argument validation, export/load of shared libraries, timing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from cuvil.errors import ArgumentError, DTypeError, ShapeError, TargetError
from cuvil.ir import expr as E
from cuvil.ir.expr import Load, Var
from cuvil.ir.stmt import Allocate, Block, Buffer, For, LoweredFunc, Store
from cuvil.runtime import Module, load

ZERO = E.const(0, "int64")


def matmul_func():
    """C[M, N] = A[M, K] @ B[K, N] in float32, with the size vars M, N, K."""
    m, n, k = Var("int64", "M"), Var("int64", "N"), Var("int64", "K")
    i, j, r = Var("int64", "i"), Var("int64", "j"), Var("int64", "r")
    a, b, c = Buffer("A", (m, k), "float32"), Buffer("B", (k, n), "float32"), Buffer("C", (m, n), "float32")
    acc = Store(c, (i, j), Load("float32", c, (i, j)) + Load("float32", a, (i, r)) * Load("float32", b, (r, j)))
    body = For(i, ZERO, m, For(j, ZERO, n, Block((Store(c, (i, j), E.const(0.0, "float32")), For(r, ZERO, k, acc)))))
    return LoweredFunc("matmul", (a, b, c), body, (m, n, k), (c,))


def scale_func():
    """Y[i, j] = X[i, j] * s + pad(P)[j]: a Var param S, a constant dim 4, a shape expression N + 2."""
    n, s = Var("int64", "N"), Var("int64", "S")
    i, j = Var("int64", "i"), Var("int64", "j")
    x = Buffer("X", (n, E.const(4, "int64")), "float64")
    p = Buffer("P", (n + E.const(2, "int64"),), "float64")
    y = Buffer("Y", (n, E.const(4, "int64")), "float64")
    val = Load("float64", x, (i, j)) * E.Cast("float64", s) + Load("float64", p, (i + E.const(2, "int64"),))
    body = For(i, ZERO, n, For(j, ZERO, E.const(4, "int64"), Store(y, (i, j), val)))
    return LoweredFunc("scale", (x, p, s, y), body, (n, s), (y,))


@pytest.fixture(scope="module")
def matmul():
    return Module(matmul_func(), "llvm")


@pytest.fixture(scope="module")
def scale():
    return Module(scale_func(), "llvm")


def operands(m=5, n=3, k=4):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    return a, b, np.zeros((m, n), np.float32)


def test_matmul_runs(matmul):
    a, b, c = operands()
    assert matmul(a, b, c) is None
    np.testing.assert_allclose(c, a @ b, rtol=1e-5, atol=1e-6)


def test_var_param_and_shape_expression(scale):
    x = np.arange(12, dtype=np.float64).reshape(3, 4)
    p = np.arange(5, dtype=np.float64)
    y = np.zeros_like(x)
    scale(x, p, 3, y)
    np.testing.assert_array_equal(y, x * 3 + p[2:, None])
    scale(x, p, np.int32(2), y)  # numpy integers are ints too
    np.testing.assert_array_equal(y, x * 2 + p[2:, None])


# -- every validation error names the argument ----------------------------------------------


@pytest.mark.parametrize("bad, error, message", [
    (lambda a, b, c: (a, b), ArgumentError, "takes 3 arguments, got 2.*matmul\\(A: float32\\[M, K\\]"),
    (lambda a, b, c: (a.tolist(), b, c), ArgumentError, "'A' \\(argument 0\\) must be a numpy.ndarray"),
    (lambda a, b, c: (a, b.astype(np.float64), c), DTypeError, "'B' \\(argument 1\\) must have dtype float32, "
                                                                "got float64"),
    (lambda a, b, c: (a[None], b, c), ShapeError, "'A' \\(argument 0\\) must have 2 dimension"),
    (lambda a, b, c: (a, b[:3], c), ShapeError, "'B' \\(argument 1\\) dimension 0 is 3, but K = 4 "
                                                "\\(from A \\(argument 0\\) dimension 1\\)"),
    (lambda a, b, c: (a, b, c[:, :2].copy()), ShapeError, "'C' \\(argument 2\\) dimension 1 is 2, but N = 3"),
    (lambda a, b, c: (a, b, np.asfortranarray(np.zeros((5, 5), np.float32))[:, :3]), ArgumentError,
     "output 'C' \\(argument 2\\) is not C-contiguous"),
])
def test_validation_errors(matmul, bad, error, message):
    with pytest.raises(error, match=message):
        matmul(*bad(*operands()))


def test_dtype_error_is_a_type_error(matmul):
    a, b, c = operands()
    with pytest.raises(TypeError):
        matmul(a.astype(np.float16), b, c)


def test_constant_dims_var_params_and_expressions(scale):
    x, p, y = np.zeros((3, 4)), np.zeros(5), np.zeros((3, 4))
    with pytest.raises(ShapeError, match="'X' \\(argument 0\\) dimension 1 must be 4, got 5"):
        scale(np.zeros((3, 5)), p, 1, y)
    with pytest.raises(ShapeError, match="'P' \\(argument 1\\) dimension 0 must be N \\+ 2 = 5, got 4"):
        scale(x, np.zeros(4), 1, y)
    with pytest.raises(ArgumentError, match="'S' \\(argument 2\\) is a size and must be a Python int, got float"):
        scale(x, p, 1.5, y)
    with pytest.raises(ArgumentError, match="got bool"):
        scale(x, p, True, y)
    with pytest.raises(ArgumentError, match="does not fit in int64"):
        scale(x, p, 2**70, y)


def test_var_param_checked_against_shapes():
    n, i = Var("int64", "N"), Var("int64", "i")
    a = Buffer("A", (n,), "int32")
    func = LoweredFunc("fill", (a, n), For(i, ZERO, n, Store(a, (i,), E.const(7, "int32"))), (n,), (a,))
    m = Module(func, "llvm")
    out = np.zeros(6, np.int32)
    m(out, 6)
    assert (out == 7).all()
    with pytest.raises(ShapeError, match="'A' \\(argument 0\\) dimension 0 is 6, but N = 5 "
                                         "\\(from argument 'N' \\(position 1\\)\\)"):
        m(out, 5)


def test_non_contiguous_inputs_are_copied(matmul):
    a, b, c = operands()
    a_t = np.asfortranarray(a)  # same values, column-major
    b_strided = np.zeros((4, 6), np.float32)
    b_strided[:, ::2] = b
    matmul(a_t, b_strided[:, ::2], c)
    np.testing.assert_allclose(c, a @ b, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")
def test_subclasses_are_accepted(matmul):
    a, b, c = operands()
    out = c.view(np.matrix)
    matmul(np.asmatrix(a), b, out)
    np.testing.assert_allclose(c, a @ b, rtol=1e-5, atol=1e-6)


def test_outputs_must_not_overlap_inputs():
    n, i = Var("int64", "N"), Var("int64", "i")
    a, b = Buffer("A", (n,), "float32"), Buffer("B", (n,), "float32")
    func = LoweredFunc("copy", (a, b), For(i, ZERO, n, Store(b, (i,), Load("float32", a, (i,)))), (n,), (b,))
    m = Module(func, "llvm")
    x = np.arange(10, dtype=np.float32)
    with pytest.raises(ArgumentError, match="output 'B' \\(argument 1\\) overlaps 'A' \\(argument 0\\)"):
        m(x, x)
    with pytest.raises(ArgumentError, match="overlaps"):
        m(x[:5], x[3:8])
    with pytest.raises(ArgumentError, match="overlaps"):  # a strided input that is a view of the output
        m(x[::2], x[5:])
    m(x[:5], x[5:])  # adjacent, not overlapping
    np.testing.assert_array_equal(x[5:], x[:5])


def test_read_only_output_is_refused(matmul):
    a, b, c = operands()
    c.setflags(write=False)
    with pytest.raises(ArgumentError, match="output 'C' \\(argument 2\\) is read-only"):
        matmul(a, b, c)


def test_unbindable_size_var_is_refused_at_construction():
    n, k, i = Var("int64", "N"), Var("int64", "K"), Var("int64", "i")
    a = Buffer("A", (n,), "float32")
    b = Buffer("B", (n * k,), "float32")  # K appears only inside an expression
    func = LoweredFunc("f", (a, b), For(i, ZERO, n, Store(b, (i,), Load("float32", a, (i,)))), (n, k), (b,))
    with pytest.raises(ShapeError, match="'K' are neither the exact extent"):
        Module(func, "llvm")


def test_heap_allocation_failure_raises_memory_error():
    # T[N] is filled by one loop and read back reversed by another, so LLVM keeps the malloc
    n, m_, i, j = Var("int64", "N"), Var("int64", "M"), Var("int64", "i"), Var("int64", "j")
    out = Buffer("O", (m_,), "float32")
    tmp = Buffer("T", (n,), "float64")
    last = m_ - E.const(1, "int64")
    fill = For(i, ZERO, m_, Store(tmp, (i,), E.Cast("float64", i)))
    use = For(j, ZERO, m_, Store(out, (j,), E.Cast("float32", Load("float64", tmp, (last - j,)))))
    m = Module(LoweredFunc("big", (out, n), Allocate(tmp, Block((fill, use))), (m_, n), (out,)), "llvm")
    o = np.zeros(4, np.float32)
    m(o, 4)
    np.testing.assert_array_equal(o, [3, 2, 1, 0])
    for n_elems in (2**60, 2**58, -1):  # bytes overflow int64; more than any machine has; negative
        with pytest.raises(MemoryError, match="out of memory"):
            m(o, n_elems)


# -- sources, timing, export and load -----------------------------------------------------------


def test_get_source_and_time(matmul):
    assert "for (r = 0; r < K; r++)" in matmul.get_source("loops")
    assert "define" in matmul.get_source("llvm")
    assert matmul.get_source("asm").strip()
    with pytest.raises(ArgumentError, match="unknown source format"):
        matmul.get_source("ptx")
    t = matmul.time(*operands(), number=3, repeat=3)
    assert isinstance(t, float) and 0 < t < 1


def test_cross_compiled_module_cannot_run_here(monkeypatch):
    m = Module(matmul_func(), "llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a76 -mattr=+neon")
    assert m.get_source("asm")
    with pytest.raises(TargetError, match="not this machine"):
        m(*operands())
    monkeypatch.setenv("PATH", "")  # no cross compiler
    with pytest.raises(TargetError, match="cross linker"):
        m.export_library("/tmp/never.so")


def test_export_and_load_without_llvmlite(tmp_path, matmul):
    lib = matmul.export_library(tmp_path / "mm.so")
    header = (tmp_path / "mm.h").read_text()
    assert "int32_t matmul(void **args, int64_t *sizes);" in header
    assert "args[2] = C: float[M, N] (output)" in header and "sizes[2] = K" in header
    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        import cuvil.runtime
        m = cuvil.runtime.load({str(lib)!r})
        a = np.arange(6, dtype=np.float32).reshape(2, 3)
        b = np.ones((3, 4), np.float32)
        c = np.zeros((2, 4), np.float32)
        m(a, b, c)
        assert np.array_equal(c, a @ b), c
        try:
            m(a, b, np.zeros((2, 5), np.float32))
        except cuvil.ShapeError as e:
            assert "N = 4" in str(e), e
        else:
            raise SystemExit("no ShapeError")
        assert 'islpy' not in sys.modules and 'llvmlite' not in sys.modules, sorted(sys.modules)
        print("ok", m.time(a, b, c) > 0)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok True"


def test_load_errors(tmp_path):
    with pytest.raises(ArgumentError, match="cannot load"):
        load(tmp_path / "missing.so")
    other = tmp_path / "other.so"
    src = tmp_path / "other.c"
    src.write_text("int f(void) { return 0; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(other), str(src)], check=True)
    with pytest.raises(ArgumentError, match="not a cuvil library"):
        load(other)
