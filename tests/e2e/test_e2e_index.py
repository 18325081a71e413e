"""End to end: index maps (transposes, reshapes with // and %, concatenation,
gathers), run-time sizes (one build, several shapes) and several outputs.

Data movement is exact, so every comparison here is bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st
from reference import (
    FLOATS,
    assert_bounded,
    assert_exact,
    budget,
    build,
    compile_and_run,
    gamma,
    random_array,
    random_floats,
    sentinel_output,
)

import cuvil
from cuvil import te

pytestmark = pytest.mark.usefixtures("each_schedule")  # the te order and auto_schedule

DTYPES = ["float32", "float64", "float16", "int32", "int64", "int8", "uint8", "bool"]


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return out[::-1]


# ---------------------------------------------------------------------------
# transposes and reshapes
# ---------------------------------------------------------------------------


@budget(1.0)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data(),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**32 - 1))
def test_transpose(shape: list[int], data: Any, dtype: str, seed: int) -> None:
    perm = data.draw(st.permutations(range(len(shape))))
    shape_t = tuple(shape)
    out_shape = tuple(shape_t[p] for p in perm)
    X = te.placeholder(shape_t, dtype, "x")

    def body(*j: Any) -> Any:
        idx: list[Any] = [None] * len(shape_t)
        for d, p in enumerate(perm):
            idx[p] = j[d]
        return X[tuple(idx)]

    Y = te.compute(out_shape, body, name="y")
    x = random_array(np.random.default_rng(seed), shape_t, dtype)
    (got,) = compile_and_run([Y], {X: x})
    assert_exact(got, np.ascontiguousarray(np.transpose(x, perm)), f"transpose {perm}")


def _factor_shape(total: int, rank: int, draw: Any) -> tuple[int, ...]:
    """A random shape of ``rank`` dimensions whose product is ``total``."""
    dims = [1] * rank
    n = total
    p = 2
    while n > 1:
        while n % p == 0:
            dims[draw(st.integers(0, rank - 1))] *= p
            n //= p
        p += 1
    return tuple(dims)


@budget(1.0)
@given(in_shape=st.lists(st.integers(1, 6), min_size=1, max_size=4), out_rank=st.integers(1, 4), data=st.data(),
       seed=st.integers(0, 2**32 - 1))
def test_reshape_via_floordiv_mod(in_shape: list[int], out_rank: int, data: Any, seed: int) -> None:
    """out[j] = x[unravel(ravel(j))]: the flat index split with // and % by constants (quasi-affine)."""
    in_t = tuple(in_shape)
    out_t = _factor_shape(math.prod(in_t), out_rank, data.draw)
    note(f"{in_t} -> {out_t}")
    X = te.placeholder(in_t, "int32", "x")
    ins, outs = _strides(in_t), _strides(out_t)

    def body(*j: Any) -> Any:
        flat = sum(jd * s for jd, s in zip(j, outs))
        return X[tuple((flat // s) % n for s, n in zip(ins, in_t))]

    Y = te.compute(out_t, body, name="y")
    x = np.random.default_rng(seed).integers(-1000, 1000, in_t).astype(np.int32)
    (got,) = compile_and_run([Y], {X: x})
    assert_exact(got, x.reshape(out_t), f"reshape {in_t} -> {out_t}")


@pytest.mark.parametrize("r", [2, 3])
def test_depth_to_space(r: int) -> None:
    """Pixel shuffle: a reshape and a transpose in one index map with // and %."""
    n, c, h, w = 2, 3, 4, 5
    x = np.random.default_rng(r).standard_normal((n, c * r * r, h, w)).astype(np.float32)
    X = te.placeholder(x.shape, "float32", "x")
    Y = te.compute((n, c, h * r, w * r), lambda b, ch, y, xx: X[b, ch * r * r + (y % r) * r + xx % r, y // r, xx // r],
                   name="d2s")
    (got,) = compile_and_run([Y], {X: x})
    want = x.reshape(n, c, r, r, h, w).transpose(0, 1, 4, 2, 5, 3).reshape(n, c, h * r, w * r)
    assert_exact(got, want, "depth_to_space")


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_slices_flips_and_tiles(dtype: str) -> None:
    """Strided slice x[1::3], flip x[::-1], tile by % and repeat by // in one program (four outputs)."""
    n = 17
    x = random_array(np.random.default_rng(4), (n,), dtype)
    X = te.placeholder((n,), dtype, "x")
    S = te.compute(((n - 1 + 2) // 3,), lambda i: X[3 * i + 1], name="slice")
    F = te.compute((n,), lambda i: X[n - 1 - i], name="flip")
    T = te.compute((2 * n + 3,), lambda i: X[i % n], name="tile")
    R = te.compute((3 * n,), lambda i: X[i // 3], name="repeat")
    s, f, t, r = compile_and_run([S, F, T, R], {X: x})
    assert_exact(s, x[1::3], "slice")
    assert_exact(f, x[::-1].copy(), "flip")
    assert_exact(t, np.concatenate([x, x, x[:3]]), "tile")
    assert_exact(r, np.repeat(x, 3), "repeat")


# ---------------------------------------------------------------------------
# concatenation
# ---------------------------------------------------------------------------


@budget(1.0)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), data=st.data(),
       dtype=st.sampled_from(["float32", "int64", "float16"]), seed=st.integers(0, 2**32 - 1))
def test_concatenate(shape: list[int], data: Any, dtype: str, seed: int) -> None:
    """Nested if_then_else over 2-3 inputs; the branch not taken would read out of bounds."""
    axis = data.draw(st.integers(0, len(shape) - 1))
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=2, max_size=3))
    shapes = [tuple(s if d == axis else shape[d] for d in range(len(shape))) for s in sizes]
    rng = np.random.default_rng(seed)
    arrays = [random_array(rng, s, dtype) for s in shapes]
    phs = [te.placeholder(s, dtype, f"x{k}") for k, s in enumerate(shapes)]
    offsets = np.cumsum([0] + sizes)
    out_shape = tuple(int(offsets[-1]) if d == axis else shape[d] for d in range(len(shape)))

    def body(*i: Any) -> Any:
        def read(k: int) -> Any:
            idx = tuple(i[d] - int(offsets[k]) if d == axis else i[d] for d in range(len(shape)))
            return phs[k][idx]

        expr = read(len(phs) - 1)
        for k in range(len(phs) - 2, -1, -1):
            expr = te.if_then_else(i[axis] < int(offsets[k + 1]), read(k), expr)
        return expr

    Y = te.compute(out_shape, body, name="concat")
    (got,) = compile_and_run([Y], dict(zip(phs, arrays)))
    assert_exact(got, np.concatenate(arrays, axis=axis), f"concat axis {axis}")


# ---------------------------------------------------------------------------
# gathers
# ---------------------------------------------------------------------------


@budget(1.0)
@given(vocab=st.integers(1, 50), dim=st.integers(1, 16), tokens=st.lists(st.integers(1, 7), min_size=1, max_size=2),
       idx_dtype=st.sampled_from(["int32", "int64"]), dtype=st.sampled_from(["float32", "float16", "int8"]),
       seed=st.integers(0, 2**32 - 1))
def test_embedding_lookup(vocab: int, dim: int, tokens: list[int], idx_dtype: str, dtype: str, seed: int) -> None:
    """out[b.., d] = W[idx[b..], d], data-dependent rows (repeats, first and last row included)."""
    rng = np.random.default_rng(seed)
    tshape = tuple(tokens)
    idx = rng.integers(0, vocab, tshape).astype(idx_dtype)
    idx.flat[0] = vocab - 1
    idx.flat[-1] = 0 if idx.size > 1 else idx.flat[-1]
    w = random_array(rng, (vocab, dim), dtype)
    W = te.placeholder((vocab, dim), dtype, "W")
    Idx = te.placeholder(tshape, idx_dtype, "idx")
    Y = te.compute((*tshape, dim), lambda *i: W[Idx[i[:-1]], i[-1]], name="emb")
    (got,) = compile_and_run([Y], {W: w, Idx: idx})
    assert_exact(got, w[idx], "embedding")


def test_take_along_axis_and_embedding_bag() -> None:
    """A gather on the inner axis, and a sum of gathered rows (gather inside a reduction)."""
    rng = np.random.default_rng(8)
    a = rng.standard_normal((4, 10)).astype(np.float32)
    cols = np.array([9, 0, 3, 3, 7], np.int64)
    A, C = te.placeholder((4, 10), "float32", "a"), te.placeholder((5,), "int64", "cols")
    T = te.compute((4, 5), lambda i, j: A[i, C[j]], name="take")
    w = rng.standard_normal((12, 6)).astype(np.float32)
    bags = rng.integers(0, 12, (3, 4)).astype(np.int32)
    W, B = te.placeholder((12, 6), "float32", "W"), te.placeholder((3, 4), "int32", "bags")
    k = te.reduce_axis((0, 4), "k")
    E = te.compute((3, 6), lambda b, d: te.sum(W[B[b, k], d], axis=k), name="bag")
    t, e = compile_and_run([T, E], {A: a, C: cols, W: w, B: bags})
    assert_exact(t, a[:, cols], "take")
    w64 = w.astype(np.float64)
    assert_bounded(e, w64[bags].sum(1), gamma(4, "float32") * np.abs(w64[bags]).sum(1), what="embedding bag")


# ---------------------------------------------------------------------------
# run-time sizes and several outputs
# ---------------------------------------------------------------------------


def test_runtime_sizes_one_build_many_shapes() -> None:
    """One module (n, m unknown at compile time) called with several shapes, two outputs:
    the transposed shifted input and its row sums, reading a 2-D and a 1-D input."""
    n, m = te.var("n"), te.var("m")
    X = te.placeholder((n, m), "float32", "x")
    V = te.placeholder((m,), "float32", "v")
    T = te.compute((m, n), lambda j, i: X[i, j] + V[j], name="t")
    k = te.reduce_axis((0, m), "k")
    S = te.compute((n,), lambda i: te.sum(X[i, k] * V[k], axis=k), name="s")
    mod = build([T, S], [X, V, T, S])
    rng = np.random.default_rng(0)
    for nn, mm in [(1, 1), (3, 7), (8, 1), (1, 9), (33, 17), (5, 64)]:
        x = rng.standard_normal((nn, mm)).astype(np.float32)
        v = rng.standard_normal(mm).astype(np.float32)
        t, s = sentinel_output((mm, nn), "float32"), sentinel_output((nn,), "float32")
        mod(x, v, t, s)
        assert_exact(t, (x + v).T.copy(), f"transpose n={nn} m={mm}")
        x64, v64 = x.astype(np.float64), v.astype(np.float64)
        assert_bounded(s, x64 @ v64, gamma(mm, "float32") * (np.abs(x64) @ np.abs(v64)), what=f"n={nn} m={mm}")


def test_runtime_size_passed_as_argument() -> None:
    """A te.var in the argument list is passed as an int; the extent of the output depends on it."""
    n = te.var("n")
    X = te.placeholder((n,), "int64", "x")
    Y = te.compute((n,), lambda i: X[n - 1 - i] * 2 + i, name="y")
    mod = build(Y, [X, Y, n])
    for size in (1, 2, 11):
        x = np.arange(size, dtype=np.int64) * 5 - 7
        y = sentinel_output((size,), "int64")
        mod(x, y, size)
        assert_exact(y, x[::-1] * 2 + np.arange(size), f"n={size}")


def test_runtime_size_gather_and_concat() -> None:
    """Run-time sizes in a data-dependent gather and a concatenation boundary."""
    v, t, n1, n2 = te.var("v"), te.var("t"), te.var("n1"), te.var("n2")
    W = te.placeholder((v, 3), "float32", "W")
    Idx = te.placeholder((t,), "int32", "idx")
    A, B = te.placeholder((n1,), "float32", "a"), te.placeholder((n2,), "float32", "b")
    G = te.compute((t, 3), lambda i, d: W[Idx[i], d], name="g")
    C = te.compute((n1 + n2,), lambda i: te.if_then_else(i < n1, A[i], B[i - n1]), name="c")
    mod = build([G, C], [W, Idx, A, B, G, C])
    rng = np.random.default_rng(1)
    for vv, tt, a_n, b_n in [(1, 1, 1, 1), (20, 7, 3, 9), (5, 30, 12, 1)]:
        w = rng.standard_normal((vv, 3)).astype(np.float32)
        idx = rng.integers(0, vv, tt).astype(np.int32)
        a, b = rng.standard_normal(a_n).astype(np.float32), rng.standard_normal(b_n).astype(np.float32)
        g, c = sentinel_output((tt, 3), "float32"), sentinel_output((a_n + b_n,), "float32")
        mod(w, idx, a, b, g, c)
        assert_exact(g, w[idx], "gather")
        assert_exact(c, np.concatenate([a, b]), "concat")


def test_runtime_size_mismatch_is_an_error_not_a_crash() -> None:
    """Two arguments that bind the same size differently are refused with a cuvil error."""
    n = te.var("n")
    A, B = te.placeholder((n,), "float32", "a"), te.placeholder((n,), "float32", "b")
    C = te.compute((n,), lambda i: A[i] + B[i], name="c")
    mod = build(C, [A, B, C])
    with pytest.raises(cuvil.CuvilError):
        mod(np.zeros(4, np.float32), np.zeros(5, np.float32), np.zeros(4, np.float32))
    with pytest.raises(cuvil.CuvilError):
        mod(np.zeros(4, np.float32), np.zeros(4, np.float32), np.zeros(3, np.float32))
    c = sentinel_output((4,), "float32")
    mod(np.ones(4, np.float32), np.full(4, 2, np.float32), c)  # still usable afterwards
    assert_exact(c, np.full(4, 3, np.float32), "after errors")


def test_unused_input_argument_is_accepted() -> None:
    """A placeholder in the arguments that no output reads is a legal (ignored) parameter."""
    x = te.placeholder((3,), "float32", "x")
    unused = te.placeholder((3,), "float32", "unused")
    y = te.compute((3,), lambda i: x[i] + 1.0, name="y")
    mod = build(y, [x, unused, y])
    out = sentinel_output((3,), "float32")
    mod(np.zeros(3, np.float32), np.zeros(3, np.float32), out)
    assert_exact(out, np.ones(3, np.float32), "y")


@pytest.mark.parametrize("dtype", FLOATS)
def test_several_outputs_sharing_stages(dtype: str) -> None:
    """Outputs that read each other: Y = x * 2 + 1 is an output and the input of Z = sum(Y) and
    of M = max(Y); a bool output from the same build; an internal stage nobody outputs."""
    rng = np.random.default_rng(3)
    x = random_floats(rng, (6, 5), dtype)
    X = te.placeholder((6, 5), dtype, "x")
    Y = te.compute((6, 5), lambda i, j: X[i, j] * 2.0 + 1.0, name="y")
    hidden = te.compute((6, 5), lambda i, j: Y[i, j] - X[i, j], name="hidden")  # = x + 1, internal
    k1, k2 = te.reduce_axis((0, 5), "k1"), te.reduce_axis((0, 5), "k2")
    Z = te.compute((6,), lambda i: te.sum(hidden[i, k1], axis=k1), name="z")
    M = te.compute((6,), lambda i: te.max(Y[i, k2], axis=k2), name="m")
    P = te.compute((6, 5), lambda i, j: Y[i, j] > M[i] - 1.0, name="p")
    y, z, m, p = compile_and_run([Y, Z, M, P], {X: x})
    x64 = x.astype(np.float64)
    y_ref = x64 * 2 + 1  # x * 2 is exact, + 1 rounds once (to float16 on store for float16)
    assert_exact(y, y_ref.astype(dtype), "y")
    assert_exact(m, y.max(1), "m")
    assert_exact(p, y.astype(np.float64) > m.astype(np.float64)[:, None] - 1.0, "p")
    h = y.astype(np.float64) - x64  # hidden is recomputed from the stored (rounded) y
    if dtype == "float16":  # hidden is stored as float16, the sum rounds to float16 after every term
        bound = 6 * eps_of("float16") * np.abs(h).sum(1) + 2 * eps_of("float32") * np.abs(h).sum(1)
    else:
        bound = gamma(6, dtype) * (np.abs(y.astype(np.float64)) + np.abs(x64)).sum(1)
    assert_bounded(z, h.sum(1), bound, what="z")


def eps_of(dtype: str) -> float:
    return float(np.finfo(dtype).eps)


# ---------------------------------------------------------------------------
# compiler state across many builds
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_many_lowerings_in_one_process() -> None:
    """Regression: the isl operation bound applies per build, not to the process.

    cuvil once set isl's ``max_operations`` on the shared context without resetting
    its counter, so after ~170 small programs every build in the process failed with
    "maximal number of operations exceeded".
    """
    a = te.placeholder((2, 5, 1), "float32", "A")
    for n in range(400):
        b = te.compute((2, 5, 1), lambda i, j, k: a[i, j, k] * a[i, j, k], name="B")
        try:
            cuvil.lower(te.create_schedule(b), [a, b])
        except cuvil.CuvilError as exc:
            raise AssertionError(f"lowering number {n} of the same tiny program failed: {exc}") from exc
    x = np.arange(10, dtype=np.float32).reshape(2, 5, 1)
    (got,) = compile_and_run([b], {a: x})
    assert_exact(got, x * x, "after 400 lowerings")
