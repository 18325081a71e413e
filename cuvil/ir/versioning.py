"""Full tiles apart from tails (a pure pass on the loop IR).

A split that does not divide its loop leaves a tail: isl bounds the inner
loops with ``min(32, N - 32 * j.outer)``.  Such a bound keeps a vectorised or
unrolled loop from having a constant extent, and a register tile from living
in registers (serial loops are left alone: versioning them only doubles code).
This pass versions the body of the innermost loop the bound depends on: one
copy for the iterations where the full extent holds (the ``min`` replaced by
its constant), one for the tail::

    for (j.outer = 0; j.outer < 32; j.outer++) {        for (j.outer = 0; j.outer < 32; j.outer++) {
      vectorize for (j = 0; j < min(32, 1000 - j.outer * 32); j++)     if (1000 - j.outer * 32 >= 32) {
        ...                                                 vectorize for (j = 0; j < 32; j++) ...
    }                                                     } else {
                                                            vectorize for (j = 0; j < min(32, ...); j++) ...
                                                          }
                                                        }
"""

from __future__ import annotations

from cuvil.ir import expr as E
from cuvil.ir.expr import Binary, Const, Expr, Var
from cuvil.ir.functor import ExprMutator, StmtMutator, free_vars, walk
from cuvil.ir.simplify import simplify_expr, simplify_stmt, skey
from cuvil.ir.stmt import Allocate, Block, For, If, LetStmt, LoweredFunc, Stmt

MAX_VERSIONS = 3  # bounds versioned per loop (each one doubles the loop body)


def _tail_bounds(body: Stmt, var: Var, bound: set[int]) -> list[tuple[Binary, int, Expr]]:
    """``min(c, e)`` in vector/unroll loop extents of ``body`` whose ``e`` depends on ``var`` and outer vars only."""
    found: dict[tuple, tuple[Binary, int, Expr]] = {}
    for root in _extents(body):
        for n in walk(root):
            if not (isinstance(n, Binary) and n.op == "min" and n.dtype == "int64"):
                continue
            c, e = (n.a, n.b) if isinstance(n.a, Const) else (n.b, n.a)
            if not isinstance(c, Const) or isinstance(e, Const):
                continue
            vs = free_vars(e)
            if any(v is var for v in vs) and all(id(v) in bound for v in vs):
                found.setdefault(skey(n), (n, int(c.value), e))
    return list(found.values())


def _extents(s: Stmt) -> list[Expr]:
    """Extents of the vectorised and unrolled loops in ``s`` (where a constant extent pays)."""
    if isinstance(s, For):
        return ([s.extent] if s.kind in ("vectorize", "unroll") else []) + _extents(s.body)
    if isinstance(s, Block):
        return [e for x in s.stmts for e in _extents(x)]
    if isinstance(s, (If,)):
        return _extents(s.then_body) + (_extents(s.else_body) if s.else_body is not None else [])
    if isinstance(s, (LetStmt, Allocate)):
        return _extents(s.body)
    return []


class _Replace(ExprMutator):
    def __init__(self, key: tuple, value: Expr):
        self.key, self.value = key, value

    def generic(self, e: Expr) -> Expr:
        if isinstance(e, Binary) and e.op == "min" and skey(e) == self.key:
            return self.value
        return super().generic(e)


def _replace(s: Stmt, key: tuple, value: Expr) -> Stmt:
    return _ReplaceStmt(key, value).visit_stmt(s)


class _ReplaceStmt(StmtMutator):
    def __init__(self, key: tuple, value: Expr):
        self.r = _Replace(key, value)

    def visit_expr(self, e: Expr) -> Expr:
        return self.r.visit(e)


class _Version(StmtMutator):
    """Versions each loop's body (inner loops first); ``bound`` holds the ids of the variables bound
    around the statement being visited (sizes, loop variables, lets)."""

    def __init__(self, bound: set[int]):
        self.bound = bound

    def visit_For(self, s: For) -> Stmt:
        outer = self.bound
        self.bound = inner = outer | {id(s.var)}
        try:
            body = self.visit_stmt(s.body)
        finally:
            self.bound = outer
        for n, c, e in _tail_bounds(body, s.var, inner)[:MAX_VERSIONS]:
            full = simplify_stmt(_replace(body, skey(n), E.const(c, "int64")))
            if full is None:
                continue
            body = If(simplify_expr(E.binary("ge", e, E.const(c, "int64"))), full, body)
        return For(s.var, s.min, s.extent, body, s.kind)

    def visit_LetStmt(self, s: LetStmt) -> Stmt:
        outer = self.bound
        self.bound = outer | {id(s.var)}
        try:
            body = self.visit_stmt(s.body)
        finally:
            self.bound = outer
        return LetStmt(s.var, s.value, body)


def version_tails(func: LoweredFunc) -> LoweredFunc:
    """``func`` with full tiles versioned apart from tail tiles."""
    bound = {id(v) for v in func.size_vars}
    body = _Version(bound).visit_stmt(func.body)
    return LoweredFunc(func.name, func.params, body, func.size_vars, func.outputs)
