"""The kernels of a decoder step besides its weight contractions (:mod:`cuvil.llm.qlinear`), written in te
and scheduled by :func:`cuvil.auto_schedule` like any other kernel.

Each builder returns a compiled module; its arguments are listed in its docstring.  ``T`` is the number of
tokens a step takes (1 when decoding, the chunk when prefilling).  The KV cache of a layer is token-major,
``[capacity, kv_heads, head_dim]``, so that the T new rows of a step are one contiguous slice (the rotary
kernel writes them there: no copy per token) and the first ``L`` rows, the attended ones, are another:
attention takes ``L`` as a size variable, so one module serves every length.
"""

from __future__ import annotations

import math
from typing import Any

from cuvil import te
from cuvil.llm.weights import DecoderConfig

__all__ = ["attention", "build", "embed", "gated_act", "greedy", "rms_norm", "rotary"]


def build(args: list[Any], target: Any = None, name: str = "kernel") -> Any:
    """Schedule (:func:`cuvil.auto_schedule`) and compile the program whose arguments are ``args``."""
    import cuvil

    tgt = target if target is not None else "llvm"
    s = cuvil.auto_schedule(args, tgt)
    return cuvil.build(s, args, tgt, name=name)


def embed(cfg: DecoderConfig, T: int, target: Any = None) -> Any:
    """``(ids int32 [T], table float32 [vocab, hidden], x float32 [T, hidden])``: rows of the table, times
    the config's embedding scale."""
    ids = te.placeholder((T,), "int32", name="ids")
    table = te.placeholder((cfg.vocab, cfg.hidden), name="table")
    scale = float(cfg.embed_scale)

    def body(t: Any, j: Any) -> Any:
        v = table[te.cast(ids[t], "int64"), j]
        return v * scale if scale != 1.0 else v

    x = te.compute((T, cfg.hidden), body, name="embed")
    return build([ids, table, x], target, "embed")


def rms_norm(cfg: DecoderConfig, T: int, target: Any = None) -> Any:
    """``(x float32 [T, hidden], gamma float32 [hidden], y float32 [T, hidden])``:
    ``x / sqrt(mean(x^2) + eps) * (norm_offset + gamma)``."""
    n = cfg.hidden
    x = te.placeholder((T, n), name="x")
    gamma = te.placeholder((n,), name="gamma")
    r = te.reduce_axis((0, n), name="r")
    ss = te.compute((T,), lambda i: te.sum(x[i, r] * x[i, r], axis=r), name="sumsq")
    inv = te.compute((T,), lambda i: 1.0 / te.sqrt(ss[i] * (1.0 / n) + cfg.rms_eps), name="inv")
    off = float(cfg.norm_offset)
    y = te.compute((T, n), lambda i, j: x[i, j] * inv[i] * ((gamma[j] + off) if off else gamma[j]), name="rmsnorm")
    return build([x, gamma, y], target, "rms_norm")


def rotary(cfg: DecoderConfig, T: int, target: Any = None) -> Any:
    """``(qkv float32 [T, (heads + 2 kv_heads) head_dim], cos float32 [T, head_dim / 2], sin (same),
    q float32 [T, heads, head_dim], k float32 [T, kv_heads, head_dim], v (same))``.

    The fused projection's row is split into the query, key and value heads; queries and keys are turned
    by their position's angles (pairs ``(i, i + head_dim / 2)``, as Hugging Face's ``rotate_half``); ``k``
    and ``v`` are the cache's slots for these T tokens."""
    H, G, D = cfg.heads, cfg.kv_heads, cfg.head_dim
    half = D // 2
    qkv = te.placeholder((T, (H + 2 * G) * D), name="qkv")
    cos = te.placeholder((T, half), name="cos")
    sin = te.placeholder((T, half), name="sin")

    def turned(base: int) -> Any:
        def body(t: Any, h: Any, d: Any) -> Any:
            col = base + h * D + d
            lo = d < half
            i = te.if_then_else(lo, d, d - half)
            partner = te.if_then_else(lo, qkv[t, col + half], qkv[t, col - half])
            sign = te.if_then_else(lo, -1.0, 1.0)
            return qkv[t, col] * cos[t, i] + sign * partner * sin[t, i]
        return body

    q = te.compute((T, H, D), turned(0), name="q_rot")
    k = te.compute((T, G, D), turned(H * D), name="k_rot")
    v = te.compute((T, G, D), lambda t, g, d: qkv[t, (H + G) * D + g * D + d], name="v_new")
    return build([qkv, cos, sin, q, k, v], target, "rotary")


