"""The automatic scheduler's strategies for stages that are not contractions (see cuvil.schedule.auto).

Scatters: the copy as an element-wise stage, the updates in order with their row vectorised.
Rows: a chain of per-row stages (softmax, layer norm) computed inside its last stage's row loop.
Reductions: vector-lane partial results over one unit-stride axis (rfactor), or a small window's loops
outside the vectorised output row.  Element-wise stages: the innermost axis vectorised (transposing reads
in square blocks of a cache line's rows), the outermost data loop of more than one iteration in parallel.
Every method uses the public primitives only, so isl proves each step; the caller proves a group of steps
at once where they are legal by construction (``Schedule.deferred_checks``).
"""

from __future__ import annotations

import math
from typing import Any

from cuvil.ir import expr as E
from cuvil.ir.expr import IterVar, TensorRead
from cuvil.ir.functor import structural_equal, substitute, walk
from cuvil.ir.simplify import simplify_expr
from cuvil.schedule.axes import const_int
from cuvil.schedule.contraction import _uses, unit_stride_last
from cuvil.schedule.fallback import REFUSED, fall_back
from cuvil.schedule.heuristics import Heuristics
from cuvil.schedule.schedule import Schedule
from cuvil.schedule.stage import Stage
from cuvil.target import SPAN_STRIDE
from cuvil.te.tensor import ComputeOp, ScatterOp


