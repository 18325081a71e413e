"""isl's AST generator -> cuvil loop IR.

isl turns a schedule (a union map from statement instances to time) into a
loop AST with exact bounds, guards and tails.  This module walks that AST by
hand (``n_children``/``child`` style, never through callbacks whose nodes die
when they return) and builds For / If / Block / LetStmt / Store nodes with
cuvil's scalar expressions.  A loop takes the name of the te axis it runs
over when every statement below it uses its iterator as that axis.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import islpy as isl

from cuvil.errors import ScheduleError, UnsupportedOpError
from cuvil.ir import expr as E
from cuvil.ir.expr import Expr, IterVar, TensorRead, Var
from cuvil.ir.functor import ExprMutator, substitute
from cuvil.ir.simplify import simplify_expr
from cuvil.ir.stmt import Allocate, Buffer, For, If, LetStmt, Stmt, Store, block
from cuvil.schedule.model import PolyModel, Statement
from cuvil.schedule.storage import LocalStorage, aff_to_expr
from cuvil.schedule.timemap import TimeMaps

_OP = isl.ast_expr_op_type
_NODE = isl.ast_node_type


def generate_ast(model: PolyModel, schedule: isl.UnionMap, separate: tuple[int, ...] = ()) -> isl.AstNode:
    """Ask isl for the loop AST of ``schedule`` over the model's domains.

    ``separate`` lists time dimensions whose loops isl splits into the iterations where the
    loops inside have their full extent and the rest (tiles vs tails): inside full tiles the
    unrolled and vectorised loops have constant bounds.
    """
    build = isl.AstBuild.from_context(model.context)
    if separate:
        width = _width(schedule)
        prefix = "t"
        while any(n.startswith(prefix) for n in re.findall(r"\w+", model.param_str)):
            prefix += "_"  # not a size's name
        dims = ", ".join(f"{prefix}{k}" for k in range(width))
        opts = "; ".join(f"[{dims}] -> separate[{d}]" for d in separate)
        build = build.set_options(isl.UnionMap(f"{model.param_str} -> {{ {opts} }}"))
    return build.node_from_schedule_map(schedule.intersect_domain(model.domain))


def _width(um: isl.UnionMap) -> int:
    maps: list[isl.Map] = []
    um.foreach_map(maps.append)
    return max((m.dim(isl.dim_type.out) for m in maps), default=1)


class _Reads(ExprMutator):
    """TensorRead -> Load on the tensor's buffer (or its local buffer inside its attach loop)."""

    def __init__(self, access: Callable[[object, tuple[Expr, ...]], tuple[Buffer, tuple[Expr, ...]]]):
        self.access = access

    def visit_TensorRead(self, e: TensorRead) -> Expr:
        buf, idx = self.access(e.tensor, tuple(self.visit(i) for i in e.indices))
        return E.Load(e.dtype, buf, idx)


