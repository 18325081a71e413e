"""Unroll ``For(kind="unroll")`` loops in the loop IR (a pure pass).

A loop marked ``unroll`` whose extent is a constant (after simplification) of
at most :data:`MAX_UNROLL` iterations becomes its body repeated, with the loop
variable replaced by ``min + t`` in the t-th copy; inner loops are unrolled
first, so nested unroll loops become one straight block::

    for (i = 0; i < N; i++) {                  for (i = 0; i < N; i++) {
      unroll for (u = 0; u < 3; u++) {           C[i, 0] = A[i, 0] * 2.0f;
        C[i, u] = A[i, u] * 2.0f;        ->      C[i, 1] = A[i, 1] * 2.0f;
      }                                          C[i, 2] = A[i, 2] * 2.0f;
    }                                          }

An unroll loop with a non-constant extent (``unroll for (u = 0; u < M; u++)``),
or with more than ``MAX_UNROLL`` iterations, stays a loop of kind
``"unroll"``: the LLVM backend emits it as a plain loop, and LLVM's unroller
decides how far to unroll it.
"""

from __future__ import annotations

from cuvil.ir import expr as E
from cuvil.ir.expr import Const
from cuvil.ir.functor import StmtMutator
from cuvil.ir.simplify import simplify_expr, simplify_stmt, substitute_stmt
from cuvil.ir.stmt import Block, For, LoweredFunc, Stmt, block

MAX_UNROLL = 256  # iterations; a longer constant loop is left to LLVM's unroller


def unroll_loops(func: LoweredFunc) -> LoweredFunc:
    """``func`` with every constant-extent ``unroll`` loop replaced by copies of its body."""
    body = _Unroll().visit_stmt(func.body)
    if body is func.body:
        return func
    return LoweredFunc(func.name, func.params, body, func.size_vars, func.outputs)


class _Unroll(StmtMutator):
    """Inner loops first, so nested unroll loops become one block."""

    def make_block(self, stmts: tuple[Stmt, ...]) -> Stmt:
        return block(stmts)

    def visit_For(self, s: For) -> Stmt:
        body = self.visit_stmt(s.body)
        ext = simplify_expr(s.extent)
        if s.kind == "unroll" and isinstance(ext, Const) and int(ext.value) <= MAX_UNROLL:
            return _expand(s, body, int(ext.value))
        return s if body is s.body else For(s.var, s.min, s.extent, body, s.kind)


def _expand(s: For, body: Stmt, trips: int) -> Stmt:
    copies: list[Stmt] = []
    for t in range(max(trips, 0)):
        value = simplify_expr(s.min + E.const(t, s.var.dtype)) if s.min.dtype == s.var.dtype else \
            simplify_expr(E.Cast(s.var.dtype, s.min) + E.const(t, s.var.dtype))
        copy = simplify_stmt(substitute_stmt(body, {s.var: value}))
        if copy is not None:
            copies.append(copy)
    return block(copies) if copies else Block(())
