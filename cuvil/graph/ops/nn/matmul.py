"""ONNX Gemm and MatMul in float: constant weights packed at compile time into panels of the
target's width (:meth:`cuvil.target.Target.panel_width`), shared by the nodes that read the same
array (``_PANELS``), and bf16 panels where the precision asks for them."""

from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np

from cuvil import te
from cuvil.cache import BoundedCache
from cuvil.graph.ops.base import NodeCtx, Shaped, bcast_read, broadcast_shapes, op
from cuvil.graph.ops.nn import bf16
from cuvil.te.tensor import Tensor


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
_PANELS: BoundedCache[tuple, tuple[Any, np.ndarray]] = BoundedCache("cuvil.graph.ops.nn.matmul._PANELS", 1024)


def _weight_panels(ctx: NodeCtx, w: np.ndarray, source: Any = None, how: Any = None) -> Any:
    """Constant weights ``W[k, j]`` packed at compile time into panels ``[j // P, k, j % P]`` (P = two
    vectors of the target, the auto-scheduler's tile width), as a read function ``(k, j) -> W[k, j]``;
    None when the weights are too narrow for one panel or the target is not a CPU.

    ``source`` (the graph's array ``w`` was taken from, by ``how``) packs it once for every node
    that reads it (an unrolled LSTM's 64 steps): one packing, and one constant buffer in the module."""
    tgt = ctx.target
    if tgt is None or getattr(tgt, "kind", "") != "llvm" or w.ndim != 2:
        return None
    p = tgt.panel_width(w.dtype.itemsize)
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
