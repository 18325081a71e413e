"""Recognising contractions from their accesses (used by the automatic scheduler).

A *contraction* is a stage ``C[...] = sum(X[...] * Y[...])``. The register
tile of the auto-scheduler needs two of its output axes:

- ``j``, the tile's columns, vectorised: one operand (the *vector* operand)
  reads ``j`` with unit stride, the other (the *broadcast* operand) does not
  read it at all;
- ``i``, the tile's rows, unrolled: only the broadcast operand reads it.

matmul ``A[i, k] * B[k, j]`` has one such pair; conv2d
``X[n, c, y + ry, x + rx] * W[f, c, ry, rx]`` has two: ``j = x`` (``X`` read
with unit stride, ``W`` broadcast, ``i = f``) and ``j = f`` (``W`` is read at
``f`` in its first dimension, so it is unit stride only once packed into
panels ``W.p[f // NR, c, ry, rx, f % NR]``; ``X`` broadcast, ``i = x``).
:func:`contraction_candidates` lists every pair, :func:`find_contraction` the
first one that needs no packing. Which one pays is the scheduler's choice.
"""

from __future__ import annotations

from dataclasses import dataclass

from cuvil import dtype as dt
from cuvil.ir.expr import DOT_CALLS, Binary, Call, Cast, Expr, IterVar, Reduce, TensorRead
from cuvil.ir.functor import free_vars, walk
from cuvil.schedule.axes import const_int
from cuvil.te.tensor import ComputeOp


@dataclass(frozen=True)
class Contraction:
    """What the register tile needs to know about a contraction stage."""

    i: IterVar  # output axis of the tile's rows (read by the broadcast operand only)
    j: IterVar  # output axis of the tile's columns (unit stride in the vector operand)
    vector: TensorRead
    broadcast: TensorRead
    pack_dim: int | None = None  # the vector operand's dimension indexed by j, when it must be packed
    panel: int | None = None  # the vector operand is already packed: read at [..., j // panel, ..., j % panel]


def product_operands(body: Expr) -> tuple[TensorRead, TensorRead] | None:
    """The two reads of ``sum(X[...] * Y[...])``, ``sum(dot4(X[...], Y[...]))`` or
    ``sum(dot2_bf16(X[...], Y[...]))`` (casts around them allowed), or None."""
    if not isinstance(body, Reduce) or body.name != "sum" or body.where is not None:
        return None
    src = body.source
    while isinstance(src, Cast):
        src = src.value
    if isinstance(src, Call) and src.name in DOT_CALLS:  # packed steps at once: dot4 (int8), dot2_bf16
        args = src.args
    elif isinstance(src, Binary) and src.op == "mul":
        args = (src.a, src.b)
    else:
        return None
    ops = []
    for x in args:
        while isinstance(x, Cast):
            x = x.value
        if not isinstance(x, TensorRead):
            return None
        ops.append(x)
    return ops[0], ops[1]


def _decoded(x: Expr) -> tuple[TensorRead, list[TensorRead]] | None:
    """An operand that is an element-wise expression of reads, not a bare read: 4-bit weights unpacked
    and scaled in registers, ``float(value j of W[n // P, u, n % P]) * S[n // P, b, n % P]`` (MatMulNBits:
    :mod:`cuvil.graph.ops.quant.nbits`).  Its reads, and the read of the largest tensor among them, which
    stands for the operand (the weights; the scales beside them are a 16th of their elements or less),
    which must be of an integer type decoded to floats (an expression of float reads, such as a padded
    input inlined into a convolution, is left to the other strategies).  No reduction inside."""
    reads = [n for n in walk(x) if isinstance(n, TensorRead)]
    if not reads or any(isinstance(n, Reduce) for n in walk(x)):
        return None

    def size(r: TensorRead) -> int:
        n = 1
        for d in r.tensor.shape:
            c = const_int(d)
            n *= c if c is not None else 1 << 30
        return n

    rep = max(reads, key=size)
    if not dt.is_int(rep.tensor.dtype) or dt.is_int(x.dtype):
        return None  # codes decoded to numbers only (not a padded input inlined into a convolution)
    return rep, reads


def decoded_operands(body: Expr) -> tuple[tuple[TensorRead, list[TensorRead]], ...] | None:
    """``sum(X * D)`` where either factor may be a decoded operand (:func:`_decoded`): per factor, the read
    standing for it and all its reads (a bare read: itself alone), or None.  Only the CPU register tile
    takes decoded operands (its vector loop computes the decoding once per tile column and step)."""
    if not isinstance(body, Reduce) or body.name != "sum" or body.where is not None:
        return None
    src = body.source
    while isinstance(src, Cast):
        src = src.value
    if not (isinstance(src, Binary) and src.op == "mul"):
        return None
    out = []
    for x in (src.a, src.b):
        while isinstance(x, Cast):
            x = x.value
        d = (x, [x]) if isinstance(x, TensorRead) else _decoded(x)
        if d is None:
            return None
        out.append(d)
    return tuple(out)


