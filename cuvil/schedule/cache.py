"""Primitives that add stages: cache_write, cache_read (with packing layouts) and rfactor.

Each one rewrites the program (new ops, new stages) so that it computes the
same values; the result is still checked by isl like any other primitive.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import islpy as isl

from cuvil.errors import ScheduleError
from cuvil.ir import expr as E
from cuvil.ir.expr import Expr, IterVar, Reduce, TensorRead
from cuvil.ir.functor import ExprMutator, substitute
from cuvil.schedule.axes import Split, const_int, depends_on, leaf_values, original_from_leaves
from cuvil.schedule.trace import Step
from cuvil.te.tensor import ComputeOp, ScanOp, ScatterOp, Tensor

SCOPES = ("global", "local")
READ_SCOPES = SCOPES + ("shared",)  # "shared": a GPU block's shared memory (cache_read on CUDA targets)


def _scope(scope: str, what: str, scopes: tuple[str, ...] = SCOPES) -> None:
    if scope not in scopes:
        raise ScheduleError(f"{what}: unknown scope {scope!r}; the scopes are {scopes}")


def _fresh_axes(axes: tuple[IterVar, ...]) -> tuple[IterVar, ...]:
    return tuple(IterVar("int64", a.name, a.min, a.extent, a.kind) for a in axes)


def _with_body(op: ComputeOp, body: Expr) -> ComputeOp:
    """``op`` with a new body, the same axes (so the stage's loops stay valid)."""
    return ComputeOp(op.name, op.axis, body, op.tag, op.attrs, op.shape, op.store_indices)


def _rebuild_reduce(r: Reduce, source: Expr, axis: tuple[IterVar, ...], where: Expr | None) -> Reduce:
    return Reduce(r.dtype, r.name, r.lhs, r.rhs, r.combined, r.identity, source, axis, where)


def _untouched(st: Any, what: str) -> None:
    same = len(st.leaves) == len(st.roots) and all(a is b for a, b in zip(st.leaves, st.roots))
    if st.relations or st.kinds or st.attach != "root" or not same:
        raise ScheduleError(f"{what}: apply it before scheduling the loops of {st.name} (it resets them)")
    _no_attached(st, what)


def _no_attached(st: Any, what: str) -> None:
    here = st.attached_here()
    if here:
        raise ScheduleError(f"{what}: {', '.join(here)} is computed at a loop of {st.name}; apply it before "
                            "compute_at")


def cache_write(sched: Any, tensor: Tensor, scope: str) -> Tensor:
    """Compute ``tensor`` in a new stage ``T.<scope>`` and copy it out.

    Before, after ``CC = s.cache_write(C, "local")``::

        for (i, j) { C[i, j] = 0;                 for (i, j) { C.local[i, j] = 0;
          for (k) C[i, j] += A[i, k] * B[k, j] }    for (k) C.local[i, j] += A[i, k] * B[k, j] }
                                                  for (i, j) C[i, j] = C.local[i, j]

    ``s[CC].compute_at(s[C], ...)`` then keeps the tile in a small local buffer (registers).
    """
    what = f"cache_write({tensor.name if isinstance(tensor, Tensor) else tensor!r}, {scope!r})"
    st = sched[tensor]
    _scope(scope, what)
    op = st.op
    if not isinstance(op, ComputeOp) or isinstance(op, ScanOp):
        raise ScheduleError(f"{what}: only a te.compute stage can be cached")
    _untouched(st, what)
    out: list[Tensor] = []

    def do() -> None:
        axes = _fresh_axes(op.axis)
        mapping: dict[Any, Expr] = dict(zip(op.axis, axes))
        if isinstance(op.body, Reduce):
            raxes = _fresh_axes(op.reduce_axis)
            mapping.update(zip(op.reduce_axis, raxes))
            r = op.body
            body: Expr = _rebuild_reduce(r, substitute(r.source, mapping), raxes,
                                         None if r.where is None else substitute(r.where, mapping))
        else:
            body = substitute(op.body, mapping)
        cache = ComputeOp(sched.fresh_name(f"{op.name}.{scope}"), axes, body)
        stage = sched.new_stage(cache, before=st)
        stage.scope = scope
        # the copy-out keeps the stage's own layout (a packed copy stays packed)
        st.set_op(ComputeOp(op.name, op.axis, cache.output(0)[tuple(op.axis)], op.tag, op.attrs, op.shape,
                            op.store_indices))
        out.append(cache.output(0))

    sched.apply(Step("cache_write", st.name, (scope,)), do, check=False)
    return out[0]


class _Redirect(ExprMutator):
    def __init__(self, src: Any, dst: Tensor, layout: Callable[[tuple[Expr, ...]], tuple[Expr, ...]] | None,
                 sched: Any):
        self.src, self.dst, self.layout, self.sched = src, dst, layout, sched

    def visit_TensorRead(self, e: TensorRead) -> Expr:
        idx = tuple(self.visit(i) for i in e.indices)
        if self.sched.stage_of(e.tensor) is self.src:
            new = self.layout(idx) if self.layout is not None else idx
            return TensorRead(e.dtype, self.dst, tuple(new))
        return TensorRead(e.dtype, e.tensor, idx)


def cache_read(sched: Any, tensor: Tensor, scope: str, readers: Sequence[Any],
               layout: Callable[..., Any] | None = None) -> Tensor:
    """Copy ``tensor`` into a new stage that ``readers`` read instead; with ``layout`` the copy
    is packed: element ``idx`` goes to ``layout(*idx)`` (e.g. panels of 16 columns).

    Before, after ``BP = s.cache_read(B, "global", [C], layout=lambda k, j: (j // 16, k, j % 16))``::

                                            for (k, j) B.global[j // 16, k, j % 16] = B[k, j]
        C[i, j] += A[i, k] * B[k, j]        C[i, j] += A[i, k] * B.global[j // 16, k, j % 16]
    """
    what = f"cache_read({getattr(tensor, 'name', tensor)!r}, {scope!r})"
    src = sched[tensor]
    _scope(scope, what, READ_SCOPES)
    if not isinstance(readers, (list, tuple)) or not readers:
        raise ScheduleError(f"{what}: readers must be a non-empty list of tensors that read {src.name}")
    rstages = []
    for r in readers:
        rs = sched[r]
        if not sched.reads(rs, src):
            raise ScheduleError(f"{what}: {rs.name} does not read {src.name}")
        if isinstance(rs.op, (ScanOp, ScatterOp)):
            raise ScheduleError(f"{what}: a {'scan' if isinstance(rs.op, ScanOp) else 'scatter'} cannot read "
                                "through a cache yet")
        if src.attach == "at" and src.attach_stage is rs:
            raise ScheduleError(f"{what}: {src.name} is computed at a loop of {rs.name}; apply cache_read before "
                                "compute_at")
        rstages.append(rs)
    data = src.op.output(0)
    axes = tuple(IterVar("int64", f"ax{d}", E.const(0, "int64"), ext, "data") for d, ext in enumerate(data.shape))
    fn = None
    shape: tuple[Expr, ...] | None = None
    store: tuple[Expr, ...] | None = None
    layout_json = None
    if layout is not None:
        def fn(idx: tuple[Expr, ...]) -> tuple[Expr, ...]:
            res = layout(*idx)
            res = tuple(res) if isinstance(res, (tuple, list)) else (res,)
            return tuple(E.as_expr(x, "int64") for x in res)

        store = fn(axes)
        shape = _layout_shape(axes, store, what)
        from cuvil.schedule.trace import expr_to_json

        layout_json = tuple(expr_to_json(x, {id(a): f"ax{d}" for d, a in enumerate(axes)}) for x in store)
    out: list[Tensor] = []

    def do() -> None:
        copy = ComputeOp(sched.fresh_name(f"{src.name}.{scope}"), axes, data[axes], shape=shape,
                         store_indices=store)
        stage = sched.new_stage(copy, after=src)
        stage.scope = scope
        dst = copy.output(0)
        for rs in rstages:
            redirect = _Redirect(src, dst, fn, sched)
            body = rs.op.body
            if isinstance(body, Reduce):
                new: Expr = _rebuild_reduce(body, redirect.visit(body.source), body.axis,
                                            None if body.where is None else redirect.visit(body.where))
            else:
                new = redirect.visit(body)
            rs.set_op(_with_body(rs.op, new), keep_loops=True)
        out.append(dst)

    args = (scope, tuple(sched[r].name for r in readers)) + ((layout_json,) if layout_json is not None else ())
    sched.apply(Step("cache_read", src.name, args), do, check=False)
    return out[0]


def _layout_shape(axes: tuple[IterVar, ...], store: tuple[Expr, ...], what: str) -> tuple[Expr, ...]:
    """The box that the layout maps the tensor's index space into (constant sizes)."""
    from cuvil.schedule.model import isl_aff

    names = {id(a): f"a{d}" for d, a in enumerate(axes)}
    exts = [const_int(a.extent) for a in axes]
    if any(e is None for e in exts):
        raise ScheduleError(f"{what}: a packing layout needs a tensor of constant shape")
    affs = [isl_aff(x, names) for x in store]
    if any(a is None for a in affs):
        raise ScheduleError(f"{what}: the layout must be affine in the indices (+, -, * and // % by constants)")
    dom = " and ".join(f"0 <= a{d} < {e}" for d, e in enumerate(exts))
    m = isl.Map(f"{{ [{', '.join(names.values())}] -> [{', '.join(affs)}] : {dom} }}")  # type: ignore[arg-type]
    if not m.is_injective():
        raise ScheduleError(f"{what}: the layout maps two elements to the same place")
    rng = m.range()
    shape = []
    for d in range(len(store)):
        lo, hi = rng.dim_min(d), rng.dim_max(d)
        lo_v, hi_v = lo.min_val(), hi.max_val()
        if not lo_v.is_int() or lo_v.to_python() < 0:
            raise ScheduleError(f"{what}: layout dimension {d} can be negative")
        shape.append(E.const(hi_v.to_python() + 1, "int64"))
    return tuple(shape)


def rfactor(sched: Any, tensor: Tensor, axis: IterVar, factor_axis: int = 0) -> Tensor:
    """Factor a reduction: a new stage reduces over every reduction loop but ``axis``, keeping
    ``axis`` as a data dimension (at ``factor_axis``); the original then reduces over it.

    Before, after ``s[S].split(k, 16)`` and ``SF = s.rfactor(S, k.inner)``::

        S[0] = sum(k) A[k]          SF[ki, 0] = sum(k.outer) A[k.outer * 16 + ki]     (ki may run in parallel)
                                    S[0] = sum(ki) SF[ki, 0]
    """
    st = sched[tensor]
    op = st.op
    what = f"rfactor({getattr(tensor, 'name', tensor)!r}, {getattr(axis, 'name', axis)!r})"
    if not isinstance(op, ComputeOp) or not isinstance(op.body, Reduce):
        raise ScheduleError(f"{what}: {st.name} is not a reduction")
    k = st._leaf(axis, "rfactor")
    vals = leaf_values(st.roots, st.relations)
    red = [a for a in st.leaves if a.kind == "reduce"]  # derived from reduction axes (fuse keeps kinds apart)
    if not any(k is a for a in red):
        raise ScheduleError(f"{what}: {k.name} is not a reduction loop of {st.name}")
    for a in red:
        if depends_on(vals[id(a)], op.axis):
            raise ScheduleError(f"{what}: loop {a.name} mixes data and reduction axes")
    _no_attached(st, what)
    ndata = len(op.axis)
    if not isinstance(factor_axis, int) or not 0 <= factor_axis <= ndata:
        raise ScheduleError(f"{what}: factor_axis must be an int in [0, {ndata}]")
    if st.attach != "root":
        raise ScheduleError(f"{what}: apply rfactor before compute_at/compute_inline of {st.name}")
    out: list[Tensor] = []

    def do() -> None:
        r: Reduce = op.body
        data = _fresh_axes(op.axis)
        kf = IterVar("int64", k.name.replace(".", "_") + "_v", E.const(0, "int64"), k.extent, "data")
        rest = [IterVar("int64", a.name, E.const(0, "int64"), a.extent, "reduce") for a in red if a is not k]
        leaf_map = {id(a): b for a, b in zip([a for a in red if a is not k], rest)}
        leaf_map[id(k)] = kf
        inv = original_from_leaves(st.roots, st.relations, list(red))
        mapping: dict[Any, Expr] = dict(zip(op.axis, data))
        for ra in op.reduce_axis:
            mapping[ra] = substitute(inv[id(ra)], {a: leaf_map[id(a)] for a in red})
        guard = _split_guard(st, op.reduce_axis, mapping, red, leaf_map)
        where = None if r.where is None else substitute(r.where, mapping)
        if guard is not None:
            where = guard if where is None else E.binary("and", guard, where)
        rf_axes = data[:factor_axis] + (kf,) + data[factor_axis:]
        if rest:
            body: Expr = _rebuild_reduce(r, substitute(r.source, mapping), tuple(rest), where)
        else:
            src = substitute(r.source, mapping)
            body = src if where is None else E.select(where, src, r.identity)
        rf = ComputeOp(sched.fresh_name(f"{st.name}.rf"), rf_axes, body)
        sched.new_stage(rf, before=st)
        kr = IterVar("int64", kf.name, E.const(0, "int64"), k.extent, "reduce")
        idx = tuple(op.axis[:factor_axis]) + (kr,) + tuple(op.axis[factor_axis:])
        final = _rebuild_reduce(r, rf.output(0)[idx], (kr,), None)
        st.set_op(ComputeOp(op.name, op.axis, final, op.tag, op.attrs))
        out.append(rf.output(0))

    sched.apply(Step("rfactor", st.name, (k.name, factor_axis)), do, check=False)
    return out[0]


def _split_guard(st: Any, raxes: tuple[IterVar, ...], mapping: dict[Any, Expr], red: list[IterVar],
                 leaf_map: dict[int, IterVar]) -> Expr | None:
    """``lo <= r < lo + extent`` for reduction axes that a non-dividing split can overshoot, and
    ``p < p.min + extent`` for each such split's parent ``p`` that is not a reduction axis itself (a loop
    of extent 1 split by 2 overshoots it while the axis above stays in range: without its own guard the
    rfactored stage would add some terms twice)."""
    overshoot = []
    for rel in st.relations:
        if isinstance(rel, Split):
            ext, f = const_int(rel.parent.extent), const_int(rel.factor)
            if ext is None or f is None or ext % f:
                overshoot.append(rel.parent)
    # an overshoot anywhere in the chain of a reduction axis can take it out of range
    conds = []
    for ra in raxes:
        if overshoot:
            e = mapping[ra]
            conds.append(E.binary("and", E.binary("ge", e, ra.min), E.binary("lt", e, ra.min + ra.extent)))
    inner = [p for p in overshoot if p.kind == "reduce" and all(p is not ra for ra in raxes)]
    if inner:
        every = original_from_leaves(st.roots, st.relations, list(red), every=True)
        for p in inner:
            if id(p) in every:
                e = substitute(every[id(p)], {a: leaf_map[id(a)] for a in red})
                conds.append(E.binary("lt", e, p.min + p.extent))
    if not conds:
        return None
    out = conds[0]
    for c in conds[1:]:
        out = E.binary("and", out, c)
    return out


__all__ = ["cache_read", "cache_write", "rfactor"]
