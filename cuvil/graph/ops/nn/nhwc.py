"""Channels-last (NHWC) kernels that :func:`cuvil.graph.channels_last.channels_last` puts in place of 2-D
convolutions in models with depthwise convolutions (MobileNet-style).  They are cuvil's own ops,
not ONNX's (the pass names them, no model does):

- ``CuvilConvNHWC(x, W[, b]; group, strides, pads, dilations, in_layout)``: ``x`` is NHWC, or NCHW
  with ``in_layout="NCHW"`` (a network's first convolution reads the model's input); ``W`` is ONNX's
  ``(M, C / group, kh, kw)`` constant; the output is NHWC ``(N, H', W', M)``.  Only ``group == 1``
  and depthwise (``group == C == M``) convolutions.
- ``CuvilGlobalAveragePoolNHWC(x)``: NHWC in, ``(N, C, 1, 1)`` out (the same bytes as NHWC).

Why: with channels innermost, a depthwise convolution is vectorised over channels with unit-stride
loads whatever its stride, and its padding tests depend only on the pixel (one branch per vector,
not a bound test per lane); a 1x1 convolution is a plain matmul ``(pixels, C) x (C, M)`` with the
weights as the constant vector operand (no per-call packing of the activations), and every output
is stored with unit stride.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from cuvil import te
from cuvil.graph.ops.base import NodeCtx, Shaped, op
from cuvil.graph.ops.nn.window import float_input, window


def _weights(ctx: NodeCtx, w: np.ndarray) -> Any:
    """Constant ``W[m, c, ky, kx]`` as a read function of ``(m, c, ky, kx)`` with ``m`` in unit stride:
    panels ``[m // P, c, ky, kx, m % P]`` of two target vectors, or ``[c, ky, kx, m]`` when ``m < P``."""
    tgt = ctx.target
    p = tgt.panel_width(w.dtype.itemsize) if tgt is not None else 2 * max(4, 32 // w.dtype.itemsize)  # no target: AVX2
    m = w.shape[0]
    if m < p:
        wt = ctx.constant(np.ascontiguousarray(np.moveaxis(w, 0, -1)), keyed=False)
        return lambda idx: wt[tuple(idx[1:]) + (idx[0],)]
    q = -(-m // p)
    full = np.zeros((q * p,) + w.shape[1:], w.dtype)
    full[:m] = w
    wp = ctx.constant(np.ascontiguousarray(np.moveaxis(full.reshape((q, p) + w.shape[1:]), 1, -1)), keyed=False)
    return lambda idx: wp[(idx[0] // p,) + tuple(idx[1:]) + (idx[0] % p,)]


def chained_sum(terms: list[Any], chains: int, init: Any = None) -> Any:
    """``init + sum(terms)`` as ``chains`` interleaved chains added at the end (:attr:`Heuristics.dw_chains`):
    one chain of 25 taps is 25 dependent multiply-adds (4 cycles each here), 4 chains overlap (5x5
    depthwise 240@28 with SiLU at 1 thread: 308 -> 187 us)."""
    sums: list[Any] = []
    for k, t in enumerate(terms):
        if k < chains:
            sums.append(t if k or init is None else init + t)
        else:
            sums[k % chains] = sums[k % chains] + t
    while len(sums) > 1:  # pairwise: (c0 + c1) + (c2 + c3)
        sums = [sums[i] + sums[i + 1] if i + 1 < len(sums) else sums[i] for i in range(0, len(sums), 2)]
    return sums[0]


@op("CuvilConvNHWC")
def conv_nhwc(ctx: NodeCtx) -> list:
    float_input(ctx)
    nchw_in = ctx.attr("in_layout", "NHWC") == "NCHW"
    xs = ctx.shape(0)
    if len(xs) != 4 or not ctx.known(1) or len(ctx.shape(1)) != 4:
        raise ctx.error(f"input {list(xs)} and weights {list(ctx.shape(1))}: a 2-D convolution with constant "
                        "weights")
    n, c, h, w_ = (xs[0], xs[1], xs[2], xs[3]) if nchw_in else (xs[0], xs[3], xs[1], xs[2])
    w = np.asarray(ctx.entries[1])
    m, cg, kh, kw = w.shape
    g = int(ctx.attr("group", 1))
    depthwise = g == c == m and cg == 1
    if not depthwise and (g != 1 or cg != c):
        raise ctx.unsupported(f"group={g} with {c} input channels and weights {list(w.shape)}")
    has_bias = ctx.has(2)
    strides, dil, begin, out = window(ctx, (h, w_), [kh, kw])
    oh, ow = out
    b = ctx.tensor(2) if has_bias else None
    if not depthwise and kh == kw == 1 and strides == [1, 1] and not any(begin) and (oh, ow) == (h, w_) and not nchw_in:
        X = ctx.tensor(0, (n * h * w_, c))
        wr = _weights(ctx, w)
        rc = te.reduce_axis((0, c), name="rc")
        y = te.compute((n * h * w_, m), lambda q, f: te.sum(X[q, rc] * wr((f, rc, 0, 0)), axis=rc), name="conv1x1")
        if b is not None:
            y = te.compute((n * h * w_, m), lambda q, f: y[q, f] + b[f], name="conv_bias")
        return [Shaped(y, (n, oh, ow, m))]
    X = ctx.tensor(0)
    end = [max(0, (o - 1) * st + d * (k - 1) + 1 - bg - size)
           for o, st, d, k, bg, size in zip(out, strides, dil, (kh, kw), begin, (h, w_))]
    # a depthwise convolution reading NCHW (SegFormer's Mix-FFN: a token grid seen as an image) reads it
    # through an NHWC copy: its taps put channels in the vector lanes, which in NCHW lie H * W elements
    # apart (one gather per tap and vector: 128 channels at 128x128, 3x3, 0.7 GMAC/s); the copy is one
    # blocked transpose per call, each element then read kh * kw times by unit-stride vector loads
    to_nhwc = depthwise and nchw_in
    if any(begin) or any(end) or to_nhwc:
        # a padded copy, computed once per call: a dense convolution's reduction reads each element kh * kw
        # times, and so do a depthwise convolution's taps (the scheduler keeps it: plain loads, no test per tap)
        src = X
        ph, pw = h + begin[0] + end[0], w_ + begin[1] + end[1]

        def pad_body(n_: Any, a: Any, bb: Any, cc: Any) -> Any:
            y, x, ch = (bb, cc, a) if nchw_in and not to_nhwc else (a, bb, cc)
            v = src[n_, ch, y - begin[0], x - begin[1]] if nchw_in else src[n_, y - begin[0], x - begin[1], ch]
            # (all four tests even where a side has no padding: a transposing copy without any keeps its select,
            # which keeps it a stage of its own that the taps read, not a gather inlined into each tap)
            inside = te.all(y >= begin[0], y < h + begin[0], x >= begin[1], x < w_ + begin[1])
            return te.if_then_else(inside, v, te.const(0, src.dtype))

        X = te.compute((n, c, ph, pw) if nchw_in and not to_nhwc else (n, ph, pw, c), pad_body,
                       name="dw_pad" if depthwise else "conv_pad")
    if depthwise:
        wt = ctx.constant(np.ascontiguousarray(w[:, 0].transpose(1, 2, 0)), keyed=False)  # (kh, kw, C)
        Xp = X

        def at(n_: Any, y: Any, x: Any, c_: Any, ky: int, kx: int) -> Any:
            return Xp[n_, y * strides[0] + ky * dil[0], x * strides[1] + kx * dil[1], c_]

        def dw_body(n_: Any, y: Any, x: Any, c_: Any) -> Any:
            taps = [at(n_, y, x, c_, ky, kx) * wt[ky, kx, c_] for ky, kx in itertools.product(range(kh), range(kw))]
            return chained_sum(taps, ctx.heuristics.dw_chains, None if b is None else b[c_])

        return [te.compute((n, oh, ow, m), dw_body, name="conv_dw")]
    wr = _weights(ctx, w)
    rc = te.reduce_axis((0, c), name="rc")
    ry = te.reduce_axis((0, kh), name="ry")
    rx = te.reduce_axis((0, kw), name="rx")

    def body(n_: Any, y: Any, x: Any, f: Any) -> Any:
        py, px = y * strides[0] + ry * dil[0], x * strides[1] + rx * dil[1]  # (in the padded copy)
        v = X[n_, rc, py, px] if nchw_in else X[n_, py, px, rc]
        return te.sum(v * wr((f, rc, ry, rx)), axis=[rc, ry, rx])

    y = te.compute((n, oh, ow, m), body, name="conv")
    if b is not None:
        y = te.compute((n, oh, ow, m), lambda n_, yy, xx, f: y[n_, yy, xx, f] + b[f], name="conv_bias")
    return [y]


@op("CuvilGlobalAveragePoolNHWC")
def global_average_pool_nhwc(ctx: NodeCtx) -> list:
    float_input(ctx)
    n, h, w, c = ctx.shape(0)
    r = te.reduce_axis((0, h * w), name="r")
    if n == 1:
        # a contraction with a row of ones (exact: 1 * x is x), so the auto-scheduler keeps the channels
        # in vector lanes with the pixels outside; as a plain reduction over the pixels it read the
        # channels-last input one strided element at a time (EfficientNet's 112x112x32 mean: 0.38 ms)
        X2 = ctx.tensor(0, (h * w, c))
        ones = ctx.constant(np.ones((1, h * w), dtype=np.dtype(ctx.dtype(0))), keyed=False)
        s = te.compute((n, c), lambda i, ch: te.sum(ones[i, r] * X2[r, ch], axis=r), name="gap_sum")
    else:
        X = ctx.tensor(0, (n, h * w, c))
        s = te.compute((n, c), lambda i, ch: te.sum(X[i, r, ch], axis=r), name="gap_sum")
    y = te.compute((n, c), lambda i, ch: s[i, ch] * (1.0 / (h * w)), name="gap")
    return [Shaped(y, (n, c, 1, 1))]

