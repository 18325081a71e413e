"""cuvil's own float32 exp/log/tanh/erf/sigmoid (cuvil/codegen/vecmath.py).

Accuracy is measured against a float64 reference (numpy's float64 functions,
math.erf), as the error of the float32 result in ULP of the exact value:
``|got - exact| / ulp(exact)``, ulp of a subnormal being 2^-149.  Measured with
``tools``-style dense sampling (every 37th float32 bit pattern, both signs, plus a
2M-point grid on [-100, 100]: 117M points) the maxima are below the bounds here;
the tests sample every 2003rd bit pattern (2.1M points per function) to stay fast.
Against numpy's own float32 kernels the integer ULP distance also includes
numpy's error (its AVX-512 exp/log are up to 2-3 ULP off on their own), so it is
checked with a looser bound.

The vector body and the scalar code use the same IR (vecmath is called on vectors
and on scalars), so a vectorised loop and its scalar epilogue agree bit for bit.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reference import budget

from cuvil.codegen.llvm import simd_bits
from cuvil.ir import expr as E
from cuvil.ir.expr import Call, Load, Var
from cuvil.ir.stmt import Buffer, For, LoweredFunc, Store
from cuvil.runtime import Module
from cuvil.target import Target

NAMES = ["exp", "log", "tanh", "erf", "sigmoid"]
# maximum error against the exact (float64) value, in ULP; measured maxima in docs/codegen.md
BOUND_EXACT = {"exp": 1.5, "log": 1.5, "tanh": 1.5, "erf": 1.5, "sigmoid": 2.5}
# maximum integer ULP distance from numpy's float32 result (ours + numpy's own error)
BOUND_NUMPY = {"exp": 4, "log": 4, "tanh": 3, "sigmoid": 5}


def _erf64(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def _sigmoid64(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


REF64 = {"exp": np.exp, "log": np.log, "tanh": np.tanh, "erf": _erf64, "sigmoid": _sigmoid64}
NUMPY32 = {"exp": np.exp, "log": np.log, "tanh": np.tanh, "sigmoid": lambda x: 1 / (1 + np.exp(-x))}
_MODULES: dict[tuple[str, str, str], Module] = {}


def module(name: str, kind: str = "vectorize", dtype: str = "float32") -> Module:
    """``kind for (i = 0; i < N; i++) Y[i] = name(X[i])``, compiled once per session."""
    key = (name, kind, dtype)
    if key not in _MODULES:
        n, i = Var("int64", "N"), Var("int64", "i")
        x, y = Buffer("X", (n,), dtype), Buffer("Y", (n,), dtype)
        body = Store(y, (i,), Call(dtype, name, (Load(dtype, x, (i,)),)))
        func = LoweredFunc(f"vm_{name}", (x, y), For(i, E.const(0, "int64"), n, body, kind), (n,), (y,))
        _MODULES[key] = Module(func, "llvm")
    return _MODULES[key]


def run(name: str, x: np.ndarray, kind: str = "vectorize") -> np.ndarray:
    y = np.empty_like(x)
    module(name, kind, str(x.dtype))(x, y)
    return y


def ulp_error(got: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """|got - exact| in ULP of float32 at ``exact`` (float64); 0 where both are NaN or got is the inf
    that ``exact`` rounds to (beyond the float32 range)."""
    with np.errstate(over="ignore"):
        overflow = np.isinf(got) & (got == exact.astype(np.float32))
    got = got.astype(np.float64)
    ulp = np.maximum(np.ldexp(1.0, np.frexp(exact)[1] - 24), 2.0**-149)
    with np.errstate(invalid="ignore"):
        err = np.abs(got - exact) / ulp
    same = (got == exact) | (np.isnan(got) & np.isnan(exact)) | overflow
    return np.where(same, 0.0, np.where(np.isfinite(err), err, np.inf))


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Number of float32 values between ``a`` and ``b`` (0 when both are NaN)."""
    def ordered(v):
        i = v.astype(np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)

    d = np.abs(ordered(a) - ordered(b))
    return np.where(np.isnan(a) & np.isnan(b), 0, np.where(np.isnan(a) | np.isnan(b), 1 << 40, d))


def dense_samples() -> np.ndarray:
    bits = np.arange(0, 0x7F800000, 2003, dtype=np.int64).astype(np.uint32).view(np.float32)
    return np.concatenate([bits, -bits, np.linspace(-100, 100, 200_001, dtype=np.float32)])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow
def test_ulp_error_over_dense_float32_samples(name):
    x = dense_samples()
    if name == "erf":  # math.erf is slow; |x| >= 4 is exactly +-1 (tested below)
        x = x[np.abs(x) < 4.5]
    got = run(name, x)
    with np.errstate(all="ignore"):
        exact = REF64[name](x.astype(np.float64))
    err = ulp_error(got, exact)
    worst = int(np.argmax(err))
    assert err[worst] <= BOUND_EXACT[name], (name, x[worst], got[worst], exact[worst], err[worst])
    if name in NUMPY32:
        with np.errstate(all="ignore"):
            theirs = NUMPY32[name](x)
        keep = x > -87 if name == "sigmoid" else np.ones(len(x), bool)  # numpy's 1/(1+exp(-x)) flushes to 0 there
        dist = ulp_distance(got[keep], theirs[keep])
        assert dist.max() <= BOUND_NUMPY[name], (name, x[keep][np.argmax(dist)], dist.max())


