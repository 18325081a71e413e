"""Integer contractions on an x86 without VNNI: bytes widened to 16-bit pairs and ``vpmaddwd``
(cuvil.ir.expr.dot2_i16, cuvil.graph.ops.quant.kernels.word_plan), bit-exact against numpy's integers.

The targets are named CPUs (``x86-64`` SSE2, ``x86-64-v3`` AVX2, ``skylake-avx512`` AVX-512 BW without
VNNI): each is compiled and its code checked for ``vpmaddwd`` at its width and never the saturating
``vpmaddubsw``; it runs here when this CPU has its features.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reference import budget
from test_int8_kernels import _build, _conv_ref, _ctx, _matmul_ref

import cuvil
from cuvil import te
from cuvil.errors import DTypeError
from cuvil.graph.ops.quant.conv_nhwc import int_conv_nhwc
from cuvil.graph.ops.quant.kernels import int_conv, int_matmul, word_plan
from cuvil.ir.expr import dot2_i16

X86 = cuvil.Target("llvm").triple.startswith("x86_64")
# (target, the register vpmaddwd uses)
PAIR_TARGETS = [("llvm -mtriple=x86_64-linux-gnu -mcpu=x86-64", "xmm"),
                ("llvm -mtriple=x86_64-linux-gnu -mcpu=x86-64-v3", "ymm"),
                ("llvm -mtriple=x86_64-linux-gnu -mcpu=skylake-avx512", "zmm")]
INT8 = (np.uint8, np.int8)


def _ints(rng: np.random.Generator, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max + 1, shape).astype(dtype)


def _runs_here(target: str) -> bool:
    return X86 and cuvil.Target(target).is_host


def test_word_plan_follows_the_features():
    assert word_plan(cuvil.Target("llvm -mtriple=x86_64-linux-gnu -mcpu=x86-64-v3")) == (2, 16)
    assert word_plan(cuvil.Target("llvm -mtriple=x86_64-linux-gnu -mcpu=skylake-avx512")) == (2, 32)
    assert word_plan(cuvil.Target("llvm -mtriple=x86_64-linux-gnu -mcpu=x86-64")) == (2, 8)
    assert word_plan(cuvil.Target("llvm -mtriple=x86_64-linux-gnu -mcpu=znver4"))[0] == 4  # VNNI: dot4
    assert word_plan(cuvil.Target("llvm -mtriple=x86_64-linux-gnu -mcpu=alderlake"))[0] == 4  # AVX-VNNI
    assert word_plan(cuvil.Target("llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a72")) == (0, 0)  # no dotprod


def test_dot2_i16_types():
    with pytest.raises(DTypeError, match="two packed int16"):
        dot2_i16(te.const(1, "int16"), te.const(1, "int32"))


@pytest.mark.parametrize("target, register", PAIR_TARGETS)
@pytest.mark.parametrize("ad, wd", [(x, y) for x in INT8 for y in INT8])
@pytest.mark.slow
def test_matmul_pairs_are_exact_and_use_vpmaddwd(target, register, ad, wd):
    """Every signedness mix, a reduction of odd length (the last word holds one step) and columns off the
    panel's multiple; values at the 8-bit limits (a pair's sum reaches 2 * 255 * 128, past int16)."""
    rng = np.random.default_rng(3)
    a = _ints(rng, ad, (13, 37))
    w = _ints(rng, wd, (37, 40))
    a[0, :], w[:, 0] = np.iinfo(ad).min, np.iinfo(wd).min
    a[1, :], w[:, 1] = np.iinfo(ad).max, np.iinfo(wd).max
    mod, vals, out = _build(lambda ctx, x: int_matmul(ctx, x, w), [a], target)
    asm = mod.get_source("asm")
    assert f"vpmaddwd\t%{register}" in asm or (register == "xmm" and "pmaddwd\t%xmm" in asm), asm[:3000]
    assert "pmaddubsw" not in asm and "vpdpbusd" not in asm
    if _runs_here(target):
        mod(*vals, out)
        np.testing.assert_array_equal(out, _matmul_ref(a, w))


V3 = "llvm -mtriple=x86_64-linux-gnu -mcpu=x86-64-v3"
needs_v3 = pytest.mark.skipif(not _runs_here(V3), reason="needs avx2 and fma (x86-64-v3): this CPU lacks them")


@needs_v3
def test_sums_past_int32_wrap_like_numpy():
    k = 70000
    a = np.full((2, k), 255, np.uint8)
    w = np.full((k, 16), 127, np.int8)
    mod, vals, out = _build(lambda ctx, x: int_matmul(ctx, x, w), [a], V3)
    mod(*vals, out)
    ref = _matmul_ref(a, w)
    assert ref[0, 0] < 0
    np.testing.assert_array_equal(out, ref)


@needs_v3
@budget(0.25)
@given(c=st.integers(1, 9), o=st.integers(1, 20), size=st.integers(1, 9), kern=st.integers(1, 3),
       stride=st.integers(1, 2), pad_lo=st.integers(0, 1), pad_hi=st.integers(0, 1), xd=st.sampled_from(INT8),
       wd=st.sampled_from(INT8), seed=st.integers(0, 2**16))
@pytest.mark.slow
def test_conv_pairs_nchw_and_nhwc_are_exact(c, o, size, kern, stride, pad_lo, pad_hi, xd, wd, seed):
    """NCHW (int_conv) and channels-last (int_conv_nhwc, from an NCHW or NHWC input) convolutions with an
    odd channel count, padding at either end (a 1x1 window reaching past the image included), strides,
    and the zero point as the pad value, against numpy's integers."""
    size = max(size, kern - pad_lo - pad_hi)
    rng = np.random.default_rng(seed)
    x = _ints(rng, xd, (1, c, size, size))
    w = _ints(rng, wd, (o, c, kern, kern))
    pv = int(_ints(rng, xd, ()))
    args = ([stride] * 2, [1, 1], [pad_lo] * 2, [pad_hi] * 2, 1)
    ref = _conv_ref(x, w, *args, pad_value=pv)
    got = _run_conv(lambda ctx, t: int_conv(ctx, t, w, *args, pad_value=pv), x, ref.shape)
    np.testing.assert_array_equal(got, ref)
    want = ref.transpose(0, 2, 3, 1)
    got = _run_conv(lambda ctx, t: int_conv_nhwc(ctx, t, w, *args, pad_value=pv, in_nhwc=False), x, want.shape)
    np.testing.assert_array_equal(got, want)
    xh = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    got = _run_conv(lambda ctx, t: int_conv_nhwc(ctx, t, w, *args, pad_value=pv), xh, want.shape)
    np.testing.assert_array_equal(got, want)


def _run_conv(make, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    mod, vals, _ = _build(make, [x], V3)
    out = np.zeros(shape, np.int32)
    mod(*vals, out)
    return out


def test_a_profile_counts_every_packed_product():
    """cuvil.graph.profile.contraction_flops: a pair (dot2_i16) is two products, a VNNI word (dot4) four."""
    from cuvil.graph.profile import contraction_flops

    a = np.zeros((13, 36), np.uint8)
    w = np.ones((36, 40), np.int8)
    for target, kind in ((V3, "int8"), ("llvm -mtriple=x86_64-linux-gnu -mcpu=znver4", "int8")):
        ctx = _ctx(cuvil.Target(target))
        A = te.placeholder(a.shape, dtype="uint8", name="A")
        y = int_matmul(ctx, A, w)
        flops, got = contraction_flops([A, y])
        assert got == kind and flops == 2 * 13 * 36 * 40
