"""The scheduler's thresholds (cuvil.schedule.heuristics.Heuristics): derived from the target's facts,
changed per compilation (never through a module global), and part of the kernel key."""

from __future__ import annotations

import pytest

import cuvil
from cuvil import te
from cuvil.errors import ArgumentError
from cuvil.options import CompileOptions
from cuvil.schedule.heuristics import Heuristics, heuristics_of
from cuvil.target import Target
from cuvil.te import ops

ZEN4 = "llvm -mtriple=x86_64-unknown-linux-gnu -mcpu=znver4"
AVX2 = "llvm -mcpu=x86-64-v3"
NEOVERSE_N1 = "llvm -mtriple=aarch64-linux-gnu -mcpu=neoverse-n1"


def test_zen4_with_avx512_gets_the_values_measured_there():
    """32 registers, two FMA pipes of 16 lanes: the values the scheduler was tuned with on Zen 4 (they were
    module globals before)."""
    assert Target(ZEN4).vector_registers == 32
    h = Heuristics.for_target(ZEN4)
    assert h == Heuristics(
        parallel_min_work=1 << 20, matvec_min_work=1 << 18, big_tile_rows=512, tall_tile_rows=14, wide_row=192,
        pack_gain=1.25, default_ku=2, window_ku=8, stencil_taps=4, row_chains=4, selector_extent=4, dw_chains=4,
        depthwise_taps=25, small_image_pixels=256, winograd_min_channels=128, winograd_min_tiles=49,
        winograd_max_tiles=1024, flat_words=128, region_rows=8)


def test_avx2_halves_the_parallel_threshold():
    """x86-64-v3: 8 lanes of FMA per pipe (half of AVX-512's work per cycle), 16 registers (6-row tall tiles)."""
    assert Target(AVX2).vector_registers == 16
    h = Heuristics.for_target(AVX2)
    assert h.parallel_min_work == 1 << 19
    assert h.tall_tile_rows == (16 - 4) // 2


def test_neon_tall_tiles_keep_a_register_per_broadcast_row():
    """AArch64 loads each row's value into a register of its own (ld1r): 12 rows of 32 registers, not 14."""
    assert Heuristics.for_target(NEOVERSE_N1).tall_tile_rows == 12


def test_a_gpu_target_keeps_the_cpu_values_for_the_builders():
    assert Heuristics.for_target("cuda") == Heuristics.for_target("llvm")


def test_replace_rejects_unknown_names():
    h = Heuristics.for_target(ZEN4)
    assert h.replace(parallel_min_work=1).parallel_min_work == 1
    assert h.parallel_min_work == 1 << 20  # frozen: replace makes another set
    with pytest.raises(ArgumentError, match="unknown threshold.*parallel_min_works"):
        h.replace(parallel_min_works=1)


def test_heuristics_of_options_heuristics_or_target():
    h = Heuristics.for_target(AVX2).replace(wide_row=64)
    assert heuristics_of(h) is h
    assert heuristics_of(CompileOptions(target=AVX2, heuristics=h)) is h
    assert heuristics_of(CompileOptions(target=AVX2)) == Heuristics.for_target(AVX2)
    assert heuristics_of(Target(NEOVERSE_N1)) == Heuristics.for_target(NEOVERSE_N1)


def _matmul(n: int) -> list:
    A = te.placeholder((n, n), name="A")
    B = te.placeholder((n, n), name="B")
    return [A, B, ops.matmul(A, B)]


def test_a_lower_parallel_threshold_parallelises_a_small_matmul():
    args = _matmul(64)  # 2^18 multiply-adds: under the host's threshold, one thread
    h = Heuristics.for_target("llvm")
    assert 64 ** 3 < h.parallel_min_work
    serial = cuvil.auto_schedule(args, "llvm")
    threaded = cuvil.auto_schedule(args, "llvm", heuristics=h.replace(parallel_min_work=1))
    assert "parallel" not in {st.op for st in serial.trace}
    assert "parallel" in {st.op for st in threaded.trace}
    assert "parallel for" not in str(cuvil.lower(serial, args))
    assert "parallel for" in str(cuvil.lower(threaded, args))


def test_knobs_follow_the_thresholds():
    """default_knobs gives the choices auto_schedule makes with the same thresholds."""
    from cuvil.schedule.auto import default_knobs

    args = _matmul(64)
    h = Heuristics.for_target("llvm")
    assert default_knobs(args, "llvm")["C"]["parallel"] is False
    assert default_knobs(args, "llvm", h.replace(parallel_min_work=1))["C"]["parallel"] is True


def test_the_options_key_changes_with_a_threshold():
    base = CompileOptions()
    assert base.key() == CompileOptions().with_heuristics().key()
    assert base.with_heuristics(parallel_min_work=1).key() != base.key()
    assert base.with_heuristics(winograd_min_tiles=1).key() != base.key()
