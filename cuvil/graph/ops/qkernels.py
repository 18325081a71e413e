"""Integer contractions for quantized models: ``int_matmul`` and ``int_conv``.

Both compute exact int32 sums of products of 8-bit integers (uint8 or int8, any mix); the callers (the
quantized ONNX operators) apply zero points, bias and requantization around them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cuvil import te
from cuvil.errors import DTypeError, ShapeError
from cuvil.graph.ops.base import NodeCtx, t_shape
from cuvil.te.tensor import Tensor

INT8_TYPES = ("uint8", "int8")


def _check_int8(what: str, dtype: str) -> None:
    if dtype not in INT8_TYPES:
        raise DTypeError(f"{what} is {dtype}; an integer contraction takes uint8 or int8")


def _i32(x: Any) -> Any:
    return te.cast(x, "int32")


def int_matmul(ctx: NodeCtx, a: Tensor, w: Tensor | np.ndarray, name: str = "qmatmul") -> Tensor:
    """``[..., N] int32 = sum_k int32(a[..., k]) * int32(w[k, n])``, exact for every signedness mix.

    ``w`` is a compile-time constant (numpy) or a te tensor (activation x activation)."""
    a_s = t_shape(a)
    _check_int8(f"{ctx.node}: the activation of {name}", a.dtype)
    if isinstance(w, np.ndarray):
        _check_int8(f"{ctx.node}: the weights of {name}", w.dtype.name)
        w_s = tuple(int(d) for d in w.shape)
    else:
        _check_int8(f"{ctx.node}: the weights of {name}", w.dtype)
        w_s = t_shape(w)
    if len(a_s) < 1 or len(w_s) != 2 or a_s[-1] != w_s[0]:
        raise ShapeError(f"{ctx.node}: {name} takes a [..., K] activation and [K, N] weights; got "
                         f"{list(a_s)} and {list(w_s)}")
    W = ctx.constant(np.ascontiguousarray(w), keyed=False) if isinstance(w, np.ndarray) else w
    k = te.reduce_axis((0, w_s[0]), name="k")
    out = a_s[:-1] + (w_s[1],)
    return te.compute(out, lambda *i: te.sum(_i32(a[i[:-1] + (k,)]) * _i32(W[k, i[-1]]), axis=k), name=name)


def int_conv(ctx: NodeCtx, x: Tensor, w: np.ndarray, strides: Sequence[int], dilations: Sequence[int],
             pads_begin: Sequence[int], pads_end: Sequence[int], group: int, name: str = "qconv",
             pad_value: int = 0) -> Tensor:
    """The exact int32 convolution of ``x`` (NC spatial..., uint8/int8) with constant ``w``
    ``[O, C/group, k...]`` (uint8/int8); the padding reads ``pad_value`` (a quantized conv pads with the
    input's zero point). The output is N O spatial..., int32."""
    xs = t_shape(x)
    _check_int8(f"{ctx.node}: the input of {name}", x.dtype)
    w = np.asarray(w)
    _check_int8(f"{ctx.node}: the weights of {name}", w.dtype.name)
    n_sp = len(xs) - 2
    if n_sp < 1 or w.ndim != len(xs):
        raise ShapeError(f"{ctx.node}: {name} takes an input (N, C, ...) and weights (O, C/group, ...); got "
                         f"{list(xs)} and {list(w.shape)}")
    g = int(group)
    if g < 1 or xs[1] != w.shape[1] * g or w.shape[0] % g:
        raise ShapeError(f"{ctx.node}: {xs[1]} input channels do not fit weights {list(w.shape)} with group={g}")
    lo, hi = np.iinfo(x.dtype).min, np.iinfo(x.dtype).max
    if not lo <= int(pad_value) <= hi:
        raise ShapeError(f"{ctx.node}: the pad value {pad_value} of {name} does not fit {x.dtype}")
    for what, v in (("strides", strides), ("dilations", dilations), ("pads_begin", pads_begin),
                    ("pads_end", pads_end)):
        if len(v) != n_sp:
            raise ShapeError(f"{ctx.node}: {name} has {n_sp} spatial dimensions but {what} {list(v)}")
    kernel = [int(d) for d in w.shape[2:]]
    out = []
    for d in range(n_sp):
        full = xs[2 + d] + pads_begin[d] + pads_end[d] - dilations[d] * (kernel[d] - 1) - 1
        if full < 0 or strides[d] < 1 or dilations[d] < 1:
            raise ShapeError(f"{ctx.node}: the window of {name} does not fit the padded input in dimension {d}")
        out.append(full // strides[d] + 1)
    X = x
    if any(pads_begin) or any(pads_end):
        pshape = xs[:2] + tuple(xs[2 + d] + pads_begin[d] + pads_end[d] for d in range(n_sp))

        def pad_body(*i: Any) -> Any:
            inside = [c for d in range(n_sp) for c in (i[2 + d] >= pads_begin[d], i[2 + d] < xs[2 + d] + pads_begin[d])]
            src = tuple(i[:2]) + tuple(i[2 + d] - pads_begin[d] for d in range(n_sp))
            return te.if_then_else(te.all(*inside), x[src], te.const(int(pad_value), x.dtype))

        X = te.compute(pshape, pad_body, name=f"{name}_pad")
    W = ctx.constant(np.ascontiguousarray(w), keyed=False)
    cg, per_group = w.shape[1], w.shape[0] // g
    rc = te.reduce_axis((0, cg), name="rc")
    rk = [te.reduce_axis((0, kernel[d]), name=f"rk{d}") for d in range(n_sp)]

    def body(n: Any, m: Any, *sp: Any) -> Any:
        c = rc if g == 1 else (m // per_group) * cg + rc
        src = (n, c) + tuple(sp[d] * strides[d] + rk[d] * dilations[d] for d in range(n_sp))
        return te.sum(_i32(X[src]) * _i32(W[(m, rc) + tuple(rk)]), axis=[rc] + rk)

    return te.compute((xs[0], w.shape[0]) + tuple(out), body, name=name)
