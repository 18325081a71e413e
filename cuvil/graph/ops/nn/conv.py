"""ONNX Conv in float: direct, grouped and depthwise convolutions, 1x1 convolutions as a matrix
product over packed filter panels, windows whose taps reach past the image computed region by region,
and Winograd F(2x2, 3x3) (:mod:`cuvil.graph.ops.nn.winograd`) where it pays."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cuvil import te
from cuvil.graph.ops.base import NodeCtx, Shaped, op
from cuvil.graph.ops.nn import bf16
from cuvil.graph.ops.nn.window import float_input, window
from cuvil.graph.ops.nn.winograd import winograd_conv, winograd_pays
from cuvil.te.tensor import Tensor


@op("Conv")
def conv(ctx: NodeCtx) -> list:
    float_input(ctx)
    xs, ws = ctx.shape(0), ctx.shape(1)
    if len(xs) < 3 or len(ws) != len(xs):
        raise ctx.error(f"input {list(xs)} and weights {list(ws)} must be (N, C, ...) and (M, C/group, ...)")
    g = int(ctx.attr("group", 1))
    n_sp = len(xs) - 2
    kernel = list(ws[2:])
    if xs[1] != ws[1] * g or ws[0] % g:
        raise ctx.error(f"{xs[1]} input channels do not fit weights {list(ws)} with group={g}")
    strides, dil, begin, out = window(ctx, xs[2:], kernel)
    if g == 1 and ctx.known(1) and bf16.wants_bf16(ctx, 0, 1):  # precision="bf16" (cuvil/graph/ops/nn/bf16.py)
        return [bf16.conv_node(ctx, strides, dil, begin, out)]
    if g == 1 and all(k == 1 for k in kernel) and tuple(out) == xs[2:] and not any(begin):
        return [_pointwise_conv(ctx, xs, ws)]
    if winograd_pays(ctx, xs, ws, g, kernel, strides, dil, out):
        ctx.variant = "winograd"  # keys the kernel: a compile with winograd=False is another kernel
        return [winograd_conv(ctx, xs, ws, begin, out)]
    if _flat_grouped(ctx, xs, ws, g, strides, out):
        return [_grouped_flat(ctx, xs, ws, g, kernel, strides[0], dil, begin, out)]
    X = ctx.tensor(0)
    has_bias = ctx.has(2)  # before compile-time constants are appended to the entries
    w_read = _filter_panels(ctx, np.asarray(ctx.entries[1])) if g == 1 and ctx.known(1) else None
    if w_read is None:
        W = ctx.tensor(1)

        def w_read(idx: tuple[Any, ...]) -> Any:
            return W[idx]
    padded = [(begin[d], max(0, (out[d] - 1) * strides[d] + dil[d] * (kernel[d] - 1) + 1 - begin[d] - xs[2 + d]))
              for d in range(n_sp)]
    if any(a or b for a, b in padded):
        pshape = xs[:2] + tuple(xs[2 + d] + a + b for d, (a, b) in enumerate(padded))

        def pad_body(*i: Any) -> Any:
            inside = [c for d, (a, b) in enumerate(padded) for c in
                      ([i[2 + d] >= a] if a else []) + ([i[2 + d] < xs[2 + d] + a] if b else [])]
            src = tuple(i[:2]) + tuple(i[2 + d] - padded[d][0] for d in range(n_sp))
            return te.if_then_else(te.all(*inside), X[src], te.const(0, X.dtype))

        X = te.compute(pshape, pad_body, name="conv_pad")
    cg = ws[1]
    per_group = ws[0] // g
    rc = te.reduce_axis((0, cg), name="rc")
    rk = [te.reduce_axis((0, kernel[d]), name=f"rk{d}") for d in range(n_sp)]

    def body(n: Any, m: Any, *sp: Any) -> Any:
        c = rc if g == 1 else (m // per_group) * cg + rc
        src = (n, c) + tuple(sp[d] * strides[d] + rk[d] * dil[d] for d in range(n_sp))
        return te.sum(X[src] * w_read((m, rc) + tuple(rk)), axis=[rc] + rk)

    shape = (xs[0], ws[0]) + tuple(out)
    regions = (_tap_regions(xs[2:], kernel, strides, dil, begin, out, ctx.heuristics.region_rows)
               if g == 1 and n_sp == 2 else None)
    if regions is not None:  # (read from the padded copy: a region may keep a tap that is in part padding)
        y = _region_conv(X, w_read, shape, cg, strides, dil, regions)
    elif g > 1 and per_group > 1:  # grouped: the group is an axis of its own, a batched contraction
        return [_grouped_conv(ctx, X, w_read, shape, g, cg, per_group, kernel, strides, dil, has_bias)]
    elif (cg == 1 and per_group == 1 and math.prod(kernel) <= ctx.heuristics.depthwise_taps
            and not any(a or b for a, b in padded)):  # a small window: written out tap by tap
        y = _depthwise_taps(X, w_read, shape, kernel, strides, dil)
    else:
        y = te.compute(shape, body, name="conv")
    if has_bias:
        b = ctx.tensor(2)
        y = te.compute(shape, lambda n, m, *sp: y[(n, m) + sp] + b[m], name="conv_bias")
    return [y]


# -- windows whose taps reach past the image ------------------------------------------------------

def _axis_intervals(size: int, k: int, stride: int, dil: int, begin: int, out: int, min_len: int
                    ) -> tuple[list[tuple[int, int, int, int]], int]:
    """The outputs ``[o0, o1)`` along one axis cut into intervals, each with the taps ``[k0, k1)`` that read the
    image for some output in it (the taps outside the image for all of them dropped), and the cost of the cut
    in tap-outputs.  Exact intervals (the same taps reach the image for every output in each) are merged with
    neighbours until each is at least ``min_len`` outputs long (or the whole axis): the cut of least cost
    (dynamic programming over the exact intervals)."""
    exact: list[list[int]] = []
    for o in range(out):
        lo = max(0, -(-(begin - o * stride) // dil))
        hi = min(k, (size - 1 + begin - o * stride) // dil + 1)
        lo, hi = (lo, hi) if lo < hi else (min(lo, k - 1), min(lo, k - 1) + 1)  # all padding: one zero tap
        if exact and exact[-1][2:] == [lo, hi]:
            exact[-1][1] = o + 1
        else:
            exact.append([o, o + 1, lo, hi])
    n = len(exact)

    def cost(a: int, b: int) -> int | None:  # exact intervals a..b-1 as one
        length = exact[b - 1][1] - exact[a][0]
        if length < min_len and (a, b) != (0, n):
            return None
        return length * (max(e[3] for e in exact[a:b]) - min(e[2] for e in exact[a:b]))

    best: list[tuple[int, list[int]] | None] = [(0, [])] + [None] * n
    for b in range(1, n + 1):
        for a in range(b):
            c = cost(a, b)
            if c is not None and best[a] is not None and (best[b] is None or best[a][0] + c < best[b][0]):
                best[b] = (best[a][0] + c, best[a][1] + [a])
    total, starts = best[n]  # (the whole axis is always a cut)
    starts = starts + [n]
    cut = [(exact[a][0], exact[b - 1][1], min(e[2] for e in exact[a:b]), max(e[3] for e in exact[a:b]))
           for a, b in zip(starts, starts[1:])]
    return cut, total


def _tap_regions(spatial: tuple[int, ...], kernel: list[int], strides: list[int], dil: list[int],
                 begin: list[int], out: list[int], rows: int) -> list[list[tuple[int, int, int, int]]] | None:
    """Per spatial axis, the intervals of :func:`_axis_intervals` when computing the 2-D window region by
    region skips at least one tap per output pixel on average (the output stage that picks each pixel from
    its region loads and stores it once, and each region starts a loop nest of its own); None otherwise.
    Each interval is at least ``rows`` outputs long (:attr:`Heuristics.region_rows`): along the columns,
    which are the register tile's rows (the filters in the vector lanes), a narrower region leaves its tail
    tile short of accumulators; along the rows, a region of a row or two is a loop nest for a sliver (the
    5x5 windows with padding 2 of GoogLeNet at 28x28 would save 4% of their taps in five regions).

    A 3x3 window at dilation r with padding r on an image of fewer than 2r + 1 pixels has outputs whose
    outer tap rows or columns all read padding: DeepLab's ASPP at rates 12 and 18 on its 33x33 map computes
    57% and 40% of the taps (rate 6: 77%, in stretches of 6 outputs: kept whole).  A 3x3 window with padding
    1 drops a tap row for one output row at each border: kept whole."""
    cuts, split, whole = [], 1, 1
    for d in range(2):
        cut, c = _axis_intervals(spatial[d], kernel[d], strides[d], dil[d], begin[d], out[d], rows)
        cuts.append(cut)
        split *= c
        whole *= out[d] * kernel[d]
    if all(len(c) == 1 for c in cuts) or whole - split < out[0] * out[1]:
        return None
    return cuts


def _region_conv(X: Tensor, w_read: Any, shape: tuple[int, ...], cg: int, strides: list[int], dil: list[int],
                 regions: list[list[tuple[int, int, int, int]]]) -> Tensor:
    """A 2-D convolution (one group, over the zero-padded input ``X``) computed as one contraction per region of
    :func:`_tap_regions`, each over its own taps, and an output stage that picks each pixel from its region."""
    n, m = shape[:2]
    rc = te.reduce_axis((0, cg), name="rc")

    def region(y0: int, y1: int, ky0: int, ky1: int, x0: int, x1: int, kx0: int, kx1: int, name: str) -> Tensor:
        ty = te.reduce_axis((0, ky1 - ky0), name="rk0")
        tx = te.reduce_axis((0, kx1 - kx0), name="rk1")

        def body(n_: Any, f: Any, y: Any, x: Any) -> Any:
            src = X[n_, rc, (y + y0) * strides[0] + (ty + ky0) * dil[0], (x + x0) * strides[1] + (tx + kx0) * dil[1]]
            return te.sum(src * w_read((f, rc, ty + ky0, tx + kx0)), axis=[rc, ty, tx])

        return te.compute((n, m, y1 - y0, x1 - x0), body, name=name)

    parts = [[region(*ys, *xs, name=f"conv_r{a}{b}") for b, xs in enumerate(regions[1])]
             for a, ys in enumerate(regions[0])]

    def pick(n_: Any, f: Any, y: Any, x: Any) -> Any:
        def along_x(ry: int) -> Any:
            y0 = regions[0][ry][0]
            expr = None
            for rx in range(len(regions[1]) - 1, -1, -1):
                x0, x1 = regions[1][rx][:2]
                v = parts[ry][rx][n_, f, y - y0, x - x0]
                expr = v if expr is None else te.if_then_else(x < x1, v, expr)
            return expr

        expr = None
        for ry in range(len(regions[0]) - 1, -1, -1):
            v = along_x(ry)
            expr = v if expr is None else te.if_then_else(y < regions[0][ry][1], v, expr)
        return expr

    return te.compute(shape, pick, name="conv")


def _flat_grouped(ctx: NodeCtx, xs: tuple[int, ...], ws: tuple[int, ...], g: int, strides: list[int],
                  out: list[int]) -> bool:
    """Whether a grouped 2-D convolution runs over its flattened (phase-split) image (:func:`_grouped_flat`):
    several filters per group but fewer than one register tile's two vectors of columns (a group's filters
    cannot fill the lanes: RegNet's group width 8 against 2 x 16 lanes on AVX-512), and output rows narrower
    than that tile (rows of 28, 14 or 7 pixels filled the tile in part: 2-7 GFLOP/s; rows of 56 ran well as
    they are) or strided (a stride-2 window read every other pixel: 4 GFLOP/s on AVX2 and AVX-512 alike); the
    same stride along both axes."""
    tgt = ctx.target
    if len(xs) != 4 or g == 1 or strides[0] != strides[1] or tgt is None or getattr(tgt, "kind", "") != "llvm":
        return False
    tile = tgt.panel_width(np.dtype(ctx.dtype(0)).itemsize)
    return 1 < ws[0] // g < tile and (out[1] < tile or strides[0] > 1)


def _grouped_flat(ctx: NodeCtx, xs: tuple[int, ...], ws: tuple[int, ...], g: int, kernel: list[int],
                  stride: int, dil: list[int], begin: list[int], out: list[int]) -> Shaped:
    """A grouped 2-D convolution as one contraction per group over the image's rows laid end to end.

    The padded input is split into ``stride x stride`` phases (pixel ``(s * i + py, s * j + px)`` goes to phase
    ``(py, px)`` at ``(i, j)``), each phase flattened with row width ``wq``: output pixel ``p = y * wq + x``
    then reads tap ``(ky, kx)`` at ``p + (ky * dy // s) * wq + kx * dx // s`` of phase ``(ky * dy % s, kx * dx %
    s)``, a unit-stride run of pixels whatever the row width, so pixels fill the vector lanes.  The ``wq - ow``
    columns past each row's end are computed and dropped (2 of 30 at 28x28); the output stage reads the others."""
    n, c, h, w = xs
    cg, pg = ws[1], ws[0] // g
    kh, kw = kernel
    oh, ow = out
    st, (dy, dx), (a0, a1) = stride, dil, begin
    b = ctx.tensor(2) if ctx.has(2) else None  # (before the constant table joins the entries)
    wq = max(ow + (kw - 1) * dx // st, -(-(a1 + w) // st))  # phase row width: the taps' reach and every column
    size = (oh + (kh - 1) * dy // st) * wq + (kw - 1) * dx // st  # the last row's dropped columns read past it
    # where each phase pixel comes from in the flattened input image, -1 for padding: a table built now (a
    # gather per pixel at run time; the row and column arithmetic and bounds tests cost ~5 cycles a pixel)
    qi = np.arange(size)
    yy = (qi // wq)[None, None, :] * st + np.arange(st)[:, None, None] - a0
    xx = (qi % wq)[None, None, :] * st + np.arange(st)[None, :, None] - a1
    src = np.where((yy >= 0) & (yy < h) & (xx >= 0) & (xx < w), yy * w + xx, -1).astype(np.int32)
    T = ctx.constant(src, keyed=False)
    X = ctx.tensor(0, (n, c, h * w))

    def phase_body(n_: Any, ch: Any, py: Any, px: Any, q: Any) -> Any:
        i = T[py, px, q]
        return te.if_then_else(i >= 0, X[n_, ch, te.max(i, 0)], te.const(0, X.dtype))

    Xp = te.compute((n, c, st, st, size), phase_body, name="conv_phases")
    W = ctx.tensor(1)
    rc = te.reduce_axis((0, cg), name="rc")
    ry = te.reduce_axis((0, kh), name="rk0")
    rx = te.reduce_axis((0, kw), name="rk1")

    def tap(n_: Any, grp: Any, p: Any) -> Any:
        return Xp[n_, grp * cg + rc, (ry * dy) % st, (rx * dx) % st, p + (ry * dy // st) * wq + rx * dx // st]

    rows = te.compute((n, g, pg, oh * wq), lambda n_, grp, m, p: te.sum(
        tap(n_, grp, p) * W[grp * pg + m, rc, ry, rx], axis=[rc, ry, rx]), name="conv_groups")

    def pick(n_: Any, grp: Any, m: Any, y: Any, x: Any) -> Any:
        v = rows[n_, grp, m, y * wq + x]
        return v + b[grp * pg + m] if b is not None else v

    return Shaped(te.compute((n, g, pg, oh, ow), pick, name="conv_rows"), (n, ws[0], oh, ow))


def _grouped_conv(ctx: NodeCtx, X: Tensor, w_read: Any, shape: tuple[int, ...], g: int, cg: int, per_group: int,
                  kernel: list[int], strides: list[int], dil: list[int], has_bias: bool) -> Shaped:
    """A grouped convolution computed as ``Y[n, group, m, *sp]`` (the same element order as the graph's
    ``[n, group * per_group + m, *sp]``): filters of a group x pixels is a contraction the auto-scheduler
    tiles, with the group as a batch axis (as one reduction over ``(m // per_group) * cg + rc`` it got no
    register tile: AlexNet's conv2 ran at 2 GFLOP/s)."""
    n_sp = len(kernel)
    rc = te.reduce_axis((0, cg), name="rc")
    rk = [te.reduce_axis((0, kernel[d]), name=f"rk{d}") for d in range(n_sp)]
    tgt = ctx.target
    w = np.asarray(ctx.entries[1]) if ctx.known(1) else None
    p = tgt.panel_width(w.dtype.itemsize) if w is not None and tgt is not None and getattr(
        tgt, "kind", "") == "llvm" and w.dtype.kind == "f" else 0
    if p and per_group >= p:  # constant filters in panels per group: [group, m // P, c, *k, m % P]
        q = -(-per_group // p)
        full = np.zeros((g, q * p) + w.shape[1:], w.dtype)
        full[:, :per_group] = w.reshape((g, per_group) + w.shape[1:])
        Wg = ctx.constant(np.ascontiguousarray(np.moveaxis(full.reshape((g, q, p) + w.shape[1:]), 2, -1)),
                          keyed=False)

        def filt(grp: Any, m: Any) -> Any:
            return Wg[(grp, m // p, rc) + tuple(rk) + (m % p,)]
    else:
        def filt(grp: Any, m: Any) -> Any:
            return w_read((grp * per_group + m, rc) + tuple(rk))

    def body(n: Any, grp: Any, m: Any, *sp: Any) -> Any:
        src = (n, grp * cg + rc) + tuple(sp[d] * strides[d] + rk[d] * dil[d] for d in range(n_sp))
        return te.sum(X[src] * filt(grp, m), axis=[rc] + rk)

    shape5 = (shape[0], g, per_group) + tuple(shape[2:])
    y = te.compute(shape5, body, name="conv_groups")
    if has_bias:
        b = ctx.tensor(2)
        y = te.compute(shape5, lambda n, grp, m, *sp: y[(n, grp, m) + sp] + b[grp * per_group + m], name="conv_bias")
    return Shaped(y, shape)


def _depthwise_taps(X: Tensor, w_read: Any, shape: tuple[int, ...], kernel: list[int], strides: list[int],
                    dil: list[int]) -> Tensor:
    """A depthwise convolution without padding (one input channel per output channel) as an
    element-wise stage that sums its window's taps:
    ``Y[n, m, y, x] = sum_(ky, kx) X[n, m, y*s + ky, x*s + kx] * W[m, 0, ky, kx]``.  With no reduction
    axis it is vectorised along ``x`` and takes bias and activation into the same loop (as a
    reduction over the window it got a scalar loop nest and a buffer of its own).  Padded ones keep the
    reduction (a bounds test per tap is evaluated lane by lane); in models with depthwise
    convolutions :func:`cuvil.graph.channels_last.channels_last` makes them NHWC kernels instead."""
    import itertools

    n_sp = len(kernel)

    def body(n: Any, m: Any, *sp: Any) -> Any:
        acc = None
        for taps in itertools.product(*(range(k) for k in kernel)):
            src = (n, m) + tuple(sp[d] * strides[d] + taps[d] * dil[d] for d in range(n_sp))
            term = X[src] * w_read((m, 0) + taps)
            acc = term if acc is None else acc + term
        return acc

    return te.compute(shape, body, name="conv_dw")


def _filter_panels(ctx: NodeCtx, w: np.ndarray) -> Any:
    """Constant conv weights ``W[m, c, *k]`` packed at compile time into filter panels
    ``[m // P, c, *k, m % P]`` (P = two vectors of the target), as a read function of ``(m, c, *k)``:
    the auto-scheduler may then put filters in vector lanes (small images) without a per-call copy."""
    tgt = ctx.target
    if tgt is None or getattr(tgt, "kind", "") != "llvm" or w.dtype.kind != "f":
        return None
    p = tgt.panel_width(w.dtype.itemsize)
    m = w.shape[0]
    if m < p:
        return None
    q = -(-m // p)
    full = np.zeros((q * p,) + w.shape[1:], w.dtype)
    full[:m] = w
    panels = full.reshape((q, p) + w.shape[1:])
    Wp = ctx.constant(np.ascontiguousarray(np.moveaxis(panels, 1, -1)), keyed=False)
    return lambda idx: Wp[(idx[0] // p,) + tuple(idx[1:]) + (idx[0] % p,)]


def _pointwise_conv(ctx: NodeCtx, xs: tuple[int, ...], ws: tuple[int, ...]) -> Shaped:
    """A 1x1 convolution with stride 1 and no padding is a matmul over the flattened pixels:
    ``Y[n, m, p] = sum_c W[m, c] * X[n, c, p]`` (2-D for one image)."""
    n, c, m, p = xs[0], xs[1], ws[0], math.prod(xs[2:])
    has_bias = ctx.has(2)  # before compile-time constants are appended to the entries
    # constant filters on small images (7x7, 14x14: fewer pixels than a few register tiles) are packed
    # in panels, so the register tile may put filters in vector lanes (MobileNetV2's 960->320 at 7x7:
    # 2.9x faster than pixels in lanes); on big images pixels stay in lanes (unit-stride output stores)
    panels = (_filter_panels(ctx, np.asarray(ctx.entries[1]).reshape(m, c))
              if ctx.known(1) and n * p < ctx.heuristics.small_image_pixels else None)
    if panels is None:
        W = ctx.tensor(1, (m, c))

        def panels(idx: tuple[Any, ...]) -> Any:
            return W[idx]
    b = ctx.tensor(2) if has_bias else None
    rc = te.reduce_axis((0, c), name="rc")
    if n == 1:
        X = ctx.tensor(0, (c, p))
        y = te.compute((m, p), lambda f, q: te.sum(panels((f, rc)) * X[rc, q], axis=rc), name="conv1x1")
        if b is not None:
            y = te.compute((m, p), lambda f, q: y[f, q] + b[f], name="conv_bias")
    else:
        X = ctx.tensor(0, (n, c, p))
        y = te.compute((n, m, p), lambda i, f, q: te.sum(panels((f, rc)) * X[i, rc, q], axis=rc), name="conv1x1")
        if b is not None:
            y = te.compute((n, m, p), lambda i, f, q: y[i, f, q] + b[f], name="conv_bias")
    return Shaped(y, (n, m) + xs[2:])
