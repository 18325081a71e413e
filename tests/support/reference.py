"""Helpers for the end-to-end tests: compile a te program, run it, compare with numpy.

Comparison policy (used by every e2e test):

- integers and bools are compared exactly (cuvil wraps like numpy);
- a float result is checked against a float64 numpy reference ``ref`` and an
  error ``bound`` derived from a forward error analysis of the computation
  (``|got - exact| <= bound`` must hold for cuvil and ``|ref - exact| <= bound``
  for numpy, so ``|got - ref| <= 2 * bound``).  The bound is rigorous to first
  order, so the checks cannot flake on a legal rounding difference (FMA
  contraction, another libm), yet a wrong element, a missing term or a
  misplaced index is off by far more than a few ULP of the operands;
- NaN positions must match exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from hypothesis import settings

import cuvil
from cuvil import te

FLOATS = ("float16", "float32", "float64")


# ---------------------------------------------------------------------------
# budgets
# ---------------------------------------------------------------------------


def budget(fraction: float = 1.0) -> settings:
    """``@settings`` with ``fraction`` of the loaded profile's examples (at least 3)."""
    return settings(max_examples=max(3, round(settings.default.max_examples * fraction)))


# ---------------------------------------------------------------------------
# building and running
# ---------------------------------------------------------------------------


SCHEDULES = ("te", "auto")
SCHEDULE = "te"  # which one build() uses: set per test module by conftest's ``each_schedule`` fixture


def build(outputs: Any, args: Sequence[Any]) -> Any:
    """``outputs`` compiled for the host CPU in the te order (``SCHEDULE == "te"``) or as
    :func:`cuvil.auto_schedule` schedules them (``"auto"``: tiles, vectors, threads, fusion)."""
    if SCHEDULE == "auto":
        return cuvil.build(cuvil.auto_schedule(list(args)), list(args), target="llvm")
    return cuvil.build(te.create_schedule(outputs), list(args), target="llvm")


def sentinel_output(shape: Sequence[int], dtype: str) -> np.ndarray:
    """An output buffer pre-filled with a value no test computes, so unwritten elements show."""
    if dtype == "bool":
        # every byte 0x01 = True; tests with bool outputs check both True and False positions
        return np.ones(tuple(shape), dtype=bool)
    if dtype in FLOATS:
        return np.full(tuple(shape), -31337.0 if dtype != "float16" else -31344.0, dtype=dtype)
    info = np.iinfo(dtype)
    return np.full(tuple(shape), min(info.max, 0x5A5A5A5A), dtype=dtype)


def compile_and_run(outputs: Sequence[Any], inputs: dict[Any, np.ndarray],
                    out_shapes: Sequence[Sequence[int]] | None = None) -> list[np.ndarray]:
    """Build ``inputs`` (placeholders, in order) + ``outputs`` with the default schedule and run it once.

    Output buffers get their shapes from ``out_shapes`` or from the tensors' constant shapes.
    """
    outs = list(outputs)
    mod = build(outs, list(inputs) + outs)
    shapes = out_shapes if out_shapes is not None else [const_shape(t) for t in outs]
    bufs = [sentinel_output(shp, t.dtype) for shp, t in zip(shapes, outs)]
    mod(*inputs.values(), *bufs)
    return bufs


def const_shape(t: Any) -> tuple[int, ...]:
    """The shape of a tensor whose extents are all constants."""
    out = []
    for d in t.shape:
        if not hasattr(d, "value"):
            raise ValueError(f"{t.name} has a run-time extent {d}; pass the output shape explicitly")
        out.append(int(d.value))
    return tuple(out)


# ---------------------------------------------------------------------------
# random inputs
# ---------------------------------------------------------------------------


def random_floats(rng: np.random.Generator, shape: Sequence[int], dtype: str, *, lo: float = -4.0,
                  hi: float = 4.0, special: float = 0.15, nan: float = 0.0) -> np.ndarray:
    """Uniform values in [lo, hi) with a fraction ``special`` of exact small values.

    The special values (0, +-0.5, +-1, +-2.5, small integers) hit ties of
    round/floor, exact zeros and equal operands of comparisons; ``nan`` is the
    probability of a NaN.
    """
    shape = tuple(shape)
    x = rng.uniform(lo, hi, size=shape)
    specials = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 2.5, -2.5, 3.0, -2.0, 1.5])
    specials = specials[(specials >= lo) & (specials < hi)] if ((specials >= lo) & (specials < hi)).any() else [lo]
    pick = rng.random(shape) < special
    x = np.where(pick, rng.choice(specials, size=shape), x)
    if nan:
        x = np.where(rng.random(shape) < nan, np.nan, x)
    with np.errstate(over="ignore"):  # a float16 overflows to inf, as intended
        return x.astype(dtype)


def random_ints(rng: np.random.Generator, shape: Sequence[int], dtype: str, *, small: float = 0.7) -> np.ndarray:
    """Integers: mostly small (zeros included, for divisors), some anywhere in the dtype's range."""
    shape = tuple(shape)
    info = np.iinfo(dtype)
    lo, hi = max(info.min, -9), min(info.max, 9)
    small_v = rng.integers(lo, hi + 1, size=shape, dtype=np.int64)
    wide = rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True).astype(np.int64)
    edge = rng.choice(np.array([info.min, info.max, info.min + 1, -1 if info.min < 0 else 1], dtype=np.int64),
                      size=shape)
    r = rng.random(shape)
    x = np.where(r < small, small_v, np.where(r < small + 0.2, wide, edge))
    return x.astype(dtype)


