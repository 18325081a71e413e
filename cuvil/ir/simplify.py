"""Expression and statement simplification (a pure pass).

* integer affine expressions are normalised: ``(M - 1) - 0 + 1`` -> ``M``,
  ``i * 4 + 2 - i * 4`` -> ``2``;
* constants fold (integers wrap like numpy; floats only where exact);
* ``x * 1``, ``x + 0``, ``select(true, a, b)``, min/max of equal constants;
* loops of zero trips and ``if (false)`` disappear, ``if (true)`` is its body.
"""

from __future__ import annotations

import math

from cuvil import dtype as dt
from cuvil.ir import expr as E
from cuvil.ir.expr import Binary, Cast, Const, Expr, Select, Unary, Var
from cuvil.ir.functor import ExprMutator, StmtMutator, substitute, walk
from cuvil.ir.stmt import Allocate, Block, For, If, LetStmt, LoweredFunc, Stmt, Store, block


def skey(e: Expr) -> tuple:
    """A structural key: equal for structurally equal expressions (variables by identity)."""
    if isinstance(e, Var):
        return ("var", id(e))
    if isinstance(e, Const):
        return ("const", e.dtype, e.value)
    from cuvil.ir.functor import children

    tag = getattr(e, "op", None) or getattr(e, "name", None)
    extra = id(getattr(e, "buffer", None) or getattr(e, "tensor", None))
    return (type(e).__name__, e.dtype, tag, extra) + tuple(skey(c) for c in children(e))


def linear_form(e: Expr) -> tuple[dict[tuple, tuple[Expr, int]], int] | None:
    """``e`` as ``sum(coef * term) + const`` over int64, terms keyed structurally."""
    if e.dtype != "int64":
        return None
    if isinstance(e, Const):
        return {}, int(e.value)
    if isinstance(e, Binary) and e.op in ("add", "sub"):
        a, b = linear_form(e.a), linear_form(e.b)
        if a is None or b is None:
            return None
        sign = 1 if e.op == "add" else -1
        terms = dict(a[0])
        for k, (t, c) in b[0].items():
            old = terms.get(k, (t, 0))[1]
            terms[k] = (t, old + sign * c)
        return terms, a[1] + sign * b[1]
    if isinstance(e, Binary) and e.op == "mul" and (isinstance(e.a, Const) or isinstance(e.b, Const)):
        c, x = (e.a, e.b) if isinstance(e.a, Const) else (e.b, e.a)
        inner = linear_form(x)
        if inner is None:
            return None
        k = int(c.value)
        return {key: (t, v * k) for key, (t, v) in inner[0].items()}, inner[1] * k
    if isinstance(e, Unary) and e.op == "neg":
        inner = linear_form(e.a)
        if inner is None:
            return None
        return {key: (t, -v) for key, (t, v) in inner[0].items()}, -inner[1]
    if isinstance(e, Binary) and e.op == "floormod" and isinstance(e.b, Const) and e.b.value > 0:
        # x % c == x - c * (x // c) for floor semantics: tile offsets cancel against each other
        inner = linear_form(e.a)
        if inner is not None:
            q = Binary("int64", "floordiv", e.a, e.b)
            terms = dict(inner[0])
            old = terms.get(skey(q), (q, 0))[1]
            terms[skey(q)] = (q, old - int(e.b.value))
            return terms, inner[1]
    return {skey(e): (e, 1)}, 0


def _rebuild(terms: dict[tuple, tuple[Expr, int]], c: int) -> Expr:
    out: Expr | None = None
    for t, k in terms.values():
        if k == 0:
            continue
        if out is None:
            out = t if k == 1 else (-t if k == -1 else Binary("int64", "mul", t, E.const(k, "int64")))
        elif k > 0:
            out = Binary("int64", "add", out, t if k == 1 else Binary("int64", "mul", t, E.const(k, "int64")))
        else:
            out = Binary("int64", "sub", out, t if k == -1 else Binary("int64", "mul", t, E.const(-k, "int64")))
    if out is None:
        return E.const(c, "int64")
    if c > 0:
        return Binary("int64", "add", out, E.const(c, "int64"))
    if c < 0:
        return Binary("int64", "sub", out, E.const(-c, "int64"))
    return out


