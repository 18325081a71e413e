"""Integer contractions (cuvil.graph.ops.quant.kernels): bit-exact against numpy's integer arithmetic.

Every u8/s8 mix, constant and run-time weights, shapes off the packing's multiples of 4 and of the
panels, values at the 8-bit limits, sums past int32 (they wrap, as numpy's: ``vpdpbusd``, not the
saturating ``vpdpbusds``), and convolutions with strides, dilations, padding (with a pad value), groups.
On this host the VNNI path runs when the CPU has ``avx512vnni``; a target without it is checked too (an
x86 takes the 16-bit pairs, tests/codegen/test_int8_pairs.py; grouped convolutions the plain int32 contraction);
the emitted code is checked for ``vpdpbusd`` on VNNI targets and for its absence elsewhere.
"""

from __future__ import annotations

import re

import isa
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reference import budget

import cuvil
from cuvil import te
from cuvil.errors import DTypeError, ShapeError
from cuvil.graph.ir import Node
from cuvil.graph.ops.base import NodeCtx
from cuvil.graph.ops.quant.kernels import dot_panel, int_conv, int_matmul
from cuvil.ir.expr import dot4

HOST = cuvil.Target("llvm")
HAS_VNNI = "avx512vnni" in HOST.enabled_features
AVX512 = "+avx512f,+avx512bw,+avx512vl,+avx512dq"
NO_VNNI = f"llvm -mcpu=skylake-avx512 -mattr={AVX512}"  # AVX-512 without VNNI: runs on any AVX-512 host
# (it takes the 16-bit pairs, vpmaddwd: tests/codegen/test_int8_pairs.py)
needs_vnni = isa.needs("avx512vnni")
needs_avx512 = isa.needs("avx512f")
INT8 = (np.uint8, np.int8)


def _ctx(target: cuvil.Target) -> NodeCtx:
    ctx = NodeCtx(Node("QLinearMatMul", "q", (), ("y",)), [], 13)
    ctx.target = target
    return ctx


def _build(make, inputs: list[np.ndarray], target: str | cuvil.Target = HOST):
    """Compile ``make(ctx, *placeholders)`` as the graph compiler does (auto-scheduled) for ``target``:
    the module, its argument arrays (inputs, then the constants the builder packed) and the output."""
    tgt = cuvil.Target(target) if isinstance(target, str) else target
    ctx = _ctx(tgt)
    phs = [te.placeholder(a.shape, dtype=a.dtype.name, name=f"x{i}") for i, a in enumerate(inputs)]
    y = make(ctx, *phs)
    args = phs + [p for _, p in ctx.placeholders] + [y]
    mod = cuvil.build(cuvil.auto_schedule(args, tgt), args, target=tgt)
    vals = list(inputs) + [ctx.entries[i] for i, _ in ctx.placeholders]
    return mod, vals, np.zeros([int(d.value) for d in y.shape], np.int32)


def _run(make, inputs: list[np.ndarray], target: str | cuvil.Target = HOST) -> np.ndarray:
    mod, vals, out = _build(make, inputs, target)
    mod(*vals, out)
    return out


