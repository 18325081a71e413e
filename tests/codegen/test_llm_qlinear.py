"""cuvil.llm.qlinear: the weight contractions of an LLM decoder against numpy references.

Tolerances (u = 2^-24, float32's unit roundoff; every reference is computed in float64):

- int8 activations (Q4, Q8): the reference quantizes the activations exactly as the kernel does
  (:func:`cuvil.llm.qlinear.quantize_rows`, checked bit for bit against the kernel's own quantization)
  and multiplies them with the dequantized weights.  The kernel's integer sums per group are exact; per
  group it rounds a conversion (exact below 2^24), two products and a sum, and it sums NG groups (plus the
  residual and bias): at most ``(NG + 8) u`` relative to the sum of the magnitudes of every term it adds,
  ``T = sum_k |xq_k| (|s| |q_k - c| + |o + c s|)`` (c = 8 for Q4, 128 for Q8), plus the reference's own
  dequantization ``w = q s + o``, one rounding per weight, ``u sum_k |xq_k w_k|``.
- float32 activations (Q4): per group a sum of ``group`` float32 products, then the same per-group
  scaling: ``(group + NG + 8) u`` relative to ``sum_k |x_k| (|s| (|q_k| + 8) + |o|)``, plus ``u sum |x w|``.
- Dense: a sum of K products: ``(K + 4) u sum_k |x_k w_k|``.
"""

from __future__ import annotations

import numpy as np
import pytest
import reference
from hypothesis import given
from hypothesis import strategies as st

import cuvil
from cuvil.errors import ArgumentError, CuvilError, DTypeError, ShapeError
from cuvil.llm.call import Bound
from cuvil.llm.qlinear import Linear, linear, quantize_rows
from cuvil.llm.weights import Q4, Q8, Dense
from cuvil.target import Target

U = 2.0 ** -24
AVX2 = "llvm -mcpu=x86-64-v3"


