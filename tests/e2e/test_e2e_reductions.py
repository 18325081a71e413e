"""End to end: reductions over random axes, compiled and compared with numpy.

Tolerances: max/min are exact (no rounding).  A float sum of n terms, in any
order and with or without FMA, errs by at most gamma_n * sum|x_i| (Higham,
"Accuracy and Stability of Numerical Algorithms", 4.2); the reference is the
float64 sum, so ``|got - ref| <= 2 * gamma_n * sum|x_i|`` for float64 results
and the float64 reference error is negligible for float32 ones.  This bound
scales with the terms, not the result, so cancellation cannot make it flake,
while a dropped, repeated or misplaced term is off by ~|x_i| >> n * eps * sum|x|.
A product of n factors errs by at most gamma_n * |product|.  Integers are exact
(sums and products wrap like numpy with the output dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st
from reference import (
    assert_bounded,
    assert_exact,
    budget,
    compile_and_run,
    gamma,
    random_array,
    random_floats,
)

from cuvil import te

pytestmark = pytest.mark.usefixtures("each_schedule")  # the te order and auto_schedule

prod = te.comm_reducer(lambda x, y: x * y, lambda t: 1, name="prod")

NP = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def identity(kind: str, dtype: str) -> Any:
    if kind == "sum":
        return 0
    if kind == "prod":
        return 1
    if dtype.startswith("float"):
        return -np.inf if kind == "max" else np.inf
    info = np.iinfo(dtype)
    return info.min if kind == "max" else info.max


def te_reduce(kind: str, expr: Any, axes: list[Any], where: Any) -> Any:
    f = {"sum": te.sum, "max": te.max, "min": te.min, "prod": prod}[kind]
    return f(expr, axis=axes if len(axes) > 1 else axes[0], where=where)


@dataclass
class Case:
    kind: str
    dtype: str
    shape: tuple[int, ...]
    axes: tuple[int, ...]
    keepdims: bool
    where: str  # "none" | "data" (x > 0) | "index" (an affine condition on the axes)
    lo: tuple[int, ...]  # the reduction range of each reduced axis is [lo, shape)
    seed: int


@st.composite
def cases(draw: Any) -> Case:
    kind = draw(st.sampled_from(["sum", "max", "min", "prod"]))
    dtypes = ["float32", "float64", "int32", "int64"] + (["float16", "int8", "uint8"] if kind in ("max", "min")
                                                         else [])
    dtype = draw(st.sampled_from(dtypes))
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=rank, max_size=rank)))
    if draw(st.integers(0, 2)) == 0:  # a long dimension: vectorised loops and their tails
        d = draw(st.integers(0, rank - 1))
        shape = shape[:d] + (draw(st.sampled_from([16, 37, 100])),) + shape[d + 1:]
    axes = tuple(sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1))))
    lo = tuple(draw(st.integers(0, shape[a] - 1)) if draw(st.integers(0, 3)) == 0 else 0 for a in axes)
    return Case(kind, dtype, shape, axes, draw(st.booleans()), draw(st.sampled_from(["none", "data", "index"])),
                lo, draw(st.integers(0, 2**32 - 1)))


def run_case(c: Case) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(c.seed)
    if c.kind == "prod" and c.dtype.startswith("float"):
        x = random_floats(rng, c.shape, c.dtype, lo=0.5, hi=2.0, special=0.1)  # no under/overflow
        x = x * np.where(rng.random(c.shape) < 0.3, -1, 1).astype(c.dtype)
    elif c.dtype.startswith("float"):
        x = random_floats(rng, c.shape, c.dtype, nan=0.02 if c.kind != "prod" else 0.0)
    else:
        x = random_array(rng, c.shape, c.dtype)
    X = te.placeholder(c.shape, c.dtype, "x")
    raxes = {a: te.reduce_axis((lo, c.shape[a]), f"k{a}") for a, lo in zip(c.axes, c.lo)}
    kept = [d for d in range(len(c.shape)) if d not in raxes]
    out_shape = tuple(1 if d in raxes else c.shape[d] for d in range(len(c.shape))) if c.keepdims else \
        tuple(c.shape[d] for d in kept)

    def body(*i: Any) -> Any:
        pos = dict(zip(range(len(c.shape)), i)) if c.keepdims else dict(zip(kept, i))
        idx = tuple(raxes[d] if d in raxes else pos[d] for d in range(len(c.shape)))
        cond = None
        if c.where == "data":
            cond = X[idx] > te.const(0, c.dtype)
        elif c.where == "index":  # a triangle: the reduced indices sum to at most an output index
            first_kept = pos[kept[0]] if kept else 2
            cond = sum(raxes.values()) <= first_kept + 1
        return te_reduce(c.kind, X[idx], list(raxes.values()), cond)

    Y = te.compute(out_shape, body, name="y")
    (got,) = compile_and_run([Y], {X: x})
    return got, x


def numpy_case(c: Case, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(reference, bound): the masked reduction in float64 (floats) or the dtype (ints)."""
    rank = len(c.shape)
    grids = np.meshgrid(*[np.arange(s) for s in c.shape], indexing="ij")
    mask = np.ones(c.shape, bool)
    for a, lo in zip(c.axes, c.lo):
        mask &= grids[a] >= lo
    if c.where == "data":
        with np.errstate(invalid="ignore"):
            mask &= x > 0
    elif c.where == "index":
        kept = [d for d in range(rank) if d not in c.axes]
        first_kept = grids[kept[0]] if kept else 2
        mask &= sum(grids[a] for a in c.axes) <= first_kept + 1
    ident = identity(c.kind, c.dtype)
    ufunc = NP[c.kind]
    if c.dtype.startswith("float"):
        xm = np.where(mask, x.astype(np.float64), ident)
        ref = ufunc.reduce(xm, axis=c.axes, keepdims=c.keepdims)
        n = max(1, int(np.prod([c.shape[a] for a in c.axes])))
        if c.kind == "sum":
            bound = gamma(n, c.dtype) * np.add.reduce(np.abs(np.where(mask, xm, 0.0)), axis=c.axes,
                                                      keepdims=c.keepdims)
        elif c.kind == "prod":
            bound = gamma(n, c.dtype) * np.abs(ref)
        else:
            bound = np.zeros_like(ref)
        return ref, bound
    xm = np.where(mask, x, np.array(ident).astype(c.dtype))
    with np.errstate(all="ignore"):
        ref = ufunc.reduce(xm, axis=c.axes, keepdims=c.keepdims, dtype=c.dtype)
    return np.asarray(ref), np.zeros(())