def _fold_int(op: str, a: int, b: int, dtype: str) -> int | bool | None:
    if op == "add":
        return a + b
    if op == "sub":
        return a - b
    if op == "mul":
        return a * b
    if op == "floordiv":
        return a // b if b != 0 else 0
    if op == "floormod":
        return a % b if b != 0 else 0
    if op == "min":
        return min(a, b)
    if op == "max":
        return max(a, b)
    if op in ("and", "or", "xor") and dt.is_int(dtype):
        return {"and": a & b, "or": a | b, "xor": a ^ b}[op]
    cmp = {"eq": a == b, "ne": a != b, "lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b}
    return cmp.get(op)


Bounds = dict[int, tuple[int, int | None]]  # id(var) -> (lowest, highest or None) of a loop variable


def _interval(terms: dict[tuple, tuple[Expr, int]], c: int, bounds: Bounds) -> tuple[int, int] | None:
    """The range of ``sum(coef * term) + c`` when every term is a bounded loop variable."""
    lo = hi = c
    for t, k in terms.values():
        if k == 0:
            continue
        if not isinstance(t, Var) or id(t) not in bounds or bounds[id(t)][1] is None:
            return None
        tlo, thi = bounds[id(t)]
        lo += min(k * tlo, k * thi)  # type: ignore[operator]
        hi += max(k * tlo, k * thi)  # type: ignore[operator]
    return lo, hi


def _divmod(e: Binary, a: Expr, c: int, bounds: Bounds) -> Expr | None:
    """``(c * q + r) // c == q + r // c``; ``r // c`` and ``r % c`` fold when r's range is known."""
    lin = linear_form(a)
    if lin is None:
        return None
    quot: dict[tuple, tuple[Expr, int]] = {}
    rest: dict[tuple, tuple[Expr, int]] = {}
    for key, (t, k) in lin[0].items():
        if k % c == 0:
            quot[key] = (t, k // c)
        else:
            rest[key] = (t, k)
    rng = _interval(rest, lin[1], bounds)
    if rng is None or rng[0] // c != rng[1] // c:
        common = _divmod_common(e, lin, c, bounds)
        if common is not None:
            return common
        cq, cr = divmod(lin[1], c)  # whole multiples of c in the constant leave the division too
        if e.op == "floordiv" and rest and all(k % c > c // 2 for _, k in rest.values()):
            # each k nearer the multiple of c above it: k = c * ceil(k / c) - m, so that the rule below sees
            # -m (isl writes x - x // 54 as (53 * x + 53) // 54; a conv tile's local filter index then cancels
            # to a constant, its accumulators stay in registers and the NCHW store is shuffles, not a load per
            # lane: SqueezeNet's 3x3 convolutions 3-5% faster at 1 thread)
            for key, (t, k) in rest.items():
                quot[key] = (t, -(-k // c))
                rest[key] = (t, k + c * (-k // c))
        if e.op == "floordiv" and rest and all(k < 0 for _, k in rest.values()):
            # (-r + cr) // c == -((r + c - 1 - cr) // c): the same quotient as a positive one, to cancel
            pos = {key: (t, -k) for key, (t, k) in rest.items()}
            neg = Binary("int64", "floordiv", _rebuild(pos, c - 1 - cr), e.b)
            return Binary("int64", "sub", _rebuild(quot, cq), neg)
        if not quot and cq == 0:
            return None
        r = _rebuild(rest, cr)
        if e.op == "floordiv":
            return _rebuild(quot, cq) + Binary("int64", "floordiv", r, e.b)
        return Binary("int64", "floormod", r, e.b)
    k0 = rng[0] // c
    if e.op == "floordiv":
        return _rebuild(quot, k0)
    return _rebuild(rest, lin[1] - k0 * c)


def _divmod_common(e: Binary, lin: tuple[dict[tuple, tuple[Expr, int]], int], c: int, bounds: Bounds
                   ) -> Expr | None:
    """``(g * q + r) // (g * d) == q // d`` and ``(g * q + r) % (g * d) == g * (q % d) + r`` when
    ``0 <= r < g``: a tile's row ``(14 * f + i) % 12544`` under a fused loop ``f`` (``i < 14``) is
    ``14 * (f % 896) + i``, so the tile's local index ``i`` cancels to a constant and the accumulators
    stay in registers.  ``g`` is the largest common factor of ``c`` and a coefficient."""
    terms, const = lin
    for g in sorted({math.gcd(c, abs(k)) for _, k in terms.values() if k}, reverse=True):
        if g in (1, c):
            continue
        quot = {key: (t, k // g) for key, (t, k) in terms.items() if k % g == 0}
        rest = {key: (t, k) for key, (t, k) in terms.items() if k % g != 0}
        rng = _interval(rest, const, bounds)
        if rng is None or rng[0] // g != rng[1] // g:
            continue
        k0 = rng[0] // g
        q = _rebuild(quot, k0)
        d = E.const(c // g, "int64")
        if e.op == "floordiv":
            return Binary("int64", "floordiv", q, d)
        return Binary("int64", "floormod", q, d) * g + _rebuild(rest, const - k0 * g)
    return None


class Simplifier(ExprMutator):
    def __init__(self, bounds: Bounds | None = None):
        self.bounds: Bounds = bounds if bounds is not None else {}

    def visit_Binary(self, e: Binary) -> Expr:
        a, b = self.visit(e.a), self.visit(e.b)
        if (e.op == "floordiv" and isinstance(a, Binary) and a.op == "floordiv" and isinstance(b, Const)
                and isinstance(a.b, Const) and b.value > 0 and a.b.value > 0 and e.dtype == a.dtype == "int64"):
            # (x // c) // d == x // (c * d) for positive c, d: isl's (32 * f + 31) // 109 // 32 is then
            # (32 * f + 31) // 3488 == f // 109 (a 7x7 stem convolution's tile index cancels to a constant)
            return self.visit(Binary("int64", "floordiv", a.a, E.const(int(a.b.value) * int(b.value), "int64")))
        if (e.dtype == "int64" and e.op in ("floordiv", "floormod") and isinstance(b, Const) and b.value > 0
                and not isinstance(a, Const) and _is_index(a)):  # (data * 4 + 1) // 4 wraps first
            folded = _divmod(e, a, int(b.value), self.bounds)
            if folded is not None:
                return self.visit(folded) if not isinstance(folded, Binary) or folded.op not in (
                    "floordiv", "floormod") else folded
        if isinstance(a, Const) and isinstance(b, Const) and dt.is_int(a.dtype) and dt.is_int(b.dtype):
            v = _fold_int(e.op, int(a.value), int(b.value), e.dtype)
            if v is not None:
                return E.const(v, e.dtype)
        if e.dtype == "bool" and a.dtype == "bool" and isinstance(a, Const) and e.op in ("and", "or"):
            if e.op == "and":
                return b if a.value else a
            return a if a.value else b
        if e.dtype == "bool" and b.dtype == "bool" and isinstance(b, Const) and e.op in ("and", "or"):
            if e.op == "and":
                return a if b.value else b
            return b if b.value else a
        if dt.is_int(e.dtype):
            if e.op == "mul" and (_is(a, 1) or _is(b, 1)):
                return b if _is(a, 1) else a
            if e.op in ("floordiv",) and _is(b, 1):
                return a
            if e.op == "floormod" and _is(b, 1):
                return E.const(0, e.dtype)
        out = e if (a is e.a and b is e.b) else Binary(e.dtype, e.op, a, b)
        if e.dtype == "int64" and e.op in ("add", "sub", "mul"):
            lin = linear_form(out)
            if lin is not None:
                pushed = self._into_minmax(*lin)
                return pushed if pushed is not None else _rebuild(*lin)
        if e.dtype == "int64" and e.op in ("min", "max") and isinstance(b, Const) and not isinstance(a, Const):
            return Binary(e.dtype, e.op, b, a)  # constant first: min(32, N - 32 * j)
        return out

    def _into_minmax(self, terms: dict[tuple, tuple[Expr, int]], c: int) -> Expr | None:
        """``min(a, b) + t`` -> ``min(a + t, b + t)`` (one min/max term, coefficient 1): tail bounds
        such as ``min(999, 32 * j + 31) - 32 * j + 1`` become ``min(1000 - 32 * j, 32)``."""
        mm = [(k, t) for k, (t, n) in terms.items() if n and isinstance(t, Binary) and t.op in ("min", "max")]
        if len(mm) != 1 or terms[mm[0][0]][1] != 1:
            return None
        if not all(_is_index(t) for t, _ in terms.values()):
            return None  # data, not an index: int64 wraps, and min(a, b) + t != min(a + t, b + t) then
        key, t = mm[0]
        rest = dict(terms)
        del rest[key]
        r = _rebuild(rest, c)
        return self.visit(Binary("int64", t.op, simplify_expr(t.a + r), simplify_expr(t.b + r)))

    def visit_Cast(self, e: Cast) -> Expr:
        v = self.visit(e.value)
        if isinstance(v, Const) and not dt.is_float(v.dtype) and not dt.is_float(e.dtype):
            return E.cast(v, e.dtype)
        return e if v is e.value else Cast(e.dtype, v)

    def visit_Select(self, e: Select) -> Expr:
        c = self.visit(e.cond)
        if isinstance(c, Const):
            return self.visit(e.t if c.value else e.f)
        t, f = self.visit(e.t), self.visit(e.f)
        return e if (c is e.cond and t is e.t and f is e.f) else Select(e.dtype, c, t, f)


def _is_index(e: Expr) -> bool:
    """An expression of loop variables, sizes and constants only (no loaded data): such int64 values
    never wrap, so the rewrites that assume exact integers (moving terms into a min/max or out of a
    floor division) hold for them."""
    return not any(isinstance(x, (E.Load, E.TensorRead, E.Call)) for x in walk(e))


def _is(e: Expr, v: int) -> bool:
    return isinstance(e, Const) and e.value == v


def simplify_expr(e: Expr) -> Expr:
    return Simplifier().visit(e)


def simplify_stmt(s: Stmt, bounds: Bounds | None = None) -> Stmt | None:
    """Simplify a statement; None when nothing is left.  ``bounds`` are the enclosing loops' ranges."""
    bounds = bounds if bounds is not None else {}
    simp = Simplifier(bounds)
    if isinstance(s, Store):
        return Store(s.buffer, tuple(simp.visit(i) for i in s.indices), simp.visit(s.value))
    if isinstance(s, For):
        ext = simp.visit(s.extent)
        if isinstance(ext, Const) and ext.value <= 0:
            return None
        lo = simp.visit(s.min)
        inner = dict(bounds)
        if isinstance(lo, Const):
            inner[id(s.var)] = (int(lo.value), int(lo.value) + int(ext.value) - 1 if isinstance(ext, Const) else None)
        body = simplify_stmt(s.body, inner)
        if body is None:
            return None
        if isinstance(ext, Const) and ext.value == 1 and s.kind == "serial":
            return simplify_stmt(LetStmt(s.var, s.min, body), bounds)
        short = _guarded_extent(s.var, lo, ext, body, inner)
        if short is not None:  # the loop's whole body is ``if (var <= c)``: the loop stops at c
            ext, body = short, _unguard(body)
        return For(s.var, lo, ext, body, s.kind)
    if isinstance(s, If):
        c = simp.visit(s.cond)
        if isinstance(c, Const):
            chosen = s.then_body if c.value else s.else_body
            return None if chosen is None else simplify_stmt(chosen, bounds)
        then = _simplify_branch(s.then_body, c, False, bounds)
        other = None if s.else_body is None else _simplify_branch(s.else_body, c, True, bounds)
        if then is None and other is None:
            return None
        if then is None:
            return If(E.unary("not", c), other)  # type: ignore[arg-type]
        return If(c, then, other)
    if isinstance(s, Block):
        parts = [simplify_stmt(x, bounds) for x in s.stmts]
        kept = [p for p in parts if p is not None]
        return block(kept) if kept else None
    if isinstance(s, LetStmt):
        v = simp.visit(s.value)
        if isinstance(v, (Const, Var)):
            return simplify_stmt(substitute_stmt(s.body, {s.var: v}), bounds)
        body = simplify_stmt(s.body, bounds)
        return None if body is None else LetStmt(s.var, v, body)
    if isinstance(s, Allocate):
        body = simplify_stmt(s.body, bounds)
        return None if body is None else Allocate(s.buffer, body)
    raise TypeError(f"cannot simplify {type(s).__name__}")


def _guarded_extent(var: Var, lo: Expr, ext: Expr, body: Stmt, bounds: Bounds) -> Const | None:
    """The shorter extent of a loop whose whole body runs only below some bound of its own variable.

    isl bounds a loop over tiles fused with ``fuse`` by a hull and guards the body with the exact bound;
    a parallel loop chunked over its full extent then gives one thread the empty iterations::

        parallel for (t = 0; t < 1169; t++)             parallel for (t = 0; t < 784; t++)
          if (t <= 783) body                       ->     body
    """
    while isinstance(body, Allocate):  # a buffer per iteration around the guard
        body = body.body
    if not (isinstance(body, If) and body.else_body is None and isinstance(lo, Const) and isinstance(ext, Const)):
        return None
    refined = _refine(body.cond, False, bounds)
    if refined is None or refined[0] is not var or refined[1] != int(lo.value):
        return None
    n = refined[2] - int(lo.value) + 1
    return E.const(n, ext.dtype) if n < int(ext.value) else None


def _unguard(body: Stmt) -> Stmt:
    """``body`` (an ``If`` inside Allocates) without the ``If``."""
    if isinstance(body, Allocate):
        return Allocate(body.buffer, _unguard(body.body))
    assert isinstance(body, If)
    return body.then_body


_FLIP = {"ge": "lt", "gt": "le", "le": "gt", "lt": "ge"}


def _simplify_branch(body: Stmt, cond: Expr, negate: bool, bounds: Bounds) -> Stmt | None:
    """Simplify one side of ``if (cond)``: a condition on one loop variable narrows its range there, and a
    variable pinned to one value becomes that constant (the tail tile of a loop: ``j < 32`` and
    ``!(1000 - 32 * j >= 32)`` leave ``j = 31``, so the tail's extents and indices fold)."""
    refined = _refine(cond, negate, bounds)
    if refined is None:
        return simplify_stmt(body, bounds)
    var, lo, hi = refined
    inner = {**bounds, id(var): (lo, hi)}
    if lo == hi:
        body = substitute_stmt(body, {var: E.const(lo, var.dtype)})
    return simplify_stmt(body, inner)


def _refine(cond: Expr, negate: bool, bounds: Bounds) -> tuple[Var, int, int] | None:
    """(v, lo, hi) when ``cond`` (or its negation) is ``k * v + c (cmp) 0`` for one bounded loop variable."""
    if not (isinstance(cond, Binary) and cond.op in _FLIP and cond.a.dtype == "int64" and cond.b.dtype == "int64"):
        return None
    lin = linear_form(Binary("int64", "sub", cond.a, cond.b))
    if lin is None:
        return None
    terms = [(t, k) for t, k in lin[0].values() if k]
    if len(terms) != 1 or not isinstance(terms[0][0], Var) or id(terms[0][0]) not in bounds:
        return None
    (v, k), c = terms[0], lin[1]
    lo, hi = bounds[id(v)]
    if hi is None:
        return None
    op = _FLIP[cond.op] if negate else cond.op
    if op == "gt":  # k v + c > 0  <=>  k v + c - 1 >= 0 (integers)
        op, c = "ge", c - 1
    elif op == "lt":
        op, c = "le", c + 1
    if op == "le":  # k v + c <= 0  <=>  -k v - c >= 0
        k, c = -k, -c
    # k v >= -c
    if k > 0:
        lo = max(lo, -(c // k))  # ceil(-c / k)
    else:
        hi = min(hi, c // -k)  # floor(c / -k)
    if lo > hi:
        return None  # the branch never runs; leave it to the code that produced it
    return v, lo, hi


def substitute_stmt(s: Stmt, mapping: dict[Var, Expr]) -> Stmt:
    """Replace variables in every expression of ``s``."""
    return _SubstituteStmt(mapping).visit_stmt(s)


class _SubstituteStmt(StmtMutator):
    def __init__(self, mapping: dict[Var, Expr]):
        self.mapping = mapping

    def visit_expr(self, e: Expr) -> Expr:
        return substitute(e, self.mapping)


def simplify(f: LoweredFunc) -> LoweredFunc:
    body = simplify_stmt(f.body)
    return LoweredFunc(f.name, f.params, body if body is not None else Block(()), f.size_vars, f.outputs)
