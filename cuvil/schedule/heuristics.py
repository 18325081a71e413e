"""The thresholds the automatic scheduler and the op builders decide by, derived from one target's facts.

    h = Heuristics.for_target("llvm -mcpu=x86-64-v3")
    h.parallel_min_work, h.tall_tile_rows      # 524288, 6 (AVX2: 16 lanes of FMA work per cycle, 16 registers)
    h.replace(winograd_min_tiles=1)           # another frozen set (CompileOptions.with_heuristics does this)

Each field is a function of the target (:class:`cuvil.target.Target`: vector width and registers, FMA
pipes and latency, cache sizes); :meth:`Heuristics.for_target` gives each one's derivation.  Where a value
is a measurement that no fact explains yet, it says so and on which CPU it was measured.  A compilation
carries one set in its :class:`cuvil.options.CompileOptions` (they are part of the kernel-cache key);
nothing reads a module global.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from cuvil.errors import ArgumentError


@dataclass(frozen=True)
class Heuristics:
    """The scheduler's thresholds for one target (see :meth:`for_target` for each derivation)."""

    # contractions (cuvil.schedule.auto)
    parallel_min_work: int  # multiply-adds a contraction needs before its tile loop runs on threads
    matvec_min_work: int  # ... or, with one output row (a matrix-vector product), this many
    big_tile_rows: int  # rows from which a contraction gets the 6 x 4-vector tile (32 registers)
    tall_tile_rows: int  # rows of the tile over panels read by one reduction loop
    wide_row: int  # output rows from which a window's tile takes filters, not pixels, in lanes
    pack_gain: float  # how much more work per load a tile must get before an operand is packed to make it
    default_ku: int  # reduction steps per iteration of a one-axis contraction's innermost loop
    window_ku: int  # ... and the taps of a window's innermost loop unrolled whole (up to this many)
    stencil_taps: int  # a padded stage an element-wise body reads at this many places stays a stage
    # other reductions and element-wise stages (cuvil.schedule.auto_plain)
    row_chains: int  # vectors of partial results a long row reduction keeps (independent chains)
    selector_extent: int  # axes up to this extent whose values pick a formula are unrolled
    # op builders (cuvil.graph.ops)
    dw_chains: int  # independent multiply-add chains a depthwise window's taps are summed in
    depthwise_taps: int  # depthwise windows up to this many taps are written out tap by tap
    small_image_pixels: int  # 1x1 convolutions over fewer pixels put constant filters in panels
    winograd_min_channels: int  # input and output channels from which Winograd F(2x2, 3x3) pays
    winograd_min_tiles: int  # output 2x2 tiles from which it pays ...
    winograd_max_tiles: int  # ... and up to which
    flat_words: int  # int8 1x1 convolutions over fewer input words may run over the flattened image
    region_rows: int  # outputs per axis at least, of a window's region computed with fewer taps (past the image)

    @staticmethod
    def for_target(target: Any = "llvm") -> Heuristics:
        """The thresholds for ``target`` (a target string or :class:`cuvil.target.Target`)."""
        from cuvil.target import Target

        return _derive(Target(target))

    def replace(self, **changes: Any) -> Heuristics:
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ArgumentError(f"unknown threshold(s): {', '.join(sorted(unknown))}; the thresholds: "
                                + ", ".join(f.name for f in dataclasses.fields(self)))
        return dataclasses.replace(self, **changes)

    def key(self) -> tuple:
        """The values in field order: part of a kernel-cache key."""
        return dataclasses.astuple(self)

    def __str__(self) -> str:
        return "Heuristics(" + ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)) + ")"


