"""com.microsoft's operators of onnxruntime-genai's LLM models: MatMulNBits (4-bit weights in blocks),
SimplifiedLayerNormalization (RMSNorm), SkipSimplifiedLayerNormalization, RotaryEmbedding and
GroupQueryAttention.  The importer gives them cuvil's default domain
(:data:`cuvil.graph.ops.quant_ms.MS_OPS`; RotaryEmbedding shares its name with ONNX's operator, whose
builder hands the com.microsoft form here).

MatMulNBits ``Y = A @ dequantize(B)^T`` (B: N rows of K 4-bit values in blocks of ``block_size``, two
per byte, the low nibble first; ``(q - zero_point) * scale`` per block, the zero point 8 when absent).
The weights stay 4-bit in memory.  B is known when compiling, and its rows are laid out again in panels of
P output columns: four bytes of a row are one int32 word holding k = 8u .. 8u + 7 (value j in bits 4j ..
4j + 3), stored at ``W[n // P, u, n % P]``; each block's scale (and zero point) the same way.  The kernel
is a contraction whose weight operand is decoded in registers (:func:`cuvil.schedule.contraction.
decoded_operands`): the register tile's vector loop loads P contiguous words per step of u and, its 8 steps
of j unrolled, takes value j with two shifts::

    Y[m, n] = sum(u, j) A[m, 8u + j] * float(W[n // P, u, n % P] * 2^(28 - 4j) // 2^28) * S[n // P, b, n % P]

(b = u // (block_size / 8)).  Without zero points each nibble is stored as the 4-bit two's complement of
``q - 8`` (``q ^ 8``), so the shifts sign-extend it and no subtraction is left; with them, value j is
``(w // 2^4j) & 15`` minus the block's zero point (bytes in panels).  Either way the weight is exactly
onnxruntime's ``(q - zp) * scale``.  P is a whole number of vectors: two for a tile of several rows
(prefill), and for one row (decode: a matrix-vector product) as many as the target's multiply-add pipes need
independent accumulators (pipes x latency x 1.5, a power of two, at most a quarter of the vector registers),
fewer when N is not a multiple of them.

A decode step on one core is bound by the arithmetic, not yet by memory: each 16 weights cost a shift pair,
a conversion, the scale's multiplication and the multiply-add (five vector operations); applying the scale
once per block (two nested sums) and int8 activations with an integer dot product are the next steps.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cuvil import te
from cuvil.errors import DTypeError
from cuvil.graph.ops.base import NodeCtx, Shaped, op
from cuvil.graph.ops.rotary import rotated


def _panel(ctx: NodeCtx, m: int, n: int) -> int:
    """The columns of a weight panel: a whole number of vectors (see the module's docstring)."""
    t = ctx.target
    lanes = max(4, (t.vector_bits if t is not None else 128) // 32)
    regs = (t.vector_registers if t is not None else 16) or 16
    if m >= 4 or t is None:
        vecs = 2
    else:  # a register tile of m rows: m * vecs accumulators to cover the multiply-add latency
        want = -(-3 * max(1, t.fma_units) * t.fma_latency // 2)
        vecs = 1 << max(1, (-(-want // m) - 1).bit_length())  # the power of two at or above want / m
        vecs = max(2, min(vecs, regs // 4))
    while vecs > 2 and n % (vecs * lanes) and n % (vecs // 2 * lanes) == 0:
        vecs //= 2
    return vecs * lanes


def _nibbles(v: np.ndarray, count: int) -> np.ndarray:
    """``count`` 4-bit values of each row of packed bytes ``v`` (low nibble first)."""
    lo, hi = v & 15, v >> 4
    return np.stack([lo, hi], axis=-1).reshape(v.shape[0], -1)[:, :count]


@op("MatMulNBits")
def matmul_nbits(ctx: NodeCtx) -> list:
    """``Y = A @ dequantize(B)^T (+ bias)`` with B's 4-bit values unpacked in registers (the module's
    docstring); B, scales and zero points must be initializers."""
    K, N = int(ctx.attr("K", 0)), int(ctx.attr("N", 0))
    bits, bs = int(ctx.attr("bits", 4)), int(ctx.attr("block_size", 0))
    if bits != 4:
        raise ctx.unsupported(f"bits={bits}: cuvil's MatMulNBits takes 4-bit weights")
    if bs < 16 or bs & (bs - 1):
        raise ctx.error(f"block_size {bs} must be a power of two, at least 16")
    if K < 1 or N < 1:
        raise ctx.error(f"the attributes K={K} and N={N} must be positive")
    if K % 8:
        raise ctx.unsupported(f"K={K} is not a multiple of 8: cuvil reads the weights 8 values (a 32-bit word) "
                              "at a time")
    a_dtype = ctx.dtype(0)
    if a_dtype != "float32":
        raise DTypeError(f"{ctx.node}: input A is {a_dtype}; cuvil's MatMulNBits takes float32")
    xs = ctx.shape(0)
    if not xs or xs[-1] != K:
        raise ctx.error(f"input A has shape {list(xs)}; its last dimension must be K={K}")
    nb, blob = -(-K // bs), bs // 2
    if ctx.dtype(1) != "uint8" or ctx.shape(1) != (N, nb, blob):
        raise ctx.error(f"input B is {ctx.dtype(1)} {list(ctx.shape(1))}; expected uint8 [{N}, {nb}, {blob}] "
                        f"(N, K / block_size blocks, block_size / 2 bytes)")
    if ctx.dtype(2) != a_dtype or math.prod(ctx.shape(2)) != N * nb:
        raise ctx.error(f"scales are {ctx.dtype(2)} {list(ctx.shape(2))}; expected {a_dtype} with {N} x {nb} "
                        "values")
    if ctx.has(4) and not _trivial_g_idx(ctx, K, bs):
        raise ctx.unsupported("g_idx other than k // block_size (act-order) is not supported yet")
    if not all(ctx.known(i) for i in (1, 2)) or (ctx.has(3) and not ctx.known(3)):
        raise ctx.unsupported("B, scales and zero_points must be initializers (cuvil lays the weights out "
                              "when compiling)")
    with_bias = ctx.has(5)  # (before ctx.constant adds inputs)
    if with_bias and (ctx.shape(5) != (N,) or ctx.dtype(5) != a_dtype):
        raise ctx.error(f"bias is {ctx.dtype(5)} {list(ctx.shape(5))}; expected {a_dtype} [{N}]")
    scale = np.asarray(ctx.value(2), dtype=np.float32).reshape(N, nb)
    zp = _zero_points(ctx, N, nb)
    M = math.prod(xs[:-1])
    P = _panel(ctx, M, N)
    panels = -(-N // P)
    npad = panels * P
    kp = nb * blob  # bytes per row of B: the K values, the last block padded
    raw = np.zeros((npad, kp), np.uint8)
    raw[:N] = np.asarray(ctx.value(1)).reshape(N, kp)
    if zp is None:  # each nibble as the 4-bit two's complement of q - 8 (q ^ 8): sign-extended, no subtraction
        raw ^= 0x88
    # four bytes of a row, little-endian, are one int32 word of 8 values: k = 8u + j in bits 4j .. 4j + 3
    words = raw.view("<i4").astype(np.int32)
    w = np.ascontiguousarray(words.reshape(panels, P, kp // 4).transpose(0, 2, 1))  # [panel, u, column]
    s = np.zeros((npad, nb), np.float32)
    s[:N] = scale
    S = ctx.constant(np.ascontiguousarray(s.reshape(panels, P, nb).transpose(0, 2, 1)), keyed=False)
    W = ctx.constant(w, keyed=False)
    Z = None
    if zp is not None:  # per (column, block), in panels like the scales (uint8: a quarter of their bytes)
        z = np.full((npad, nb), 8, zp.dtype)
        z[:N] = zp
        Z = ctx.constant(np.ascontiguousarray(z.reshape(panels, P, nb).transpose(0, 2, 1)), keyed=False)
    A = ctx.tensor(0, (M, K))
    u = te.reduce_axis((0, K // 8), name="u")
    j = te.reduce_axis((0, 8), name="j")

    def body(m: Any, n: Any) -> Any:
        word = W[n // P, u, n % P]  # 8 values of column n
        b = u // (bs // 8)
        if Z is None:  # value j sign-extended: shifted to the top bits, then down by 28 (arithmetic)
            v = word // (1 << 28)
            for i in range(7):
                v = te.if_then_else(j == i, (word * (1 << (28 - 4 * i))) // (1 << 28), v)
        else:  # value j: shifted down by 4j and masked, minus its zero point
            q = word & 15
            for i in range(1, 8):
                q = te.if_then_else(j == i, (word // (1 << 4 * i)) & 15, q)
            zero = Z[n // P, b, n % P]
            v = (q - te.cast(zero, "int32") if zero.dtype == "uint8"
                 else te.cast(q, "float32") - zero)  # (float zero points: as given)
        # (j is unrolled: each value a constant shift; the weight is exact, as onnxruntime's)
        return te.sum(A[m, u * 8 + j] * (te.cast(v, "float32") * S[n // P, b, n % P]), axis=[u, j])

    y = te.compute((M, N), body, name="matmul_nbits")
    if with_bias:
        bias = ctx.tensor(5)
        y0 = y
        y = te.compute((M, N), lambda m, n: y0[m, n] + bias[n], name="bias")
    return [Shaped(y, (*xs[:-1], N))]


def _zero_points(ctx: NodeCtx, N: int, nb: int) -> np.ndarray | None:
    """The zero point of each (column, block), [N, blocks]: None when absent (8), else unpacked (uint8:
    two per byte, low nibble first, each column's blocks padded to a whole byte) or as given (float)."""
    if not ctx.has(3):
        return None
    v = np.asarray(ctx.value(3))
    if v.dtype == np.uint8:
        per = -(-nb // 2)
        if v.size != N * per:
            raise ctx.error(f"zero_points has {v.size} bytes; expected {N} x {per} (two 4-bit values a byte)")
        return _nibbles(v.reshape(N, per), nb)
    if v.dtype.name != ctx.dtype(0) or v.size != N * nb:
        raise ctx.error(f"zero_points are {v.dtype.name} with {v.size} values; expected uint8 packed, or "
                        f"{ctx.dtype(0)} with {N} x {nb}")
    return v.reshape(N, nb)


def _trivial_g_idx(ctx: NodeCtx, K: int, bs: int) -> bool:
    """Whether g_idx (input 4) maps each k to its own block ``k // block_size``."""
    if not ctx.known(4):
        return False
    g = np.asarray(ctx.value(4)).reshape(-1)
    return g.size == K and bool(np.array_equal(g, np.arange(K) // bs))


# -- RMSNorm: SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization ------------------------------


def _rms(ctx: NodeCtx, x: Any, rows: int, n: int, eps: float, gamma: Any) -> tuple[Any, Any]:
    """``x * inv * gamma`` over a (rows, n) view and ``inv = 1 / sqrt(mean(x^2) + eps)`` (rows, 1)."""
    r = te.reduce_axis((0, n), name="r")
    ss = te.compute((rows,), lambda i: te.sum(x[i, r] * x[i, r], axis=r), name="sumsq")
    inv = te.compute((rows, 1), lambda i, _: 1.0 / te.sqrt(ss[i] * (1.0 / n) + eps), name="invrms")
    y = te.compute((rows, n), lambda i, j: x[i, j] * inv[i, 0] * gamma(j), name="rmsnorm")
    return y, inv


def _float32(ctx: NodeCtx, inputs: list[int]) -> None:
    for i in inputs:
        if ctx.has(i) and ctx.dtype(i) != "float32":
            raise DTypeError(f"{ctx.node}: input {i} is {ctx.dtype(i)}; cuvil's {ctx.node.op_type} takes float32")


def _wanted(ctx: NodeCtx, i: int) -> bool:
    return len(ctx.node.outputs) > i and bool(ctx.node.outputs[i])


@op("SimplifiedLayerNormalization")
def simplified_layer_norm(ctx: NodeCtx) -> list:
    """onnxruntime's RMSNorm (ai.onnx domain in onnxruntime, com.microsoft accepted too):
    ``Y = X / sqrt(mean(X^2) + epsilon) * scale``, the mean over the axes from ``axis`` (default -1) on;
    the optional second output is ``1 / sqrt(mean(X^2) + epsilon)`` with those axes kept as 1."""
    _float32(ctx, [0, 1])
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
    _float32(ctx, [0, 1, 2, 3])
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


# -- RotaryEmbedding (com.microsoft) --------------------------------------------------------------------


def ms_rotary_embedding(ctx: NodeCtx) -> list:
    """com.microsoft RotaryEmbedding (inputs: input, position_ids, cos_cache, sin_cache; the ONNX
    operator of the same name, opset 23, takes the caches second and the ids last: the registered builder
    in :mod:`cuvil.graph.ops.rotary` tells them apart by input 1's type and sends this one here).

    ``input`` is (B, S, H*D) (``num_heads`` H, or D from the caches: ``2 * cos_cache.shape[1]`` when
    ``rotary_embedding_dim`` is 0) or (B, H, S, D); ``position_ids`` is (B, S), or one value: the position
    of the first token, the others following it.  Pairs ``(k, k + r/2)`` (``(2k, 2k + 1)`` when
    ``interleaved``) of each head's first ``r`` features turn by the angle of ``cos_cache[pos, k]``,
    ``sin_cache[pos, k]``; the rest pass through.  A position past the caches is not checked at run time."""
    _float32(ctx, [0, 2, 3])
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
    _float32(ctx, [0, 1, 2, 3, 4, 7, 8])
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
    T = max(P, total)
    rotary = bool(int(ctx.attr("do_rotary", 0)))
    q_in, k_in, v_in, lens = ctx.tensor(0), ctx.tensor(1), ctx.tensor(2), ctx.tensor(5)
    group = N // KV
    scale = ctx.attr("scale")
    scale = 1.0 / math.sqrt(D) if not scale else float(scale)

    def past_of(b: Any) -> Any:  # the cached tokens of sequence b
        return te.cast(lens[b], "int64") + (1 - S)

    if rotary:
        cs = ctx.shape(7) if ctx.has(7) else ()
        if not ctx.has(8) or len(cs) != 2 or ctx.shape(8) != cs or 2 * cs[1] > D:
            raise ctx.error(f"do_rotary needs cos_cache and sin_cache of shape [positions, rotary dim / 2 <= {D // 2}]")
        half = cs[1]
        cos, sin = ctx.tensor(7), ctx.tensor(8)
        inter = bool(int(ctx.attr("rotary_interleaved", 0)))
        q = te.compute((B, S, N, D), lambda b, s, h, f: _rotate(
            lambda g: q_in[b, s, h * D + g], past_of(b) + s, f, half, 2 * half, cos, sin, inter), name="q_rot")
        k = te.compute((B, S, KV, D), lambda b, s, h, f: _rotate(
            lambda g: k_in[b, s, h * D + g], past_of(b) + s, f, half, 2 * half, cos, sin, inter), name="k_rot")
        q_at = lambda b, s, h, f: q[b, s, h, f]  # noqa: E731
        k_at = lambda b, s, h, f: k[b, s, h, f]  # noqa: E731
    else:
        q_at = lambda b, s, h, f: q_in[b, s, h * D + f]  # noqa: E731
        k_at = lambda b, s, h, f: k_in[b, s, h * D + f]  # noqa: E731
    v_at = lambda b, s, h, f: v_in[b, s, h * D + f]  # noqa: E731
    past_k = ctx.tensor(3) if P else None
    past_v = ctx.tensor(4) if P else None
    zero = te.const(0.0, "float32")

    def present(new: Any, past: Any, name: str) -> Any:
        def body(b: Any, h: Any, t: Any, f: Any) -> Any:
            pb = past_of(b)
            s = te.min(te.max(t - pb, 0), S - 1)  # (clamped: read only where selected)
            fresh = te.if_then_else(t < pb + S, new(b, s, h, f), zero)
            if past is None:
                return fresh
            return te.if_then_else(t < pb, past[b, h, te.min(t, P - 1), f], fresh)

        return te.compute((B, KV, T, D), body, name=name)

    pk, pv = present(k_at, past_k, "present_key"), present(v_at, past_v, "present_value")
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
