"""The generated CUDA C computes the right values: run on the CPU with CUDA's execution model
(tests/support/cuda_emulator.py: one real thread per GPU thread, __syncthreads() a barrier) and compared
with numpy.  Needs g++ (C++20) and NVRTC (the module compiles its PTX too)."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_emulator import emulate
from toolchain import missing, require

import cuvil
from cuvil import te

SM90 = "cuda -arch=sm_90"


@pytest.fixture(scope="module", autouse=True)
def tools():
    require("g++", "apt-get install -y g++")
    try:
        import cuda.bindings.nvrtc  # noqa: F401
    except ImportError:
        missing('cuda-python is not installed (pip install -e ".[cuda]")')


def _auto(args):
    s = cuvil.auto_schedule(args, target=SM90)
    return cuvil.build(s, args, target=SM90)


@pytest.mark.slow
def test_batched_matmul_with_tails():
    b_, M, N, K = 3, 37, 70, 45
    A = te.placeholder((b_, M, K), name="A")
    B = te.placeholder((b_, K, N), name="B")
    k = te.reduce_axis((0, K), "k")
    C = te.compute((b_, M, N), lambda b, i, j: te.sum(A[b, i, k] * B[b, k, j], axis=k), name="C")
    m = _auto([A, B, C])
    assert "__shared__" in m.get_source("cuda") and m.program.kernels[0].grid[2].value == 3
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((b_, M, K), np.float32), rng.standard_normal((b_, K, N), np.float32)
    c = np.full((b_, M, N), -7, np.float32)
    emulate(m, a, b, c)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_softmax_kernels_in_sequence():
    n, d = 5, 19
    X = te.placeholder((n, d), name="X")
    k1, k2 = te.reduce_axis((0, d), "k1"), te.reduce_axis((0, d), "k2")
    mx = te.compute((n,), lambda i: te.max(X[i, k1], axis=k1), name="mx")
    e = te.compute((n, d), lambda i, j: te.exp(X[i, j] - mx[i]), name="e")
    sm = te.compute((n,), lambda i: te.sum(e[i, k2], axis=k2), name="sm")
    Y = te.compute((n, d), lambda i, j: e[i, j] / sm[i], name="Y")
    m = _auto([X, Y])
    assert len(m.program.kernels) >= 3
    x = np.random.default_rng(1).standard_normal((n, d)).astype(np.float32) * 3
    x[2, 4] = np.nan
    y = np.zeros_like(x)
    emulate(m, x, y)
    z = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
    ref = z / z.sum(1, keepdims=True)
    assert np.isnan(y[2]).all()
    np.testing.assert_allclose(y[[0, 1, 3, 4]], ref[[0, 1, 3, 4]], rtol=1e-5)


@pytest.mark.slow
def test_long_reduction_is_split_over_threads():
    X = te.placeholder((3, 3000), name="X")
    k = te.reduce_axis((0, 3000), "k")
    Y = te.compute((3,), lambda i: te.sum(X[i, k], axis=k), name="Y")
    m = _auto([X, Y])
    assert len(m.program.kernels) == 2 and m.program.kernels[0].block[0] == 128  # rfactor: partial sums
    x = np.random.default_rng(2).standard_normal((3, 3000)).astype(np.float32)
    y = np.zeros(3, np.float32)
    emulate(m, x, y)
    np.testing.assert_allclose(y, x.astype(np.float64).sum(1), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_conv2d_relu_with_padding():
    from cuvil.te import ops

    X = te.placeholder((1, 3, 10, 10), name="X")
    W = te.placeholder((4, 3, 3, 3), name="W")
    P = ops.pad(X, (1, 1))
    c, r, s_ = te.reduce_axis((0, 3), "c"), te.reduce_axis((0, 3), "r"), te.reduce_axis((0, 3), "s")
    Y = te.compute((1, 4, 10, 10), lambda n, o, y, x: te.sum(P[n, c, y + r, x + s_] * W[o, c, r, s_],
                                                              axis=[c, r, s_]), name="Y")
    Z = te.compute((1, 4, 10, 10), lambda *i: te.max(Y[i], te.const(0.0)), name="Z")
    m = _auto([X, W, Z])
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((1, 3, 10, 10), np.float32), rng.standard_normal((4, 3, 3, 3), np.float32)
    z = np.zeros((1, 4, 10, 10), np.float32)
    emulate(m, x, w, z)
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    ref = sum(np.einsum("oc,ncyx->noyx", w[:, :, a, b], xp[:, :, a:a + 10, b:b + 10]) for a in range(3)
              for b in range(3))
    np.testing.assert_allclose(z, np.maximum(ref, 0), rtol=1e-5, atol=1e-5)


def test_elementwise_runtime_size_float16_and_integer_semantics():
    n = te.var("n")
    H = te.placeholder((n,), "float16", "H")
    Q = te.placeholder((n,), "int32", "Q")
    Z = te.compute((n,), lambda i: te.cast(te.max(te.cast(H[i], "float32"), te.const(-1.0)) * 3, "float16"),
                   name="Z")
    R = te.compute((n,), lambda i: Q[i] // 7 + Q[i] % -5, name="R")
    m = _auto([H, Q, Z, R])
    size = 1000
    rng = np.random.default_rng(4)
    h = (rng.standard_normal(size) * 4).astype(np.float16)
    h[7] = np.nan
    q = rng.integers(-1000, 1000, size).astype(np.int32)
    z, r = np.zeros(size, np.float16), np.zeros(size, np.int32)
    emulate(m, h, q, z, r)
    np.testing.assert_array_equal(z, (np.maximum(h.astype(np.float32), -1) * 3).astype(np.float16))
    np.testing.assert_array_equal(r, q // 7 + q % -5)


@pytest.mark.slow
def test_hand_schedule_block_level_store_and_partial_thread_region():
    """A stage computed at a block's loop with no thread loop writes at block level (thread 0 does
    it, then a barrier); a cache stage bound to threadIdx.x runs on the threads with threadIdx.y == 0."""
    X = te.placeholder((8, 64), name="X")
    k = te.reduce_axis((0, 64), "k")
    S = te.compute((8,), lambda i: te.sum(X[i, k] * 2, axis=k), name="S")
    T = te.compute((8,), lambda i: S[i] * 0.5, name="T")
    Y = te.compute((8, 64), lambda i, j: X[i, j] - T[i], name="Y")
    s = te.create_schedule(Y)
    i, j = s[Y].op.axis
    jo, ji = s[Y].split(j, factor=16)
    s[Y].bind(i, "blockIdx.x")
    s[Y].bind(jo, "threadIdx.y")
    s[Y].bind(ji, "threadIdx.x")
    XS = s.cache_read(X, "shared", [Y])
    s[XS].compute_at(s[Y], i)
    a0, a1 = s[XS].op.axis
    s[XS].bind(a1, "threadIdx.x")
    s[T].compute_at(s[Y], i)
    (si,) = s[S].op.axis
    s[S].bind(si, "blockIdx.x")
    m = cuvil.build(s, [X, Y], target=SM90)
    cu = m.get_source("cuda")
    assert "threadIdx.x == 0 && threadIdx.y == 0" in cu and "threadIdx.y == 0)" in cu
    m.check_ptx()
    x = np.random.default_rng(5).standard_normal((8, 64)).astype(np.float32)
    y = np.zeros_like(x)
    emulate(m, x, y)
    np.testing.assert_allclose(y, x - x.astype(np.float64).sum(1, keepdims=True), rtol=1e-5, atol=1e-5)