def _dtype_bytes(dtype: str) -> int:
    from cuvil import dtype as dt

    return max(1, dt.bits(dtype) // 8)


def dt_float(dtype: str) -> bool:
    return dtype in ("float16", "float32", "float64")


def _elementwise(st: Stage) -> bool:
    return isinstance(st.op, ComputeOp) and not st.op.reduce_axis


def _outer_loop(st: Stage) -> IterVar | None:
    """The loop to run on threads: the outermost data loop of more than one iteration (a batch of one
    in front does not hide the channels behind it), or None."""
    for a in st.leaves:
        if a.kind != "data":
            return None  # not inside a reduction loop
        ext = const_int(a.extent)
        if ext != 1:
            return a if ext is not None else None
    return None


def _selector_axes(st: Stage, extent: int) -> list[IterVar]:
    """The axes of an element-wise stage (in te order, its loops untouched) whose values choose between
    formulas: every select condition of the body tests only such axes, each of at most ``extent``
    iterations (:attr:`Heuristics.selector_extent`; a Winograd transform's
    ``select(r == 0, d0 - d2, select(r == 1, ...))``).
    Unrolled, each copy's conditions are constants and its select folds to one formula; in a vector
    loop they would be computed for every branch and blended lane by lane."""
    op = st.op
    if list(st.leaves) != list(op.axis):
        return []
    small = {id(a): a for a in op.axis if 1 < (const_int(a.extent) or 0) <= extent}
    found: dict[int, IterVar] = {}
    for n in walk(op.body):
        if isinstance(n, E.Select):
            parts = list(walk(n.cond))
            used = [x for x in parts if isinstance(x, IterVar)]
            if any(isinstance(x, TensorRead) for x in parts) or any(id(x) not in small for x in used):
                return []
            found.update((id(x), x) for x in used)
    return [a for a in op.axis if id(a) in found]


def _shifted_axis(ix: Any) -> IterVar | None:
    """``a`` when the index ``ix`` is the axis ``a``, ``a + c`` or ``a - c`` for a constant ``c``, else None."""
    if isinstance(ix, IterVar):
        return ix
    if isinstance(ix, E.Binary) and ix.op in ("add", "sub") and isinstance(ix.a, IterVar) and isinstance(ix.b, E.Const):
        return ix.a
    return None


def _reads_one_element(st: Stage) -> bool:
    """``st``'s body reads one tensor element (a copy, a padded copy, a cast): inlined into a reader it adds
    no work per read."""
    return sum(isinstance(n, TensorRead) for n in walk(st.op.body)) <= 1


def _readers(s: Schedule, st: Stage) -> list[Stage]:
    return [r for r in s.compute_stages if s.reads(r, st)]


class PlainStrategies:
    """Mixed into :class:`cuvil.schedule.auto.AutoScheduler` (which sets ``s``, ``outputs``, ``target``,
    ``knobs``, ``heuristics`` and ``bits``)."""

    s: Schedule
    outputs: list[Stage]
    knobs: dict[str, Any]
    target: Any
    heuristics: Heuristics
    bits: int

    def lanes(self, dtype: str) -> int:
        from cuvil import dtype as dt

        return max(4, self.bits // max(8, dt.bits(dtype) if dtype != "float16" else 32))

    # -- rows: chains of per-row stages computed inside their consumer's row loop -----------
    def _row_members(self, done: set[int]) -> dict[int, Stage]:
        """Stages to compute inside the row loop of a reader, id(stage) -> that reader.

        A stage qualifies when it is not an output, every reader reads it only at the reader's own first
        axis (``mx[i]`` in ``e[i, j] = exp(X[i, j] - mx[i])``), over the same row extent, and its readers
        are one stage of the plain strategies plus qualifying stages.  softmax, layer norm: one loop over
        rows instead of one loop nest per stage, each row's intermediates used while in L1."""
        s = self.s

        def row_extent(st: Stage) -> int | None:
            ok = isinstance(st.op, ComputeOp) and st.op.axis and st.attach == "root" and id(st) not in done
            return const_int(st.op.axis[0].extent) if ok else None

        def reads_row(reader: Stage, st: Stage) -> bool:
            reads = [n for n in walk(reader.op.body) if isinstance(n, TensorRead) and s.stage_of(n.tensor) is st]
            return bool(reads) and all(r.indices and r.indices[0] is reader.op.axis[0] for r in reads)

        members: dict[int, Stage] = {}
        group_root: dict[int, Stage] = {}  # id(member) -> the non-member stage its chain ends in
        for st in reversed(list(s.compute_stages)):
            ext = row_extent(st)
            if ext is None or ext < 2 or any(st is o for o in self.outputs):
                continue
            readers = [r for r in _readers(s, st) if r.attach != "inline"]
            if not readers or not all(row_extent(r) == ext and reads_row(r, st) for r in readers):
                continue
            roots = {id(group_root.get(id(r), r)): group_root.get(id(r), r) for r in readers}
            if len(roots) != 1:
                continue
            (root,) = roots.values()
            if any(id(r) not in members and r is not root for r in readers):
                continue
            members[id(st)] = root if any(r is root for r in readers) else readers[0]
            group_root[id(st)] = root
        return members

    def _fuse_rows(self, members: dict[int, Stage], done: set[int]) -> None:
        """Schedule each chain's last stage as usual, then its members without threads of their own,
        each computed at the row loop of its reader (consumers first)."""
        s = self.s
        roots = {id(r): r for r in members.values() if id(r) not in members}
        lanes: dict[int, list[Stage]] = {}  # id(stage) -> its lane stages: the outermost reads its inputs now
        for st in reversed(list(s.compute_stages)):
            if id(st) in roots:
                lanes[id(st)] = self._plain(st, parallel=None)
                done.update([id(st), *(id(rf) for rf in lanes[id(st)])])  # lane stages: scheduled by _plain
            elif id(st) in members:
                rfs = lanes[id(st)] = self._plain(st, parallel=False)
                reader = members[id(st)]
                reader = (lanes.get(id(reader)) or [reader])[0]  # (a variance's lanes read the deviations)
                st.compute_at(reader, reader.op.axis[0])
                for rf, user in zip(rfs, [*rfs[1:], st]):  # each lane stage in the row loop of its reader
                    rf.compute_at(user, user.op.axis[0])
                    done.add(id(rf))

    def _plain(self, st: Stage, parallel: bool | None) -> list[Stage]:
        """The reduction or element-wise strategy without its own proof (the caller proves the whole);
        returns the lane stages a vector reduction creates.  ``parallel=None``: decide by work."""
        if st.op.reduce_axis:
            rfs = self._rfactor_lanes(st) if self.knobs.get(st.name, {}).get("lanes", True) else []
            if parallel is not False and (self.knobs.get(st.name, {}).get("parallel", self._big(st))):
                for stage in [*rfs, st]:
                    loop = _outer_loop(stage)
                    if loop is not None:
                        stage.parallel(loop)
            return rfs
        if parallel is False and len(st.op.axis) == 1:
            return []  # one element per row
        self._elementwise(st, strict=True, parallel=parallel)
        return []

    # -- strategies ---------------------------------------------------------------------
    def reduction(self, st: Stage) -> None:
        if self.knobs.get(st.name, {}).get("lanes", True) and self._vector_reduction(st):
            return
        if self._window_reduction(st):
            return
        loop = _outer_loop(st)
        if loop is not None and self.knobs.get(st.name, {}).get("parallel", self._big(st)):
            st.parallel(loop)

    def _window_reduction(self, st: Stage) -> bool:
        """A reduction over a small window (pooling, a depthwise convolution): the window loops run
        outside the innermost output axis, which is vectorised (each window tap updates a row of
        results)::

            for (y) for (x) for (ry < 3) for (rx < 3)        for (y) for (ry < 3) for (rx < 3)
              Y[y, x] = max(Y[y, x], X[2y + ry, 2x + rx])  ->  for (x.o) vector(16) Y[y, x] = max(Y[y, x], X[..])
        """
        op = st.op
        data = [a for a in st.leaves if a.kind == "data"]
        red = [a for a in st.leaves if a.kind == "reduce"]
        if not data or not red or any(a is not b for a, b in zip(st.leaves, data + red)):
            return False
        inner = data[-1]
        ext = const_int(inner.extent)
        window = math.prod(const_int(r.extent) or 1 << 20 for r in red)
        v = self.lanes(op.dtype)
        if ext is None or ext < 4 or window > 64:
            return False
        reads = [n for n in walk(op.body) if isinstance(n, TensorRead) and any(_uses(ix, inner) for ix in n.indices)]
        if not all(unit_stride_last(r, inner, SPAN_STRIDE) for r in reads):
            return False  # a window read further apart: a load per lane costs more than the window saves
        try:
            with self.s.deferred_checks(self.outputs):
                st.reorder(*data[:-1], *red, inner)
                if ext > v:
                    _, inner = st.split(inner, factor=v)
                st.vectorize(inner)
                loop = _outer_loop(st)
                if loop is not None and self.knobs.get(st.name, {}).get("parallel", self._big(st)):
                    st.parallel(loop)
        except REFUSED as exc:  # the window applies (checked above) and isl refused it: a loss (WARNING)
            fall_back(self.s, st, "window reduction (taps outside a vectorised row)", exc,
                      "its loops in te order instead")
            return False
        if loop is not None:
            self._window_inputs_at(st, loop, inline=ext >= 2 * v)
        return True

    def _window_inputs_at(self, st: Stage, loop: IterVar, inline: bool = False) -> None:
        """Compute a padded copy that only ``st`` reads inside ``st``'s outer loop, where each iteration
        reads its own part (a depthwise convolution reads channel ``c`` of the padding for output
        channel ``c``): the copy stays in L1 and the kernel has one parallel loop instead of two::

            parallel for (c) for (y, x) P[c, y, x] = pad(X)        parallel for (c) {
            parallel for (c) for (y) ... P[c, y + ry, x + rx]  ->    for (y, x) P[y, x] = pad(X)[c, ..]
                                                                    for (y) ... P[y + ry, x + rx] }
        A copy whose parts overlap between iterations (the reads of a dense convolution) stays apart.
        ``inline`` (output rows of at least two vectors): the copy is inlined instead, each tap a masked
        load of the input, which is cheaper than a copy of a large image (1 thread: 32@112 0.25 -> 0.20 ms,
        144@56 1.13x) and dearer for small ones (960@7 0.66x), where the local copy stays.  Only a copy is
        inlined (one read per element): a stage that combines ``k`` reads per element would be computed
        again for each of the reader's taps, ``k x taps`` reads instead of ``k + taps`` (a strided max pool's
        column maximum under its row maximum: 3x3 / 2 over 96 x 109 x 109, 420 -> ~270 us)."""
        pos = next((k for k, a in enumerate(st.op.axis) if a is loop), None)
        if pos is None:
            return
        ones = {r: E.const(0, r.dtype) for r in st.op.reduce_axis if const_int(r.extent) == 1}
        for prod in self.s.compute_stages:
            if prod is st or prod.attach != "root" or prod.op.reduce_axis or any(prod is o for o in self.outputs):
                continue
            if not self.s.reads(st, prod) or _readers(self.s, prod) != [st]:
                continue
            reads = [n for n in walk(st.op.body) if isinstance(n, TensorRead) and n.tensor is prod.op.output(0)]
            if not reads or any(
                    len(r.indices) <= pos or not structural_equal(simplify_expr(substitute(r.indices[pos], ones)), loop)
                    for r in reads):
                continue  # each iteration must read its own slice of the copy (no overlap, no recompute)
            shape = [const_int(d) for d in prod.op.output(0).shape]
            if any(d is None for d in shape) or math.prod(shape) // shape[pos] * _dtype_bytes(prod.op.dtype) > \
                    self.target.l2_size // 4:
                continue  # a slice per iteration (a whole image per batch element) too big to stay in cache
            if inline and _reads_one_element(prod):
                try:
                    with self.s.deferred_checks(self.outputs):
                        prod.compute_inline()
                    continue
                except REFUSED as exc:  # the local copy below is the other planned way: an alternative (DEBUG)
                    fall_back(self.s, prod, f"inlining into {st.name}", exc,
                              f"a local copy at {st.name}'s loop {loop.name} instead", loss=False)
            try:
                with self.s.deferred_checks(self.outputs):
                    prod.compute_at(st, loop)
                    inner = prod.leaves[-1]
                    if not _reads_one_element(prod):  # a row of computed elements: vectors of the target's lanes
                        self._vector_row(prod, inner, self.lanes(prod.op.dtype))
                    elif (const_int(inner.extent) or 0) >= 4:
                        prod.vectorize(inner)
            except REFUSED as exc:  # a whole copy outside the loop: a loss (WARNING)
                fall_back(self.s, prod, f"compute_at {st.name}'s loop {loop.name}", exc,
                          "computed whole at the root instead")

    def _vector_reduction(self, st: Stage) -> bool:
        """A row reduction over one unit-stride axis: ``v`` partial results in vector lanes (rfactor; the
        reassociation is explicit in the schedule), then a short serial reduction of the lanes::

            S.rf[i, l] = reduce(r.outer) X[i, r.outer * v + l]      (l vectorised)
            S[i] = reduce(l) S.rf[i, l]
        """
        try:
            with self.s.deferred_checks(self.outputs):
                rfs = self._rfactor_lanes(st)
                if not rfs:
                    return False
                for stage in (*rfs, st):
                    loop = _outer_loop(stage)
                    if loop is not None and self._big(rfs[0]):
                        stage.parallel(loop)
        except REFUSED as exc:  # the lanes apply (a row reduction) and isl refused them: a loss (WARNING)
            fall_back(self.s, st, "vector-lane reduction (rfactor)", exc, "the window or serial strategy instead")
            return False
        return True

    def _rfactor_lanes(self, st: Stage) -> list[Stage]:
        """The lane stages of :meth:`_vector_reduction` (not proved here), outermost first; empty when
        ``st`` is not a row reduction over one unit-stride axis.

        A row of at least 2c vectors whose length is a multiple of c vectors keeps c vectors of partial
        results (c = :attr:`Heuristics.row_chains`, the target's add latency: with 4, one vector add or max
        waits 4 cycles for the previous, four chains overlap), folded into one vector, then into the scalar;
        other rows of at least 4 vectors keep one vector
        (the lanes past the row's end are masked: a 1500-wide softmax row 40 -> 18 ms for 9000 rows)::

            S.rf[i, l] = reduce(r.outer) X[i, r.outer * 4v + l]     (l < 4v, vectorised)
            S.rf_1[i, m] = reduce(l.outer) S.rf[i, l.outer * v + m]  (m < v, vectorised)
            S[i] = reduce(m) S.rf_1[i, m]
        """
        op = st.op
        if not isinstance(op, ComputeOp) or len(op.reduce_axis) != 1 or op.body.where is not None:
            return []
        (r,) = op.reduce_axis
        v = self.lanes(op.dtype)
        ext = const_int(r.extent)
        if ext is None or ext < 4 * v or not dt_float(op.dtype):
            return []
        reads = [n for n in walk(op.body.source) if isinstance(n, TensorRead)]
        if not reads or not all(unit_stride_last(x, r) for x in reads):
            return []
        chains = self.heuristics.row_chains
        chains = chains if ext % (chains * v) == 0 and ext >= 2 * chains * v else 1
        stages = []
        for width in ([chains * v, v] if chains > 1 else [v]):
            (red,) = st.op.reduce_axis
            _, ri = st.split(red, factor=width)
            rf = self.s[self.s.rfactor(st.op.output(0), ri, factor_axis=len(st.op.axis))]
            lane = rf.op.axis[-1]
            (ro,) = rf.op.reduce_axis
            rf.reorder(ro, lane)
            rf.vectorize(lane)
            stages.append(rf)
        return stages

    def elementwise(self, st: Stage) -> None:
        """Split the innermost loop by the vector width and vectorise it, run the outer loop in parallel:
        proved legal once for the whole stage (element-wise stages, packing copies: legal by construction);
        if isl refuses, the steps are retried one by one and the refused ones left out."""
        try:
            with self.s.deferred_checks(self.outputs):
                self._elementwise(st, strict=True)
        except REFUSED as exc:  # nothing lost yet (a step the retry drops is a loss of its own): DEBUG
            fall_back(self.s, st, "vectorised, parallel element-wise loops proved at once", exc,
                      "its steps tried one by one instead", loss=False)
            self._elementwise(st, strict=False)

    def scatter(self, st: Stage) -> None:
        """A scatter (``te.scatter``): the copy's innermost loop vectorised and its outer loop parallel when
        the copy is big; the updates in order on one thread (two may land on one element), their innermost
        loop vectorised when it is the row the updates store along (``out[idx[u], r]``: isl proves the
        iterations of ``r`` touch different elements)::

            for (i0) for (i1) out[i0, i1] = data[i0, i1]      parallel for (i0) for (i1.o) vector for (i1.i) ...
            for (u) for (r) out[idx[u], r] += upd[u, r]   ->  for (u) for (r.o) vector for (r.i) ...
        """
        op: ScatterOp = st.op
        n = len(op.axis)
        v = self.lanes(op.dtype)
        parallel = self.knobs.get(st.name, {}).get("parallel", self._big(st))
        try:
            with self.s.deferred_checks(self.outputs):  # the copy: element-wise, legal by construction
                xi = self._vector_row(st, st.leaves[n - 1], v) if n else None
                loop = st.leaves[0] if n and st.leaves[0] is not xi else None
                if parallel and loop is not None and (const_int(loop.extent) or 2) > 1:
                    st.parallel(loop)
        except REFUSED as exc:
            fall_back(self.s, st, "vectorised, parallel copy", exc, "scalar loops instead")
        r = op.update_axis[-1] if op.update_axis else None
        if r is None or op.indices[-1] is not r:
            return  # the updates store along no row of their own: one element at a time
        try:
            self._vector_row(st, r, v)
        except REFUSED as exc:
            fall_back(self.s, st, f"vectorize({r.name}) of the updates", exc, "scalar updates instead")

    def _vector_row(self, st: Stage, row: IterVar, v: int) -> IterVar | None:
        """Split ``row`` by ``v`` lanes (a short row: one partial vector) and vectorise the inner loop."""
        ext = const_int(row.extent)
        if ext is None or ext < 4:
            return None
        _, xi = st.split(row, factor=v) if ext > v else (None, row)
        st.vectorize(xi)
        return xi

    def _elementwise(self, st: Stage, strict: bool, parallel: bool | None = None) -> None:
        axes = list(st.leaves)
        if not axes:
            return
        inner = axes[-1]
        v = self.lanes(st.op.dtype)
        ext = const_int(inner.extent)
        rows = self._transposed_read(st)
        selectors = _selector_axes(st, self.heuristics.selector_extent)
        if selectors:
            self._unrolled_selectors(st, selectors, v, strict)
        elif rows is not None and ext is not None and ext >= min(v, 16):
            try:
                # (rows shorter than a vector of bytes take a vector of the largest power of two that fits:
                # a 56-pixel uint8 row as 32 + 24 lanes, not 56 gathers of a stride of the channels)
                self._transpose_tiles(st, rows, inner, v if ext >= v else 1 << (ext.bit_length() - 1))
            except REFUSED as exc:
                if strict:
                    raise
                fall_back(self.s, st, "square blocks for a transposing read", exc,
                          "rows in te order, not vectorised, instead")  # a loss (WARNING)
        elif ext is not None and ext >= 4 and (ext >= v or len(axes) > 1):
            xo, xi = st.split(inner, factor=v) if ext > v else (None, inner)  # a short row: one partial vector
            row = self._stencil_axis(st) if xo is not None else None
            if row is not None:
                # the row's vectors outside the taps' axis: one channel block's window rows stay in L1 and its
                # weights in registers (5x5 depthwise 240@28 over a padded copy, 1 thread: 411 -> 127 us)
                keep = list(st.leaves)
                pos = next(k for k, a in enumerate(keep) if a is row)
                try:
                    st.reorder(*keep[:pos], xo, *[a for a in keep[pos:] if a is not xo])
                except REFUSED as exc:
                    if strict:
                        raise
                    fall_back(self.s, st, f"{xo.name} outside the stencil's {row.name}", exc,
                              "the te order instead")  # a loss (WARNING)
            try:
                st.vectorize(xi)
            except REFUSED as exc:
                if strict:
                    raise
                fall_back(self.s, st, f"vectorize({xi.name})", exc, "scalar loops instead")  # a loss (WARNING)
        if parallel is False:
            return
        loop = _outer_loop(st)
        if self.knobs.get(st.name, {}).get("parallel", self._big(st)) and loop is not None:
            try:
                st.parallel(loop)
            except REFUSED as exc:
                if strict:
                    raise
                fall_back(self.s, st, f"parallel({loop.name})", exc, "one thread instead")  # a loss (WARNING)

    def _unrolled_selectors(self, st: Stage, selectors: list[IterVar], v: int, strict: bool) -> None:
        """Selector axes (see :func:`_selector_axes`) unrolled inside the vector loop's outer part, the
        innermost other axis vectorised::

            for (r < 4) for (c < C) for (t < T) vector V[r, c, t] = select(r == 0, X[..] - X[..], ...)
          ->
            for (c < C) for (t.o < T / 16) { V[0, c, t.o*16 + 0:16] = X[..] - X[..]; ... (r = 1, 2, 3) }

        Each unrolled copy is one formula (its select folds away), and the copies share their loads (a
        Winograd transform reads 16 inputs once for 16 outputs)."""
        rest = [a for a in st.leaves if not any(a is x for x in selectors)]
        try:
            order = list(rest)
            xi = None
            if rest:
                inner = rest[-1]
                ext = const_int(inner.extent)
                if ext is not None and ext >= 4:
                    xo, xi = st.split(inner, factor=v) if ext > v else (None, inner)
                    order = rest[:-1] + ([xo] if xo is not None else [])
            st.reorder(*order, *selectors, *([xi] if xi is not None else []))
            for a in selectors:
                st.unroll(a)
            if xi is not None:
                st.vectorize(xi)
        except REFUSED as exc:
            if strict:
                raise
            fall_back(self.s, st, "selector axes unrolled", exc, "the te order instead")  # a loss (WARNING)

    @staticmethod
    def _stencil_axis(st: Stage) -> IterVar | None:
        """The axis just above the innermost one when an element-wise stage reads one tensor at several
        offsets along it (``Y[y, x, c] = sum_k P[y + ky, x + kx, c] * W[ky, kx, c]``: x), else None."""
        op = st.op
        if len(op.axis) < 2:
            return None
        row = op.axis[-2]
        offsets: dict[Any, set[str]] = {}
        for n in walk(op.body):
            if isinstance(n, TensorRead) and len(n.indices) >= 2 and _uses(n.indices[-2], row):
                offsets.setdefault(n.tensor, set()).add(str(n.indices[-2]))
        return row if any(len(o) >= 3 for o in offsets.values()) else None

    def _transposed_read(self, st: Stage) -> IterVar | None:
        """The axis ``a`` of an element-wise stage that a read walks with unit stride (its last index) while
        that read takes the stage's innermost axis ``j`` in another dimension (``B[i, j] = A[j, i]``: a = i);
        None when there is none, or the block would not hold a cache line of the read per row."""
        op = st.op
        if list(st.leaves) != list(op.axis) or len(op.axis) < 2:
            return None
        inner = op.axis[-1]
        bytes_ = max(1, _dtype_bytes(op.dtype))
        for n in walk(op.body):
            if not isinstance(n, TensorRead) or not n.indices:
                continue
            last = _shifted_axis(n.indices[-1])  # (a padded copy reads its source at x - pad)
            if (last is not None and last is not inner and any(last is a for a in op.axis)
                    and any(ix is inner for ix in n.indices[:-1])):
                ext = const_int(last.extent)
                if ext is not None and ext * bytes_ >= 64:
                    return last
        return None

    def _transpose_tiles(self, st: Stage, rows: IterVar, inner: IterVar, v: int) -> None:
        """Square blocks of a cache line's rows for a transposing read, vectorised along the writes::

            for (i < N) for (j.o < N / 16) vector(16) B[i, j] = A[j, i]     // each read a new cache line
          ->
            for (i.o < N / 16) for (j.o < N / 16) for (i.i < 16) vector(16) B[..] = A[..]  // a 16 x 16 block
        """
        t = max(v, 64 // max(1, _dtype_bytes(st.op.dtype)))
        ext = const_int(inner.extent)
        if ext is not None and ext < t:  # a row shorter than a cache line: blocks of one vector
            t = v
        io, ii = st.split(rows, factor=t)
        jo, ji = st.split(inner, factor=t)
        keep = [a for a in st.leaves if not any(a is b for b in (io, ii, jo, ji))]
        st.reorder(*keep, io, jo, ii, ji)
        if t != v:
            _, ji = st.split(ji, factor=v)
        st.vectorize(ji)

    @staticmethod
    def _work(st: Stage) -> int:
        total = 1
        for a in st.roots:
            e = const_int(a.extent)
            total *= e if e is not None else 1024
        return total

    def _big(self, st: Stage) -> bool:
        total = 1
        for a in (st.op.axis if isinstance(st.op, ScatterOp) else st.roots):  # a scatter's threads run its copy
            e = const_int(a.extent)
            total *= e if e is not None else 1024
        return total >= 32 * 1024
