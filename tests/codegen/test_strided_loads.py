"""Vector reads of elements 2-4 apart: one masked load of their span and a shuffle (only the lanes' own
elements are read, so a span that would run past the buffer's end does not), for every element type; 5 or
more apart: a load per lane.  Exact against numpy on the host, on AVX2 (x86-64-v3) and on AArch64 under qemu."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuvil
from cuvil import te

DTYPES = ["float32", "float64", "float16", "int8", "uint8", "int16", "int32", "int64"]


def _program(n: int, stride: int, offset: int, dtype: str, lanes: int):
    size = (n - 1) * stride + offset + 2  # the last lane's second read is the buffer's last element
    A = te.placeholder((size,), dtype=dtype, name="A")
    B = te.compute((n,), lambda j: te.max(A[j * stride + offset], A[j * stride + offset + 1]), name="B")
    s = te.create_schedule(B.op)
    (j,) = B.op.axis
    _, ji = s[B].split(j, factor=lanes)
    s[B].vectorize(ji)
    return s, A, B


def _data(size: int, dtype: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(size).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size, endpoint=True).astype(dtype)


def _reference(a: np.ndarray, n: int, stride: int, offset: int) -> np.ndarray:
    at = np.arange(n) * stride + offset
    return np.maximum(a[at], a[at + 1])


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 70), stride=st.integers(2, 5), offset=st.integers(0, 3), dtype=st.sampled_from(DTYPES),
       lanes=st.sampled_from([4, 8, 16]), target=st.sampled_from(["llvm", "llvm -mcpu=x86-64-v3"]))
def test_strided_vector_reads_are_exact(n, stride, offset, dtype, lanes, target):
    s, A, B = _program(n, stride, offset, dtype, lanes)
    mod = cuvil.build(s, [A, B], target=target)
    a = _data((n - 1) * stride + offset + 2, dtype, n * 31 + stride)
    out = np.zeros(n, dtype)
    mod(a, out)
    np.testing.assert_array_equal(out, _reference(a, n, stride, offset))


@pytest.mark.parametrize("stride, span", [(2, True), (4, True), (5, False)])
def test_a_span_load_up_to_four_apart_and_a_load_per_lane_beyond(stride, span):
    s, A, B = _program(64, stride, 1, "float32", 16)
    ir_text = cuvil.build(s, [A, B], target="llvm -mcpu=x86-64-v3").get_source("llvm-unopt")
    assert ("llvm.masked.load" in ir_text) == span, ir_text[:2000]


def test_strided_float_reads_on_aarch64_under_qemu(tmp_path):
    from test_aarch64 import _run_under_qemu

    target = "llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a76 -mattr=+neon -num-cores=2"
    n, stride, offset = 37, 2, 1
    s, A, B = _program(n, stride, offset, "float32", 4)
    mod = cuvil.build(s, [A, B], target=target, name="kernel")
    a = _data((n - 1) * stride + offset + 2, "float32", 3)
    (out,) = _run_under_qemu(tmp_path, mod, [a, np.zeros(n, np.float32)], {1})
    np.testing.assert_array_equal(out, _reference(a, n, stride, offset))
