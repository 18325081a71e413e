"""End to end: neural-network operators written in te, compiled and compared with numpy.

matmul (transposed operands, batched with broadcast), conv2d NCHW (random
stride / padding / dilation, padding in its own stage or inline, depthwise),
max / average pooling, softmax and layer norm as multi-stage programs.

Tolerances: a dot product of n terms errs by at most gamma_n * sum|a_i b_i|
(any order, with or without FMA), so contractions are checked against the
float64 result within ``gamma_n * (|A| @ |B|)`` (the same contraction of the
absolute values) -- see tests/support/reference.py for why the bound is doubled.
Softmax and layer norm bounds are derived next to their tests.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, note
from hypothesis import strategies as st
from reference import (
    assert_bounded,
    assert_exact,
    budget,
    compile_and_run,
    eps,
    gamma,
    random_floats,
    random_ints,
)

from cuvil import te

pytestmark = pytest.mark.usefixtures("each_schedule")  # the te order and auto_schedule

# ---------------------------------------------------------------------------
# matmul
# ---------------------------------------------------------------------------


@budget(1.0)
@given(m=st.integers(1, 24), n=st.integers(1, 24), k=st.integers(1, 40), ta=st.booleans(), tb=st.booleans(),
       dtype=st.sampled_from(["float32", "float64", "int32"]), seed=st.integers(0, 2**32 - 1))
def test_matmul(m: int, n: int, k: int, ta: bool, tb: bool, dtype: str, seed: int) -> None:
    """C = op(A) @ op(B) with op = identity or transpose (written as an index swap)."""
    rng = np.random.default_rng(seed)
    a_shape, b_shape = ((k, m) if ta else (m, k)), ((n, k) if tb else (k, n))
    if dtype == "int32":
        a, b = random_ints(rng, a_shape, dtype), random_ints(rng, b_shape, dtype)
    else:
        a, b = random_floats(rng, a_shape, dtype), random_floats(rng, b_shape, dtype)
    A, B = te.placeholder(a_shape, dtype, "A"), te.placeholder(b_shape, dtype, "B")
    r = te.reduce_axis((0, k), "r")
    C = te.compute((m, n), lambda i, j: te.sum((A[r, i] if ta else A[i, r]) * (B[j, r] if tb else B[r, j]), axis=r),
                   name="C")
    (got,) = compile_and_run([C], {A: a, B: b})
    a2, b2 = (a.T if ta else a), (b.T if tb else b)
    if dtype == "int32":  # exact, wrapping in int32 like numpy's int32 matmul
        with np.errstate(all="ignore"):
            assert_exact(got, (a2 @ b2).astype(np.int32), "int32 matmul")
        return
    a64, b64 = a2.astype(np.float64), b2.astype(np.float64)
    assert_bounded(got, a64 @ b64, gamma(k, dtype) * (np.abs(a64) @ np.abs(b64)), what=f"matmul ta={ta} tb={tb}")


@budget(0.75)
@given(batch=st.integers(1, 4), m=st.integers(1, 12), n=st.integers(1, 12), k=st.integers(1, 20),
       b_batched=st.sampled_from(["full", "one", "none"]), tb=st.booleans(), seed=st.integers(0, 2**32 - 1))
@pytest.mark.slow
def test_batch_matmul(batch: int, m: int, n: int, k: int, b_batched: str, tb: bool, seed: int) -> None:
    """C[b] = A[b] @ B[b]; B may have batch 1 or no batch (broadcast) and may be stored transposed."""
    rng = np.random.default_rng(seed)
    bk = (n, k) if tb else (k, n)
    b_shape = {"full": (batch, *bk), "one": (1, *bk), "none": bk}[b_batched]
    a = random_floats(rng, (batch, m, k), "float32")
    b = random_floats(rng, b_shape, "float32")
    A, B = te.placeholder((batch, m, k), "float32", "A"), te.placeholder(b_shape, "float32", "B")
    r = te.reduce_axis((0, k), "r")

    def b_read(t: Any, j: Any) -> Any:
        ij = (j, r) if tb else (r, j)
        return {"full": lambda: B[(t, *ij)], "one": lambda: B[(0, *ij)], "none": lambda: B[ij]}[b_batched]()

    C = te.compute((batch, m, n), lambda t, i, j: te.sum(A[t, i, r] * b_read(t, j), axis=r), name="C")
    (got,) = compile_and_run([C], {A: a, B: b})
    b64 = b.astype(np.float64)
    if tb:
        b64 = np.swapaxes(b64, -1, -2)
    a64 = a.astype(np.float64)
    assert_bounded(got, a64 @ b64, gamma(k, "float32") * (np.abs(a64) @ np.abs(b64)), what="batch matmul")


def test_matmul_bias_relu_epilogue() -> None:
    """Three stages: matmul, + bias (broadcast over rows), relu as te.max(x, 0) -- relu keeps NaN."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((9, 33)).astype(np.float32)
    b = rng.standard_normal((33, 7)).astype(np.float32)
    bias = rng.standard_normal(7).astype(np.float32)
    a[3, 5] = np.nan
    A, B, Bias = te.placeholder((9, 33), "float32", "A"), te.placeholder((33, 7), "float32", "B"), \
        te.placeholder((7,), "float32", "bias")
    r = te.reduce_axis((0, 33), "r")
    C = te.compute((9, 7), lambda i, j: te.sum(A[i, r] * B[r, j], axis=r), name="C")
    D = te.compute((9, 7), lambda i, j: te.max(C[i, j] + Bias[j], 0.0), name="D")
    (got,) = compile_and_run([D], {A: a, B: b, Bias: bias})
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ref = np.maximum(a64 @ b64 + bias, 0.0)
    bound = gamma(34, "float32") * (np.abs(a64) @ np.abs(b64) + np.abs(bias))
    assert_bounded(got, ref, bound, what="matmul+bias+relu")
    assert np.isnan(got[3]).all() and not np.isnan(got[:3]).any()