def _uses(e: Expr, v: IterVar) -> bool:
    return any(x is v for x in free_vars(e))


def unit_stride_last(read: TensorRead, v: IterVar, most: int = 1) -> bool:
    """The last index of ``read`` is ``v + (terms without v)``, and no other index uses ``v``; with ``most``
    > 1, ``k * v + (terms without v)`` for ``1 <= k <= most`` too."""
    if any(_uses(ix, v) for ix in read.indices[:-1]):
        return False
    last = read.indices[-1]
    if last is v:
        return True
    from cuvil.ir.simplify import linear_form

    lin = linear_form(last)
    if lin is None:
        return False
    coef = [k for t, k in lin[0].values() if t is v]
    others = [t for t, k in lin[0].values() if t is not v and k]
    return len(coef) == 1 and 1 <= coef[0] <= most and not any(_uses(t, v) for t in others)


def _packable_dim(read: TensorRead, v: IterVar) -> int | None:
    """The dimension of a tensor of constant shape that ``read`` indexes with exactly ``v`` (and no other
    dimension uses ``v``): packing the tensor with that dimension last makes ``v`` unit stride (the
    scheduler decides whether the tensor can be packed: an input, or a stage computed on its own)."""
    t = read.tensor
    if any(const_int(d) is None for d in t.shape):
        return None
    dims = [d for d, ix in enumerate(read.indices) if _uses(ix, v)]
    if len(dims) != 1 or read.indices[dims[0]] is not v or not all(isinstance(ix, IterVar) for ix in read.indices):
        return None
    return dims[0]


def panel_width(read: TensorRead, v: IterVar) -> int | None:
    """P when ``read`` is a packed operand ``T[..., v // P, ..., v % P]`` (``v % P`` last, no other use of
    ``v``): within a panel of P columns ``v`` is unit stride, so a register tile of P columns needs no
    packing (weights packed once, at compile time)."""
    from cuvil.ir.expr import Binary, Const

    last = read.indices[-1]
    if not (isinstance(last, Binary) and last.op == "floormod" and last.a is v and isinstance(last.b, Const)):
        return None
    p = int(last.b.value)
    uses = [ix for ix in read.indices[:-1] if _uses(ix, v)]
    if p < 1 or len(uses) != 1:
        return None
    q = uses[0]
    ok = isinstance(q, Binary) and q.op == "floordiv" and q.a is v and isinstance(q.b, Const) and int(q.b.value) == p
    return p if ok else None


def contraction_candidates(op: ComputeOp) -> list[Contraction]:
    """Every (vector operand, j) pair of ``op`` with the innermost admissible i, unpacked ones first."""
    pair = product_operands(op.body)
    decoded = decoded_operands(op.body) if pair is None else None
    if pair is None and decoded is None:
        return []
    if decoded is not None:  # a decoded operand: its reads must all allow the tile (checked below)
        pair = (decoded[0][0], decoded[1][0])
        every = {id(decoded[0][0]): decoded[0][1], id(decoded[1][0]): decoded[1][1]}
    else:
        every = {id(pair[0]): [pair[0]], id(pair[1]): [pair[1]]}
    unpacked: list[Contraction] = []
    packed: list[Contraction] = []
    for vec, bc in (pair, pair[::-1]):
        for j in reversed(op.axis):
            if const_int(j.extent) is None or any(_uses(ix, j) for r in every[id(bc)] for ix in r.indices):
                continue
            panel = panel_width(vec, j)
            natural = unit_stride_last(vec, j) or panel is not None
            pack_dim = None if natural or decoded is not None else _packable_dim(vec, j)
            if pack_dim is None and not natural:
                continue
            if decoded is not None and not all(  # each read of the decoded operand: in the panel, or not along j
                    not any(_uses(ix, j) for ix in r.indices) or panel_width(r, j) == panel
                    or (panel is None and unit_stride_last(r, j)) for r in every[id(vec)]):
                continue
            for i in reversed(op.axis):
                if i is j or const_int(i.extent) is None:
                    continue
                if any(_uses(ix, i) for r in every[id(vec)] for ix in r.indices) or \
                        not any(_uses(ix, i) for ix in bc.indices):
                    continue
                (unpacked if pack_dim is None else packed).append(Contraction(i, j, vec, bc, pack_dim, panel))
                break
    return unpacked + packed


def find_contraction(op: ComputeOp) -> Contraction | None:
    """The first contraction pair of ``op`` that needs no packing (None: not a contraction)."""
    return next((c for c in contraction_candidates(op) if c.pack_dim is None), None)
