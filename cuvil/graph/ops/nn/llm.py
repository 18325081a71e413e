"""com.microsoft's float operators of onnxruntime-genai's LLM models: SimplifiedLayerNormalization
(RMSNorm), SkipSimplifiedLayerNormalization and GroupQueryAttention.  The importer gives them cuvil's
default domain (:data:`cuvil.graph.ops.quant.ms.MS_OPS`).  Their 4-bit MatMulNBits is
:mod:`cuvil.graph.ops.quant.nbits`; their RotaryEmbedding is :mod:`cuvil.graph.ops.nn.rotary`'s."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from cuvil import te
from cuvil.graph.ops.base import NodeCtx, Shaped, float32_inputs, op

# -- RMSNorm: SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization ------------------------------


def _rms(ctx: NodeCtx, x: Any, rows: int, n: int, eps: float, gamma: Any) -> tuple[Any, Any]:
    """``x * inv * gamma`` over a (rows, n) view and ``inv = 1 / sqrt(mean(x^2) + eps)`` (rows, 1)."""
    r = te.reduce_axis((0, n), name="r")
    ss = te.compute((rows,), lambda i: te.sum(x[i, r] * x[i, r], axis=r), name="sumsq")
    inv = te.compute((rows, 1), lambda i, _: 1.0 / te.sqrt(ss[i] * (1.0 / n) + eps), name="invrms")
    y = te.compute((rows, n), lambda i, j: x[i, j] * inv[i, 0] * gamma(j), name="rmsnorm")
    return y, inv


def _wanted(ctx: NodeCtx, i: int) -> bool:
    return len(ctx.node.outputs) > i and bool(ctx.node.outputs[i])


@op("SimplifiedLayerNormalization")
def simplified_layer_norm(ctx: NodeCtx) -> list:
    """onnxruntime's RMSNorm (ai.onnx domain in onnxruntime, com.microsoft accepted too):
    ``Y = X / sqrt(mean(X^2) + epsilon) * scale``, the mean over the axes from ``axis`` (default -1) on;
    the optional second output is ``1 / sqrt(mean(X^2) + epsilon)`` with those axes kept as 1."""
    float32_inputs(ctx, [0, 1])
    xs = ctx.shape(0)
    axis = int(ctx.attr("axis", -1))
    if not -len(xs) <= axis < len(xs):
        raise ctx.error(f"axis {axis} is out of range for rank {len(xs)}")
    axis %= len(xs)
    rows, n = math.prod(xs[:axis]), math.prod(xs[axis:])
    if math.prod(ctx.shape(1)) != n or ctx.shape(1) != xs[len(xs) - len(ctx.shape(1)):]:
        raise ctx.error(f"scale {list(ctx.shape(1))} must have the normalised shape {list(xs[axis:])}")
    g = ctx.tensor(1, (n,))
    y, inv = _rms(ctx, ctx.tensor(0, (rows, n)), rows, n, float(ctx.attr("epsilon", 1e-5)), lambda j: g[j])
    outs: list = [Shaped(y, xs)]
    if len(ctx.node.outputs) > 1:
        outs.append(Shaped(inv, (*xs[:axis], *(1,) * (len(xs) - axis))) if _wanted(ctx, 1) else None)
    return outs


@op("SkipSimplifiedLayerNormalization")
def skip_simplified_layer_norm(ctx: NodeCtx) -> list:
    """com.microsoft: ``s = input + skip (+ bias)``, then RMSNorm of ``s`` over the last axis with
    ``gamma``.  Outputs: the normalised ``s``; ``mean`` (onnxruntime writes zeros: RMSNorm has no mean);
    ``inv_std_var`` (rows, 1); ``input_skip_bias_sum`` (``s``).  ``skip`` has the input's shape or its
    last two dimensions; gamma and bias are of the last dimension."""
    float32_inputs(ctx, [0, 1, 2, 3])
    xs = ctx.shape(0)
    if len(xs) < 2:
        raise ctx.error(f"input {list(xs)} must have at least 2 dimensions")
    n = xs[-1]
    rows = math.prod(xs[:-1])
    ks = ctx.shape(1)
    if ks != xs and ks != xs[-2:]:
        raise ctx.error(f"skip {list(ks)} must have the input's shape {list(xs)} or its last two {list(xs[-2:])}")
    for i, what in ((2, "gamma"), (3, "bias")):
        if ctx.has(i) and ctx.shape(i) != (n,):
            raise ctx.error(f"{what} {list(ctx.shape(i))} must be [{n}]")
    x = ctx.tensor(0, (rows, n))
    per = math.prod(ks[:-1])
    skip = ctx.tensor(1, (per, n))
    bias = ctx.tensor(3) if ctx.has(3) else None
    g = ctx.tensor(2)

    def add(i: Any, j: Any) -> Any:
        v = x[i, j] + skip[i % per if per != rows else i, j]
        return v + bias[j] if bias is not None else v

    s = te.compute((rows, n), add, name="skipsum")
    y, inv = _rms(ctx, s, rows, n, float(ctx.attr("epsilon", 1e-5)), lambda j: g[j])
    kept = (*xs[:-1], 1)
    outs: list = [Shaped(y, xs)]
    extra = [(1, lambda: Shaped(te.compute((rows, 1), lambda i, _: te.const(0.0, "float32"), name="mean"), kept)),
             (2, lambda: Shaped(inv, kept)), (3, lambda: Shaped(s, xs))]
    for i, make in extra:
        if len(ctx.node.outputs) > i:
            outs.append(make() if _wanted(ctx, i) else None)
    return outs


# -- GroupQueryAttention (com.microsoft) ------------------------------------------------------------------


def _rotate(x: Any, pos: Any, f: Any, half: int, r: int, cos: Any, sin: Any, interleaved: bool) -> Any:
    """Feature ``f`` of a head ``x(g)`` (a reader of its features) turned by the angle of position ``pos``:
    pairs ``(k, k + r/2)``, or ``(2k, 2k + 1)`` when interleaved; features from ``r`` on pass through."""
    if interleaved:
        k, second, first_f, second_f = (f // 2) % half, f % 2 == 1, f - f % 2, f - f % 2 + 1
    else:
        k, second, first_f, second_f = f % half, (f >= half) & (f < r), f % half, f % half + half
    c, sn = cos[pos, k], sin[pos, k]
    x1, x2 = x(first_f), x(second_f)
    return te.if_then_else(f < r, te.if_then_else(second, sn * x1 + c * x2, c * x1 - sn * x2), x(f))


@op("GroupQueryAttention")
def group_query_attention(ctx: NodeCtx) -> list:
    """com.microsoft GroupQueryAttention, as onnxruntime-genai's decoders use it (separate query, key and
    value inputs, a past cache, causal).

    Query (B, S, N*D), key and value (B, S, KV*D), past_key / past_value (B, KV, P, D), ``seqlens_k`` (B,
    int32: each sequence's total length - 1) and ``total_sequence_length`` (a scalar known when compiling:
    the session specialises on it).  Sequence b has ``past = seqlens_k[b] + 1 - S`` cached tokens; its new
    keys and values go to ``present[past .. past + S)`` after the first ``past`` of the cache, and the rest
    of the present buffers (of length ``max(P, total_sequence_length)``) is zero.  Query s (position
    ``past + s``) attends to keys ``0 .. past + s`` of key/value head ``h // (N / KV)``, scaled by
    ``scale`` (default ``1/sqrt(D)``).  With ``do_rotary``, queries and new keys turn by the angles of their
    positions first (``cos_cache`` / ``sin_cache``, inputs 7 and 8).  Not yet: packed QKV (no key input),
    ``local_window_size``, ``softcap``, ``smooth_softmax``, attention bias and position ids inputs."""
    g = _gqa_shapes(ctx)
    B, S, N, KV, D, P, T = g.B, g.S, g.N, g.KV, g.D, g.P, g.T
    q_in, k_in, v_in, lens = ctx.tensor(0), ctx.tensor(1), ctx.tensor(2), ctx.tensor(5)
    group = N // KV
    scale = ctx.attr("scale")
    scale = 1.0 / math.sqrt(D) if not scale else float(scale)

    def past_of(b: Any) -> Any:  # the cached tokens of sequence b
        return te.cast(lens[b], "int64") + (1 - S)

    q_at, k_at = _gqa_rotated(ctx, g, q_in, k_in, past_of)
    v_at = lambda b, s, h, f: v_in[b, s, h * D + f]  # noqa: E731
    past_k = ctx.tensor(3) if P else None
    past_v = ctx.tensor(4) if P else None
    pk, pv = _present(g, k_at, past_k, past_of, "present_key"), _present(g, v_at, past_v, past_of, "present_value")
    d = te.reduce_axis((0, D), name="d")
    neg = te.const(-math.inf, "float32")
    raw = te.compute((B, N, S, T), lambda b, h, s, t: te.sum(q_at(b, s, h, d) * pk[b, h // group, t, d], axis=d),
                     name="scores")
    scores = te.compute((B, N, S, T), lambda b, h, s, t: te.if_then_else(
        t <= past_of(b) + s, raw[b, h, s, t] * scale, neg), name="masked")
    j = te.reduce_axis((0, T), name="j")
    m = te.compute((B, N, S), lambda b, h, s: te.max(scores[b, h, s, j], axis=j), name="rowmax")
    e = te.compute((B, N, S, T), lambda b, h, s, t: te.exp(scores[b, h, s, t] - m[b, h, s]), name="exp")
    j2 = te.reduce_axis((0, T), name="j2")
    den = te.compute((B, N, S), lambda b, h, s: te.sum(e[b, h, s, j2], axis=j2), name="rowsum")
    jy = te.reduce_axis((0, T), name="jy")
    num = te.compute((B, S, N * D), lambda b, s, c: te.sum(
        e[b, c // D, s, jy] * pv[b, c // D // group, jy, c % D], axis=jy), name="weighted")
    y = te.compute((B, S, N * D), lambda b, s, c: num[b, s, c] / den[b, c // D, s], name="gqa")
    outs: list = [y]
    for i, t in ((1, pk), (2, pv)):
        if len(ctx.node.outputs) > i:
            outs.append(t if _wanted(ctx, i) else None)
    return outs


@dataclass(frozen=True)
class _GQA:
    """The sizes of a GroupQueryAttention node: batch, new tokens, query and key/value heads, head size,
    cached positions (0: no cache) and the present buffers' length."""

    B: int
    S: int
    N: int
    KV: int
    D: int
    P: int
    T: int