def random_array(rng: np.random.Generator, shape: Sequence[int], dtype: str, **kw: Any) -> np.ndarray:
    if dtype in FLOATS:
        return random_floats(rng, shape, dtype, **kw)
    if dtype == "bool":
        return rng.random(tuple(shape)) < 0.5
    return random_ints(rng, shape, dtype)


# ---------------------------------------------------------------------------
# error bounds
# ---------------------------------------------------------------------------


def compute_dtype(dtype: str) -> str:
    """float16 is a storage type: cuvil computes it in float32."""
    return "float32" if dtype == "float16" else dtype


def eps(dtype: str) -> float:
    """Machine epsilon (1 ULP at 1.0, twice the unit roundoff) of the type cuvil computes ``dtype`` in."""
    return float(np.finfo(compute_dtype(dtype)).eps)


def subnormal(dtype: str) -> float:
    """The smallest positive subnormal of the type cuvil computes ``dtype`` in."""
    return float(np.finfo(compute_dtype(dtype)).smallest_subnormal)


def gamma(n: int, dtype: str) -> float:
    """Higham's gamma_n = n*u / (1 - n*u): the relative error bound of n sequential roundings.

    Summing n terms in any order (sequential, pairwise, with FMA) errs by at
    most gamma_{n-1} * sum|x_i|; we use eps (= 2u) instead of u as a margin.
    """
    nu = n * eps(dtype)
    return nu / (1.0 - nu)


def store_rounding(dtype: str) -> float:
    """Relative error of rounding the float32 value of a float16 result on store (0 otherwise)."""
    return float(np.finfo(np.float16).eps) if dtype == "float16" else 0.0


# ---------------------------------------------------------------------------
# comparisons
# ---------------------------------------------------------------------------


def assert_exact(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    """Bit-for-bit equal values (NaN positions must match for floats)."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    np.testing.assert_array_equal(got, want, err_msg=what, strict=True)


def assert_bounded(got: np.ndarray, ref: np.ndarray, bound: np.ndarray | float, *,
                   ok: np.ndarray | None = None, what: str = "") -> None:
    """``got`` (dtype T) lies within ``ref +- 2*bound`` rounded to T, wherever ``ok``; NaNs match.

    ``ref`` and ``bound`` are float64 arrays (or broadcastable): the exact
    result is within ``bound`` of both cuvil's and numpy's, so the two are
    within ``2*bound`` of each other.  Rounding the bracket to T keeps the
    check exact for float16 results, which cuvil rounds on store, and lets a
    result that overflows T be inf exactly when the bracket reaches inf.
    """
    t = got.dtype
    ref = np.broadcast_to(np.asarray(ref, dtype=np.float64), got.shape)
    # a subnormal result carries an absolute, not a relative, rounding error: allow a few units
    # of the smallest subnormal (1.4e-45 in float32), far below any error a bug would make
    bound = np.asarray(bound, dtype=np.float64) + 4 * subnormal(t.name)
    bound = np.broadcast_to(bound, got.shape)
    ok = np.ones(got.shape, bool) if ok is None else np.broadcast_to(ok, got.shape)
    with np.errstate(over="ignore", invalid="ignore"):
        lo = (ref - 2 * bound).astype(t).astype(np.float64)
        hi = (ref + 2 * bound).astype(t).astype(np.float64)
    g = got.astype(np.float64)
    nan_ref, nan_got = np.isnan(ref), np.isnan(g)
    bad_nan = ok & (nan_ref != nan_got)
    with np.errstate(invalid="ignore"):
        inside = (g >= lo) & (g <= hi)
    bad = bad_nan | (ok & ~nan_ref & ~nan_got & ~inside)
    if bad.any():
        idx = np.argwhere(bad)[:8]
        lines = [
            f"  at {tuple(int(v) for v in i)}: got {g[tuple(i)]!r}, want {ref[tuple(i)]!r} "
            f"+- {2 * bound[tuple(i)]:.3g} (rounded bracket [{lo[tuple(i)]!r}, {hi[tuple(i)]!r}])"
            for i in idx
        ]
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {int(ok.sum())} checked elements differ from the numpy reference "
            f"({int(bad_nan.sum())} NaN mismatches)\n" + "\n".join(lines)
        )


def assert_close(got: np.ndarray, want: np.ndarray, *, rtol: float, atol: float = 0.0, what: str = "") -> None:
    """``np.testing.assert_allclose`` in float64 (NaN positions and infinities must match)."""
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    np.testing.assert_allclose(got.astype(np.float64), np.asarray(want, dtype=np.float64), rtol=rtol, atol=atol,
                               equal_nan=True, err_msg=what)


def np_erf(x: np.ndarray) -> np.ndarray:
    """erf in float64 (numpy has none; math.erf is correctly rounded to ~1 ULP)."""
    return np.vectorize(math.erf, otypes=[np.float64])(np.asarray(x, dtype=np.float64))
