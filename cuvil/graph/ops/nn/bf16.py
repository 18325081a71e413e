"""bfloat16 contractions for float32 models: the ``precision="bf16"`` opt-in.

With ``InferenceSession(model, precision="bf16")`` (``cuvil compile --precision bf16``) the
contractions with constant weights (``MatMul``, ``Gemm``, ``Conv`` of one group) multiply in bfloat16
and accumulate in float32 on x86's ``vdpbf16ps`` (AVX512-BF16); everything else, the contraction's
output included, stays float32.  fp32 is the default; a target without ``avx512bf16`` compiles the
float32 kernels and says so (:func:`resolve_precision`).

The int8 contractions' scheme (:mod:`cuvil.graph.ops.quant.kernels`) with two reduction steps per int32
instead of four: the weights are rounded to bfloat16 at compile time (round to nearest, ties to even)
and packed in panels ``[N / P][K / 2][P]`` of int32 (low half k = 2 k2, high half k = 2 k2 + 1; P two
vectors of float32 lanes), a packing stage rounds the activation's pairs the same way
(:func:`cuvil.ir.expr.bf16_pair`), and the contraction sums :func:`cuvil.ir.expr.dot2_bf16` over them,
which the code generator emits as ``vdpbf16ps``.  The auto-scheduler tiles it like any contraction.

Error bound.  A bfloat16 keeps 8 significant bits: rounding ``x`` to nearest gives ``x (1 + d)`` with
``|d| <= 2^-9``, so a product of two rounded operands is ``a w (1 + e)`` with ``|e| <= 2^-8 + 2^-18``
and is exact in float32.  Summing ``K`` of them in float32 (``K / 2`` steps of two additions, the
last pair padded with a zero for an odd ``K``) adds at most ``(K + 2) * 2^-24`` of ``sum |a w|``.
So, for every output,

    |y_bf16 - y_exact| <= (2 * 2^-9 + 2^-18 + (K + 2) * 2^-24) * sum_k |a_k| |w_k|

(plus float32's rounding of a bias added afterwards).  ``2 * 2^-9 * sum |a||w|`` is the leading term;
the bound does not shrink with cancellation, so an output near zero can have a large *relative*
error.  ``vdpbf16ps`` also treats bfloat16 subnormals (below ~1.2e-38) as zero.  tests/codegen/test_bf16.py
checks every output against this bound computed from the inputs.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from cuvil import te
from cuvil.errors import ArgumentError
from cuvil.graph.ops.base import NodeCtx, Shaped, t_shape
from cuvil.ir.expr import bf16_pair, dot2_bf16
from cuvil.options import PRECISIONS  # (one list: the compile options check it first)
from cuvil.te.tensor import Tensor

FEATURE = "avx512bf16"


class PrecisionWarning(UserWarning):
    """A requested precision the target cannot compute (it runs float32 instead)."""


def bf16_panel(target: Any) -> int:
    """The float32 columns of a bf16 weight panel on ``target`` (two vectors of lanes), 0 when it has no
    bf16 dot product (``vdpbf16ps``)."""
    from cuvil.codegen.llvm_dot import bf16_dot_width

    if target is None or getattr(target, "kind", "") != "llvm":
        return 0
    lanes = target.panel_lanes(4)
    return 2 * lanes if bf16_dot_width(target, lanes) else 0


def resolve_precision(precision: Any, target: Any) -> str:
    """The precision ``target`` computes for the requested ``precision`` ("fp32" or "bf16"): "bf16" on a
    CPU with AVX512-BF16; on another it warns (:class:`PrecisionWarning`, naming the feature) and
    returns "fp32".  Anything else is an :class:`~cuvil.errors.ArgumentError`."""
    if precision not in PRECISIONS:
        raise ArgumentError(f"precision must be one of {', '.join(repr(p) for p in PRECISIONS)}, got {precision!r}")
    if precision == "bf16" and not bf16_panel(target):
        canonical = getattr(target, "canonical", target)
        warnings.warn(f"precision='bf16' needs {FEATURE} (vdpbf16ps), which the target {canonical} lacks: "
                      "computing in float32", PrecisionWarning, stacklevel=3)
        return "fp32"
    return precision


def wants_bf16(ctx: NodeCtx, *inputs: int) -> bool:
    """Whether ``ctx``'s node computes its contraction in bf16: the compile asked for it (the graph
    compiler sets ``ctx.precision``), the target has the instruction, the inputs are float32."""
    return (ctx.precision == "bf16" and bool(bf16_panel(ctx.target))
            and all(ctx.dtype(i) == "float32" for i in inputs))


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded to bfloat16 (nearest, ties to even; NaN stays a quiet NaN) as the uint16
    bit patterns, at compile time (the same rounding as :func:`cuvil.ir.expr.bf16_pair`)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    near = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet = (bits | 0x00400000) >> 16
    return np.where(np.isnan(x), quiet, near).astype(np.uint16)


def _pair_words(halves: np.ndarray, panel: int) -> np.ndarray:
    """bf16 bit patterns ``[K, taps, N]`` as int32 panels ``[ceil(N / P), ceil(K / 2), taps, P]``: half t of
    a word is ``k = 2 k2 + t`` (zeros past K and N)."""
    k, taps, n = halves.shape
    k2, q = -(-k // 2), -(-n // panel)
    full = np.zeros((k2 * 2, taps, q * panel), np.uint16)
    full[:k, :, :n] = halves
    blocks = full.reshape(k2, 2, taps, q, panel).transpose(3, 0, 2, 4, 1)  # [q, k2, taps, P, 2]
    return np.ascontiguousarray(blocks).view("<i4")[..., 0].astype(np.int32)


def _pair(read: Any, step: Any, total: int) -> Any:
    """``bf16_pair`` of ``read(2 step)`` and ``read(2 step + 1)`` (float32 expressions of a reduction
    index), the second 0 past ``total`` (an odd reduction length)."""
    if total % 2 == 0:
        return bf16_pair(read(step * 2), read(step * 2 + 1))
    hi = te.if_then_else(step * 2 + 1 < total, read(te.min(step * 2 + 1, total - 1)), te.const(0.0, "float32"))
    return bf16_pair(read(step * 2), hi)


def bf16_matmul(ctx: NodeCtx, a: Tensor, w: np.ndarray, name: str = "matmul") -> Tensor:
    """``[..., N] float32 = sum_k bf16(a[..., k]) * bf16(w[k, n])`` with float32 accumulation, ``w`` a
    float32 constant ``[K, N]`` (error bound: the module's docstring)."""
    a_s = t_shape(a)
    if w.ndim != 2 or a_s[-1] != w.shape[0]:
        raise ctx.error(f"{name} takes a [..., K] activation and [K, N] weights; got {list(a_s)} and "
                        f"{list(w.shape)}")
    kk, n = (int(d) for d in w.shape)
    panel = bf16_panel(ctx.target)
    k2 = -(-kk // 2)
    lead = a_s[:-1]
    A2 = te.compute(lead + (k2,), lambda *i: _pair(lambda k: a[i[:-1] + (k,)], i[-1], kk), name=f"{name}_a2")
    words = _pair_words(round_bf16(w)[:, None, :], panel)[:, :, 0, :]  # [q, k2, P]
    W2 = ctx.constant(words, keyed=False)
    s2 = te.reduce_axis((0, k2), name="k2")
    return te.compute(lead + (n,), lambda *i: te.sum(dot2_bf16(W2[i[-1] // panel, s2, i[-1] % panel],
                                                               A2[i[:-1] + (s2,)]), axis=s2), name=name)


def bf16_pointwise(ctx: NodeCtx, x: Tensor, w: np.ndarray, name: str = "conv1x1") -> Tensor:
    """A 1x1 convolution as ``Y[n, m, p] = sum_c bf16(W[m, c]) * bf16(X[n, c, p])`` over flattened pixels
    (``x`` is ``[N, C, P]``): the input packed in channel pairs ``X2[n, c2, p]`` (pixels stay contiguous),
    the filters in panels ``[M / P, C / 2, P]``; the scheduler puts pixels or filters in the lanes."""
    n, c, p = t_shape(x)
    m = int(w.shape[0])
    panel = bf16_panel(ctx.target)
    c2 = -(-c // 2)
    X2 = te.compute((n, c2, p), lambda b, s, q: _pair(lambda k: x[b, k, q], s, c), name=f"{name}_x2")
    words = _pair_words(round_bf16(w.reshape(m, c).T)[:, None, :], panel)[:, :, 0, :]  # [q, c2, P]
    W2 = ctx.constant(words, keyed=False)
    r2 = te.reduce_axis((0, c2), name="rc2")
    return te.compute((n, m, p), lambda b, f, q: te.sum(dot2_bf16(W2[f // panel, r2, f % panel], X2[b, r2, q]),
                                                        axis=r2), name=name)


def bf16_conv(ctx: NodeCtx, x: Tensor, w: np.ndarray, strides: Sequence[int], dilations: Sequence[int],
              pads_begin: Sequence[int], out: Sequence[int], name: str = "conv") -> Tensor:
    """A convolution of one group, ``x`` (N C spatial..., float32) with constant ``w`` ``[O, C, k...]``,
    in bf16 with float32 accumulation: the input padded (zeros) and packed two channels per int32
    (``X2[n, *rows, C / 2, columns]``: image rows stay unit stride), the filters in panels
    ``[O / P, C / 2, *kernel, P]``; the output is N O spatial..., float32."""
    xs = t_shape(x)
    n_sp = len(xs) - 2
    c = xs[1]
    c2 = -(-c // 2)
    panel = bf16_panel(ctx.target)
    kernel = [int(d) for d in w.shape[2:]]
    span = [(out[d] - 1) * strides[d] + dilations[d] * (kernel[d] - 1) + 1 for d in range(n_sp)]

    def x_body(n: Any, *rest: Any) -> Any:
        sp, s2 = rest[:-2] + rest[-1:], rest[-2]
        src = tuple(sp[d] - pads_begin[d] for d in range(n_sp))
        inside = [cond for d in range(n_sp) for cond in
                  ([sp[d] >= pads_begin[d]] if pads_begin[d] else []) +
                  ([sp[d] < xs[2 + d] + pads_begin[d]] if span[d] > xs[2 + d] + pads_begin[d] else [])]

        def read(ch: Any) -> Any:
            v = x[(n, ch) + src]
            return te.if_then_else(te.all(*inside), v, te.const(0.0, "float32")) if inside else v

        return _pair(read, s2, c)

    X2 = te.compute((xs[0],) + tuple(span[:-1]) + (c2, span[-1]), x_body, name=f"{name}_x2")
    o = int(w.shape[0])
    flat = np.moveaxis(np.asarray(w, np.float32), 0, -1).reshape(c, -1, o)  # [C, taps, O]
    words = _pair_words(round_bf16(flat), panel)
    W2 = ctx.constant(words.reshape((words.shape[0], c2) + tuple(kernel) + (panel,)), keyed=False)
    r2 = te.reduce_axis((0, c2), name="rc2")
    rk = [te.reduce_axis((0, kernel[d]), name=f"rk{d}") for d in range(n_sp)]

    def body(n: Any, m: Any, *sp: Any) -> Any:
        wr = W2[(m // panel, r2) + tuple(rk) + (m % panel,)]
        at = tuple(sp[d] * strides[d] + rk[d] * dilations[d] for d in range(n_sp))
        return te.sum(dot2_bf16(wr, X2[(n,) + at[:-1] + (r2, at[-1])]), axis=[r2] + rk)

    return te.compute((xs[0], o) + tuple(out), body, name=name)


def conv_node(ctx: NodeCtx, strides: Sequence[int], dilations: Sequence[int], pads_begin: Sequence[int],
              out: Sequence[int]) -> Any:
    """An ONNX ``Conv`` of one group with constant float32 weights in bf16 (its checks done by the
    caller): a 1x1 convolution of stride 1 without padding over flattened pixels, others direct; the
    bias added in float32."""
    xs, ws = ctx.shape(0), ctx.shape(1)
    has_bias = ctx.has(2)  # before compile-time constants are appended to the entries
    w = np.asarray(ctx.entries[1], np.float32)
    ctx.variant = "bf16"  # keys the kernel: the same node in fp32 is another kernel
    b = ctx.tensor(2) if has_bias else None
    if all(k == 1 for k in ws[2:]) and tuple(out) == xs[2:] and not any(pads_begin):
        shape3 = (xs[0], ws[0], int(np.prod(xs[2:], dtype=np.int64)))
        y = bf16_pointwise(ctx, ctx.tensor(0, (xs[0], xs[1], shape3[2])), w, "conv1x1")
        if b is not None:
            y = te.compute(shape3, lambda n, m, q: y[n, m, q] + b[m], name="conv_bias")
        return Shaped(y, (xs[0], ws[0]) + xs[2:])
    y = bf16_conv(ctx, ctx.tensor(0), w, strides, dilations, pads_begin, out, "conv")
    if b is not None:
        shape = t_shape(y)
        y = te.compute(shape, lambda n, m, *sp: y[(n, m) + sp] + b[m], name="conv_bias")
    return y
