"""The register tile of a contraction: its size, which operand pair it tiles, and whether to pack.

:class:`RegisterTiles` is mixed into :class:`cuvil.schedule.auto.AutoScheduler`, which applies the tile it
chooses (step 2 of that module's strategy).  Every choice here is arithmetic on the target model
(registers, FMA pipes, caches: :class:`cuvil.target.Target`) and the thresholds of
:class:`cuvil.schedule.heuristics.Heuristics`; none applies a primitive.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from cuvil.ir.expr import IterVar
from cuvil.ir.functor import walk
from cuvil.schedule.auto_plain import _dtype_bytes
from cuvil.schedule.axes import const_int
from cuvil.schedule.contraction import Contraction, contraction_candidates
from cuvil.schedule.heuristics import Heuristics
from cuvil.schedule.schedule import Schedule
from cuvil.te.tensor import ComputeOp, PlaceholderOp, Tensor


def _reduction_loops(c: Contraction) -> int:
    """How many reduction loops of more than one iteration index the contraction's operands."""
    seen = {id(ix): ix for r in (c.vector, c.broadcast) for e in r.indices for ix in walk(e)
            if isinstance(ix, IterVar) and ix.kind == "reduce" and (const_int(ix.extent) or 2) > 1}
    return len(seen)


class RegisterTiles:
    """Mixed into :class:`cuvil.schedule.auto.AutoScheduler` (which sets ``s``, ``target`` and
    ``heuristics``; ``lanes`` comes from :class:`cuvil.schedule.auto_plain.PlainStrategies`)."""

    s: Schedule
    target: Any
    heuristics: Heuristics
    lanes: Callable[[str], int]

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
        unpacked, 35 packed).  (Unpacked reads of 128-byte segments up to twice L1 won on the kernels alone
        on a Zen 4 with AVX-512, 256 -> 64 at 56x56 1170 -> 947 us, and lost inside models: HRNet-W18-small
        0.89 -> 1.04 of onnxruntime's time, MobileNetV2 0.99 -> 1.05.)"""
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