class AstLowering:
    """Converts one isl AST into loop IR."""

    def __init__(self, model: PolyModel, tm: TimeMaps, buffer_of: Callable[[object], Buffer],
                 storage: dict[int, LocalStorage] | None = None):
        self.model = model
        self.tm = tm
        self.in_parallel: str | None = None
        self.stmts = {s.name: s for s in model.statements}
        self.params = {model.param_name(p): p for p in model.params}
        self.reads = _Reads(self.access)
        self.buffer_of = buffer_of
        self.storage = storage or {}
        self.local: dict[int, tuple[Buffer, tuple[Expr, ...], LocalStorage]] = {}  # id(stage) -> buffer, lower
        self.placed: set[int] = set()  # stages whose local buffer found its loop

    def access(self, t: object, idx: tuple[Expr, ...]) -> tuple[Buffer, tuple[Expr, ...]]:
        st = self.model.schedule.stage_of(t)
        if st is not None and id(st) in self.local:
            buf, lower, ls = self.local[id(st)]
            return buf, ls.buffer_index(tuple(i - lo for i, lo in zip(idx, lower)))
        return self.buffer_of(t), idx

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
        leaf, stage = self._loop_leaf(n, it)
        name = leaf.name if leaf is not None else it
        kind = stage.kinds.get(id(leaf), "serial") if leaf is not None else "serial"
        init = self.expr(n.for_get_init(), env)
        if n.for_is_degenerate():
            v = Var("int64", name)
            return LetStmt(v, init, self.body(n, {**env, it: v}, it))
        if kind != "parallel":
            return self._for(n, env, it, name, kind, init)
        if self.in_parallel is not None:
            raise ScheduleError(
                f"loop {name} of {stage.name} is parallel inside the parallel loop {self.in_parallel}; "
                "a parallel loop may not contain another"
            )
        self.in_parallel = name
        try:
            return self._for(n, env, it, name, kind, init)
        finally:
            self.in_parallel = None

    def _for(self, n: isl.AstNode, env: dict[str, Expr], it: str, name: str, kind: str, init: Expr) -> Stmt:
        cond = n.for_get_cond()
        inc = n.for_get_inc().get_val().to_python()
        op = cond.get_op_type()
        lhs = cond.get_op_arg(0)
        if op not in (_OP.lt, _OP.le) or lhs.get_type() != isl.ast_expr_type.id or lhs.get_id().get_name() != it:
            raise UnsupportedOpError(f"unexpected loop condition from isl: {cond.to_C_str()}")
        ub = self.expr(cond.get_op_arg(1), env)
        count = ub - init + (1 if op == _OP.le else 0)
        # loops count from 0: the iterator is init + v * inc (offsets of tiles cancel in indices)
        v = Var("int64", name)
        trips = count if inc == 1 else (count + (inc - 1)) // inc
        value = simplify_expr(init + v * inc)
        return For(v, E.const(0, "int64"), simplify_expr(trips), self.body(n, {**env, it: value}, it), kind)

    def body(self, n: isl.AstNode, env: dict[str, Expr], it: str) -> Stmt:
        """The loop body; stages stored per iteration of this loop get their local buffers here."""
        d = int(it[1:])
        # a stage's buffer goes in the loop of its time dimension, or in the innermost loop around it when
        # isl made no loop of that dimension (a stage computed at a loop of a stage computed at a loop:
        # the inner copies of the row index are substituted)
        here = [ls for ls in self.storage.values() if id(ls.stage) not in self.placed and ls.dim >= d
                and self._below(n, ls.stage) and (ls.dim == d or not self._loop_between(n, ls, d))]
        if not here:
            return self.node(n.for_get_body(), env)
        saved = dict(self.local)
        bufs = []
        for ls in here:
            dims = [env[f"c{k}"] if f"c{k}" in env else E.const(ls.fixed.get(k, 0), "int64") for k in range(d + 1)]
            lower = tuple(simplify_expr(aff_to_expr(a, dims, self.params)) for a in ls.lower)
            out = ls.stage.op.output(0)
            scope = "shared" if ls.stage.scope == "shared" else "local"
            buf = Buffer(ls.stage.name, tuple(E.const(x, "int64") for x in ls.buffer_shape), out.dtype, scope)
            self.local[id(ls.stage)] = (buf, lower, ls)
            self.placed.add(id(ls.stage))
            bufs.append(buf)
        try:
            inner = self.node(n.for_get_body(), env)
        finally:
            self.local = saved
        for buf in reversed(bufs):
            inner = Allocate(buf, inner)
        return inner

    def _loop_between(self, n: isl.AstNode, ls: LocalStorage, d: int) -> bool:
        """Whether the body of loop ``n`` (time dimension ``d``) has a loop over a dimension in
        ``(d, ls.dim]`` around statements of ``ls.stage``."""
        found = False

        def visit(node: isl.AstNode) -> bool:
            nonlocal found
            if node.get_type() == isl.ast_node_type.for_:
                k = int(node.for_get_iterator().get_id().get_name()[1:])
                if d < k <= ls.dim and self._below(node, ls.stage):
                    found = True
            return not found

        n.for_get_body().foreach_descendant_top_down(visit)
        return found

    def _below(self, n: isl.AstNode, stage: Any) -> bool:
        return any(self.stmts[c.get_op_arg(0).get_id().get_name()].stage is stage
                   for c in _user_calls(n.for_get_body()))

    def _loop_leaf(self, n: isl.AstNode, it: str) -> tuple[IterVar | None, Any]:
        """The stage loop that isl's loop over time dimension ``c<d>`` runs (None if ambiguous)."""
        d = int(it[1:])
        found: dict[int, IterVar] = {}
        for call in _user_calls(n.for_get_body()):
            leaf = self.tm.dim_leaf[call.get_op_arg(0).get_id().get_name()][d]
            if leaf is not None:
                found[id(leaf)] = leaf
        if len(found) != 1:
            return None, None
        leaf = next(iter(found.values()))
        return leaf, self.tm.leaf_stage[id(leaf)]

    def user(self, call: isl.AstExpr, env: dict[str, Expr]) -> Stmt:
        stmt: Statement = self.stmts[call.get_op_arg(0).get_id().get_name()]
        args = [self.expr(call.get_op_arg(d), env) for d in range(1, call.get_op_n_arg())]
        mapping = dict(zip(stmt.iters, args))
        value = self.reads.visit(substitute(stmt.value, mapping))
        idx = tuple(self.reads.visit(substitute(i, mapping)) for i in stmt.indices)
        buf, idx = self.access(stmt.op.output(0), idx)
        out: Stmt = Store(buf, idx, value)
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
            out = args[0]
            for a in args[1:]:  # isl's min and max may take more than two arguments
                out = _BINARY[op](out, a)
            return out
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


def ast_to_loops(model: PolyModel, tm: TimeMaps, ast: isl.AstNode, buffer_of: Callable[[object], Buffer],
                 storage: dict[int, LocalStorage] | None = None) -> tuple[Stmt, set[int]]:
    """The loop IR of ``ast``, and the stages whose local storage was placed in a loop (a loop isl
    did not generate, one of a single iteration, places none: those keep a whole buffer)."""
    lowering = AstLowering(model, tm, buffer_of, storage)
    return lowering.node(ast, {}), lowering.placed
