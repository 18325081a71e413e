"""Bounds, proved: every quasi-affine access of a te program lies inside its tensor (isl).

For each statement of the program as written (the schedule only reorders its points), each read and
write whose index in a dimension is quasi-affine (:func:`cuvil.ir.checks.quasi_affine`, the class
:func:`cuvil.schedule.model.isl_aff` models) is checked against the tensor's extent there, for every
value of the size parameters (``te.var``)::

    B = te.compute((n,), lambda i: A[i + 1])       # A: (m,)
    [n, m] -> { S0_B[i] -> A[o] : o = i + 1 and 0 <= i < n }      o >= m for some i when n >= m

- it holds for every size: nothing to do;
- it holds for no size for which the statement runs (``A[i + 1]`` with A of the loop's own extent, or
  any constant-size program that leaves its tensor): a ``ShapeError`` naming the statement, the access,
  the tensor, the dimension, and an example iteration (isl's ``sample_point``);
- it holds for some sizes only: the condition on the sizes under which it fails becomes a check made
  once per call (``LoweredFunc.entry_checks``, see :mod:`cuvil.ir.checks`).

A read inside ``te.if_then_else`` (or a reduction's ``where=``) runs only where its condition holds, so
it is judged on that part of the domain when the condition is affine (comparisons of quasi-affine
indices joined by ``& | ~``); under a condition that reads data it is judged on the whole domain, and
only proved, never refused (the condition may exclude the bad points).  A dimension whose index is
not quasi-affine (read from memory, computed in floats, a select) is left to the run-time checks of
:mod:`cuvil.ir.checks`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import islpy as isl

from cuvil.cache import BoundedCache
from cuvil.errors import IslBudgetError, ShapeError
from cuvil.ir import expr as E
from cuvil.ir.expr import Binary, Const, Expr, Select, TensorRead, Unary, Var
from cuvil.ir.functor import children
from cuvil.ir.stmt import CheckSite
from cuvil.schedule.model import PolyModel, Statement, isl_aff, isl_budget
from cuvil.te.tensor import PlaceholderOp, Tensor

log = logging.getLogger("cuvil.schedule")
_ISL_CMP = {"eq": "=", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
# id(op) of a program's outputs -> (those ops, the conditions to check at run time): the tuner lowers one
# program under many schedules, so the proof is needed for one program at a time
_PROVED: BoundedCache[tuple[int, ...], tuple[tuple[Any, ...], list[tuple[Expr, CheckSite]]]] = BoundedCache(
    "cuvil.schedule.bounds._PROVED", 256)


def prove_bounds(args: Sequence[Any], name: str) -> list[tuple[Expr, CheckSite]]:
    """Prove the accesses of the program computing the tensors in ``args`` (a build's arguments) inside
    their tensors; raise ``ShapeError`` for one that leaves its tensor for every size, and return the
    (condition on the sizes, what) pairs to check at run time for those that leave it for some sizes."""
    from cuvil.schedule.schedule import Schedule

    outputs = [a for a in args if isinstance(a, Tensor) and not isinstance(a.op, PlaceholderOp)]
    if not outputs:
        return []
    key = tuple(id(t.op) for t in outputs)
    hit = _PROVED.get(key)
    if hit is not None and all(a is b.op for a, b in zip(hit[0], outputs)):
        return hit[1]  # the tuner lowers one program under many schedules
    try:
        with isl_budget(f"proving the accesses of {name} in bounds"):
            model = _ProofModel(Schedule(outputs))
            entry = _Prover(model).run()
    except IslBudgetError as exc:  # a proof isl gives up on must not stop a program that lowers
        log.warning("%s: its accesses are not proved in bounds (%s); data-dependent indices are still "
                    "checked when it runs", name, str(exc).splitlines()[0])
        entry = []
    _PROVED[key] = (tuple(t.op for t in outputs), entry)
    return entry


class _ProofModel(PolyModel):
    """The statements of a program (domains, values, guards) without the access relations of the
    dependence analysis: the proof builds its own, grouped per tensor."""

    def _access(self, space: str, domain: isl.Set, t: Tensor, indices: tuple[Expr, ...],
                names: dict[int, str]) -> isl.UnionMap:
        return isl.UnionMap.empty(domain.get_space().params())


class _Prover:
    def __init__(self, model: PolyModel):
        self.model = model
        self.entry: list[tuple[Expr, CheckSite]] = []
        self.seen: set[tuple[str, int, str]] = set()
        # (statement, domain, tensor) -> the accesses made there: one isl test for all of them
        self.groups: dict[tuple[int, int, int], tuple[Any, ...]] = {}

    def run(self) -> list[tuple[Expr, CheckSite]]:
        for st in self.model.statements:
            names = dict(self.model.param_names)
            names.update({id(a): n for a, n in zip(st.iters, st.iter_names)})
            space = f"{st.name}[{', '.join(st.iter_names)}]"
            out = st.op.output(0)
            self.add(st, space, names, st.domain, out, st.indices, "writes", True)
            dom = st.domain
            if st.guard is not None:
                self.visit(st, space, names, st.guard, dom, True)
                dom, exact = self.condition(st.guard, space, names, dom)
            else:
                exact = True
            self.visit(st, space, names, st.value, dom, exact)
        for st, space, names, dom, exact, t, accesses in self.groups.values():
            self.check(st, space, names, dom, exact, t, accesses)
        return self.entry

    # -- where each read runs --------------------------------------------------------------
    def visit(self, st: Statement, space: str, names: dict[int, str], e: Expr, dom: isl.Set, exact: bool) -> None:
        """The reads of ``e`` evaluated on ``dom`` (``exact``: only there; else at most there)."""
        if isinstance(e, Select):
            self.visit(st, space, names, e.cond, dom, exact)
            cond, ok = self.condition(e.cond, space, names, dom)
            self.visit(st, space, names, e.t, cond, exact and ok)
            self.visit(st, space, names, e.f, dom.subtract(cond) if ok else dom, exact and ok)
            return
        if isinstance(e, TensorRead):
            self.add(st, space, names, dom, e.tensor, e.indices, "reads", exact)
        for c in children(e):
            self.visit(st, space, names, c, dom, exact)

    def condition(self, c: Expr, space: str, names: dict[int, str], dom: isl.Set) -> tuple[isl.Set, bool]:
        """The points of ``dom`` where the bool ``c`` holds, and whether that is exact (``dom`` when not)."""
        text = self.cond_text(c, names)
        if text is None:
            return dom, False
        return dom.intersect(isl.Set(f"{self.model.param_str} -> {{ {space} : {text} }}")), True

    def cond_text(self, c: Expr, names: dict[int, str]) -> str | None:
        if isinstance(c, Const) and c.dtype == "bool":
            return "0 = 0" if c.value else "1 = 0"
        if isinstance(c, Unary) and c.op == "not":
            inner = self.cond_text(c.a, names)
            return None if inner is None else f"not ({inner})"
        if not isinstance(c, Binary):
            return None
        if c.op in ("and", "or") and c.dtype == "bool":
            a, b = self.cond_text(c.a, names), self.cond_text(c.b, names)
            return None if a is None or b is None else f"({a}) {c.op} ({b})"
        if c.op in _ISL_CMP and c.a.dtype.startswith(("int", "uint")):
            a, b = isl_aff(c.a, names), isl_aff(c.b, names)
            return None if a is None or b is None else f"({a}) {_ISL_CMP[c.op]} ({b})"
        return None

    # -- accesses ----------------------------------------------------------------------------
    def add(self, st: Statement, space: str, names: dict[int, str], dom: isl.Set, t: Tensor,
            indices: tuple[Expr, ...], verb: str, exact: bool) -> None:
        key = (id(st), id(dom), id(t))
        if key not in self.groups:
            self.groups[key] = (st, space, names, dom, exact, t, {})
        accesses = self.groups[key][6]
        accesses.setdefault(", ".join(str(i) for i in indices), (indices, verb))

    def check(self, st: Statement, space: str, names: dict[int, str], dom: isl.Set, exact: bool, t: Tensor,
              accesses: dict[str, tuple[tuple[Expr, ...], str]]) -> None:
        """One test that every access of ``t`` on ``dom`` stays in its box; the accesses and their
        dimensions one by one only when it fails."""
        if dom.is_empty():
            return
        exts = [isl_aff(ext, names) for ext in t.shape]
        outs = ", ".join(f"o{d}" for d in range(len(t.shape)))
        terms = []
        for indices, _verb in accesses.values():
            eqs = []
            for d, (ix, n) in enumerate(zip(indices, exts)):
                a = isl_aff(ix, names)
                eqs.append(f"o{d} = {a}" if a is not None and n is not None else f"o{d} = 0")
            terms.append(f"({' and '.join(eqs) or '0 = 0'})")
        p = self.model.param_str
        whole = isl.Map(f"{p} -> {{ {space} -> [{outs}] : {' or '.join(terms)} }}")
        inside = " and ".join(f"0 <= o{d} < {n}" for d, n in enumerate(exts) if n) or "0 = 0"
        box = isl.Set(f"{p} -> {{ [{outs}] : {inside} }}")
        if whole.intersect_domain(dom).range().is_subset(box):
            return
        for indices, verb in accesses.values():
            for d, (ix, n) in enumerate(zip(indices, exts)):
                a = isl_aff(ix, names)
                if a is None or n is None:
                    continue  # not quasi-affine: checked at run time (cuvil.ir.checks)
                acc = isl.Map(f"{p} -> {{ {space} -> [o] : o = {a} }}").intersect_domain(dom)
                bad = acc.intersect_range(isl.Set(f"{p} -> {{ [o] : o < 0 or o >= {n} }}")).domain()
                if bad.is_empty():
                    continue
                if exact:
                    self.refuse_or_check(st, dom, bad, t, indices, d, verb)
                break

    def refuse_or_check(self, st: Statement, dom: isl.Set, bad: isl.Set, t: Tensor, indices: tuple[Expr, ...],
                        d: int, verb: str) -> None:
        read = f"{t.name}[{', '.join(str(i) for i in indices)}]"
        what = f"compute {st.op.name} {verb} {read}"
        bad_sizes = bad.params().intersect(self.model.context).coalesce()
        runs = dom.params().intersect(self.model.context)
        if not self.model.params or runs.subtract(bad_sizes).is_empty():
            raise ShapeError(f"{what} outside {t.name} (shape {_shape(t)}) in dimension {d}: "
                             f"{self.example(st, bad, indices[d])} (statement {st.name}); "
                             "guard the read with te.if_then_else, or change the index or the shape")
        by_name = {self.model.param_name(v): v for v in self.model.params}
        cond = _set_expr(bad_sizes.gist(self.model.context), by_name)
        text = str(cond)
        if (what, d, text) in self.seen:
            return
        self.seen.add((what, d, text))  # type: ignore[arg-type]
        self.entry.append((cond, CheckSite("sizes", f"{what}, which leaves {t.name} (shape {_shape(t)}) in "
                                                     f"dimension {d} when {text}", t.name, d,
                                           str(t.shape[d]))))

    def example(self, st: Statement, bad: isl.Set, index: Expr) -> str:
        pt = bad.sample_point()
        sizes = [f"{v.name} = {pt.get_coordinate_val(isl.dim_type.param, k).to_python()}"
                 for k, v in enumerate(self.model.params)]
        its = [f"{a.name} = {pt.get_coordinate_val(isl.dim_type.set, k).to_python()}"
               for k, a in enumerate(st.iters)]
        env = {id(v): E.const(pt.get_coordinate_val(isl.dim_type.param, k).to_python(), "int64")
               for k, v in enumerate(self.model.params)}
        env.update({id(a): E.const(pt.get_coordinate_val(isl.dim_type.set, k).to_python(), "int64")
                    for k, a in enumerate(st.iters)})
        value = _evaluate(index, env)
        at = f"at {', '.join(its)}" + (f" with {', '.join(sizes)}" if sizes else "")
        return f"{at} the index is {value}" if value is not None else at


def _shape(t: Tensor) -> str:
    return "(" + ", ".join(str(d) for d in t.shape) + ")"


def _evaluate(e: Expr, env: dict[int, Const]) -> int | None:
    """An integer index expression at a point (None if it is not plain integer arithmetic)."""
    if isinstance(e, Const):
        return int(e.value)
    if isinstance(e, Var):
        c = env.get(id(e))
        return None if c is None else int(c.value)
    if isinstance(e, E.Cast):
        return _evaluate(e.value, env)
    if isinstance(e, Unary) and e.op == "neg":
        a = _evaluate(e.a, env)
        return None if a is None else -a
    if isinstance(e, Binary):
        a, b = _evaluate(e.a, env), _evaluate(e.b, env)
        if a is None or b is None:
            return None
        ops = {"add": lambda: a + b, "sub": lambda: a - b, "mul": lambda: a * b, "min": lambda: min(a, b),
               "max": lambda: max(a, b), "floordiv": lambda: a // b if b else 0, "floormod": lambda: a % b if b else 0}
        return ops[e.op]() if e.op in ops else None
    return None


def _set_expr(s: isl.Set, vars_: dict[str, Var]) -> Expr:
    """A parameter set of isl as a bool expression of the size variables (basic sets or-ed), each
    constraint written ``positive terms >= negative terms`` (``n >= m + 1``)."""
    out: Expr | None = None
    for bset in s.get_basic_sets():
        term: Expr | None = None
        for c in bset.get_constraints():
            lhs, rhs = _constraint_sides(c, bset, vars_)
            cond = E.binary("eq" if c.is_equality() else "ge", lhs, rhs)
            term = cond if term is None else term & cond
        term = term if term is not None else E.const(True)
        out = term if out is None else out | term
    return out if out is not None else E.const(False)


def _param(vars_: dict[str, Var], space_obj: Any, k: int) -> Expr:
    v = vars_[space_obj.get_dim_name(isl.dim_type.param, k)]
    return v if v.dtype == "int64" else E.Cast("int64", v)


def _plus(e: Expr | None, coef: int, x: Expr) -> Expr:
    term = x if coef == 1 else E.const(coef, "int64") * x
    return term if e is None else e + term


def _constraint_sides(c: isl.Constraint, bset: isl.BasicSet, vars_: dict[str, Var]) -> tuple[Expr, Expr]:
    """``sum(coefficient * parameter or div) + constant`` (>= 0 or == 0) as (positive part, negative part)."""
    pos: Expr | None = None
    neg: Expr | None = None
    terms = [(c.get_coefficient_val(isl.dim_type.param, k).to_python(), _param(vars_, c.space, k))
             for k in range(c.space.dim(isl.dim_type.param))]
    terms += [(c.get_coefficient_val(isl.dim_type.div, k).to_python(), None, k)  # type: ignore[misc]
              for k in range(bset.dim(isl.dim_type.div))]
    for coef, x, *div in terms:
        if coef:
            x = x if x is not None else _div_expr(bset.get_div(div[0]), bset, vars_)
            if coef > 0:
                pos = _plus(pos, coef, x)
            else:
                neg = _plus(neg, -coef, x)
    k = c.get_constant_val().to_python()
    if k > 0 or (k and pos is None):
        pos = E.const(k, "int64") if pos is None else pos + E.const(k, "int64")
    elif k < 0:
        neg = E.const(-k, "int64") if neg is None else neg + E.const(-k, "int64")
    return (pos if pos is not None else E.const(0, "int64")), (neg if neg is not None else E.const(0, "int64"))


def _div_expr(aff: isl.Aff, bset: isl.BasicSet, vars_: dict[str, Var]) -> Expr:
    """``floor(aff)`` of a div of an isl basic set, as an expression of the sizes."""
    den = aff.get_denominator_val().to_python()
    num: Expr = E.const((aff.get_constant_val() * den).to_python(), "int64")
    for k in range(aff.dim(isl.dim_type.param)):
        coef = (aff.get_coefficient_val(isl.dim_type.param, k) * den).to_python()
        if coef:
            num = num + E.const(coef, "int64") * _param(vars_, aff.space, k)
    for k in range(aff.dim(isl.dim_type.div)):
        coef = (aff.get_coefficient_val(isl.dim_type.div, k) * den).to_python()
        if coef:
            num = num + E.const(coef, "int64") * _div_expr(aff.get_div(k), bset, vars_)
    return num // E.const(den, "int64") if den != 1 else num
