"""Integer contractions for quantized models: ``int_matmul`` and ``int_conv``.

Both compute exact int32 sums of products of 8-bit integers (uint8 or int8, any mix); the callers (the
quantized ONNX operators) apply zero points, bias and requantization around them.

On a CPU with an 8-bit dot-product instruction (x86 VNNI: ``avx512vnni`` / ``avxvnni``; AArch64
``dotprod`` / ``i8mm``: gated on the features, never the CPU's name) the reduction runs four steps at a
time: both operands are packed so that four consecutive reduction steps sit in one int32 (the weights
in panels ``[N / P][K / 4][P]`` of such int32, P two vectors of lanes, packed at compile time; the
activation ``[..., K / 4]``), and the contraction sums :func:`cuvil.ir.expr.dot4` over them, which the
code generator emits as ``vpdpbusd`` (``udot`` / ``sdot`` / ``usdot``).  The auto-scheduler tiles it
like any contraction (a register tile of MR rows x P int32 lanes over the panels).  ``vpdpbusd``
multiplies unsigned by signed bytes, ``udot`` / ``sdot`` same-signed ones; the other mixes are mapped
onto them by flipping the activation's bytes (XOR 0x80, i.e. +-128) and adding ``+-128 * colsum(w)``
back (a compile-time constant for constant weights).

An x86 CPU without VNNI has no exact 8-bit dot product: ``vpmaddubsw`` multiplies unsigned by signed
bytes and clamps each pair's sum to 16 bits, which real weights overflow.  There the bytes are widened
to 16 bits as they are packed, two reduction steps per int32 (the weights ``[N / P][K / 2][P]`` at
compile time, the activation ``[..., K / 2]``), and the contraction sums
:func:`cuvil.ir.expr.dot2_i16`, which is ``vpmaddwd`` (16 x 16 -> 32-bit pair sums, exact for every
signedness mix, no flip) and an add: 16 multiply-adds per two instructions on AVX2, where the plain
int32 contraction takes a widening, a 32-bit multiply and an add for 8.  Elsewhere (AArch64 without
``dotprod``) it is the plain int32 contraction (correct, slower).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from cuvil import te
from cuvil.errors import DTypeError, ShapeError
from cuvil.graph.ops.base import NodeCtx, t_shape
from cuvil.ir.expr import dot2_i16, dot4
from cuvil.te.tensor import Tensor

INT8_TYPES = ("uint8", "int8")


def _check_int8(what: str, dtype: str) -> None:
    if dtype not in INT8_TYPES:
        raise DTypeError(f"{what} is {dtype}; an integer contraction takes uint8 or int8")


def _i32(x: Any) -> Any:
    return te.cast(x, "int32")


def dot_panel(target: Any) -> int:
    """The int32 columns of a weight panel for the dot-product instructions of ``target`` (two vectors of
    int32 lanes), 0 when it has none (the plain int32 contraction then)."""
    from cuvil.codegen.llvm_dot import dot4_kinds, dot4_width

    if target is None or getattr(target, "kind", "") != "llvm":
        return 0
    lanes = target.panel_lanes(4)
    if not any(dot4_width(target, name, lanes) for name in dot4_kinds(target)):
        return 0
    return 2 * lanes


def word_plan(target: Any) -> tuple[int, int]:
    """(reduction steps per int32 word, the weight panel's int32 columns) of ``target``'s integer
    contraction: (4, P) with an 8-bit dot product (``dot4``), (2, P) for 16-bit pairs (``dot2_i16``),
    (0, 0) for the plain int32 contraction."""
    panel = dot_panel(target)
    if panel:
        return 4, panel
    if target is not None and getattr(target, "kind", "") == "llvm" and str(target.triple).startswith("x86_64"):
        return 2, target.panel_width(4)  # vpmaddwd: SSE2 and later, two vectors of int32 lanes
    return 0, 0


PAIRS = ("i16", True, False, 0)  # the plan of a 16-bit pair contraction: no signs, no flip, nothing to add back


def _plan(a_dtype: str, w_dtype: str, target: Any) -> tuple[str, bool, bool, int]:
    """How ``target``'s dot product takes the activation's and the weights' bytes: (dot4's signs, weights
    first, flip the activation's bytes, sign of ``128 * colsum(w)`` to add back). x86's ``vpdpbusd`` is
    unsigned x signed: a mixed pair as it is (u8 weights first), a same-signed one with the activation
    flipped; AArch64's ``udot`` / ``sdot`` take same-signed pairs: a mixed one flips the activation."""
    from cuvil.codegen.llvm_dot import dot4_kinds

    kinds = {name[5] + name[7] for name in dot4_kinds(target)}  # "dot4_u8s8" -> "us"
    a_u, w_u = a_dtype == "uint8", w_dtype == "uint8"
    flip = not (("us" in kinds) if a_u != w_u else ("uu" if a_u else "ss") in kinds)
    if flip:
        a_u = not a_u  # u8 a = (a ^ 0x80 as s8) + 128; s8 a = (a ^ 0x80 as u8) - 128
    sign = (1 if a_dtype == "uint8" else -1) if flip else 0
    if a_u == w_u:
        return ("uu" if a_u else "ss"), True, flip, sign
    return "us", w_u, flip, sign


def _pack4(byte: Any, steps: Any, total: int, flip: bool) -> Any:
    """The int32 whose byte t is ``byte(t)`` (an 8-bit integer expression, XOR 0x80 when ``flip``) for the
    reduction step ``4 * step + t`` (zero past ``total``): four reduction steps in one int32."""
    word: Any = None
    for t in range(4):
        v = _i32(byte(t)) & 255
        if flip:
            v = v ^ 128
        if total % 4 and t >= total % 4:  # the last int32 holds fewer than four steps
            v = te.if_then_else(steps * 4 + t < total, v, te.const(0, "int32"))
        v = v * (1 << (8 * t)) if t < 3 else v * te.const(1 << 24, "int32")
        word = v if word is None else word | v
    return word


def _pack2(value: Any, steps: Any, total: int) -> Any:
    """The int32 whose low and high 16 bits are ``value(0)`` and ``value(1)`` (8-bit integer expressions,
    widened with their sign) for the reduction steps ``2 * step + t`` (zero past ``total``)."""
    lo, hi = _i32(value(0)) & 65535, _i32(value(1))
    if total % 2:  # the last int32 holds one step
        hi = te.if_then_else(steps * 2 + 1 < total, hi, te.const(0, "int32"))
    return lo | hi * te.const(1 << 16, "int32")


def _pack(per: int, value: Any, steps: Any, total: int, flip: bool) -> Any:
    """Four bytes (:func:`_pack4`) or two 16-bit integers (:func:`_pack2`) of reduction steps per int32."""
    return _pack4(value, steps, total, flip) if per == 4 else _pack2(value, steps, total)


def _dot(wr: Any, xr: Any, plan: tuple[str, bool, bool, int]) -> Any:
    """One packed dot product of a weight word and an activation word, as ``plan`` says."""
    signs, w_first = plan[:2]
    if signs == "i16":
        return dot2_i16(wr, xr)
    return dot4(wr, xr, signs) if w_first else dot4(xr, wr, signs)


def _as_words(full: np.ndarray, per: int) -> np.ndarray:
    """``full[..., per]`` of 8-bit (per 4) or 16-bit (per 2) integers as the int32 words they pack into."""
    assert full.shape[-1] == per and full.itemsize * per == 4
    return np.ascontiguousarray(full).view("<i4")[..., 0].astype(np.int32)


def _weight_words(w: np.ndarray, panel: int, per: int = 4) -> np.ndarray:
    """Weights ``w[K, N]`` as int32 panels ``[ceil(N / P), ceil(K / per), P]`` of ``per`` consecutive k
    each (byte, or 16-bit half, t of a word is k = per * kw + t; zeros past K and N), packed at compile
    time."""
    k, n = w.shape
    kw, q = -(-k // per), -(-n // panel)
    full = np.zeros((kw * per, q * panel), np.uint8 if per == 4 else np.int16)
    full[:k, :n] = w.view(np.uint8) if per == 4 else w.astype(np.int16)
    blocks = full.reshape(kw, per, q, panel).transpose(2, 0, 3, 1)  # [q, kw, P, per]
    return _as_words(blocks, per)


def _filter_sums(w: np.ndarray) -> np.ndarray:
    """The sum of each filter of a convolution's ``[O, C, *kernel]`` (the compensation of a flipped
    activation is 128 times it)."""
    return w.astype(np.int64).reshape(w.shape[0], -1).sum(axis=1)


def int_matmul(ctx: NodeCtx, a: Tensor, w: Tensor | np.ndarray, name: str = "qmatmul") -> Tensor:
    """``[..., N] int32 = sum_k int32(a[..., k]) * int32(w[k, n])``, exact for every signedness mix.

    ``w`` is a compile-time constant (numpy) or a te tensor (activation x activation: attention's
    ``Q K^T``).  Batched weights ``w[*B, K, N]`` pair with an activation ``a[*B, ..., K]`` whose leading
    dimensions are those batches: ``out[*B, ..., n] = sum_k a[*B, ..., k] * w[*B, k, n]`` (one contraction
    over every batch, e.g. the heads of an attention)."""
    a_s = t_shape(a)
    _check_int8(f"{ctx.node}: the activation of {name}", a.dtype)
    if isinstance(w, np.ndarray):
        _check_int8(f"{ctx.node}: the weights of {name}", w.dtype.name)
        w_s = tuple(int(d) for d in w.shape)
    else:
        _check_int8(f"{ctx.node}: the weights of {name}", w.dtype)
        w_s = t_shape(w)
    nb = len(w_s) - 2
    if nb < 0 or len(a_s) < nb + 1 or a_s[-1] != w_s[-2] or a_s[:nb] != w_s[:nb]:
        raise ShapeError(f"{ctx.node}: {name} takes a [..., K] activation and [K, N] weights (or [*B, ..., K] "
                         f"and [*B, K, N]); got {list(a_s)} and {list(w_s)}")
    out = a_s[:-1] + (w_s[-1],)
    per, panel = word_plan(ctx.target)
    if per:
        return _dot_matmul(ctx, a, w, panel, name, per)
    W = ctx.constant(np.ascontiguousarray(w), keyed=False) if isinstance(w, np.ndarray) else w
    k = te.reduce_axis((0, w_s[-2]), name="k")
    return te.compute(out, lambda *i: te.sum(_i32(a[i[:-1] + (k,)]) * _i32(W[i[:nb] + (k, i[-1])]), axis=k),
                      name=name)


def _dot_matmul(ctx: NodeCtx, a: Tensor, w: Tensor | np.ndarray, panel: int, name: str, per: int = 4) -> Tensor:
    """``int_matmul`` as ``sum(dot4)`` over int32 words of four k, or ``sum(dot2_i16)`` over words of two
    (``per``; see the module's docstring)."""
    a_s = t_shape(a)
    w_s = tuple(int(d) for d in (w.shape if isinstance(w, np.ndarray) else t_shape(w)))
    nb, (kk, n) = len(w_s) - 2, w_s[-2:]
    w_dtype = w.dtype.name if isinstance(w, np.ndarray) else w.dtype
    plan = _plan(a.dtype, w_dtype, ctx.target) if per == 4 else PAIRS
    flip, sign = plan[2:]
    k4 = -(-kk // per)
    lead = a_s[:-1]
    tag = str(per)
    A4 = te.compute(lead + (k4,), lambda *i: _pack(per, lambda t: a[i[:-1] + (i[-1] * per + t,)] if kk % per == 0
                                                   else a[i[:-1] + (te.min(i[-1] * per + t, kk - 1),)],
                                                   i[-1], kk, flip), name=f"{name}_a{tag}")
    q = -(-n // panel)
    comp = None
    if isinstance(w, np.ndarray):
        flat = np.ascontiguousarray(w).reshape((-1, kk, n))
        words = np.stack([_weight_words(m, panel, per) for m in flat]).reshape(w_s[:nb] + (q, k4, panel))
        W4 = ctx.constant(words, keyed=False)
        if sign:
            comp = ctx.constant((sign * 128 * w.astype(np.int64).sum(axis=-2)).astype(np.int32), keyed=False)
    else:
        def w_body(*i: Any) -> Any:
            b, (p, s, lane) = i[:nb], i[nb:]
            col = p * panel + lane
            col = col if n % panel == 0 else te.min(col, n - 1)
            word = _pack(per, lambda t: w[b + ((s * per + t if kk % per == 0 else te.min(s * per + t, kk - 1)),
                                               col)], s, kk, False)
            return word if n % panel == 0 else te.if_then_else(p * panel + lane < n, word, te.const(0, "int32"))

        W4 = te.compute(w_s[:nb] + (q, k4, panel), w_body, name=f"{name}_w{tag}")
        if sign:
            r = te.reduce_axis((0, kk), name="rk")
            cs = te.compute(w_s[:nb] + (n,), lambda *j: te.sum(_i32(w[j[:-1] + (r, j[-1])]), axis=r),
                            name=f"{name}_colsum")
            comp = te.compute(w_s[:nb] + (n,), lambda *j: cs[j] * (sign * 128), name=f"{name}_comp")
    s4 = te.reduce_axis((0, k4), name=f"k{tag}")

    def body(*i: Any) -> Any:
        wr, ar = W4[i[:nb] + (i[-1] // panel, s4, i[-1] % panel)], A4[i[:-1] + (s4,)]
        return te.sum(_dot(wr, ar, plan), axis=s4)

    out = lead + (n,)
    y = te.compute(out, body, name=name if comp is None else f"{name}_dot")
    if comp is None:
        return y
    return te.compute(out, lambda *i: y[i] + comp[i[:nb] + (i[-1],)], name=name)


def int_conv(ctx: NodeCtx, x: Tensor, w: np.ndarray, strides: Sequence[int], dilations: Sequence[int],
             pads_begin: Sequence[int], pads_end: Sequence[int], group: int, name: str = "qconv",
             pad_value: int = 0) -> Tensor:
    """The exact int32 convolution of ``x`` (NC spatial..., uint8/int8) with constant ``w``
    ``[O, C/group, k...]`` (uint8/int8); the padding reads ``pad_value`` (a quantized conv pads with the
    input's zero point). The output is N O spatial..., int32."""
    xs = t_shape(x)
    _check_int8(f"{ctx.node}: the input of {name}", x.dtype)
    w = np.asarray(w)
    _check_int8(f"{ctx.node}: the weights of {name}", w.dtype.name)
    n_sp = len(xs) - 2
    if n_sp < 1 or w.ndim != len(xs):
        raise ShapeError(f"{ctx.node}: {name} takes an input (N, C, ...) and weights (O, C/group, ...); got "
                         f"{list(xs)} and {list(w.shape)}")
    g = int(group)
    if g < 1 or xs[1] != w.shape[1] * g or w.shape[0] % g:
        raise ShapeError(f"{ctx.node}: {xs[1]} input channels do not fit weights {list(w.shape)} with group={g}")
    lo, hi = np.iinfo(x.dtype).min, np.iinfo(x.dtype).max
    if not lo <= int(pad_value) <= hi:
        raise ShapeError(f"{ctx.node}: the pad value {pad_value} of {name} does not fit {x.dtype}")
    for what, v in (("strides", strides), ("dilations", dilations), ("pads_begin", pads_begin),
                    ("pads_end", pads_end)):
        if len(v) != n_sp:
            raise ShapeError(f"{ctx.node}: {name} has {n_sp} spatial dimensions but {what} {list(v)}")
    kernel = [int(d) for d in w.shape[2:]]
    out = []
    for d in range(n_sp):
        full = xs[2 + d] + pads_begin[d] + pads_end[d] - dilations[d] * (kernel[d] - 1) - 1
        if full < 0 or strides[d] < 1 or dilations[d] < 1:
            raise ShapeError(f"{ctx.node}: the window of {name} does not fit the padded input in dimension {d}")
        out.append(full // strides[d] + 1)
    per, panel = word_plan(ctx.target)
    if per and g == 1:
        return _dot_conv(ctx, x, w, strides, dilations, pads_begin, out, panel, name, int(pad_value), per)
    X = x
    if any(pads_begin) or any(pads_end):
        pshape = xs[:2] + tuple(xs[2 + d] + pads_begin[d] + pads_end[d] for d in range(n_sp))

        def pad_body(*i: Any) -> Any:
            inside = [c for d in range(n_sp) for c in (i[2 + d] >= pads_begin[d], i[2 + d] < xs[2 + d] + pads_begin[d])]
            src = tuple(i[:2]) + tuple(i[2 + d] - pads_begin[d] for d in range(n_sp))
            return te.if_then_else(te.all(*inside), x[src], te.const(int(pad_value), x.dtype))

        X = te.compute(pshape, pad_body, name=f"{name}_pad")
    W = ctx.constant(np.ascontiguousarray(w), keyed=False)
    cg, per_group = w.shape[1], w.shape[0] // g
    rc = te.reduce_axis((0, cg), name="rc")
    rk = [te.reduce_axis((0, kernel[d]), name=f"rk{d}") for d in range(n_sp)]

    def body(n: Any, m: Any, *sp: Any) -> Any:
        c = rc if g == 1 else (m // per_group) * cg + rc
        src = (n, c) + tuple(sp[d] * strides[d] + rk[d] * dilations[d] for d in range(n_sp))
        return te.sum(_i32(X[src]) * _i32(W[(m, rc) + tuple(rk)]), axis=[rc] + rk)

    return te.compute((xs[0], w.shape[0]) + tuple(out), body, name=name)


def _dot_conv(ctx: NodeCtx, x: Tensor, w: np.ndarray, strides: Sequence[int], dilations: Sequence[int],
              pads_begin: Sequence[int], out: Sequence[int], panel: int, name: str, pad_value: int, per: int = 4
              ) -> Tensor:
    """``int_conv`` (one group) as ``sum(dot4)`` (``sum(dot2_i16)`` with ``per`` 2): the input padded and
    packed ``per`` channels per int32 (``X4[n, *rows, C / per, columns]``: the packing reads and writes
    image rows with unit stride; the padding holds ``pad_value``), the filters in panels
    ``[O / P, C / per, *kernel, P]`` (see the module's docstring); the output stays NCHW."""
    xs = t_shape(x)
    n_sp = len(xs) - 2
    c = xs[1]
    c4 = -(-c // per)
    plan = _plan(x.dtype, w.dtype.name, ctx.target) if per == 4 else PAIRS
    flip, sign = plan[2:]
    kernel = list(w.shape[2:])
    if _flat_1x1(xs, kernel, strides, pads_begin, out, c4 * per // 4, panel // 2, ctx.heuristics.flat_words):
        return _dot_conv_flat(ctx, x, w, strides, out, panel, name, plan, per)
    span = [(out[d] - 1) * strides[d] + dilations[d] * (kernel[d] - 1) + 1 for d in range(n_sp)]
    pv = te.const(pad_value, x.dtype)

    def x_body(n: Any, *rest: Any) -> Any:
        sp, s4 = rest[:-2] + rest[-1:], rest[-2]

        def byte(t: int) -> Any:
            ch = s4 * per + t if c % per == 0 else te.min(s4 * per + t, c - 1)
            src = tuple(sp[d] - pads_begin[d] for d in range(n_sp))
            inside = [cond for d in range(n_sp) for cond in
                      ([sp[d] >= pads_begin[d]] if pads_begin[d] else []) +
                      ([sp[d] < xs[2 + d] + pads_begin[d]] if span[d] > xs[2 + d] + pads_begin[d] else [])]
            read = x[(n, ch) + src]
            return te.if_then_else(te.all(*inside), read, pv) if inside else read

        return _pack(per, byte, s4, c, flip)

    X4 = te.compute((xs[0],) + tuple(span[:-1]) + (c4, span[-1]), x_body, name=f"{name}_x{per}")
    o = w.shape[0]
    flat = np.ascontiguousarray(np.moveaxis(w, 0, -1)).reshape(c, -1, o)  # [C, taps, O]
    words = _conv_words(flat, panel, per)
    W4 = ctx.constant(words.reshape((words.shape[0], c4) + tuple(kernel) + (panel,)), keyed=False)
    comp = ctx.constant((sign * 128 * _filter_sums(w)).astype(np.int32), keyed=False) if sign else None
    r4 = te.reduce_axis((0, c4), name=f"rc{per}")
    rk = [te.reduce_axis((0, kernel[d]), name=f"rk{d}") for d in range(n_sp)]

    def body(n: Any, m: Any, *sp: Any) -> Any:
        wr = W4[(m // panel, r4) + tuple(rk) + (m % panel,)]
        at = tuple(sp[d] * strides[d] + rk[d] * dilations[d] for d in range(n_sp))
        xr = X4[(n,) + at[:-1] + (r4, at[-1])]
        return te.sum(_dot(wr, xr, plan), axis=[r4] + rk)

    shape = (xs[0], o) + tuple(out)
    y = te.compute(shape, body, name=name if comp is None else f"{name}_dot")
    if comp is None:
        return y
    return te.compute(shape, lambda n, m, *sp: y[(n, m) + sp] + comp[m], name=name)


def _flat_1x1(xs: tuple[int, ...], kernel: list[int], strides: Sequence[int], pads_begin: Sequence[int],
              out: Sequence[int], c4: int, lanes: int, flat_words: int) -> bool:
    """Whether a convolution is a 1x1 one (stride 1, no padding) over fewer than ``flat_words``
    (:attr:`Heuristics.flat_words`) input words (4 channels each) whose rows take more than one vector of
    ``lanes`` int32 but less than two, and no whole number (a 28-pixel row on AVX-512).  The auto-scheduler
    puts such a row in lanes, and LLVM keeps its 28-lane accumulators in memory (128 -> 512 @ 28x28, 1
    thread: 3.7 ms); as a product over the flattened image (784 pixels, whole vectors) it takes 0.37 ms.  Other
    convolutions measured faster in image rows (256 -> 64 @ 56x56 0.34 ms, flattened 0.80; 512 -> 128
    @ 28x28 0.30 / 0.56, where the scheduler puts the filters in lanes)."""
    return (all(k == 1 for k in kernel) and not any(pads_begin)
            and all(o == -(-x // s) for o, x, s in zip(out, xs[2:], strides))
            and c4 < flat_words and lanes < out[-1] < 2 * lanes and out[-1] % lanes != 0)


def _dot_conv_flat(ctx: NodeCtx, x: Tensor, w: np.ndarray, strides: Sequence[int], out: Sequence[int], panel: int,
                   name: str, plan: tuple[str, bool, bool, int], per: int = 4) -> Tensor:
    """A 1x1 convolution (no padding) as ``sum(dot4)`` over the flattened output image: the input
    packed ``X4[n, C / 4, pixels]`` (a strided one packs only the pixels it reads), the filters in panels
    ``[O / P, C / 4, P]``, the int32 sums ``[n, O, pixels]`` read back as N O spatial... (see
    :func:`_flat_1x1`)."""
    xs = t_shape(x)
    sp = tuple(out)
    c, hw, o = xs[1], math.prod(sp), w.shape[0]
    c4 = -(-c // per)
    flip, sign = plan[2:]

    def pixel(p: Any) -> tuple:
        return tuple((p // math.prod(sp[d + 1:])) % sp[d] for d in range(len(sp)))

    X4 = te.compute((xs[0], c4, hw), lambda n, s4, p: _pack(
        per, lambda t: x[(n, s4 * per + t if c % per == 0 else te.min(s4 * per + t, c - 1)) +
                         tuple(i * st for i, st in zip(pixel(p), strides))], s4, c, flip),
        name=f"{name}_x{per}")
    words = _conv_words(np.ascontiguousarray(w.reshape(o, c).T).reshape(c, 1, o), panel, per)
    W4 = ctx.constant(words.reshape(words.shape[0], c4, panel), keyed=False)
    r4 = te.reduce_axis((0, c4), name=f"rc{per}")

    def body(n: Any, m: Any, p: Any) -> Any:
        wr, xr = W4[m // panel, r4, m % panel], X4[n, r4, p]
        return te.sum(_dot(wr, xr, plan), axis=r4)

    y = te.compute((xs[0], o, hw), body, name=f"{name}_flat")
    comp = ctx.constant((sign * 128 * _filter_sums(w)).astype(np.int32), keyed=False) if sign else None

    def read(n: Any, m: Any, *i: Any) -> Any:
        p = i[0]
        for d in range(1, len(sp)):
            p = p * sp[d] + i[d]
        return y[n, m, p] if comp is None else y[n, m, p] + comp[m]

    return te.compute((xs[0], o) + tuple(sp), read, name=name)


def _conv_words(flat: np.ndarray, panel: int, per: int = 4) -> np.ndarray:
    """Filters ``flat[C, taps, O]`` as int32 panels ``[ceil(O / P), ceil(C / per), taps, P]``, byte (or
    16-bit half) t of a word the input channel ``per * cw + t`` (zeros past C and O), packed at compile
    time."""
    c, taps, o = flat.shape
    cw, q = -(-c // per), -(-o // panel)
    full = np.zeros((cw * per, taps, q * panel), np.uint8 if per == 4 else np.int16)
    full[:c, :, :o] = flat.view(np.uint8) if per == 4 else flat.astype(np.int16)
    blocks = full.reshape(cw, per, taps, q, panel).transpose(3, 0, 2, 4, 1)  # [q, cw, taps, P, per]
    return _as_words(blocks, per)
