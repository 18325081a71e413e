"""LLVM code generation: every operator and dtype against numpy, loops, allocation, targets.

Loop IR is built by hand (no isl): ``elementwise`` makes a 1-D kernel over
``N`` elements with one output per expression.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reference import budget

from cuvil import dtype as dt
from cuvil.codegen.llvm import STACK_LIMIT, codegen_llvm, optimize
from cuvil.errors import CuvilError, TargetError
from cuvil.ir import expr as E
from cuvil.ir.expr import Binary, Call, Cast, Load, Select, TensorRead, Unary, Var
from cuvil.ir.stmt import Allocate, Block, Buffer, For, If, LetStmt, LoweredFunc, Store
from cuvil.runtime import Module
from cuvil.target import Target

INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOAT_DTYPES = ["float32", "float64"]
ZERO = E.const(0, "int64")


def elementwise(build, in_dtypes, name="k", kind="serial"):
    """A kernel ``Y_j[i] = build(X_0[i], X_1[i], ...)[j]`` over ``N`` elements.

    ``build`` returns a list of expressions (one output each); returns (func, n_outputs).
    """
    n = Var("int64", "N")
    i = Var("int64", "i")
    ins = [Buffer(f"X{k}", (n,), d) for k, d in enumerate(in_dtypes)]
    exprs = build(*[Load(b.dtype, b, (i,)) for b in ins])
    outs = [Buffer(f"Y{k}", (n,), e.dtype) for k, e in enumerate(exprs)]
    body = Block(tuple(Store(o, (i,), e) for o, e in zip(outs, exprs)))
    func = LoweredFunc(name, tuple(ins + outs), For(i, ZERO, n, body, kind), (n,), tuple(outs))
    return func


def run(func, *inputs):
    """Compile ``func`` and run it on ``inputs``; returns the outputs."""
    m = Module(func, "llvm")
    n = len(inputs[0])
    outs = [np.zeros(n, o.dtype) for o in func.outputs]
    m(*inputs, *outs)
    return outs


def random_values(dtype, n, rng):
    if dt.is_bool(dtype):
        return rng.integers(0, 2, n).astype(bool)
    if dt.is_int(dtype):
        info = np.iinfo(dtype)
        vals = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
        vals[:4] = [info.min, info.max, 0, 1]
        return vals
    return (rng.standard_normal(n) * 100).astype(dtype)


# -- arithmetic, bits and comparisons on every dtype --------------------------------------


@pytest.mark.parametrize("dtype", INT_DTYPES + FLOAT_DTYPES)
def test_arithmetic_and_comparisons(dtype):
    rng = np.random.default_rng(0)
    a, b = random_values(dtype, 257, rng), random_values(dtype, 257, rng)
    b[5] = a[5]  # some equal pairs for ==, <=, >=
    ops = ["add", "sub", "mul", "min", "max", "eq", "ne", "lt", "le", "gt", "ge"]
    if dt.is_int(dtype):
        ops += ["and", "or", "xor"]
    func = elementwise(lambda x, y: [Binary(x.dtype if o not in E.CMP_OPS else "bool", o, x, y) for o in ops],
                       [dtype, dtype])
    outs = run(func, a, b)
    ref = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "min": np.minimum, "max": np.maximum,
           "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
           "ge": np.greater_equal, "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}
    with np.errstate(all="ignore"):
        for o, got in zip(ops, outs):
            want = ref[o](a, b)
            if dt.is_float(dtype) and o in ("add", "sub", "mul"):
                np.testing.assert_allclose(got, want, rtol=1e-6 if dtype == "float32" else 1e-15, err_msg=o)
            else:
                np.testing.assert_array_equal(got, want, err_msg=f"{dtype} {o}")


def test_float_division():
    rng = np.random.default_rng(1)
    for dtype in FLOAT_DTYPES:
        a, b = random_values(dtype, 100, rng), random_values(dtype, 100, rng)
        (got,) = run(elementwise(lambda x, y: [x / y], [dtype, dtype]), a, b)
        np.testing.assert_array_equal(got, a / b)


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_unary_neg_and_not(dtype):
    a = random_values(dtype, 64, np.random.default_rng(2))
    neg, inv = run(elementwise(lambda x: [Unary(x.dtype, "neg", x), Unary(x.dtype, "not", x)], [dtype]), a)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(neg, (np.zeros_like(a) - a))
    np.testing.assert_array_equal(inv, ~a)


def test_bool_logic():
    a = np.array([0, 0, 1, 1], bool)
    b = np.array([0, 1, 0, 1], bool)
    func = elementwise(lambda x, y: [x & y, x | y, x ^ y, Unary("bool", "not", x), Binary("bool", "min", x, y),
                                     Binary("bool", "max", x, y), x == y, x < y], ["bool", "bool"])
    outs = run(func, a, b)
    for got, want in zip(outs, [a & b, a | b, a ^ b, ~a, a & b, a | b, a == b, a < b]):
        np.testing.assert_array_equal(got, want)


def test_unsigned_compares_unsigned():
    a = np.array([0, 1, 2**63, 2**64 - 1], np.uint64)
    b = np.array([2**64 - 1, 0, 1, 2**63], np.uint64)
    lt, mn = run(elementwise(lambda x, y: [x < y, E.minimum(x, y)], ["uint64", "uint64"]), a, b)
    np.testing.assert_array_equal(lt, a < b)
    np.testing.assert_array_equal(mn, np.minimum(a, b))


def test_nan_propagates_through_min_max_and_compares():
    nan = np.nan
    a = np.array([nan, 1.0, nan, -0.0, 2.0, -np.inf], np.float32)
    b = np.array([1.0, nan, nan, 0.0, 3.0, np.inf], np.float32)
    for dtype in FLOAT_DTYPES:
        x, y = a.astype(dtype), b.astype(dtype)
        mn, mx, ne, eq, lt = run(elementwise(lambda p, q: [E.minimum(p, q), E.maximum(p, q), p != q, p == q, p < q],
                                             [dtype, dtype]), x, y)
        np.testing.assert_array_equal(mn, np.minimum(x, y))
        np.testing.assert_array_equal(mx, np.maximum(x, y))
        np.testing.assert_array_equal(ne, x != y)  # unordered: NaN != NaN is true
        np.testing.assert_array_equal(eq, x == y)
        np.testing.assert_array_equal(lt, x < y)


# -- floor division and modulo ------------------------------------------------------------

_FLOORDIV_MODULES: dict[str, Module] = {}


def floordiv_module(dtype):
    if dtype not in _FLOORDIV_MODULES:
        _FLOORDIV_MODULES[dtype] = Module(elementwise(lambda x, y: [x // y, x % y], [dtype, dtype]), "llvm")
    return _FLOORDIV_MODULES[dtype]


def check_floordiv(dtype, a, b):
    m = floordiv_module(dtype)
    q, r = np.zeros_like(a), np.zeros_like(a)
    m(a, b, q, r)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(q, np.floor_divide(a, b), err_msg=f"{dtype} {a} // {b}")
        np.testing.assert_array_equal(r, np.remainder(a, b), err_msg=f"{dtype} {a} % {b}")
    if dt.is_float(dtype):  # the sign of zero results too
        with np.errstate(all="ignore"):
            np.testing.assert_array_equal(np.signbit(r), np.signbit(np.remainder(a, b)))


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_int_floordiv_edge_cases(dtype):
    info = np.iinfo(dtype)
    vals = sorted(v for v in {info.min, info.min + 1, -7, -1, 0, 1, 2, 7, info.max - 1, info.max}
                  if info.min <= v <= info.max)
    a = np.array([x for x in vals for _ in vals], dtype)
    b = np.array([y for _ in vals for y in vals], dtype)
    check_floordiv(dtype, a, b)  # zero divisors give 0; INT_MIN // -1 wraps; nothing traps


@budget(3)  # 60 examples under the ci profile
@given(st.sampled_from(["int8", "int32", "int64", "uint8", "uint64"]), st.data())
def test_int_floordiv_random(dtype, data):
    info = np.iinfo(dtype)
    ints = st.integers(int(info.min), int(info.max))
    pairs = data.draw(st.lists(st.tuples(ints, ints | st.sampled_from([0, -1 if info.min else 0, 1])),
                               min_size=1, max_size=20))
    a = np.array([p[0] for p in pairs], dtype)
    b = np.array([p[1] for p in pairs], dtype)
    check_floordiv(dtype, a, b)


@pytest.mark.parametrize("kind", ["serial", "vectorize"])
@pytest.mark.parametrize("dtype", INT_DTYPES)
@pytest.mark.slow
def test_int_floordiv_by_power_of_two(dtype, kind):
    """A constant power-of-two divisor is a shift right (arithmetic for a signed type) and a mask, which are
    floor division and modulo exactly, negative values included (MatMulNBits sign-extends its 4-bit weights
    with ``w * 2**(28 - 4j) // 2**28``); the largest power the type holds too, scalar and vectorised."""
    info = np.iinfo(dtype)
    bits = dt.bits(dtype) - (1 if dt.is_signed(dtype) else 0)
    rng = np.random.default_rng(0)
    edges = [v for v in (int(info.min), int(info.min) + 1, -7, -1, 0, 1, 7, int(info.max)) if info.min <= v]
    a = np.array(edges + [int(rng.integers(0, 1 << 62)) % (int(info.max) - int(info.min) + 1) + int(info.min)
                          for _ in range(40)], dtype=object).astype(dtype)
    for k in sorted({0, 1, 4, bits - 1}):
        d = 1 << k
        f = elementwise(lambda x, d=d: [x // E.const(d, dtype), x % E.const(d, dtype)], [dtype], kind=kind)
        q, r = run(f, a)
        np.testing.assert_array_equal(q, np.floor_divide(a, np.array(d).astype(dtype)), err_msg=f"// 2**{k}")
        np.testing.assert_array_equal(r, np.remainder(a, np.array(d).astype(dtype)), err_msg=f"% 2**{k}")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_float_floordiv_like_numpy(dtype):
    vals = [np.inf, -np.inf, 5.0, -5.0, 5.5, -5.5, 0.0, -0.0, np.nan, 1e300, 1e-300, 3.0, -3.0, 0.1, 7.0]
    with np.errstate(over="ignore"):  # 1e300 and 1e-300 become inf and 0 in float32
        a = np.array([x for x in vals for _ in vals], dtype)
        b = np.array([y for _ in vals for y in vals], dtype)
    check_floordiv(dtype, a, b)
    rng = np.random.default_rng(3)
    check_floordiv(dtype, random_values(dtype, 500, rng), random_values(dtype, 500, rng))


# -- float16 storage ------------------------------------------------------------------------


def test_float16_storage_computes_in_float32():
    rng = np.random.default_rng(4)
    a = (rng.standard_normal(300) * 10).astype(np.float16)
    b = (rng.standard_normal(300) * 10).astype(np.float16)
    f32 = np.float32
    func = elementwise(lambda x, y: [x + y, x * y, Cast("float32", x) / Cast("float32", y), E.maximum(x, y),
                                     Cast("float16", Cast("float32", x) * E.const(1.0 / 3.0, "float32")),
                                     Cast("float16", Cast("float64", x) * E.const(0.1, "float64"))],
                       ["float16", "float16"])
    add, mul, div, mx, third, tenth = run(func, a, b)
    np.testing.assert_array_equal(add, (a.astype(f32) + b.astype(f32)).astype(np.float16))
    np.testing.assert_array_equal(mul, (a.astype(f32) * b.astype(f32)).astype(np.float16))
    np.testing.assert_array_equal(div, a.astype(f32) / b.astype(f32))
    np.testing.assert_array_equal(mx, np.maximum(a, b))
    np.testing.assert_array_equal(third, (a.astype(f32) * f32(1 / 3)).astype(np.float16))
    np.testing.assert_array_equal(tenth, (a.astype(np.float64) * 0.1).astype(np.float16))


def test_cast_to_float16_then_compute_keeps_rounding():
    # (x cast to float16) + 0: the intermediate must be rounded to half, not kept as float
    a = np.array([1.0001, 3.14159, 65519.0, 1e-5], np.float32)
    func = elementwise(lambda x: [Cast("float32", Cast("float16", x))], ["float32"])
    (got,) = run(func, a)
    np.testing.assert_array_equal(got, a.astype(np.float16).astype(np.float32))


# -- casts ----------------------------------------------------------------------------------

ALL_DTYPES = ["bool", *INT_DTYPES, "float16", *FLOAT_DTYPES]


@pytest.mark.parametrize("src", ALL_DTYPES)
def test_casts_from(src):
    # values representable in every destination (0..100) plus negatives for signed/float sources
    vals = [0, 1, 2, 7, 100, 3]
    if dt.is_signed(src) or dt.is_float(src):
        vals += [-1, -100]
    if dt.is_float(src):
        vals += [2.5, -2.5, 0.7, -0.7]
    a = np.array(vals).astype(src) if src != "bool" else np.array([0, 1, 1, 0], bool)
    dsts = [d for d in ALL_DTYPES if d != src]
    outs = run(elementwise(lambda x: [Cast(d, x) for d in dsts], [src]), a)
    with np.errstate(all="ignore"):
        for d, got in zip(dsts, outs):
            want = a.astype(d)
            np.testing.assert_array_equal(got, want, err_msg=f"{src} -> {d}")


def test_float_to_bool_nan_is_true():
    a = np.array([0.0, -0.0, np.nan, 1e-40, -3.0], np.float32)
    (got,) = run(elementwise(lambda x: [Cast("bool", x)], ["float32"]), a)
    np.testing.assert_array_equal(got, a.astype(bool))


# -- math functions ---------------------------------------------------------------------------

# Tolerances in ULP against numpy on the same inputs.  float32 exp, log, tanh, erf and sigmoid
# are cuvil's own code (<= 1-2.5 ULP from the exact value, tests/codegen/test_vecmath.py); float64 ones
# and pow call glibc (< 1 ULP in practice); numpy dispatches to its own SIMD kernels on AVX-512/AVX2 hosts,
# which are accurate to a few ULP by design (measured here: up to 2).  The sum bounds the gap:
# 4 ULP.  sigmoid is a composite (exp, add, divide: three roundings in each implementation),
# so it gets 2 more.  sqrt, rsqrt (1/sqrt on both sides), abs and the rounding functions are
# exact and agree bit for bit.  erf is checked against math.erf in float64, rounded.
MATH = {
    "exp": (np.exp, (-80, 80)), "log": (np.log, (1e-3, 1e6)), "sqrt": (np.sqrt, (0, 1e6)),
    "rsqrt": (lambda x: 1 / np.sqrt(x), (1e-3, 1e6)), "tanh": (np.tanh, (-10, 10)),
    "sigmoid": (lambda x: 1 / (1 + np.exp(-x)), (-30, 30)), "abs": (np.abs, (-1e3, 1e3)),
    "floor": (np.floor, (-1e3, 1e3)), "ceil": (np.ceil, (-1e3, 1e3)), "round": (np.round, (-1e3, 1e3)),
    "trunc": (np.trunc, (-1e3, 1e3)),
}
MAX_ULP = {"float32": 4, "float64": 4}


def erf_reference(x):
    import math

    return np.array([math.erf(float(v)) for v in x])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_math_functions_within_ulp(dtype):
    rng = np.random.default_rng(5)
    names = [*MATH, "erf"]
    ranges = {**{k: v[1] for k, v in MATH.items()}, "erf": (-5, 5)}
    xs = [rng.uniform(*ranges[k], 400).astype(dtype) for k in names]
    for k, x in enumerate(xs):
        if names[k] in ("floor", "ceil", "round", "trunc"):
            x[:6] = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5]  # halves: round is half to even
    func = elementwise(lambda *ins: [Call(dtype, name, (v,)) for name, v in zip(names, ins)], [dtype] * len(names))
    outs = run(func, *xs)
    for name, x, got in zip(names, xs, outs):
        want = erf_reference(x).astype(dtype) if name == "erf" else MATH[name][0](x).astype(dtype)
        np.testing.assert_array_max_ulp(got, want, maxulp=MAX_ULP[dtype] + (2 if name == "sigmoid" else 0))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_pow_and_isnan(dtype):
    rng = np.random.default_rng(6)
    x = rng.uniform(0.01, 10, 200).astype(dtype)
    y = rng.uniform(-3, 3, 200).astype(dtype)
    x[:3] = [np.nan, 1.0, 0.0]
    p, isn = run(elementwise(lambda a, b: [Call(dtype, "pow", (a, b)), Call("bool", "isnan", (a,))],
                             [dtype, dtype]), x, y)
    with np.errstate(divide="ignore"):
        np.testing.assert_array_max_ulp(p, np.power(x, y), maxulp=MAX_ULP[dtype])
    np.testing.assert_array_equal(isn, np.isnan(x))


# -- select only evaluates the chosen side ------------------------------------------------------


def test_select_does_not_evaluate_the_other_side():
    # C[i] = i < 3 ? A[i + 10^12] : A[i]  -- the chosen side is in bounds; the other would fault
    n, i = Var("int64", "N"), Var("int64", "i")
    a, c = Buffer("A", (n,), "float32"), Buffer("C", (n,), "float32")
    far = Load("float32", a, (i + E.const(10**12, "int64"),))
    near = Load("float32", a, (i,))
    val = Select("float32", i >= E.const(0, "int64"), near, far)  # always the near side
    d = Var("int64", "d")
    divide = Select("int64", d != E.const(0, "int64"), i // d, E.const(-1, "int64"))
    body = Store(c, (i,), val + Cast("float32", divide))
    func = LoweredFunc("sel", (a, c, d), For(i, ZERO, n, body), (n, d), (c,))
    m = Module(func, "llvm")
    x = np.arange(8, dtype=np.float32)
    out = np.zeros_like(x)
    m(x, out, 0)
    np.testing.assert_array_equal(out, x - 1)
    assert "br i1" in m.get_source("llvm-unopt")


def test_select_without_memory_is_a_plain_select():
    one, minus_one = E.const(1.0, "float32"), E.const(-1.0, "float32")
    func = elementwise(lambda x: [Select("float32", x > E.const(0.0, "float32"), one, minus_one) * x], ["float32"])
    text = codegen_llvm(func, "llvm")
    assert re.search(r"select\s+i1", text) and "sel.t" not in text
    (got,) = run(func, np.array([-2.0, 3.0], np.float32))
    np.testing.assert_array_equal(got, [2.0, 3.0])


# -- loops, statements, allocation -------------------------------------------------------------


def matmul_func(dtype="float32"):
    m_, n_, k_ = Var("int64", "M"), Var("int64", "N"), Var("int64", "K")
    i, j, k = Var("int64", "i"), Var("int64", "j"), Var("int64", "k")
    a, b, c = Buffer("A", (m_, k_), dtype), Buffer("B", (k_, n_), dtype), Buffer("C", (m_, n_), dtype)
    update = Store(c, (i, j), Load(dtype, c, (i, j)) + Load(dtype, a, (i, k)) * Load(dtype, b, (k, j)))
    body = For(i, ZERO, m_, For(j, ZERO, n_, Block((Store(c, (i, j), E.const(0, dtype)), For(k, ZERO, k_, update)))))
    return LoweredFunc("matmul", (a, b, c), body, (m_, n_, k_), (c,))


@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 5, 3), (33, 17, 64), (0, 4, 4)])
def test_matmul_with_size_vars(shape):
    m, n, k = shape
    rng = np.random.default_rng(7)
    mod = Module(matmul_func("float64"), "llvm")
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    c = np.full((m, n), np.nan)
    mod(a, b, c)
    np.testing.assert_allclose(c, a @ b, rtol=1e-12, atol=1e-12)


