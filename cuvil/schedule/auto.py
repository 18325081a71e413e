"""The automatic scheduler: a schedule for any te program, with no tuning.

Strategy, stage by stage (consumers first), using only the public primitives,
so every decision is proved legal by isl and recorded in the trace:

1. Element-wise stages that are not outputs are inlined into their readers,
   unless a reader is a reduction that reads them with reuse (a padded input
   of a convolution): those are computed at the root, once.
2. A *contraction* (a sum of a product of two reads) is recognised from its
   accesses, not its name: an output axis ``j`` that one operand (the
   *vector* operand) reads with unit stride in its last dimension and the
   other (the *broadcast* operand) does not read, and an output axis ``i`` that
   only the broadcast operand reads.  matmul (``A[i, k] * B[k, j]``), a
   transposed or batched one, and conv2d (``W[f, c, ry, rx] * X[n, c, y + ry,
   x + rx]``: i = f, j = x) all match.  It gets a register tile ``MR x NR``
   (NR = two vectors, MR from the register file), accumulated in a local
   buffer over all reduction loops (``cache_write`` + ``compute_at``), rows
   unrolled, columns vectorised, tiles fused and run in parallel; a vector
   operand that is a plain 2-D input of constant shape is packed into
   ``NR``-wide panels (``cache_read`` with a layout), column panels outermost.
   An element-wise consumer (bias, relu) becomes the output stage that the
   tile is computed at.
3. Scatters (``te.scatter``) copy in parallel vector loops and apply their updates in order, each row
   vectorised.  Chains of per-row stages (softmax, layer norm) are computed inside their
   last stage's row loop; other reductions keep vector-lane partial results or
   run a small window outside a vectorised output row; element-wise outputs
   are vectorised along their innermost axis (transposing reads in blocks) and
   run their outermost data loop in parallel: ``cuvil.schedule.auto_plain``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from cuvil.errors import ArgumentError
from cuvil.ir import expr as E
from cuvil.ir.expr import IterVar, TensorRead
from cuvil.ir.functor import walk
from cuvil.schedule.auto_plain import PlainStrategies, _dtype_bytes, _elementwise, _readers
from cuvil.schedule.axes import const_int
from cuvil.schedule.contraction import (
    Contraction,
    _uses,
    contraction_candidates,
    find_contraction,  # noqa: F401  (re-exported: the tests and users look for it here)
)
from cuvil.schedule.fallback import REFUSED, fall_back
from cuvil.schedule.heuristics import Heuristics
from cuvil.schedule.schedule import Schedule, Stage
from cuvil.te.tensor import ComputeOp, PlaceholderOp, ScatterOp, Tensor


def _pos(seq: Sequence[Any], x: Any) -> int:
    return next(k for k, a in enumerate(seq) if a is x)


def _reads_at_own_axes(s: Schedule, reader: Stage, producer: Stage) -> bool:
    """Every read of ``producer`` in ``reader`` is at exactly the reader's own axes (an epilogue)."""
    reads = [n for n in walk(reader.op.body) if isinstance(n, TensorRead) and s.stage_of(n.tensor) is producer]
    axes = reader.op.axis
    return bool(reads) and all(len(r.indices) == len(axes) and all(a is b for a, b in zip(r.indices, axes))
                               for r in reads)


def _untouched(st: Stage) -> bool:
    """``st`` still has its te loops and stores each element at its own axes (no schedule has claimed it:
    a packing copy of a matmul's operand has split loops and panels, and is no epilogue of its producer)."""
    return (not st.relations and not st.kinds and len(st.leaves) == len(st.roots)
            and all(a is b for a, b in zip(st.leaves, st.roots))
            and all(a is b for a, b in zip(st.op.store_indices, st.op.axis)))


def _reduction_loops(c: Contraction) -> int:
    """How many reduction loops of more than one iteration index the contraction's operands."""
    seen = {id(ix): ix for r in (c.vector, c.broadcast) for e in r.indices for ix in walk(e)
            if isinstance(ix, IterVar) and ix.kind == "reduce" and (const_int(ix.extent) or 2) > 1}
    return len(seen)


def _reused_by_reduction(s: Schedule, st: Stage) -> bool:
    for r in _readers(s, st):
        if r.op.reduce_axis:
            for n in walk(r.op.body):
                if isinstance(n, TensorRead) and s.stage_of(n.tensor) is st:
                    if any(_uses(ix, a) for ix in n.indices for a in r.op.reduce_axis):
                        return True
    return False


def pads_a_stencil(producer: ComputeOp, reader_body: Any, taps: int) -> bool:
    """``producer`` is a padded copy (its body selects) that ``reader_body``, an element-wise body, reads
    at ``taps`` or more places (:attr:`Heuristics.stencil_taps`: the taps of a depthwise convolution
    written as a sum of taps).
    Inlined, every tap tests the padding (a branch and a conditional load per tap and vector: 5x5
    depthwise 240@28 at 1 thread, 348 us); computed once, the taps are plain loads."""
    if not any(isinstance(n, E.Select) for n in walk(producer.body)):
        return False
    places = {tuple(str(ix) for ix in n.indices) for n in walk(reader_body)
              if isinstance(n, TensorRead) and n.tensor.op is producer}
    return len(places) >= taps


