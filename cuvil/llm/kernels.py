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


def rotary(cfg: DecoderConfig, T: int, target: Any = None, kv: str = "float32") -> Any:
    """``(qkv float32 [T, (heads + 2 kv_heads) head_dim], cos float32 [T, head_dim / 2], sin (same),
    q float32 [T, heads, head_dim], k float32 [T, kv_heads, head_dim], v (same))``.

    The fused projection's row is split into the query, key and value heads; queries and keys are turned
    by their position's angles (pairs ``(i, i + head_dim / 2)``, as Hugging Face's ``rotate_half``); ``k``
    and ``v`` are the cache's slots for these T tokens.

    ``kv="int8"``: the cache holds int8 values with a float32 scale per (token, head) (``max|x| / 127``,
    rounded to nearest), so the outputs are ``q, k int8, k_scale float32 [T, kv_heads], v int8, v_scale``."""
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
    if kv == "float32":
        return build([qkv, cos, sin, q, k, v], target, "rotary")
    k8, ks = _int8_rows(k, T, G, D, "k")
    v8, vs = _int8_rows(v, T, G, D, "v")
    return build([qkv, cos, sin, q, k8, ks, v8, vs], target, "rotary_int8")


def _int8_rows(x: Any, T: int, G: int, D: int, name: str) -> tuple[Any, Any]:
    """``x`` [T, G, D] as int8 values and a scale per (t, g): ``round(x / scale)``, ``scale = max|x| / 127``
    (1 for a row of zeros)."""
    d = te.reduce_axis((0, D), name=f"{name}d")
    top = te.compute((T, G), lambda t, g: te.max(te.abs(x[t, g, d]), axis=d), name=f"{name}_absmax")
    scale = te.compute((T, G), lambda t, g: te.if_then_else(top[t, g] > 0.0, top[t, g] * (1.0 / 127.0), 1.0),
                       name=f"{name}_scale")
    q = te.compute((T, G, D), lambda t, g, j: te.cast(te.cast(te.round(x[t, g, j] / scale[t, g]), "int32"),
                                                      "int8"), name=f"{name}_int8")
    return q, scale


def attention(cfg: DecoderConfig, T: int, target: Any = None, kv: str = "float32") -> Any:
    """``(q float32 [T, heads, head_dim], k float32 [L, kv_heads, head_dim], v (same), o float32
    [T, heads * head_dim])`` with ``L`` a size variable: the T queries are the last T of the L positions;
    query t attends to key s when ``s <= L - T + t`` (causal) and, with a sliding window W, when
    ``s > L - T + t - W``.  Head h reads key/value head ``h // (heads / kv_heads)``.

    ``kv="int8"``: ``(q, k int8 [L, kv_heads, head_dim], k_scale float32 [L, kv_heads], v int8, v_scale,
    o)``: each key's products are summed in float32 and scaled once; each value's scale joins its
    probability."""
    H, G, D = cfg.heads, cfg.kv_heads, cfg.head_dim
    per = H // G
    L = te.var("L")
    q = te.placeholder((T, H, D), name="q")
    quant = kv == "int8"
    k = te.placeholder((L, G, D), "int8" if quant else "float32", name="k")
    v = te.placeholder((L, G, D), "int8" if quant else "float32", name="v")
    ks = te.placeholder((L, G), name="k_scale") if quant else None
    vs = te.placeholder((L, G), name="v_scale") if quant else None
    scale = 1.0 / math.sqrt(D)
    W = int(cfg.sliding_window)

    def visible(t: Any, s: Any) -> Any:
        last = L - T + t
        return s <= last if not W else te.all(s <= last, s > last - W)

    d = te.reduce_axis((0, D), name="d")
    if quant:
        raw = te.compute((T, H, L), lambda t, h, s: te.sum(q[t, h, d] * te.cast(k[s, h // per, d], "float32"),
                                                           axis=d), name="dot_raw")
        dot = te.compute((T, H, L), lambda t, h, s: raw[t, h, s] * ks[s, h // per], name="dot")
    else:
        dot = te.compute((T, H, L), lambda t, h, s: te.sum(q[t, h, d] * k[s, h // per, d], axis=d), name="dot")
    s1 = te.reduce_axis((0, L), name="s1")
    top = te.compute((T, H), lambda t, h: te.max(dot[t, h, s1], axis=s1, where=visible(t, s1)), name="top")
    e = te.compute((T, H, L), lambda t, h, s: te.if_then_else(
        visible(t, s), te.exp((dot[t, h, s] - top[t, h]) * scale), 0.0), name="e")
    s2 = te.reduce_axis((0, L), name="s2")
    den = te.compute((T, H), lambda t, h: te.sum(e[t, h, s2], axis=s2), name="den")
    s3 = te.reduce_axis((0, L), name="s3")
    if quant:
        num = te.compute((T, H, D), lambda t, h, j: te.sum(
            e[t, h, s3] * vs[s3, h // per] * te.cast(v[s3, h // per, j], "float32"), axis=s3), name="num")
    else:
        num = te.compute((T, H, D), lambda t, h, j: te.sum(e[t, h, s3] * v[s3, h // per, j], axis=s3), name="num")
    o = te.compute((T, H * D), lambda t, c: num[t, c // D, c % D] / den[t, c // D], name="attn")
    if quant:
        return build([q, k, ks, v, vs, o], target, "attention_int8")
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
