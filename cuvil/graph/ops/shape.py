"""ONNX operators that move data: Reshape and friends (aliases of their input), Transpose, Concat,
Split, Slice, Gather, Expand, Tile, Pad, and the shape-producing ones (Shape, Constant,
ConstantOfShape, Range)."""

from __future__ import annotations

from typing import Any

import numpy as np

from cuvil import te
from cuvil.graph.ops.base import Alias, NodeCtx, bcast_read, broadcast_shapes, norm_axis, op


def _prod(xs: Any) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


# -- aliases: same buffer, another shape ----------------------------------------------------


@op("Reshape")
def reshape(ctx: NodeCtx) -> list:
    src = ctx.shape(0)
    if ctx.opset >= 5 and len(ctx.shape(1)) != 1:
        raise ctx.error(f"the shape input must be a 1-D tensor, got shape {list(ctx.shape(1))}")
    spec = ctx.ints(1) if ctx.opset >= 5 else list(ctx.attr("shape"))
    allowzero = int(ctx.attr("allowzero", 0))
    out = [src[d] if s == 0 and not allowzero and d < len(src) else s for d, s in enumerate(spec)]
    if out.count(-1) > 1:
        raise ctx.error(f"shape {spec} has more than one -1")
    if -1 in out:
        known = _prod(x for x in out if x != -1)
        if known == 0 or _prod(src) % known:
            raise ctx.error(f"cannot reshape {list(src)} to {spec}")
        out[out.index(-1)] = _prod(src) // known
    if _prod(out) != _prod(src) or any(x < 0 for x in out):
        raise ctx.error(f"cannot reshape {list(src)} ({_prod(src)} elements) to {spec}")
    return [Alias(0, tuple(out))]


@op("Flatten")
def flatten(ctx: NodeCtx) -> list:
    shp = ctx.shape(0)
    axis = int(ctx.attr("axis", 1))
    axis = axis + len(shp) if axis < 0 else axis
    if not 0 <= axis <= len(shp):
        raise ctx.error(f"axis {ctx.attr('axis')} is out of range for rank {len(shp)}")
    return [Alias(0, (_prod(shp[:axis]), _prod(shp[axis:])))]


def _axes(ctx: NodeCtx, since: int, i: int = 1) -> list[int] | None:
    if ctx.opset >= since:
        return ctx.ints(i) if ctx.has(i) else None
    a = ctx.attr("axes")
    return list(a) if a is not None else None


@op("Squeeze")
def squeeze(ctx: NodeCtx) -> list:
    shp = ctx.shape(0)
    axes = _axes(ctx, 13)
    if axes is None:
        keep = [d for d in shp if d != 1]
    else:
        ax = {norm_axis(ctx, a, len(shp)) for a in axes}
        for a in ax:
            if shp[a] != 1:
                raise ctx.error(f"cannot squeeze axis {a} of size {shp[a]}")
        keep = [d for k, d in enumerate(shp) if k not in ax]
    return [Alias(0, tuple(keep))]


@op("Unsqueeze")
def unsqueeze(ctx: NodeCtx) -> list:
    shp = list(ctx.shape(0))
    axes = _axes(ctx, 13)
    if axes is None:
        raise ctx.error("axes are required")
    rank = len(shp) + len(axes)
    ax = sorted(norm_axis(ctx, a, rank) for a in axes)
    if len(set(ax)) != len(ax):
        raise ctx.error(f"axes {axes} repeat an axis")
    for a in ax:
        shp.insert(a, 1)
    return [Alias(0, tuple(shp))]


# -- data movement ------------------------------------------------------------------------


@op("Transpose")
def transpose(ctx: NodeCtx) -> list:
    x = ctx.tensor(0)
    shp = ctx.shape(0)
    perm = [int(p) for p in ctx.attr("perm", list(range(len(shp)))[::-1])]
    if sorted(perm) != list(range(len(shp))):
        raise ctx.error(f"perm {perm} is not a permutation of the {len(shp)} axes")
    out = tuple(shp[p] for p in perm)

    def body(*i: Any) -> Any:
        src = [None] * len(shp)
        for k, p in enumerate(perm):
            src[p] = i[k]
        return x[tuple(src)]

    return [te.compute(out, body, name="transpose")]


@op("Concat")
def concat(ctx: NodeCtx) -> list:
    ins = [i for i in range(ctx.n_inputs) if ctx.has(i)]
    shapes = [ctx.shape(i) for i in ins]
    rank = len(shapes[0])
    axis = norm_axis(ctx, int(ctx.attr("axis", 0)), rank)
    for s in shapes:
        if len(s) != rank or any(a != b for d, (a, b) in enumerate(zip(s, shapes[0])) if d != axis):
            raise ctx.error(f"inputs of shapes {[list(x) for x in shapes]} cannot be joined on axis {axis}")
    parts = [(ctx.tensor(i), s[axis]) for i, s in zip(ins, shapes) if s[axis] > 0]
    out = list(shapes[0])
    out[axis] = sum(s[axis] for s in shapes)
    if not parts:
        return [np.zeros(out, ctx.dtype(ins[0]))]

    def body(*i: Any) -> Any:
        offs, acc = [], 0
        for _, n in parts:
            offs.append(acc)
            acc += n
        k = len(parts) - 1
        t, _ = parts[k]
        expr = t[tuple(i[:axis]) + (i[axis] - offs[k],) + tuple(i[axis + 1:])]
        for k in range(len(parts) - 2, -1, -1):
            t, n = parts[k]
            expr = te.if_then_else(i[axis] < offs[k] + n,
                                   t[tuple(i[:axis]) + (i[axis] - offs[k],) + tuple(i[axis + 1:])], expr)
        return expr

    return [te.compute(tuple(out), body, name="concat")]


