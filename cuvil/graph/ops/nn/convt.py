"""ONNX ConvTranspose (opset 1+; attributes as of opset 11): the gradient of a convolution with
respect to its input, 1-D, 2-D or 3-D, with strides, pads, dilations, groups, output_padding,
output_shape and auto_pad.

Two kernels:

- **kernel == stride** (no padding, no dilation, group 1: the 2x2 stride-2 upsampling of a UNet):
  every input pixel writes its own ``k x k`` block of the output, so the node is a 1x1 convolution
  producing ``M * k * k`` channels per input pixel (a contraction the auto-scheduler packs and
  register-tiles) followed by a depth-to-space index map that also adds the bias::

      P[m, ky, kx, p]      = sum_c W[c, m, ky, kx] * X[c, p]            p = iy * W_in + ix
      Y[m, y, x]           = P[m, y % k, x % k, (y // k) * W_in + x // k] + b[m]

- **any other**: the input upsampled by the strides (zeros between pixels) and padded, then a
  stride-1 convolution with the filters flipped and transposed (``W[c, m, k]`` read as
  ``W'[m, c, K - 1 - k]``)::

      Z[n, c, u]  = X[n, c, (u - a) / s]  if (u - a) >= 0, (u - a) % s == 0, (u - a) / s < S   else 0
      Y[n, m, o]  = sum_(c, k) Z[n, g(m) * Cg + c, o + k * d] * W'[m, c, k]       a = d (K - 1) - pad_begin

  (it multiplies by the inserted zeros, ``prod(strides)`` times the useful work: correct for every
  attribute combination, fast where strides are 1).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cuvil import te
from cuvil.graph.ops.base import NodeCtx, Shaped, op
from cuvil.graph.ops.nn.window import attr_ints, auto_pad, float_input


def _geometry(ctx: NodeCtx, spatial: tuple[int, ...], kernel: list[int]
              ) -> tuple[list[int], list[int], list[int], list[int]]:
    """Strides, dilations, begin pads and output sizes (ONNX's rules: pads, or output_shape and
    auto_pad deciding them)."""
    n = len(spatial)
    strides = attr_ints(ctx, "strides", n, 1)
    dil = attr_ints(ctx, "dilations", n, 1)
    outpad = attr_ints(ctx, "output_padding", n, 0)[:n]
    for name, v in (("strides", strides), ("dilations", dil), ("output_padding", outpad)):
        if len(v) != n or any(x < (0 if name == "output_padding" else 1) for x in v):
            raise ctx.error(f"{name} {v} must have {n} {'non-negative' if name == 'output_padding' else 'positive'} "
                            "values")
    span = [dil[d] * (kernel[d] - 1) + 1 for d in range(n)]
    full = [strides[d] * (spatial[d] - 1) + outpad[d] + span[d] for d in range(n)]
    mode = auto_pad(ctx)
    if mode not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"):
        raise ctx.unsupported(f"auto_pad={mode!r}")
    pads = ctx.attr("pads")
    shape_attr = ctx.attr("output_shape")
    if shape_attr is not None:
        out = [int(x) for x in shape_attr][-n:]
        if len(out) != n:
            raise ctx.error(f"output_shape {list(shape_attr)} has fewer than {n} spatial sizes")
    if pads is not None and mode in ("NOTSET", "VALID"):
        pads = [int(x) for x in pads]
        if len(pads) != 2 * n or any(p < 0 for p in pads):
            raise ctx.error(f"pads {pads} must have {2 * n} non-negative values")
        begin = pads[:n] if mode == "NOTSET" else [0] * n
        if shape_attr is None:
            out = [full[d] - (pads[d] + pads[d + n] if mode == "NOTSET" else 0) for d in range(n)]
        return strides, dil, begin, out
    if mode in ("SAME_UPPER", "SAME_LOWER") or shape_attr is not None:
        if shape_attr is None:
            out = [spatial[d] * strides[d] for d in range(n)]
        total = [full[d] - out[d] for d in range(n)]
        begin = [t // 2 if mode == "SAME_UPPER" else t - t // 2 for t in total]
        return strides, dil, begin, out
    return strides, dil, [0] * n, full


@op("ConvTranspose")
def conv_transpose(ctx: NodeCtx) -> list:
    float_input(ctx)
    xs, ws = ctx.shape(0), ctx.shape(1)
    if len(xs) < 3 or len(ws) != len(xs):
        raise ctx.error(f"input {list(xs)} and weights {list(ws)} must be (N, C, ...) and (C, M/group, ...)")
    g = int(ctx.attr("group", 1))
    if g < 1 or xs[1] != ws[0] or xs[1] % g:
        raise ctx.error(f"{xs[1]} input channels do not fit weights {list(ws)} with group={g}")
    kernel = list(ws[2:])
    ks = ctx.attr("kernel_shape")
    if ks is not None and [int(k) for k in ks] != kernel:
        raise ctx.error(f"kernel_shape {list(ks)} differs from the weights' {kernel}")
    strides, dil, begin, out = _geometry(ctx, xs[2:], kernel)
    if any(o < 1 for o in out):
        raise ctx.error(f"the output would have spatial sizes {out}")
    m = ws[1] * g
    if ctx.has(2) and ctx.shape(2) != (m,):
        raise ctx.error(f"bias of shape {list(ctx.shape(2))}; expected [{m}]")
    if (g == 1 and kernel == strides and all(d == 1 for d in dil) and not any(begin)
            and out == [s * k for s, k in zip(xs[2:], kernel)]):
        return [_blocks(ctx, xs, m, kernel)]
    return [_upsampled_conv(ctx, xs, ws, g, m, kernel, strides, dil, begin, out)]


def _blocks(ctx: NodeCtx, xs: tuple[int, ...], m: int, kernel: list[int]) -> Shaped:
    """kernel == stride: a contraction to ``M * prod(k)`` channels per pixel, then depth-to-space."""
    n, c, sp = xs[0], xs[1], xs[2:]
    nd = len(sp)
    kk = math.prod(kernel)
    pixels = math.prod(sp)
    has_bias = ctx.has(2)
    if ctx.known(1):  # W[c, m, *k] -> [m * prod(k), c]: rows of the contraction with c innermost
        w = np.asarray(ctx.entries[1])
        Wt = ctx.constant(np.ascontiguousarray(w.reshape(c, m * kk).T), keyed=False)

        def wread(f: Any, rc: Any) -> Any:
            return Wt[f, rc]
    else:
        W = ctx.tensor(1, (c, m * kk))

        def wread(f: Any, rc: Any) -> Any:
            return W[rc, f]
    b = ctx.tensor(2) if has_bias else None
    X = ctx.tensor(0, (n, c, pixels))
    rc = te.reduce_axis((0, c), name="rc")
    P = te.compute((n, m * kk, pixels), lambda i, f, q: te.sum(wread(f, rc) * X[i, rc, q], axis=rc), name="convt")
    out = tuple(s * k for s, k in zip(sp, kernel))

    def d2s(i: Any, f: Any, *o: Any) -> Any:
        tap, q = None, None
        for d in range(nd):
            tap = o[d] % kernel[d] if tap is None else tap * kernel[d] + o[d] % kernel[d]
            q = o[d] // kernel[d] if q is None else q * sp[d] + o[d] // kernel[d]
        v = P[i, f * kk + tap, q]
        return v + b[f] if b is not None else v

    return Shaped(te.compute((n, m) + out, d2s, name="convt_blocks"), (n, m) + out)


def _upsampled_conv(ctx: NodeCtx, xs: tuple[int, ...], ws: tuple[int, ...], g: int, m: int, kernel: list[int],
                    strides: list[int], dil: list[int], begin: list[int], out: list[int]) -> Any:
    """The general form: the input with zeros inserted and padded, then a stride-1 convolution."""
    nd = len(kernel)
    cg, mg = xs[1] // g, ws[1]
    sp = xs[2:]
    has_bias = ctx.has(2)
    if ctx.known(1):  # flipped and transposed once, at compile time: Wf[m, c, *k] (a Conv's layout)
        w = np.asarray(ctx.entries[1])
        wf = w.reshape((g, cg, mg) + tuple(kernel)).swapaxes(1, 2).reshape((m, cg) + tuple(kernel))
        Wf = ctx.constant(np.ascontiguousarray(np.flip(wf, axis=tuple(range(2, 2 + nd)))), keyed=False)

        def wread(f: Any, rc: Any, rk: list[Any]) -> Any:
            return Wf[(f, rc) + tuple(rk)]
    else:
        W = ctx.tensor(1)

        def wread(f: Any, rc: Any, rk: list[Any]) -> Any:
            return W[((f // mg) * cg + rc, f % mg) + tuple(kernel[d] - 1 - rk[d] for d in range(nd))]
    X = ctx.tensor(0)
    shift = [dil[d] * (kernel[d] - 1) - begin[d] for d in range(nd)]
    zlen = [out[d] + dil[d] * (kernel[d] - 1) for d in range(nd)]

    def zbody(n: Any, c: Any, *u: Any) -> Any:
        conds, src = [], []
        for d in range(nd):
            v = u[d] - shift[d]
            if shift[d] > 0:
                conds.append(v >= 0)
            if strides[d] > 1:
                conds.append(v % strides[d] == 0)
                v = v // strides[d]
            if (zlen[d] - 1 - shift[d]) // strides[d] >= sp[d]:
                conds.append(v < sp[d])
            src.append(v)
        read = X[(n, c) + tuple(src)]
        return te.if_then_else(te.all(*conds), read, te.const(0, X.dtype)) if conds else read

    Z = te.compute((xs[0], xs[1]) + tuple(zlen), zbody, name="convt_zeros")
    rc = te.reduce_axis((0, cg), name="rc")
    rk = [te.reduce_axis((0, kernel[d]), name=f"rk{d}") for d in range(nd)]

    def body(n: Any, f: Any, *o: Any) -> Any:
        c = rc if g == 1 else (f // mg) * cg + rc
        src = (n, c) + tuple(o[d] + rk[d] * dil[d] for d in range(nd))
        return te.sum(Z[src] * wread(f, rc, rk), axis=[rc] + rk)

    shape = (xs[0], m) + tuple(out)
    y = te.compute(shape, body, name="convt")
    if has_bias:
        b = ctx.tensor(2)
        y = te.compute(shape, lambda n, f, *o: y[(n, f) + o] + b[f], name="convt_bias")
    return y
