"""ONNX Einsum: one te reduction over the summed letters of the equation.

``"bij,bjk->bik"`` names each input's axes by letters; the output keeps the letters after ``->`` and
sums the product of the inputs over every other letter.  Without ``->`` the output is the letters
that appear exactly once, in alphabetical order.  A letter repeated within one term reads a diagonal
(``"ii->i"``).  ``...`` stands for the same run of leading (broadcast) axes in every term.  When every
input is known at compile time, the graph compiler runs the kernel once and keeps the result.
"""

from __future__ import annotations

import math
import string
from typing import Any

import numpy as np

from cuvil import dtype as dt
from cuvil import te
from cuvil.errors import DTypeError
from cuvil.graph.ops.base import NodeCtx, op

_LETTERS = set(string.ascii_letters)


def _parse(ctx: NodeCtx, shapes: list[tuple[int, ...]]) -> tuple[list[list[str]], list[str], dict[str, int]]:
    """Each input's axes and the output's as lists of letters (``...`` spelled as digits "0", "1"...
    that stand for broadcast axes), and every letter's size."""
    eq = ctx.attr("equation")
    eq = (eq.decode() if isinstance(eq, bytes) else str(eq)).replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        raise ctx.error(f"equation {eq!r} has {len(terms)} input terms for {len(shapes)} inputs")
    n_ell = 0
    for t, s in zip(terms, shapes):
        if "..." in t:
            n_ell = max(n_ell, len(s) - (len(t) - 3))
    ell = [str(d) for d in range(n_ell)]  # the broadcast axes, outermost first

    def expand(term: str, rank: int | None) -> list[str]:
        head, dots, tail = term.partition("...")
        if any(c not in _LETTERS for c in head + tail) or "." in tail:
            raise ctx.error(f"equation {eq!r}: term {term!r} has characters other than letters and one '...'")
        if not dots:
            return list(head)
        n = n_ell if rank is None else rank - len(head) - len(tail)
        if n < 0:
            raise ctx.error(f"equation {eq!r}: term {term!r} has more letters than its input has axes ({rank})")
        return list(head) + ell[n_ell - n:] + list(tail)

    ins = [expand(t, len(s)) for t, s in zip(terms, shapes)]
    sizes: dict[str, int] = {}
    for axes, s in zip(ins, shapes):
        if len(axes) != len(s):
            raise ctx.error(f"equation {eq!r}: a term names {len(axes)} axes for an input of shape {list(s)}")
        for a, n in zip(axes, s):
            old = sizes.get(a)
            if old is not None and old != n and not (a.isdigit() and 1 in (old, n)):
                raise ctx.error(f"equation {eq!r}: axis {a!r} has sizes {old} and {n}")
            sizes[a] = n if old is None or old == 1 else old
    if arrow:
        out = expand(rhs, None)
        for a in out:
            if a not in sizes:
                raise ctx.error(f"equation {eq!r}: output axis {a!r} appears in no input")
        if len(set(out)) != len(out):
            raise ctx.error(f"equation {eq!r}: an output axis is repeated")
    else:
        letters = [c for axes in ins for c in axes if not c.isdigit()]
        out = ell + sorted(c for c in set(letters) if letters.count(c) == 1)
    return ins, out, sizes


@op("Einsum")
def einsum(ctx: NodeCtx) -> list:
    """``out[o] = sum over the other letters of prod_k input_k[its letters]`` (see the module)."""
    ins_i = list(range(ctx.n_inputs))
    if not ins_i:
        raise ctx.error("Einsum needs at least one input")
    dtypes = {ctx.dtype(i) for i in ins_i}
    if len(dtypes) > 1:
        raise DTypeError(f"{ctx.node}: inputs have different dtypes ({', '.join(sorted(dtypes))})")
    dtype = dtypes.pop()
    if not (dt.is_float(dtype) or dt.is_int(dtype)):
        raise DTypeError(f"{ctx.node}: Einsum of {dtype} tensors")
    shapes = [ctx.shape(i) for i in ins_i]
    ins, out_axes, sizes = _parse(ctx, shapes)
    out_shape = tuple(sizes[a] for a in out_axes)
    summed = [a for a in dict.fromkeys(c for axes in ins for c in axes) if a not in out_axes]
    if math.prod(out_shape) == 0 or any(sizes[a] == 0 for a in summed):
        return [np.zeros(out_shape, dtype)]
    xs = [ctx.tensor(i) for i in ins_i]
    red = {a: te.reduce_axis((0, sizes[a]), name=f"r_{a}" if a.isalpha() else f"r{a}") for a in summed}

    def body(*o: Any) -> Any:
        where = dict(zip(out_axes, o))
        where.update(red)
        prod: Any = None
        for x, axes, s in zip(xs, ins, shapes):
            # a broadcast axis of size 1 reads index 0
            v = x[tuple(0 if a.isdigit() and n == 1 and sizes[a] != 1 else where[a] for a, n in zip(axes, s))]
            prod = v if prod is None else prod * v
        return te.sum(prod, axis=list(red.values())) if red else prod

    return [te.compute(out_shape, body, name="einsum")]
