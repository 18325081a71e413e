"""The graph IR that model importers produce: values, nodes and constants, with no framework types.

A :class:`Graph` lists its nodes in a valid execution order; every node input names a graph input,
an initializer or an earlier node's output (``""`` is an absent optional input).  Shapes hold ints
for known dimensions and strings for symbolic ones (``"batch"``); ``None`` is unknown.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

Dim = int | str | None


@dataclass(frozen=True)
class ValueInfo:
    """A named tensor: its dtype (cuvil's name, ``None`` if unsupported) and shape (``None`` if unknown)."""

    name: str
    dtype: str | None
    shape: tuple[Dim, ...] | None
    type_str: str = ""  # the framework's spelling, e.g. "tensor(float)"


@dataclass(frozen=True)
class Node:
    """One operator application: ``outputs = op_type(inputs; attrs)``."""

    op_type: str
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    domain: str = ""

    def __str__(self) -> str:
        return f"{self.op_type} node {self.name!r}"


@dataclass(frozen=True)
class Uses:
    """Who writes and who reads each value of a graph (:meth:`Graph.uses`), for passes that look at a
    node's neighbours."""

    producer: dict[str, Node]  # a value -> the node that writes it
    readers: dict[str, list[Node]]  # a value -> the nodes that read it, in order, once per input that reads it
    outputs: frozenset[str]  # the graph outputs' names

    def only_reader(self, name: str) -> Node | None:
        """The one node that reads ``name``, if it has one reader (counted per input) and is not a graph output."""
        r = self.readers.get(name, [])
        return r[0] if len(r) == 1 and name not in self.outputs else None


@dataclass
class Graph:
    """A model: inputs to feed, outputs to return, constant tensors and nodes in execution order."""

    name: str
    inputs: list[ValueInfo]
    outputs: list[ValueInfo]
    initializers: dict[str, np.ndarray]
    nodes: list[Node]
    opset: int
    value_info: dict[str, ValueInfo] = field(default_factory=dict)
    # each symbolic dimension's range of sizes (lowest, highest or None), where the importer knows it
    dims: dict[str, tuple[int, int | None]] = field(default_factory=dict)

    @property
    def feeds(self) -> list[ValueInfo]:
        """The inputs a caller must feed (graph inputs without an initializer)."""
        return [v for v in self.inputs if v.name not in self.initializers]

    def uses(self) -> Uses:
        """Each value's producer and readers (built anew on each call: a pass makes a new graph)."""
        producer = {o: n for n in self.nodes for o in n.outputs if o}
        readers: dict[str, list[Node]] = {}
        for n in self.nodes:
            for x in n.inputs:
                if x:
                    readers.setdefault(x, []).append(n)
        return Uses(producer, readers, frozenset(v.name for v in self.outputs))

    def op_types(self) -> dict[str, list[str]]:
        """Each op type with the names of its nodes."""
        out: dict[str, list[str]] = {}
        for n in self.nodes:
            out.setdefault(n.op_type if not n.domain else f"{n.domain}.{n.op_type}", []).append(n.name)
        return out
