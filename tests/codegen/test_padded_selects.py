"""A vector select whose condition varies across lanes and whose true side reads memory (a padded window's
edge: ``x >= 0 ? X[x] : pad``): a side of elements up to 4 apart is a masked (span) load; any other side, in
a full vector, first tests whether every lane takes the true side (then plain vector code), else goes lane
by lane.  Exact against
numpy on the host, on AVX2 and on AArch64 (qemu)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuvil
from cuvil import te

TARGETS = ["llvm", "llvm -mcpu=x86-64-v3"]


def _program(n: int, pad: int, stride: int, lanes: int):
    """B[j] = max of X at columns j*stride - pad + {0, 1}, the columns outside X counting as -1000."""
    w = n * stride
    X = te.placeholder((w,), name="X")

    def tap(j, t):
        x = j * stride - pad + t
        return te.if_then_else(te.all(x >= 0, x < w), X[x], te.const(-1000.0))

    B = te.compute((n,), lambda j: te.max(tap(j, 0), tap(j, 1)), name="B")
    s = te.create_schedule(B.op)
    (j,) = B.op.axis
    _, ji = s[B].split(j, factor=lanes)
    s[B].vectorize(ji)
    return s, X, B


def _reference(x: np.ndarray, n: int, pad: int, stride: int) -> np.ndarray:
    padded = np.concatenate([np.full(pad, -1000.0, np.float32), x, np.full(pad + 2, -1000.0, np.float32)])
    at = np.arange(n) * stride
    return np.maximum(padded[at], padded[at + 1])


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 70), pad=st.integers(0, 3), stride=st.integers(1, 5), lanes=st.sampled_from([4, 8, 16]),
       target=st.sampled_from(TARGETS))
def test_padded_reads_are_exact(n, pad, stride, lanes, target):
    s, X, B = _program(n, pad, stride, lanes)
    mod = cuvil.build(s, [X, B], target=target)
    x = np.random.default_rng(n * 7 + pad).standard_normal(n * stride).astype(np.float32)
    out = np.zeros(n, np.float32)
    mod(x, out)
    np.testing.assert_array_equal(out, _reference(x, n, pad, stride))


@pytest.mark.parametrize("target, stride, tests_all", [
    ("llvm -mcpu=x86-64-v3", 1, False),     # a unit-stride side: masked loads (AVX2's vmaskmovps)
    ("llvm -mcpu=x86-64-v4", 1, False),     # AVX-512: k-masks
    ("llvm -mcpu=x86-64-v3", 2, False),     # 2-4 apart: a span load, its mask and the select's together
    ("llvm -mcpu=x86-64-v4", 4, False),
    ("llvm -mcpu=x86-64-v3", 5, True),      # 5 apart cannot be masked: lane by lane unless all in
    ("llvm -mcpu=x86-64-v4", 5, True),
])
def test_which_targets_test_every_lane_first(target, stride, tests_all):
    s, X, B = _program(64, 1, stride, 8)
    text = cuvil.build(s, [X, B], target=target).get_source("llvm-unopt")
    assert ("llvm.vector.reduce.and" in text) == tests_all


def test_padded_reads_on_aarch64_under_qemu(tmp_path):
    from test_aarch64 import _run_under_qemu

    target = "llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a76 -mattr=+neon -num-cores=2"
    s, X, B = _program(37, 1, 5, 4)  # stride 5: not maskable
    assert "llvm.vector.reduce.and" in cuvil.build(s, [X, B], target=target).get_source("llvm-unopt")
    mod = cuvil.build(s, [X, B], target=target, name="kernel")
    x = np.random.default_rng(5).standard_normal(37 * 5).astype(np.float32)
    (out,) = _run_under_qemu(tmp_path, mod, [x, np.zeros(37, np.float32)], {1})
    np.testing.assert_array_equal(out, _reference(x, 37, 1, 5))
