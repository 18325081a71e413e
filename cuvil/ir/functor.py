"""Visitors and rewriters over expressions and statements, shared by every pass.

``ExprMutator.visit(e)`` rebuilds a node only when one of its children
changed, so an unchanged tree comes back as the same object.
``StmtMutator.visit_stmt(s)`` does the same for loop IR statements, and rewrites
each expression in them with its ``visit_expr`` (unchanged by default).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from cuvil.ir.expr import (
    Binary,
    Call,
    Cast,
    Const,
    Expr,
    IterVar,
    Load,
    Reduce,
    Select,
    TensorRead,
    Unary,
    Var,
)
from cuvil.ir.stmt import Allocate, Block, For, If, LetStmt, Stmt, Store


def children(e: Expr) -> tuple[Expr, ...]:
    """The direct sub-expressions of ``e``."""
    if isinstance(e, (Const, Var)):
        return ()
    if isinstance(e, Cast):
        return (e.value,)
    if isinstance(e, Binary):
        return (e.a, e.b)
    if isinstance(e, Unary):
        return (e.a,)
    if isinstance(e, Call):
        return e.args
    if isinstance(e, Select):
        return (e.cond, e.t, e.f)
    if isinstance(e, (TensorRead, Load)):
        return e.indices
    if isinstance(e, Reduce):
        return (e.source,) + ((e.where,) if e.where is not None else ())
    raise TypeError(f"not a cuvil expression: {e!r}")


class ExprMutator:
    """Rebuilds expressions bottom-up; override ``visit_<Class>`` to rewrite."""

    def visit(self, e: Expr) -> Expr:
        method = getattr(self, "visit_" + type(e).__name__, None)
        if method is not None:
            return method(e)
        return self.generic(e)

    def generic(self, e: Expr) -> Expr:
        if isinstance(e, (Const, Var)):
            return e
        if isinstance(e, Cast):
            v = self.visit(e.value)
            return e if v is e.value else Cast(e.dtype, v)
        if isinstance(e, Binary):
            a, b = self.visit(e.a), self.visit(e.b)
            return e if (a is e.a and b is e.b) else Binary(e.dtype, e.op, a, b)
        if isinstance(e, Unary):
            a = self.visit(e.a)
            return e if a is e.a else Unary(e.dtype, e.op, a)
        if isinstance(e, Call):
            args = tuple(self.visit(x) for x in e.args)
            return e if _same(args, e.args) else Call(e.dtype, e.name, args)
        if isinstance(e, Select):
            c, t, f = self.visit(e.cond), self.visit(e.t), self.visit(e.f)
            return e if (c is e.cond and t is e.t and f is e.f) else Select(e.dtype, c, t, f)
        if isinstance(e, TensorRead):
            idx = tuple(self.visit(x) for x in e.indices)
            return e if _same(idx, e.indices) else TensorRead(e.dtype, e.tensor, idx)
        if isinstance(e, Load):
            idx = tuple(self.visit(x) for x in e.indices)
            return e if _same(idx, e.indices) else Load(e.dtype, e.buffer, idx)
        if isinstance(e, Reduce):
            src = self.visit(e.source)
            where = None if e.where is None else self.visit(e.where)
            if src is e.source and where is e.where:
                return e
            return Reduce(e.dtype, e.name, e.lhs, e.rhs, e.combined, e.identity, src, e.axis, where)
        raise TypeError(f"not a cuvil expression: {e!r}")


def _same(xs: tuple[Any, ...], ys: tuple[Any, ...]) -> bool:
    return all(x is y for x, y in zip(xs, ys))


class StmtMutator:
    """Rebuilds statements bottom-up; override ``visit_<Class>`` (``visit_For``, ``visit_Store``, ...) to
    rewrite one kind of statement, ``visit_expr`` to rewrite every expression, ``make_block`` to build
    blocks another way (:func:`cuvil.ir.stmt.block` flattens nested ones).

    Children are visited in a fixed order (a loop's min, extent, body; an if's condition, then, else; a
    let's value, body; a store's indices, value), which a pass that numbers what it finds can rely on.
    The method names do not clash with :class:`ExprMutator`'s (statement and expression classes have
    different names), so a pass may derive from both and set ``visit_expr = ExprMutator.visit``."""

    def visit_stmt(self, s: Stmt) -> Stmt:
        method = getattr(self, "visit_" + type(s).__name__, None)
        if method is not None:
            return method(s)
        return self.generic_stmt(s)

    def visit_expr(self, e: Expr) -> Expr:
        return e

    def make_block(self, stmts: tuple[Stmt, ...]) -> Stmt:
        return Block(stmts)

    def generic_stmt(self, s: Stmt) -> Stmt:
        if isinstance(s, Store):
            idx = tuple(self.visit_expr(i) for i in s.indices)
            value = self.visit_expr(s.value)
            return s if value is s.value and _same(idx, s.indices) else Store(s.buffer, idx, value)
        if isinstance(s, For):
            lo, ext = self.visit_expr(s.min), self.visit_expr(s.extent)
            body = self.visit_stmt(s.body)
            same = lo is s.min and ext is s.extent and body is s.body
            return s if same else For(s.var, lo, ext, body, s.kind)
        if isinstance(s, If):
            cond, then = self.visit_expr(s.cond), self.visit_stmt(s.then_body)
            other = None if s.else_body is None else self.visit_stmt(s.else_body)
            same = cond is s.cond and then is s.then_body and other is s.else_body
            return s if same else If(cond, then, other)
        if isinstance(s, Block):
            parts = tuple(self.visit_stmt(x) for x in s.stmts)
            return s if _same(parts, s.stmts) else self.make_block(parts)
        if isinstance(s, LetStmt):
            value, body = self.visit_expr(s.value), self.visit_stmt(s.body)
            return s if value is s.value and body is s.body else LetStmt(s.var, value, body)
        if isinstance(s, Allocate):
            body = self.visit_stmt(s.body)
            return s if body is s.body else Allocate(s.buffer, body)
        raise TypeError(f"{type(self).__name__}: unknown statement {type(s).__name__}")


class _Substitute(ExprMutator):
    def __init__(self, mapping: Mapping[Var, Expr]):
        self.mapping = mapping

    def visit_Var(self, e: Var) -> Expr:
        return self.mapping.get(e, e)

    def visit_IterVar(self, e: IterVar) -> Expr:
        return self.mapping.get(e, e)


def substitute(e: Expr, mapping: Mapping[Var, Expr]) -> Expr:
    """Replace variables (by identity) with expressions."""
    if not mapping:
        return e
    return _Substitute(mapping).visit(e)


def walk(e: Expr) -> list[Expr]:
    """All nodes of ``e`` in pre-order."""
    out: list[Expr] = []
    stack = [e]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(reversed(children(n)))
    return out


def collect(e: Expr, pred: Callable[[Expr], bool]) -> list[Expr]:
    return [n for n in walk(e) if pred(n)]


def free_vars(e: Expr) -> list[Var]:
    """Variables used in ``e`` (first occurrence order, no duplicates)."""
    seen: dict[int, Var] = {}
    for n in walk(e):
        if isinstance(n, Var) and id(n) not in seen:
            seen[id(n)] = n
    return list(seen.values())


def structural_equal(a: Any, b: Any) -> bool:
    """True if two expressions have the same structure (variables by identity)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, Var):
        return False
    if isinstance(a, Expr):
        if a.dtype != b.dtype:
            return False
        if isinstance(a, Const):
            return a.value == b.value
        for name in ("op", "name"):
            if getattr(a, name, None) != getattr(b, name, None):
                return False
        if isinstance(a, TensorRead) and a.tensor is not b.tensor:
            return False
        if isinstance(a, Load) and a.buffer is not b.buffer:
            return False
        if isinstance(a, Reduce) and (
            not _all_same(a.axis, b.axis) or not structural_equal(a.identity, b.identity)
        ):
            return False
        ca, cb = children(a), children(b)
        return len(ca) == len(cb) and all(structural_equal(x, y) for x, y in zip(ca, cb))
    return bool(a == b)


def _all_same(xs: tuple[Any, ...], ys: tuple[Any, ...]) -> bool:
    return len(xs) == len(ys) and _same(xs, ys)
