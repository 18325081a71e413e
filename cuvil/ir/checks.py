"""Run-time bounds checks in loop IR: the indices isl cannot prove, checked where they are used.

``cuvil.schedule.bounds`` proves every quasi-affine access of a te program inside its tensor at build
time.  What it cannot prove is an index that is not quasi-affine: one read from memory (a gather's
``W[idx[t], d]``), computed in floats, or multiplied by a size.  This pass wraps each such index of a
Load or Store in an ``index_check`` call (:func:`cuvil.ir.expr.index_check`)::

    out[t, d] = W[idx[t], d]          ->   out[t, d] = W[checked(idx[t], 30522 #1), d]

and numbers every check (those the graph's operators wrote at the te level too, such as ONNX's
negative-index rule ``checked_wrap(k, n)``) as a site of the function: ``func.checks[site - 1]``
says what it checks, for the error message.  An index that already is an ``index_check`` against
the dimension it indexes is not checked twice.  The code generators compare the value once where it
is computed (LLVM hoists a check of a loop-invariant index out of the loop) and, when it is out of
range, stop the kernel with status 4 and the site and value in the call's error record.

``entry_checks`` are conditions on the run-time sizes under which an affine access would leave its
tensor (from the proof): they are checked once per call, before the body.

With ``enabled=False`` the checks go: an ``index_check`` becomes its value (``checked_wrap`` keeps
the negative-index rule), and nothing is added.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from cuvil import dtype as dt
from cuvil.ir import expr as E
from cuvil.ir.expr import Binary, Call, Cast, Const, Expr, Load, Select, Unary, Var, index_check_parts
from cuvil.ir.functor import ExprMutator, StmtMutator, structural_equal
from cuvil.ir.stmt import CheckSite, LetStmt, LoweredFunc, Stmt, Store

_CMP = ("eq", "ne", "lt", "le", "gt", "ge")


def quasi_affine(e: Expr, opaque: frozenset[int] = frozenset()) -> bool:
    """True if ``e`` is an integer expression isl models exactly: variables (except the ``opaque`` ones,
    by id), integer constants, ``+ -``, ``*`` by a constant, ``//`` and ``%`` by a positive constant,
    ``min``/``max``, and selects on comparisons of such expressions.  The same class the build-time proof
    (``cuvil.schedule.bounds``) decides; anything else is checked at run time."""
    if isinstance(e, Const):
        return dt.is_int(e.dtype)
    if isinstance(e, Var):
        return dt.is_int(e.dtype) and id(e) not in opaque
    if isinstance(e, Cast):
        return dt.is_int(e.dtype) and dt.is_int(e.value.dtype) and quasi_affine(e.value, opaque)
    if isinstance(e, Unary):
        return e.op == "neg" and dt.is_int(e.dtype) and quasi_affine(e.a, opaque)
    if isinstance(e, Select):
        return affine_condition(e.cond, opaque) and quasi_affine(e.t, opaque) and quasi_affine(e.f, opaque)
    if not isinstance(e, Binary) or not dt.is_int(e.dtype):
        return False
    if e.op in ("add", "sub", "min", "max"):
        return quasi_affine(e.a, opaque) and quasi_affine(e.b, opaque)
    if e.op == "mul":
        return (isinstance(e.a, Const) and quasi_affine(e.b, opaque)) or (
            isinstance(e.b, Const) and quasi_affine(e.a, opaque))
    if e.op in ("floordiv", "floormod"):
        return isinstance(e.b, Const) and e.b.value > 0 and quasi_affine(e.a, opaque)
    return False


def affine_condition(e: Expr, opaque: frozenset[int] = frozenset()) -> bool:
    """True if the bool ``e`` is comparisons of quasi-affine integers joined by ``& | ~``."""
    if isinstance(e, Const):
        return e.dtype == "bool"
    if isinstance(e, Unary):
        return e.op == "not" and e.dtype == "bool" and affine_condition(e.a, opaque)
    if not isinstance(e, Binary):
        return False
    if e.op in _CMP:
        return dt.is_int(e.a.dtype) and quasi_affine(e.a, opaque) and quasi_affine(e.b, opaque)
    if e.op in ("and", "or") and e.dtype == "bool":
        return affine_condition(e.a, opaque) and affine_condition(e.b, opaque)
    return False


def unchecked(e: Call) -> Expr:
    """An ``index_check`` call without its check: the value (negative ones counted from the end with wrap)."""
    v, n, wrap, _tag, _site = index_check_parts(e)  # type: ignore[misc]
    return E.select(v < 0, v + n, v) if wrap else v


class _Checks(ExprMutator, StmtMutator):
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.sites: list[CheckSite] = []
        self.numbered: dict[int, Call] = {}  # id of a te-level check -> the numbered call
        self.opaque: frozenset[int] = frozenset()  # let-bound variables whose value is not quasi-affine

    def site(self, info: CheckSite) -> int:
        self.sites.append(info)
        return len(self.sites)

    def visit_Call(self, e: Call) -> Expr:
        return self._number(e, None, -1)

    def _number(self, e: Call, buffer: object, dim: int) -> Expr:
        parts = index_check_parts(e)
        if parts is None:
            return self.generic(e)
        v, n, wrap, tag, site = parts
        if not self.enabled:
            return self.visit(unchecked(e))
        if site:
            return e  # already numbered (a loop IR pass ran twice)
        key = id(e)
        if key not in self.numbered:
            v = self.visit(v)
            where = f"dimension {dim} of {buffer.name}" if buffer is not None else "an index"  # type: ignore[attr-defined]
            s = self.site(CheckSite("index", where, getattr(buffer, "name", ""), dim, str(n), wrap, tag))
            self.numbered[key] = E.index_check(v, n, wrap, tag, s)
        return self.numbered[key]

    def indices(self, buffer: object, indices: tuple[Expr, ...]) -> tuple[Expr, ...]:
        out = []
        for d, ix in enumerate(indices):
            extent = buffer.shape[d]  # type: ignore[attr-defined]
            parts = index_check_parts(ix)
            if parts is not None:
                new = self._number(ix, buffer, d)  # type: ignore[arg-type]
                if not self.enabled or structural_equal(parts[1], extent):
                    out.append(new)
                    continue
                ix = new
            else:
                ix = self.visit(ix)
            if self.enabled and not quasi_affine(ix, self.opaque):
                s = self.site(CheckSite("index", f"dimension {d} of {buffer.name}", buffer.name, d,  # type: ignore
                                        str(extent)))
                ix = E.index_check(ix, extent, False, -1, s)
            out.append(ix)
        return tuple(out)

    def visit_Load(self, e: Load) -> Expr:
        idx = self.indices(e.buffer, e.indices)
        return e if all(a is b for a, b in zip(idx, e.indices)) else Load(e.dtype, e.buffer, idx)

    def visit_expr(self, e: Expr) -> Expr:
        return self.visit(e)

    def visit_Store(self, s: Store) -> Stmt:
        idx, value = self.indices(s.buffer, s.indices), self.visit(s.value)
        if value is s.value and all(a is b for a, b in zip(idx, s.indices)):
            return s
        return Store(s.buffer, idx, value)

    def visit_LetStmt(self, s: LetStmt) -> Stmt:
        value = self.visit(s.value)
        saved = self.opaque
        if not quasi_affine(value, self.opaque):
            self.opaque = self.opaque | {id(s.var)}
        try:
            return LetStmt(s.var, value, self.visit_stmt(s.body))
        finally:
            self.opaque = saved


def insert_checks(func: LoweredFunc, entry: Sequence[tuple[Expr, CheckSite]] = (),
                  enabled: bool = True) -> LoweredFunc:
    """``func`` with its unproven indices checked and every check numbered (see the module docstring);
    ``entry`` are (condition on the sizes under which an access leaves its tensor, what it is)."""
    c = _Checks(enabled)
    body = c.visit_stmt(func.body)
    entry_checks = tuple((cond, c.site(info)) for cond, info in entry) if enabled else ()
    return dataclasses.replace(func, body=body, checks=tuple(c.sites), entry_checks=entry_checks)
