"""ONNX Resize (and the older Upsample): nearest, N-linear and cubic interpolation.

Which input elements an output element reads, and with which weights, depends only on its position
along each resized axis; those tables are computed with numpy at compile time (every coordinate
transformation mode then costs the same) and the kernel is a weighted sum of table-indexed reads::

    out[n, c, y, x] = sum_{a, b} Wy[y, a] * Wx[x, b] * X[n, c, Iy[y, a], Ix[x, b]]
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from cuvil import te
from cuvil.frontend.onnx_ops import NodeCtx, op


def _source_coords(mode: str, out_len: int, in_len: int, scale: float, roi: tuple[float, float]) -> np.ndarray:
    """Each output position's coordinate in the input (ONNX's coordinate_transformation_mode)."""
    x = np.arange(out_len, dtype=np.float64)
    if mode == "half_pixel":
        return (x + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        adj = out_len / (scale * in_len)
        offset = in_len / 2 * (1 - adj)
        return offset + (x + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (x + 0.5) / scale - 0.5 if out_len > 1 else np.zeros_like(x)
    if mode == "align_corners":
        return x * (in_len - 1) / (out_len - 1) if out_len > 1 else np.zeros_like(x)
    if mode == "asymmetric":
        return x / scale
    if mode == "tf_crop_and_resize":
        start, end = roi
        if out_len > 1:
            return start * (in_len - 1) + x * (end - start) * (in_len - 1) / (out_len - 1)
        return np.full_like(x, 0.5 * (start + end) * (in_len - 1))
    raise ValueError(mode)


def _nearest(x: np.ndarray, mode: str) -> np.ndarray:
    if mode == "floor":
        return np.floor(x)
    if mode == "ceil":
        return np.ceil(x)
    if mode == "round_prefer_ceil":
        return np.floor(x + 0.5)
    return np.ceil(x - 0.5)  # round_prefer_floor


def _cubic(t: np.ndarray, a: float) -> np.ndarray:
    d = np.stack([t + 1, t, 1 - t, 2 - t], axis=-1)
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    return np.where(np.abs(d) <= 1, near, far)


def _tables(ctx: NodeCtx, mode: str, coord: str, nearest: str, out_len: int, in_len: int, scale: float,
            roi: tuple[float, float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Index table [out, K], weight table [out, K] and an inside mask [out] for one axis."""
    x = _source_coords(coord, out_len, in_len, scale, roi)
    inside = (x >= 0) & (x <= in_len - 1) if coord == "tf_crop_and_resize" else np.ones(out_len, bool)
    if mode == "nearest":
        idx = _nearest(x, nearest)[:, None]
        w = np.ones_like(idx)
    elif mode == "linear":
        base = np.floor(x)
        idx = np.stack([base, base + 1], axis=-1)
        t = (x - base)[:, None]
        w = np.concatenate([1 - t, t], axis=-1)
    else:
        base = np.floor(x)
        idx = base[:, None] + np.arange(-1, 3)[None, :]
        w = _cubic(x - base, float(ctx.attr("cubic_coeff_a", -0.75)))
        if int(ctx.attr("exclude_outside", 0)):
            w = np.where((idx >= 0) & (idx <= in_len - 1), w, 0.0)
            w = w / w.sum(axis=-1, keepdims=True)
    idx = np.clip(idx, 0, in_len - 1).astype(np.int64)
    return idx, w, inside


