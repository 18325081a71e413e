"""Channels-last integer convolutions: ``int_conv_nhwc``, the NHWC form of
:func:`cuvil.graph.ops.quant.kernels.int_conv` that :func:`cuvil.graph.channels_last.channels_last` gives a quantized
model's 2-D convolutions (``CuvilQLinearConvNHWC``, cuvil/graph/ops/quant/conv.py).

With the channels innermost, the filters lie in vector lanes and each output pixel's channels are one
unit-stride store: the requantized bytes of a register tile leave as whole vectors, where an NCHW output
takes one byte store per element of the tile (ResNet-50's 1x1 convolutions, whose reductions are short,
spent much of their time there).  The input is read as the next convolution wants it: four channels of a
pixel are one int32 word of ``X4[n, y, x, C / 4]``, a unit-stride copy of the NHWC bytes (padded with the
input's zero point for windows that reach past the image; a strided 1x1 convolution packs only the pixels
it reads).  The filters are the compile-time panels ``[M / P, C / 4, kh, kw, P]`` of
:mod:`cuvil.graph.ops.quant.kernels`, and the reduction is ``sum(dot4)`` (``vpdpbusd``, ``udot`` / ``sdot`` /
``usdot``); an x86 without VNNI packs two channels per word, widened to 16 bits, and sums ``dot2_i16``
(``vpmaddwd``).  Grouped and depthwise convolutions, and targets with neither, take the
plain int32 contraction, also channels-last (a depthwise one sums its taps per channel, the channels in
lanes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cuvil import te
from cuvil.errors import ShapeError
from cuvil.graph.ops.base import NodeCtx, t_shape
from cuvil.graph.ops.nn.nhwc import chained_sum
from cuvil.graph.ops.quant.kernels import (
    PAIRS,
    _check_int8,
    _conv_words,
    _dot,
    _filter_sums,
    _i32,
    _pack,
    _plan,
    word_plan,
)
from cuvil.te.tensor import Tensor


def int_conv_nhwc(ctx: NodeCtx, x: Tensor, w: np.ndarray, strides: Sequence[int], dilations: Sequence[int],
                  pads_begin: Sequence[int], pads_end: Sequence[int], group: int, name: str = "qconv",
                  pad_value: int = 0, in_nhwc: bool = True) -> Tensor:
    """The exact int32 2-D convolution of ``x`` (NHWC, or NCHW with ``in_nhwc`` False: a network's first
    convolution reads the model's input) with constant ``w`` ``[O, C / group, kh, kw]``, the padding
    reading ``pad_value``; the output is NHWC ``(N, H', W', O)``, int32."""
    xs = t_shape(x)
    _check_int8(f"{ctx.node}: the input of {name}", x.dtype)
    _check_int8(f"{ctx.node}: the weights of {name}", w.dtype.name)
    if len(xs) != 4 or w.ndim != 4:
        raise ShapeError(f"{ctx.node}: {name} (channels-last) takes a 4-D input and 4-D weights; got {list(xs)} "
                         f"and {list(w.shape)}")
    n, h, wd, c = xs if in_nhwc else (xs[0], xs[2], xs[3], xs[1])
    g = int(group)
    if g < 1 or c != w.shape[1] * g or w.shape[0] % g:
        raise ShapeError(f"{ctx.node}: {c} input channels do not fit weights {list(w.shape)} with group={g}")
    kernel = [int(d) for d in w.shape[2:]]
    out = []
    for d, size in enumerate((h, wd)):
        full = size + pads_begin[d] + pads_end[d] - dilations[d] * (kernel[d] - 1) - 1
        if full < 0 or strides[d] < 1 or dilations[d] < 1:
            raise ShapeError(f"{ctx.node}: the window of {name} does not fit the padded input in dimension {d}")
        out.append(full // strides[d] + 1)

    def read(n_: Any, y: Any, x_: Any, ch: Any) -> Any:
        return x[n_, y, x_, ch] if in_nhwc else x[n_, ch, y, x_]

    per, panel = word_plan(ctx.target)
    if per and g == 1:
        return _dot_nhwc(ctx, read, (n, h, wd, c), x.dtype, w, strides, dilations, pads_begin, out, panel, name,
                         int(pad_value), per)
    return _plain(ctx, read, (n, h, wd, c), x.dtype, w, strides, dilations, pads_begin, out, g, name,
                  int(pad_value))


def _padded(read: Any, dims: tuple[int, int, int, int], begin: Sequence[int], span: Sequence[int], pv: Any) -> Any:
    """``read`` of the padded image: ``pv`` where a pixel ``(y, x)`` of the span lies in the padding (tested
    only on the sides the span reaches past)."""
    _, h, wd, _ = dims

    def at(n_: Any, y: Any, x_: Any, ch: Any) -> Any:
        inside = [cond for d, (i, size) in enumerate(((y, h), (x_, wd))) for cond in
                  ([i >= begin[d]] if begin[d] else []) + ([i < size + begin[d]] if span[d] > size + begin[d] else [])]
        v = read(n_, y - begin[0], x_ - begin[1], ch)
        return te.if_then_else(te.all(*inside), v, pv) if inside else v

    return at


def _dot_nhwc(ctx: NodeCtx, read: Any, dims: tuple[int, int, int, int], dtype: str, w: np.ndarray,
              strides: Sequence[int], dil: Sequence[int], begin: Sequence[int], out: list[int], panel: int,
              name: str, pad_value: int, per: int = 4) -> Tensor:
    """One group as ``sum(dot4)`` over ``X4[n, y, x, C / 4]`` and the filter panels, or ``sum(dot2_i16)``
    over ``X2[n, y, x, C / 2]`` (``per`` 2: an x86 without VNNI; see the module's docstring)."""
    n, h, wd, c = dims
    c4 = -(-c // per)
    plan = _plan(dtype, w.dtype.name, ctx.target) if per == 4 else PAIRS
    flip, sign = plan[2:]
    o, kh, kw = w.shape[0], w.shape[2], w.shape[3]

    def chan(s4: Any, t: int) -> Any:
        return s4 * per + t if c % per == 0 else te.min(s4 * per + t, c - 1)

    if kh == kw == 1 and not any(begin) and all((out[d] - 1) * strides[d] < (h, wd)[d] for d in range(2)):
        # a 1x1 window inside the image: pack the pixels it reads (a strided one reads one in stride**2),
        # then stride 1 (padding at the end, which only a 1x1 window reaching past the image reads, takes
        # the padded copy below)
        X4 = te.compute((n, out[0], out[1], c4), lambda n_, y, x_, s4: _pack(
            per, lambda t: read(n_, y * strides[0], x_ * strides[1], chan(s4, t)), s4, c, flip),
            name=f"{name}_x{per}")
        step = (1, 1)
    else:
        span = [(out[d] - 1) * strides[d] + dil[d] * ((kh, kw)[d] - 1) + 1 for d in range(2)]
        at = _padded(read, dims, begin, span, te.const(pad_value, dtype))
        X4 = te.compute((n, span[0], span[1], c4), lambda n_, y, x_, s4: _pack(
            per, lambda t: at(n_, y, x_, chan(s4, t)), s4, c, flip), name=f"{name}_x{per}")
        step = (strides[0], strides[1])
    flat = np.ascontiguousarray(np.moveaxis(w, 0, -1)).reshape(c, -1, o)  # [C, taps, O]
    words = _conv_words(flat, panel, per)
    W4 = ctx.constant(words.reshape((words.shape[0], c4, kh, kw, panel)), keyed=False)
    r4 = te.reduce_axis((0, c4), name=f"rc{per}")
    ry, rx = te.reduce_axis((0, kh), name="ry"), te.reduce_axis((0, kw), name="rx")

    def body(n_: Any, y: Any, x_: Any, m: Any) -> Any:
        wr = W4[m // panel, r4, ry, rx, m % panel]
        xr = X4[n_, y * step[0] + ry * dil[0], x_ * step[1] + rx * dil[1], r4]
        return te.sum(_dot(wr, xr, plan), axis=[r4, ry, rx])

    shape = (n, out[0], out[1], o)
    y = te.compute(shape, body, name=name if not sign else f"{name}_dot")
    if not sign:
        return y
    comp = ctx.constant((sign * 128 * _filter_sums(w)).astype(np.int32), keyed=False)
    return te.compute(shape, lambda n_, yy, xx, m: y[n_, yy, xx, m] + comp[m], name=name)


def _plain(ctx: NodeCtx, read: Any, dims: tuple[int, int, int, int], dtype: str, w: np.ndarray,
           strides: Sequence[int], dil: Sequence[int], begin: Sequence[int], out: list[int], g: int, name: str,
           pad_value: int) -> Tensor:
    """The int32 contraction with the output channels in lanes (any group; without a dot-product
    instruction).  A window past the image reads a padded copy; one input channel per filter (depthwise)
    sums its taps in independent chains instead of a reduction."""
    n, h, wd, c = dims
    o, cg, kh, kw = w.shape
    per_group = o // g
    span = [(out[d] - 1) * strides[d] + dil[d] * ((kh, kw)[d] - 1) + 1 for d in range(2)]
    at = read
    if any(begin) or span[0] > h or span[1] > wd:
        pad = _padded(read, dims, begin, span, te.const(pad_value, dtype))
        P = te.compute((n, span[0], span[1], c), pad, name=f"{name}_pad")

        def at(n_: Any, y: Any, x_: Any, ch: Any) -> Any:
            return P[n_, y, x_, ch]

    W = ctx.constant(np.ascontiguousarray(np.moveaxis(w, 0, -1)), keyed=False)  # [C / g, kh, kw, O]

    def group_channel(m: Any, rc: Any) -> Any:
        return rc if g == 1 else (m // per_group) * cg + rc

    if cg == 1:
        def taps(n_: Any, y: Any, x_: Any, m: Any) -> Any:
            ch = group_channel(m, 0)
            terms = [_i32(at(n_, y * strides[0] + ky * dil[0], x_ * strides[1] + kx * dil[1], ch)) *
                     _i32(W[0, ky, kx, m]) for ky in range(kh) for kx in range(kw)]
            return chained_sum(terms, ctx.heuristics.dw_chains)

        return te.compute((n, out[0], out[1], o), taps, name=name)
    rc = te.reduce_axis((0, cg), name="rc")
    ry, rx = te.reduce_axis((0, kh), name="ry"), te.reduce_axis((0, kw), name="rx")

    def body(n_: Any, y: Any, x_: Any, m: Any) -> Any:
        v = at(n_, y * strides[0] + ry * dil[0], x_ * strides[1] + rx * dil[1], group_channel(m, rc))
        return te.sum(_i32(v) * _i32(W[rc, ry, rx, m]), axis=[rc, ry, rx])

    return te.compute((n, out[0], out[1], o), body, name=name)
