"""The polyhedral model of a te program (islpy).

Each compute stage becomes isl statements: one for an element-wise compute,
two for a reduction (``init`` and ``update``), two for a scatter (``scatter_copy``
over the output, ``scatter_update`` over the updates).  A statement has an iteration
domain (run-time sizes are isl parameters), read and write access relations,
and the scalar work it does at each point (a Store in te terms)::

    C = te.compute((M, N), lambda i, j: te.sum(A[i, k] * B[k, j], axis=k))

    [M, N, K] -> { S0_C_init[i, j] : 0 <= i < M and 0 <= j < N }
    [M, N, K] -> { S0_C_update[i, j, k] : 0 <= i < M and 0 <= j < N and 0 <= k < K }
    writes  { S0_C_update[i, j, k] -> C[i, j] }
    reads   { S0_C_update[i, j, k] -> C[i, j]; S0_C_update[i, j, k] -> A[i, k]; ... -> B[k, j] }

Affine and quasi-affine indices (``//`` and ``%`` by constants) are exact;
a data-dependent index (``W[idx[t], d]``) reads the whole extent of that
dimension, and a scatter's store at one (``out[idx[u], r] = ...``) may write any
element of it (isl treats it as writing them all; the update also reads them all,
so the updates keep their order and only an ``r`` loop may run in parallel).
isl objects stay inside ``cuvil/schedule``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import islpy as isl

from cuvil.errors import CuvilError, IslBudgetError, ShapeError, UnsupportedOpError
from cuvil.ir import expr as E
from cuvil.ir.expr import Binary, Cast, Const, Expr, IterVar, TensorRead, Unary, Var
from cuvil.ir.functor import ExprMutator, substitute, walk
from cuvil.schedule.schedule import Schedule
from cuvil.te.tensor import ComputeOp, PlaceholderOp, ScanOp, ScatterOp, Tensor

# isl gives up with an error instead of running for minutes on huge problems
MAX_ISL_OPERATIONS = 2_000_000


@dataclass(frozen=True, eq=False)
class Statement:
    """One isl statement: ``tensor[indices] = value`` (if ``guard``) for each point of ``domain``."""

    name: str
    stage: Any  # cuvil.schedule.stage.Stage
    kind: str  # "compute", "init", "update", "scan_init", "scan_update", "scatter_copy", "scatter_update"
    iters: tuple[IterVar, ...]
    iter_names: tuple[str, ...]
    domain: isl.Set
    indices: tuple[Expr, ...]
    value: Expr
    guard: Expr | None
    reads: isl.UnionMap
    writes: isl.UnionMap

    @property
    def op(self) -> ComputeOp:
        return self.stage.op

    def __repr__(self) -> str:
        return f"Statement({self.name}: {self.domain})"


class Names:
    """isl names for parameters, tensors and statements (unique, isl-safe)."""

    def __init__(self) -> None:
        self.used: set[str] = set()

    def fresh(self, base: str) -> str:
        base = re.sub(r"\W", "_", base) or "v"
        if base[0].isdigit():
            base = "_" + base
        n, i = base, 0
        while n in self.used:
            i += 1
            n = f"{base}_{i}"
        self.used.add(n)
        return n


def isl_aff(e: Expr, names: dict[int, str]) -> str | None:
    """``e`` as an isl quasi-affine expression, or None if it is not one."""
    if isinstance(e, Const):
        return None if isinstance(e.value, (bool, float)) else str(int(e.value))
    if isinstance(e, Var):
        return names.get(id(e))
    if isinstance(e, Cast):
        if e.dtype.startswith(("int", "uint")) and e.value.dtype.startswith(("int", "uint")):
            return isl_aff(e.value, names)
        return None
    if isinstance(e, Unary) and e.op == "neg":
        a = isl_aff(e.a, names)
        return None if a is None else f"-({a})"
    if not isinstance(e, Binary) or not e.dtype.startswith(("int", "uint")):
        return None
    a, b = isl_aff(e.a, names), isl_aff(e.b, names)
    if a is None or b is None:
        return None
    if e.op in ("add", "sub"):
        return f"({a}) {'+' if e.op == 'add' else '-'} ({b})"
    if e.op == "mul":
        if isinstance(e.a, Const):
            return f"{a} * ({b})"
        if isinstance(e.b, Const):
            return f"{b} * ({a})"
        return None
    if e.op in ("floordiv", "floormod") and isinstance(e.b, Const) and e.b.value > 0:
        return f"floor(({a}) / {b})" if e.op == "floordiv" else f"(({a}) mod {b})"
    if e.op in ("min", "max"):
        return f"{e.op}({a}, {b})"
    return None


class _Inline(ExprMutator):
    """Reads of inlined stages -> the stage's body at those indices (recursively)."""

    def __init__(self, sched: Schedule):
        self.sched = sched

    def visit_TensorRead(self, e: TensorRead) -> Expr:
        idx = tuple(self.visit(i) for i in e.indices)
        st = self.sched.stage_of(e.tensor)
        if st is not None and st.attach == "inline":
            return self.visit(substitute(st.op.body, dict(zip(st.op.axis, idx))))
        return e if all(a is b for a, b in zip(idx, e.indices)) else TensorRead(e.dtype, e.tensor, idx)


