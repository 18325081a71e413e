"""The te programs and schedules of :mod:`cuvil.llm.qlinear` (its docstring describes the layouts and the
arithmetic): the weights laid out in panels when compiling, the register-tiled contractions, and the
activations' quantization."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cuvil import te
from cuvil.ir.expr import dot4
from cuvil.llm.weights import Q4, Q8, Dense
from cuvil.schedule.axes import const_int

MASK = 0x0F0F0F0F  # the low nibble of each byte of a word
DENSE_UNROLL = 4  # steps of k a dense tile unrolls


@dataclass
class Program:
    """A contraction before it is compiled: its schedule, its arguments in order (the weights' constants
    first, then ``x`` when ``takes_x``, or the quantized activations ``xa, xs, xsum``; the residual, the
    bias, the output), the constants' arrays, and the weight bytes a call streams."""

    schedule: Any
    args: list[te.Tensor]
    consts: list[np.ndarray]
    takes_x: bool
    nbytes: int


# -- compile-time layouts ---------------------------------------------------------------------------------


def panels(a: np.ndarray, pt: int) -> np.ndarray:
    """``a [N, X]`` as panels ``[ceil(N / pt), X, pt]`` (zero columns past N)."""
    n, x = a.shape
    tiles = -(-n // pt)
    full = np.zeros((tiles * pt, x), a.dtype)
    full[:n] = a
    return np.ascontiguousarray(full.reshape(tiles, pt, x).transpose(0, 2, 1))


def q4_words(w: Q4) -> np.ndarray:
    """The 4-bit values of ``w`` as int32 words ``[N, K / 8]``: byte b of word u holds k = 8u + b in its
    low nibble and k = 8u + 4 + b in its high one."""
    v = w.values()  # uint8 [N, K]
    n, k = v.shape
    v = v.reshape(n, k // 8, 2, 4)
    b = (v[:, :, 0] | (v[:, :, 1] << 4)).astype(np.uint8)  # [N, K/8, 4]
    return np.ascontiguousarray(b).view("<i4")[..., 0].astype(np.int32)


def q8_words(w: Q8, signed: bool = False) -> np.ndarray:
    """The int8 values of ``w`` XOR 0x80 (unsigned: q + 128; as they are when ``signed``) as int32 words
    ``[N, K / 4]``."""
    n, k = w.q.shape
    b = (w.q.view(np.uint8) ^ (0 if signed else 0x80)).astype(np.uint8).reshape(n, k // 4, 4)
    return np.ascontiguousarray(b).view("<i4")[..., 0].astype(np.int32)


def scale_dtype(*arrays: np.ndarray) -> np.dtype:
    """float16 when every value is exactly a float16 (the kernels widen it exactly), else float32."""
    for a in arrays:
        if not np.array_equal(a.astype(np.float16).astype(np.float32), a):
            return np.dtype(np.float32)
    return np.dtype(np.float16)


# -- the plan of a kernel ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tile:
    """A register tile: ``mr`` rows by ``pt`` columns (``pt`` a whole number of ``lanes``)."""

    mr: int
    pt: int
    lanes: int


def choose_tile(target: Any, rows: int, n: int) -> Tile:
    """The register tile for ``rows`` rows.  A decode step (fewer than 4 rows): one row by as many vectors
    as cover the multiply-add pipes' latency with independent accumulators (``fma_units * fma_latency /
    2``, a power of two, at most a quarter of the vector registers: 4 on Zen 4, AVX2 and Cortex-A76).  A
    prefill: four rows by two vectors (Zen 4, 2048 x 2048, 128 rows, 1 thread: 4x2 312 GFLOP/s, 6x2 318,
    8x1 313, 4x4 305, 2x4 291; x86-64-v3 code on the same CPU: 4x2 146, 2x4 152, 4x1 136).  Fewer
    vectors when N is smaller."""
    lanes = target.panel_lanes(4)
    if rows < 4:
        want = max(2, (max(1, target.fma_units) * max(1, target.fma_latency)) // 2)
        vecs = min(1 << (want - 1).bit_length(), max(2, (target.vector_registers or 16) // 4))
    else:
        vecs = 2
    while vecs > 1 and n < vecs * lanes:
        vecs //= 2
    mr = 1 if rows < 4 else min(4, rows)
    return Tile(mr, vecs * lanes, lanes)


def dot_signs(target: Any) -> str:
    """The signs of the byte dot product the int8 kernels use on ``target``: "us" (x86 VNNI's
    ``vpdpbusd``, AArch64 i8mm's ``usdot``; also x86 without VNNI, where the 4-bit weights' bytes below
    128 make it ``vpmaddubsw``), "ss" where only a signed one exists (AArch64 ``sdot``: the 4-bit values
    are the same bytes signed, and the 8-bit weights are left signed)."""
    from cuvil.codegen.llvm_dot import dot4_kinds

    kinds = dot4_kinds(target)
    return "ss" if "dot4_u8s8" not in kinds and "dot4_s8s8" in kinds else "us"


# -- the kernels ------------------------------------------------------------------------------------------


def schedule_tile(s: Any, out: te.Tensor, y: te.Tensor, inner: te.Tensor | None, tile: Tile, red: list[Any],
                  unroll_k: int = 1, max_t: int = 4, prove: bool = False) -> None:
    """:func:`_tile_steps`, trusted unless ``prove``: the tile schedules are legal by construction (a
    contraction's output split into panels and row tiles, its sums at each tile), so the build skips isl's
    proof, as for the automatic scheduler's strategies; ``prove`` (``CompileOptions(check_schedules=True)``
    passed to :func:`cuvil.llm.qlinear.linear`) has isl prove them."""
    s.prove_deferred = prove
    with s.deferred_checks([s[out]]):
        _tile_steps(s, out, y, inner, tile, red, unroll_k, max_t)
    if not prove:
        s.trusted_steps = len(s.trace)


def _tile_steps(s: Any, out: te.Tensor, y: te.Tensor, inner: te.Tensor | None, tile: Tile, red: list[Any],
                unroll_k: int = 1, max_t: int = 4) -> None:
    """``out`` in panels of ``tile.pt`` columns (parallel) and tiles of ``tile.mr`` rows; ``y`` (its sum
    over groups) at each tile, ``inner`` (the per-group sum, reduction axes ``red``) at each group of ``y``,
    both vectorised over the columns with every other loop of the tile unrolled (``y``'s reduction split
    by ``unroll_k`` and its inner part unrolled too; of ``inner``'s first reduction axis, at most ``max_t``
    steps: a group of 256 or per-channel weights would otherwise unroll hundreds of steps)."""
    m, n = s[out].op.axis
    no, ni = s[out].split(n, tile.pt)
    mo, mi = s[out].split(m, tile.mr)
    s[out].reorder(no, mo, mi, ni)
    s[out].parallel(no)
    _, nl = s[out].split(ni, tile.lanes)
    s[out].vectorize(nl)
    s[y].compute_at(s[out], mo)
    ym, yn = s[y].op.axis
    (g,) = s[y].op.reduce_axis
    yu, yl = s[y].split(yn, tile.lanes)
    if unroll_k > 1:
        go, g = s[y].split(g, unroll_k)
        s[y].reorder(go, g, ym, yu, yl)
        s[y].unroll(g)
    else:
        s[y].reorder(g, ym, yu, yl)
    s[y].unroll(ym)
    s[y].unroll(yu)
    s[y].vectorize(yl)
    if inner is None:
        return
    s[inner].compute_at(s[y], g)
    im, inn, ig = s[inner].op.axis
    iu, il = s[inner].split(inn, tile.lanes)
    t, rest = red[0], list(red[1:])
    outer = []
    if (const_int(t.extent) or 0) > max_t:  # a large group: its words in a loop of unrolled steps
        to, t = s[inner].split(t, max_t)
        outer = [to]
    s[inner].reorder(ig, *outer, t, *rest, im, iu, il)
    for ax in (t, *rest, im, iu):
        s[inner].unroll(ax)
    s[inner].vectorize(il)


def _out_stage(y: te.Tensor, rows: int, n: int, residual: te.Tensor | None, bias: te.Tensor | None) -> te.Tensor:
    def body(m: Any, j: Any) -> Any:
        v = y[m, j]
        if residual is not None:
            v = residual[m, j] + v
        if bias is not None:
            v = v + bias[j]
        return v

    return te.compute((rows, n), body, name="out")


def _f32(x: Any) -> Any:
    return x if x.dtype == "float32" else te.cast(x, "float32")


def _io(rows: int, K: int, N: int, residual: bool, bias: bool) -> tuple[te.Tensor, te.Tensor | None,
                                                                          te.Tensor | None]:
    X = te.placeholder((rows, K), "float32", name="x")
    R = te.placeholder((rows, N), "float32", name="residual") if residual else None
    B = te.placeholder((N,), "float32", name="bias") if bias else None
    return X, R, B


def _program(s: Any, ins: list[te.Tensor], consts: list[np.ndarray], X: te.Tensor | None, out: te.Tensor,
             R: te.Tensor | None, B: te.Tensor | None, nbytes: int) -> Program:
    args = list(ins) + [t for t in (X, R, B) if t is not None] + [out]
    return Program(s, args, consts, X is not None, int(nbytes))


def int8_program(w: Q4 | Q8, rows: int, tile: Tile, target: Any, residual: bool, bias: bool,
                 layout_only: bool = False, prove: bool = False) -> Program:
    """``out = residual + y + bias`` with ``y`` from int8 activations (arguments ``xa, xs, xsum``);
    ``layout_only``: only the constants (the program of a repeated shape is already compiled)."""
    K, N = w.shape[1], w.shape[0]
    G = w.group
    NG = K // G
    pt = tile.pt
    tiles = -(-N // pt)
    signs = dot_signs(target)
    if isinstance(w, Q4):
        words, per = q4_words(w), 8
        off = None if w.symmetric else (w.offset + 8 * w.scale).astype(np.float32)
        c = 8
    else:
        words, per = q8_words(w, signed=signs == "ss"), 4
        off, c = None, (0 if signs == "ss" else 128)
    sd = scale_dtype(w.scale, *([off] if off is not None else []))
    consts = [panels(words, pt), panels(w.scale.astype(sd), pt)]
    if off is not None:
        consts.append(panels(off.astype(sd), pt))
    if layout_only:
        return Program(None, [], consts, False, sum(a.nbytes for a in consts))
    W = te.placeholder(consts[0].shape, "int32", name="w")
    WS = te.placeholder(consts[1].shape, sd.name, name="ws")
    WO = te.placeholder(consts[2].shape, sd.name, name="wo") if off is not None else None
    XA = te.placeholder((rows, K // 4), "int32", name="xa")
    XS = te.placeholder((rows, NG), "float32", name="xs")
    XI = te.placeholder((rows, NG), "int32", name="xsum")
    wpg = G // per  # weight words per group
    t = te.reduce_axis((0, wpg), name="t")
    if isinstance(w, Q4):
        h = te.reduce_axis((0, 2), name="h")
        red = [t, h]

        def isum_body(m: Any, n: Any, g: Any) -> Any:
            word = W[n // pt, g * wpg + t, n % pt]
            nib = te.if_then_else(h == 0, word & MASK, (word // 16) & MASK)
            return te.sum(dot4(nib, XA[m, (g * wpg + t) * 2 + h], signs), axis=[t, h])
    else:
        red = [t]

        def isum_body(m: Any, n: Any, g: Any) -> Any:
            return te.sum(dot4(W[n // pt, g * wpg + t, n % pt], XA[m, g * wpg + t], signs), axis=t)

    isum = te.compute((rows, tiles * pt, NG), isum_body, name="isum")
    g = te.reduce_axis((0, NG), name="g")

    def y_body(m: Any, n: Any) -> Any:
        i = isum[m, n, g] - XI[m, g] * c if c else isum[m, n, g]
        v = _f32(WS[n // pt, g, n % pt]) * te.cast(i, "float32")
        if WO is not None:
            v = v + _f32(WO[n // pt, g, n % pt]) * te.cast(XI[m, g], "float32")
        return te.sum(XS[m, g] * v, axis=g)

    y = te.compute((rows, tiles * pt), y_body, name="y")
    _, R, B = _io(rows, K, N, residual, bias)
    out = _out_stage(y, rows, N, R, B)
    s = te.create_schedule(out)
    schedule_tile(s, out, y, isum, tile, red, max_t=4 if isinstance(w, Q4) else 8, prove=prove)
    ins = [W, WS] + ([WO] if WO is not None else []) + [XA, XS, XI]
    return _program(s, ins, consts, None, out, R, B, sum(a.nbytes for a in consts))


def q4_float_program(w: Q4, rows: int, tile: Tile, target: Any, residual: bool, bias: bool,
                     layout_only: bool = False, prove: bool = False) -> Program:
    """``out = residual + y + bias`` with ``y`` from float32 activations: values decoded in registers,
    summed per group, scaled per group (a group that is not a multiple of 8: :func:`_q4_plain_program`)."""
    N, K = w.shape
    G = w.group
    if G % 8:
        return _q4_plain_program(w, rows, target, residual, bias, layout_only, prove)
    NG, pt = K // G, tile.pt
    tiles = -(-N // pt)
    sd = scale_dtype(w.scale, *([] if w.symmetric else [w.offset]))
    consts = [panels(q4_words(w), pt), panels(w.scale.astype(sd), pt)]
    if not w.symmetric:
        consts.append(panels(w.offset.astype(sd), pt))
    if layout_only:
        return Program(None, [], consts, True, sum(a.nbytes for a in consts))
    W = te.placeholder(consts[0].shape, "int32", name="w")
    WS = te.placeholder(consts[1].shape, sd.name, name="ws")
    WO = None if w.symmetric else te.placeholder(consts[2].shape, sd.name, name="wo")
    X, R, B = _io(rows, K, N, residual, bias)
    wpg = G // 8
    r = te.reduce_axis((0, G), name="r")
    xsum = te.compute((rows, NG), lambda m, g: te.sum(X[m, g * G + r], axis=r), name="xsum")
    t = te.reduce_axis((0, wpg), name="t")
    j = te.reduce_axis((0, 8), name="j")

    def value(word: Any) -> Any:  # value j of a word: k = 8u + j (bytes' low nibbles, then high ones)
        v = word & 15
        for i in range(1, 8):
            sh = 8 * i if i < 4 else 8 * (i - 4) + 4
            v = te.if_then_else(j == i, (word // (1 << sh)) & 15, v)
        return te.cast(v, "float32")

    fsum = te.compute((rows, tiles * pt, NG), lambda m, n, g: te.sum(
        X[m, (g * wpg + t) * 8 + j] * value(W[n // pt, g * wpg + t, n % pt]), axis=[t, j]), name="fsum")
    g = te.reduce_axis((0, NG), name="g")

    def y_body(m: Any, n: Any) -> Any:
        s_ = _f32(WS[n // pt, g, n % pt])
        if WO is None:
            return te.sum(s_ * (fsum[m, n, g] - xsum[m, g] * 8.0), axis=g)
        return te.sum(s_ * fsum[m, n, g] + _f32(WO[n // pt, g, n % pt]) * xsum[m, g], axis=g)

    y = te.compute((rows, tiles * pt), y_body, name="y")
    out = _out_stage(y, rows, N, R, B)
    s = te.create_schedule(out)
    schedule_tile(s, out, y, fsum, tile, [t, j], max_t=2, prove=prove)
    return _program(s, [W, WS] + ([WO] if WO is not None else []), consts, X, out, R, B,
                    sum(a.nbytes for a in consts))


def _q4_plain_program(w: Q4, rows: int, target: Any, residual: bool, bias: bool,
                      layout_only: bool = False, prove: bool = False) -> Program:
    """Q4 with a group that is not a multiple of 8, float32 activations: the product with the weights
    dequantized per element, one value per byte (correct, auto-scheduled; not tuned)."""
    from cuvil.schedule.auto import auto_schedule

    N, K = w.shape
    G = w.group
    Q = np.ascontiguousarray(w.values())
    consts = [Q, w.scale, w.offset]
    if layout_only:
        return Program(None, [], consts, True, sum(a.nbytes for a in consts))
    W = te.placeholder(Q.shape, "uint8", name="w")
    WS = te.placeholder(w.scale.shape, "float32", name="ws")
    WO = te.placeholder(w.offset.shape, "float32", name="wo")
    X, R, B = _io(rows, K, N, residual, bias)
    k = te.reduce_axis((0, K), name="k")
    y = te.compute((rows, N), lambda m, n: te.sum(X[m, k] * (te.cast(W[n, k], "float32") * WS[n, k // G]
                                                              + WO[n, k // G]), axis=k), name="y")
    out = _out_stage(y, rows, N, R, B)
    args = [W, WS, WO, X] + [t for t in (R, B) if t is not None] + [out]
    s = auto_schedule(args, target, prove=True if prove else None)
    return _program(s, [W, WS, WO], consts, X, out, R, B, sum(a.nbytes for a in consts))


def dense_program(w: Dense, rows: int, tile: Tile, target: Any, residual: bool, bias: bool,
                  layout_only: bool = False, prove: bool = False) -> Program:
    """``out = residual + x @ W^T + bias`` in float32, the weight in panels ``[N / PT, K, PT]``."""
    N, K = w.shape
    pt = tile.pt
    tiles = -(-N // pt)
    consts = [panels(w.w, pt)]
    if layout_only:
        return Program(None, [], consts, True, consts[0].nbytes)
    W = te.placeholder(consts[0].shape, "float32", name="w")
    X, R, B = _io(rows, K, N, residual, bias)
    k = te.reduce_axis((0, K), name="k")
    y = te.compute((rows, tiles * pt), lambda m, n: te.sum(X[m, k] * W[n // pt, k, n % pt], axis=k), name="y")
    out = _out_stage(y, rows, N, R, B)
    s = te.create_schedule(out)
    schedule_tile(s, out, y, None, tile, [], unroll_k=DENSE_UNROLL, prove=prove)
    return _program(s, [W], consts, X, out, R, B, consts[0].nbytes)


def quantizer(rows: int, K: int, G: int, target: Any) -> tuple[Any, list[te.Tensor]]:
    """The schedule and arguments of the kernel ``x -> (q, xs, xsum)`` of
    :func:`cuvil.llm.qlinear.quantize_rows` (``q`` int8 [rows, K], which the contraction reads as int32
    words of four).  The groups' maxima and sums are taken in two steps, a
    vector of ``L`` partial results per group (contiguous loads) and then its ``L`` lanes, so that no loop
    reads with a stride of a group."""
    NG = K // G
    lanes = target.panel_lanes(4)
    L = next(v for v in (lanes, 8, 4, 2, 1) if G % v == 0)
    C = G // L
    X = te.placeholder((rows, K), "float32", name="x")
    c = te.reduce_axis((0, C), name="c")
    pm = te.compute((rows, NG, L), lambda m, g, j: te.max(te.abs(X[m, g * G + c * L + j]), axis=c), name="pmax")
    j = te.reduce_axis((0, L), name="j")
    amax = te.compute((rows, NG), lambda m, g: te.max(pm[m, g, j], axis=j), name="amax")
    xs = te.compute((rows, NG), lambda m, g: amax[m, g] * (1.0 / 127.0), name="xs")
    inv = te.compute((rows, NG), lambda m, g: te.if_then_else(amax[m, g] > 0.0, 127.0 / amax[m, g], 0.0),
                     name="inv")
    q = te.compute((rows, K), lambda m, k: te.cast(te.round(X[m, k] * inv[m, k // G]), "int32"), name="q")
    q8 = te.compute((rows, K), lambda m, k: te.cast(q[m, k], "int8"), name="q8")
    c2 = te.reduce_axis((0, C), name="c2")
    ps = te.compute((rows, NG, L), lambda m, g, i: te.sum(q[m, g * G + c2 * L + i], axis=c2), name="psum")
    j2 = te.reduce_axis((0, L), name="j2")
    xsum = te.compute((rows, NG), lambda m, g: te.sum(ps[m, g, j2], axis=j2), name="xsum")
    args = [X, q8, xs, xsum]
    s = te.create_schedule([q8, xs, xsum])
    for stage in (pm, ps):
        s[stage].reorder(*s[stage].op.axis[:2], *s[stage].op.reduce_axis, s[stage].op.axis[2])
        if L > 1:
            s[stage].vectorize(s[stage].op.axis[2])
    _, k = s[q8].op.axis
    if K % lanes == 0:
        _, kl = s[q8].split(k, lanes)
        s[q8].vectorize(kl)
    s[q].compute_inline()  # (recomputed by q8 and psum: no [rows, K] buffer)
    s[pm].compute_at(s[amax], s[amax].op.axis[0])  # one row's partial results at a time
    s[ps].compute_at(s[xsum], s[xsum].op.axis[0])
    return s, args
