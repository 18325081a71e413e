"""Random inputs for a model: what ``cuvil run --random`` and ``cuvil bench`` feed.

    feeds = random_feeds(graph, {"input_ids": (1, 128), "mask": (1, 128)}, seed=0)

Floats are standard normal; booleans are fair coins; an integer input that indexes a table (a
Gather of a constant table, the input reaching it through casts and reshapes, as token ids reach an
embedding) is uniform over the table's rows (the smallest table when it indexes several); any other
integer input is 0 or 1 (a mask, a token type).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cuvil.graph.ir import Graph

# ops whose output holds the values of their first input, rearranged
_SAME_VALUES = frozenset(["Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Expand", "Transpose"])


def index_rows(graph: Graph) -> dict[str, int]:
    """For each integer graph input that indexes a constant table through a Gather: the number of
    rows it may index (the smallest such table)."""
    consumers: dict[str, list[tuple[Any, int]]] = {}
    for n in graph.nodes:
        for pos, x in enumerate(n.inputs):
            consumers.setdefault(x, []).append((n, pos))
    tables: dict[str, tuple[int, ...]] = {k: v.shape for k, v in graph.initializers.items()}
    for n in graph.nodes:
        if n.op_type == "Constant" and isinstance(n.attrs.get("value"), np.ndarray):
            tables[n.outputs[0]] = n.attrs["value"].shape
    out: dict[str, int] = {}
    for v in graph.feeds:
        if v.dtype is None or np.dtype(v.dtype).kind not in "iu":
            continue
        seen, todo = {v.name}, [v.name]
        while todo:
            for node, pos in consumers.get(todo.pop(), ()):
                if node.op_type in _SAME_VALUES and pos == 0:
                    for o in node.outputs[:1]:
                        if o not in seen:
                            seen.add(o)
                            todo.append(o)
                elif node.op_type == "Gather" and node.domain in ("", "ai.onnx") and pos == 1:
                    shape = tables.get(node.inputs[0])
                    if shape:
                        axis = int(node.attrs.get("axis", 0)) % len(shape)
                        out[v.name] = min(out.get(v.name, shape[axis]), shape[axis])
    return out


def random_feeds(graph: Graph, shapes: Mapping[str, Sequence[int]], seed: int = 0,
                 names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """A random array for each of ``graph``'s feeds (or only ``names``) with the shape in ``shapes``
    (see the module docstring for the values)."""
    rng = np.random.default_rng(seed)
    rows = index_rows(graph)
    out: dict[str, np.ndarray] = {}
    for v in graph.feeds:
        if names is not None and v.name not in names:
            continue
        dtype = np.dtype(v.dtype or "float32")
        shape = tuple(int(d) for d in shapes[v.name])
        if dtype.kind == "f":
            out[v.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            out[v.name] = rng.random(shape) < 0.5
        else:
            out[v.name] = rng.integers(0, max(rows.get(v.name, 2), 1), shape).astype(dtype)
    return out


def describe_random(graph: Graph, name: str) -> str:
    """How :func:`random_feeds` fills input ``name`` (for a line of ``cuvil run --random``)."""
    v = next(x for x in graph.feeds if x.name == name)
    kind = np.dtype(v.dtype or "float32").kind
    if kind == "f":
        return "standard normal"
    if kind == "b":
        return "random booleans"
    rows = index_rows(graph).get(name)
    return f"uniform in 0..{rows - 1} (it indexes a table of {rows} rows)" if rows else "0 or 1"
