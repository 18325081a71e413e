"""A static memory plan: intermediate buffers share one arena, reused by lifetime.

A compiled graph runs its kernels in a fixed order, so each intermediate buffer is live from the
call that first writes it to the last call that reads it. Two buffers whose lifetimes do not
overlap may share bytes. :func:`plan_memory` places every buffer at an offset of one arena,
largest first, at the lowest offset where it overlaps no placed buffer that is live at the same
time (greedy best fit, offsets aligned to ``align`` bytes)::

    calls:   k0 writes a          a: 4 KiB, live [0, 1]        arena (8 KiB):
             k1 reads a, writes b  b: 4 KiB, live [1, 2]        a at 0, b at 4096,
             k2 reads b, writes c  c: 4 KiB, live [2, 3]        c at 0 (a is dead by then)
             k3 reads c

The result says the arena's size and the sum of all buffers (what one allocation per buffer
would use), so a caller can report how much the plan saved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Lifetime:
    """Buffer ``key`` of ``nbytes`` bytes, live from call ``first`` to call ``last`` (inclusive)."""

    key: object
    nbytes: int
    first: int
    last: int


@dataclass(frozen=True)
class MemoryPlan:
    offsets: dict[object, int]  # key -> byte offset in the arena
    arena_bytes: int
    total_bytes: int  # the sum of all buffers

    def __str__(self) -> str:
        saved = 1 - self.arena_bytes / self.total_bytes if self.total_bytes else 0.0
        return (f"memory plan: {len(self.offsets)} buffers, arena {self.arena_bytes} bytes, "
                f"sum {self.total_bytes} bytes ({saved:.0%} saved)")


def lifetimes(calls: Sequence[tuple[Sequence[object], Sequence[object]]], sizes: dict[object, int]
              ) -> list[Lifetime]:
    """Lifetimes of the buffers in ``sizes`` from ``calls``: per call, (buffers read, buffers written)."""
    first: dict[object, int] = {}
    last: dict[object, int] = {}
    for t, (reads, writes) in enumerate(calls):
        for k in (*reads, *writes):
            if k in sizes:
                first.setdefault(k, t)
                last[k] = t
    return [Lifetime(k, sizes[k], first[k], last[k]) for k in sizes if k in first]


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def plan_memory(buffers: Sequence[Lifetime], align: int = 64) -> MemoryPlan:
    """Offsets for ``buffers`` in one arena; buffers live at the same time never share a byte."""
    placed: list[tuple[int, int, Lifetime]] = []  # (offset, aligned size, buffer)
    offsets: dict[object, int] = {}
    for b in sorted(buffers, key=lambda b: (-b.nbytes, b.first)):
        size = _align(max(b.nbytes, 1), align)
        busy = sorted((o, o + s) for o, s, other in placed if other.first <= b.last and b.first <= other.last)
        offset = 0
        for lo, hi in busy:  # the lowest gap that holds this buffer
            if offset + size <= lo:
                break
            offset = max(offset, hi)
        placed.append((offset, size, b))
        offsets[b.key] = offset
    arena = max((o + s for o, s, _ in placed), default=0)
    return MemoryPlan(offsets, arena, sum(b.nbytes for b in buffers))


def plan_with_views(calls: Sequence[Sequence[object]], sizes: dict[object, int],
                    views: dict[object, tuple[object, int]], align: int = 64) -> MemoryPlan:
    """:func:`plan_memory` over the buffers that each call of ``calls`` (its buffers) uses, where a buffer of
    ``views`` is bytes of another: ``view -> (base, byte offset)`` (a concatenation's inputs, written in
    place by their producers; a base may itself be a view).  A view has no bytes of its own: its uses count
    toward its base's lifetime, and its offset is its base's plus its own."""
    def root(k: object) -> tuple[object, int]:
        off = 0
        while k in views:
            k, d = views[k]
            off += d
        return k, off

    mapped = [((), tuple(root(k)[0] for k in args)) for args in calls]
    plan = plan_memory(lifetimes(mapped, {k: n for k, n in sizes.items() if k not in views}), align)
    offsets = dict(plan.offsets)
    for v in views:
        base, off = root(v)
        if base in offsets:
            offsets[v] = offsets[base] + off
    return MemoryPlan(offsets, plan.arena_bytes, plan.total_bytes)
