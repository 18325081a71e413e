"""Loop axes of a stage: splits, fuses, and the value of every leaf loop.

A stage starts with one loop per te axis (data axes, then reduction axes).
``split`` and ``fuse`` derive new axes; each derived axis is an
:class:`~cuvil.ir.expr.IterVar` whose *value* is an expression over the
original axes::

    split(i, 8):   i.outer = (i - i.min) // 8,   i.inner = (i - i.min) % 8
    fuse(a, b):    a.b.fused = (a - a.min) * extent(b) + (b - b.min)

The schedule maps each statement instance to the values of the stage's leaf
loops (in order); isl then generates the loops.
"""

from __future__ import annotations

from dataclasses import dataclass

from cuvil.ir import expr as E
from cuvil.ir.expr import Const, Expr, IterVar
from cuvil.ir.functor import free_vars
from cuvil.ir.simplify import simplify_expr


@dataclass(frozen=True, eq=False)
class Split:
    parent: IterVar
    outer: IterVar
    inner: IterVar
    factor: Expr  # extent of inner


@dataclass(frozen=True, eq=False)
class Fuse:
    outer: IterVar
    inner: IterVar
    fused: IterVar


Relation = Split | Fuse


def derived(name: str, extent: Expr, kind: str) -> IterVar:
    return IterVar("int64", name, E.const(0, "int64"), simplify_expr(extent), kind)


def leaf_values(roots: tuple[IterVar, ...], relations: list[Relation]) -> dict[int, Expr]:
    """id(axis) -> its value over the original axes, for every axis ever derived."""
    val: dict[int, Expr] = {id(a): a for a in roots}
    for r in relations:
        if isinstance(r, Split):
            base = val[id(r.parent)] - r.parent.min
            val[id(r.outer)] = simplify_expr(base // r.factor)
            val[id(r.inner)] = simplify_expr(base % r.factor)
        else:
            o = val[id(r.outer)] - r.outer.min
            i = val[id(r.inner)] - r.inner.min
            val[id(r.fused)] = simplify_expr(o * r.inner.extent + i)
    return val


def original_from_leaves(roots: tuple[IterVar, ...], relations: list[Relation],
                         leaves: list[IterVar], every: bool = False) -> dict[int, Expr]:
    """The inverse map: each original axis (with ``every``, each axis a relation derives from, too) as an
    expression of the leaf axes."""
    expr: dict[int, Expr] = {id(a): a for a in leaves}
    for r in reversed(relations):
        if isinstance(r, Split):
            if id(r.outer) in expr and id(r.inner) in expr:
                expr[id(r.parent)] = simplify_expr(r.parent.min + expr[id(r.outer)] * r.factor + expr[id(r.inner)])
        else:
            if id(r.fused) in expr:
                f = expr[id(r.fused)]
                expr[id(r.outer)] = simplify_expr(r.outer.min + f // r.inner.extent)
                expr[id(r.inner)] = simplify_expr(r.inner.min + f % r.inner.extent)
    return expr if every else {id(a): expr[id(a)] for a in roots if id(a) in expr}


def depends_on(value: Expr, axes: tuple[IterVar, ...]) -> bool:
    ids = {id(a) for a in axes}
    return any(id(v) in ids for v in free_vars(value))


def const_int(e: Expr) -> int | None:
    e = simplify_expr(e)
    return int(e.value) if isinstance(e, Const) else None
