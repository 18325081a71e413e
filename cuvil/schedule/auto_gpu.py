"""The automatic scheduler for CUDA targets: blocks, threads, shared-memory tiles.

``cuvil.auto_schedule(args, target="cuda -arch=sm_90")`` comes here.  Stage by
stage (consumers first), with the public primitives only, so isl proves every
choice legal (``bind`` loops carry no dependence) and the trace records it:

1. Element-wise stages that are not outputs are inlined into their readers,
   unless a reduction reads them with reuse (a padded input): those get their
   own kernel.
2. A *contraction* ``C[..., i, j] = sum_k X[.., i, .., k ..] * Y[.., k, .., j ..]``
   (matmul, transposed or batched) is tiled to blocks of ``BM x BN`` outputs
   (``blockIdx.y``, ``blockIdx.x``; batches on ``blockIdx.z``), each computed by
   ``TY x TX`` threads with an ``RM x RN`` register tile spread ``TY`` rows and
   ``TX`` columns apart (neighbouring threads touch neighbouring columns:
   coalesced global accesses, no shared-memory bank conflicts).  The
   reduction is split in steps of ``BK``; per step both operand tiles are
   copied to shared memory (``cache_read(..., "shared")`` computed at that
   step) by all the threads of the block, ``threadIdx.x`` along the operand's
   contiguous dimension, then read from there ``BM``/``BN`` times.
3. A reduction over one long axis that its operands store contiguously (a
   row sum, a norm) is split in two kernels with ``rfactor``: ``T`` threads
   per row each sum a strided part (coalesced), then one thread per row adds
   the ``T`` partial sums.
4. Everything else (element-wise stages, other reductions) runs one thread
   per output element: the innermost output axes (constant extents) are fused
   and split into blocks of 256 threads; a reduction sums in a register
   (``cache_write`` computed at the thread's loop).

A stage whose strategy isl refuses keeps its loops (a kernel on one thread)
rather than failing: correct, and slow; ``cuvil.lower`` shows it, and the
schedule's ``fallbacks`` and the ``cuvil.schedule`` log say so.
"""

from __future__ import annotations

from typing import Any

from cuvil.errors import ScheduleError
from cuvil.ir.expr import IterVar, Reduce, TensorRead
from cuvil.ir.functor import free_vars, walk
from cuvil.schedule.axes import const_int
from cuvil.schedule.contraction import product_operands
from cuvil.schedule.fallback import REFUSED, fall_back
from cuvil.schedule.schedule import Schedule
from cuvil.schedule.stage import Stage
from cuvil.te.tensor import ComputeOp, ScanOp

THREADS = 256  # threads per block of the one-thread-per-output strategy
TILE = 128  # a contraction's block tile (BM = BN) on large operands: 16 x 16 threads, 8 x 8 outputs each


def _pow2_at_most(n: int, cap: int) -> int:
    p = 1
    while p * 2 <= min(n, cap):
        p *= 2
    return p


def _words(name: str) -> str:
    """A strategy's method name as words: ``one_thread_per_output`` -> ``one thread per output``."""
    return name.replace("_", " ")


def _uses(e: Any, v: IterVar) -> bool:
    return any(x is v for x in free_vars(e))