class PolyModel:
    """Statements, parameters and the original (te-order) schedule of a program."""

    def __init__(self, sched: Schedule):
        self.schedule = sched
        self.names = Names()
        self.tensor_names: dict[int, str] = {}
        self.params: list[Var] = []
        self._param_names: dict[int, str] = {}
        self._collect_params()
        self.inline = _Inline(sched)
        self.statements: list[Statement] = []
        for pos, st in enumerate(sched.stages):
            if not st.is_placeholder and st.attach != "inline":
                self.statements.extend(self._stage_statements(pos, st))

    # -- parameters ---------------------------------------------------------
    def _collect_params(self) -> None:
        def visit(e: Expr) -> None:
            for n in walk(e):
                if isinstance(n, Var) and not isinstance(n, IterVar) and id(n) not in self._param_names:
                    if n.dtype not in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"):
                        continue  # reducer placeholders (acc, x) are substituted before use
                    self._param_names[id(n)] = self.names.fresh(n.name)
                    self.params.append(n)

        for st in self.schedule.stages:
            op = st.op
            for d in getattr(op, "shape", ()):
                visit(d)
            if not isinstance(op, PlaceholderOp):
                for a in op.axis + op.reduce_axis + getattr(op, "update_axis", ()):
                    visit(a.min)
                    visit(a.extent)
                bodies = ((op.init_body, op.update_body, op.init_extent) if isinstance(op, ScanOp) else
                          (op.init, op.value, *op.indices) if isinstance(op, ScatterOp) else (op.body,))
                for body in bodies:
                    for n in walk(body):
                        if isinstance(n, TensorRead):
                            for d in n.tensor.shape:
                                visit(d)
                    visit(body)

    @property
    def param_str(self) -> str:
        return "[" + ", ".join(self._param_names[id(p)] for p in self.params) + "]"

    def param_name(self, v: Var) -> str:
        return self._param_names[id(v)]

    @property
    def param_names(self) -> dict[int, str]:
        return self._param_names

    @cached_property
    def context(self) -> isl.Set:
        cons = " and ".join(f"{self._param_names[id(p)]} >= 0" for p in self.params)
        return isl.Set(f"{self.param_str} -> {{ : {cons or '0 = 0'} }}")

    def tensor_name(self, t: Tensor) -> str:
        """The isl name of a tensor: one per stage (a cache or replaced op keeps its stage's name)."""
        st = self.schedule.stage_of(t)
        key = id(st) if st is not None else id(t)
        if key not in self.tensor_names:
            self.tensor_names[key] = self.names.fresh(st.name if st is not None else t.name)
        return self.tensor_names[key]

    # -- statements ---------------------------------------------------------
    def _stage_statements(self, pos: int, st: Any) -> list[Statement]:
        if isinstance(st.op, ScanOp):
            return self._scan_statements(pos, st)
        if isinstance(st.op, ScatterOp):
            return self._scatter_statements(pos, st)
        op: ComputeOp = st.op
        out = op.output(0)
        body = op.body
        store = tuple(getattr(op, "store_indices", op.axis))
        if op.reduce_axis:
            acc = TensorRead(out.dtype, out, store)
            update = substitute(body.combined, {body.lhs: acc, body.rhs: self.inline.visit(body.source)})
            where = None if body.where is None else self.inline.visit(body.where)
            base = self.names.fresh(f"S{pos}_{st.name}")
            return [
                self._statement(f"{base}_init", st, "init", op.axis, store, body.identity, None),
                self._statement(f"{base}_update", st, "update", op.axis + op.reduce_axis, store, update, where),
            ]
        value = self.inline.visit(body)
        return [self._statement(self.names.fresh(f"S{pos}_{st.name}"), st, "compute", op.axis, store, value, None)]

    def _scan_statements(self, pos: int, st: Any) -> list[Statement]:
        """``init`` for t < len(init), ``update`` for the other steps; both over the scan's axes."""
        op: ScanOp = st.op
        base = self.names.fresh(f"S{pos}_{st.name}")
        t = op.axis[0]
        store = tuple(op.axis)
        return [
            self._statement(f"{base}_init", st, "scan_init", op.axis, store, self.inline.visit(op.init_body), None,
                            first=(E.const(0, "int64"), op.init_extent)),
            self._statement(f"{base}_update", st, "scan_update", op.axis, store, self.inline.visit(op.update_body),
                            None, first=(op.init_extent, t.extent - op.init_extent)),
        ]

    def _scatter_statements(self, pos: int, st: Any) -> list[Statement]:
        """``copy`` over the output's axes, then ``update`` over the updates' (see ``ScatterOp``).  The
        update reads the element it writes even where it only stores (``reduction="none"``): its write
        may land anywhere in a data-dependent dimension, so that read is what keeps the updates in order
        (the last one to a position wins)."""
        op: ScatterOp = st.op
        base = self.names.fresh(f"S{pos}_{st.name}")
        out = op.output(0)
        idx = tuple(self.inline.visit(i) for i in op.indices)
        itself = TensorRead(out.dtype, out, idx)
        return [
            self._statement(f"{base}_copy", st, "scatter_copy", op.axis, tuple(op.axis), self.inline.visit(op.init),
                            None),
            self._statement(f"{base}_update", st, "scatter_update", op.update_axis, idx,
                            self.inline.visit(op.value), None, also_reads=(itself,)),
        ]

    def _statement(self, name: str, st: Any, kind: str, iters: tuple[IterVar, ...], store: tuple[Expr, ...],
                   value: Expr, guard: Expr | None, first: tuple[Expr, Expr] | None = None,
                   also_reads: tuple[Expr, ...] = ()) -> Statement:
        op = st.op
        local = Names()
        local.used = set(self.names.used)
        iter_names = tuple(local.fresh(a.name) for a in iters)
        names = dict(self._param_names)
        names.update({id(a): n for a, n in zip(iters, iter_names)})
        cons = []
        for k, (a, n) in enumerate(zip(iters, iter_names)):
            lo_e, ext_e = (a.min, a.extent) if (k or first is None) else first
            lo, ext = isl_aff(lo_e, names), isl_aff(ext_e, names)
            if lo is None or ext is None:
                raise UnsupportedOpError(
                    f"compute {op.name}: the range of axis {a.name} ({a.min} .. {a.min} + {a.extent}) is not "
                    "affine in the sizes; use ints, te.var sizes and + - * // % by constants"
                )
            cons.append(f"{lo} <= {n} < ({lo}) + ({ext})")
        space = f"{name}[{', '.join(iter_names)}]"
        domain = isl.Set(f"{self.param_str} -> {{ {space} : {' and '.join(cons) or '0 = 0'} }}")
        writes = self._access(space, domain, op.output(0), store, names)
        reads = isl.UnionMap.empty(domain.get_space().params())
        seen: set[tuple[int, str]] = set()
        for root in (value,) + ((guard,) if guard is not None else ()) + also_reads:
            for n in walk(root):
                if isinstance(n, TensorRead) and (id(n.tensor), str(n.indices)) not in seen:
                    seen.add((id(n.tensor), str(n.indices)))
                    reads = reads.union(self._access(space, domain, n.tensor, n.indices, names))
        # one box instead of a map per read where the reads tile one (a Winograd tile's 16 taps, a 3x3
        # window written tap by tap): every dataflow question isl answers later is that much smaller
        reads = reads.coalesce()
        return Statement(name, st, kind, iters, iter_names, domain, store, value, guard, reads, writes)

    def _access(self, space: str, domain: isl.Set, t: Tensor, indices: tuple[Expr, ...],
                names: dict[int, str]) -> isl.UnionMap:
        outs, cons = [], []
        taken = set(names.values()) | set(self._param_names.values())
        prefix = "o"
        while any(n.startswith(prefix) and n[len(prefix):].isdigit() for n in taken):
            prefix += "_"  # an axis named o0 must not be mistaken for the element's dimension o0
        for d, (ix, ext) in enumerate(zip(indices, t.shape)):
            a = isl_aff(ix, names)
            o = f"{prefix}{d}"
            outs.append(o)
            if a is not None:
                cons.append(f"{o} = {a}")
            else:  # data-dependent: any element of this dimension may be read
                e = isl_aff(ext, names)
                cons.append(f"0 <= {o}" + (f" < {e}" if e is not None else ""))
        text = (f"{self.param_str} -> {{ {space} -> {self.tensor_name(t)}[{', '.join(outs)}] : "
                f"{' and '.join(cons) or '0 = 0'} }}")
        try:
            m = isl.Map(text)
        except isl.Error as exc:  # pragma: no cover - isl_aff only emits valid syntax
            raise ShapeError(f"cannot model the access {t.name}{list(map(str, indices))}: {exc}") from exc
        return isl.UnionMap.from_map(m.intersect_domain(domain))

    # -- union views ----------------------------------------------------------
    def union(self, attr: str) -> isl.UnionMap:
        result = None
        for s in self.statements:
            x = getattr(s, attr)
            result = x if result is None else result.union(x)
        return result if result is not None else isl.UnionMap("{ }")

    @cached_property
    def domain(self) -> isl.UnionSet:
        result = isl.UnionSet.empty(self.context.get_space())
        for s in self.statements:
            result = result.union(isl.UnionSet.from_set(s.domain))
        return result

    @property
    def reads(self) -> isl.UnionMap:
        return self.union("reads")

    @property
    def writes(self) -> isl.UnionMap:
        return self.union("writes")

    @cached_property
    def original_schedule(self) -> isl.UnionMap:
        """Stages in producer order, loops in te order; a reduction's init before its update loops::

            S_init[i, j] -> [stage, i, j, 0, 0];  S_update[i, j, k] -> [stage, i, j, 1, k]

        and a scatter's copy before its updates::

            S_copy[i, j] -> [stage, 0, i, j];  S_update[u, r] -> [stage, 1, u, r]
        """
        width = 2 + max((len(s.iters) + (s.kind == "update") for s in self.statements), default=0)
        result = isl.UnionMap.empty(self.context.get_space())
        pos = {id(st): k for k, st in enumerate(self.schedule.stages)}
        for s in self.statements:
            dims = [str(pos[id(s.stage)])] + list(s.iter_names[: len(s.op.axis)])
            if s.kind in ("scatter_copy", "scatter_update"):  # the copy, then the updates in order
                dims = [dims[0], "0" if s.kind == "scatter_copy" else "1"] + list(s.iter_names)
            if s.kind == "scan_init":
                dims = [dims[0], "0"] + dims[1:]
            elif s.kind == "scan_update":
                dims = [dims[0], "1"] + dims[1:]
            if s.kind == "init":
                dims.append("0")
            elif s.kind == "update":
                dims.append("1")
                dims.extend(s.iter_names[len(s.op.axis):])
            dims += ["0"] * (width - len(dims))
            m = isl.Map(f"{self.param_str} -> {{ {s.name}[{', '.join(s.iter_names)}] -> [{', '.join(dims)}] }}")
            result = result.union(isl.UnionMap.from_map(m.intersect_domain(s.domain)))
        return result


def build_model(sched: Schedule) -> PolyModel:
    return PolyModel(sched)


def _budget_spent() -> bool:
    """isl reports a spent operation bound as whatever call ran out; probe with a trivial one."""
    try:
        isl.Set("{ [0] }")
    except isl.Error:
        return True
    return False


@contextmanager
def isl_budget(what: str) -> Iterator[None]:
    """Run isl work under a fresh operation bound; an isl failure becomes a CuvilError."""
    ctx = isl.DEFAULT_CONTEXT
    ctx.set_max_operations(MAX_ISL_OPERATIONS)
    ctx.reset_operations()
    try:
        yield
    except isl.Error as exc:
        if _budget_spent():
            raise IslBudgetError(
                f"{what}: isl gave up after {MAX_ISL_OPERATIONS} operations; the program is too large or "
                "too irregular to model (simplify the indices or split the computation)"
            ) from exc
        raise CuvilError(f"{what}: isl failed: {exc}") from exc
    finally:
        ctx.set_max_operations(0)
        ctx.reset_operations()
