"""Data-dependent guards become loop bounds (a pure pass on the loop IR).

A reduction whose ``where=`` reads its bounds from a tensor (an embedding bag: row ``i`` belongs to bag
``b`` when ``starts[b] <= i < ends[b]``) lowers to a guard inside the loops; isl cannot turn a bound read
from memory into a loop bound, so every bag would visit every row.  This pass does it after lowering:

1. an ``if`` that does not depend on its loop's variable, and whose buffers the loop does not write, is
   moved out of the loop (unswitching; only ``serial`` and ``vectorize`` loops);
2. a ``serial`` loop whose whole body is ``if (lo <= i & i < hi & rest)`` over its variable ``i``, with
   ``lo`` and ``hi`` read from memory and free of ``i``, runs over ``[max(min, lo), min(min + extent, hi))``
   (``rest`` stays a guard)::

    for (b = 0; b < 8; b++) {                        for (b = 0; b < 8; b++) {
      for (i = 0; i < 24; i++) {                       for (i = max(0, st[b]); i < min(24, en[b]); i++) {
        vectorize for (d = 0; d < 8; d++) {     ->       vectorize for (d = 0; d < 8; d++) {
          if (st[b] <= i & i < en[b]) {                    out[b, d] = out[b, d] + W[idx[i], d];
            out[b, d] = out[b, d] + W[idx[i], d];        }
          }                                            }
        }                                            }
      }
    }

The new range is a subset of the old one, so every access the lowering proved in bounds stays proved.
Guards that read no memory are isl's business (it splits the loops itself) and are left alone.
"""

from __future__ import annotations

from cuvil.ir import expr as E
from cuvil.ir.expr import Binary, Expr, Load, TensorRead, Var
from cuvil.ir.functor import StmtMutator, collect, free_vars
from cuvil.ir.stmt import For, If, LoweredFunc, Stmt, Store, block, sub_stmts

_UNSWITCH_KINDS = ("serial", "vectorize")


def bound_guarded_loops(func: LoweredFunc) -> LoweredFunc:
    """``func`` with data-dependent guards hoisted out of loops and turned into loop bounds."""
    body = _BoundGuards().visit_stmt(func.body)
    if body is func.body:
        return func
    return LoweredFunc(func.name, func.params, body, func.size_vars, func.outputs, func.checks, func.entry_checks)


class _BoundGuards(StmtMutator):
    """Inner loops first: each loop, its body done, is bounded (:func:`_bound`) or unswitched."""

    def make_block(self, stmts: tuple[Stmt, ...]) -> Stmt:
        return block(stmts)

    def visit_For(self, s: For) -> Stmt:
        body = self.visit_stmt(s.body)
        loop = s if body is s.body else For(s.var, s.min, s.extent, body, s.kind)
        return _bound(loop) or _unswitch(loop) or loop


def _reads_memory(e: Expr) -> bool:
    return bool(collect(e, lambda n: isinstance(n, (Load, TensorRead))))


def _uses(e: Expr, v: Var) -> bool:
    return any(x is v for x in free_vars(e))


def _written(s: Stmt) -> set[int]:
    """ids of the buffers ``s`` stores to."""
    if isinstance(s, Store):
        return {id(s.buffer)}
    out: set[int] = set()
    for x in sub_stmts(s):
        out |= _written(x)
    return out


def _read_buffers(e: Expr) -> set[int]:
    return {id(n.buffer) for n in collect(e, lambda n: isinstance(n, Load))}


def _invariant(e: Expr, loop: For) -> bool:
    """``e`` has the same value in every iteration of ``loop``."""
    return not _uses(e, loop.var) and not (_read_buffers(e) & _written(loop.body)) and not collect(
        e, lambda n: isinstance(n, TensorRead))


def _unswitch(loop: For) -> Stmt | None:
    """``for v { if (c) S }`` -> ``if (c) { for v { S } }`` when ``c`` reads memory and is invariant."""
    body = loop.body
    if loop.kind not in _UNSWITCH_KINDS or not isinstance(body, If) or body.else_body is not None:
        return None
    if not _reads_memory(body.cond) or not _invariant(body.cond, loop):
        return None
    return If(body.cond, For(loop.var, loop.min, loop.extent, body.then_body, loop.kind))


def _conjuncts(c: Expr) -> list[Expr]:
    if isinstance(c, Binary) and c.op == "and" and c.dtype == "bool":
        return _conjuncts(c.a) + _conjuncts(c.b)
    return [c]


def _bound(loop: For) -> Stmt | None:
    """``for (i in [m, m + n)) if (lo <= i & i < hi & rest) S`` -> ``for (i in [max(m, lo), min(m + n, hi)))
    if (rest) S`` where ``lo`` / ``hi`` read memory and are invariant."""
    body = loop.body
    if loop.kind != "serial" or not isinstance(body, If) or body.else_body is not None:
        return None
    v = loop.var
    lows: list[Expr] = []
    highs: list[Expr] = []
    rest: list[Expr] = []
    for t in _conjuncts(body.cond):
        side = _side(t, v, loop)
        if side is None:
            rest.append(t)
        elif side[0] == "lo":
            lows.append(side[1])
        else:
            highs.append(side[1])
    if not lows and not highs:
        return None
    lo, hi = loop.min, loop.min + loop.extent
    for x in lows:
        lo = E.maximum(lo, x)
    for x in highs:
        hi = E.minimum(hi, x)
    inner = body.then_body
    if rest:
        cond = rest[0]
        for t in rest[1:]:
            cond = E.binary("and", cond, t)
        inner = If(cond, inner)
    return For(v, lo, E.maximum(hi - lo, E.const(0, v.dtype)), inner, loop.kind)


def _side(t: Expr, v: Var, loop: For) -> tuple[str, Expr] | None:
    """``("lo", x)`` for ``x <= v`` (``v >= x``, ``x < v + ...`` not), ``("hi", x)`` for ``v < x``
    (``x > v``, ``v <= x`` as ``x + 1``), where ``x`` reads memory, is invariant and has ``v``'s dtype."""
    if not isinstance(t, Binary) or t.op not in ("lt", "le", "gt", "ge"):
        return None
    op, a, b = t.op, t.a, t.b
    if b is v and a is not v:  # put v on the left
        op, a, b = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}[op], b, a
    if a is not v or b.dtype != v.dtype or not _reads_memory(b) or not _invariant(b, loop):
        return None
    one = E.const(1, v.dtype)
    return {"ge": ("lo", b), "gt": ("lo", b + one), "lt": ("hi", b), "le": ("hi", b + one)}[op]
