"""Explicit SIMD (vectorize), unrolling and native threads (parallel), on hand-built loop IR.

The reference for a vectorised or parallel loop is the same loop IR with a serial loop: the
results must be bit-identical (float expressions here contain no multiply feeding an add, so
FMA contraction cannot make the two differ; the matmul test allows 1e-5 relative for it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reference import budget

from cuvil import dtype as dt
from cuvil.codegen.llvm import PARALLEL_STACK_LIMIT, codegen_llvm
from cuvil.codegen.llvm_expr import InternalError
from cuvil.errors import ArgumentError
from cuvil.ir import expr as E
from cuvil.ir.expr import Binary, Cast, Load, Select, Var
from cuvil.ir.functor import substitute
from cuvil.ir.stmt import Allocate, Block, Buffer, For, If, LetStmt, LoweredFunc, Store
from cuvil.ir.unroll import unroll_loops
from cuvil.runtime import Module, load, threads


def c64(v):
    return E.const(v, "int64")


ZERO = c64(0)


def kernel(build, in_dtypes, kind, extent=None, name="k"):
    """``Y_j[i] = build(i, X_0, X_1, ...)[j]`` for i < extent (default N); X_k are length-N buffers."""
    n, i = Var("int64", "N"), Var("int64", "i")
    ins = [Buffer(f"X{k}", (n,), d) for k, d in enumerate(in_dtypes)]
    exprs = build(i, *ins)
    outs = [Buffer(f"Y{k}", (n,), e.dtype) for k, e in enumerate(exprs)]
    body = Block(tuple(Store(o, (i,), e) for o, e in zip(outs, exprs)))
    ext = n if extent is None else extent
    return LoweredFunc(name, tuple(ins + outs), For(i, ZERO, ext, body, kind), (n,), tuple(outs))


def same_as_serial(build, in_dtypes, inputs, extent=None, kinds=("vectorize",)):
    """Run the kernel serially and with each kind in ``kinds``; outputs must be identical."""
    outs = {}
    for kind in ("serial", *kinds):
        func = kernel(build, in_dtypes, kind, extent)
        m = Module(func, "llvm")
        ys = [np.zeros(len(inputs[0]), o.dtype) for o in func.outputs]
        m(*inputs, *ys)
        outs[kind] = ys
    for kind in kinds:
        for got, want in zip(outs[kind], outs["serial"]):
            np.testing.assert_array_equal(got, want, err_msg=kind)
    return outs["serial"]


def values(dtype, n, rng):
    if dt.is_bool(dtype):
        return rng.integers(0, 2, n).astype(bool)
    if dt.is_int(dtype):
        info = np.iinfo(dtype)
        v = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
        v[: min(n, 4)] = [info.min, info.max, 0, -1 if info.min else 1][: min(n, 4)]
        return v
    v = (rng.standard_normal(n) * 50).astype(dtype)
    v[: min(n, 3)] = [np.nan, 0.0, -0.0][: min(n, 3)]
    return v


# -- unrolling ------------------------------------------------------------------------------


def test_unroll_golden_text():
    n, i, u, w = Var("int64", "N"), Var("int64", "i"), Var("int64", "u"), Var("int64", "w")
    a, c = Buffer("A", (n, c64(3)), "float32"), Buffer("C", (n, c64(3)), "float32")
    inner = Store(c, (i, u), Load("float32", a, (i, u)) * E.const(2.0, "float32"))
    body = Block((For(u, ZERO, c64(3), inner, "unroll"),
                  For(w, ZERO, n, Store(c, (i, c64(0)), Load("float32", a, (i, c64(0)))), "unroll")))
    func = LoweredFunc("k", (a, c), For(i, ZERO, n, body), (n,), (c,))
    out = unroll_loops(func)
    assert str(out) == textwrap.dedent("""\
        func k(A: float32[N, 3], C: float32[N, 3]) {
          for (i = 0; i < N; i++) {
            C[i, 0] = A[i, 0] * 2.0f;
            C[i, 1] = A[i, 1] * 2.0f;
            C[i, 2] = A[i, 2] * 2.0f;
            unroll for (w = 0; w < N; w++) {
              C[i, 0] = A[i, 0];
            }
          }
        }""")
    assert unroll_loops(kernel(lambda i, x: [Load("float32", x, (i,))], ["float32"], "serial")).body is not None
    same = kernel(lambda i, x: [Load("float32", x, (i,))], ["float32"], "serial")
    assert unroll_loops(same) is same  # nothing to unroll: the same object
    # nested unroll loops with a non-zero min become one block, and compute the same
    j = Var("int64", "j")
    nest = For(u, c64(1), c64(2), For(j, ZERO, c64(2), Store(c, (u, j), E.Cast("float32", u * c64(10) + j)),
                                      "unroll"), "unroll")
    f2 = unroll_loops(LoweredFunc("k", (a, c), nest, (n,), (c,)))
    assert isinstance(f2.body, Block) and len(f2.body.stmts) == 4
    x, y = np.zeros((3, 3), np.float32), np.zeros((3, 3), np.float32)
    Module(f2, "llvm")(x, y)
    np.testing.assert_array_equal(y, [[0, 0, 0], [10, 11, 0], [20, 21, 0]])


# -- explicit SIMD --------------------------------------------------------------------------


@pytest.mark.parametrize("extent", [None, 1, 3, 16, 37, 64, 100])
def test_vector_loop_extents_and_tails(extent):
    rng = np.random.default_rng(0)
    ext = None if extent is None else c64(extent)
    f = kernel(lambda i, x: [Load("float32", x, (i,)) * E.const(3.0, "float32")], ["float32"], "vectorize", ext)
    m = Module(f, "llvm")
    sizes = [extent + 5] if extent is not None else list(range(0, 35)) + [100, 1001]
    for n in sizes:  # run-time extents: tails of 0 .. V-1 elements
        x = rng.standard_normal(n).astype(np.float32)
        y = np.full(n, -7.0, np.float32)
        m(x, y)
        k = n if extent is None else extent
        np.testing.assert_array_equal(y[:k], x[:k] * np.float32(3))
        np.testing.assert_array_equal(y[k:], -7.0)  # nothing written past the extent


def test_tail_extent_like_isl():
    # for (j = 0; j < min(64, N - 64*jo); j++): the vector part plus a scalar tail, per block
    n, jo, j = Var("int64", "N"), Var("int64", "jo"), Var("int64", "j")
    x, y = Buffer("X", (n,), "float64"), Buffer("Y", (n,), "float64")
    idx = jo * c64(64) + j
    inner = For(j, ZERO, E.minimum(c64(64), n - jo * c64(64)),
                Store(y, (idx,), Load("float64", x, (idx,)) + E.const(1.0, "float64")), "vectorize")
    func = LoweredFunc("k", (x, y), For(jo, ZERO, (n + c64(63)) // c64(64), inner), (n,), (y,))
    m = Module(func, "llvm")
    for size in (0, 1, 63, 64, 65, 200):
        a = np.arange(size, dtype=np.float64)
        out = np.zeros(size)
        m(a, out)
        np.testing.assert_array_equal(out, a + 1)


def test_unit_stride_broadcast_gather_and_scatter():
    n, i = Var("int64", "N"), Var("int64", "i")
    x = Buffer("X", (n, c64(4)), "int32")  # X[i, 1]: stride 4, a gather
    s = Buffer("S", (c64(1),), "int32")  # S[0]: invariant, a broadcast
    v = Buffer("V", (n,), "int32")  # V[i]: unit stride
    y = Buffer("Y", (n,), "int32")  # Y[N - 1 - i]: stride -1, a scatter
    z = Buffer("Z", (n,), "int32")  # Z[i]: vector store
    w = Buffer("W", (c64(1),), "int32")  # W[0]: every lane stores; the last one stays
    val = Load("int32", x, (i, c64(1))) + Load("int32", s, (ZERO,)) * Load("int32", v, (i,))
    body = Block((Store(y, (n - c64(1) - i,), val), Store(z, (i,), Load("int32", v, (Load("int32", v, (i,)) % E.const(
        1 << 30, "int32"),))), Store(w, (ZERO,), Cast("int32", i))))
    func = LoweredFunc("k", (x, s, v, y, z, w), For(i, ZERO, n, body, "vectorize"), (n,), (y, z, w))
    m = Module(func, "llvm")
    text = m.get_source("llvm-unopt")
    assert "load <16 x i32>" in text or "load <8 x i32>" in text  # V[i] is one vector load
    for size in (5, 16, 37):
        rng = np.random.default_rng(size)
        xa = rng.integers(-100, 100, (size, 4)).astype(np.int32)
        sa = np.array([3], np.int32)
        va = rng.permutation(size).astype(np.int32)  # indices for the gather V[V[i]]
        ya, za, wa = np.zeros(size, np.int32), np.zeros(size, np.int32), np.zeros(1, np.int32)
        m(xa, sa, va, ya, za, wa)
        np.testing.assert_array_equal(ya[::-1], xa[:, 1] + 3 * va)
        np.testing.assert_array_equal(za, va[va])
        assert wa[0] == size - 1


ALL = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
       "float64"]


@pytest.mark.slow
def test_every_dtype_load_store_cast_and_compare():
    rng = np.random.default_rng(1)
    for d in ALL:
        a, b = values(d, 77, rng), values(d, 77, rng)
        ops = ["min", "max", "eq", "lt"] + (["add", "sub", "floordiv", "floormod"] if d != "bool" else ["and"])

        def build(i, x, y, d=d, ops=ops):
            p, q = Load(d, x, (i,)), Load(d, y, (i,))
            out = [Binary("bool" if o in E.CMP_OPS else d, o, p, q) for o in ops]
            return out + [Cast("float32", p), Cast(d, Cast("int16", p) if d != "bool" else p)]

        with np.errstate(all="ignore"):
            same_as_serial(build, [d, d], [a, b], kinds=("vectorize", "parallel"))


@pytest.mark.slow
def test_float_semantics_nan_min_max_floordiv_and_math():
    rng = np.random.default_rng(2)
    for d in ("float32", "float64", "float16"):
        a, b = values(d, 101, rng), values(d, 101, rng)
        b[10:14] = [0.0, -0.0, np.inf, np.nan]

        def build(i, x, y, d=d):
            p, q = Load(d, x, (i,)), Load(d, y, (i,))
            return [E.minimum(p, q), E.maximum(p, q), p // q, p % q, p != q, p / q, E.call("isnan", p),
                    E.call("sqrt", E.call("abs", p)), E.call("floor", p), E.call("round", p), E.call("exp", q),
                    E.call("tanh", p), E.call("log", E.call("abs", q)), E.call("pow", E.call("abs", p), q)]

        with np.errstate(all="ignore"):
            outs = same_as_serial(build, [d, d], [a, b])
            np.testing.assert_array_equal(outs[0], np.minimum(a, b))
            np.testing.assert_array_equal(outs[1], np.maximum(a, b))


_INT_OPS = ["add", "sub", "mul", "min", "max", "floordiv", "floormod", "and", "or", "xor"]
_FLOAT_OPS = ["add", "sub", "min", "max", "div", "floordiv", "floormod"]  # no mul: FMA could contract


@st.composite
def expressions(draw, dtype, leaves, depth):
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        k = draw(st.integers(0, len(leaves)))
        if k == len(leaves):
            v = draw(st.integers(-5, 5)) if not dt.is_bool(dtype) else draw(st.booleans())
            if dt.is_int(dtype) and not dt.is_signed(dtype):
                v = abs(v)
            return E.const(v, dtype)
        return Cast(dtype, leaves[k]) if leaves[k].dtype != dtype else leaves[k]
    kind = draw(st.sampled_from(["bin", "bin", "select", "cast"]))
    if kind == "cast":
        other = draw(st.sampled_from(["int32", "float32", "uint8", "float64"]))
        inner = draw(expressions(other, leaves, depth - 1))
        if dt.is_float(other) and dt.is_int(dtype):  # out-of-range float -> int is unspecified (as in
            # numpy; x86 gives INT_MIN, constant folding 0): convert only finite values well inside the range
            ok = Binary("bool", "and", Binary("bool", "eq", inner, inner),
                        Binary("bool", "lt", E.call("abs", inner), E.const(100.0, other)))
            inner = Select(other, ok, inner, E.const(0.0, other))
        return Cast(dtype, inner)
    a = draw(expressions(dtype, leaves, depth - 1))
    b = draw(expressions(dtype, leaves, depth - 1))
    if kind == "select":
        c = Binary("bool", draw(st.sampled_from(["lt", "eq", "ne"])), a, b)
        return Select(dtype, c, b, a)
    if dt.is_bool(dtype):
        return Binary(dtype, draw(st.sampled_from(["and", "or", "xor", "min", "max"])), a, b)
    op = draw(st.sampled_from(_FLOAT_OPS if dt.is_float(dtype) else _INT_OPS))
    return Binary(dtype, op, a, b)


@budget(0.75)  # 15 examples under the ci profile
@given(st.sampled_from(ALL), st.sampled_from(ALL), st.data())
@pytest.mark.slow
def test_random_expressions_vector_equals_serial(d0, d1, data):
    """A random expression over two inputs (and the loop variable) of random dtypes."""
    out_dtype = data.draw(st.sampled_from(ALL))
    rng = np.random.default_rng(data.draw(st.integers(0, 1000)))
    n = data.draw(st.integers(0, 40))
    a, b = values(d0, n, rng), values(d1, n, rng)

    p0, p1, iv = Var(d0, "p0"), Var(d1, "p1"), Var("int64", "iv")
    expr = data.draw(expressions(out_dtype, [p0, p1, iv], 3))  # drawn once, then placed in each kernel

    def build(i, x, y):
        return [substitute(expr, {p0: Load(d0, x, (i,)), p1: Load(d1, y, (i,)), iv: i})]

    with np.errstate(all="ignore"):
        same_as_serial(build, [d0, d1], [a, b])


@budget(0.75)  # 15 examples under the ci profile
@given(st.sampled_from(ALL), st.sampled_from([3, 5, 7, 11, 13, 14, 15, 24, 56]), st.data())
@pytest.mark.slow
def test_constant_extent_tail_is_one_masked_vector(d0, extent, data):
    """A constant extent that is not a power of two (a 7-wide row) ends in one masked vector: the same
    values as the serial loop, and nothing past the extent read or written (the buffers are longer)."""
    out_dtype = data.draw(st.sampled_from(ALL))
    rng = np.random.default_rng(data.draw(st.integers(0, 1000)))
    n = extent + 3
    a = values(d0, n, rng)
    p0, iv = Var(d0, "p0"), Var("int64", "iv")
    expr = data.draw(expressions(out_dtype, [p0, iv], 3))

    def build(i, x):
        return [substitute(expr, {p0: Load(d0, x, (i,)), iv: i})]

    with np.errstate(all="ignore"):
        outs = same_as_serial(build, [d0], [a], extent=E.const(extent, "int64"))
    assert not outs[0][extent:].any()  # zeros as allocated: the masked tail stored nothing past the end
    func = kernel(build, [d0], "vectorize", E.const(extent, "int64"))
    if extent in (7, 11, 13, 14, 15) and dt.bits(out_dtype) >= 8:
        assert "llvm.masked.store" in Module(func, "llvm").get_source("llvm-unopt")


def test_select_never_reads_the_unchosen_side():
    far = c64(10 ** 12)

    def build(i, x):
        n = x.shape[0]
        inside = Load("float32", x, (i,))
        outside = Load("float32", x, (i + far,))
        lane_cond = Select("float32", i >= n, outside, inside)  # depends on the lane: per-lane code
        uniform = Select("float32", n > c64(0), inside, outside)  # one condition for all lanes: a branch
        shifted = Select("float32", i + c64(1) < n, Load("float32", x, (i + c64(1),)), E.const(0.0, "float32"))
        return [lane_cond, uniform, shifted]

    x = np.arange(1, 40, dtype=np.float32)
    lane, uni, shifted = same_as_serial(build, ["float32"], [x])
    np.testing.assert_array_equal(lane, x)
    np.testing.assert_array_equal(uni, x)
    np.testing.assert_array_equal(shifted, np.append(x[1:], 0))


def test_store_then_load_in_one_vector_body():
    n, i = Var("int64", "N"), Var("int64", "i")
    x, t, y = (Buffer(nm, (n,), "float32") for nm in ("X", "T", "Y"))
    body = Block((Store(t, (i,), Load("float32", x, (i,)) + E.const(1.0, "float32")),
                  Store(y, (i,), Load("float32", t, (i,)) * Load("float32", t, (i,)))))
    m = Module(LoweredFunc("k", (x, t, y), For(i, ZERO, n, body, "vectorize"), (n,), (t, y)), "llvm")
    a = np.arange(21, dtype=np.float32)
    tt, yy = np.zeros_like(a), np.zeros_like(a)
    m(a, tt, yy)
    np.testing.assert_array_equal(yy, (a + 1) * (a + 1))


def test_uniform_if_and_let_stay_vector_others_fall_back_to_serial():
    n, i, k = Var("int64", "N"), Var("int64", "i"), Var("int64", "k")
    x, y = Buffer("X", (n,), "float32"), Buffer("Y", (n,), "float32")
    s = Var("float32", "s")
    load = Load("float32", x, (i,))
    ok_body = LetStmt(s, E.const(2.0, "float32"), If(n > c64(3), Store(y, (i,), load * s), Store(y, (i,), load)))
    ok = LoweredFunc("k", (x, y), For(i, ZERO, n, ok_body, "vectorize"), (n,), (y,))
    assert "stays serial" not in codegen_llvm(ok, "llvm")
    nested = For(k, ZERO, c64(2), Store(y, (i,), load + Cast("float32", k)))
    bad = LoweredFunc("k", (x, y), For(i, ZERO, n, nested, "vectorize"), (n,), (y,))
    text = codegen_llvm(bad, "llvm")
    assert "cuvil: vectorize loop 'i' stays serial: its body contains a nested loop (k)" in text
    a = np.arange(9, dtype=np.float32)
    for func, want in ((ok, a * 2), (bad, a + 1)):
        out = np.zeros_like(a)
        Module(func, "llvm")(a, out)
        np.testing.assert_array_equal(out, want)


def test_asm_of_a_vectorised_fp32_loop_has_vector_fma():
    f = kernel(lambda i, x, y: [Load("float32", x, (i,)) * Load("float32", y, (i,)) + Load("float32", y, (i,))],
               ["float32", "float32"], "vectorize")
    asm = Module(f, "llvm").get_source("asm")
    assert "vfmadd" in asm and "vmovups" in asm
    assert "zmm" in asm or "ymm" in asm


# -- threads --------------------------------------------------------------------------------


def parallel_rows(kind="parallel"):
    """Y[i, j] = 2 * X[i, j] + 1 via a per-row scratch T[M] (heap: M is a run-time size)."""
    n, m_ = Var("int64", "N"), Var("int64", "M")
    i, j = Var("int64", "i"), Var("int64", "j")
    x, y = Buffer("X", (n, m_), "float64"), Buffer("Y", (n, m_), "float64")
    tmp = Buffer("T", (m_,), "float64", scope="local")
    fill = For(j, ZERO, m_, Store(tmp, (j,), Load("float64", x, (i, j)) * E.const(2.0, "float64")))
    use = For(j, ZERO, m_, Store(y, (i, j), Load("float64", tmp, (j,)) + E.const(1.0, "float64")), "vectorize")
    return LoweredFunc("rows", (x, y), For(i, ZERO, n, Allocate(tmp, Block((fill, use))), kind), (n, m_), (y,))


@pytest.fixture
def restore_threads():
    yield
    threads.set_num_threads(None)


def test_parallel_equals_serial_for_thread_counts_and_extents(restore_threads):
    par, ser = Module(parallel_rows(), "llvm"), Module(parallel_rows("serial"), "llvm")
    text = par.get_source("llvm-unopt")
    assert "GOMP_parallel" in text and '@"aligned_alloc"' in text
    for nt in (1, 2, 3):
        threads.set_num_threads(nt)
        assert threads.get_num_threads() == nt
        for rows in (0, 1, 7, 1000):
            x = np.random.default_rng(rows).standard_normal((rows, 13))
            got, want = np.full_like(x, np.nan), np.full_like(x, np.nan)
            par(x, got)
            ser(x, want)
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(got, 2 * x + 1)


def test_parallel_iterations_run_exactly_once(restore_threads):
    """Owned ranges and taking the others' grains: every iteration runs once, for thread counts above and
    below the extent and above RANGES (threads then share a range), and loops that do not start at 0."""
    from cuvil.codegen.llvm_parallel import RANGES

    n, i = Var("int64", "N"), Var("int64", "i")
    y = Buffer("Y", (n,), "int32")
    body = Store(y, (i,), Load("int32", y, (i,)) + E.const(1, "int32"))
    for start in (0, 3):
        m = Module(LoweredFunc("once", (y,), For(i, c64(start), n - c64(start), body, "parallel"), (n,), (y,)),
                   "llvm")
        for nt in (1, 2, 3, 7, RANGES, RANGES + 1, 2 * RANGES + 3):
            threads.set_num_threads(nt)
            for extent in (0, 1, 2, 63, 64, 65, 1000):
                out = np.zeros(extent + start, np.int32)
                m(out)
                want = np.r_[np.zeros(start, np.int32), np.ones(extent, np.int32)]
                np.testing.assert_array_equal(out, want, err_msg=f"{nt} threads, {extent} iterations from {start}")


def test_parallel_matmul_with_vector_rows(restore_threads):
    size = 48
    i, j, k = Var("int64", "i"), Var("int64", "j"), Var("int64", "k")
    a, b, c = (Buffer(nm, (c64(size), c64(size)), "float32") for nm in "ABC")
    init = For(j, ZERO, c64(size), Store(c, (i, j), E.const(0.0, "float32")), "vectorize")
    upd = For(k, ZERO, c64(size), For(j, ZERO, c64(size), Store(c, (i, j), Load("float32", c, (i, j)) + Load(
        "float32", a, (i, k)) * Load("float32", b, (k, j))), "vectorize"))
    m = Module(LoweredFunc("mm", (a, b, c), For(i, ZERO, c64(size), Block((init, upd)), "parallel"), (), (c,)),
               "llvm")
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((size, size)).astype(np.float32), rng.standard_normal((size, size)).astype(np.float32)
    out = np.zeros((size, size), np.float32)
    threads.set_num_threads(3)
    m(x, y, out)
    np.testing.assert_allclose(out, x @ y, rtol=1e-5, atol=1e-5)  # FMA contraction and summation order


def test_thread_count_precedence(restore_threads, monkeypatch):
    monkeypatch.setenv("CUVIL_NUM_THREADS", "3")
    assert threads.get_num_threads() == 3
    threads.set_num_threads(2)
    assert threads.get_num_threads() == 2  # set_num_threads wins over the environment
    threads.set_num_threads(None)
    monkeypatch.delenv("CUVIL_NUM_THREADS")
    assert threads.get_num_threads() == len(os.sched_getaffinity(0))  # all cores
    monkeypatch.setenv("CUVIL_NUM_THREADS", "zero")
    with pytest.raises(ArgumentError, match="CUVIL_NUM_THREADS"):
        threads.get_num_threads()
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ArgumentError, match="set_num_threads"):
            threads.set_num_threads(bad)


def test_nested_parallel_is_an_internal_error():
    n, i, j = Var("int64", "N"), Var("int64", "i"), Var("int64", "j")
    x = Buffer("X", (n, n), "float32")
    body = For(i, ZERO, n, For(j, ZERO, n, Store(x, (i, j), E.const(1.0, "float32")), "parallel"), "parallel")
    with pytest.raises(InternalError, match="nested"):
        codegen_llvm(LoweredFunc("k", (x,), body, (n,), (x,)), "llvm")


def test_stack_buffers_in_parallel_bodies_are_small():
    n, i, j = Var("int64", "N"), Var("int64", "i"), Var("int64", "j")
    x = Buffer("X", (n,), "float32")
    big = Buffer("T", (c64(PARALLEL_STACK_LIMIT // 4 + 1),), "float32", scope="local")
    body = Allocate(big, Block((For(j, ZERO, c64(4), Store(big, (j,), Cast("float32", j))),
                                Store(x, (i,), Load("float32", big, (c64(3),)) + Cast("float32", i)))))
    func = LoweredFunc("k", (x,), For(i, ZERO, n, body, "parallel"), (n,), (x,))
    text = codegen_llvm(func, "llvm")
    assert '@"aligned_alloc"' in text  # 16 KiB + 4 bytes: heap inside a parallel loop (stack elsewhere)
    out = np.zeros(50, np.float32)
    Module(func, "llvm")(out)
    np.testing.assert_array_equal(out, np.arange(50) + 3)


@pytest.mark.slow
def test_export_and_load_a_parallel_kernel(tmp_path):
    path = str(tmp_path / "rows.so")
    Module(parallel_rows(), "llvm").export_library(path)
    header = open(str(tmp_path / "rows.h")).read()
    assert "void rows_set_num_threads(int32_t n);" in header and "-lgomp" in header
    needed = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
    assert "libgomp" in needed
    script = textwrap.dedent(f"""
        import sys, numpy as np
        from cuvil.runtime import load, threads
        lib = load({path!r})
        assert "llvmlite" not in sys.modules
        for nt in (1, 3):
            threads.set_num_threads(nt)
            x = np.arange(700.0).reshape(100, 7)
            y = np.zeros_like(x)
            lib(x, y)
            np.testing.assert_array_equal(y, 2 * x + 1)
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "ok", proc.stderr
    assert load(path).name == "rows"