def attention(cfg: DecoderConfig, T: int, target: Any = None) -> Any:
    """``(q float32 [T, heads, head_dim], k float32 [L, kv_heads, head_dim], v (same), o float32
    [T, heads * head_dim])`` with ``L`` a size variable: the T queries are the last T of the L positions;
    query t attends to key s when ``s <= L - T + t`` (causal) and, with a sliding window W, when
    ``s > L - T + t - W``.  Head h reads key/value head ``h // (heads / kv_heads)``."""
    H, G, D = cfg.heads, cfg.kv_heads, cfg.head_dim
    per = H // G
    L = te.var("L")
    q = te.placeholder((T, H, D), name="q")
    k = te.placeholder((L, G, D), name="k")
    v = te.placeholder((L, G, D), name="v")
    scale = 1.0 / math.sqrt(D)
    W = int(cfg.sliding_window)

    def visible(t: Any, s: Any) -> Any:
        last = L - T + t
        return s <= last if not W else te.all(s <= last, s > last - W)

    d = te.reduce_axis((0, D), name="d")
    dot = te.compute((T, H, L), lambda t, h, s: te.sum(q[t, h, d] * k[s, h // per, d], axis=d), name="dot")
    s1 = te.reduce_axis((0, L), name="s1")
    top = te.compute((T, H), lambda t, h: te.max(dot[t, h, s1], axis=s1, where=visible(t, s1)), name="top")
    e = te.compute((T, H, L), lambda t, h, s: te.if_then_else(
        visible(t, s), te.exp((dot[t, h, s] - top[t, h]) * scale), 0.0), name="e")
    s2 = te.reduce_axis((0, L), name="s2")
    den = te.compute((T, H), lambda t, h: te.sum(e[t, h, s2], axis=s2), name="den")
    s3 = te.reduce_axis((0, L), name="s3")
    num = te.compute((T, H, D), lambda t, h, j: te.sum(e[t, h, s3] * v[s3, h // per, j], axis=s3), name="num")
    o = te.compute((T, H * D), lambda t, c: num[t, c // D, c % D] / den[t, c // D], name="attn")
    return build([q, k, v, o], target, "attention")


def gated_act(cfg: DecoderConfig, T: int, target: Any = None) -> Any:
    """``(gu float32 [T, 2 ffn], a float32 [T, ffn])``: ``act(gate) * up`` of the fused gate/up
    projection (gate first)."""
    F = cfg.ffn
    gu = te.placeholder((T, 2 * F), name="gu")
    if cfg.act == "silu":
        def act(g: Any) -> Any:
            return g * te.sigmoid(g)
    else:  # gelu with the tanh approximation
        c = math.sqrt(2.0 / math.pi)

        def act(g: Any) -> Any:
            return 0.5 * g * (1.0 + te.tanh(c * (g + 0.044715 * g * g * g)))
    a = te.compute((T, F), lambda t, j: act(gu[t, j]) * gu[t, F + j], name="gated")
    return build([gu, a], target, "gated_act")


def greedy(vocab: int, target: Any = None) -> Any:
    """``(logits float32 [1, vocab], best int32 [1])``: the first index of the largest logit."""
    x = te.placeholder((1, vocab), name="logits")
    r = te.reduce_axis((0, vocab), name="r")
    top = te.compute((1,), lambda i: te.max(x[i, r], axis=r), name="top")
    r2 = te.reduce_axis((0, vocab), name="r2")
    best = te.compute((1,), lambda i: te.min(te.if_then_else(x[i, r2] == top[i], te.cast(r2, "int32"),
                                                              te.const(vocab, "int32")), axis=r2), name="best")
    return build([x, best], target, "greedy")
