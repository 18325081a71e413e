"""What the code for the target under test should look like, from the target's facts.

Tests that assert the shape of generated code (vector widths, register tiles, lane stages) take their
expectations from here rather than writing 16 lanes in: the suite runs on AVX2, AVX-512 and AArch64
hosts, and with ``CUVIL_HOST_TARGET=x86-64-v3`` the host is narrowed to AVX2 code on any newer x86.
A golden text that holds on one ISA only says which ISA it is for (``IS_512`` ...) and checks the
property everywhere else.
"""

from __future__ import annotations

import os

import pytest

import cuvil

HOST = cuvil.Target("llvm")
IS_512 = HOST.vector_bits >= 512


def lanes(dtype_bits: int = 32, target: cuvil.Target = HOST) -> int:
    """Elements of ``dtype_bits`` in one of the target's widest vector registers."""
    return target.vector_lanes(dtype_bits)


def row_lane_widths(extent: int, chains: int = 4, target: cuvil.Target = HOST) -> list[int]:
    """The widths of the lane stages (rfactor) of a float32 row reduction of ``extent`` elements: ``chains``
    vectors of partial results when the row is a multiple of them and at least twice as long (then folded
    into one vector), else one vector; none for a row shorter than ``chains`` vectors."""
    v = lanes(32, target)
    if extent < chains * v:
        return []
    if extent % (chains * v) == 0 and extent >= 2 * chains * v:
        return [chains * v, v]
    return [v]


def lacks(feature: str, target: cuvil.Target = HOST) -> str:
    """Why a test that needs ``feature`` skips: the CPU (or the CPU the host is narrowed to) lacks it."""
    narrowed = f" (the host narrowed to {target.cpu} by CUVIL_HOST_TARGET)" if os.environ.get(
        "CUVIL_HOST_TARGET", "").strip() not in ("", "native") else ""
    return f"needs {feature}: this CPU{narrowed} lacks it"


def needs(feature: str, target: cuvil.Target = HOST) -> pytest.MarkDecorator:
    """Skip unless the host target has ``feature`` (an LLVM feature name: avx512f, avx512vnni, ...)."""
    return pytest.mark.skipif(feature not in target.enabled_features, reason=lacks(feature, target))