def _q4(rng: np.random.Generator, n: int, k: int, group: int, symmetric: bool, half: bool = False) -> Q4:
    q = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    s = (rng.random((n, k // group), dtype=np.float32) * 0.02 + 1e-3).astype(np.float32)
    if half:  # scales exactly float16 (GGUF's): the kernel stores them as float16
        s = s.astype(np.float16).astype(np.float32)
    o = -8 * s if symmetric else (rng.standard_normal((n, k // group)) * 0.05).astype(np.float32)
    return Q4(q, s, o.astype(np.float32), group, symmetric)


def _q8(rng: np.random.Generator, n: int, k: int, group: int) -> Q8:
    q = rng.integers(-128, 128, (n, k), dtype=np.int8)
    return Q8(q, (rng.random((n, k // group), dtype=np.float32) * 0.02 + 1e-3).astype(np.float32), group)


def _dequantized_x(x: np.ndarray, group: int) -> np.ndarray:
    q, xs, _ = quantize_rows(x, group)
    rows, k = x.shape
    return (q.reshape(rows, k // group, group).astype(np.float64) * xs[:, :, None]).reshape(rows, k)


def _reference(L: Linear, x: np.ndarray, residual: np.ndarray | None, bias: np.ndarray | None
               ) -> tuple[np.ndarray, np.ndarray]:
    """(the float64 reference, the tolerance per element) for ``L`` on ``x`` (see the module's docstring)."""
    w = L.weight
    wd = w.dequantize().astype(np.float64)
    n, k = w.shape
    if L.activations == "int8":
        xd = _dequantized_x(x, w.group)
    else:
        xd = x.astype(np.float64)
    y = xd @ wd.T
    mag = np.abs(xd) @ np.abs(wd).T
    if isinstance(w, Dense):
        tol = (k + 4) * U * mag
    else:
        g = w.group
        ng = k // g
        s = np.repeat(w.scale.astype(np.float64), g, axis=1)
        if isinstance(w, Q4):
            q = w.values().astype(np.float64)
            o = np.repeat(w.offset.astype(np.float64), g, axis=1)
            c = 8.0
        else:
            q, o, c = w.q.astype(np.float64), 0.0 * s, 128.0
        terms = np.abs(s) * np.abs(q - c) + np.abs(o + c * s) + (np.abs(s) * (np.abs(q) + 8) + np.abs(o))
        n_ops = ng + 8 + (g if L.activations == "float32" else 0)
        tol = n_ops * U * (np.abs(xd) @ terms.T) + U * mag
    if residual is not None:
        y = y + residual
        tol = tol + 4 * U * np.abs(residual)
    if bias is not None:
        y = y + bias
        tol = tol + 4 * U * np.abs(bias)
    return y, tol + 4 * U * np.abs(y) + 1e-30


def _check(L: Linear, x: np.ndarray, residual: np.ndarray | None = None, bias: np.ndarray | None = None) -> None:
    out = np.full((L.rows, L.N), np.nan, np.float32)
    L(x, out, residual)
    ref, tol = _reference(L, x, residual, bias)
    err = np.abs(out - ref)
    assert np.all(err <= tol), f"{L}: worst error {err.max():.3e}, {float((err / tol).max()):.2f}x the bound"


# -- the activations' quantization -------------------------------------------------------------------------


@pytest.mark.parametrize("rows,k,group", [(1, 256, 32), (3, 512, 64), (2, 64, 8)])
@pytest.mark.slow
def test_quantized_activations_match_numpy_bit_for_bit(rows: int, k: int, group: int) -> None:
    rng = np.random.default_rng(rows + k)
    L = linear(_q4(rng, 32, k, group, True), rows)
    x = rng.standard_normal((rows, k), dtype=np.float32) * 3
    x[0, :group] = 0.0  # an all-zero group: scale 0, values 0
    x[-1, group] = 126.5 / 127 * np.abs(x[-1, group:2 * group]).max()  # a tie
    Bound(L.quantizer, x, *L._xq)()
    q, xs, xsum = quantize_rows(x, group)
    xa, ks, ki = L._scratch
    assert np.array_equal(xa.view(np.int8).reshape(rows, k), q)
    assert np.array_equal(ks, xs) and np.array_equal(ki, xsum)


# -- int8 activations --------------------------------------------------------------------------------------


@given(k_groups=st.integers(1, 6), n=st.integers(1, 80), group=st.sampled_from([8, 16, 32, 64, 128]),
       symmetric=st.booleans(), half=st.booleans(), rows=st.sampled_from([1, 2, 3, 4, 5, 9]),
       seed=st.integers(0, 2 ** 16))
@reference.budget(0.5)
@pytest.mark.slow
def test_q4_int8_activations(k_groups: int, n: int, group: int, symmetric: bool, half: bool, rows: int,
                             seed: int) -> None:
    rng = np.random.default_rng(seed)
    k = k_groups * group
    L = linear(_q4(rng, n, k, group, symmetric, half), rows)
    assert L.activations == "int8" and (L.rows, L.K, L.N) == (rows, k, n)
    _check(L, rng.standard_normal((rows, k), dtype=np.float32))


@given(k_groups=st.integers(1, 4), n=st.integers(1, 70), group=st.sampled_from([4, 32, 64, 256]),
       rows=st.sampled_from([1, 3, 4, 6]), seed=st.integers(0, 2 ** 16))
@reference.budget(0.3)
@pytest.mark.slow
def test_q8_int8_activations(k_groups: int, n: int, group: int, rows: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    k = k_groups * group
    L = linear(_q8(rng, n, k, group), rows)
    assert L.activations == "int8"
    _check(L, rng.standard_normal((rows, k), dtype=np.float32))


# -- float32 activations ----------------------------------------------------------------------------------


@given(k_groups=st.integers(1, 5), n=st.integers(1, 70), group=st.sampled_from([2, 6, 8, 32, 64]),
       symmetric=st.booleans(), rows=st.sampled_from([1, 2, 4, 7]), seed=st.integers(0, 2 ** 16))
@reference.budget(0.3)
@pytest.mark.slow
def test_q4_float32_activations(k_groups: int, n: int, group: int, symmetric: bool, rows: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    k = k_groups * group
    L = linear(_q4(rng, n, k, group, symmetric), rows, activations="float32")
    assert L.activations == "float32"
    _check(L, rng.standard_normal((rows, k), dtype=np.float32))


@pytest.mark.parametrize("rows,k,n", [(1, 64, 48), (3, 100, 37), (64, 96, 64)])
def test_dense(rows: int, k: int, n: int) -> None:
    rng = np.random.default_rng(k)
    L = linear(Dense(rng.standard_normal((n, k), dtype=np.float32)), rows)
    assert L.activations == "float32" and L.nbytes == n * k * 4 + (-n % L.tile.pt) * k * 4
    _check(L, rng.standard_normal((rows, k), dtype=np.float32))


# -- residual, bias, threads, bound calls --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["q4", "q4-float32", "q8", "dense"])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.slow
def test_residual_and_bias(kind: str, rows: int) -> None:
    rng = np.random.default_rng(7)
    k, n = 128, 40
    w = {"q4": lambda: _q4(rng, n, k, 32, True), "q4-float32": lambda: _q4(rng, n, k, 32, False),
         "q8": lambda: _q8(rng, n, k, 32), "dense": lambda: Dense(rng.standard_normal((n, k), dtype=np.float32))}[kind]()
    bias = rng.standard_normal(n, dtype=np.float32)
    L = linear(w, rows, residual=True, bias=bias, activations="float32" if kind == "q4-float32" else None)
    _check(L, rng.standard_normal((rows, k), dtype=np.float32), rng.standard_normal((rows, n), dtype=np.float32),
           bias)


def test_check_schedules_reaches_the_tile_schedule() -> None:
    """A tile schedule is trusted (the build skips isl's proof) unless the program is built to be proved."""
    from cuvil.llm import qlinear_kernels as qk

    w = Dense(np.random.default_rng(3).standard_normal((24, 64), dtype=np.float32))
    tile = qk.choose_tile(Target("llvm"), 1, 24)
    trusted = qk.dense_program(w, 1, tile, Target("llvm"), False, False).schedule
    proved = qk.dense_program(w, 1, tile, Target("llvm"), False, False, prove=True).schedule
    assert trusted.trusted_steps == len(trusted.trace) and not trusted.prove_deferred
    assert proved.trusted_steps == -1 and proved.prove_deferred


@pytest.mark.parametrize("kind", ["q4", "q4-float32", "q8", "dense"])
@pytest.mark.slow
def test_tile_schedules_are_proved_legal(kind: str) -> None:
    """The builds trust the tile schedules (legal by construction); with ``CompileOptions(check_schedules=True)``
    isl proves each kind's (rows 1 and 4, a residual and a bias: every stage the programs have)."""
    from cuvil.options import CompileOptions

    check = CompileOptions(check_schedules=True)
    rng = np.random.default_rng(11)
    k, n = 64, 24
    w = {"q4": lambda: _q4(rng, n, k, 32, True), "q4-float32": lambda: _q4(rng, n, k, 32, False),
         "q8": lambda: _q8(rng, n, k, 32), "dense": lambda: Dense(rng.standard_normal((n, k), dtype=np.float32))}[kind]()
    for rows in (1, 4):
        bias = rng.standard_normal(n, dtype=np.float32)
        L = linear(w, rows, residual=True, bias=bias, activations="float32" if kind == "q4-float32" else None,
                   options=check)
        _check(L, rng.standard_normal((rows, k), dtype=np.float32),
               rng.standard_normal((rows, n), dtype=np.float32), bias)


def test_bound_call_sees_x_changed_in_place_and_two_threads_agree() -> None:
    rng = np.random.default_rng(3)
    L = linear(_q4(rng, 256, 256, 32, True), 1)
    x = np.zeros((1, 256), np.float32)
    out = np.zeros((1, 256), np.float32)
    run = L.bind(x, out)
    try:
        for threads in (1, 2):
            cuvil.set_num_threads(threads)
            x[:] = rng.standard_normal((1, 256), dtype=np.float32)
            run()
            ref, tol = _reference(L, x, None, None)
            assert np.all(np.abs(out - ref) <= tol)
    finally:
        cuvil.set_num_threads(None)


# -- AVX2 without VNNI (x86-64-v3: vpmaddubsw + vpmaddwd for the 4-bit weights) -----------------------


@pytest.mark.skipif(not Target(AVX2).is_host, reason="x86-64-v3 code does not run on this CPU")
@pytest.mark.parametrize("kind,rows", [("q4", 1), ("q4", 5), ("q4-offsets", 3), ("q4-float32", 2), ("q8", 1),
                                       ("q8", 4), ("dense", 2)])
@pytest.mark.slow
def test_avx2_target(kind: str, rows: int) -> None:
    rng = np.random.default_rng(11)
    k, n = 256, 72
    w = {"q4": lambda: _q4(rng, n, k, 32, True), "q4-offsets": lambda: _q4(rng, n, k, 64, False),
         "q4-float32": lambda: _q4(rng, n, k, 32, False), "q8": lambda: _q8(rng, n, k, 32),
         "dense": lambda: Dense(rng.standard_normal((n, k), dtype=np.float32))}[kind]()
    L = linear(w, rows, AVX2, activations="float32" if kind == "q4-float32" else None)
    _check(L, rng.standard_normal((rows, k), dtype=np.float32))


def test_avx2_int4_uses_pmaddubsw() -> None:
    rng = np.random.default_rng(5)
    asm = linear(_q4(rng, 64, 256, 32, True), 1, AVX2).module.get_source("asm")
    assert "vpmaddubsw" in asm and "vpdpbusd" not in asm


def test_float16_scales_when_exact() -> None:
    rng = np.random.default_rng(2)
    exact = linear(_q4(rng, 64, 256, 32, True, half=True), 1)
    inexact = linear(_q4(rng, 64, 256, 32, True), 1)
    assert exact.nbytes == 64 * 128 + 64 * 8 * 2 and inexact.nbytes == 64 * 128 + 64 * 8 * 4


# -- bad input ---------------------------------------------------------------------------------------------


def test_errors() -> None:
    rng = np.random.default_rng(0)
    w = _q4(rng, 32, 64, 16, True)
    with pytest.raises(DTypeError, match="Dense, Q4 or Q8"):
        linear(np.zeros((4, 4), np.float32), 1)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="rows"):
        linear(w, 0)
    with pytest.raises(ShapeError, match="bias"):
        linear(w, 1, bias=np.zeros(31, np.float32))
    with pytest.raises(ArgumentError, match="activations"):
        linear(w, 1, activations="int4")
    with pytest.raises(ShapeError, match="multiple of 8"):
        linear(_q4(rng, 32, 12, 6, True), 1)
    with pytest.raises(ArgumentError, match="CPUs"):
        linear(w, 1, "cuda -arch=sm_80")
    L = linear(w, 2)
    x, out = np.zeros((2, 64), np.float32), np.zeros((2, 32), np.float32)
    with pytest.raises(ShapeError, match="x must be"):
        L(np.zeros((1, 64), np.float32), out)
    with pytest.raises(ShapeError, match="out must be"):
        L(x, np.zeros((2, 32), np.float64))
    with pytest.raises(ArgumentError, match="without a residual"):
        L(x, out, np.zeros((2, 32), np.float32))
    with pytest.raises(ArgumentError, match="with a residual"):
        linear(w, 2, residual=True)(x, out)
    with pytest.raises(CuvilError):
        L.bind(x, out[:, ::2])


# -- AArch64 with dotprod only (sdot: the 4-bit values as signed bytes, the 8-bit weights left signed) --------


def _run_linear_under_qemu(tmp_path, module, arrays: list[np.ndarray]) -> np.ndarray:
    """Export ``module`` (function ``linear``), link tests/codegen/aarch64_harness.c for AArch64 (its ``kernel``
    names renamed to ``linear``'s), run it under qemu on ``arrays`` (the last one the output); the output."""
    import subprocess

    from test_aarch64 import APT, HARNESS
    from toolchain import require

    gcc, qemu = require("aarch64-linux-gnu-gcc", APT), require("qemu-aarch64", APT)
    lib = module.export_library(tmp_path / "kernel.so")
    exe = tmp_path / "harness"
    names = ["-Dkernel=linear", "-Dkernel_set_num_threads=linear_set_num_threads", "-Dcuvil_meta_kernel=cuvil_meta_linear"]
    subprocess.run([gcc, "-O1", "-DTHREADS=2", *names, "-I", str(tmp_path), HARNESS, lib, f"-Wl,-rpath,{tmp_path}",
                    "-o", str(exe)], check=True, capture_output=True, text=True)
    cmd = [qemu, "-L", "/usr/aarch64-linux-gnu", str(exe), "0"]
    for pos, a in enumerate(arrays):
        path = tmp_path / f"arg{pos}.bin"
        if pos < len(arrays) - 1:
            np.ascontiguousarray(a).tofile(path)
        cmd += ["out" if pos == len(arrays) - 1 else "in", str(path), str(a.nbytes)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"qemu run failed ({proc.returncode}): {proc.stderr}"
    out = arrays[-1]
    return np.fromfile(tmp_path / f"arg{len(arrays) - 1}.bin", dtype=out.dtype).reshape(out.shape)


@pytest.mark.parametrize("kind,rows", [("q4", 1), ("q4-offsets", 3), ("q8", 2)])
@pytest.mark.slow
def test_aarch64_sdot_under_qemu(tmp_path, kind: str, rows: int) -> None:
    a76 = "llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a76 -mattr=+neon,+dotprod"
    rng = np.random.default_rng(13)
    k, n = 128, 40
    w = {"q4": lambda: _q4(rng, n, k, 32, True), "q4-offsets": lambda: _q4(rng, n, k, 32, False),
         "q8": lambda: _q8(rng, n, k, 32)}[kind]()
    L = linear(w, rows, a76)
    assert "sdot" in L.module.get_source("asm")
    x = rng.standard_normal((rows, k), dtype=np.float32)
    q, xs, xsum = quantize_rows(x, w.group)  # (the quantizer's own kernel is checked on this host)
    weights = L._weights
    out = _run_linear_under_qemu(tmp_path, L.module, [*weights, q.view(np.int32).reshape(rows, k // 4), xs, xsum,
                                                      np.zeros((rows, n), np.float32)])
    ref, tol = _reference(L, x, None, None)
    assert np.all(np.abs(out - ref) <= tol)


@pytest.mark.skipif(not Target(AVX2).is_host, reason="x86-64-v3 code does not run on this CPU")
@pytest.mark.parametrize("mask", [0x7F7F7F7F, 0x0F0F0F0F])
def test_avx2_pmaddubsw_is_exact_at_the_extremes(mask: int) -> None:
    """``dot4(u & mask, s)`` with every byte of the mask below 128 is ``vpmaddubsw`` + ``vpmaddwd`` on AVX2
    (cuvil.codegen.llvm_dot.dot4_pmaddubsw): exact for the largest pairs (127 * -128 twice: -32512)."""
    from cuvil import te
    from cuvil.ir.expr import dot4

    n = 64
    U = te.placeholder((n,), "int32", name="u")
    S = te.placeholder((n,), "int32", name="s")
    Y = te.compute((n,), lambda i: dot4(U[i] & mask, S[i]), name="y")
    s = te.create_schedule(Y)
    _, il = s[Y].split(Y.op.axis[0], 8)
    s[Y].vectorize(il)
    f = cuvil.build(s, [U, S, Y], AVX2)
    assert "vpmaddubsw" in f.get_source("asm")
    rng = np.random.default_rng(0)
    u = rng.integers(0, 256, (n, 4), dtype=np.uint8)
    v = rng.integers(-128, 128, (n, 4), dtype=np.int8)
    u[:8], v[:8] = 255, -128  # the extremes
    u[8:16], v[8:16] = 255, 127
    y = np.zeros(n, np.int32)
    f(u.view(np.int32).ravel(), v.view(np.int32).ravel(), y)
    ref = ((u & np.uint8(mask & 0xFF)).astype(np.int64) * v.astype(np.int64)).sum(axis=1)
    assert np.array_equal(y, ref)
