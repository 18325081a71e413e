"""isl's AST generator -> cuvil loop IR.

isl turns a schedule (a union map from statement instances to time) into a
loop AST with exact bounds, guards and tails.  This module walks that AST by
hand (``n_children``/``child`` style, never through callbacks whose nodes die
when they return) and builds For / If / Block / LetStmt / Store nodes with
cuvil's scalar expressions.  A loop takes the name of the te axis it runs
over when every statement below it uses its iterator as that axis.
"""

from __future__ import annotations

from collections.abc import Callable

import islpy as isl

from cuvil.errors import UnsupportedOpError
from cuvil.ir import expr as E
from cuvil.ir.expr import Expr, TensorRead, Var
from cuvil.ir.functor import ExprMutator, substitute
from cuvil.ir.stmt import Buffer, For, If, LetStmt, Stmt, Store, block
from cuvil.schedule.model import PolyModel, Statement

_OP = isl.ast_expr_op_type
_NODE = isl.ast_node_type


def generate_ast(model: PolyModel, schedule: isl.UnionMap) -> isl.AstNode:
    """Ask isl for the loop AST of ``schedule`` over the model's domains."""
    build = isl.AstBuild.from_context(model.context)
    return build.node_from_schedule_map(schedule.intersect_domain(model.domain))


class _Reads(ExprMutator):
    """TensorRead -> Load on the tensor's buffer."""

    def __init__(self, buffers: Callable[[object], Buffer]):
        self.buffers = buffers

    def visit_TensorRead(self, e: TensorRead) -> Expr:
        idx = tuple(self.visit(i) for i in e.indices)
        return E.Load(e.dtype, self.buffers(e.tensor), idx)


class AstLowering:
    """Converts one isl AST into loop IR."""

    def __init__(self, model: PolyModel, buffer_of: Callable[[object], Buffer]):
        self.model = model
        self.stmts = {s.name: s for s in model.statements}
        self.params = {model.param_name(p): p for p in model.params}
        self.reads = _Reads(buffer_of)
        self.buffer_of = buffer_of

    # -- nodes ----------------------------------------------------------------
    def node(self, n: isl.AstNode, env: dict[str, Expr]) -> Stmt:
        t = n.get_type()
        if t == _NODE.block:
            children = n.block_get_children()
            return block([self.node(children.get_at(i), env) for i in range(children.n_ast_node())])
        if t == _NODE.for_:
            return self.for_node(n, env)
        if t == _NODE.if_:
            cond = self.expr(n.if_get_cond(), env)
            then = self.node(n.if_get_then_node(), env)
            other = self.node(n.if_get_else_node(), env) if n.if_has_else_node() else None
            return If(cond, then, other)
        if t == _NODE.user:
            return self.user(n.user_get_expr(), env)
        if t == _NODE.mark:
            return self.node(n.mark_get_node(), env)
        raise UnsupportedOpError(f"unexpected isl AST node {t}")

    def for_node(self, n: isl.AstNode, env: dict[str, Expr]) -> Stmt:
        it = n.for_get_iterator().get_id().get_name()
        name = self._loop_name(n, it)
        init = self.expr(n.for_get_init(), env)
        if n.for_is_degenerate():
            v = Var("int64", name)
            return LetStmt(v, init, self.node(n.for_get_body(), {**env, it: v}))
        cond = n.for_get_cond()
        inc = n.for_get_inc().get_val().to_python()
        op = cond.get_op_type()
        lhs = cond.get_op_arg(0)
        if op not in (_OP.lt, _OP.le) or lhs.get_type() != isl.ast_expr_type.id or lhs.get_id().get_name() != it:
            raise UnsupportedOpError(f"unexpected loop condition from isl: {cond.to_C_str()}")
        ub = self.expr(cond.get_op_arg(1), env)
        count = ub - init + (1 if op == _OP.le else 0)
        if inc == 1:
            v = Var("int64", name)
            return For(v, init, count, self.node(n.for_get_body(), {**env, it: v}))
        # strided loop: run a dense counter and bind the iterator
        t = Var("int64", name + "_t")
        v = Var("int64", name)
        trips = (count + (inc - 1)) // inc
        body = LetStmt(v, init + t * inc, self.node(n.for_get_body(), {**env, it: v}))
        return For(t, E.const(0, "int64"), trips, body)

    def _loop_name(self, n: isl.AstNode, it: str) -> str:
        """The te axis name the iterator stands for in every statement below, else the isl name."""
        found: set[str] = set()
        for call in _user_calls(n.for_get_body()):
            stmt = self.stmts[call.get_op_arg(0).get_id().get_name()]
            for d in range(1, call.get_op_n_arg()):
                a = call.get_op_arg(d)
                if a.get_type() == isl.ast_expr_type.id and a.get_id().get_name() == it:
                    found.add(stmt.iters[d - 1].name)
        return found.pop() if len(found) == 1 else it

    def user(self, call: isl.AstExpr, env: dict[str, Expr]) -> Stmt:
        stmt: Statement = self.stmts[call.get_op_arg(0).get_id().get_name()]
        args = [self.expr(call.get_op_arg(d), env) for d in range(1, call.get_op_n_arg())]
        mapping = dict(zip(stmt.iters, args))
        value = self.reads.visit(substitute(stmt.value, mapping))
        idx = tuple(self.reads.visit(substitute(i, mapping)) for i in stmt.indices)
        out: Stmt = Store(self.buffer_of(stmt.tensor), idx, value)
        if stmt.guard is not None:
            out = If(self.reads.visit(substitute(stmt.guard, mapping)), out)
        return out

    # -- expressions ------------------------------------------------------------
    def expr(self, e: isl.AstExpr, env: dict[str, Expr]) -> Expr:
        t = e.get_type()
        if t == isl.ast_expr_type.int:
            return E.const(e.get_val().to_python(), "int64")
        if t == isl.ast_expr_type.id:
            name = e.get_id().get_name()
            if name in env:
                return env[name]
            if name in self.params:
                p = self.params[name]
                return p if p.dtype == "int64" else E.Cast("int64", p)
            raise UnsupportedOpError(f"unknown name {name!r} in the isl AST")
        op = e.get_op_type()
        args = [self.expr(e.get_op_arg(i), env) for i in range(e.get_op_n_arg())]
        if op in _BINARY:
            return _BINARY[op](*args)
        if op == _OP.minus:
            return -args[0]
        if op in (_OP.cond, _OP.select):
            return E.select(args[0], args[1], args[2])
        raise UnsupportedOpError(f"unexpected isl AST expression {e.to_C_str()}")


