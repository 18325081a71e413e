"""ONNX RotaryEmbedding (opset 23): rotary position embeddings, as LLaMA-style decoders apply them to
queries and keys."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from cuvil import dtype as dt
from cuvil import te
from cuvil.errors import DTypeError
from cuvil.graph.ops.base import NodeCtx, float32_inputs, op


@op("RotaryEmbedding")
def rotary_embedding(ctx: NodeCtx) -> list:
    """Rotate pairs of features of each head by a per-position angle.

    ``input`` is (B, H, S, D) or (B, S, H*D) with ``num_heads``; the first ``r = rotary_embedding_dim``
    (default D) features of each head rotate, the rest pass through.  The pairs are ``(k, k + r/2)``,
    or ``(2k, 2k + 1)`` when ``interleaved``; pair k at position (b, s) turns by the angle whose cosine
    and sine are ``cos_cache[pos, k]`` and ``sin_cache[pos, k]``, ``pos = position_ids[b, s]`` (caches of
    shape (max position, r/2)), or ``cos_cache[b, s, k]`` without position ids::

        out[first] = cos * x[first] - sin * x[second];   out[second] = sin * x[first] + cos * x[second]

    A position id out of the cache's range reads outside it (not checked at run time yet).
    """
    if ctx.has(1) and dt.is_int(ctx.dtype(1)):  # com.microsoft's operator: position_ids second
        return ms_rotary_embedding(ctx)
    xs = ctx.shape(0)
    dtype = ctx.dtype(0)
    if not dt.is_float(dtype):
        raise DTypeError(f"{ctx.node}: input 0 is {dtype}; RotaryEmbedding needs a float tensor")
    for i in (1, 2):
        if ctx.dtype(i) != dtype:
            raise DTypeError(f"{ctx.node}: input {i} is {ctx.dtype(i)}, input 0 is {dtype}")
    interleaved = bool(int(ctx.attr("interleaved", 0)))
    if len(xs) == 4:
        b, _, s, d = xs
    elif len(xs) == 3:
        heads = int(ctx.attr("num_heads", 0))
        if heads < 1 or xs[2] % heads:
            raise ctx.error(f"a 3-D input {list(xs)} needs num_heads dividing its last dimension, got {heads}")
        b, s, d = xs[0], xs[1], xs[2] // heads
    else:
        raise ctx.error(f"the input {list(xs)} must be 3-D (B, S, H*D) or 4-D (B, H, S, D)")
    r = int(ctx.attr("rotary_embedding_dim", 0)) or d
    if r % 2 or r > d:
        raise ctx.error(f"rotary_embedding_dim {r} must be even and at most the head size {d}")
    half = r // 2
    with_ids = ctx.has(3)
    for i in (1, 2):
        cs = ctx.shape(i)
        if (len(cs) != 2 if with_ids else cs != (b, s, half)) or cs[-1] != half:
            want = f"[positions, {half}]" if with_ids else f"[{b}, {s}, {half}]"
            raise ctx.error(f"input {i} has shape {list(cs)}; expected {want}")
    x, cos, sin = ctx.tensor(0), ctx.tensor(1), ctx.tensor(2)
    ids = ctx.tensor(3) if with_ids else None
    if with_ids and ctx.shape(3) != (b, s):
        raise ctx.error(f"position_ids {list(ctx.shape(3))} must have shape [{b}, {s}]")

    def angle(bi: Any, si: Any, k: Any) -> tuple[Any, Any]:
        if ids is not None:
            pos = te.cast(ids[bi, si], "int64")
            return cos[pos, k], sin[pos, k]
        return cos[bi, si, k], sin[bi, si, k]

    return [rotated(x, xs, d, r, interleaved, angle)]


def rotated(x: Any, xs: tuple[int, ...], d: int, r: int, interleaved: bool,
            angle: Callable[[Any, Any, Any], tuple[Any, Any]]) -> Any:
    """``x`` (of shape ``xs``: (B, H, S, D), or (B, S, H*D) with heads of ``d`` features) with the first ``r``
    features of each head turned pair by pair, pair ``k`` at batch ``b`` and position ``s`` by the angle
    whose cosine and sine are ``angle(b, s, k)``; the other features pass through.  Pairs are ``(k, k +
    r/2)``, or ``(2k, 2k + 1)`` when ``interleaved`` (ONNX's RotaryEmbedding and com.microsoft's share it)."""
    half = r // 2

    def body(*i: Any) -> Any:
        if len(xs) == 4:
            bi, si, f = i[0], i[2], i[3]
            at = lambda g: (i[0], i[1], i[2], g)  # noqa: E731
        else:
            bi, si, f = i[0], i[1], i[2] % d
            at = lambda g: (i[0], i[1], i[2] - f + g)  # noqa: E731
        if interleaved:
            k, second = (f // 2) % half, f % 2 == 1  # (% half: in range where f >= r passes through)
            first_f, second_f = f - f % 2, f - f % 2 + 1
        else:
            k, second = f % half, f >= half
            first_f, second_f = f % half, f % half + half
        c, sn = angle(bi, si, k)
        x1, x2 = x[at(first_f)], x[at(second_f)]
        out = te.if_then_else(second, sn * x1 + c * x2, c * x1 - sn * x2)
        return te.if_then_else(f < r, out, x[i]) if r < d else out

    return te.compute(xs, body, name="rotary")


# -- RotaryEmbedding (com.microsoft) --------------------------------------------------------------------


def ms_rotary_embedding(ctx: NodeCtx) -> list:
    """com.microsoft RotaryEmbedding (inputs: input, position_ids, cos_cache, sin_cache; the ONNX
    operator of the same name, opset 23, takes the caches second and the ids last: the registered builder
    in :mod:`cuvil.graph.ops.nn.rotary` tells them apart by input 1's type and sends this one here).

    ``input`` is (B, S, H*D) (``num_heads`` H, or D from the caches: ``2 * cos_cache.shape[1]`` when
    ``rotary_embedding_dim`` is 0) or (B, H, S, D); ``position_ids`` is (B, S), or one value: the position
    of the first token, the others following it.  Pairs ``(k, k + r/2)`` (``(2k, 2k + 1)`` when
    ``interleaved``) of each head's first ``r`` features turn by the angle of ``cos_cache[pos, k]``,
    ``sin_cache[pos, k]``; the rest pass through.  A position past the caches is not checked at run time."""
    float32_inputs(ctx, [0, 2, 3])
    if ctx.dtype(1) not in ("int64", "int32"):
        raise DTypeError(f"{ctx.node}: position_ids are {ctx.dtype(1)}; expected int64")
    xs = ctx.shape(0)
    cs = ctx.shape(2)
    if len(cs) != 2 or ctx.shape(3) != cs:
        raise ctx.error(f"cos_cache {list(cs)} and sin_cache {list(ctx.shape(3))} must both be [positions, "
                        "rotary dim / 2]")
    half = cs[1]
    r = int(ctx.attr("rotary_embedding_dim", 0)) or 2 * half
    if r != 2 * half:
        raise ctx.error(f"rotary_embedding_dim {r} must be twice the caches' last dimension {half}")
    heads = int(ctx.attr("num_heads", 0))
    if len(xs) == 4:
        b, _, s, d = xs
    elif len(xs) == 3:
        b, s = xs[0], xs[1]
        d = xs[2] // heads if heads else r
        if d < 1 or xs[2] % d:
            raise ctx.error(f"a 3-D input {list(xs)} needs num_heads dividing its last dimension, got {heads}")
    else:
        raise ctx.error(f"the input {list(xs)} must be 3-D (B, S, H*D) or 4-D (B, H, S, D)")
    if r > d:
        raise ctx.error(f"the rotary dimension {r} exceeds the head size {d}")
    ps = ctx.shape(1)
    if ps not in ((b, s), (1,)) and math.prod(ps) != 1:
        raise ctx.error(f"position_ids {list(ps)} must be [{b}, {s}] or one value")
    one = math.prod(ps) == 1
    x, cos, sin = ctx.tensor(0), ctx.tensor(2), ctx.tensor(3)
    ids = ctx.tensor(1, (1,) if one else (b, s))
    interleaved = bool(int(ctx.attr("interleaved", 0)))

    def angle(bi: Any, si: Any, k: Any) -> tuple[Any, Any]:
        pos = te.cast(ids[0], "int64") + si if one else te.cast(ids[bi, si], "int64")
        return cos[pos, k], sin[pos, k]

    return [rotated(x, xs, d, r, interleaved, angle)]