def _gqa_shapes(ctx: NodeCtx) -> _GQA:
    """Step 1: the attributes and the inputs' shapes checked (and what cuvil does not take yet refused)."""
    float32_inputs(ctx, [0, 1, 2, 3, 4, 7, 8])
    N, KV = int(ctx.attr("num_heads", 0)), int(ctx.attr("kv_num_heads", 0))
    if not ctx.has(1) or not ctx.has(2):
        raise ctx.unsupported("a packed QKV input (no key and value inputs) is not supported yet")
    for name in ("local_window_size",):
        if int(ctx.attr(name, -1)) != -1:
            raise ctx.unsupported(f"{name} is not supported yet")
    if float(ctx.attr("softcap", 0.0) or 0.0) or int(ctx.attr("smooth_softmax", 0)):
        raise ctx.unsupported("softcap and smooth_softmax are not supported yet")
    if any(ctx.has(i) for i in range(9, ctx.n_inputs)):
        raise ctx.unsupported("position_ids, attention_bias and head_sink inputs are not supported yet")
    qs, ks, vs = ctx.shape(0), ctx.shape(1), ctx.shape(2)
    if N < 1 or KV < 1 or N % KV or len(qs) != 3 or qs[2] % N:
        raise ctx.error(f"query {list(qs)} with num_heads {N} and kv_num_heads {KV}: expected (B, S, N * D), "
                        "N a multiple of kv_num_heads")
    B, S = qs[0], qs[1]
    D = qs[2] // N
    if ks != (B, S, KV * D) or vs != ks:
        raise ctx.error(f"key {list(ks)} and value {list(vs)} must be [{B}, {S}, {KV * D}]")
    P = 0
    if ctx.has(3) or ctx.has(4):
        if not (ctx.has(3) and ctx.has(4)):
            raise ctx.error("past_key and past_value come together")
        P = ctx.shape(3)[2] if len(ctx.shape(3)) == 4 else -1
        if ctx.shape(3) != (B, KV, P, D) or ctx.shape(4) != (B, KV, P, D):
            raise ctx.error(f"past_key {list(ctx.shape(3))} / past_value {list(ctx.shape(4))} must be "
                            f"[{B}, {KV}, past, {D}]")
    if ctx.shape(5) != (B,) or ctx.dtype(5) != "int32":
        raise ctx.error(f"seqlens_k is {ctx.dtype(5)} {list(ctx.shape(5))}; expected int32 [{B}]")
    total = int(np.asarray(ctx.value(6)).reshape(-1)[0])
    return _GQA(B, S, N, KV, D, P, max(P, total))


