"""A small pattern rewriter for graph passes: a pass is a table of patterns, each matching a subgraph at
a root node and returning what replaces it.

    PATTERNS = (
        Pattern("DQ -> Conv [-> Relu] -> Q: an integer convolution", {"Conv"}, contraction),
        Pattern("DQ -> MaxPool -> Q: max of the 8-bit codes", {"MaxPool"}, move),
    )

    def match_qdq(g: Graph) -> Graph:
        return rewrite(g, PATTERNS, Rewrite(g))

:func:`rewrite` visits the nodes once, in execution order.  For each node of the default domain it tries
the patterns listed for its op type, in table order; the first whose ``match(rw, node)`` returns a
:class:`Match` decides, and a node no pattern matches is kept (or given to ``otherwise``).  A match looks at
the root's attributes, at its neighbours through ``rw.uses`` (producers, readers), at constants
(``rw.const``) and static shapes (``rw.static``); it names the other nodes of the subgraph that its
replacement consumes (they are not written, even if their turn comes later), and it may write the
replacement where a later node of the subgraph stands (``at``: after every value that node reads).

``rw`` is the run's :class:`Rewrite` (or a subclass with a pass's own state, as the layout pass keeps
which values are channels-last): what was decided for earlier nodes is there for later matches to read.
The input graph is not changed; patterns add constants to ``rw.inits``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from cuvil.graph.ir import Graph, Node


@dataclass(frozen=True)
class Match:
    """A matched subgraph: ``nodes`` replace its root (none: the root is dropped), ``consumed`` are its other
    nodes (dropped), and ``at``, if given, is the later node of the subgraph where ``nodes`` are written
    (that node is dropped too)."""

    nodes: tuple[Node, ...] = ()
    consumed: tuple[Node, ...] = ()
    at: Node | None = None


@dataclass(frozen=True)
class Pattern:
    """A named rewrite: ``match(rw, root)`` is a :class:`Match` where ``root`` (an op of ``ops``, default
    domain) starts the subgraph it rewrites, else None."""

    name: str
    ops: Iterable[str]
    match: Callable[[Any, Node], Match | None] = field(compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", frozenset(self.ops))


class Rewrite:
    """What one run of a pattern table shares: the graph, its uses, its initializers as the patterns
    leave them, and the value names taken."""

    def __init__(self, g: Graph):
        self.g = g
        self.uses = g.uses()
        self.inits: dict[str, Any] = dict(g.initializers)
        self.taken: set[str] = set(g.initializers) | {o for n in g.nodes for o in n.outputs}
        self._shapes = {v.name: v.shape for v in (*g.inputs, *g.outputs, *g.value_info.values())}

    def const(self, name: str) -> np.ndarray | None:
        """The input graph's constant ``name`` (an initializer), else None."""
        return self.g.initializers.get(name) if name else None

    def scalar(self, name: str) -> bool:
        """``name`` is a constant of one value."""
        c = self.const(name)
        return c is not None and c.size == 1

    def static(self, name: str) -> tuple[int, ...] | None:
        """``name``'s shape where every dimension is known, else None."""
        s = self._shapes.get(name)
        return tuple(s) if s is not None and all(isinstance(d, int) for d in s) else None

    def fresh(self, base: str) -> str:
        """A value name not yet taken: ``base``, else ``base1``, ``base2``, ... (taken from now on)."""
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}{k}", k + 1
        self.taken.add(name)
        return name

    def new_const(self, base: str, value: np.ndarray) -> str:
        """``value`` as a new initializer named ``base`` (or ``base1``, ... if that constant exists)."""
        name, k = base, 1
        while name in self.inits:
            name, k = f"{base}{k}", k + 1
        self.inits[name] = value
        return name


def rewrite(g: Graph, patterns: Sequence[Pattern], rw: Rewrite,
            otherwise: Callable[[Any, Node], Sequence[Node]] | None = None) -> Graph:
    """``g`` with each node replaced as the first matching pattern says (see the module docstring); a node
    no pattern matches is kept, or replaced by ``otherwise(rw, node)``.  ``g`` itself if nothing changed."""
    table: dict[str, list[Pattern]] = {}
    for p in patterns:
        for op in p.ops:
            table.setdefault(op, []).append(p)
    placed: dict[int, tuple[Node, ...]] = {}  # id(a later node) -> what a match writes where it stands
    consumed: set[int] = set()
    out: list[Node] = []
    changed = False
    for n in g.nodes:
        if id(n) in placed:
            out.extend(placed.pop(id(n)))
            continue
        if id(n) in consumed:
            continue
        m = None
        for p in table.get(n.op_type, ()) if not n.domain else ():
            m = p.match(rw, n)
            if m is not None:
                break
        if m is None:
            new = otherwise(rw, n) if otherwise is not None else (n,)
            changed = changed or len(new) != 1 or new[0] is not n
            out.extend(new)
            continue
        changed = True
        consumed.update(id(c) for c in m.consumed)
        if m.at is None:
            out.extend(m.nodes)
        else:
            placed[id(m.at)] = m.nodes
    if not changed and rw.inits.keys() == g.initializers.keys():
        return g
    return replace(g, nodes=out, initializers=rw.inits)