# ---------------------------------------------------------------------------
# conv2d
# ---------------------------------------------------------------------------


def out_size(size: int, k: int, stride: int, pad: int, dil: int) -> int:
    return (size + 2 * pad - dil * (k - 1) - 1) // stride + 1


def conv2d_numpy(x: np.ndarray, w: np.ndarray, stride: tuple[int, int], pad: tuple[int, int],
                 dil: tuple[int, int], depthwise: bool) -> np.ndarray:
    """float64 conv2d NCHW, one shifted strided window per kernel tap."""
    n, c, h, wd = x.shape
    kh, kw = w.shape[2:]
    oh, ow = out_size(h, kh, stride[0], pad[0], dil[0]), out_size(wd, kw, stride[1], pad[1], dil[1])
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    out = np.zeros((n, c if depthwise else w.shape[0], oh, ow))
    for ry in range(kh):
        for rx in range(kw):
            y0, x0 = ry * dil[0], rx * dil[1]
            win = xp[:, :, y0:y0 + stride[0] * (oh - 1) + 1:stride[0], x0:x0 + stride[1] * (ow - 1) + 1:stride[1]]
            if depthwise:
                out += win * w[None, :, 0, ry, rx, None, None]
            else:
                out += np.einsum("nchw,oc->nohw", win, w[:, :, ry, rx].astype(np.float64))
    return out