INF, NAN = np.inf, np.nan
# (x, f(x)); None: the float64 reference, within BOUND_EXACT (e.g. subnormal results)
SPECIAL = {
    "exp": [(INF, INF), (-INF, 0.0), (NAN, NAN), (0.0, 1.0), (-0.0, 1.0), (88.7229, INF), (1e30, INF),
            (-104.0, 0.0), (-1e30, 0.0), (-103.0, None), (-90.0, None),
            (88.72283, None), (1e-45, 1.0)],
    "log": [(0.0, -INF), (-0.0, -INF), (-1.0, NAN), (-INF, NAN), (-1e-45, NAN), (INF, INF), (NAN, NAN), (1.0, 0.0),
            (1e-45, None), (1e-40, None), (3.4028235e38, None)],
    "tanh": [(INF, 1.0), (-INF, -1.0), (NAN, NAN), (0.0, 0.0), (-0.0, -0.0), (1e-45, 1e-45), (-1e-30, -1e-30),
             (1e-20, 1e-20), (20.0, 1.0), (-1e30, -1.0)],
    "erf": [(INF, 1.0), (-INF, -1.0), (NAN, NAN), (0.0, 0.0), (-0.0, -0.0), (4.0, 1.0), (-10.0, -1.0),
            (1e-30, None)],
    "sigmoid": [(INF, 1.0), (-INF, 0.0), (NAN, NAN), (0.0, 0.5), (-0.0, 0.5), (-1e30, 0.0), (1e30, 1.0),
                (-90.0, None), (-104.0, 0.0), (20.0, None)],
}


@pytest.mark.parametrize("name", NAMES)
def test_special_values(name):
    xs = np.array([x for x, _ in SPECIAL[name]], np.float32)
    with np.errstate(all="ignore"):
        ref = REF64[name](xs.astype(np.float64))
    want = np.array([r if w is None else w for (_, w), r in zip(SPECIAL[name], ref)])
    exact = np.array([w is not None for _, w in SPECIAL[name]])
    for kind in ("vectorize", "serial"):
        with np.errstate(all="ignore"):
            got = run(name, xs, kind)
        np.testing.assert_array_equal(got[exact], want[exact].astype(np.float32), err_msg=f"{name} ({kind}) of {xs}")
        np.testing.assert_array_equal(np.signbit(got[exact]), np.signbit(want[exact]), err_msg=f"{name} ({kind})")
        assert np.max(ulp_error(got[~exact], want[~exact]), initial=0) <= BOUND_EXACT[name], (name, kind, xs[~exact], got[~exact])


@pytest.mark.parametrize("name", NAMES)
def test_vector_body_tail_and_serial_agree_bit_for_bit(name):
    lanes = simd_bits(Target("llvm")) // 32
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(40 * max(lanes, 1) + max(lanes - 1, 1)) * 20).astype(np.float32)
    # and the ends of exp's range: subnormal results, overflow (the vector scaling may be one instruction)
    x = np.concatenate([x, np.linspace(-106, 90, 64 * max(lanes, 1), dtype=np.float32)])
    if name == "log":
        x = np.abs(x)
    whole = run(name, x)  # vector body, then a scalar epilogue of lanes - 1 elements
    np.testing.assert_array_equal(whole, run(name, x, "serial"))
    if lanes >= 2:  # chunks shorter than one vector run entirely in the scalar epilogue
        k = lanes - 1
        tail = np.concatenate([run(name, x[s:s + k]) for s in range(0, len(x), k)])
        np.testing.assert_array_equal(whole, tail)


@pytest.mark.parametrize("name", NAMES)
def test_no_libm_calls_in_vector_code(name):
    m = module(name)
    asm = m.get_source("asm")
    calls = [ln for ln in asm.splitlines() if re.search(r"\bcall", ln)]
    # no expf/logf/tanhf/erff: the only calls are the entry points' (plain and checked) to the body
    assert len(calls) == len(re.findall(r"movabsq\s+\$vm_\w+\.body,", asm)) <= 2, calls
    llvm = m.get_source("llvm")
    assert not [ln for ln in llvm.splitlines() if ln.startswith("declare") and "@llvm." not in ln]
    if simd_bits(Target("llvm")) >= 128:
        assert "<4 x float>" in llvm or "<8 x float>" in llvm or "<16 x float>" in llvm


@budget(1.5)  # 30 examples under the ci profile
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=70),
       st.sampled_from(NAMES))
def test_random_inputs(values, name):
    x = np.array(values, np.float32)
    got = run(name, x)
    np.testing.assert_array_equal(got, run(name, x, "serial"))
    with np.errstate(all="ignore"):
        exact = REF64[name](x.astype(np.float64))
    assert ulp_error(got, exact).max() <= BOUND_EXACT[name], (name, x)


@pytest.mark.parametrize("name", NAMES)
def test_float64_falls_back_to_libm_and_stays_correct(name):
    rng = np.random.default_rng(4)
    x = rng.uniform(-20, 20, 203)
    if name == "log":
        x = np.abs(x)
    x[:4] = [np.nan, np.inf, -np.inf, 0.0]
    with np.errstate(all="ignore"):
        got, want = run(name, x), REF64[name](x)
    np.testing.assert_array_max_ulp(got, want, maxulp=4)
