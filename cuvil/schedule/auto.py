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

from collections.abc import Mapping, Sequence
from typing import Any

from cuvil.errors import ArgumentError
from cuvil.ir import expr as E
from cuvil.ir.expr import IterVar, TensorRead
from cuvil.ir.functor import walk
from cuvil.schedule.auto_plain import PlainStrategies, _elementwise, _readers
from cuvil.schedule.auto_tile import RegisterTiles
from cuvil.schedule.axes import const_int
from cuvil.schedule.contraction import (
    Contraction,
    _uses,
    find_contraction,  # noqa: F401  (re-exported: the tests and users look for it here)
)
from cuvil.schedule.fallback import REFUSED, fall_back
from cuvil.schedule.heuristics import Heuristics
from cuvil.schedule.schedule import Schedule
from cuvil.schedule.stage import Stage
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


class AutoScheduler(PlainStrategies, RegisterTiles):
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

    def contraction(self, st: Stage, c: Contraction, knobs: Mapping[str, Any] | None = None) -> set[int]:
        """Register-tile the contraction ``c`` of stage ``st`` (module docstring, step 2); ``knobs`` override
        the tile's choices (:data:`cuvil.schedule.knobs.KNOBS`).  Returns the ids of the stages it scheduled."""
        k = knobs or {}
        op: ComputeOp = st.op
        mr, nr = self._tile_sizes(c, op.dtype, op)
        mr, nr = int(k.get("mr", mr)), int(k.get("nr", nr))
        ku = int(k.get("ku", _default_ku(op, c, self.heuristics)))
        work = self._work(st)  # multiply-adds, counted before cache_write moves the reduction away
        threads_pay = _threads_pay(work, const_int(c.i.extent), self.heuristics)
        pack = (None if c.panel else self._packable(c, nr, op) if k.get("pack", True) or c.pack_dim is not None
                else None)
        epilogue = self._epilogue(st)
        ps = self._pack_operand(st, pack, nr) if pack is not None else None
        outer, cache, oi, oj, c = self._tile_stages(st, c, epilogue)
        # a panel stays in cache while the row tiles stream the other operand past it, unless that operand
        # outgrows the last-level cache while all the panels fit in L2 (:meth:`_rows_outgrow_cache`)
        panels_outer = k.get("panels_outer", (pack is not None or c.panel is not None)
                             and not self._rows_outgrow_cache(c, nr))
        ii, ji, loops = self._tile_loops(outer, c, oi, oj, mr, nr, panels_outer)
        if k.get("parallel", threads_pay):  # below it, waking threads costs more than it saves
            outer.parallel(loops[0])
        self._vectorize_tile(outer, oi, oj, ii, ji, mr)
        cache.compute_at(outer, loops[-1])
        self._tile_body(cache, c, ku)
        return {id(outer), id(cache)} | ({id(ps)} if ps is not None else set())

    def _epilogue(self, st: Stage) -> Stage | None:
        """The element-wise reader of ``st`` that the tile is computed at (bias, relu), or None: ``st``'s
        only reader, at the root, reading it at its own axes, with its te loops (not a packing copy of
        another contraction: its loops are set); an output stage has none."""
        readers = _readers(self.s, st)
        if (len(readers) == 1 and _elementwise(readers[0]) and readers[0].attach == "root"
                and not any(st is o for o in self.outputs) and _reads_at_own_axes(self.s, readers[0], st)
                and _untouched(readers[0])):
            return readers[0]
        return None

    def _pack_operand(self, st: Stage, pack: tuple[Tensor, Any, int], nr: int) -> Stage:
        """The stage that copies the vector operand into panels of ``nr`` columns (:meth:`_packable`)."""
        pvec, layout, d = pack
        ps = self.s[self.s.cache_read(pvec, "global", [st.op.output(0)], layout=layout)]
        self._pack_loops(ps, d, nr)
        return ps

    def _tile_stages(self, st: Stage, c: Contraction,
                     epilogue: Stage | None) -> tuple[Stage, Stage, IterVar, IterVar, Contraction]:
        """The stage whose loops run the tiles (``outer``: the epilogue, or ``st`` itself) and the one that
        accumulates a tile (``cache``: ``st`` under an epilogue, else a local ``cache_write`` of it), the
        outer stage's axes of ``c``'s rows and columns, and ``c`` on the cache's axes."""
        op = st.op
        if epilogue is not None:
            axes = dict(zip((id(a) for a in op.axis), epilogue.op.axis))
            return epilogue, st, axes[id(c.i)], axes[id(c.j)], c
        cache = self.s[self.s.cache_write(st.op.output(0), "local")]
        c2 = Contraction(cache.op.axis[_pos(op.axis, c.i)], cache.op.axis[_pos(op.axis, c.j)],
                         c.vector, c.broadcast, c.pack_dim, c.panel)
        return st, cache, c.i, c.j, c2

    def _tile_loops(self, outer: Stage, c: Contraction, oi: IterVar, oj: IterVar, mr: int, nr: int,
                    panels_outer: bool) -> tuple[IterVar, IterVar, list[IterVar]]:
        """Tile ``outer`` by ``mr x nr``, order the tile loops (column panels outermost or innermost) and fuse
        the outer loops where that is safe; the tile's row and column loops and the outer loops, outermost
        first."""
        io, jo, ii, ji = outer.tile(oi, oj, mr, nr)
        rest = [a for a in outer.leaves if not any(a is b for b in (io, jo, ii, ji))]
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
        return ii, ji, loops

    @staticmethod
    def _vectorize_tile(outer: Stage, oi: IterVar, oj: IterVar, ii: IterVar, ji: IterVar, mr: int) -> None:
        """Vectorise the tile's columns, or its rows where they are the output's contiguous axis."""
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

    @staticmethod
    def _tile_body(cache: Stage, c: Contraction, ku: int) -> None:
        """The accumulating stage's loops inside a tile: reductions outside the tile's rows (unrolled) and
        columns (vectorised), the innermost reduction unrolled ``ku`` steps at a time."""
        ci = c.i
        cj = c.j
        others = [a for a in cache.leaves if a is not ci and a is not cj and a.kind == "data"]
        red = [a for a in cache.leaves if a.kind == "reduce"]
        cache.reorder(*(others + red + [ci, cj]))
        _unroll_reduction(cache, red, ku)
        cache.unroll(ci)
        cache.vectorize(cj)

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