def _padding_under_taps(s: Schedule, st: Stage, taps: int) -> bool:
    return any(pads_a_stencil(st.op, r.op.body, taps) for r in _readers(s, st) if not r.op.reduce_axis)


class AutoScheduler(PlainStrategies):
    def __init__(self, s: Schedule, outputs: list[Stage], target: Any,
                 knobs: Mapping[str, Mapping[str, Any]] | None = None, heuristics: Heuristics | None = None):
        from cuvil.target import Target

        self.s = s
        self.outputs = outputs
        self.target = Target(target)
        self.knobs = dict(knobs or {})  # stage name -> overrides of this scheduler's choices (see KNOBS)
        self.heuristics = heuristics or Heuristics.for_target(self.target)  # the thresholds it decides by
        self.bits = max(128, self.target.vector_bits)

    def run(self) -> Schedule:
        s = self.s
        # 1. inline element-wise intermediates (not the padded inputs a reduction reuses)
        for st in list(s.compute_stages):
            if any(st is o for o in self.outputs) or not _elementwise(st):
                continue
            if _reused_by_reduction(s, st) or _padding_under_taps(s, st, self.heuristics.stencil_taps):
                continue
            st.compute_inline()
        # 2. contractions (with their epilogues), then 3-4. the other stages, consumers first
        done: set[int] = set()
        for st in reversed(list(s.compute_stages)):
            k = self.knobs.get(st.name, {})
            c = self.choose(st.op, k.get("candidate")) if isinstance(st.op, ComputeOp) and st.op.reduce_axis else None
            if c is not None and st.attach == "root":
                try:
                    with s.deferred_checks(self.outputs):  # legal by construction: isl checks it once
                        done.update(self.contraction(st, c, k))
                except REFUSED as exc:  # undone: the stage gets the plain reduction strategy below
                    # a loss (WARNING) when this scheduler chose the tile; with knobs the autotuner proposed,
                    # a combination isl refuses is part of its search (DEBUG)
                    fall_back(s, st, "register-tiled contraction", exc, "the plain reduction strategy instead",
                              loss=not k)
        rows = self._row_members(done)
        if rows:
            try:
                with s.deferred_checks(self.outputs):  # per-row chains: legal by construction, checked once
                    self._fuse_rows(rows, done)
                done.update(rows)
            except REFUSED as exc:  # undone: each stage gets its own loop nest below (a loss: WARNING)
                names = ", ".join(st.name for st in s.compute_stages if id(st) in rows)
                fall_back(s, names, "per-row chain", exc, "each stage in a loop nest of its own instead")
        for st in reversed(list(s.compute_stages)):
            if st.attach != "root" or id(st) in done:
                continue
            if isinstance(st.op, ScatterOp):
                self.scatter(st)
            elif st.op.reduce_axis:
                self.reduction(st)
            else:
                self.elementwise(st)
        return s

    def registers(self) -> int:
        """The vector registers a register tile may fill: the target's (32 with AVX-512 and on AArch64, 16
        with AVX2 / SSE; an AArch64 tile used to be sized for 16, 8 accumulators, which Neoverse V1's four
        FMA pipes of latency 4 leave half idle: llvm-mca 49% of the FMA bound, 93-95% with 32)."""
        return self.target.vector_registers or 16

    def tall_rows(self) -> int:
        """Rows of a tall tile over panels (two vectors of columns): :attr:`Heuristics.tall_tile_rows`, 14
        where the broadcast operand comes from memory (x86: ``vfmadd231ps (mem){1to16}``), 12 on AArch64,
        where NEON loads each row's value into a register of its own (``ld1r``: 14 rows spilled
        accumulators; see :meth:`Heuristics.for_target`)."""
        return self.heuristics.tall_tile_rows

    def _wants_more_chains(self, c: Contraction, op: Any, mr: int, nv: int, regs: int) -> bool:
        """Whether a tile of ``mr`` x ``nv`` vectors has too few accumulators for the target's FMA pipes
        and should take the most rows the register file holds (beside ``nv`` operand vectors and the
        broadcast).  A tile wants 1.5 x pipes x FMA latency (Target.fma_latency) independent accumulators: on a Zen 4
        running AVX2 code, 8 (= 2 pipes x 4) reach 93% of the FMA rate and 12 all of it (a loop of bare
        FMAs), and whole AVX2 kernels gain 1.11-1.19x with 12 (6 x 2: matmuls 128-512 x 768 x 768-3072, 1x1
        convolutions 1024 -> 256 @14).  Only for a single reduction loop whose columns are the output's
        unit-stride axis: a window's unrolled taps keep their operand vectors live (a 3x3 convolution's 6 x
        2 tile spilled accumulators and lost 2-16%), and rows that are the output's unit-stride axis store
        whole vectors only at 4 or 8 rows.  32 registers hold 8 x 2 = 16 accumulators, enough for two
        pipes (four, Neoverse V1: 95% of the FMA bound in llvm-mca); unchanged there."""
        if regs >= 32 or op is None or _reduction_loops(c) != 1 or c.j is not op.axis[-1]:
            return False
        want = -(-3 * max(1, self.target.fma_units) * self.target.fma_latency // 2)
        return mr * nv < want and (regs - nv - 1) // nv > mr

    def _tile_sizes(self, c: Contraction, dtype: str, op: Any = None) -> tuple[int, int]:
        v = self.lanes(dtype)
        ext_j = const_int(c.j.extent)
        # two vector registers per row, or one when that divides the columns and two do not
        nr = v if ext_j is not None and ext_j % (2 * v) and ext_j % v == 0 else 2 * v
        if c.panel is not None:  # an operand packed in panels: a tile column per panel column
            nr = c.panel
        regs = self.registers()
        ext_i = const_int(c.i.extent)
        # MR x NV accumulators + NV operand vectors + a broadcast fit the register file. On AVX-512, long
        # row ranges with at least four vectors of columns of an operand that needs no transposing copy
        # get 6 x 4 vectors (24 accumulators, 2.4
        # multiply-adds per load, and the other operand is read once per 64 columns instead of 32: the
        # autotuner's best on 1024^3, 1.05-1.12x numpy against 0.90-0.96x for 12 x 2); 8 x 2 otherwise
        # (wider or taller tiles lost on the ResNet convolutions, whose rows are 64-256 filters)
        big = (ext_i is not None and ext_i >= self.heuristics.big_tile_rows and regs >= 32 and c.panel is None
               and c.pack_dim is None and ext_j is not None and ext_j >= 4 * v)
        if big:
            nr = 4 * v
        nv = max(1, -(-nr // v))
        if ext_j is not None and ext_j < nr:
            nr = max(1, ext_j)
        # filters already in panels read by one reduction loop (a 1x1 convolution, a model's dense layer):
        # 14 rows x 2 vectors (28 accumulators, 1.75 multiply-adds per load instead of 1.6; 1x1 1024->256
        # @14x14 at 1 thread 1.20x, 256->64 and 64->256 @56x56 1.06-1.09x); a 3x3 window's three loops
        # keep 8 rows (LLVM unrolls the innermost and holds its three filter pairs: 14 rows spill)
        tall_rows = self.tall_rows()
        tall = (not big and c.panel is not None and regs >= 32 and nv == 2 and _reduction_loops(c) == 1
                and ext_i is not None and any(ext_i % m == 0 for m in range(10, tall_rows + 1)))
        # (only without a tail tile: an MLP layer's 64 rows as 13 + ... + 12 measured no faster than 8 x 8)
        mr = 6 if big else tall_rows if tall else max(1, min(8, (regs - 4) // 2 - 2))
        if not big and not tall and self._wants_more_chains(c, op, mr, nv, regs):
            mr = (regs - nv - 1) // nv
        if ext_i is not None and ext_i < mr:
            mr = max(1, ext_i)
        if ext_i is not None and ext_i % mr:
            # rows per tile: most work per load, counting the rows a tail tile wastes (14 -> 7 x 2, 1024 -> 12)
            def score(m: int) -> tuple[float, float]:
                used = ext_i / (-(-ext_i // m) * m)
                return (round(used * m * nv / (m + nv), 6), used)

            mr = max(range(max(1, mr // 2), mr + 1), key=score)
        return mr, nr

    def _intensity(self, c: Contraction, op: ComputeOp) -> float:
        """Multiply-adds per register access of the tile ``c`` gets, times the share of vector lanes in use.

        Per step of the reduction a tile loads ``mr`` broadcasts and ``nv`` vectors for ``mr * nv`` vector
        multiply-adds; when ``j`` is not the output's last axis its ``mr x nr`` results are stored one
        element at a time at the end, spread over the ``k`` steps (a 1x1 convolution over 64 channels
        with filters in lanes: 6 stores a step)."""
        v = self.lanes(op.dtype)
        mr, nr = self._tile_sizes(c, op.dtype, op)
        nv = -(-nr // v)
        ext_j = const_int(c.j.extent) or nr
        used = ext_j / (-(-ext_j // v) * v)
        k = math.prod(const_int(r.extent) or 1024 for r in op.reduce_axis)
        scattered = 0.0 if c.j is op.axis[-1] else mr * nr / k
        return mr * nv / (mr + nv + scattered) * used

    def candidates(self, op: ComputeOp) -> list[Contraction]:
        """The contraction pairs of ``op`` this scheduler can tile (packing where it must be possible)."""
        return [c for c in contraction_candidates(op)
                if c.pack_dim is None or self._packable(c, self._tile_sizes(c, op.dtype, op)[1], op) is not None]

    def choose(self, op: ComputeOp, pick: int | None = None) -> Contraction | None:
        """The contraction pair of ``op`` to tile: the one with most work per load when it needs no copy
        (an operand already stored in panels: a model's constant filters); otherwise the first unpacked one
        unless packing an operand gives a tile with clearly more work per load, the packing copy's accesses
        counted (:meth:`_copy_share`; conv2d on small images: vectorise over the filters; not a matmul whose
        N is one vector: its rows stay broadcasts of a tile one vector wide);
        ``pick`` (a knob) chooses by position in :meth:`candidates` instead."""
        cands = self.candidates(op)
        if not cands:
            return None
        if pick is not None:
            return cands[pick % len(cands)]
        best = max(cands, key=lambda c: self._intensity(c, op))
        wide = self._wide_rows(op, best, cands)
        if wide is not None:
            return wide
        if best.pack_dim is None or best.panel is not None:
            return best  # no copy to pay for (an operand already in panels: constant filters of a model)
        first = cands[0]
        if first.pack_dim is not None:
            return best
        gain = self.heuristics.pack_gain
        i_first, i_best = self._intensity(first, op), self._intensity(best, op)
        if const_int(first.i.extent) == 1 or i_first * gain >= i_best:  # (one row: every panel is read once)
            return first
        # the copy's accesses counted: the unpacked tile wins unless its rows end in a masked vector (then
        # its accumulators live on the stack, and the copy's rows in lanes pay: 2708 x 768 x 7 on AVX2,
        # 7.3 ms unpacked, 1.3 ms packed)
        _, nr = self._tile_sizes(first, op.dtype, op)
        keeps_registers = not _masked_row(min(nr, const_int(first.j.extent) or nr))
        if keeps_registers and gain * (1 / i_best + self._copy_share(best, op)) >= 1 / i_first:
            return first
        return best

    def _copy_share(self, c: Contraction, op: ComputeOp) -> float:
        """The register accesses the copy that packs ``c``'s vector operand costs per vector multiply-add of
        the contraction (to add to ``1 / _intensity``: accesses per multiply-add of the tile itself).

        The copy transposes (the operand's dimension indexed by ``j`` is not its last, or it would need no
        packing): one load and one store per element, element by element.  Each element serves
        ``work / size`` multiply-adds, ``work / size / lanes`` vector ones, so the share is ``2 * size *
        lanes / work``: small where the packed operand is reused across a long output axis (a convolution's
        filters over its pixels), large where the axis it is reused along is one vector or two (a matmul
        with N = 16 columns: the transposed copy of the 2708 x 1433 rows, 2 accesses per vector multiply-add
        against the 1.1 of a tile of 8 rows x 1 vector that reads those rows as broadcasts, unpacked).  A
        copy's access (a strided load, out of cache for a big operand) costs at least a tile's (an L1 hit):
        counted as equal, packing is still chosen only where it pays."""
        size = math.prod(const_int(d) or 1 for d in c.vector.tensor.shape)
        work = math.prod(const_int(a.extent) or 1 for a in (*op.axis, *op.reduce_axis))
        return 2 * size * self.lanes(op.dtype) / max(1, work)

    def _wide_rows(self, op: ComputeOp, best: Contraction, cands: list[Contraction]) -> Contraction | None:
        """The candidate with filters in panels when the best one puts a window's (several reduction loops)
        output rows of at least :attr:`Heuristics.wide_row` pixels in lanes: each row tile then re-reads its inputs'
        lines across every filter block, and at 1 thread on Zen 4 the NCHW 3x3 convolutions lost a third
        (64 -> 32 at 256x256 33.0 ms, filters in lanes 24.9; 32 -> 32 at 256x256 15.8 / 12.3; at 192x192
        20.5 / 14.1), while at 128 and below both tie (64 -> 64 12.2 / 11.8, 128 -> 64 23.6 / 23.1)."""
        if len(op.reduce_axis) < 2 or best.panel is not None or best.j is not op.axis[-1]:
            return None
        if (const_int(best.j.extent) or 0) < self.heuristics.wide_row:
            return None
        return next((c for c in cands if c.panel is not None), None)

    def contraction(self, st: Stage, c: Contraction, knobs: Mapping[str, Any] | None = None) -> set[int]:
        s = self.s
        k = knobs or {}
        op: ComputeOp = st.op
        mr, nr = self._tile_sizes(c, op.dtype, op)
        mr, nr = int(k.get("mr", mr)), int(k.get("nr", nr))
        ku = int(k.get("ku", _default_ku(op, c, self.heuristics)))
        work = self._work(st)  # multiply-adds, counted before cache_write moves the reduction away
        threads_pay = _threads_pay(work, const_int(c.i.extent), self.heuristics)
        pack = (None if c.panel else self._packable(c, nr, op) if k.get("pack", True) or c.pack_dim is not None
                else None)
        readers = _readers(s, st)
        epilogue = (
            len(readers) == 1 and _elementwise(readers[0]) and readers[0].attach == "root"
            and not any(st is o for o in self.outputs) and _reads_at_own_axes(s, readers[0], st)
            and _untouched(readers[0])  # not a packing copy of another contraction (its loops are set)
        )
        ps = None
        if pack is not None:
            pvec, layout, d = pack
            ps = s[s.cache_read(pvec, "global", [op.output(0)], layout=layout)]
            self._pack_loops(ps, d, nr)
            op = st.op
        if epilogue:
            outer = readers[0]
            cache = st
            axes = dict(zip((id(a) for a in op.axis), outer.op.axis))
            oi, oj = axes[id(c.i)], axes[id(c.j)]
        else:
            cache_t = s.cache_write(st.op.output(0), "local")
            cache = s[cache_t]
            outer = st
            oi, oj = c.i, c.j
            c = Contraction(cache.op.axis[_pos(op.axis, c.i)], cache.op.axis[_pos(op.axis, c.j)],
                            c.vector, c.broadcast, c.pack_dim, c.panel)
        io, jo, ii, ji = outer.tile(oi, oj, mr, nr)
        rest = [a for a in outer.leaves if not any(a is b for b in (io, jo, ii, ji))]
        # a panel stays in cache while the row tiles stream the other operand past it, unless that operand
        # outgrows the last-level cache while all the panels fit in L2 (:meth:`_rows_outgrow_cache`)
        panels_outer = k.get("panels_outer", (pack is not None or c.panel is not None)
                             and not self._rows_outgrow_cache(c, nr))
        order = [jo, *rest, io] if panels_outer else [*rest, io, jo]
        outer.reorder(*order)
        # fuse the outer loops into one parallel loop, except a tile loop with a tail: fused, its tail
        # could not be versioned apart (full tiles then keep constant inner bounds)
        tail = {id(io)} if (const_int(oi.extent) or 1) % mr else set()
        tail |= {id(jo)} if (const_int(oj.extent) or 1) % nr else set()
        plain_before = any(const_int(a.extent) != 1 for a in rest)
        if rest and const_int(io.extent) != 1 and (
                (panels_outer and (c.pack_dim is not None or (const_int(jo.extent) != 1 and plain_before)))
                or (not panels_outer and const_int(jo.extent) != 1 and plain_before)):
            # row tiles stay a loop of their own under outermost column panels: a fused index
            # ``A * floor(f / 32) + B * y + floor(x / 7)`` (a tile index under a plain loop under another
            # tile index) is one isl's AST generator cannot invert: the statements' arguments become pages
            # of nested divisions, and its search takes seconds (96->192 2x2 stride-2 at 56x56: 10 s) to
            # minutes past the operation bound (192->384 at 28x28, ConvNeXt-T's downsample, filters stored
            # in panels by the model). Panels and rows fused without the row tiles, or a tile index
            # innermost with no plain loop before it, take milliseconds; the order of execution is the
            # same, the parallel loop has fewer iterations (168 here).  The same holds with the row tiles
            # before the column tiles (an NCHW convolution: filters in rows, pixels in columns, under the
            # output rows): fused, the tile's local indices became divisions of the fused index, so LLVM
            # kept its accumulators on the stack (3x3 128 -> 128 at 64x64: 35.5 -> 12.7 ms CPU time; the
            # UNet at 256x256 397 -> 303 ms)
            tail.add(id(io))
        loops = [order[0]]
        for a in order[1:]:
            prev = loops[-1]
            if const_int(a.extent) is None or id(a) in tail or id(prev) in tail or const_int(prev.extent) is None:
                loops.append(a)
            else:
                loops[-1] = outer.fuse(prev, a)
        if k.get("parallel", threads_pay):  # below it, waking threads costs more than it saves
            outer.parallel(loops[0])
        if oi is outer.op.axis[-1] and oj is not outer.op.axis[-1] and mr in (4, 8, 16):
            # the tile's rows are the output's contiguous axis (NCHW convolutions with filters in lanes):
            # stored a column at a time, rows as one vector store, the columns unrolled, instead of one
            # extract and one store per element (the 7x7 stride-2 stem of ResNet, 147 reduction steps per
            # 256 stores: 3.45 -> 3.18 ms; 3x3 1.01-1.02x). LLVM still gathers each vector from the tile's
            # stack copy lane by lane: an in-register transpose would save more
            outer.reorder(ji, ii)
            outer.unroll(ji)
            outer.vectorize(ii)
        else:
            outer.vectorize(ji)
        cache.compute_at(outer, loops[-1])
        ci = c.i
        cj = c.j
        others = [a for a in cache.leaves if a is not ci and a is not cj and a.kind == "data"]
        red = [a for a in cache.leaves if a.kind == "reduce"]
        cache.reorder(*(others + red + [ci, cj]))
        _unroll_reduction(cache, red, ku)
        cache.unroll(ci)
        cache.vectorize(cj)
        return {id(outer), id(cache)} | ({id(ps)} if ps is not None else set())

    def _rows_outgrow_cache(self, c: Contraction, nr: int) -> bool:
        """Whether the broadcast operand (the tile rows' side) is larger than the last-level cache while the
        vector operand (all the column panels) fits in L2: with the panels outermost each of the ``n`` panels
        would stream the whole broadcast operand from memory again (SegFormer's fuse, a 1x1 1024 -> 256 over
        128x128 pixels: 8 passes over 64 MiB, 155 ms, 43% of peak at 1 thread); with the row tiles outermost
        it comes from memory once and each row tile reads the panels from L2 (1.7x faster).  An operand that
        fits in L3 keeps the panels outermost (streaming it again from L3 costs little)."""
        def nbytes(t: Any) -> int | None:
            dims = [const_int(d) for d in t.shape]
            return None if any(d is None for d in dims) else math.prod(dims) * _dtype_bytes(t.dtype)

        rows, cols = nbytes(c.broadcast.tensor), nbytes(c.vector.tensor)
        panels = -(-(const_int(c.j.extent) or 0) // max(1, nr))
        return (rows is not None and cols is not None and panels > 1 and rows > self.target.l3_size
                and cols <= self.target.l2_size)

    def _pack_loops(self, ps: Stage, d: int, nr: int) -> None:
        """The packing copy runs panel by panel, each panel's elements in the order they are stored, so
        the writes stay inside one panel row and the reads run along the source's rows::

            for (f < 512) for (c < 512) for (y < 3) for (x < 3)
              P[f // 32, c, y, x, f % 32] = W[f, c, y, x]
          ->
            parallel for (f.o < 16) for (c < 512) for (f.i < 32) for (y < 3) for (x < 3)
              P[f.o, c, y, x, f.i] = W[f.o * 32 + f.i, c, y, x]

        With the packed dimension last (``B[k, j]`` -> ``[j // 32, k, j % 32]``) the inner loop copies 32
        contiguous elements to 32 contiguous elements, vectorised."""
        ax = list(ps.op.axis)
        if nr <= 1 or (const_int(ax[d].extent) or 0) <= nr:
            if const_int(ax[0].extent):
                ps.parallel(ax[0])
            return
        o, i = ps.split(ax[d], factor=nr)
        others = ax[:d] + ax[d + 1:]
        ps.reorder(o, *others[:1], i, *others[1:])
        if d == len(ax) - 1 and nr % self.lanes(ps.op.dtype) == 0:
            ps.vectorize(i)
        ps.parallel(o)

    def _packable(self, c: Contraction, nr: int, op: ComputeOp | None = None) -> tuple[Tensor, Any, int] | None:
        """Pack the vector operand (of constant shape, read at plain axes) into panels of ``nr``
        along j's dimension ``d``: ``B[k, j]`` -> ``[j // nr, k, j % nr]``, ``W[f, c, ry, rx]`` (j = f) ->
        ``[f // nr, c, ry, rx, f % nr]``."""
        t = c.vector.tensor
        src = self.s.stage_of(t)
        if not isinstance(t.op, PlaceholderOp) and (src is None or src.attach != "root"):
            return None  # an input, or a stage computed on its own (a graph's intermediate): not inlined
        shape = [const_int(d) for d in t.shape]
        if any(d is None for d in shape):
            return None
        if c.pack_dim is None and math.prod(shape) < 64 * 1024:
            return None  # optional packing of a small operand costs more than its panels save
        if c.pack_dim is None and const_int(c.i.extent) == 1:
            return None  # one row of tiles reads each panel once: packing would only copy it
        if c.pack_dim is None and op is not None and self._short_tile_rows(op, c, nr):
            return None  # the unpacked panel already sits in L1: packing costs a copy and saves nothing
        idx = c.vector.indices
        if not all(isinstance(ix, IterVar) for ix in idx):
            return None
        d = c.pack_dim if c.pack_dim is not None else len(idx) - 1
        if idx[d] is not c.j or (c.pack_dim is None and len(idx) != 2):
            return None
        return t, (lambda *ax: (ax[d] // nr, *ax[:d], *ax[d + 1:], ax[d] % nr)), d

    def _short_tile_rows(self, op: ComputeOp, c: Contraction, nr: int) -> bool:
        """Whether the lines a tile reads of the unpacked vector operand over the whole reduction (its
        ``nr`` columns in every reduction row) fill at most a third of L1: a 1x1 convolution over 64
        channels (1 thread, 64 x 3136 -> 256: 53 GFLOP/s unpacked, 40 packed), not one over 256 (22
        unpacked, 35 packed)."""
        k = math.prod(const_int(r.extent) or 1 << 20 for r in op.reduce_axis)
        lines = -(-nr * _dtype_bytes(c.vector.tensor.dtype) // 64) * 64
        return k * lines <= self.target.l1_size // 3


def _masked_row(cols: int) -> bool:
    """Whether a vectorised row of ``cols`` elements (a register tile's columns, at most a few registers)
    ends in a masked vector in the code generator (:meth:`cuvil.codegen.llvm_vector.VectorLoops.vector_loop`:
    after the largest power of two of lanes, a rest of 3 or more lanes that is not a power of two is one
    masked vector: 7 = 4 + masked 3, 13 = 8 + masked 5; 5 = 4 + 1 and 6 = 4 + 2 are not).  A register tile
    with such rows keeps its accumulators on the stack (LLVM does not promote memory that masked stores
    write): each multiply-add loads its accumulator right after a masked store to it, which store
    forwarding does not serve (2708 x 768 x 7 with an 8 x 7 tile: 2.2 GFLOP/s, 9.4 with rows in lanes)."""
    rest = cols - (1 << (cols.bit_length() - 1)) if cols > 0 else 0
    return rest >= 3 and bool(rest & (rest - 1))


def auto_schedule(args: Sequence[Any], target: Any = "llvm",
                  knobs: Mapping[str, Mapping[str, Any]] | None = None,
                  heuristics: Heuristics | None = None, prove: bool | None = None) -> Schedule:
    """A schedule for the program whose arguments are ``args`` (computed tensors are outputs).

    ``knobs`` (for the autotuner) overrides choices per stage name; :func:`knob_space` lists them.
    ``heuristics`` are the thresholds the scheduler decides by (None: :meth:`Heuristics.for_target`).
    A combination that is not legal leaves that stage to the plain strategy (isl decides).  Every strategy
    isl refused is in the returned schedule's ``fallbacks`` (:mod:`cuvil.schedule.fallback`).

    ``prove``: whether isl proves the strategies that are legal by construction (each register tile,
    row chain, window, vector and parallel loop this scheduler chooses is one) and the build proves the
    whole schedule again.  Default: only with ``knobs`` (the tuner's combinations may be refused; that is
    part of its search); ``True`` is the debug mode that checks the construction
    (``CompileOptions(check_schedules=True)``).
    """
    if not isinstance(args, (list, tuple)):
        raise ArgumentError("auto_schedule needs the argument list, e.g. [A, B, C]")
    outs = [a for a in args if isinstance(a, Tensor) and not isinstance(a.op, PlaceholderOp)]
    if not outs:
        raise ArgumentError("auto_schedule: none of the arguments is a computed tensor")
    s = Schedule(outs)
    if _is_cuda(target):  # blocks, threads and shared memory: cuvil.schedule.auto_gpu
        from cuvil.schedule.auto_gpu import GpuScheduler

        return GpuScheduler(s, [s[o] for o in outs], target).run()
    s.prove_deferred = bool(knobs) if prove is None else prove
    s = AutoScheduler(s, [s[o] for o in outs], target, knobs, heuristics).run()
    if not s.prove_deferred:
        s.trusted_steps = len(s.trace)
    return s


KNOB_SPACE_VERSION = 3  # bump when a knob is added, removed or changes meaning (2: "ku", 3: ku 8); records are
# filed per version (cuvil.autotune.workload), so a search never mixes points of two spaces

KNOBS = {
    "candidate": "contraction: which (vector operand, column axis) pair to tile (index into the candidates)",
    "mr": "contraction: rows of the register tile (unrolled)",
    "nr": "contraction: columns of the register tile (vectorised; a multiple of the vector width)",
    "pack": "contraction: pack the vector operand into panels of nr columns (cache_read with a layout)",
    "panels_outer": "contraction: column panels outermost (a panel stays in cache while every row tile uses it)",
    "ku": "contraction: reduction steps per iteration of the tile's innermost reduction loop (1: no unrolling)",
    "parallel": "run the outer loop on threads",
    "lanes": "row reduction: keep vector-lane partial results (rfactor)",
}


def knob_space(args: Sequence[Any], target: Any = "llvm",
               heuristics: Heuristics | None = None) -> dict[str, dict[str, list[Any]]]:
    """For each stage the auto-scheduler would tune, the values each knob (:data:`KNOBS`) can take.

    Any combination can be passed to :func:`auto_schedule`; one that isl refuses leaves its stage to
    the plain strategy, so every combination gives a legal schedule."""
    outs = [a for a in args if isinstance(a, Tensor) and not isinstance(a.op, PlaceholderOp)]
    if not outs:
        raise ArgumentError("knob_space: none of the arguments is a computed tensor")
    s = Schedule(outs)
    sch = AutoScheduler(s, [s[o] for o in outs], target, heuristics=heuristics)
    space: dict[str, dict[str, list[Any]]] = {}
    for st in s.compute_stages:
        op = st.op
        if not isinstance(op, ComputeOp) or not op.reduce_axis:
            if isinstance(op, ComputeOp) and not any(st is o for o in sch.outputs):
                continue  # inlined
            space[st.name] = {"parallel": [True, False]}
            continue
        cands = sch.candidates(op)
        if not cands:
            space[st.name] = {"parallel": [True, False], "lanes": [True, False]}
            continue
        v = sch.lanes(op.dtype)
        regs = sch.registers()
        tiles = [(mr, nv * v) for nv in (1, 2, 3, 4) for mr in range(1, 15) if mr * nv + nv + 1 <= regs]
        space[st.name] = {
            "candidate": list(range(len(cands))),
            "mr": sorted({mr for mr, _ in tiles}),
            "nr": sorted({nr for _, nr in tiles}),
            "pack": [True, False],
            "panels_outer": [True, False],
            "ku": list(KU_VALUES),
            "parallel": [True, False],
        }
    return space


def default_knobs(args: Sequence[Any], target: Any = "llvm",
                  heuristics: Heuristics | None = None) -> dict[str, dict[str, Any]]:
    """The value of every knob of :func:`knob_space` that :func:`auto_schedule` picks on its own:
    ``auto_schedule(args, target, knobs=default_knobs(args, target))`` is ``auto_schedule(args, target)``
    (with the same ``heuristics``)."""
    outs = [a for a in args if isinstance(a, Tensor) and not isinstance(a.op, PlaceholderOp)]
    if not outs:
        raise ArgumentError("default_knobs: none of the arguments is a computed tensor")
    space = knob_space(args, target, heuristics)
    s = Schedule(outs)
    sch = AutoScheduler(s, [s[o] for o in outs], target, heuristics=heuristics)
    chosen: dict[str, dict[str, Any]] = {}
    for st in s.compute_stages:
        if st.name not in space:
            continue
        op = st.op
        if "candidate" in space[st.name]:
            cands = sch.candidates(op)
            c = sch.choose(op)
            idx = next(k for k, x in enumerate(cands) if c is not None and x.i is c.i and x.j is c.j
                       and x.vector is c.vector and x.pack_dim == c.pack_dim)
            mr, nr = sch._tile_sizes(c, op.dtype, op)
            packed = c.panel is None and sch._packable(c, nr, op) is not None
            chosen[st.name] = {"candidate": idx, "mr": mr, "nr": nr, "pack": True,
                               "panels_outer": packed or c.panel is not None,
                               "ku": _default_ku(op, c, sch.heuristics),
                               "parallel": _threads_pay(sch._work(st), const_int(c.i.extent), sch.heuristics)}
        else:
            chosen[st.name] = {"parallel": sch._big(st)} | ({"lanes": True} if "lanes" in space[st.name] else {})
    return chosen


def _threads_pay(work: int, rows: int | None, h: Heuristics) -> bool:
    """Whether a contraction of ``work`` multiply-adds over ``rows`` output rows runs its tiles on threads
    (:attr:`Heuristics.parallel_min_work`, :attr:`Heuristics.matvec_min_work`)."""
    return work >= h.parallel_min_work or (rows == 1 and work >= h.matvec_min_work)


def _is_cuda(target: Any) -> bool:
    from cuvil.target import Target

    return Target(target).kind == "cuda"


KU_VALUES = (1, 2, 4, 8)  # the values of the "ku" knob (8 unrolls a window of up to 8 taps whole)


def _default_ku(op: ComputeOp, c: Contraction, h: Heuristics) -> int:
    """Reduction steps per iteration of the tile's innermost reduction loop when no knob says
    (``h.default_ku``, ``h.window_ku``): two for a matmul-like contraction (one reduction axis, no
    operand stored in panels ahead of time: 1 thread, CPU time,
    interleaved: 1024^3 1.05-1.07x, 4096 x 4096 x 1024 1.00-1.08x, 1000^3 0.99-1.10x, 12 x 128 x 128 x 64
    batched 1.01-1.02x), and for one reduction loop of at least 256 steps over an operand in panels (a
    model's dense layer, 1x1 convolutions with their filters packed at compile time: an MLP layer 64 x 1024
    x 1024 1.03-1.09x, 1x1 1024->256@14 with 14-row tiles 1.06x, 256->64@56 1.02x; with 8-row tiles the
    1024->256 one had measured 0.88x once); one step otherwise (3x3 convolutions gained nothing, K = 64
    1.00x).  A window (several reduction loops) whose innermost loop has at most 8 steps gets it unrolled
    whole: LLVM then keeps the tile in registers across the taps and reuses the broadcasts of neighbouring
    taps (ResNet's 7x7 stride-2 stem 1.16x; 3x3 windows, which LLVM unrolls anyway, 0.99-1.00x)."""
    if len(op.reduce_axis) != 1:
        inner = const_int(op.reduce_axis[-1].extent) or 0
        return h.window_ku if 3 < inner <= h.window_ku else 1
    steps = const_int(op.reduce_axis[0].extent) or 0
    return h.default_ku if c.panel is None or steps >= 256 else 1


def _unroll_reduction(cache: Stage, red: list[IterVar], ku: int) -> None:
    """Unroll the innermost reduction loop of a register tile ``ku`` steps at a time: split by ``ku`` when
    that divides its extent, unrolled whole when its extent is at most ``ku`` (a 3-wide filter window with
    ``ku = 4``), left alone otherwise (a tail would put a guard in the hot loop).  The tile's ``mr x nv``
    multiply-adds per step then run twice or four times per loop branch (1024^3 at 1 thread, 6 x 64 tile:
    2 steps 1.06-1.12x one step, CPU time, interleaved)."""
    if ku <= 1 or not red:
        return
    ext = const_int(red[-1].extent)
    if ext is None or ext <= 1:
        return
    if ext <= ku:
        cache.unroll(red[-1])
    elif ext % ku == 0:
        _, inner = cache.split(red[-1], factor=ku)
        cache.unroll(inner)
