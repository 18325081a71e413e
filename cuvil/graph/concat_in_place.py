"""Concatenations written in place by their producers (no copy).

A Concat whose inputs are whole, consecutive runs of its output (every axis before the joined one has
extent 1: a batch-1 NCHW model joining channels) needs no kernel of its own: each producer can write its
result straight into its run of the output.  The graph compiler notes such calls as it makes them
(:func:`concat_parts`); once the graph's outputs are known, :func:`concats_in_place` drops those it can
and returns each input's slot as bytes of the output's, which the memory plan places
(:func:`cuvil.graph.memplan.plan_with_views`)::

    k3: squeeze -> s          k3: squeeze -> s
    k4: expand1x1(s) -> a     k4: expand1x1(s) -> out[0:64]      (a is out's first 64 channels)
    k5: expand3x3(s) -> b     k5: expand3x3(s) -> out[64:128]    (b the next 64)
    k6: concat(a, b) -> out

An input or output returned to the caller, fed, constant, or already placed in another concatenation keeps
its own buffer, and the concatenation its copy.  A concatenation of concatenations (DenseNet's blocks)
chains: the inner output is itself bytes of the outer one.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cuvil.graph.ops.base import NodeCtx, Runtime

# (call index, output slot, ((input slot, element offset), ...))
Parts = tuple[int, int, tuple[tuple[int, int], ...]]


def concat_parts(ctx: NodeCtx, out: Runtime, call: int) -> list[Parts]:
    """The Concat call ``call`` of ``ctx`` (its output ``out``) as parts of its output, or nothing when its
    inputs are not whole, consecutive runs of the output, or not all computed at run time."""
    entries = [ctx.entries[i] for i in range(ctx.n_inputs) if ctx.has(i)]
    if not entries or not all(isinstance(e, Runtime) for e in entries):
        return []
    axis = int(ctx.attr("axis", 0)) % max(1, len(out.shape))
    slots = [e.slot for e in entries]
    sizes = [math.prod(e.shape) for e in entries]
    if math.prod(out.shape[:axis]) != 1 or len(set(slots)) != len(slots) or 0 in sizes:
        return []
    return [(call, out.slot, tuple((s, sum(sizes[:k])) for k, s in enumerate(slots)))]


def concats_in_place(c: Any, outputs: list[tuple[str, Runtime | np.ndarray]]) -> dict[int, tuple[int, int]]:
    """Drop from the graph compiler ``c`` the noted Concat calls whose inputs their producers can write in
    place (its calls, labels, work and nodes per call); returns ``input slot -> (output slot, byte offset)``.
    SqueezeNet: its 7 fire-module concatenations, ~280 us of a 15.7 ms run at 1 thread."""
    returned = {e.slot for _, e in outputs if isinstance(e, Runtime)}
    views: dict[int, tuple[int, int]] = {}
    drop: set[int] = set()
    for call, out, parts in c.concats:
        if out in returned or c.slots[out].kind != "temp" or any(
                s in returned or s in views or s == out or c.slots[s].kind != "temp" for s, _ in parts):
            continue
        size = np.dtype(c.slots[out].dtype).itemsize
        views.update({s: (out, off * size) for s, off in parts})
        drop.add(call)
    keep = [k for k in range(len(c.calls)) if k not in drop]
    c.calls = [c.calls[k] for k in keep]
    c.labels = [c.labels[k] for k in keep]
    c.call_flops = [c.call_flops[k] for k in keep]
    c.call_nodes = [c.call_nodes[k] for k in keep]
    return views
