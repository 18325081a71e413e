"""``cuvil info`` (the host target) and ``cuvil demo`` (:mod:`cuvil.bench.demo`)."""

from __future__ import annotations

import argparse

__all__ = ["demo_cmd", "info_cmd"]


def demo_cmd(args: argparse.Namespace) -> int:
    from cuvil.bench.demo import demo

    return demo(args.size)


def info_cmd(args: argparse.Namespace) -> int:
    import cuvil

    t = cuvil.Target("llvm")
    print(f"cuvil {cuvil.__version__}")
    print(f"target: {t.canonical}")
    isa = ("AVX-512" if t.vector_bits >= 512 else "AVX2" if t.vector_bits == 256 else
           "NEON" if t.triple.startswith("aarch64") else "SSE")
    print(f"  {t.arch or t.triple.split('-')[0]} {t.cpu}: {isa}, {t.vector_bits}-bit vectors "
          f"({t.vector_lanes(32)} fp32 lanes), {t.vector_registers} vector registers, {t.fma_units} FMA units "
          f"({t.peak_flops_per_cycle()} fp32 FLOP/cycle/core)")
    print(f"  {t.num_cores} cores; L1d {t.l1_size // 1024} KiB, L2 {t.l2_size // 1024} KiB, "
          f"L3 {t.l3_size // 1024} KiB")
    return 0