def test_loop_kinds_and_metadata():
    # unroll with a run-time extent is a plain loop (LLVM's unroller decides; metadata only made it
    # warn); vectorize is explicit vector code and parallel is a GOMP_parallel launch
    # (tests/codegen/test_simd_threads.py tests both in depth)
    for kind, key in [("unroll", "br label"), ("vectorize", "x float>"),
                      ("parallel", "@\"GOMP_parallel\"")]:
        func = elementwise(lambda x: [x + x], ["float32"], kind=kind)
        text = codegen_llvm(func, "llvm")
        assert key in text
        assert "llvm.loop.unroll" not in text
        optimize(text, "llvm")  # parses and verifies
        (got,) = run(func, np.arange(37, dtype=np.float32))
        np.testing.assert_array_equal(got, 2 * np.arange(37, dtype=np.float32))


def test_nonzero_loop_min_if_else_and_let():
    n, i = Var("int64", "N"), Var("int64", "i")
    a, c = Buffer("A", (n,), "int32"), Buffer("C", (n,), "int32")
    t = Var("int32", "t")
    x = Load("int32", a, (i,))
    body = LetStmt(t, x * E.const(3, "int32"), If(x > E.const(2, "int32"), Store(c, (i,), t),
                                                   Store(c, (i,), -t)))
    func = LoweredFunc("k", (a, c), Block((For(i, E.const(2, "int64"), n - E.const(2, "int64"), body),
                                          If(n > E.const(0, "int64"), Store(c, (ZERO,), E.const(99, "int32"))))),
                       (n,), (c,))
    a_ = np.arange(6, dtype=np.int32)
    out = np.zeros_like(a_)
    Module(func, "llvm")(a_, out)
    np.testing.assert_array_equal(out, [99, 0, -6, 9, 12, 15])  # i in [2, 2 + (N - 2))