class GpuScheduler:
    """Schedules every stage of ``s`` for an NVIDIA GPU (see the module docstring)."""

    def __init__(self, s: Schedule, outputs: list[Stage], target: Any):
        self.s = s
        self.outputs = outputs
        self.target = target

    def run(self) -> Schedule:
        s = self.s
        for st in list(s.compute_stages):
            if any(st is o for o in self.outputs) or st.op.reduce_axis or self._reused_by_reduction(st):
                continue
            try:
                st.compute_inline()
            except REFUSED as exc:  # a kernel of its own, its result in global memory: a loss (WARNING)
                fall_back(s, st, "compute_inline", exc, "a kernel of its own instead")
        for st in reversed(list(s.compute_stages)):
            if st.attach != "root" or isinstance(st.op, ScanOp) or not isinstance(st.op, ComputeOp):
                continue
            strategies = (self.contraction_in_registers, self.contraction, self.long_reduction,
                          self.one_thread_per_output_in_registers, self.one_thread_per_output)
            for n, strategy in enumerate(strategies):
                try:
                    with s.deferred_checks(self.outputs):
                        if strategy(st):
                            break
                except REFUSED as exc:  # undone (a strategy that does not apply says so before changing
                    # anything, or raises); the next one is the normal course of the search (DEBUG), and
                    # none left is a loss (WARNING): the stage keeps its loops, on one thread
                    last = n == len(strategies) - 1
                    fall_back(s, st, _words(strategy.__name__), exc,
                              "its loops on one thread instead" if last else
                              f"{_words(strategies[n + 1].__name__)} tried instead", loss=last)
        return s

    def _reused_by_reduction(self, st: Stage) -> bool:
        for r in self.s.compute_stages:
            if self.s.reads(r, st) and r.op.reduce_axis:
                for n in walk(r.op.body):
                    if isinstance(n, TensorRead) and self.s.stage_of(n.tensor) is st and \
                            any(_uses(ix, a) for ix in n.indices for a in r.op.reduce_axis):
                        return True
        return False

    # -- 4. one thread per output element ------------------------------------------------
    def one_thread_per_output(self, st: Stage) -> bool:
        axes = list(st.op.axis)
        if not axes:
            return False
        fused = axes[-1]
        rest = axes[:-1]
        while rest and const_int(fused.extent) is not None:
            fused = st.fuse(rest.pop(), fused)
        ext = const_int(fused.extent)
        threads = THREADS if ext is None else _pow2_at_most(ext, THREADS) if ext < THREADS else THREADS
        bo, ti = st.split(fused, factor=threads)
        if rest or st.op.reduce_axis:
            st.reorder(bo, ti, *rest, *st.op.reduce_axis)
        st.bind(bo, "blockIdx.x")
        st.bind(ti, "threadIdx.x")
        return True

    def one_thread_per_output_in_registers(self, st: Stage) -> bool:
        """A reduction, one thread per output, its sum kept in a register (cache_write computed at the
        thread's loop) rather than read and written in global memory at every step."""
        if not st.op.reduce_axis or not st.op.axis:
            return False
        local = self.s.cache_write(st.op.output(0), "local")
        self.one_thread_per_output(st)
        ti = next(a for a in st.leaves if st.kinds.get(id(a)) == "threadIdx.x")
        if ti is not st.leaves[-1]:  # serial loops inside the thread's loop: undone (deferred_checks)
            raise ScheduleError("a thread's outputs would not fit in registers")
        self.s[local].compute_at(st, ti)
        return True

    # -- 3. a long reduction: rfactor over threads ----------------------------------------
    def long_reduction(self, st: Stage) -> bool:
        op = st.op
        if len(op.reduce_axis) != 1 or not isinstance(op.body, Reduce) or op.body.where is not None:
            return False
        k = op.reduce_axis[0]
        n = const_int(k.extent)
        reads = [r for r in walk(op.body.source) if isinstance(r, TensorRead) and any(_uses(x, k) for x in r.indices)]
        if n is None or n < 512 or not reads or not all(_uses(r.indices[-1], k) for r in reads):
            return False  # short, or along a strided axis: one thread per output reads coalesced already
        t = 128
        ko, ki = st.split(k, factor=t)
        rf = self.s.rfactor(op.output(0), ki)
        local = self.s.cache_write(rf, "local")  # each thread's partial sum in a register
        rs = self.s[rf]
        ki2, *rdata = rs.op.axis
        if rdata:
            row = rdata[0]
            for a in rdata[1:]:
                row = rs.fuse(row, a)
            rs.reorder(row, ki2, *rs.op.reduce_axis)
            rs.bind(row, "blockIdx.x")
        rs.bind(ki2, "threadIdx.x")
        self.s[local].compute_at(rs, ki2)
        st2 = self.s[op.output(0)]
        if st2.op.axis:
            self.one_thread_per_output(st2)
        return True

    # -- 2. contractions: shared-memory tiles --------------------------------------------
    def _operands(self, st: Stage) -> tuple[TensorRead, TensorRead] | None:
        pair = product_operands(st.op.body)
        if pair is None or len(st.op.axis) < 2:
            return None
        ops = list(pair)
        i, j = st.op.axis[-2], st.op.axis[-1]

        def reads(r: TensorRead, a: IterVar) -> bool:
            return any(_uses(ix, a) for ix in r.indices)

        for x, y in (ops, ops[::-1]):
            if reads(x, i) and not reads(x, j) and reads(y, j) and not reads(y, i) and \
                    all(reads(x, a) and reads(y, a) for a in st.op.reduce_axis) and \
                    len(x.indices) >= 2 and len(y.indices) >= 2:
                return x, y
        return None

    def _tiles(self, st: Stage) -> tuple[int, int, int, int, int]:
        """``BM, TY, BN, TX, BK`` for a contraction stage."""
        *_, i, j = st.op.axis
        (k,) = st.op.reduce_axis
        sizes = []
        for a in (i, j):
            e = const_int(a.extent)
            b = TILE if e is None or e >= 2 * TILE else 64 if e >= 64 else _pow2_at_most(max(e, 1), 64)
            sizes.append((b, min(16, b)))
        ek = const_int(k.extent)
        (bm, ty), (bn, tx) = sizes
        return bm, ty, bn, tx, 16 if ek is None or ek >= 16 else max(1, ek)

    def _stage_in_shared(self, cache: Any, at: Stage, loop: IterVar, ty: int, tx: int) -> None:
        """Compute an operand's shared tile at ``loop``, copied by all the threads (x along its last axis)."""
        cs = self.s[cache]
        if len(cs.op.axis) < 2:
            raise ScheduleError("an operand of fewer than two dimensions")
        cs.compute_at(at, loop)
        *outer, a0, a1 = cs.op.axis
        o0, i0 = cs.split(a0, factor=ty)
        o1, i1 = cs.split(a1, factor=tx)
        cs.reorder(*outer, o0, o1, i0, i1)
        cs.bind(i0, "threadIdx.y")
        cs.bind(i1, "threadIdx.x")

    def contraction_in_registers(self, st: Stage) -> bool:
        """Tiles as in :meth:`contraction`, each thread accumulating its outputs in registers: the sum is
        computed in a ``cache_write`` stage at the block's loop (the CUDA code generator keeps a buffer
        whose elements each belong to one thread in that thread's registers), then copied out."""
        ops = self._operands(st)
        if ops is None or len(st.op.reduce_axis) != 1:
            return False
        x, y = ops
        bm, ty, bn, tx, bk = self._tiles(st)
        s = self.s
        cl = s.cache_write(st.op.output(0), "local")
        xs = s.cache_read(x.tensor, "shared", [cl])
        ys = s.cache_read(y.tensor, "shared", [cl])
        *batch, i, j = st.op.axis
        bi, ii = st.split(i, factor=bm)
        ri, ti = st.split(ii, factor=ty)
        bj, jj = st.split(j, factor=bn)
        rj, tj = st.split(jj, factor=tx)
        order = [bi, bj, ti, tj, ri, rj]
        bz = self._batch(st, batch, order)
        st.reorder(*order)
        if bz is not None:
            st.bind(bz, "blockIdx.z")
        st.bind(bi, "blockIdx.y")
        st.bind(bj, "blockIdx.x")
        st.bind(ti, "threadIdx.y")
        st.bind(tj, "threadIdx.x")
        cs = s[cl]
        cs.compute_at(st, bj)
        *cbatch, ci, cj = cs.op.axis
        (ck,) = cs.op.reduce_axis
        cri, cti = cs.split(ci, factor=ty)
        crj, ctj = cs.split(cj, factor=tx)
        ko, ki = cs.split(ck, factor=bk)
        cs.reorder(*cbatch, ko, cti, ctj, ki, cri, crj)
        cs.bind(cti, "threadIdx.y")
        cs.bind(ctj, "threadIdx.x")
        for cache in (xs, ys):
            self._stage_in_shared(cache, cs, ko, ty, tx)
        return True

    def _batch(self, st: Stage, batch: list[IterVar], order: list[IterVar]) -> IterVar | None:
        if not batch:
            return None
        bz = batch[0]
        for a in batch[1:]:
            bz = st.fuse(bz, a)
        order.insert(0, bz)
        return bz

    def contraction(self, st: Stage) -> bool:
        ops = self._operands(st)
        if ops is None or len(st.op.reduce_axis) != 1:
            return False
        x, y = ops
        *batch, i, j = st.op.axis
        (k,) = st.op.reduce_axis
        sizes = []
        for a in (i, j):
            e = const_int(a.extent)
            b = TILE if e is None or e >= 2 * TILE else 64 if e >= 64 else _pow2_at_most(max(e, 1), 64)
            t = min(16, b)
            sizes.append((b, t))
        (bm, ty), (bn, tx) = sizes
        ek = const_int(k.extent)
        bk = 16 if ek is None or ek >= 16 else max(1, ek)
        s = self.s
        xs = s.cache_read(x.tensor, "shared", [st.op.output(0)])
        ys = s.cache_read(y.tensor, "shared", [st.op.output(0)])
        bi, ii = st.split(i, factor=bm)
        ri, ti = st.split(ii, factor=ty)
        bj, jj = st.split(j, factor=bn)
        rj, tj = st.split(jj, factor=tx)
        ko, ki = st.split(k, factor=bk)
        order = [bi, bj, ko, ti, tj, ki, ri, rj]
        bz = None
        if batch:
            bz = batch[0]
            for a in batch[1:]:
                bz = st.fuse(bz, a)
            order = [bz] + order
        st.reorder(*order)
        if bz is not None:
            st.bind(bz, "blockIdx.z")
        st.bind(bi, "blockIdx.y")
        st.bind(bj, "blockIdx.x")
        st.bind(ti, "threadIdx.y")
        st.bind(tj, "threadIdx.x")
        for cache in (xs, ys):
            cs = s[cache]
            cs.compute_at(st, ko)
            *outer, a0, a1 = cs.op.axis
            o0, i0 = cs.split(a0, factor=ty)
            o1, i1 = cs.split(a1, factor=tx)
            cs.reorder(*outer, o0, o1, i0, i1)
            cs.bind(i0, "threadIdx.y")
            cs.bind(i1, "threadIdx.x")
        return True


__all__ = ["GpuScheduler"]