@functools.lru_cache(maxsize=64)
def _derive(t: Any) -> Heuristics:
    """:meth:`Heuristics.for_target`'s derivations, once per target."""
    from cuvil.target import Target

    if t.kind != "llvm":  # the GPU scheduler reads none of them; the CPU values keep the builders' choices
        t = Target("llvm")
    regs = t.vector_registers or 16
    macs_per_cycle = max(1, t.peak_flops_per_cycle(32) // 2)  # fp32 lanes x FMA pipes
    aarch64 = t.triple.startswith("aarch64")
    if aarch64:
        # NEON loads each row's value into a register of its own (ld1r) and keeps about half of them in
        # flight: 2 r + 2 + r / 2 <= registers -> 12 of 32 (llvm-mca, neoverse-n1, a 1x1 conv 1024 -> 256:
        # 14 rows 85.9% of the FMA bound, 12 rows 90.1%)
        tall = max(r for r in range(1, regs) if 2 * r + 2 + r // 2 <= regs)
    else:
        # x86 broadcasts from memory (vfmadd231ps (mem){1to16}): 2 r accumulators + 2 operand vectors and
        # two registers to spare -> 14 of 32 (Zen 4: 1x1 1024 -> 256 @14 1.20x over 8 rows)
        tall = (regs - 2 - 2) // 2
    return Heuristics(
        # a parallel region costs about a microsecond to start and join (spinning teams); its work must be
        # ~2^15 cycles of the core's peak (8 us at 4 GHz) to gain at 2 threads: 2^20 multiply-adds on
        # AVX-512 (Zen 4: 127 x 255 x 63 at 2 threads 41 -> 32 us; 4x that kept it serial), 2^19 on AVX2
        parallel_min_work=(1 << 15) * macs_per_cycle,
        # a matrix-vector product streams its whole matrix once (4 bytes per multiply-add); threads pay once
        # it no longer fits one core's L2, where a second core adds bandwidth: L2 / 4 (1 MiB: 2^18)
        matvec_min_work=max(1, t.l2_size // 4),
        # measured, not derived: on Zen 4 (32 registers) the 6 x 4-vector tile won from 1024 rows (the
        # autotuner's best on 1024^3) and lost on ResNet's 64-256 filters; it needs 32 registers
        big_tile_rows=512,
        tall_tile_rows=tall,
        # a window's row tile with pixels in lanes re-reads its input lines for every filter block; the lines
        # of one channel stay in L1 up to about 192 pixels with 32 KiB (Zen 4: 64 -> 32 at 256x256 33.0 ms
        # against 24.9 with filters in lanes; at 128 and below both tie): scaled with the L1 data cache
        wide_row=max(64, t.l1_size * 6 // 1024),
        # a packing copy reads and writes its operand once; it pays when the tile's multiply-adds per load
        # grow by a quarter (a ratio of the same machine's costs: the same on every target)
        pack_gain=1.25,
        # unrolling: two reduction steps per loop branch (1024^3 1.05-1.12x), a window's innermost taps whole
        # (up to 8: ResNet's 7x7 stem 1.16x); instruction counts, not machine facts
        default_ku=2,
        window_ku=8,
        # a padded stage read at 4+ places (a depthwise window's taps): inlined, every tap would test the
        # padding (a branch and a masked load per tap and vector); structural, the same on every target
        stencil_taps=4,
        # independent vector partial sums: one per cycle of FMA / add latency keeps a pipe busy
        row_chains=t.fma_latency,
        # a Winograd transform's selects over an axis of 4 values unroll to 4 copies (code size)
        selector_extent=4,
        dw_chains=t.fma_latency,  # the same latency bound for a depthwise window's taps (5x5: 308 -> 187 us)
        # windows up to 5x5 written out tap by tap (code size; 7x7 stays a reduction)
        depthwise_taps=25,
        # measured on Zen 4 with AVX-512 only: constant filters on images under 256 pixels (7x7, 14x14) go
        # in panels, filters in lanes (MobileNetV2's 960 -> 320 at 7x7 2.9x faster)
        small_image_pixels=256,
        # Winograd's transforms move 2 / C_out + 2 / C_in bytes per saved multiply-add: under 128 channels
        # they outweigh the 2.25x saving (measured on Zen 4); tile counts: 7x7 tiles (ResNet's 256 @ 14x14)
        # and up gained, 5x5 lost 8x (YOLOv8n), above 1024 tiles the transformed input leaves L2
        winograd_min_channels=128,
        winograd_min_tiles=49,
        winograd_max_tiles=max(64, t.l2_size // 1024),
        # int8 1x1 convolutions over fewer than 128 input words (512 channels) whose rows are 1-2 vectors:
        # measured on Zen 4 with VNNI (128 -> 512 @ 28x28 3.7 -> 0.37 ms flattened)
        flat_words=128,
        # a convolution whose taps fall wholly in the padding for a stretch of outputs (a dilated window
        # wider than the image: DeepLab's ASPP at rates 6-18 on a 33x33 map) is computed region by region,
        # each with the taps that reach the image; a region's tile rows are its output columns (the filters
        # in the lanes), and a region narrower than one accumulator per multiply-add in flight (FMA pipes x
        # latency: 8 on Zen 4) leaves the pipes idle in its tail tile whatever the vectors: on AVX2 (4-row
        # tiles) the rate-6 columns cut at 6 ran 15% slower than the whole window, with 23% fewer taps
        region_rows=max(1, max(1, t.fma_units) * t.fma_latency),
    )


def heuristics_of(options_or_target: Any = None) -> Heuristics:
    """The thresholds of a :class:`cuvil.options.CompileOptions`, a :class:`Heuristics` itself, or a target's
    (None: the host's)."""
    if isinstance(options_or_target, Heuristics):
        return options_or_target
    h = getattr(options_or_target, "heuristics", None)
    if h is not None:
        return h
    target = getattr(options_or_target, "target", options_or_target)
    return Heuristics.for_target(target if target is not None else "llvm")