def test_remainder_uses_narrower_vectors():
    # a constant extent of 24: one 16-lane vector, then one 8-lane vector, and no scalar tail loop
    import cuvil
    from cuvil import te

    X = te.placeholder((24,), name="X")
    Y = te.compute((24,), lambda i: X[i] * 3.0 + 1.0, name="Y")
    s = te.create_schedule(Y)
    s[Y].vectorize(s[Y].op.axis[0])
    f = cuvil.build(s, [X, Y])
    text = f.get_source("llvm-unopt")
    assert "<16 x float>" in text and "<8 x float>" in text and ".tail" not in text
    x = np.arange(24, dtype=np.float32)
    y = np.empty_like(x)
    f(x, y)
    np.testing.assert_array_equal(y, x * np.float32(3) + np.float32(1))
    # a run-time extent: each remainder width is taken when it fits
    m = te.var("m")
    X2 = te.placeholder((m,), name="X2")
    Y2 = te.compute((m,), lambda i: X2[i] + 1.0, name="Y2")
    s2 = te.create_schedule(Y2)
    io, ii = s2[Y2].split(s2[Y2].op.axis[0], factor=32)
    s2[Y2].vectorize(ii)
    g = cuvil.build(s2, [X2, Y2])
    for n in range(0, 70):
        x = np.arange(n, dtype=np.float32)
        y = np.full(n, np.nan, np.float32)
        g(x, y)
        np.testing.assert_array_equal(y, x + 1)