def conv2d_te(xs: tuple[int, ...], ws: tuple[int, ...], stride: tuple[int, int], pad: tuple[int, int],
              dil: tuple[int, int], depthwise: bool, inline_pad: bool, dtype: str) -> tuple[Any, Any, Any]:
    n, c, h, wd = xs
    kh, kw = ws[2:]
    oh, ow = out_size(h, kh, stride[0], pad[0], dil[0]), out_size(wd, kw, stride[1], pad[1], dil[1])
    X, W = te.placeholder(xs, dtype, "X"), te.placeholder(ws, dtype, "W")
    ph, pw = pad

    def inside(y: Any, x: Any) -> Any:
        return te.all(y >= ph, y < h + ph, x >= pw, x < wd + pw)

    if inline_pad:  # the out-of-bounds read sits in the branch that is not taken
        def padded(b: Any, ch: Any, y: Any, x: Any) -> Any:
            return te.if_then_else(inside(y, x), X[b, ch, y - ph, x - pw], 0.0)
    else:
        P = te.compute((n, c, h + 2 * ph, wd + 2 * pw),
                       lambda b, ch, y, x: te.if_then_else(inside(y, x), X[b, ch, y - ph, x - pw], 0.0), name="pad")

        def padded(b: Any, ch: Any, y: Any, x: Any) -> Any:
            return P[b, ch, y, x]

    ry, rx = te.reduce_axis((0, kh), "ry"), te.reduce_axis((0, kw), "rx")
    if depthwise:
        Y = te.compute((n, c, oh, ow), lambda b, ch, y, x: te.sum(
            padded(b, ch, y * stride[0] + ry * dil[0], x * stride[1] + rx * dil[1]) * W[ch, 0, ry, rx],
            axis=[ry, rx]), name="dwconv")
    else:
        rc = te.reduce_axis((0, c), "rc")
        Y = te.compute((n, ws[0], oh, ow), lambda b, o, y, x: te.sum(
            padded(b, rc, y * stride[0] + ry * dil[0], x * stride[1] + rx * dil[1]) * W[o, rc, ry, rx],
            axis=[rc, ry, rx]), name="conv")
    return X, W, Y


@st.composite
def conv_cases(draw: Any) -> dict[str, Any]:
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    pad = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    dil = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    h = draw(st.integers(max(1, dil[0] * (kh - 1) + 1 - 2 * pad[0]), 10))
    w = draw(st.integers(max(1, dil[1] * (kw - 1) + 1 - 2 * pad[1]), 10))
    depthwise = draw(st.booleans())
    c = draw(st.integers(1, 4))
    o = c if depthwise else draw(st.integers(1, 4))
    return dict(xs=(draw(st.integers(1, 2)), c, h, w), ws=(c, 1, kh, kw) if depthwise else (o, c, kh, kw),
                stride=stride, pad=pad, dil=dil, depthwise=depthwise, inline_pad=draw(st.booleans()),
                dtype=draw(st.sampled_from(["float32", "float64"])), seed=draw(st.integers(0, 2**32 - 1)))


@pytest.mark.slow
@budget(1.0)
@given(conv_cases())
def test_conv2d(case: dict[str, Any]) -> None:
    note(repr(case))
    seed = case.pop("seed")
    rng = np.random.default_rng(seed)
    X, W, Y = conv2d_te(**case)
    x = random_floats(rng, case["xs"], case["dtype"])
    w = random_floats(rng, case["ws"], case["dtype"])
    (got,) = compile_and_run([Y], {X: x, W: w})
    args = (case["stride"], case["pad"], case["dil"], case["depthwise"])
    ref = conv2d_numpy(x, w, *args)
    terms = case["ws"][1] * case["ws"][2] * case["ws"][3] if not case["depthwise"] else case["ws"][2] * case["ws"][3]
    bound = gamma(terms, case["dtype"]) * conv2d_numpy(np.abs(x), np.abs(w), *args)
    assert_bounded(got, ref, bound, what=repr(case))


def test_conv2d_padding_is_zero_not_garbage() -> None:
    """All-ones input and kernel: every output counts the in-bounds taps exactly (border effects)."""
    xs, ws = (1, 2, 5, 6), (3, 2, 3, 3)
    X, W, Y = conv2d_te(xs, ws, (2, 1), (2, 1), (1, 2), False, True, "float32")
    (got,) = compile_and_run([Y], {X: np.ones(xs, np.float32), W: np.ones(ws, np.float32)})
    want = conv2d_numpy(np.ones(xs), np.ones(ws), (2, 1), (2, 1), (1, 2), False).astype(np.float32)
    assert_exact(got, want, "tap counts")


