"""The ATen -> graph IR table, part 2: data movement, indexing and tensor creation (see
:mod:`cuvil.frontend.torch_ops` for the translations' contract).  Sizes may be symbolic: a list of
sizes holding a :class:`~cuvil.frontend.torch.Sym` becomes a Concat of them (``Builder.ints``)."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from cuvil.errors import UnsupportedOpError
from cuvil.frontend.torch import Builder, Sym, node_meta, torch_dtype_name
from cuvil.frontend.torch_ops import _axis, _dt, _rank, _shape, aten

_BIG = 2**62


def _static(vals: Any) -> bool:
    return all(isinstance(v, (int, np.integer)) for v in vals)


@aten("view.default", "_unsafe_view.default", "view_copy.default")
def _view(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    return b.one("Reshape", [args[0], b.ints(args[1])], _dt(n))


@aten("expand.default", "expand_copy.default")
def _expand(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    sizes = [1 if (isinstance(s, int) and s == -1) else s for s in args[1]]
    return b.one("Expand", [args[0], b.ints(sizes)], _dt(n))


@aten("permute.default", "permute_copy.default")
def _permute(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    rank = _rank(n.args[0])
    return b.one("Transpose", [args[0]], _dt(n), perm=[_axis(d, rank) for d in args[1]])


@aten("transpose.int", "t.default")
def _transpose(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    rank = _rank(n.args[0])
    d0, d1 = (args[1], args[2]) if len(args) > 2 else (0, 1)
    perm = list(range(rank))
    if rank >= 2:
        a, c = _axis(d0, rank), _axis(d1, rank)
        perm[a], perm[c] = perm[c], perm[a]
    return b.one("Transpose", [args[0]], _dt(n), perm=perm)


@aten("unsqueeze.default", "unsqueeze_copy.default")
def _unsqueeze(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    return b.one("Unsqueeze", [args[0], b.const([_axis(args[1], _rank(n.args[0]) + 1)], "int64")], _dt(n))


@aten("squeeze.dims", "squeeze.dim", "squeeze.default", "squeeze_copy.dims")
def _squeeze(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    shape, rank = _shape(n.args[0]), _rank(n.args[0])
    dims = args[1] if len(args) > 1 else [d for d in range(rank) if shape[d] == 1]
    dims = [dims] if isinstance(dims, int) else list(dims)
    dims = [_axis(d, rank) for d in dims if shape[_axis(d, rank)] == 1]  # torch skips dims that are not 1
    if not dims:
        return b.one("Identity", [args[0]], _dt(n))
    return b.one("Squeeze", [args[0], b.const(dims, "int64")], _dt(n))


@aten("cat.default", "concat.default")
def _cat(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dt = _dt(n)
    dim = args[1] if len(args) > 1 else kw.get("dim", 0)
    rank = _rank(n)
    parts = [b.tensor(t, dt) for t, a in zip(args[0], n.args[0]) if node_meta(a).shape != (0,) or rank == 1]
    if len(parts) == 1:  # a cache's first append (torch.cat([empty, past])): no copy
        return b.one("Identity", parts, dt)
    return b.one("Concat", parts, dt, axis=_axis(dim, rank))


@aten("split_with_sizes.default", "split.Tensor", "split_with_sizes_copy.default", "unbind.int")
def _split(b: Builder, n: Any, args: tuple, kw: dict) -> tuple:
    shape, rank = _shape(n.args[0]), _rank(n.args[0])
    name = str(n.target)
    dim = _axis(args[2] if len(args) > 2 else kw.get("dim", 0), rank) if "unbind" not in name else \
        _axis(args[1] if len(args) > 1 else kw.get("dim", 0), rank)
    total = shape[dim]
    if not isinstance(total, int):
        raise UnsupportedOpError(f"splitting a symbolic dimension ({total})")
    if "unbind" in name:
        sizes = [1] * total
    elif "split.Tensor" in name:
        step = args[1]
        sizes = [min(step, total - s) for s in range(0, total, step)] or [0]
    else:
        sizes = list(args[1])
    dt = _dt(n)
    outs = b.emit("Split", [args[0], b.const(sizes, "int64")], dt, len(sizes), axis=dim)
    if "unbind" in name:
        outs = [b.one("Squeeze", [o, b.const([dim], "int64")], dt) for o in outs]
    return tuple(outs)


@aten("slice.Tensor", "slice_copy.Tensor")
def _slice(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    rank = _rank(n.args[0])
    dim = _axis(args[1] if len(args) > 1 else 0, rank)
    start = args[2] if len(args) > 2 and args[2] is not None else 0
    end = args[3] if len(args) > 3 and args[3] is not None else _BIG
    step = args[4] if len(args) > 4 else 1
    if isinstance(end, int) and end >= sys.maxsize:
        end = _BIG
    if isinstance(start, int) and isinstance(end, int) and start == 0 and end >= _BIG and step == 1:
        return b.one("Identity", [args[0]], _dt(n))
    return b.one("Slice", [args[0], b.ints([start]), b.ints([end]), b.const([dim], "int64"),
                           b.const([step], "int64")], _dt(n))


@aten("select.int", "select_copy.int")
def _select(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dim = _axis(args[1], _rank(n.args[0]))
    index = b.tensor(args[2], "int64") if isinstance(args[2], Sym) else b.const(int(args[2]), "int64")
    return b.one("Gather", [args[0], index], _dt(n), axis=dim)


@aten("index_select.default")
def _index_select(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    return b.one("Gather", [args[0], b.tensor(args[2], "int64")], _dt(n), axis=_axis(args[1], _rank(n.args[0])))


@aten("embedding.default")
def _embedding(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    return b.one("Gather", [args[0], b.tensor(args[1], "int64")], _dt(n), axis=0)


@aten("gather.default")
def _gather(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    return b.one("GatherElements", [args[0], b.tensor(args[2], "int64")], _dt(n),
                 axis=_axis(args[1], _rank(n.args[0])))


def _scatter(b: Builder, n: Any, x: Any, dim: int, index: Any, src: Any, reduction: str) -> str:
    """``ScatterElements(x, index, src)`` along ``dim``: torch reads ``src`` only where ``index`` has
    elements (``src`` may be larger in any dimension: its leading corner is sliced off); a number as
    ``src`` is a constant of the index's shape."""
    dt = _dt(n)
    rank = _rank(n.args[0])
    dim = _axis(dim, rank)
    idx = b.tensor(index, "int64")
    ishape = _shape(n.args[2])
    if isinstance(src, (bool, int, float)):
        src = b.one("Expand", [b.const(src, dt), b.one("Shape", [idx], "int64")], dt)
    else:
        src = b.tensor(src, dt)
        if _shape(n.args[3]) != ishape:
            src = b.one("Slice", [src, b.const([0] * rank, "int64"), b.one("Shape", [idx], "int64"),
                                  b.const(list(range(rank)), "int64")], dt)
    return b.one("ScatterElements", [b.tensor(x, dt), idx, src], dt, axis=dim, reduction=reduction)