@budget(1.5)
@given(cases())
def test_random_reductions(c: Case) -> None:
    note(repr(c))
    got, x = run_case(c)
    ref, bound = numpy_case(c, x)
    if c.dtype.startswith("float"):
        assert_bounded(got, ref, bound, what=repr(c))
    else:
        assert_exact(got, np.array(ref), repr(c))


def test_nan_in_masked_out_elements_does_not_propagate() -> None:
    x = np.array([[np.nan, 1.0, 2.0], [3.0, np.nan, -1.0]], np.float32)
    X = te.placeholder((2, 3), "float32", "x")
    k = te.reduce_axis((0, 3), "k")
    S = te.compute((2,), lambda i: te.sum(X[i, k], axis=k, where=k != i), name="s")
    k2 = te.reduce_axis((0, 3), "k2")
    M = te.compute((2,), lambda i: te.max(X[i, k2], axis=k2), name="m")
    k3 = te.reduce_axis((0, 3), "k3")
    N = te.compute((2,), lambda i: te.min(X[i, k3], axis=k3, where=~te.isnan(X[i, k3])), name="n")
    s, m, n = compile_and_run([S, M, N], {X: x})
    assert_exact(s, np.array([3.0, 2.0], np.float32), "sum where k != i")
    assert_exact(m, np.array([np.nan, np.nan], np.float32), "max propagates NaN")
    assert_exact(n, np.array([1.0, -1.0], np.float32), "min over non-NaN")