@op("Split")
def split(ctx: NodeCtx) -> list:
    shp = ctx.shape(0)
    axis = norm_axis(ctx, int(ctx.attr("axis", 0)), len(shp))
    n_out = len(ctx.node.outputs)
    if ctx.opset >= 13 and ctx.has(1):
        sizes = ctx.ints(1)
    elif ctx.opset < 13 and ctx.attr("split") is not None:
        sizes = [int(s) for s in ctx.attr("split")]
    else:
        parts = int(ctx.attr("num_outputs", n_out))
        size = -(-shp[axis] // parts)
        sizes = [min(size, shp[axis] - k * size) for k in range(parts)]
    if sum(sizes) != shp[axis] or len(sizes) != n_out:
        raise ctx.error(f"split sizes {sizes} do not cover axis {axis} of size {shp[axis]} in {n_out} outputs")
    x = ctx.tensor(0)
    outs, off = [], 0
    for k, n in enumerate(sizes):
        shape = list(shp)
        shape[axis] = n

        def body(*i: Any, off: int = off) -> Any:
            return x[tuple(i[:axis]) + (i[axis] + off,) + tuple(i[axis + 1:])]

        outs.append(te.compute(tuple(shape), body, name=f"split{k}") if n else np.zeros(shape, ctx.dtype(0)))
        off += n
    return outs


@op("Slice")
def slice_(ctx: NodeCtx) -> list:
    shp = ctx.shape(0)
    if ctx.opset >= 10:
        starts, ends = ctx.ints(1), ctx.ints(2)
        axes = ctx.ints(3) if ctx.has(3) else list(range(len(starts)))
        steps = ctx.ints(4) if ctx.has(4) else [1] * len(starts)
    else:
        starts, ends = list(ctx.attr("starts")), list(ctx.attr("ends"))
        axes = list(ctx.attr("axes", range(len(starts))))
        steps = [1] * len(starts)
    begin = [0] * len(shp)
    step = [1] * len(shp)
    out = list(shp)
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = norm_axis(ctx, a, len(shp))
        n = shp[a]
        if st == 0:
            raise ctx.error("a slice step is 0")
        s = s + n if s < 0 else s
        e = e + n if e < 0 else e
        if st > 0:
            s, e = min(max(s, 0), n), min(max(e, 0), n)
            count = max(0, -(-(e - s) // st))
        else:
            s, e = min(max(s, -1), n - 1), min(max(e, -1), n - 1)
            count = max(0, -(-(s - e) // -st))
        begin[a], step[a], out[a] = s, st, count
    if _prod(out) == 0:
        return [np.zeros(out, ctx.dtype(0))]
    x = ctx.tensor(0)
    return [te.compute(tuple(out), lambda *i: x[tuple(b + st * ix for b, st, ix in zip(begin, step, i))],
                       name="slice")]


@op("Gather")
def gather(ctx: NodeCtx) -> list:
    shp, ishp = ctx.shape(0), ctx.shape(1)
    axis = norm_axis(ctx, int(ctx.attr("axis", 0)), len(shp))
    out = shp[:axis] + ishp + shp[axis + 1:]
    if _prod(out) == 0:
        return [np.zeros(out, ctx.dtype(0))]
    from cuvil.graph.ops.index import _check_known

    _check_known(ctx, 1, shp[axis])  # indices known now are checked now
    x, idx = ctx.tensor(0), ctx.tensor(1)
    n, r = shp[axis], len(ishp)

    def body(*i: Any) -> Any:
        k = idx[tuple(i[axis:axis + r])] if r else idx[()]
        k = ctx.index(k, n, 1)  # -n .. n-1, checked when the kernel runs
        return x[tuple(i[:axis]) + (k,) + tuple(i[axis + r:])]

    return [te.compute(out, body, name="gather")]


@op("Expand")
def expand(ctx: NodeCtx) -> list:
    out = broadcast_shapes(ctx, ctx.shape(0), tuple(ctx.ints(1)))
    x = ctx.tensor(0)
    return [te.compute(out, lambda *i: bcast_read(x, out, i), name="expand")]


@op("Tile")
def tile(ctx: NodeCtx) -> list:
    shp = ctx.shape(0)
    reps = ctx.ints(1)
    if len(reps) != len(shp):
        raise ctx.error(f"repeats {reps} do not match the rank {len(shp)}")
    out = tuple(d * r for d, r in zip(shp, reps))
    if _prod(out) == 0:
        return [np.zeros(out, ctx.dtype(0))]
    x = ctx.tensor(0)
    return [te.compute(out, lambda *i: x[tuple(ix % d if r != 1 else ix for ix, d, r in zip(i, shp, reps))],
                       name="tile")]


@op("Pad")
def pad(ctx: NodeCtx) -> list:
    shp = ctx.shape(0)
    rank = len(shp)
    mode = ctx.attr("mode", "constant")
    if isinstance(mode, bytes):
        mode = mode.decode()
    if ctx.opset >= 11:
        pads = ctx.ints(1)
        value = np.asarray(ctx.value(2)).reshape(-1)[0].item() if ctx.has(2) else 0
        axes = [norm_axis(ctx, a, rank) for a in ctx.ints(3)] if ctx.has(3) else list(range(rank))
    else:
        pads = [int(p) for p in ctx.attr("pads")]
        value = float(ctx.attr("value", 0.0))
        axes = list(range(rank))
    if len(pads) != 2 * len(axes):
        raise ctx.error(f"pads {pads} need two entries per padded axis ({len(axes)})")
    lo, hi = [0] * rank, [0] * rank
    for k, a in enumerate(axes):
        lo[a], hi[a] = pads[k], pads[k + len(axes)]
    out = tuple(d + a + b for d, a, b in zip(shp, lo, hi))
    if any(d < 0 for d in out):
        raise ctx.error(f"pads {pads} remove more than the input {list(shp)} has")
    if _prod(out) == 0:
        return [np.zeros(out, ctx.dtype(0))]
    if mode not in ("constant", "edge", "reflect", "wrap"):
        raise ctx.unsupported(f"mode {mode!r}")
    if mode != "constant" and any(d == 0 for d in shp):
        raise ctx.error(f"mode {mode!r} cannot pad an empty input")
    x = ctx.tensor(0)
    fill = te.const(value, ctx.dtype(0))

    def body(*i: Any) -> Any:
        src, inside = [], []
        for d in range(rank):
            j = i[d] - lo[d]
            n = shp[d]
            if lo[d] == 0 and hi[d] <= 0:
                src.append(j)
            elif mode == "constant":
                src.append(j)
                inside += ([j >= 0] if lo[d] > 0 else []) + ([j < n] if hi[d] > 0 else [])
            elif mode == "edge":
                src.append(te.max(te.min(j, te.const(n - 1, "int64")), te.const(0, "int64")))
            elif mode == "wrap":
                src.append(j % n)
            else:  # reflect: ... 2 1 | 0 1 2 ... n-1 | n-2 ...
                p = 2 * (n - 1) if n > 1 else 1
                m = j % p
                src.append(te.if_then_else(m < n, m, te.const(p, "int64") - m) if n > 1 else j * 0)
        v = x[tuple(src)]
        return te.if_then_else(te.all(*inside), v, fill) if inside else v

    return [te.compute(out, body, name="pad")]


# -- values known at compile time ----------------------------------------------------------


@op("Shape")
def shape(ctx: NodeCtx) -> list:
    shp = ctx.shape(0)
    start, end = int(ctx.attr("start", 0)), ctx.attr("end")
    return [np.array(shp[start:None if end is None else int(end)], np.int64)]


@op("Size")
def size(ctx: NodeCtx) -> list:
    return [np.array(_prod(ctx.shape(0)), np.int64)]


def constant_value(a: dict[str, Any]) -> np.ndarray | None:
    """The value of a ``Constant`` node with attributes ``a``; None for string and sparse constants."""
    if "value" in a:
        return np.asarray(a["value"])
    if "value_float" in a:
        return np.array(a["value_float"], np.float32)
    if "value_floats" in a:
        return np.array(a["value_floats"], np.float32)
    if "value_int" in a:
        return np.array(a["value_int"], np.int64)
    if "value_ints" in a:
        return np.array(a["value_ints"], np.int64)
    return None


@op("Constant")
def constant(ctx: NodeCtx) -> list:
    v = constant_value(ctx.node.attrs)
    if v is None:
        raise ctx.unsupported(f"attributes {sorted(ctx.node.attrs)} (string and sparse constants are not supported)")
    return [v]


@op("ConstantOfShape")
def constant_of_shape(ctx: NodeCtx) -> list:
    v = ctx.attr("value")
    v = np.asarray(v).reshape(-1) if v is not None else np.zeros(1, np.float32)
    shape = ctx.ints(0)
    if any(d < 0 for d in shape):
        raise ctx.error(f"negative dimension in {shape}")
    return [np.full(shape, v[0], v.dtype)]


@op("Range")
def range_(ctx: NodeCtx) -> list:
    start, limit, delta = (np.asarray(ctx.value(i)).reshape(-1)[0].item() for i in range(3))
    if delta == 0:
        raise ctx.error("delta is 0")
    n = max(int(np.ceil((limit - start) / delta)), 0)
    dtype = ctx.dtype(0)
    if n == 0:
        return [np.zeros(0, dtype)]
    s, d = ctx.tensor(0), ctx.tensor(2)
    return [te.compute((n,), lambda i: s[()] + te.cast(i, dtype) * d[()], name="range")]
