"""Narrow contractions: a matmul whose N is a vector register or a few (gcn's 2708 x 1433 by 1433 x 16).

The automatic scheduler may tile such a matmul two ways: B's columns in vector lanes with A's rows read
as broadcasts (no copy), or A's rows in lanes, which needs A transposed into panels by a copy of all
of A.  Each element of A serves only N multiply-adds, so that copy (a strided load and a store per
element) costs more than the wider tile saves: :meth:`AutoScheduler.choose` counts it
(``_copy_share``) and keeps the unpacked tile, on AVX-512 (N = 16: one vector) as on AVX2 (two).  A
tile whose rows end in a masked vector (N = 7) keeps its accumulators on the stack, and there the copy
pays: the packed candidate stays.

Results against numpy in float64.  Tolerance: each output is a float32 sum of K products, rounded
once per product and once per addition in some order; its error is at most ``gamma_(K+1) * sum_k
|a_ik| |b_kj|`` with ``gamma_n = n u / (1 - n u)``, ``u = 2^-24`` (Higham, the standard bound of a dot
product in any order).  That bound, computed per element, is the tolerance: no slack fitted to a run.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reference import budget

import cuvil
from cuvil import te
from cuvil.schedule.auto import AutoScheduler
from cuvil.schedule.auto_tile import _masked_row
from cuvil.schedule.schedule import Schedule
from cuvil.target import Target

AVX512, AVX2 = "llvm -mcpu=x86-64-v4", "llvm -mcpu=x86-64-v3"


def _matmul(m: int, k: int, n: int) -> tuple:
    A = te.placeholder((m, k), dtype="float32", name="A")
    B = te.placeholder((k, n), dtype="float32", name="B")
    r = te.reduce_axis((0, k), name="k")
    C = te.compute((m, n), lambda i, j: te.sum(A[i, r] * B[r, j], axis=r), name="C")
    return A, B, C


def _choice(m: int, k: int, n: int, target: str) -> tuple[str, int | None]:
    """(the axis the chosen tile puts in vector lanes, the vector operand's packed dimension)."""
    _, _, C = _matmul(m, k, n)
    s = Schedule([C])
    c = AutoScheduler(s, [s[C]], target).choose(s[C].op)
    return c.j.name, c.pack_dim


def _runs_here(target: str) -> bool:
    return Target(target).kind == "llvm" and not Target(target).missing_here()


def _check(m: int, k: int, n: int, target: str, seed: int = 0, prove: bool | None = None) -> None:
    A, B, C = _matmul(m, k, n)
    s = cuvil.auto_schedule([A, B, C], target=target, prove=prove)
    f = cuvil.build(s, [A, B, C], target=target)
    rng = np.random.default_rng(seed)
    a = rng.uniform(-1, 1, (m, k)).astype(np.float32)
    b = rng.uniform(-1, 1, (k, n)).astype(np.float32)
    c = np.zeros((m, n), np.float32)
    f(a, b, c)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    u = 2.0 ** -24
    gamma = (k + 1) * u / (1 - (k + 1) * u)
    bound = gamma * (np.abs(a64) @ np.abs(b64))
    err = np.abs(c - a64 @ b64)
    assert np.all(err <= bound), f"{m}x{k}x{n} on {target}: error {err.max():.3g} above the bound {bound.max():.3g}"


@pytest.mark.parametrize("target", [AVX512, AVX2])
def test_gcn_shape_keeps_rows_as_broadcasts(target):
    """2708 x 1433 by 1433 x 16: B's columns in lanes, no copy of A (before: A transposed into panels,
    1.3 -> 7.2 ms on Zen 4)."""
    assert _choice(2708, 1433, 16, target) == ("j", None)


@pytest.mark.parametrize("n", [4, 8, 16, 24, 48])
def test_narrow_columns_never_copy_the_tall_operand(n):
    for target in (AVX512, AVX2):
        assert _choice(512, 768, n, target) == ("j", None), (n, target)


def test_masked_rows_keep_the_packed_tile():
    """N = 7 ends each tile row in a masked vector (accumulators on the stack): the copy pays there."""
    assert _masked_row(7) and _masked_row(13) and not any(_masked_row(c) for c in (1, 2, 4, 5, 6, 8, 12, 16, 24))
    assert _choice(2708, 768, 7, AVX512) == ("i", 0)


def test_the_lowered_loops_have_no_copy_of_a():
    A, B, C = _matmul(2708, 1433, 16)
    s = cuvil.auto_schedule([A, B, C], target=AVX512)
    text = str(cuvil.lower(s, [A, B, C]))
    assert "A.global" not in text and "C.local" in text


def test_gcn_shape_matches_numpy_and_is_proved():
    """The gcn shape at the host's width, the scheduler's strategy proved by isl (prove=True)."""
    _check(2708, 1433, 16, "llvm", prove=True)


@budget(0.3)
@given(m=st.integers(1, 300), k=st.integers(1, 600), n=st.integers(1, 48), avx2=st.booleans(),
       seed=st.integers(0, 2**16))
def test_narrow_matmul_matches_numpy(m, k, n, avx2, seed):
    target = AVX2 if avx2 else "llvm"
    if not _runs_here(target):
        pytest.skip(f"{target} does not run on this CPU")
    _check(m, k, n, target, seed)
