"""A small operator library written in te (matmul, conv2d, padding, relu).

Each function returns the output tensor; intermediate stages (the padded
input of a convolution) are ordinary computes that a schedule may inline.
"""

from __future__ import annotations

from cuvil import te
from cuvil.errors import ShapeError
from cuvil.ir.simplify import simplify_expr
from cuvil.te.tensor import Tensor


def matmul(A: Tensor, B: Tensor, name: str = "C") -> Tensor:
    """``C[i, j] = sum_k A[i, k] * B[k, j]``."""
    (M, K), (K2, N) = A.shape, B.shape
    if not te.structural_equal(K, K2):
        raise ShapeError(f"matmul {name}: A has {K} columns but B has {K2} rows")
    k = te.reduce_axis((0, K), name="k")
    return te.compute((M, N), lambda i, j: te.sum(A[i, k] * B[k, j], axis=k), name=name)


def pad(X: Tensor, pads: tuple[int, ...], value: float = 0.0, name: str = "pad") -> Tensor:
    """Pad the last ``len(pads)`` dimensions of ``X`` by ``pads[d]`` on both sides."""
    lead = X.ndim - len(pads)
    shape = list(X.shape[:lead]) + [simplify_expr(X.shape[lead + d] + 2 * p) for d, p in enumerate(pads)]

    def body(*idx):
        inside = [idx[lead + d] >= p for d, p in enumerate(pads) if p] + [
            idx[lead + d] < X.shape[lead + d] + p for d, p in enumerate(pads) if p
        ]
        src = list(idx[:lead]) + [idx[lead + d] - p for d, p in enumerate(pads)]
        if not inside:
            return X[tuple(src)]
        return te.if_then_else(te.all(*inside), X[tuple(src)], te.const(value, X.dtype))

    return te.compute(tuple(shape), body, name=name)


def conv2d_nchw(X: Tensor, W: Tensor, stride: int = 1, padding: int = 0, dilation: int = 1,
                groups: int = 1, name: str = "conv") -> Tensor:
    """2-D convolution, NCHW input, OIHW weights (``I = C / groups``)."""
    N, C, H, Wd = X.shape
    F, Cg, KH, KW = W.shape
    kh_, kw_, cg_ = _const(KH), _const(KW), _const(Cg)
    if kh_ is None or kw_ is None or cg_ is None:
        raise ShapeError(f"conv2d {name}: kernel sizes and input channels per group must be constants")
    Xp = pad(X, (padding, padding), name=f"{name}_pad") if padding else X
    OH = simplify_expr((H + 2 * padding - dilation * (kh_ - 1) - 1) // stride + 1)
    OW = simplify_expr((Wd + 2 * padding - dilation * (kw_ - 1) - 1) // stride + 1)
    fpg = _const(F)
    per_group = fpg // groups if fpg is not None else None
    rc = te.reduce_axis((0, cg_), name="rc")
    ry = te.reduce_axis((0, kh_), name="ry")
    rx = te.reduce_axis((0, kw_), name="rx")
    if groups > 1 and per_group is not None and per_group > 1:
        # the group as an axis of its own: a batched contraction (filters of one group x pixels),
        # then the [N, G, F/G, OH, OW] result read as [N, F, OH, OW] (the same element order)
        def grouped(n, g, f, y, x):
            return te.sum(Xp[n, g * cg_ + rc, y * stride + ry * dilation, x * stride + rx * dilation]
                          * W[g * per_group + f, rc, ry, rx], axis=[rc, ry, rx])

        Y5 = te.compute((N, groups, per_group, OH, OW), grouped, name=f"{name}_groups")
        return te.compute((N, F, OH, OW), lambda n, f, y, x: Y5[n, f // per_group, f % per_group, y, x], name=name)

    def body(n, f, y, x):
        c = rc if groups == 1 else (f // per_group) * cg_ + rc
        return te.sum(Xp[n, c, y * stride + ry * dilation, x * stride + rx * dilation] * W[f, rc, ry, rx],
                      axis=[rc, ry, rx])

    return te.compute((N, F, OH, OW), body, name=name)


def relu(X: Tensor, name: str = "relu") -> Tensor:
    return te.compute(X.shape, lambda *i: te.max(X[i], te.const(0, X.dtype)), name=name)


def _const(e: object) -> int | None:
    from cuvil.ir.expr import Const

    return int(e.value) if isinstance(e, Const) else None