def _gqa_rotated(ctx: NodeCtx, g: _GQA, q_in: Any, k_in: Any, past_of: Any) -> tuple[Any, Any]:
    """Step 2: readers ``at(b, s, h, f)`` of the queries and new keys, turned by their positions' angles
    first with ``do_rotary`` (stages ``q_rot``, ``k_rot``)."""
    B, S, N, KV, D = g.B, g.S, g.N, g.KV, g.D
    if not int(ctx.attr("do_rotary", 0)):
        return (lambda b, s, h, f: q_in[b, s, h * D + f]), (lambda b, s, h, f: k_in[b, s, h * D + f])
    cs = ctx.shape(7) if ctx.has(7) else ()
    if not ctx.has(8) or len(cs) != 2 or ctx.shape(8) != cs or 2 * cs[1] > D:
        raise ctx.error(f"do_rotary needs cos_cache and sin_cache of shape [positions, rotary dim / 2 <= {D // 2}]")
    half = cs[1]
    cos, sin = ctx.tensor(7), ctx.tensor(8)
    inter = bool(int(ctx.attr("rotary_interleaved", 0)))
    q = te.compute((B, S, N, D), lambda b, s, h, f: _rotate(
        lambda x: q_in[b, s, h * D + x], past_of(b) + s, f, half, 2 * half, cos, sin, inter), name="q_rot")
    k = te.compute((B, S, KV, D), lambda b, s, h, f: _rotate(
        lambda x: k_in[b, s, h * D + x], past_of(b) + s, f, half, 2 * half, cos, sin, inter), name="k_rot")
    return (lambda b, s, h, f: q[b, s, h, f]), (lambda b, s, h, f: k[b, s, h, f])


def _present(g: _GQA, new: Any, past: Any, past_of: Any, name: str) -> Any:
    """Step 3: a present buffer (B, KV, T, D): sequence b's ``past_of(b)`` cached rows, its new ones after
    them, zeros after those."""
    S, P = g.S, g.P
    zero = te.const(0.0, "float32")

    def body(b: Any, h: Any, t: Any, f: Any) -> Any:
        pb = past_of(b)
        s = te.min(te.max(t - pb, 0), S - 1)  # (clamped: read only where selected)
        fresh = te.if_then_else(t < pb + S, new(b, s, h, f), zero)
        if past is None:
            return fresh
        return te.if_then_else(t < pb, past[b, h, te.min(t, P - 1), f], fresh)

    return te.compute((g.B, g.KV, g.T, g.D), body, name=name)
