"""com.microsoft's MatMulNBits (4-bit weights in blocks), of onnxruntime-genai's LLM models: a weight-only
quantised matrix product.  The importer gives it cuvil's default domain (:data:`cuvil.graph.ops.quant.ms.MS_OPS`);
the models' float operators are :mod:`cuvil.graph.ops.nn.llm`.

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


def _panel(ctx: NodeCtx, m: int, n: int) -> int:
    """The columns of a weight panel: a whole number of vectors (see the module's docstring)."""
    t = ctx.target
    lanes = t.panel_lanes(4) if t is not None else 4
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
    K, N, bs = _checked(ctx)
    with_bias = ctx.has(5)  # (before ctx.constant adds inputs)
    xs = ctx.shape(0)
    M = math.prod(xs[:-1])
    P = _panel(ctx, M, N)
    W, S, Z = _packed(ctx, K, N, bs, P)
    A = ctx.tensor(0, (M, K))
    u = te.reduce_axis((0, K // 8), name="u")
    j = te.reduce_axis((0, 8), name="j")

    def body(m: Any, n: Any) -> Any:
        b = u // (bs // 8)
        v = _value(W[n // P, u, n % P], j, None if Z is None else Z[n // P, b, n % P])
        # (j is unrolled: each value a constant shift; the weight is exact, as onnxruntime's)
        return te.sum(A[m, u * 8 + j] * (te.cast(v, "float32") * S[n // P, b, n % P]), axis=[u, j])

    y = te.compute((M, N), body, name="matmul_nbits")
    if with_bias:
        bias = ctx.tensor(5)
        y0 = y
        y = te.compute((M, N), lambda m, n: y0[m, n] + bias[n], name="bias")
    return [Shaped(y, (*xs[:-1], N))]


def _checked(ctx: NodeCtx) -> tuple[int, int, int]:
    """Step 1: K, N and block_size, with the inputs checked against them."""
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
    if ctx.has(5) and (ctx.shape(5) != (N,) or ctx.dtype(5) != a_dtype):
        raise ctx.error(f"bias is {ctx.dtype(5)} {list(ctx.shape(5))}; expected {a_dtype} [{N}]")
    return K, N, bs


def _packed(ctx: NodeCtx, K: int, N: int, bs: int, P: int) -> tuple[Any, Any, Any]:
    """Step 2: B, its scales and its zero points (None without them) laid out in panels of ``P`` columns, as
    constants of the kernel: ``W[n // P, u, n % P]`` (int32 words of 8 values), ``S`` and ``Z`` per block."""
    nb, blob = -(-K // bs), bs // 2
    scale = np.asarray(ctx.value(2), dtype=np.float32).reshape(N, nb)
    zp = _zero_points(ctx, N, nb)
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
    return W, S, Z


def _value(word: Any, j: Any, zero: Any) -> Any:
    """Value ``j`` (0 .. 7) of a 32-bit ``word``: without a zero point sign-extended (shifted to the top bits,
    then down by 28, arithmetic); with one, shifted down by 4j and masked, minus the zero point."""
    if zero is None:
        v = word // (1 << 28)
        for i in range(7):
            v = te.if_then_else(j == i, (word * (1 << (28 - 4 * i))) // (1 << 28), v)
        return v
    q = word & 15
    for i in range(1, 8):
        q = te.if_then_else(j == i, (word // (1 << 4 * i)) & 15, q)
    return (q - te.cast(zero, "int32") if zero.dtype == "uint8"
            else te.cast(q, "float32") - zero)  # (float zero points: as given)


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