@op("Resize", "Upsample")
def resize(ctx: NodeCtx) -> list:
    xs = ctx.shape(0)
    rank = len(xs)
    dtype = ctx.dtype(0)
    mode = ctx.attr("mode", "nearest")
    if mode not in ("nearest", "linear", "cubic", "bilinear"):
        raise ctx.unsupported(f"mode {mode!r}")
    mode = "linear" if mode == "bilinear" else mode
    old = ctx.node.op_type == "Upsample" or ctx.opset < 11
    if int(ctx.attr("antialias", 0)):
        raise ctx.unsupported("antialias=1")
    if old:
        coord = "asymmetric"
        scales_in = 1 if ctx.node.op_type == "Resize" or ctx.opset >= 9 else None
        scales = [float(s) for s in (ctx.value(scales_in).reshape(-1) if scales_in is not None
                                     else ctx.attr("scales"))]
        sizes = None
        roi = np.array([0.0] * rank + [1.0] * rank)
        nearest_default = "floor"
    else:
        coord = ctx.attr("coordinate_transformation_mode", "half_pixel")
        roi = np.asarray(ctx.value(1), np.float64).reshape(-1) if ctx.has(1) and ctx.shape(1) != (0,) else None
        scales = [float(s) for s in ctx.value(2).reshape(-1)] if ctx.has(2) and ctx.shape(2) != (0,) else None
        sizes = ctx.ints(3) if ctx.has(3) and ctx.shape(3) != (0,) else None
        nearest_default = None
    axes = [a + rank if a < 0 else a for a in ctx.attr("axes", list(range(rank)))]
    in_sel = [xs[a] for a in axes]
    if sizes is not None:
        policy = ctx.attr("keep_aspect_ratio_policy", "stretch")
        sc = [s / n for s, n in zip(sizes, in_sel)]
        if policy in ("not_larger", "not_smaller"):
            one = min(sc) if policy == "not_larger" else max(sc)
            sc = [one] * len(sc)
            sizes = [int(np.floor(one * n + 0.5)) for n in in_sel]
        out_sel, sc_sel = sizes, sc
    elif scales is not None:
        out_sel = [int(np.floor(n * s)) for n, s in zip(in_sel, scales)]
        sc_sel = scales
    else:
        raise ctx.error("one of scales and sizes is required")
    out = list(xs)
    scale = [1.0] * rank
    for a, o, s in zip(axes, out_sel, sc_sel):
        out[a], scale[a] = o, s
    if roi is None or roi.size == 0:
        roi_full = [(0.0, 1.0)] * rank
    else:
        k = len(roi) // 2
        starts, ends = roi[:k], roi[k:]
        roi_full = [(0.0, 1.0)] * rank
        for j, a in enumerate(axes if k == len(axes) else range(rank)):
            roi_full[a] = (float(starts[j]), float(ends[j]))
    if np.prod(out) == 0:
        return [np.zeros(out, dtype)]
    nearest = nearest_default or ctx.attr("nearest_mode", "round_prefer_floor")
    X = ctx.tensor(0)
    per_axis: list[Any] = []
    extrap = float(ctx.attr("extrapolation_value", 0.0))
    for d in range(rank):
        identity = out[d] == xs[d] and scale[d] == 1.0 and coord != "tf_crop_and_resize"
        if identity:
            per_axis.append(None)
            continue
        idx, w, inside = _tables(ctx, mode, coord, nearest, out[d], xs[d], scale[d], roi_full[d])
        wt = w.astype(np.float64 if dtype == "float64" else np.float32)
        mask = ctx.constant(inside) if not inside.all() else None
        per_axis.append((ctx.constant(idx), ctx.constant(wt), idx.shape[1], mask))

    def body(*i: Any) -> Any:
        terms = []
        choices = [range(p[2]) if p is not None else [None] for p in per_axis]
        for combo in itertools.product(*choices):
            src, weight = [], None
            for d, k in enumerate(combo):
                p = per_axis[d]
                if p is None:
                    src.append(i[d])
                    continue
                src.append(p[0][i[d], k])
                if mode != "nearest":
                    wd = p[1][i[d], k]
                    weight = wd if weight is None else weight * wd
            v = X[tuple(src)]
            if weight is not None:
                v = te.cast(v, weight.dtype) * weight if v.dtype != weight.dtype else v * weight
            terms.append(v)
        acc = terms[0]
        for t in terms[1:]:
            acc = acc + t
        if acc.dtype != dtype:
            acc = te.cast(te.round(acc), dtype) if dtype not in ("float16",) and not dtype.startswith("float") \
                else te.cast(acc, dtype)
        masks = [p[3][i[d]] for d, p in enumerate(per_axis) if p is not None and p[3] is not None]
        if masks:
            acc = te.if_then_else(te.all(*masks), acc, te.const(extrap, dtype))
        return acc

    return [te.compute(tuple(out), body, name="resize")]