def _matmul_ref(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    return np.matmul(a.astype(np.int64), w.astype(np.int64)).astype(np.int32)  # wraps past int32, as the kernel


def _values(draw, dtype, shape) -> np.ndarray:
    info = np.iinfo(dtype)
    kind = draw(st.sampled_from(["random", "min", "max", "limits"]))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    if kind == "min":
        return np.full(shape, info.min, dtype)
    if kind == "max":
        return np.full(shape, info.max, dtype)
    if kind == "limits":
        return rng.choice(np.array([info.min, info.max, 0, info.min + 1, info.max - 1], dtype), shape)
    return rng.integers(info.min, info.max + 1, shape).astype(dtype)


@st.composite
def matmuls(draw):
    m = draw(st.integers(1, 20))
    k = draw(st.sampled_from([1, 2, 3, 4, 5, 7, 8, 13, 33, 64, 70]))
    n = draw(st.sampled_from([1, 3, 16, 17, 31, 32, 33, 50]))
    ad, wd = draw(st.sampled_from(INT8)), draw(st.sampled_from(INT8))
    lead = draw(st.sampled_from([(m,), (2, m), (), "batched"]))
    if lead == "batched":  # w[B, K, N] against a[B, M, K]: one contraction over the batches (attention heads)
        return _values(draw, ad, (3, m, k)), _values(draw, wd, (3, k, n)), draw(st.booleans())
    return _values(draw, ad, lead + (k,)), _values(draw, wd, (k, n)), draw(st.booleans())


@budget(0.75)
@given(matmuls())
def test_int_matmul_exact(case):
    a, w, constant = case
    if constant:
        got = _run(lambda ctx, x: int_matmul(ctx, x, w), [a])
    else:
        got = _run(lambda ctx, x, y: int_matmul(ctx, x, y), [a, w])
    np.testing.assert_array_equal(got, _matmul_ref(a, w))


@pytest.mark.parametrize("ad, wd", [(x, y) for x in INT8 for y in INT8])
@pytest.mark.slow
def test_int_matmul_every_signedness_at_the_limits(ad, wd):
    rng = np.random.default_rng(1)
    cases = ((np.full((5, 67), np.iinfo(ad).min, ad), np.full((67, 40), np.iinfo(wd).max, wd)),
             (rng.choice(np.array([np.iinfo(ad).min, np.iinfo(ad).max], ad), (9, 130)),
              rng.choice(np.array([np.iinfo(wd).min, np.iinfo(wd).max], wd), (130, 35))))
    for (a, w), constant in zip(cases, (True, False)):  # constant weights, then run-time weights
        got = (_run(lambda ctx, x, w=w: int_matmul(ctx, x, w), [a]) if constant
               else _run(lambda ctx, x, y: int_matmul(ctx, x, y), [a, w]))
        np.testing.assert_array_equal(got, _matmul_ref(a, w))


def test_int32_sums_wrap_not_saturate():
    """255 * 127 over 70000 steps is past int32's maximum: the sum wraps (as numpy's int32), which the
    non-saturating ``vpdpbusd`` gives and ``vpdpbusds`` (clamped at 2**31 - 1) would not."""
    k = 70000
    a = np.full((2, k), 255, np.uint8)
    w = np.full((k, 32), 127, np.int8)
    ref = _matmul_ref(a, w)
    assert ref[0, 0] < 0  # wrapped
    np.testing.assert_array_equal(_run(lambda ctx, x: int_matmul(ctx, x, w), [a]), ref)


def test_a_target_without_vnni_is_exact_and_has_no_vpdpbusd():
    rng = np.random.default_rng(2)
    a = rng.integers(-128, 128, (13, 37)).astype(np.int8)
    w = rng.integers(0, 256, (37, 40)).astype(np.uint8)
    assert dot_panel(cuvil.Target(NO_VNNI)) == 0
    mod, vals, out = _build(lambda ctx, x: int_matmul(ctx, x, w), [a], NO_VNNI)
    assert "vpdpbusd" not in mod.get_source("asm")
    if "avx512f" in HOST.enabled_features:
        mod(*vals, out)
        np.testing.assert_array_equal(out, _matmul_ref(a, w))


@pytest.mark.parametrize("target, register", [(f"llvm -mcpu=icelake-server -mattr={AVX512},+avx512vnni", "zmm"),
                                              (f"llvm -mcpu=znver4 -mattr={AVX512},+avx512vnni", "zmm"),
                                              ("llvm -mcpu=alderlake -mattr=+avx2,+fma,+avxvnni", "ymm")])
def test_vnni_targets_emit_vpdpbusd(target, register):
    """AVX512-VNNI (Ice Lake, Zen 4) and AVX-VNNI (Alder Lake, 256-bit) get ``vpdpbusd`` from the
    contraction's loop IR; compiled only (the host need not have the feature)."""
    w = np.ones((256, 64), np.int8)
    mod, _, _ = _build(lambda ctx, x: int_matmul(ctx, x, w), [np.zeros((64, 256), np.uint8)], target)
    asm = mod.get_source("asm")
    assert re.search(rf"vpdpbusd\s+%{register}", asm), f"no vpdpbusd on {register} registers for {target}"
    assert "vpdpbusds" not in asm
    assert "llvm.x86.avx512.vpdpbusd" in mod.get_source("llvm")


@needs_vnni
@pytest.mark.parametrize("ad, wd", [(x, y) for x in INT8 for y in INT8])
def test_host_kernel_uses_vpdpbusd(ad, wd):
    """Every signedness mix reaches vpdpbusd (flipped where it must), none the byte arithmetic."""
    w = np.ones((64, 64), wd)
    mod, _, _ = _build(lambda ctx, x: int_matmul(ctx, x, w), [np.zeros((32, 64), ad)])
    asm = mod.get_source("asm")
    assert "vpdpbusd" in asm and "vpmulld" not in asm


@needs_avx512
@pytest.mark.parametrize("target", [NO_VNNI, "llvm"])
def test_dot4_vector_code_without_and_with_vnni(target):
    """``dot4`` in a vectorised loop: the byte arithmetic on a target without VNNI, ``vpdpbusd`` with it;
    both exact (unsigned bytes of the first operand, signed of the second)."""
    if target == "llvm" and not HAS_VNNI:
        pytest.skip(isa.lacks("avx512vnni"))
    n = 45  # two 16-lane vectors and a tail
    U = te.placeholder((n,), dtype="int32", name="U")
    S = te.placeholder((n,), dtype="int32", name="S")
    R = te.compute((n,), lambda i: dot4(U[i], S[i]) + 7, name="R")
    s = te.create_schedule(R)
    s[R].vectorize(s[R].op.axis[0])
    mod = cuvil.build(s, [U, S, R], target=target)
    rng = np.random.default_rng(3)
    u = rng.integers(-2**31, 2**31, n).astype(np.int32)
    v = rng.integers(-2**31, 2**31, n).astype(np.int32)
    u[:2], v[:2] = -1, np.int32(-2139062144)  # all bytes 255 and all bytes -128
    r = np.zeros(n, np.int32)
    mod(u, v, r)
    ref = (u.view(np.uint8).reshape(n, 4).astype(np.int64) * v.view(np.int8).reshape(n, 4)).sum(1) + 7
    np.testing.assert_array_equal(r, ref)


def _conv_ref(x, w, strides, dil, pb, pe, group, pad_value):
    xp = np.pad(x.astype(np.int64), [(0, 0), (0, 0)] + list(zip(pb, pe)), constant_values=pad_value)
    n, c = x.shape[:2]
    o, cg = w.shape[:2]
    kernel = w.shape[2:]
    out = [(xp.shape[2 + d] - dil[d] * (kernel[d] - 1) - 1) // strides[d] + 1 for d in range(len(kernel))]
    y = np.zeros((n, o) + tuple(out), np.int64)
    per = o // group
    for taps in np.ndindex(*kernel):
        sl = tuple(slice(taps[d] * dil[d], taps[d] * dil[d] + (out[d] - 1) * strides[d] + 1, strides[d])
                   for d in range(len(kernel)))
        win = xp[(slice(None), slice(None)) + sl]
        for g in range(group):
            wt = w[(slice(g * per, (g + 1) * per), slice(None)) + taps].astype(np.int64)
            y[:, g * per:(g + 1) * per] += np.einsum("oc,nc...->no...", wt, win[:, g * cg:(g + 1) * cg])
    return y.astype(np.int32)


@st.composite
def convs(draw):
    group = draw(st.sampled_from([1, 1, 1, 2, 3]))
    cg = draw(st.sampled_from([1, 3, 4, 5, 8]))
    per = draw(st.sampled_from([1, 2, 5, 16, 33])) if group > 1 else draw(st.sampled_from([1, 7, 16, 33, 40]))
    return conv_case(draw, group, cg, per, draw(st.sampled_from([1, 2, 2])))


def conv_case(draw, group: int, cg: int, per: int, nsp: int):
    """A convolution of ``group`` groups of ``cg`` input and ``per`` output channels in ``nsp`` spatial
    dimensions: its window, the input and the weights (values at the byte limits too), a pad value."""
    kernel = [draw(st.integers(1, 3)) for _ in range(nsp)]
    strides = [draw(st.integers(1, 2)) for _ in range(nsp)]
    dil = [draw(st.integers(1, 2)) for _ in range(nsp)]
    pb = [draw(st.integers(0, 2)) for _ in range(nsp)]
    pe = [draw(st.integers(0, 2)) for _ in range(nsp)]
    spatial = [draw(st.integers(dil[d] * (kernel[d] - 1) + 1, 9)) for d in range(nsp)]
    xd, wd = draw(st.sampled_from(INT8)), draw(st.sampled_from(INT8))
    x = _values(draw, xd, (draw(st.integers(1, 2)), group * cg) + tuple(spatial))
    w = _values(draw, wd, (group * per, cg) + tuple(kernel))
    info = np.iinfo(xd)
    pad_value = draw(st.sampled_from([0, int(info.min), int(info.max), 3]))
    return x, w, strides, dil, pb, pe, group, pad_value


@budget(0.75)
@given(convs())
@pytest.mark.slow
def test_int_conv_exact(case):
    x, w, strides, dil, pb, pe, group, pv = case
    got = _run(lambda ctx, t: int_conv(ctx, t, w, strides, dil, pb, pe, group, pad_value=pv), [x])
    np.testing.assert_array_equal(got, _conv_ref(x, w, strides, dil, pb, pe, group, pv))


@pytest.mark.parametrize("xd, wd", [(x, y) for x in INT8 for y in INT8])
@pytest.mark.slow
def test_int_conv_resnet_like_layer(xd, wd):
    """A 3x3 padded convolution with 64 channels (a ResNet layer, smaller image) at the byte limits."""
    rng = np.random.default_rng(4)
    x = rng.choice(np.array([np.iinfo(xd).min, np.iinfo(xd).max, 0], xd), (1, 64, 10, 10))
    w = rng.choice(np.array([np.iinfo(wd).min, np.iinfo(wd).max, 1], wd), (64, 64, 3, 3))
    pv = int(np.iinfo(xd).max)
    got = _run(lambda ctx, t: int_conv(ctx, t, w, [1, 1], [1, 1], [1, 1], [1, 1], 1, pad_value=pv), [x])
    np.testing.assert_array_equal(got, _conv_ref(x, w, [1, 1], [1, 1], [1, 1], [1, 1], 1, pv))


@pytest.mark.parametrize("xd, wd, shape, pads, stride", [("uint8", "int8", (1, 6, 3, 28), [0, 0], 1),
                                                       ("int8", "int8", (2, 40, 2, 20), [0, 0], 1),
                                                       ("uint8", "uint8", (1, 9, 27), [0], 1),
                                                       ("int8", "uint8", (1, 9, 3, 27), [1, 0], 1),
                                                       ("uint8", "int8", (1, 12, 5, 55), [0, 0], 2)])
@pytest.mark.slow
def test_int_conv_1x1_flat(xd, wd, shape, pads, stride):
    """A 1x1 convolution whose output rows are 17-31 pixels (ResNet-50's 28) runs over the flattened image;
    exact at the byte limits, channels not a multiple of 4, one spatial dimension, stride 2 (55 -> 28
    columns), and (image rows then) padding."""
    rng = np.random.default_rng(6)
    x = rng.choice(np.array([np.iinfo(xd).min, np.iinfo(xd).max, 0, 1], xd), shape)
    w = rng.choice(np.array([np.iinfo(wd).min, np.iinfo(wd).max, 1], wd), (40, shape[1]) + (1,) * (len(shape) - 2))
    ones, st = [1] * (len(shape) - 2), [stride] * (len(shape) - 2)
    got = _run(lambda ctx, t: int_conv(ctx, t, w, st, ones, pads, pads, 1, pad_value=5), [x])
    np.testing.assert_array_equal(got, _conv_ref(x, w, st, ones, pads, pads, 1, 5))


def test_bad_inputs_raise_cuvil_errors():
    ctx = _ctx(HOST)
    a = te.placeholder((4, 8), dtype="float32", name="a")
    with pytest.raises(DTypeError, match="uint8 or int8"):
        int_matmul(ctx, a, np.zeros((8, 4), np.int8))
    a8 = te.placeholder((4, 8), dtype="uint8", name="a8")
    with pytest.raises(DTypeError, match="weights"):
        int_matmul(ctx, a8, np.zeros((8, 4), np.int32))
    with pytest.raises(ShapeError, match=r"\[4, 8\] and \[7, 4\]"):
        int_matmul(ctx, a8, np.zeros((7, 4), np.int8))
    with pytest.raises(ShapeError, match=r"\[4, 8\] and \[3, 8, 4\]"):  # batches of w must lead a
        int_matmul(ctx, a8, np.zeros((3, 8, 4), np.int8))
    x = te.placeholder((1, 4, 5, 5), dtype="int8", name="x")
    w = np.zeros((6, 2, 3, 3), np.int8)
    with pytest.raises(ShapeError, match="group=1"):
        int_conv(ctx, x, w, [1, 1], [1, 1], [0, 0], [0, 0], 1)
    with pytest.raises(ShapeError, match="pad value 200"):
        int_conv(ctx, x, np.zeros((6, 4, 3, 3), np.int8), [1, 1], [1, 1], [1, 1], [1, 1], 1, pad_value=200)
    with pytest.raises(ShapeError, match="does not fit"):
        int_conv(ctx, x, np.zeros((6, 4, 7, 7), np.int8), [1, 1], [1, 1], [0, 0], [0, 0], 1)
    with pytest.raises(ShapeError, match="strides"):
        int_conv(ctx, x, np.zeros((6, 4, 3, 3), np.int8), [1], [1, 1], [0, 0], [0, 0], 1)


def test_tuner_knobs_see_the_int8_tile_and_stay_exact():
    """The autotuner's knob space of an int8 contraction: register tiles of int32 lanes (nr a multiple of
    16 on AVX-512, the 32-lane panel by default) and k unrolled in steps of four; any point is exact."""
    from cuvil.schedule.auto import default_knobs, knob_space

    rng = np.random.default_rng(5)
    a = rng.integers(-128, 128, (40, 100)).astype(np.int8)
    w = rng.integers(-128, 128, (100, 48)).astype(np.int8)
    ctx = _ctx(HOST)
    A = te.placeholder(a.shape, dtype="int8", name="A")
    y = int_matmul(ctx, A, w)
    args = [A] + [p for _, p in ctx.placeholders] + [y]
    space = knob_space(args, HOST)
    lanes = max(4, HOST.vector_bits // 32)
    name = next(n for n, k in space.items() if "mr" in k)  # the contraction (s8 x s8: before its +128 colsum)
    assert {"nr", "ku"} <= set(space[name]) and all(nr % lanes == 0 for nr in space[name]["nr"])
    chosen = default_knobs(args, HOST)[name]
    if dot_panel(HOST):
        assert chosen["nr"] == dot_panel(HOST)
    vals = [a] + [ctx.entries[i] for i, _ in ctx.placeholders]
    for knobs in ({"mr": 3, "nr": lanes, "ku": 4}, {"mr": 5, "nr": 2 * lanes, "ku": 2, "panels_outer": False}):
        mod = cuvil.build(cuvil.auto_schedule(args, HOST, knobs={name: knobs}), args)
        out = np.zeros((40, 48), np.int32)
        mod(*vals, out)
        np.testing.assert_array_equal(out, _matmul_ref(a, w))


A76_DOT = "llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a76 -mattr=+neon,+dotprod"


@pytest.mark.parametrize("ad, wd, target, instr", [
    (np.uint8, np.int8, A76_DOT, "sdot"),  # mixed: the activation flipped to s8, + 128 * colsum(w)
    (np.uint8, np.uint8, A76_DOT, "udot"),
    (np.int8, np.uint8, A76_DOT + ",+i8mm", "usdot"),  # i8mm: unsigned x signed as it is
])
@pytest.mark.slow
def test_aarch64_dot_product_under_qemu(tmp_path, ad, wd, target, instr):
    """AArch64 with +dotprod (+i8mm) gets udot / sdot (usdot) from the same loop IR; run under qemu."""
    from test_aarch64 import _run_under_qemu

    rng = np.random.default_rng(6)
    a = rng.integers(np.iinfo(ad).min, np.iinfo(ad).max + 1, (13, 37)).astype(ad)
    w = rng.integers(np.iinfo(wd).min, np.iinfo(wd).max + 1, (37, 21)).astype(wd)
    tgt = cuvil.Target(target)
    ctx = _ctx(tgt)
    A = te.placeholder(a.shape, dtype=a.dtype.name, name="A")
    y = int_matmul(ctx, A, w)
    args = [A] + [p for _, p in ctx.placeholders] + [y]
    mod = cuvil.build(cuvil.auto_schedule(args, tgt), args, target=tgt, name="kernel")
    assert re.search(rf"\b{instr}\s+v\d+\.4s", mod.get_source("asm")), f"no {instr} in the AArch64 kernel"
    arrays = [a] + [ctx.entries[i] for i, _ in ctx.placeholders] + [np.zeros((13, 21), np.int32)]
    (out,) = _run_under_qemu(tmp_path, mod, arrays, {len(arrays) - 1})
    np.testing.assert_array_equal(out, _matmul_ref(a, w))