# ---------------------------------------------------------------------------
# pooling
# ---------------------------------------------------------------------------


def pool_windows(x: np.ndarray, k: tuple[int, int], stride: tuple[int, int], pad: tuple[int, int],
                 fill: float) -> np.ndarray:
    """(N, C, OH, OW, KH, KW) windows of x padded with ``fill`` (float64)."""
    n, c, h, w = x.shape
    oh, ow = out_size(h, k[0], stride[0], pad[0], 1), out_size(w, k[1], stride[1], pad[1], 1)
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])), constant_values=fill)
    out = np.empty((n, c, oh, ow, k[0], k[1]))
    for ry in range(k[0]):
        for rx in range(k[1]):
            out[..., ry, rx] = xp[:, :, ry:ry + stride[0] * (oh - 1) + 1:stride[0],
                                  rx:rx + stride[1] * (ow - 1) + 1:stride[1]]
    return out


@budget(1.0)
@given(k=st.tuples(st.integers(1, 3), st.integers(1, 3)), stride=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       pad=st.tuples(st.integers(0, 1), st.integers(0, 1)), hw=st.tuples(st.integers(1, 9), st.integers(1, 9)),
       count_pad=st.booleans(), dtype=st.sampled_from(["float32", "float64", "float16"]),
       seed=st.integers(0, 2**32 - 1))
@pytest.mark.slow
def test_pooling(k: tuple[int, int], stride: tuple[int, int], pad: tuple[int, int], hw: tuple[int, int],
                 count_pad: bool, dtype: str, seed: int) -> None:
    """Max pooling (padding stage of -inf, NaN propagates) and average pooling (where= masks the border;
    the divisor counts the padding or not)."""
    assume(all(p < kk for p, kk in zip(pad, k)))  # a window is never all padding
    assume(all(hh + 2 * p >= kk for hh, p, kk in zip(hw, pad, k)))
    rng = np.random.default_rng(seed)
    xs = (2, 3, *hw)
    x = random_floats(rng, xs, dtype, nan=0.03)
    n, c, h, w = xs
    oh, ow = out_size(h, k[0], stride[0], pad[0], 1), out_size(w, k[1], stride[1], pad[1], 1)
    X = te.placeholder(xs, dtype, "X")
    ninf = te.const(-np.inf, dtype)
    P = te.compute((n, c, h + 2 * pad[0], w + 2 * pad[1]), lambda b, ch, y, xx: te.if_then_else(
        te.all(y >= pad[0], y < h + pad[0], xx >= pad[1], xx < w + pad[1]), X[b, ch, y - pad[0], xx - pad[1]], ninf),
        name="pad")
    ry, rx = te.reduce_axis((0, k[0]), "ry"), te.reduce_axis((0, k[1]), "rx")
    MP = te.compute((n, c, oh, ow), lambda b, ch, y, xx: te.max(P[b, ch, y * stride[0] + ry, xx * stride[1] + rx],
                                                                  axis=[ry, rx]), name="maxpool")

    def inb(y: Any, xx: Any) -> Any:
        return te.all(y >= pad[0], y < h + pad[0], xx >= pad[1], xx < w + pad[1])

    sy, sx = te.reduce_axis((0, k[0]), "sy"), te.reduce_axis((0, k[1]), "sx")
    S = te.compute((n, c, oh, ow), lambda b, ch, y, xx: te.sum(
        X[b, ch, y * stride[0] + sy - pad[0], xx * stride[1] + sx - pad[1]],
        axis=[sy, sx], where=inb(y * stride[0] + sy, xx * stride[1] + sx)), name="winsum")
    cy, cx = te.reduce_axis((0, k[0]), "cy"), te.reduce_axis((0, k[1]), "cx")
    if count_pad:
        AP = te.compute((n, c, oh, ow), lambda *i: S[i] / float(k[0] * k[1]), name="avgpool")
    else:
        CNT = te.compute((oh, ow), lambda y, xx: te.sum(te.const(1.0, dtype), axis=[cy, cx],
                                                        where=inb(y * stride[0] + cy, xx * stride[1] + cx)), name="cnt")
        AP = te.compute((n, c, oh, ow), lambda b, ch, y, xx: S[b, ch, y, xx] / CNT[y, xx], name="avgpool")
    got_max, got_avg = compile_and_run([MP, AP], {X: x})

    win = pool_windows(x, k, stride, pad, -np.inf)
    assert_exact(got_max, win.max(axis=(-2, -1)).astype(dtype), "maxpool")  # max is exact, NaN propagates
    win0 = pool_windows(x, k, stride, pad, 0.0)
    cnt = pool_windows(np.ones((1, 1, h, w)), k, stride, pad, 0.0).sum(axis=(-2, -1))
    div = k[0] * k[1] if count_pad else cnt
    ref = win0.sum(axis=(-2, -1)) / div
    # kh*kw-term sum (float16: computed in float32 per element, stored as float16 after every update)
    terms = k[0] * k[1]
    per_step = float(np.finfo(dtype).eps)  # float16: the accumulator is rounded to half on every store
    bound = (terms + 1) * per_step * np.abs(win0).sum(axis=(-2, -1)) / div
    assert_bounded(got_avg, ref, bound, what=f"avgpool count_pad={count_pad}")