_SCATTER_REDUCE = {"sum": "add", "add": "add", "prod": "mul", "multiply": "mul", "amax": "max", "amin": "min"}


@aten("scatter_add.default")
def _scatter_add(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    return _scatter(b, n, args[0], args[1], args[2], args[3], "add")


@aten("scatter.src", "scatter.value", "scatter.reduce", "scatter.value_reduce")
def _scatter_op(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    """``x.scatter(dim, index, src)`` (``reduce="add" | "multiply"`` accumulates)."""
    reduce = args[4] if len(args) > 4 else kw.get("reduce")
    return _scatter(b, n, args[0], args[1], args[2], args[3], _SCATTER_REDUCE[reduce] if reduce else "none")


@aten("scatter_reduce.two")
def _scatter_reduce(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    """``x.scatter_reduce(dim, index, src, reduce, include_self)`` for sum, prod, amax and amin.  Without
    ``include_self`` the positions that receive an update first take the reduction's identity (0, 1,
    -inf, +inf), then every update combines with it in order."""
    reduce = args[4]
    include_self = args[5] if len(args) > 5 else kw.get("include_self", True)
    if reduce not in _SCATTER_REDUCE:
        raise UnsupportedOpError(f"scatter_reduce with reduce={reduce!r} (sum, prod, amax and amin are translated)")
    x = args[0]
    if not include_self:
        dt = _dt(n)
        big = float("inf") if dt.startswith("float") else np.iinfo(dt).max if dt != "bool" else 1
        identity = {"sum": 0, "prod": 1, "amax": -big, "amin": big}[reduce]
        identity = float(identity) if dt.startswith("float") else int(identity)
        x = _scatter(b, n, x, args[1], args[2], identity, "none")
    return _scatter(b, n, x, args[1], args[2], args[3], _SCATTER_REDUCE[reduce])


@aten("index_add.default")
def _index_add(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    """``x.index_add(dim, index, source, alpha=a)``: ``x[..., index[i], ...] += a * source[..., i, ...]``,
    a ScatterElements whose indices are ``index`` along ``dim`` expanded to the source's shape."""
    dt = _dt(n)
    x, dim, index, source = args[:4]
    alpha = args[4] if len(args) > 4 else kw.get("alpha", 1)
    rank = _rank(n.args[0])
    dim = _axis(dim, rank)
    src = b.tensor(source, dt)
    if alpha != 1:
        src = b.one("Mul", [src, b.tensor(alpha, dt)], dt)
    if rank == 0:
        return b.one("Add", [b.tensor(x, dt), src], dt)
    col = [1] * rank
    col[dim] = -1
    idx = b.one("Reshape", [b.tensor(index, "int64"), b.const(col, "int64")], "int64")
    idx = b.one("Expand", [idx, b.one("Shape", [src], "int64")], "int64")
    return b.one("ScatterElements", [b.tensor(x, dt), idx, src], dt, axis=dim, reduction="add")


@aten("index_put.default")
def _index_put(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    """``x[..., i0, i1, ...] = v`` (``+=`` with ``accumulate``, what ``index_add`` decomposes to) with index
    tensors on adjacent dimensions (``None`` for a whole one): a ScatterND whose indices are the index
    tensors broadcast to one shape and stacked, on ``x`` with the indexed dimensions moved to the front,
    its updates ``v`` broadcast to the shape ``x[..., i0, i1, ...]`` has, moved the same way."""
    x, indices, values = args[0], list(args[1]), args[2]
    accumulate = bool(args[3] if len(args) > 3 else kw.get("accumulate", False))
    dt = _dt(n)
    rank = _rank(n.args[0])
    at = [k for k, i in enumerate(indices) if i is not None]
    if not at or at != list(range(at[0], at[-1] + 1)):
        raise UnsupportedOpError("index_put with index tensors on dimensions that are not adjacent")
    if any(node_meta(n.args[1][k]).dtype.is_floating_point or str(node_meta(n.args[1][k]).dtype) == "torch.bool"
           for k in at):
        raise UnsupportedOpError("index_put with boolean or floating index tensors (masks)")
    bshape = _broadcast([_shape(n.args[1][k]) for k in at])
    if not _static(bshape):
        raise UnsupportedOpError("index_put with index tensors of symbolic sizes")
    xs = _shape(n.args[0])
    first, nb = at[0], len(bshape)
    idx = [b.one("Unsqueeze", [b.one("Expand", [b.tensor(indices[k], "int64"), b.ints(bshape)], "int64"),
                               b.const([-1], "int64")], "int64") for k in at]
    stacked = idx[0] if len(idx) == 1 else b.one("Concat", idx, "int64", axis=-1)
    picked = list(xs[:first]) + list(bshape) + list(xs[at[-1] + 1:])  # the shape of x[..., i0, i1, ...]
    upd = b.one("Expand", [b.tensor(values, dt), b.ints(picked)], dt)
    data = b.tensor(x, dt)
    if first:  # the indexed dimensions (of x, and the index block of the updates) first
        data = b.one("Transpose", [data], dt, perm=at + [d for d in range(rank) if d not in at])
        upd = b.one("Transpose", [upd], dt, perm=list(range(first, first + nb)) + list(range(first))
                    + list(range(first + nb, len(picked))))
    out = b.one("ScatterND", [data, stacked, upd], dt, reduction="add" if accumulate else "none")
    if first:
        order = at + [d for d in range(rank) if d not in at]
        out = b.one("Transpose", [out], dt, perm=[order.index(d) for d in range(rank)])
    return out


@aten("index.Tensor")
def _index(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    """``x[i0, i1, ...]`` with index tensors on adjacent dimensions (``None`` for a whole dimension): one
    index is a Gather; several, broadcast to one shape and stacked, a GatherND over the dimensions
    moved to the front."""
    x, indices = args[0], list(args[1])
    dt = _dt(n)
    rank = _rank(n.args[0])
    at = [k for k, i in enumerate(indices) if i is not None]
    if not at or at != list(range(at[0], at[-1] + 1)):
        raise UnsupportedOpError("index tensors on dimensions that are not adjacent")
    if any(node_meta(n.args[1][k]).dtype.is_floating_point or str(node_meta(n.args[1][k]).dtype) == "torch.bool"
           for k in at):
        raise UnsupportedOpError("boolean or floating index tensors (masks)")
    if len(at) == 1:
        return b.one("Gather", [x, b.tensor(indices[at[0]], "int64")], dt, axis=at[0])
    first = at[0]
    if first:
        perm = list(range(first, first + len(at))) + [d for d in range(rank) if d not in at]
        x = b.one("Transpose", [x], dt, perm=perm)
    bshape = _broadcast([_shape(n.args[1][k]) for k in at])
    idx = [b.tensor(indices[k], "int64") for k in at]
    if _static(bshape):
        to = b.ints(bshape)
    else:  # the broadcast shape, symbolic sizes included, is the shape of the indices' sum
        total = idx[0]
        for i in idx[1:]:
            total = b.one("Add", [total, i], "int64")
        to = b.one("Shape", [total], "int64")
    stacked = [b.one("Unsqueeze", [b.one("Expand", [i, to], "int64"), b.const([-1], "int64")], "int64")
               for i in idx]
    y = b.one("GatherND", [x, b.one("Concat", stacked, "int64", axis=-1)], dt)
    if first:
        nb, rest = len(bshape), rank - len(at)
        perm = list(range(nb, nb + first)) + list(range(nb)) + list(range(nb + first, nb + rest))
        y = b.one("Transpose", [y], dt, perm=perm)
    return y


def _broadcast(shapes: list[tuple]) -> tuple:
    rank = max(len(s) for s in shapes)
    out = []
    for d in range(rank):
        sizes = {s[d - rank + len(s)] for s in shapes if d - rank + len(s) >= 0}
        sizes.discard(1)
        if len(sizes) > 1 and all(isinstance(x, int) for x in sizes):
            raise UnsupportedOpError(f"index tensors of shapes {shapes} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


# -- creating tensors -------------------------------------------------------------------------


def _created_dtype(n: Any, kw: dict) -> str:
    return torch_dtype_name(kw["dtype"]) if kw.get("dtype") is not None else _dt(n)


@aten("full.default", "zeros.default", "ones.default", "empty.memory_format", "new_zeros.default",
      "new_ones.default", "new_full.default", "new_empty.default")
def _full(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    name = str(n.target)
    dt = _dt(n)
    if name.startswith("aten.new_"):
        sizes, fill = args[1], (args[2] if "full" in name else (1 if "ones" in name else 0))
    else:
        sizes = args[0]
        fill = args[1] if "full" in name else (1 if "ones" in name else 0)
    if _static(sizes) and not isinstance(fill, (str, Sym)):
        return b.const(np.full([int(s) for s in sizes], fill, dt))
    value = np.array([fill], dt) if not isinstance(fill, (str, Sym)) else None
    if value is None:
        return b.one("Expand", [b.tensor(fill, dt), b.ints(sizes)], dt)
    return b.one("ConstantOfShape", [b.ints(sizes)], dt, value=value)


@aten("full_like.default", "zeros_like.default", "ones_like.default", "empty_like.default")
def _full_like(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    name = str(n.target)
    dt = _dt(n)
    fill = args[1] if "full_like" in name else (1 if "ones" in name else 0)
    shape = _shape(n.args[0])
    if _static(shape) and not isinstance(fill, (str, Sym)):
        return b.const(np.full(shape, fill, dt))
    return b.one("Expand", [b.tensor(fill, dt), b.one("Shape", [args[0]], "int64")], dt)


@aten("scalar_tensor.default")
def _scalar_tensor(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    return b.tensor(args[0], _dt(n))


@aten("arange.start_step", "arange.default", "arange.start")
def _arange(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dt = _dt(n)
    name = str(n.target)
    if name == "aten.arange.default":
        start, end, step = 0, args[0], 1
    else:
        start, end = args[0], args[1]
        step = args[2] if len(args) > 2 else kw.get("step", 1)
    if not any(isinstance(v, (Sym, str)) for v in (start, end, step)):
        return b.const(np.arange(start, end, step, dtype=dt))
    return b.one("Range", [b.tensor(start, dt), b.tensor(end, dt), b.tensor(step, dt)], dt)


@aten("constant_pad_nd.default")
def _pad(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dt = _dt(n)
    rank = _rank(n.args[0])
    pad = list(args[1])
    value = args[2] if len(args) > 2 else 0
    begins, ends = [0] * rank, [0] * rank
    for k in range(len(pad) // 2):
        begins[rank - 1 - k], ends[rank - 1 - k] = pad[2 * k], pad[2 * k + 1]
    if any(p < 0 for p in begins + ends):
        raise UnsupportedOpError("negative padding (cropping)")
    return b.one("Pad", [args[0], b.const(begins + ends, "int64"), b.const(value, dt)], dt, mode="constant")


@aten("upsample_nearest2d.vec", "upsample_nearest2d.default", "upsample_bilinear2d.vec",
      "upsample_bilinear2d.default", "upsample_nearest1d.vec", "upsample_nearest3d.vec")
def _upsample(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dt = _dt(n)
    out = _shape(n)
    if not _static(out):
        raise UnsupportedOpError("resizing to a symbolic size")
    name = str(n.target)
    attrs: dict[str, Any] = {"mode": "nearest", "coordinate_transformation_mode": "asymmetric",
                             "nearest_mode": "floor"}
    align = False
    if "bilinear" in name:
        align = bool(args[2]) if len(args) > 2 else bool(kw.get("align_corners", False))
        attrs = {"mode": "linear", "coordinate_transformation_mode":
                 "align_corners" if align else "pytorch_half_pixel"}
    # scale factors given: torch maps output to input positions by them (1 / scale), not by the sizes' ratio
    first = 3 if "bilinear" in name else 2
    if name.endswith(".vec"):
        scales = args[first] if len(args) > first else kw.get("scale_factors")
    else:  # scales_h, scales_w: one argument per resized dimension
        scales = list(args[first:]) if any(v is not None for v in args[first:]) else None
    if scales is not None and any(v is None for v in scales):
        raise UnsupportedOpError("a scale factor for some of the resized dimensions only")
    if scales is None or align:
        return b.one("Resize", [args[0], "", "", b.const(list(out), "int64")], dt, **attrs)
    shape = _shape(n.args[0])
    factors = np.array([1.0, 1.0] + [float(v) for v in scales], np.float32)
    if not _static(shape) or [int(np.floor(d * f)) for d, f in zip(shape, factors.astype(np.float64))] != list(out):
        raise UnsupportedOpError(f"resizing {list(shape)} to {list(out)} by the scale factors {list(scales)}")
    return b.one("Resize", [args[0], "", b.const(factors)], dt, **attrs)


@aten("repeat.default")
def _repeat(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dt = _dt(n)
    reps = list(args[1])
    x, rank = args[0], _rank(n.args[0])
    if len(reps) > rank:
        x = b.one("Reshape", [x, b.ints([1] * (len(reps) - rank) + list(_shape(n.args[0])))], dt)
    return b.one("Tile", [x, b.ints(reps)], dt)


@aten("tril.default", "triu.default")
def _trilu(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    k = args[1] if len(args) > 1 else kw.get("diagonal", 0)
    return b.one("Trilu", [args[0], b.const(int(k), "int64")], _dt(n), upper=int("triu" in str(n.target)))


@aten("cumsum.default")
def _cumsum(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dt = _dt(n)
    return b.one("CumSum", [b.tensor(args[0], dt), b.const(_axis(args[1], _rank(n.args[0])), "int64")], dt)


@aten("flip.default")
def _flip(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    shape, rank = _shape(n.args[0]), _rank(n.args[0])
    dims = [_axis(d, rank) for d in args[1]]
    return b.one("Slice", [args[0], b.const([-1] * len(dims), "int64"), b.const([-_BIG] * len(dims), "int64"),
                           b.const(dims, "int64"), b.const([-1] * len(dims), "int64")], _dt(n)) if dims else \
        b.one("Identity", [args[0]], _dt(n)) if shape is not None else args[0]


@aten("as_strided.default", "as_strided_copy.default")
def _as_strided(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    """A view of the input's storage with other sizes and strides.  The same sizes and the input's own
    strides (size-1 dimensions aside: a change of memory format) are the input; on a contiguous input
    of static shape, the elements it reads are a Gather of constant positions."""
    x, size, stride = args[0], list(args[1]), list(args[2])
    offset = args[3] if len(args) > 3 and args[3] is not None else kw.get("storage_offset", 0) or 0
    m = node_meta(n.args[0])
    dt = _dt(n)
    if not (_static(size) and _static(stride) and _static(m.shape)):
        raise UnsupportedOpError("as_strided with symbolic sizes")
    own = [int(s) for s in m.stride()]
    if offset == 0 and size == [int(d) for d in m.shape] and all(d == 1 or s == o for d, s, o in
                                                                  zip(size, stride, own)):
        return b.one("Identity", [x], dt)
    if not m.is_contiguous():
        raise UnsupportedOpError("as_strided of a value whose layout is not contiguous")
    pos = np.full(size, int(offset), np.int64)
    for d, (sz, st) in enumerate(zip(size, stride)):
        pos = pos + (np.arange(sz, dtype=np.int64) * st).reshape([sz if k == d else 1 for k in range(len(size))])
    flat = b.one("Reshape", [x, b.const([-1], "int64")], dt)
    return b.one("Gather", [flat, b.const(pos)], dt, axis=0)
