"""Storage of stages computed inside a loop (compute_at): a buffer per iteration.

A stage computed at loop ``leaf`` of its only reader needs, in each iteration
of that loop, only the region that iteration reads.  isl gives the region as
a function of the enclosing loops; its bounding box (a constant size, the
largest over all iterations) becomes a small local buffer allocated inside
the loop, and every access is shifted by the region's lower bound::

    for (i < 10) {                          for (i < 10) {
      for (b = i; b < i + 2; b++)             local float32 B[2];
        B[b] = A[b] * 2;                      for (b = i; b < i + 2; b++)
      C[i] = B[i] + B[i + 1];                   B[b - i] = A[b] * 2;
    }                                         C[i] = B[0] + B[1];
                                            }

A small local buffer ends up on the stack, or in registers once its indices
are constants (unrolled loops).  The buffer's dimensions are ordered like
the stage's loops, innermost last (a register tile ``C.local[f, x]`` whose
loops run ``x`` then a vectorised ``f`` is stored ``[x, f]``), so that the
innermost, vectorised loop walks contiguous memory.  Another reader is fine when isl shows it
reads only elements written in the same iteration (softmax's exponentials, read by the row sum
and the division inside one row iteration).  Stages whose region size depends on a run-time
size, or with a reader outside the iteration (a scan reads its earlier steps), keep a whole buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import islpy as isl

from cuvil.ir import expr as E
from cuvil.ir.expr import Expr, Var
from cuvil.ir.functor import free_vars
from cuvil.schedule.axes import leaf_values
from cuvil.schedule.model import PolyModel
from cuvil.schedule.timemap import TimeMaps, _truncate
from cuvil.te.tensor import ScanOp, ScatterOp


@dataclass(frozen=True)
class LocalStorage:
    """A stage stored per iteration of time dimension ``dim``: ``shape`` and the lower bounds."""

    stage: Any
    dim: int
    shape: tuple[int, ...]
    lower: tuple[isl.Aff, ...]  # over the time prefix [t_0 .. t_dim]
    fixed: dict[int, int]  # constant time dimensions of the prefix
    order: tuple[int, ...] = ()  # buffer dimension k holds element dimension order[k] (empty: as is)

    @property
    def buffer_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[o] for o in self.order) if self.order else self.shape

    def buffer_index(self, idx: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(idx[o] for o in self.order) if self.order else idx


def plan_storage(model: PolyModel, tm: TimeMaps, intermediates: list[Any]) -> dict[int, LocalStorage]:
    """id(stage) -> its local storage, for attached intermediates that qualify."""
    sched = model.schedule
    out: dict[int, LocalStorage] = {}
    for st in intermediates:
        if st.attach != "at" or id(st) not in tm.attach_dim:
            continue
        if isinstance(st.op, (ScanOp, ScatterOp)):  # each step reads the steps before it: earlier iterations' rows
            continue
        readers = [r for r in sched.compute_stages if r.attach != "inline" and sched.reads(r, st)]
        if not any(r is st.attach_stage for r in readers):
            continue
        d = tm.attach_dim[id(st)]
        stmts = [s for s in model.statements if s.stage is st]
        region = None
        for s in stmts:
            r = isl.UnionMap.from_map(_truncate(tm.maps[s.name], d + 1)).reverse().apply_range(s.writes)
            region = r if region is None else region.union(r)
        if region is None or region.is_empty():
            continue
        if len(readers) > 1 and not _reads_within(model, tm, readers, st, d, region):
            continue
        rmap = _free_determined_dims(isl.Map.from_union_map(region))  # prefix -> element
        shape, lower = [], []
        ok = True
        for e in range(rmap.dim(isl.dim_type.out)):
            lo_pw, hi_pw = rmap.dim_min(e), rmap.dim_max(e)
            best = None
            for aff in _pieces(lo_pw):
                cand = isl.PwAff.from_aff(aff).intersect_domain(lo_pw.domain())
                if not cand.gt_set(lo_pw).is_empty():
                    continue  # not a lower bound everywhere
                ext = hi_pw.sub(cand).max_val()
                if not ext.is_int():
                    continue
                size = ext.to_python() + 1
                if best is None or size < best[0]:
                    best = (size, aff)
            if best is None:
                ok = False
                break
            shape.append(best[0])
            lower.append(best[1])
        if not ok:
            continue
        first = tm.maps[stmts[0].name]
        fixed = {}
        for k in range(d + 1):
            v = first.plain_get_val_if_fixed(isl.dim_type.out, k)
            if v.is_int():
                fixed[k] = v.to_python()
        out[id(st)] = LocalStorage(st, d, tuple(shape), tuple(lower), fixed, _loop_order(st, len(shape)))
    return out


def _reads_within(model: PolyModel, tm: TimeMaps, readers: list[Any], st: Any, d: int,
                  region: isl.UnionMap) -> bool:
    """Whether every read of ``st`` by ``readers`` happens in an iteration of the first ``d + 1`` time
    dimensions that wrote the element read (a softmax's exponentials, read by the row sum and by the
    division, both computed in the same row iteration): then a buffer per iteration holds them all."""
    written = region.range()
    for s in model.statements:
        if not any(s.stage is r for r in readers):
            continue
        reads = s.reads.intersect_range(written)
        if reads.is_empty():
            continue
        r = isl.UnionMap.from_map(_truncate(tm.maps[s.name], d + 1)).reverse().apply_range(reads)
        if not r.is_subset(region):
            return False
    return True


def _loop_order(st: Any, ndim: int) -> tuple[int, ...]:
    """Element dimensions sorted by the innermost loop of the stage that runs each one (empty: keep)."""
    axes = list(st.op.axis)
    store = getattr(st.op, "store_indices", None)
    if len(axes) != ndim or (store is not None and not all(x is a for x, a in zip(store, axes))):
        return ()  # a packed layout: the element dimensions are not the loops' axes
    values = leaf_values(tuple(st.roots), st.relations)
    pos = {id(leaf): k for k, leaf in enumerate(st.leaves)}
    inner = []
    for e, a in enumerate(axes):
        ks = [pos[id(leaf)] for leaf in st.leaves if any(v is a for v in free_vars(values[id(leaf)]))]
        inner.append((max(ks) if ks else -1, e))
    order = tuple(e for _, e in sorted(inner))
    return () if order == tuple(range(ndim)) else order


def _free_determined_dims(rmap: isl.Map) -> isl.Map:
    """``rmap`` with every prefix dimension that is a function of the earlier ones left unconstrained.

    isl's AST has no iterator for such a dimension (it substitutes its value), so a lower bound must
    not be written in terms of it: a shared tile computed at a loop of a stage that is itself
    computed at a loop has a batch dimension equal to its consumer's.  The region is unchanged for
    every prefix that occurs.
    """
    n = rmap.dim(isl.dim_type.in_)
    dom = rmap.domain()
    for k in range(n - 1, -1, -1):
        upto = dom.project_out(isl.dim_type.set, k + 1, n - k - 1)  # dimensions 0 .. k
        fn = isl.Map.from_domain(upto).move_dims(isl.dim_type.out, 0, isl.dim_type.in_, k, 1)
        if fn.is_single_valued():
            rmap = rmap.project_out(isl.dim_type.in_, k, 1).insert_dims(isl.dim_type.in_, k, 1)
    return rmap


def _pieces(pw: isl.PwAff) -> list[isl.Aff]:
    pieces: list[isl.Aff] = []
    pw.foreach_piece(lambda _set, aff: pieces.append(aff))
    return pieces


def aff_to_expr(aff: isl.Aff, dims: list[Expr], params: dict[str, Var]) -> Expr:
    """An integer-valued isl affine expression as a cuvil int64 expression."""
    den = aff.get_denominator_val().to_python()
    total: Expr = E.const(0, "int64")

    def term(coef: isl.Val, x: Expr) -> Expr:
        c = int(coef.mul(isl.Val(den)).to_python())
        return x * c if c != 1 else x

    for i in range(aff.dim(isl.dim_type.in_)):
        c = aff.get_coefficient_val(isl.dim_type.in_, i)
        if not c.is_zero():
            total = total + term(c, dims[i])
    for i in range(aff.dim(isl.dim_type.param)):
        c = aff.get_coefficient_val(isl.dim_type.param, i)
        if not c.is_zero():
            name = aff.get_dim_name(isl.dim_type.param, i)
            total = total + term(c, params[name])
    for i in range(aff.dim(isl.dim_type.div)):
        c = aff.get_coefficient_val(isl.dim_type.div, i)
        if not c.is_zero():
            inner = aff.get_div(i)
            total = total + term(c, _floor(inner, dims, params))
    const = aff.get_constant_val()
    if not const.is_zero():
        total = total + term(const, E.const(1, "int64"))
    return total if den == 1 else total // den


def _floor(aff: isl.Aff, dims: list[Expr], params: dict[str, Var]) -> Expr:
    return aff_to_expr(aff, dims, params)