@pytest.mark.parametrize("kind", ["sum", "max", "min", "prod"])
@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_empty_reduction_gives_identity(kind: str, dtype: str) -> None:
    """A reduction over an empty range (and one whose where= is never true) yields the identity."""
    X = te.placeholder((3, 4), dtype, "x")
    e = te.reduce_axis((2, 2), "e")
    Y = te.compute((3,), lambda i: te_reduce(kind, X[i, e], [e], None), name="y")
    k = te.reduce_axis((0, 4), "k")
    Z = te.compute((3,), lambda i: te_reduce(kind, X[i, k], [k], k > 10), name="z")
    x = np.arange(12).reshape(3, 4).astype(dtype)
    y, z = compile_and_run([Y, Z], {X: x})
    want = np.full(3, identity(kind, dtype)).astype(dtype)
    assert_exact(y, want, f"{kind} over an empty axis")
    assert_exact(z, want, f"{kind} with where= never true")


def test_sum_of_expression_and_mean_stage() -> None:
    """A reduction of an expression (sum of squares), then an element-wise stage that reads it (mean)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 37)).astype(np.float32)
    X = te.placeholder((5, 37), "float32", "x")
    k = te.reduce_axis((0, 37), "k")
    S = te.compute((5,), lambda i: te.sum(X[i, k] * X[i, k], axis=k), name="ssq")
    M = te.compute((5,), lambda i: te.sqrt(S[i] / 37.0), name="rms")
    (got,) = compile_and_run([M], {X: x})
    x64 = x.astype(np.float64)
    ref = np.sqrt((x64 * x64).sum(1) / 37)
    # ssq: gamma_{2n} relative (all terms >= 0); divide and sqrt add ~2 eps, sqrt halves relative errors
    assert_bounded(got, ref, (gamma(2 * 37, "float32") + 2 * gamma(1, "float32")) * ref, what="rms")


def test_sum_in_float64_keeps_small_terms() -> None:
    """1e16 + 1 + ... - 1e16 in float64 sequential order: checks the accumulator is float64, not float32."""
    x = np.array([1.0, 1e16, 1.0, 1.0, -1e16, 1.0], np.float64)
    X = te.placeholder((6,), "float64", "x")
    k = te.reduce_axis((0, 6), "k")
    Y = te.compute((1,), lambda i: te.sum(X[k], axis=k), name="y")
    (got,) = compile_and_run([Y], {X: x})
    ref = np.float64(0)
    for v in x:  # the sequential sum, which cuvil must not reassociate (DESIGN: no reassociation)
        ref += v
    assert_exact(got, np.array([ref]), "sequential float64 sum")


def test_int_sum_wraps_in_the_output_dtype() -> None:
    x = np.full((4, 3), 2**30, np.int32)
    X = te.placeholder((4, 3), "int32", "x")
    k = te.reduce_axis((0, 4), "k")
    Y = te.compute((3,), lambda j: te.sum(X[k, j], axis=k), name="y")
    (got,) = compile_and_run([Y], {X: x})
    assert_exact(got, x.sum(0, dtype=np.int32), "int32 wrap")
    assert (got == 0).all()


def test_argmax_style_two_stage_reduction() -> None:
    """max, then the first index attaining it via a min-reduction with where= (ties resolved to the smallest)."""
    rng = np.random.default_rng(2)
    x = rng.integers(0, 4, (6, 9)).astype(np.float32)
    X = te.placeholder((6, 9), "float32", "x")
    k = te.reduce_axis((0, 9), "k")
    M = te.compute((6,), lambda i: te.max(X[i, k], axis=k), name="m")
    k2 = te.reduce_axis((0, 9), "k2")
    A = te.compute((6,), lambda i: te.min(k2.astype("int32"), axis=k2, where=X[i, k2] == M[i]), name="argmax")
    (got,) = compile_and_run([A], {X: x})
    assert_exact(got, x.argmax(1).astype(np.int32), "argmax")
