"""Winograd F(2x2, 3x3) for 3x3 stride-1 float convolutions: the input and filter transforms, the
batched products and the output transform as te stages; :func:`winograd_pays` says when the
builder of Conv (:mod:`cuvil.graph.ops.nn.conv`) takes it."""

from __future__ import annotations

from typing import Any

import numpy as np

from cuvil import te
from cuvil.graph.ops.base import NodeCtx, Shaped
from cuvil.te.tensor import Tensor

# -- Winograd F(2x2, 3x3) -------------------------------------------------------------------

# F(2, 3) (Lavin and Gray, Fast Algorithms for Convolutional Neural Networks, 2016): Y = A^T [(G g G^T) . (B^T d B)] A
_BT = ((1, 0, -1, 0), (0, 1, 1, 0), (0, -1, 1, 0), (0, 1, 0, -1))
_G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])
_AT = ((1, 1, 1, 0), (0, 1, -1, -1))


def winograd_pays(ctx: NodeCtx, xs: tuple[int, ...], ws: tuple[int, ...], g: int, kernel: list[int],
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


def winograd_conv(ctx: NodeCtx, xs: tuple[int, ...], ws: tuple[int, ...], begin: list[int], out: list[int]
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
    p = tgt.panel_width(4)
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