def scratch_func(shape_of_tmp, n_elems_expr=None):
    """C[i] = T[i] + 1 where T[i] = 2 * A[i], T allocated with ``shape_of_tmp``."""
    n, i, j = Var("int64", "N"), Var("int64", "i"), Var("int64", "j")
    a, c = Buffer("A", (n,), "float32"), Buffer("C", (n,), "float32")
    tmp = Buffer("T", shape_of_tmp(n), "float32", scope="local")
    fill = For(i, ZERO, n, Store(tmp, (i,), Load("float32", a, (i,)) * E.const(2.0, "float32")))
    use = For(j, ZERO, n, Store(c, (j,), Load("float32", tmp, (j,)) + E.const(1.0, "float32")))
    return LoweredFunc("scratch", (a, c), Allocate(tmp, Block((fill, use))), (n,), (c,))


@pytest.mark.parametrize("where, shape", [
    ("stack", lambda n: (E.const(64, "int64"),)),
    ("heap", lambda n: (n,)),
    ("heap", lambda n: (E.const(STACK_LIMIT // 4 + 1, "int64"),)),
])
def test_allocate_stack_and_heap(where, shape):
    func = scratch_func(shape)
    text = codegen_llvm(func, "llvm")
    assert ("alloca float, i64 64" in text) == (where == "stack")
    assert ("@\"aligned_alloc\"(i64 64" in text and "@\"free\"" in text) == (where == "heap")  # cache-line aligned
    a = np.arange(50, dtype=np.float32)
    out = np.zeros_like(a)
    Module(func, "llvm")(a, out)
    np.testing.assert_array_equal(out, 2 * a + 1)


def test_unlowered_nodes_are_internal_errors():
    tensor = SimpleNamespace(name="T")
    func = elementwise(lambda x: [x + TensorRead("float32", tensor, (ZERO,))], ["float32"])
    with pytest.raises(CuvilError, match="internal error.*TensorRead"):
        codegen_llvm(func, "llvm")
    free = elementwise(lambda x: [x + Cast("float32", Var("int64", "ghost"))], ["float32"])
    with pytest.raises(CuvilError, match="ghost"):
        codegen_llvm(free, "llvm")


def test_constants_of_every_dtype():
    consts = [E.const(v, d) for d, v in [("int8", -128), ("uint8", 255), ("uint64", 2**64 - 1), ("int64", -2**63),
                                          ("float16", 0.1), ("float32", np.inf), ("float64", np.nan), ("bool", True)]]
    func = elementwise(lambda x: [c for c in consts], ["float32"])
    outs = run(func, np.zeros(2, np.float32))
    for c, got in zip(consts, outs):
        np.testing.assert_array_equal(got, np.array([c.value] * 2).astype(c.dtype))


# -- targets and the pipeline ----------------------------------------------------------------------


def test_host_target_and_asm():
    t = Target("llvm")
    assert t is Target.current() and t is Target(t)
    assert t.is_host and t.cpu and t.triple
    assert t.canonical.startswith(f"llvm -mtriple={t.triple} -mcpu={t.cpu}")
    assert t.vector_bits in (128, 256, 512) and t.num_cores >= 1 and t.l1_size > 0 and t.l3_size >= t.l2_size
    assert t.vector_registers in (16, 32) and t.fma_units >= 1
    assert t.peak_flops_per_cycle() == t.vector_lanes(32) * t.fma_units * 2
    a76 = Target("llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a76")
    assert (a76.vector_bits, a76.vector_registers, a76.fma_units) == (128, 32, 2)
    from cuvil.cli import main

    assert main(["info"]) == 0
    m = Module(elementwise(lambda x, y: [x * y + x], ["float32", "float32"]), "llvm")
    asm = m.get_source("asm")
    assert "k:" in asm and "ret" in asm
    assert "define" in m.get_source("llvm") and "target-cpu" in m.get_source("llvm-unopt")
    assert "for (i = 0; i < N; i++)" in m.get_source("loops")


def test_cross_target_codegen():
    t = Target("llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a76 -mattr=+neon")
    assert not t.is_host and t.vector_bits == 128 and "+neon" in t.canonical.split("-mattr=")[1].split(",")
    m = Module(elementwise(lambda x, y: [x + y], ["float32", "float32"]), t)
    assert "fadd" in m.get_source("asm") or "add" in m.get_source("asm")
    with pytest.raises(TargetError, match="not this machine"):
        m(np.zeros(2, np.float32), np.zeros(2, np.float32), np.zeros(2, np.float32))


@pytest.mark.parametrize("spec, message", [
    ("", "empty"), ("gpu", "unknown target kind"), ("llvm -mcpu", "unknown option"),
    ("llvm -mtriple=nonsense-arch-none", "no backend"), ("llvm -mattr=avx2", r"\+name"),
    ("cuda -arch=volta", "sm_90"),
])
def test_bad_targets(spec, message):
    with pytest.raises(TargetError, match=message):
        Target(spec)


def test_cuda_target_parses_but_does_not_build():
    t = Target("cuda -arch=sm_90")
    assert t.kind == "cuda" and t.canonical == "cuda -arch=sm_90"
    with pytest.raises(TargetError):
        codegen_llvm(elementwise(lambda x: [x], ["float32"]), t)

