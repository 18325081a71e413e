"""ONNX neural-network operators: Conv, Gemm, MatMul, pooling, BatchNormalization, LRN, Softmax,
LogSoftmax and LayerNormalization."""

from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np

from cuvil import dtype as dt
from cuvil import te
from cuvil.cache import BoundedCache
from cuvil.errors import DTypeError
from cuvil.graph.ops import bf16
from cuvil.graph.ops.base import NodeCtx, Shaped, bcast_read, broadcast_shapes, norm_axis, op
from cuvil.ir.expr import min_value
from cuvil.te.tensor import Tensor


def _ints(ctx: NodeCtx, name: str, n: int, default: int) -> list[int]:
    v = ctx.attr(name)
    return [int(x) for x in v] if v is not None else [default] * n


def _auto_pad(ctx: NodeCtx) -> str:
    a = ctx.attr("auto_pad", "NOTSET")
    return a.decode() if isinstance(a, bytes) else a


def _window(ctx: NodeCtx, spatial: tuple[int, ...], kernel: list[int], ceil_mode: bool = False
            ) -> tuple[list[int], list[int], list[int], list[int]]:
    """Strides, dilations, begin pads and output sizes of a sliding window over ``spatial``."""
    n = len(spatial)
    strides = _ints(ctx, "strides", n, 1)
    dil = _ints(ctx, "dilations", n, 1)
    pads = _ints(ctx, "pads", 2 * n, 0)
    mode = _auto_pad(ctx)
    begin, out = [], []
    for d in range(n):
        span = dil[d] * (kernel[d] - 1) + 1
        if mode in ("SAME_UPPER", "SAME_LOWER"):
            sp = -(-spatial[d] // strides[d])
            total = max((sp - 1) * strides[d] + span - spatial[d], 0)
            pb = total // 2 if mode == "SAME_UPPER" else total - total // 2
            begin.append(pb)
            out.append(sp)
            continue
        pb, pe = (0, 0) if mode == "VALID" else (pads[d], pads[d + n])
        full = spatial[d] + pb + pe - span
        if full < 0:
            raise ctx.error(f"the window ({span}) is larger than the padded input ({spatial[d] + pb + pe})")
        sp = (-(-full // strides[d]) if ceil_mode else full // strides[d]) + 1
        if ceil_mode and (sp - 1) * strides[d] >= spatial[d] + pb:
            sp -= 1
        begin.append(pb)
        out.append(sp)
    return strides, dil, begin, out


def _float_input(ctx: NodeCtx) -> None:
    if not dt.is_float(ctx.dtype(0)):
        raise DTypeError(f"{ctx.node}: input 0 is {ctx.dtype(0)}; this operator needs a float tensor")


@op("Conv")
def conv(ctx: NodeCtx) -> list:
    _float_input(ctx)
    xs, ws = ctx.shape(0), ctx.shape(1)
    if len(xs) < 3 or len(ws) != len(xs):
        raise ctx.error(f"input {list(xs)} and weights {list(ws)} must be (N, C, ...) and (M, C/group, ...)")
    g = int(ctx.attr("group", 1))
    n_sp = len(xs) - 2
    kernel = list(ws[2:])
    if xs[1] != ws[1] * g or ws[0] % g:
        raise ctx.error(f"{xs[1]} input channels do not fit weights {list(ws)} with group={g}")
    strides, dil, begin, out = _window(ctx, xs[2:], kernel)
    if g == 1 and ctx.known(1) and bf16.wants_bf16(ctx, 0, 1):  # precision="bf16" (cuvil/graph/ops/bf16.py)
        return [bf16.conv_node(ctx, strides, dil, begin, out)]
    if g == 1 and all(k == 1 for k in kernel) and tuple(out) == xs[2:] and not any(begin):
        return [_pointwise_conv(ctx, xs, ws)]
    if _winograd_pays(ctx, xs, ws, g, kernel, strides, dil, out):
        ctx.variant = "winograd"  # keys the kernel: a compile with winograd=False is another kernel
        return [_winograd_conv(ctx, xs, ws, begin, out)]
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


# -- Winograd F(2x2, 3x3) -------------------------------------------------------------------

# F(2, 3) (Lavin and Gray, Fast Algorithms for Convolutional Neural Networks, 2016): Y = A^T [(G g G^T) . (B^T d B)] A
_BT = ((1, 0, -1, 0), (0, 1, 1, 0), (0, -1, 1, 0), (0, 1, 0, -1))
_G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])
_AT = ((1, 1, 1, 0), (0, 1, -1, -1))


def _winograd_pays(ctx: NodeCtx, xs: tuple[int, ...], ws: tuple[int, ...], g: int, kernel: list[int],
                   strides: list[int], dil: list[int], out: list[int]) -> bool:
    """A 2-D 3x3 float32 convolution of one image, stride 1, dilation 1, one group, constant weights, an even output
    and enough channels on both sides, for a CPU target, unless the compilation turns Winograd off
    (``CompileOptions.winograd``).  The thresholds are the compilation's (``ctx.heuristics``): at least
    ``winograd_min_channels`` channels in and out, ``winograd_min_tiles`` to ``winograd_max_tiles`` 2x2 output
    tiles (why those: :meth:`cuvil.schedule.heuristics.Heuristics.for_target`)."""
    tgt = ctx.target
    h = ctx.heuristics
    on = ctx.options.winograd if ctx.options is not None else True
    # one image only: with a batch of two, isl fails checking the schedule (isl_pw_aff_max_val: not yet understood)
    return (on and len(xs) == 4 and xs[0] == 1 and g == 1 and kernel == [3, 3] and strides == [1, 1]
            and dil == [1, 1] and ctx.dtype(0) == "float32" and ctx.known(1) and tgt is not None
            and getattr(tgt, "kind", "") == "llvm"
            and min(xs[1], ws[0]) >= h.winograd_min_channels and out[0] % 2 == 0 and out[1] % 2 == 0
            and out[0] >= 4 and out[1] >= 4
            and h.winograd_min_tiles <= (out[0] // 2) * (out[1] // 2) <= h.winograd_max_tiles)


def _signed_sum(terms: list[tuple[int, Any]]) -> Any:
    """``sum(c * x)`` over ``(c, x)`` with c in {1, -1} (c = 0 terms dropped), as adds and subtracts."""
    acc = None
    for c, x in terms:
        if c == 0:
            continue
        acc = (x if c > 0 else -x) if acc is None else (acc + x if c > 0 else acc - x)
    return acc


def _choose(axis: Any, values: list[Any]) -> Any:
    """``values[axis]`` for an axis of ``len(values)`` iterations, as a chain of selects (the scheduler
    unrolls such an axis, each copy keeping one formula: :func:`cuvil.schedule.auto_plain._selector_axes`)."""
    expr = values[-1]
    for k in range(len(values) - 2, -1, -1):
        expr = te.if_then_else(axis == k, values[k], expr)
    return expr


def _flat_tiles(body: Any, shape: tuple[int, ...], name: str) -> Tensor:
    """``T[..., ty * tw + tx] = body(..., ty, tx)``: a stage over 2-D tile coordinates that stores them
    flattened (what a contraction over the tiles reads with unit stride)."""
    from cuvil.ir.expr import IterVar, const
    from cuvil.te.tensor import ComputeOp

    names = ("r", "s", "n", "c", "ty", "tx")
    axis = tuple(IterVar("int64", nm, const(0, "int64"), const(d, "int64"), "data") for nm, d in zip(names, shape))
    flat = shape[:-2] + (shape[-2] * shape[-1],)
    store = axis[:-2] + (axis[-2] * shape[-1] + axis[-1],)
    return ComputeOp(name, axis, body(*axis), shape=tuple(const(d, "int64") for d in flat),
                     store_indices=store).output(0)


def _winograd_conv(ctx: NodeCtx, xs: tuple[int, ...], ws: tuple[int, ...], begin: list[int], out: list[int]
                   ) -> Shaped:
    """A 3x3 convolution as Winograd F(2x2, 3x3): each 2x2 output tile from a 4x4 input tile with 16
    multiplies per channel pair instead of 36, in four stages::

        wino_pad  Xp[n, c, u, v]         the input, zero-padded to 2 * tiles + 2 rows and columns
        wino_in   V[r, s, n, c, t]       B^T d B of the 4x4 tile t (adds and subtracts)
        wino_gemm M[r, s, n, k, t]       sum_c U[r, s, k, c] * V[r, s, n, c, t]: 16 contractions over the
                                         channels (U = G g G^T, the filters transformed at compile time)
        wino_out  Y[n, k, ty, a, tx, b]  A^T M A (+ bias): the 2x2 outputs of tile (ty, tx), which in this
                                         order are the elements of the NCHW output [n, k, 2ty + a, 2tx + b]

    The transforms' axes ``r, s`` and ``a, b`` select formulas; the scheduler unrolls them."""
    n_, c_, h, w = xs
    k_ = ws[0]
    has_bias = ctx.has(2)  # before compile-time constants are appended to the entries
    th, tw = out[0] // 2, out[1] // 2
    ph, pw = 2 * th + 2, 2 * tw + 2
    X = ctx.tensor(0)
    b0, b1 = begin

    def pad_body(n: Any, c: Any, u: Any, v: Any) -> Any:
        inside = [cond for cond, need in ((u >= b0, b0 > 0), (u < h + b0, ph > h + b0),
                                          (v >= b1, b1 > 0), (v < w + b1, pw > w + b1)) if need]
        src = X[n, c, u - b0, v - b1]
        return te.if_then_else(te.all(*inside), src, te.const(0, X.dtype)) if inside else src

    Xp = te.compute((n_, c_, ph, pw), pad_body, name="wino_pad")

    def in_body(r: Any, s: Any, n: Any, c: Any, ty: Any, tx: Any) -> Any:
        def tile(rr: int, ss: int) -> Any:
            return _signed_sum([(_BT[rr][i] * _BT[ss][j], Xp[n, c, 2 * ty + i, 2 * tx + j])
                                for i in range(4) for j in range(4)])

        return _choose(r, [_choose(s, [tile(rr, ss) for ss in range(4)]) for rr in range(4)])

    # computed over the tile's (ty, tx), stored at t = ty * tw + tx: no division in any index
    V = _flat_tiles(in_body, (4, 4, n_, c_, th, tw), "wino_in")
    wt = np.asarray(ctx.entries[1], dtype=np.float64)
    u = np.einsum("ri,kcij,sj->rskc", _G, wt, _G).astype(np.float32)  # [r, s, k, c]
    tgt = ctx.target
    p = 2 * max(4, tgt.vector_bits // 32)
    if k_ >= p:  # in panels of p filters [r, s, k // p, c, k % p], as _filter_panels packs direct filters
        q = -(-k_ // p)
        full = np.zeros((4, 4, q * p, c_), np.float32)
        full[:, :, :k_] = u
        Up = ctx.constant(np.ascontiguousarray(full.reshape(4, 4, q, p, c_).transpose(0, 1, 2, 4, 3)), keyed=False)

        def u_read(r: Any, s: Any, k: Any, c: Any) -> Any:
            return Up[r, s, k // p, c, k % p]
    else:
        U = ctx.constant(u, keyed=False)

        def u_read(r: Any, s: Any, k: Any, c: Any) -> Any:
            return U[r, s, k, c]
    rc = te.reduce_axis((0, c_), name="rc")
    M = te.compute((4, 4, n_, k_, th * tw), lambda r, s, n, k, t: te.sum(u_read(r, s, k, rc) * V[r, s, n, rc, t],
                                                                          axis=rc), name="wino_gemm")
    bias = ctx.tensor(2) if has_bias else None

    def out_body(n: Any, k: Any, ty: Any, a: Any, tx: Any, b: Any) -> Any:
        t = ty * tw + tx

        def pixel(aa: int, bb: int) -> Any:
            y = _signed_sum([(_AT[aa][r] * _AT[bb][s], M[r, s, n, k, t]) for r in range(4) for s in range(4)])
            return y + bias[k] if bias is not None else y

        return _choose(a, [_choose(b, [pixel(aa, bb) for bb in range(2)]) for aa in range(2)])

    Y = te.compute((n_, k_, th, 2, tw, 2), out_body, name="wino_out")
    return Shaped(Y, (n_, k_) + tuple(out))


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
    tile = 2 * max(4, tgt.vector_bits // (8 * np.dtype(ctx.dtype(0)).itemsize))
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
    p = 2 * max(4, tgt.vector_bits // (8 * w.dtype.itemsize)) if w is not None and tgt is not None and getattr(
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
    convolutions :func:`cuvil.graph.passes.channels_last` makes them NHWC kernels instead."""
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
    p = 2 * max(4, tgt.vector_bits // (8 * w.dtype.itemsize))
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


@op("Gemm")
def gemm(ctx: NodeCtx) -> list:
    ta, tb = int(ctx.attr("transA", 0)), int(ctx.attr("transB", 0))
    A = ctx.tensor(0)
    has_c = ctx.has(2)  # before compile-time constants are appended to the entries
    panels = None
    if not ta and ctx.known(1) and len(ctx.shape(1)) == 2 and bf16.wants_bf16(ctx, 0, 1):
        w = np.asarray(ctx.entries[1], np.float32)
        ctx.variant = "bf16"
        panels = bf16.bf16_matmul(ctx, A, np.ascontiguousarray(w.T if tb else w), "gemm")
    elif ctx.known(1) and len(ctx.shape(1)) == 2:
        # constant weights are packed at compile time: panels of columns the register tile reads whole
        w = np.asarray(ctx.entries[1])
        panels = _weight_panels(ctx, w.T if tb else w, ctx.entries[1], ("gemm", tb))
    if panels is not None:  # (a te tensor: the bf16 contraction itself)
        B, tb, b_shape = None, 0, ctx.shape(1)[::-1] if tb else ctx.shape(1)
    elif tb and ctx.known(1) and len(ctx.shape(1)) == 2:
        # constant weights are transposed at compile time: B[k, j] reads the columns with unit stride
        B, tb = ctx.constant(np.ascontiguousarray(ctx.entries[1].T), keyed=False), 0
        b_shape = ctx.shape(1)[::-1]
    else:
        B, b_shape = ctx.tensor(1), ctx.shape(1)
    alpha, beta = float(ctx.attr("alpha", 1.0)), float(ctx.attr("beta", 1.0))
    (m, ka), (kb, n) = ctx.shape(0)[::-1] if ta else ctx.shape(0), b_shape[::-1] if tb else b_shape
    if ka != kb:
        raise ctx.error(f"A {list(ctx.shape(0))} (transA={ta}) and B {list(ctx.shape(1))} (transB={tb}) do not "
                        "multiply")
    k = te.reduce_axis((0, ka), name="k")
    def rhs(k: Any, j: Any) -> Any:
        return panels(k, j) if panels is not None else B[j, k] if tb else B[k, j]

    y = panels if isinstance(panels, Tensor) else te.compute(
        (m, n), lambda i, j: te.sum((A[k, i] if ta else A[i, k]) * rhs(k, j), axis=k), name="gemm")
    if has_c or alpha != 1.0:
        c = ctx.tensor(2) if has_c else None
        if c is not None:
            broadcast_shapes(ctx, ctx.shape(2), (m, n))

        def epi(i: Any, j: Any) -> Any:
            v = y[i, j] * alpha if alpha != 1.0 else y[i, j]
            if c is None or beta == 0.0:
                return v
            cv = bcast_read(c, (m, n), (i, j))
            return v + (cv * beta if beta != 1.0 else cv)

        return [te.compute((m, n), epi, name="gemm_out")]
    return [y]


@op("MatMul")
def matmul(ctx: NodeCtx) -> list:
    a_s, b_s = ctx.shape(0), ctx.shape(1)
    if len(a_s) >= 2 and len(b_s) >= 2 and a_s[-1] == b_s[-2]:
        # fewer dimensions for isl: rows of A against a 2-D B, or equal batch dimensions merged
        if len(b_s) == 2 and (len(a_s) > 2 or ctx.known(1)):  # (constant weights: packed in panels)
            return [_matmul_view(ctx, (math.prod(a_s[:-1]), a_s[-1]), b_s, a_s[:-1] + b_s[-1:])]
        if len(a_s) == len(b_s) > 3 and a_s[:-2] == b_s[:-2]:
            bt = math.prod(a_s[:-2])
            return [_matmul_view(ctx, (bt,) + a_s[-2:], (bt,) + b_s[-2:], a_s[:-1] + b_s[-1:])]
    A, B = ctx.tensor(0), ctx.tensor(1)
    a2 = a_s if len(a_s) > 1 else (1,) + a_s
    b2 = b_s if len(b_s) > 1 else b_s + (1,)
    if a2[-1] != b2[-2]:
        raise ctx.error(f"shapes {list(a_s)} and {list(b_s)} do not multiply")
    batch = broadcast_shapes(ctx, a2[:-2], b2[:-2])
    full = batch + (a2[-2], b2[-1])
    out = batch + ((a2[-2],) if len(a_s) > 1 else ()) + ((b2[-1],) if len(b_s) > 1 else ())
    k = te.reduce_axis((0, a2[-1]), name="k")
    nb = len(batch)

    def read(t: Tensor, shp: tuple[int, ...], idx: tuple[Any, ...], vec_first: bool) -> Any:
        if len(shp) == 1:
            return t[idx[-2] if vec_first else idx[-1]]
        off = nb - (len(shp) - 2)
        bidx = tuple(0 if shp[d] == 1 and batch[off + d] != 1 else idx[off + d] for d in range(len(shp) - 2))
        return t[bidx + idx[-2:]]

    def body(*i: Any) -> Any:
        i = list(i)
        if len(a_s) == 1:
            i.insert(nb, 0)
        if len(b_s) == 1:
            i.append(0)
        bi = tuple(i[:nb])
        return te.sum(read(A, a_s, bi + (i[nb], k), False) * read(B, b_s, bi + (k, i[nb + 1]), True), axis=k)

    del full
    return [te.compute(out, body, name="matmul")]


# (id(source), how, shape, panel width) -> (weak reference to source, panels).  An entry leaves with its source
# array (weakref.finalize below); the limit, above an LLM's count of weight matrices, caps a process that
# keeps many graphs alive (a miss packs the weights again)
_PANELS: BoundedCache[tuple, tuple[Any, np.ndarray]] = BoundedCache("cuvil.graph.ops.nn._PANELS", 1024)


def _weight_panels(ctx: NodeCtx, w: np.ndarray, source: Any = None, how: Any = None) -> Any:
    """Constant weights ``W[k, j]`` packed at compile time into panels ``[j // P, k, j % P]`` (P = two
    vectors of the target, the auto-scheduler's tile width), as a read function ``(k, j) -> W[k, j]``;
    None when the weights are too narrow for one panel or the target is not a CPU.

    ``source`` (the graph's array ``w`` was taken from, by ``how``) packs it once for every node
    that reads it (an unrolled LSTM's 64 steps): one packing, and one constant buffer in the module."""
    tgt = ctx.target
    if tgt is None or getattr(tgt, "kind", "") != "llvm" or w.ndim != 2:
        return None
    p = 2 * max(4, tgt.vector_bits // (8 * w.dtype.itemsize))
    kk, n = w.shape
    if n < p or w.dtype.kind != "f":
        return None
    key = (id(source), how, w.shape, p)
    hit = _PANELS.get(key) if source is not None else None
    if hit is not None and hit[0]() is source:
        packed = hit[1]
    else:
        q = -(-n // p)
        panels = np.zeros((q * p, kk), w.dtype)
        panels[:n] = w.T
        packed = np.ascontiguousarray(panels.reshape(q, p, kk).transpose(0, 2, 1))
        if isinstance(source, np.ndarray):
            _PANELS[key] = (weakref.ref(source), packed)
            weakref.finalize(source, _PANELS.pop, key, None)
    Wp = ctx.constant(packed, keyed=False)
    return lambda k, j: Wp[j // p, k, j % p]


def _matmul_view(ctx: NodeCtx, a_s: tuple[int, ...], b_s: tuple[int, ...], out: tuple[int, ...]) -> Shaped:
    if len(a_s) == 2 and ctx.known(1) and bf16.wants_bf16(ctx, 0, 1):  # precision="bf16"
        ctx.variant = "bf16"
        w = np.asarray(ctx.entries[1], np.float32).reshape(b_s)
        return Shaped(bf16.bf16_matmul(ctx, ctx.tensor(0, a_s), w, "matmul"), out)
    k = te.reduce_axis((0, a_s[-1]), name="k")
    panels = (_weight_panels(ctx, np.asarray(ctx.entries[1]).reshape(b_s), ctx.entries[1], "matmul")
              if len(a_s) == 2 and ctx.known(1) else None)
    if panels is not None:
        A = ctx.tensor(0, a_s)
        y = te.compute((a_s[0], b_s[1]), lambda i, j: te.sum(A[i, k] * panels(k, j), axis=k), name="matmul")
        return Shaped(y, out)
    A, B = ctx.tensor(0, a_s), ctx.tensor(1, b_s)
    if len(a_s) == 2:
        y = te.compute((a_s[0], b_s[1]), lambda i, j: te.sum(A[i, k] * B[k, j], axis=k), name="matmul")
    else:
        y = te.compute((a_s[0], a_s[1], b_s[2]), lambda b, i, j: te.sum(A[b, i, k] * B[b, k, j], axis=k),
                       name="matmul")
    return Shaped(y, out)


@op("BatchNormalization")
def batch_norm(ctx: NodeCtx) -> list:
    _float_input(ctx)
    training = int(ctx.attr("training_mode", 0))
    if not training and ctx.opset < 14 and len(ctx.node.outputs) > 1 and any(ctx.node.outputs[1:]):
        raise ctx.unsupported("the training outputs of opsets before 14 are not supported")
    eps = float(ctx.attr("epsilon", 1e-5))
    xs = ctx.shape(0)
    shp = xs[:2] + (math.prod(xs[2:]),) if len(xs) > 2 else xs
    X = ctx.tensor(0, shp)
    s, b, mean, var = (ctx.tensor(i) for i in range(1, 5))
    if training:
        return _batch_norm_training(ctx, X, shp, xs, s, b, mean, var, eps)

    def body(*i: Any) -> Any:
        c = i[1] if len(shp) > 1 else 0
        return (X[i] - mean[c]) / te.sqrt(var[c] + eps) * s[c] + b[c]

    return [Shaped(te.compute(shp, body, name="batchnorm"), xs)]


def _batch_norm_training(ctx: NodeCtx, X: Tensor, shp: tuple[int, ...], xs: tuple[int, ...], s: Tensor, b: Tensor,
                         run_mean: Tensor, run_var: Tensor, eps: float) -> list:
    """Batch statistics (population variance) normalise; the running statistics move by ``momentum``."""
    momentum = float(ctx.attr("momentum", 0.9))
    count = math.prod(shp) // shp[1]
    red = [0] + ([2] if len(shp) > 2 else [])
    total = _reduce_keep(X, shp, red, "sum", name="bsum")
    mean = te.compute((shp[1],), lambda c: total[(0, c) + (0,) * (len(shp) - 2)] * (1.0 / count), name="bmean")

    def dev(*i: Any) -> Any:
        d = X[i] - mean[i[1]]
        return d * d

    d2 = te.compute(shp, dev, name="bdev2")
    sq = _reduce_keep(d2, shp, red, "sum", name="bvar")
    var = te.compute((shp[1],), lambda c: sq[(0, c) + (0,) * (len(shp) - 2)] * (1.0 / count), name="bvar_c")
    y = te.compute(shp, lambda *i: (X[i] - mean[i[1]]) / te.sqrt(var[i[1]] + eps) * s[i[1]] + b[i[1]],
                   name="batchnorm")
    outs: list = [Shaped(y, xs)]
    if len(ctx.node.outputs) > 1:
        outs.append(te.compute((shp[1],), lambda c: run_mean[c] * momentum + mean[c] * (1 - momentum),
                               name="running_mean"))
    if len(ctx.node.outputs) > 2:
        outs.append(te.compute((shp[1],), lambda c: run_var[c] * momentum + var[c] * (1 - momentum),
                               name="running_var"))
    return outs


def _pool(ctx: NodeCtx, kind: str) -> list:
    xs = ctx.shape(0)
    n_sp = len(xs) - 2
    kernel = [int(k) for k in ctx.attr("kernel_shape")]
    if len(kernel) != n_sp:
        raise ctx.error(f"kernel_shape {kernel} does not fit the input {list(xs)}")
    strides, dil, begin, out = _window(ctx, xs[2:], kernel, bool(int(ctx.attr("ceil_mode", 0))))
    X = ctx.tensor(0)
    rk = [te.reduce_axis((0, kernel[d]), name=f"rk{d}") for d in range(n_sp)]
    shape = xs[:2] + tuple(out)

    def pos(sp: tuple[Any, ...], d: int) -> Any:
        return sp[d] * strides[d] - begin[d] + rk[d] * dil[d]

    def inside(sp: tuple[Any, ...], lo: list[int], hi: list[int]) -> Any:
        return te.all(*[c for d in range(n_sp) for c in (pos(sp, d) >= lo[d], pos(sp, d) < hi[d])])

    def read(n: Any, c: Any, sp: tuple[Any, ...]) -> Any:
        return X[(n, c) + tuple(pos(sp, d) for d in range(n_sp))]

    zeros, sizes = [0] * n_sp, list(xs[2:])
    if kind == "max" and n_sp == 2 and strides[0] == strides[1] > 1 and (len(ctx.node.outputs) < 2
                                                                           or not ctx.node.outputs[1]):
        return [_strided_max_pool(X, xs, kernel, strides[0], dil, begin, out)]
    if kind == "max":
        low = min_value(X.dtype)
        y = te.compute(shape, lambda n, c, *sp: te.max(
            te.if_then_else(inside(sp, zeros, sizes), read(n, c, sp), low), axis=rk), name="maxpool")
        if len(ctx.node.outputs) < 2 or not ctx.node.outputs[1]:
            return [y]
        return [y, _argmax_indices(ctx, X, y, xs, kernel, strides, dil, begin, shape)]
    total = te.compute(shape, lambda n, c, *sp: te.sum(
        te.if_then_else(inside(sp, zeros, sizes), read(n, c, sp), te.const(0, X.dtype)), axis=rk), name="pool_sum")
    if int(ctx.attr("count_include_pad", 0)):
        pads = _ints(ctx, "pads", 2 * n_sp, 0)
        lo = [-b for b in begin]
        hi = [xs[2 + d] + (pads[d + n_sp] if _auto_pad(ctx) == "NOTSET" else begin[d]) for d in range(n_sp)]
    else:
        lo, hi = zeros, sizes
    rc = [te.reduce_axis((0, kernel[d]), name=f"rc{d}") for d in range(n_sp)]

    def count_body(*sp: Any) -> Any:
        ps = [sp[d] * strides[d] - begin[d] + rc[d] * dil[d] for d in range(n_sp)]
        ok = te.all(*[c for d in range(n_sp) for c in (ps[d] >= lo[d], ps[d] < hi[d])])
        return te.sum(te.if_then_else(ok, te.const(1, X.dtype), te.const(0, X.dtype)), axis=rc)

    count = te.compute(tuple(out), count_body, name="pool_count")
    return [te.compute(shape, lambda n, c, *sp: total[(n, c) + sp] / count[sp], name="avgpool")]


def _strided_max_pool(X: Tensor, xs: tuple[int, ...], kernel: list[int], st: int, dil: list[int], begin: list[int],
                      out: list[int]) -> Tensor:
    """A strided 2-D max pool as three passes over unit-stride rows: the window's column maximum for each
    output row at every input column, then its row maximum at every input column from the first window's
    to the last's, then every ``st``-th of those.  A vector of a stride-``st`` row is a gather (a load per
    lane): this reads one such element per output instead of one per window tap, and its passes take
    ``kh + kw`` taps per column instead of ``kh * kw`` (SqueezeNet's 3x3 / 2 pool over 96 x 109 x 109 at 1
    thread: 405 -> 270 us).  A window with no more taps than that (2 x 2: 4 against 4, 1 x k) reads the
    phase-split input instead (:func:`_phase_max_pool`; U-Net's 2x2 / 2 pool over 256 x 64 x 64: 167 us,
    267 in passes).  Padding is the lowest value; only the bounds that the shapes let a tap cross are
    tested."""
    if kernel[0] * kernel[1] <= kernel[0] + kernel[1]:
        return _phase_max_pool(X, xs, kernel, st, dil, begin, out)
    (kh, kw), (dy, dx), (a0, a1), (oh, ow) = kernel, dil, begin, out
    h, w = xs[2:]
    wr = (ow - 1) * st + 1  # the input columns from the first window's start to the last's
    low = min_value(X.dtype)
    rx = te.reduce_axis((0, kw), name="rk1")

    def rows(n: Any, c: Any, i: Any, x: Any) -> Any:
        out = None
        for t in range(kh):  # (the taps written out: a stage of its own that its reader computes per channel)
            y = i * st + t * dy - a0
            cond = ([y >= 0] if a0 > t * dy else []) + ([y < h] if (oh - 1) * st + t * dy - a0 >= h else [])
            v = te.if_then_else(te.all(*cond), X[n, c, y, x], low) if cond else X[n, c, y, x]
            out = v if out is None else te.max(out, v)
        return out

    def cols(n: Any, c: Any, i: Any, x: Any) -> Any:
        x = x + rx * dx - a1
        cond = ([x >= 0] if a1 > 0 else []) + ([x < w] if wr - 1 + (kw - 1) * dx - a1 >= w else [])
        return te.max(te.if_then_else(te.all(*cond), V[n, c, i, x], low) if cond else V[n, c, i, x], axis=rx)

    V = te.compute(xs[:2] + (oh, w), rows, name="pool_cols")
    R = te.compute(xs[:2] + (oh, wr), cols, name="pool_rows")
    return te.compute(xs[:2] + (oh, ow), lambda n, c, i, j: R[n, c, i, j * st], name="maxpool")


def _phase_max_pool(X: Tensor, xs: tuple[int, ...], kernel: list[int], st: int, dil: list[int], begin: list[int],
                    out: list[int]) -> Tensor:
    """A strided 2-D max pool over the input split into ``st x st`` phases (pixel ``(st * i + py, st * j + px)`` at
    ``(i, j)`` of phase ``(py, px)``, the padding as the lowest value): each tap then reads a unit-stride run of
    its phase instead of every other pixel, and tests no bounds (ResNet's 3x3 / 2 stem pool over 64 x 112 x 112:
    2.5x -> 1.9x onnxruntime's time at 1 thread; a gather through a table of source offsets ran slower)."""
    (kh, kw), (dy, dx), (a0, a1), (oh, ow) = kernel, dil, begin, out
    h, w = xs[2:]
    hq, wq = oh + (kh - 1) * dy // st, ow + (kw - 1) * dx // st
    low = min_value(X.dtype)

    def phase(n: Any, c: Any, py: Any, px: Any, i: Any, j: Any) -> Any:
        y, x = i * st + py - a0, j * st + px - a1
        inside = te.all(y >= 0, y < h, x >= 0, x < w)
        return te.if_then_else(inside, X[n, c, te.max(te.min(y, h - 1), 0), te.max(te.min(x, w - 1), 0)], low)

    P = te.compute(xs[:2] + (st, st, hq, wq), phase, name="pool_phases")
    ry, rx = te.reduce_axis((0, kh), name="rk0"), te.reduce_axis((0, kw), name="rk1")
    return te.compute(xs[:2] + (oh, ow), lambda n, c, y, x: te.max(
        P[n, c, (ry * dy) % st, (rx * dx) % st, y + ry * dy // st, x + rx * dx // st], axis=[ry, rx]), name="maxpool")


def _argmax_indices(ctx: NodeCtx, X: Tensor, y: Tensor, xs: tuple[int, ...], kernel: list[int], strides: list[int],
                    dil: list[int], begin: list[int], shape: tuple[int, ...]) -> Tensor:
    """MaxPool's Indices: the first window position (row-major) holding the maximum, as an index into the
    flattened input (row-major, or column-major over the spatial axes with storage_order=1)."""
    n_sp = len(kernel)
    rk = [te.reduce_axis((0, kernel[d]), name=f"ri{d}") for d in range(n_sp)]
    big = te.const(math.prod(kernel), "int64")

    def first(n: Any, c: Any, *sp: Any) -> Any:
        p = [sp[d] * strides[d] - begin[d] + rk[d] * dil[d] for d in range(n_sp)]
        ok = te.all(*[x for d in range(n_sp) for x in (p[d] >= 0, p[d] < xs[2 + d])])
        hit = te.if_then_else(ok, X[(n, c) + tuple(p)] == y[(n, c) + sp], te.const(False))
        k = te.const(0, "int64")
        for d in range(n_sp):
            k = k * kernel[d] + te.cast(rk[d], "int64")
        return te.min(te.if_then_else(hit, k, big), axis=rk)

    win = te.compute(shape, first, name="argwin")
    col_major = int(ctx.attr("storage_order", 0)) == 1

    def index(n: Any, c: Any, *sp: Any) -> Any:
        k = win[(n, c) + sp]
        coords = []
        for d in reversed(range(n_sp)):
            coords.append(te.cast(sp[d], "int64") * strides[d] - begin[d] + (k % kernel[d]) * dil[d])
            k = k // kernel[d]
        coords = coords[::-1]
        order = list(reversed(range(n_sp))) if col_major else list(range(n_sp))
        flat = te.cast(n, "int64") * xs[1] + te.cast(c, "int64")
        for d in order:
            flat = flat * xs[2 + d] + coords[d]
        return flat

    return te.compute(shape, index, name="maxpool_indices")


@op("MaxPool")
def max_pool(ctx: NodeCtx) -> list:
    return _pool(ctx, "max")


@op("AveragePool")
def average_pool(ctx: NodeCtx) -> list:
    _float_input(ctx)
    return _pool(ctx, "avg")


@op("GlobalAveragePool", "GlobalMaxPool")
def global_pool(ctx: NodeCtx) -> list:
    """Over the image flattened (``N x C x H*W``, a view of the same buffer): one unit-stride reduction axis,
    which the scheduler reduces in vector lanes (over ``H`` and ``W`` as two axes it summed one element at a
    time: 1000 x 12 x 12, 71 -> 9 us)."""
    xs = ctx.shape(0)
    pixels = math.prod(xs[2:])
    X = ctx.tensor(0, xs[:2] + (pixels,))
    rk = te.reduce_axis((0, pixels), name="rk")
    shape = xs[:2] + (1,) * (len(xs) - 2)
    if ctx.node.op_type == "GlobalMaxPool":
        return [te.compute(shape, lambda n, c, *_: te.max(X[n, c, rk], axis=rk), name="gmaxpool")]
    _float_input(ctx)
    total = te.compute(shape, lambda n, c, *_: te.sum(X[n, c, rk], axis=rk), name="gsum")
    inv = 1.0 / pixels
    return [te.compute(shape, lambda *i: total[i] * inv, name="gavgpool")]


@op("LRN")
def lrn(ctx: NodeCtx) -> list:
    _float_input(ctx)
    xs = ctx.shape(0)
    size = int(ctx.attr("size"))
    alpha, beta, bias = float(ctx.attr("alpha", 1e-4)), float(ctx.attr("beta", 0.75)), float(ctx.attr("bias", 1.0))
    X = ctx.tensor(0)
    lo = (size - 1) // 2
    r = te.reduce_axis((0, size), name="r")

    def sq(n: Any, c: Any, *s: Any) -> Any:
        cc = c - lo + r
        v = X[(n, cc) + s]
        return te.sum(te.if_then_else(te.all(cc >= 0, cc < xs[1]), v * v, te.const(0, X.dtype)), axis=r)

    ss = te.compute(xs, sq, name="lrn_sq")
    return [te.compute(xs, lambda *i: X[i] / te.power(ss[i] * (alpha / size) + bias, te.const(beta, X.dtype)),
                       name="lrn")]


# -- normalisations over a set of axes ---------------------------------------------------


def _reduce_keep(X: Any, shape: tuple[int, ...], axes: list[int], kind: str, f: Any = None, name: str = "r") -> Tensor:
    """``kind`` ("sum" | "max") of ``f(X)[i]`` over ``axes``, keeping them as size-1 dimensions."""
    rs = {a: te.reduce_axis((0, shape[a]), name=f"r{a}") for a in axes}
    out = tuple(1 if d in rs else s for d, s in enumerate(shape))
    f = f or (lambda v: v)

    def body(*i: Any) -> Any:
        src = tuple(rs[d] if d in rs else i[d] for d in range(len(shape)))
        v = f(X[src])
        return te.sum(v, axis=list(rs.values())) if kind == "sum" else te.max(v, axis=list(rs.values()))

    return te.compute(out, body, name=name)


def _kept(i: tuple[Any, ...], axes: list[int]) -> tuple[Any, ...]:
    return tuple(0 if d in axes else x for d, x in enumerate(i))


@op("Softmax", "LogSoftmax")
def softmax(ctx: NodeCtx) -> list:
    _float_input(ctx)
    xs = ctx.shape(0)
    if math.prod(xs) == 0:
        return [np.zeros(xs, ctx.dtype(0))]
    if ctx.opset >= 13:
        a = norm_axis(ctx, int(ctx.attr("axis", -1)), len(xs))
        outer, n, inner = math.prod(xs[:a]), xs[a], math.prod(xs[a + 1:])
    else:  # opsets 1-12: the input is coerced to 2-D at the axis
        a = norm_axis(ctx, int(ctx.attr("axis", 1)), len(xs))
        outer, n, inner = math.prod(xs[:a]), math.prod(xs[a:]), 1
    shp = (outer, n, inner) if inner > 1 else (outer, n)
    axes = [1]
    X = ctx.tensor(0, shp)
    m = _reduce_keep(X, shp, axes, "max", name="smax")
    e = te.compute(shp, lambda *i: te.exp(X[i] - m[_kept(i, axes)]), name="sexp")
    s = _reduce_keep(e, shp, axes, "sum", name="ssum")
    if ctx.node.op_type == "LogSoftmax":
        y = te.compute(shp, lambda *i: X[i] - m[_kept(i, axes)] - te.log(s[_kept(i, axes)]), name="logsoftmax")
    else:
        y = te.compute(shp, lambda *i: e[i] / s[_kept(i, axes)], name="softmax")
    return [Shaped(y, xs)]


@op("LayerNormalization")
def layer_norm(ctx: NodeCtx) -> list:
    _float_input(ctx)
    xs = ctx.shape(0)
    axis = norm_axis(ctx, int(ctx.attr("axis", -1)), len(xs))
    eps = float(ctx.attr("epsilon", 1e-5))
    dtype = ctx.dtype(0)
    work = "float32" if dtype == "float16" else dtype
    outer, n = math.prod(xs[:axis]), math.prod(xs[axis:])
    shp = (outer, n)
    kept = xs[:axis] + (1,) * (len(xs) - axis)
    X0 = ctx.tensor(0, shp)
    X = X0 if work == dtype else te.compute(shp, lambda *i: te.cast(X0[i], work), name="x32")
    total = _reduce_keep(X, shp, [1], "sum", name="lsum")
    mean = te.compute(total.shape, lambda *i: total[i] * (1.0 / n), name="mean")
    d2 = te.compute(shp, lambda i, j: (X[i, j] - mean[i, 0]) * (X[i, j] - mean[i, 0]), name="dev2")
    var = _reduce_keep(d2, shp, [1], "sum", name="lvar")
    inv = te.compute(total.shape, lambda *i: 1.0 / te.sqrt(var[i] * (1.0 / n) + eps), name="invstd")

    def param(i: int) -> Any:
        """Scale or bias over the normalised dimensions, read at (row, column) of the 2-D view."""
        ps = ctx.shape(i)
        full = broadcast_shapes(ctx, ps, xs)
        if full != xs:
            raise ctx.error(f"input {i} of shape {list(ps)} does not broadcast to {list(xs)}")
        if math.prod(ps) == n and len(ps) <= len(xs) - axis:
            t = ctx.tensor(i, (n,))
            return lambda r, c: t[c]
        t = ctx.tensor(i)
        tail = xs[axis:]

        def read(r: Any, c: Any) -> Any:
            idx, rest = [], c
            for d in reversed(range(len(xs))):  # unflatten (r, c) into the N-D index
                if d >= axis:
                    idx.append(rest % tail[d - axis])
                    rest = rest // tail[d - axis]
                else:
                    idx.append(r % xs[d])
                    r = r // xs[d]
            return bcast_read(t, xs, idx[::-1])

        return read

    scale = param(1)
    bias = param(2) if ctx.has(2) else None

    def body(i: Any, j: Any) -> Any:
        y = (X[i, j] - mean[i, 0]) * inv[i, 0] * te.cast(scale(i, j), work)
        if bias is not None:
            y = y + te.cast(bias(i, j), work)
        return te.cast(y, dtype) if work != dtype else y

    outs: list = [Shaped(te.compute(shp, body, name="layernorm"), xs)]
    if len(ctx.node.outputs) > 1:
        outs.append(Shaped(mean, kept))
    if len(ctx.node.outputs) > 2:
        outs.append(Shaped(inv, kept))
    return outs