# ---------------------------------------------------------------------------
# softmax and layer norm
# ---------------------------------------------------------------------------


@budget(1.0)
@given(shape=st.lists(st.integers(1, 17), min_size=1, max_size=3), dtype=st.sampled_from(["float32", "float64"]),
       scale=st.sampled_from([1.0, 10.0, 30.0]), seed=st.integers(0, 2**32 - 1))
@pytest.mark.slow
def test_softmax(shape: list[int], dtype: str, scale: float, seed: int) -> None:
    """Stable softmax over the last axis in four stages: max, exp(x - max), sum, divide.

    Bound, relative to each output: x - max is exact to u|x - max| (|x - max| <= 2*scale*4),
    exp adds that times 1 plus ~4 ULP, the sum of K positive terms gamma_K plus the terms'
    errors, the divide 1 ULP: rel <= 2 * (|x - max| + 5) * eps + gamma_K + eps.
    """
    shape = tuple(shape)
    kdim = shape[-1]
    rng = np.random.default_rng(seed)
    x = (random_floats(rng, shape, dtype) * scale).astype(dtype)
    X = te.placeholder(shape, dtype, "x")
    k1, k2 = te.reduce_axis((0, kdim), "k1"), te.reduce_axis((0, kdim), "k2")
    lead = shape[:-1]
    M = te.compute(lead, lambda *i: te.max(X[(*i, k1)], axis=k1), name="max")
    E = te.compute(shape, lambda *i: te.exp(X[i] - M[i[:-1]]), name="exp")
    S = te.compute(lead, lambda *i: te.sum(E[(*i, k2)], axis=k2), name="sum")
    Y = te.compute(shape, lambda *i: E[i] / S[i[:-1]], name="softmax")
    (got,) = compile_and_run([Y], {X: x})
    x64 = x.astype(np.float64)
    z = x64 - x64.max(-1, keepdims=True)
    ref = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    rel = 2 * (np.abs(z).max() + 5) * eps(dtype) + gamma(kdim, dtype) + eps(dtype)
    assert_bounded(got, ref, rel * ref, what="softmax")
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=kdim * 64 * eps(dtype))


@budget(1.0)
@given(rows=st.integers(1, 9), d=st.integers(2, 64), dtype=st.sampled_from(["float32", "float64"]),
       offset=st.sampled_from([0.0, 1.0, -3.0]), seed=st.integers(0, 2**32 - 1))
