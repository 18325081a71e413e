"""ONNX Attention (opsets 23-25): scaled dot-product attention with grouped key/value heads, a key/value
cache, masks (boolean or additive, causal, sliding window, per-batch key padding) and softcapping."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cuvil import dtype as dt
from cuvil import te
from cuvil.errors import DTypeError
from cuvil.graph.ops.base import NodeCtx, Shaped, op
from cuvil.te.tensor import Tensor

_NEG_INF = -math.inf


def _heads(ctx: NodeCtx, i: int, attr: str) -> tuple[tuple[int, int, int, int], Callable[..., Any]]:
    """Input ``i`` (Q, K or V): its (batch, heads, sequence, head size) and a reader ``at(bh, s, d)`` with
    batch and head merged (``bh = b * heads + h``); a 4-D input is that already, a 3-D one is (batch,
    sequence, heads * size) with ``attr`` heads."""
    shp = ctx.shape(i)
    if len(shp) == 4:
        t = ctx.tensor(i, (shp[0] * shp[1], shp[2], shp[3]))
        return (shp[0], shp[1], shp[2], shp[3]), lambda bh, s, d: t[bh, s, d]
    heads = int(ctx.attr(attr, 0))
    if len(shp) != 3 or heads < 1 or shp[2] % heads:
        raise ctx.error(f"input {i} {list(shp)} must be 4-D, or 3-D with {attr} dividing its last dimension "
                        f"(got {heads})")
    size = shp[2] // heads
    t = ctx.tensor(i)
    return (shp[0], heads, shp[1], size), lambda bh, s, d: t[bh // heads, s, (bh % heads) * size + d]


@op("Attention")
def attention(ctx: NodeCtx) -> list:
    """``Y = softmax(Q K^T * scale + bias) V`` per (batch, query head), as ONNX's reference computes it:

    - K and V are the past cache (inputs 4, 5; outputs 1, 2 return it extended) followed by the new keys;
      query head h reads key/value head ``h // (q heads / kv heads)``;
    - the scale (default ``1/sqrt(head size)``) multiplies Q and K by its square root each;
    - ``softcap > 0`` maps the scores ``s`` to ``softcap * tanh(s / softcap)`` before the bias;
    - the bias adds ``attn_mask`` (bool: 0 / -inf; float: itself; broadcast, and -inf past its last
      column) and -inf where ``is_causal`` (key j after query i + offset), the sliding window
      (``left_window_size``, ``right_window_size``) or ``nonpad_kv_seqlen`` (input 6) exclude a key;
      the offset is the cache length, or ``nonpad_kv_seqlen[b] - queries`` without a cache;
    - a query whose keys are all excluded gets zero probabilities (Y = 0);
    - output 3 is the scores (``qk_matmul_output_mode`` 0 or 1), the scores with the bias (2) or the
      probabilities (3).
    """
    dtype = ctx.dtype(0)
    if not dt.is_float(dtype):
        raise DTypeError(f"{ctx.node}: Q is {dtype}; Attention needs float tensors")
    for i in (1, 2, 4, 5):
        if ctx.has(i) and ctx.dtype(i) != dtype:
            raise DTypeError(f"{ctx.node}: input {i} is {ctx.dtype(i)}, Q is {dtype}")
    h = _inputs(ctx)
    capped, logits, biased = _logits(ctx, h, dtype)
    p = _probabilities(logits, h, dtype, biased)
    return _outputs(ctx, h, p, capped, logits)


@dataclass(frozen=True)
class _Heads:
    """Q, K and V of an Attention node as readers ``at(bh, position, feature)``, batch and head merged (``bh
    = b * heads + h``); ``key`` and ``value`` read the past cache followed by the new keys and values (the
    ``present`` stages, when there is a cache)."""

    nb: int  # batch
    hq: int  # query heads
    hk: int  # key/value heads
    sq: int  # queries
    dq: int  # head size of Q and K
    dv: int  # head size of V
    past: int  # cached positions
    total: int  # keys per query: the cache and the new ones
    q: Callable[..., Any]
    key: Callable[..., Any]
    value: Callable[..., Any]
    present_k: Tensor | None
    present_v: Tensor | None

    @property
    def group(self) -> int:  # query heads per key/value head
        return self.hq // self.hk


def _inputs(ctx: NodeCtx) -> _Heads:
    """Step 1: Q, K, V and the cache, their shapes checked; the present key and value stages."""
    (nb, hq, sq, dq), q = _heads(ctx, 0, "q_num_heads")
    (kb, hk, sk, dk), k_new = _heads(ctx, 1, "kv_num_heads")
    (vb, hv, sv, dv), v_new = _heads(ctx, 2, "kv_num_heads")
    if not (nb == kb == vb and hk == hv and sk == sv and dq == dk and hq % hk == 0):
        raise ctx.error(f"Q {list(ctx.shape(0))}, K {list(ctx.shape(1))}, V {list(ctx.shape(2))} do not fit "
                        "(same batch, key and value heads and lengths, query heads a multiple of key heads)")
    past = 0
    if ctx.has(4) != ctx.has(5):
        raise ctx.error("past_key and past_value come together")
    if ctx.has(4):
        past = ctx.shape(4)[2]
        if ctx.shape(4) != (nb, hk, past, dk) or ctx.shape(5) != (nb, hk, past, dv):
            raise ctx.error(f"past_key {list(ctx.shape(4))} / past_value {list(ctx.shape(5))} must be "
                            f"[{nb}, {hk}, past, {dk}] / [.., {dv}]")
    total = past + sk
    key, value = k_new, v_new  # read at (b * kv heads + h, j, d)
    present_k = present_v = None
    if past:  # the cache followed by the new keys and values: outputs 1 and 2, which the rest reads
        pk, pv = ctx.tensor(4, (nb * hk, past, dk)), ctx.tensor(5, (nb * hk, past, dv))
        present_k = te.compute((nb * hk, total, dk), lambda bh, j, d: te.if_then_else(
            j < past, pk[bh, j, d], k_new(bh, j - past, d)), name="present_key")
        present_v = te.compute((nb * hk, total, dv), lambda bh, j, d: te.if_then_else(
            j < past, pv[bh, j, d], v_new(bh, j - past, d)), name="present_value")
        key = lambda bh, j, d: present_k[bh, j, d]  # noqa: E731
        value = lambda bh, j, d: present_v[bh, j, d]  # noqa: E731
    return _Heads(nb, hq, hk, sq, dq, dv, past, total, q, key, value, present_k, present_v)


def _logits(ctx: NodeCtx, h: _Heads, dtype: str) -> tuple[Tensor, Tensor, bool]:
    """Step 2: the scaled scores over (batch * query heads, queries, keys), softcapped (output 3 of modes 0
    and 1), and the logits with the bias added; whether there is a bias."""
    scale = ctx.attr("scale")
    scale = 1.0 / math.sqrt(h.dq) if scale is None else float(scale)
    root = te.const(math.sqrt(scale), dtype)
    softcap = float(ctx.attr("softcap", 0.0) or 0.0)
    # every stage over (batch * query heads, queries, ...): query head bh reads key/value head bh // group
    group = h.group
    r = te.reduce_axis((0, h.dq), name="d")
    scores = te.compute((h.nb * h.hq, h.sq, h.total), lambda bh, i, j: te.sum(
        (h.q(bh, i, r) * root) * (h.key(bh // group, j, r) * root), axis=r), name="scores")
    bias4 = _bias(ctx, h.nb, h.hq, h.sq, h.total, h.past, dtype)
    bias = None if bias4 is None else (lambda bh, i, j: bias4(bh // h.hq, bh % h.hq, i, j))
    capped, logits = scores, scores
    if softcap > 0 or bias is not None:  # one stage: the softcap, then the bias

        def cap(*i: Any) -> Any:
            return te.tanh(scores[i] * (1.0 / softcap)) * softcap if softcap > 0 else scores[i]

        logits = te.compute(scores.shape, lambda *i: cap(*i) + bias(*i) if bias is not None else cap(*i),
                            name="logits")
        if softcap > 0:  # output 3 of modes 0 and 1: the capped scores without the bias
            capped = logits if bias is None else te.compute(scores.shape, cap, name="softcap")
    return capped, logits, bias is not None


def _probabilities(logits: Tensor, h: _Heads, dtype: str, biased: bool) -> Tensor:
    """Step 3: the softmax of the logits along the keys."""
    nh, sq, total = h.nb * h.hq, h.sq, h.total
    j = te.reduce_axis((0, total), name="j")
    m = te.compute((nh, sq), lambda bh, i: te.max(logits[bh, i, j], axis=j), name="rowmax")
    zero = te.const(0, dtype)
    # a row whose bias excludes every key is all -inf: exp(-inf - 0) = 0 everywhere, a sum of 0, and
    # zero probabilities (as ONNX wants) once a zero sum divides as 1
    e = te.compute(logits.shape, lambda bh, i, jj: te.exp(
        logits[bh, i, jj] - te.if_then_else(m[bh, i] == _NEG_INF, zero, m[bh, i])), name="exp")
    j2 = te.reduce_axis((0, total), name="j2")
    s = te.compute((nh, sq), lambda bh, i: te.sum(e[bh, i, j2], axis=j2), name="rowsum")
    return te.compute(e.shape, lambda bh, i, jj: e[bh, i, jj] / (
        s[bh, i] if not biased else te.if_then_else(s[bh, i] == zero, te.const(1, dtype), s[bh, i])),
        name="probs")


def _outputs(ctx: NodeCtx, h: _Heads, p: Tensor, capped: Tensor, logits: Tensor) -> list:
    """Step 4: Y (the probabilities times the values, in Q's layout), and the optional outputs: the present
    key and value, and the scores of ``qk_matmul_output_mode``."""
    nb, hq, hk, sq, dq, dv, total, group = h.nb, h.hq, h.hk, h.sq, h.dq, h.dv, h.total, h.group
    value = h.value
    jy = te.reduce_axis((0, total), name="jy")
    if len(ctx.shape(0)) == 3:
        y = Shaped(te.compute((nb, sq, hq * dv), lambda b, i, c: te.sum(
            p[b * hq + c // dv, i, jy] * value((b * hq + c // dv) // group, jy, c % dv), axis=jy),
            name="attention"), (nb, sq, hq * dv))
    else:
        y = Shaped(te.compute((nb * hq, sq, dv), lambda bh, i, c: te.sum(
            p[bh, i, jy] * value(bh // group, jy, c), axis=jy), name="attention"), (nb, hq, sq, dv))
    outs: list = [y, None, None, None]
    names = list(ctx.node.outputs) + [""] * 4
    if names[1]:
        pk = h.present_k if h.present_k is not None else te.compute((nb * hk, total, dq), h.key, name="present_key")
        outs[1] = Shaped(pk, (nb, hk, total, dq))
    if names[2]:
        pv = h.present_v if h.present_v is not None else te.compute((nb * hk, total, dv), value, name="present_value")
        outs[2] = Shaped(pv, (nb, hk, total, dv))
    if names[3]:
        mode = int(ctx.attr("qk_matmul_output_mode", 0))
        qk = {0: capped, 1: capped, 2: logits, 3: p}.get(mode)
        if qk is None:
            raise ctx.error(f"qk_matmul_output_mode {mode} is not 0, 1, 2 or 3")
        outs[3] = Shaped(qk, (nb, hq, sq, total))
    return outs[:len(ctx.node.outputs)]


def _bias(ctx: NodeCtx, nb: int, hq: int, sq: int, total: int, past: int, dtype: str
          ) -> Callable[..., Any] | None:
    """The additive bias ``bias(b, h, i, j)`` of the scores (see :func:`attention`), or None for none."""
    mask = None
    if ctx.has(3):
        ms = ctx.shape(3)
        if not 1 <= len(ms) <= 4 or ms[-1] > total or any(
                n not in (1, want) for n, want in zip(reversed(ms[:-1]), (sq, hq, nb))):
            raise ctx.error(f"attn_mask {list(ms)} does not broadcast to [{nb}, {hq}, {sq}, {total}]")
        mt, is_bool = ctx.tensor(3), ctx.dtype(3) == "bool"
        if not is_bool and ctx.dtype(3) != dtype:
            raise DTypeError(f"{ctx.node}: attn_mask is {ctx.dtype(3)}; it must be bool or {dtype}")

        def mask(b: Any, h: Any, i: Any, j: Any) -> Any:
            full = (b, h, i, j)[4 - len(ms):]
            idx = tuple(0 if n == 1 and d < len(ms) - 1 else x for d, (n, x) in enumerate(zip(ms, full)))
            v = mt[idx]
            v = te.if_then_else(v, te.const(0, dtype), te.const(_NEG_INF, dtype)) if is_bool else v
            return te.if_then_else(j < ms[-1], v, te.const(_NEG_INF, dtype)) if ms[-1] < total else v

    causal = bool(int(ctx.attr("is_causal", 0)))
    left, right = int(ctx.attr("left_window_size", -1)), int(ctx.attr("right_window_size", -1))
    nonpad = ctx.tensor(6) if ctx.has(6) else None
    if nonpad is not None and (ctx.shape(6) != (nb,) or ctx.dtype(6) not in ("int32", "int64")):
        raise ctx.error(f"nonpad_kv_seqlen {list(ctx.shape(6))} ({ctx.dtype(6)}) must be [{nb}] integers")
    if nonpad is not None and past:
        raise ctx.error("nonpad_kv_seqlen cannot be combined with past_key / past_value")
    if mask is None and not causal and left < 0 and right < 0 and nonpad is None:
        return None

    def offset(b: Any) -> Any:
        return te.cast(nonpad[b], "int64") - sq if nonpad is not None else past

    def bias(b: Any, h: Any, i: Any, j: Any) -> Any:
        ok = []
        if causal:
            ok.append(j <= i + offset(b))
        if left >= 0:
            ok.append(i + offset(b) - j <= left)
        if right >= 0:
            ok.append(j - (i + offset(b)) <= right)
        if nonpad is not None:
            ok.append(j < te.cast(nonpad[b], "int64"))
        v = mask(b, h, i, j) if mask is not None else te.const(0, dtype)
        return te.if_then_else(te.all(*ok), v, te.const(_NEG_INF, dtype)) if ok else v

    return bias