_BINARY: dict[object, Callable[[Expr, Expr], Expr]] = {
    _OP.add: lambda a, b: a + b,
    _OP.sub: lambda a, b: a - b,
    _OP.mul: lambda a, b: a * b,
    _OP.div: lambda a, b: a // b,  # exact division
    _OP.fdiv_q: lambda a, b: a // b,
    _OP.pdiv_q: lambda a, b: a // b,
    _OP.pdiv_r: lambda a, b: a % b,
    _OP.zdiv_r: lambda a, b: a % b,  # only compared with 0, where floor and C remainders agree
    _OP.max: E.maximum,
    _OP.min: E.minimum,
    _OP.and_: lambda a, b: E.binary("and", a, b),
    _OP.and_then: lambda a, b: E.binary("and", a, b),
    _OP.or_: lambda a, b: E.binary("or", a, b),
    _OP.or_else: lambda a, b: E.binary("or", a, b),
    _OP.eq: lambda a, b: E.binary("eq", a, b),
    _OP.le: lambda a, b: E.binary("le", a, b),
    _OP.lt: lambda a, b: E.binary("lt", a, b),
    _OP.ge: lambda a, b: E.binary("ge", a, b),
    _OP.gt: lambda a, b: E.binary("gt", a, b),
}


def _user_calls(n: isl.AstNode) -> list[isl.AstExpr]:
    """The statement calls below ``n`` (walked by hand)."""
    out: list[isl.AstExpr] = []
    stack = [n]
    while stack:
        x = stack.pop()
        t = x.get_type()
        if t == _NODE.user:
            out.append(x.user_get_expr())
        elif t == _NODE.block:
            ch = x.block_get_children()
            stack.extend(ch.get_at(i) for i in range(ch.n_ast_node()))
        elif t == _NODE.for_:
            stack.append(x.for_get_body())
        elif t == _NODE.if_:
            stack.append(x.if_get_then_node())
            if x.if_has_else_node():
                stack.append(x.if_get_else_node())
        elif t == _NODE.mark:
            stack.append(x.mark_get_node())
    return out


def ast_to_loops(model: PolyModel, ast: isl.AstNode, buffer_of: Callable[[object], Buffer]) -> Stmt:
    return AstLowering(model, buffer_of).node(ast, {})