@pytest.mark.slow
def test_layer_norm(rows: int, d: int, dtype: str, offset: float, seed: int) -> None:
    """y = (x - mean) * rsqrt(var + 1e-5) * gamma + beta over the last axis, mean and var in their own stages.

    Bound, per row with m = max|x| and s = sqrt(var + 1e-5) (u = eps / 2): the mean of D terms errs by
    (D - 1) u m + u m, so each centred value c = x - mean errs by e_c <= (D / 2 + 2) eps m.  The variance
    sums (c + dc)^2: its first-order error in the mean cancels (sum c = 0), leaving 2 sqrt(var) e_c + 2 e_c^2
    from the centred values and gamma_D var from the sum; rsqrt halves that relative to var + 1e-5 and adds
    a few eps.  So |dy| <= |gamma| (e_c / s + |x_hat| (e_r + 3 eps)) + eps |beta| with
    e_r = (2 sqrt(var) e_c + 2 e_c^2 + (D + 1) eps var) / (2 (var + 1e-5)) + 3 eps.  e_c / s is what
    matters when the row's values nearly cancel (D = 2, two close values: var ~ 1e-7 against eps 1e-5,
    the centred values' rounding amplified ~300x).
    """
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, d)) + offset).astype(dtype)
    g = rng.standard_normal(d).astype(dtype)
    bta = rng.standard_normal(d).astype(dtype)
    X, G, Bt = te.placeholder((rows, d), dtype, "x"), te.placeholder((d,), dtype, "gamma"), \
        te.placeholder((d,), dtype, "beta")
    k1, k2 = te.reduce_axis((0, d), "k1"), te.reduce_axis((0, d), "k2")
    S = te.compute((rows,), lambda i: te.sum(X[i, k1], axis=k1), name="sum")
    Mu = te.compute((rows,), lambda i: S[i] / float(d), name="mean")
    Var = te.compute((rows,), lambda i: te.sum((X[i, k2] - Mu[i]) * (X[i, k2] - Mu[i]), axis=k2), name="ssd")
    Y = te.compute((rows, d), lambda i, j: (X[i, j] - Mu[i]) * te.rsqrt(Var[i] / float(d) + 1e-5) * G[j] + Bt[j],
                   name="layernorm")
    (got,) = compile_and_run([Y], {X: x, G: g, Bt: bta})
    x64 = x.astype(np.float64)
    mu = x64.mean(-1, keepdims=True)
    var = ((x64 - mu) ** 2).mean(-1, keepdims=True)
    s = np.sqrt(var + 1e-5)
    xhat = (x64 - mu) / s
    ref = xhat * g + bta
    e = eps(dtype)
    e_c = (d / 2 + 2) * e * np.abs(x64).max(-1, keepdims=True)
    e_r = (2 * np.sqrt(var) * e_c + 2 * e_c ** 2 + (d + 1) * e * var) / (2 * (var + 1e-5)) + 3 * e
    bound = np.abs(g) * (e_c / s + np.abs(xhat) * (e_r + 3 * e)) + e * np.abs(bta)
    assert_bounded(got, ref, bound, what="layernorm")


def test_softmax_with_nan_row() -> None:
    """A NaN in a row makes that whole row NaN (max propagates it) and leaves the other rows alone."""
    x = np.array([[1.0, 2.0, 3.0], [0.5, np.nan, 1.0]], np.float32)
    X = te.placeholder((2, 3), "float32", "x")
    k1, k2 = te.reduce_axis((0, 3), "k1"), te.reduce_axis((0, 3), "k2")
    M = te.compute((2,), lambda i: te.max(X[i, k1], axis=k1), name="max")
    E = te.compute((2, 3), lambda i, j: te.exp(X[i, j] - M[i]), name="exp")
    S = te.compute((2,), lambda i: te.sum(E[i, k2], axis=k2), name="sum")
    Y = te.compute((2, 3), lambda i, j: E[i, j] / S[i], name="softmax")
    (got,) = compile_and_run([Y], {X: x})
    assert np.isnan(got[1]).all()
    z = np.exp(np.array([1.0, 2.0, 3.0]) - 3.0)
    np.testing.assert_allclose(got[0], z / z.sum(), rtol=8 * eps("float32"))
