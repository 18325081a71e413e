"""ONNX ``Loop`` nodes that are embedding bags become one ``CuvilEmbeddingBag`` node; other loops with a
constant trip count are unrolled (a graph pass).

``nn.EmbeddingBag`` with offsets exports as a loop over the bags whose trip count is data (the number of
offsets), not a shape.  Both of torch.onnx.export's exporters write one; per iteration ``k``::

    torchscript: Loop(M = len(offsets), true) with scan output        dynamo: Loop("", true, SequenceEmpty(), 0)
      s = Unsqueeze(Gather(starts_all, k))                                s = Slice(offsets_ext, k, k + 1)
      e = Unsqueeze(Gather(ends_all, k))                                  e = Slice(offsets_ext, k + 1, k + 2)
      rows = Gather(W, Slice(ids, s, e))                                  rows = Slice(Gather(W, ids) * 1, s, e)
      out = ReduceSum(rows, [0], keepdims=0)  (Mean, Max)                 out = If(s == e, zeros, ReduceSum(rows, [0]))
                                                                          seq = SequenceInsert(seq, out); k + 1 < bags
                                                                        ConcatFromSequence(seq, axis=0)
    =>  CuvilEmbeddingBag(W, ids, offsets_ext, bags; mode, start=0, end=1)    (bag b: rows offsets_ext[b + start]
        to offsets_ext[b + end]; TorchScript's ends_all = Slice(starts_all, 1) is seen through to starts_all)

The body is read by a small symbolic evaluator: each value is a constant, the iteration number plus a
constant, an element ``X[k + c]`` of an outer vector, the rows ``X[s:e]`` (gathered from a table or
not), their reduction, or the sequence built so far.  Anything else in the body, a trip count that
is neither given with no exit condition nor a counter compared with a bound, or a sequence read
other than by ``ConcatFromSequence`` along axis 0 is refused with an UnsupportedOpError naming the
node and what cuvil compiles instead, unless the loop can be unrolled (:meth:`_Rewrite.unroll`: a
constant trip count, a condition that stays true, a body without sub-graphs).

Dynamo writes the last bag of a mean or max apart (``If(k == bags - 1)``: its rows run to the end of the
ids, a mean divides by the ids left); that branch is the other bags' reduction when the offsets are
``Concat(offsets, [len(ids)])`` of known lengths (include_last_offset=False).  With include_last_offset
the last offset is not known to be the end of the ids and the loop is refused.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from cuvil.errors import UnsupportedOpError
from cuvil.graph.ir import Graph, Node
from cuvil.graph.loop_body import (
    Bag,
    Counter,
    Elem,
    Exit,
    Known,
    Seq,
    _attrs,
    _Body,
    _NoMatch,
    _stays_true,
)
from cuvil.graph.ops.control import LOOP_PATTERNS

MAX_UNROLLED = 4096  # body nodes, all iterations together, of a Loop with a constant trip count

# -- the pass ---------------------------------------------------------------------------------------


def embedding_bag_loops(g: Graph) -> Graph:
    """Every ``Loop`` of ``g`` that is an embedding bag as one ``CuvilEmbeddingBag`` node (with the
    ``SequenceEmpty`` feeding it and the ``ConcatFromSequence`` reading it), one with a constant trip count
    unrolled; any other ``Loop`` is an UnsupportedOpError naming it."""
    loops = [n for n in g.nodes if n.op_type == "Loop" and not n.domain]
    if not loops:
        return g
    rw = _Rewrite(g)
    for n in loops:
        try:
            rw.loop(n)
        except _NoMatch as exc:
            if not rw.unroll(n):
                raise UnsupportedOpError(f"{n}: {exc}; {LOOP_PATTERNS}") from None
    nodes: list[Node] = []
    for n in g.nodes:
        if id(n) in rw.dropped:
            continue
        nodes.extend(rw.placed.get(id(n), [n]))
    return replace(g, nodes=nodes, initializers=rw.inits)


class _Rewrite:
    def __init__(self, g: Graph):
        self.g = g
        self.inits = dict(g.initializers)
        uses = g.uses()
        self.producer, self.readers, self.outputs = uses.producer, uses.readers, uses.outputs
        self.taken = {v.name for v in g.inputs} | set(self.inits) | set(self.producer)
        self.dropped: set[int] = set()
        self.placed: dict[int, list[Node]] = {}
        self.new: list[Node] = []

    def fresh(self, base: str) -> str:
        k = 0
        while f"{base}_{k}" in self.taken:
            k += 1
        self.taken.add(f"{base}_{k}")
        return f"{base}_{k}"

    def const(self, base: str, v: np.ndarray) -> str:
        name = self.fresh(base)
        self.inits[name] = v
        return name

    def emit(self, op: str, inputs: list[str], outputs: list[str] | None = None, **attrs: Any) -> str:
        outs = outputs or [self.fresh(f"{self.prefix}/{op}")]
        self.new.append(Node(op, self.fresh(f"{self.prefix}/{op}_node"), tuple(inputs), tuple(outs), attrs))
        return outs[0]

    def loop(self, n: Node) -> None:
        self.prefix, self.new = n.name, []
        body = n.attrs.get("body")
        if body is None or not hasattr(body, "g"):
            raise _NoMatch("it has no body graph")
        body = body.g
        trips_in = n.inputs[0] if n.inputs else ""
        cond_in = n.inputs[1] if len(n.inputs) > 1 else ""
        inits = list(n.inputs[2:])
        env: dict[str, Any] = {body.input[0].name: Counter(0, ()), body.input[1].name: Known(np.array(True))}
        seq_sources = []
        for x, v in zip(inits, body.input[2:]):
            src = self.producer.get(x)
            if src is not None and src.op_type == "SequenceEmpty":
                env[v.name] = Seq(None)
                seq_sources.append(src)
            elif x in self.inits and np.issubdtype(self.inits[x].dtype, np.integer) and self.inits[x].size == 1:
                env[v.name] = Counter(int(self.inits[x].reshape(-1)[0]), self.inits[x].shape)
            else:
                raise _NoMatch(f"the loop-carried value {x!r} is neither an empty sequence nor an integer counter")
        outs = _Body(self.g, self.proves).run(body, env)
        nc = len(inits)
        cond_out, carried, scans = outs[0], outs[1:1 + nc], outs[1 + nc:]
        for x, v, o in zip(inits, body.input[2:], carried):
            start = env[v.name]
            want = Seq(o.item if isinstance(o, Seq) else None) if isinstance(start, Seq) else \
                replace(start, offset=start.offset + 1)
            if o != want or (isinstance(o, Seq) and o.item is None):
                raise _NoMatch(f"the loop-carried value {x!r} is not a counter stepped by 1 or a sequence that "
                               "one bag is appended to per iteration")
        if cond_in and not (cond_in in self.inits and bool(np.all(self.inits[cond_in]))):
            raise _NoMatch("its first condition is not the constant true")
        trips = self.trip_count(trips_in, cond_out)
        bags = [o.item for o in carried if isinstance(o, Seq)] + list(scans)
        if not all(isinstance(b, Bag) for b in bags):
            raise _NoMatch("a scan output is not the reduction of a bag of rows")
        for o, x, v in zip(n.outputs[:nc], inits, carried):
            if not o:
                continue
            if isinstance(v, Seq):
                self.concat(o, v.item, self.bag(v.item, trips))
            elif self.readers.get(o) or o in self.outputs:
                if not isinstance(trips, int):
                    raise _NoMatch(f"the final value of the counter {x!r} is read, and the trip count is not a "
                                   "constant")
                self.emit("Add", [x, self.const("trips", np.array(trips, self.inits[x].dtype))], [o])
        for o, b in zip(n.outputs[nc:], scans):
            if o:
                r = self.bag(b, trips)
                if b.keep:
                    self.unsqueeze(r, o)
                else:
                    self.emit("Identity", [r], [o])
        self.placed[id(n)] = self.new
        self.dropped.update(id(s) for s in seq_sources if len(self.readers.get(s.outputs[0], [])) == 1)

    def unroll(self, n: Node) -> bool:
        """Unroll ``n`` if its trip count is a constant (at most :data:`MAX_UNROLLED` body nodes in all), its
        condition stays the constant true and its body has no sub-graphs: each iteration's copy of the body
        reads the iteration number as a constant and the previous copy's carried values; the scan outputs
        are the copies' values stacked."""
        from onnx import numpy_helper

        body = n.attrs.get("body")
        trips_in = n.inputs[0] if n.inputs else ""
        cond_in = n.inputs[1] if len(n.inputs) > 1 else ""
        if body is None or not hasattr(body, "g") or trips_in not in self.inits or self.inits[trips_in].size != 1:
            return False
        body, trips = body.g, int(self.inits[trips_in].reshape(-1)[0])
        if trips < 1 or trips * len(body.node) > MAX_UNROLLED or len(body.input) != len(n.inputs):
            return False
        if cond_in and not (cond_in in self.inits and bool(np.all(self.inits[cond_in]))):
            return False
        if any(a.type in (5, 10) for x in body.node for a in x.attribute):  # GRAPH, GRAPHS
            return False
        if not _stays_true(body.output[0].name, body.input[1].name, body):
            return False
        self.prefix, self.new = n.name, []
        consts = {t.name: self.const(f"{n.name}/{t.name}", numpy_helper.to_array(t)) for t in body.initializer}
        carried = [x for x in n.inputs[2:]]
        nc = len(carried)
        true = self.const(f"{n.name}/true", np.array(True))
        scans: list[list[str]] = [[] for _ in body.output[1 + nc:]]
        for k in range(trips):
            names = dict(consts)
            names[body.input[0].name] = self.const(f"{n.name}/k{k}", np.array(k, np.int64))
            names[body.input[1].name] = true
            names.update((v.name, x) for v, x in zip(body.input[2:], carried))
            for x in body.node:
                outs = [self.fresh(f"{n.name}/{k}/{o}") if o else "" for o in x.output]
                self.new.append(Node(x.op_type, self.fresh(f"{n.name}/{k}/{x.name or x.op_type}"),
                                     tuple(names.get(i, i) if i else "" for i in x.input), tuple(outs),
                                     _attrs(x), "" if x.domain == "ai.onnx" else x.domain))
                names.update((o, f) for o, f in zip(x.output, outs) if o)
            values = [names.get(o.name, o.name) for o in body.output]
            carried = values[1:1 + nc]
            for lst, v in zip(scans, values[1 + nc:]):
                lst.append(self.emit("Unsqueeze", [v, self.const("axes", np.array([0], np.int64))]) if
                           self.g.opset >= 13 else self.emit("Unsqueeze", [v], axes=[0]))
        for o, v in zip(n.outputs[:nc], carried):
            if o:
                self.emit("Identity", [v], [o])
        for o, lst in zip(n.outputs[nc:], scans):
            if o:
                self.emit("Concat", lst, [o], axis=0)
        self.placed[id(n)] = self.new
        return True

    def trip_count(self, given: str, cond_out: Any) -> int | str:
        """The number of iterations: an int, or the name of a scalar computed at run time."""
        known = int(np.asarray(self.inits[given]).reshape(-1)[0]) if given in self.inits else None
        if isinstance(cond_out, Known) and bool(np.all(cond_out.value)):
            if not given:
                raise _NoMatch("it has neither a trip count nor an exit condition")
            return known if known is not None else given
        if isinstance(cond_out, Exit):
            n = max(1, cond_out.bound - cond_out.offset + 1)  # continue while k + offset < bound
            if given and known is None:
                raise _NoMatch("it has both a trip count computed at run time and an exit condition")
            return n if known is None else min(n, known)
        raise _NoMatch("its exit condition is neither the constant true nor 'counter < constant'")

    def base(self, e: Elem) -> tuple[str, int]:
        """``e`` as ``(vector, offset)`` with the vector not a ``Slice`` from a constant start to the end of
        another one (TorchScript's ends are ``Slice(offsets, 1, INT64_MAX)``)."""
        src, off = e.src, e.offset
        while (p := self.producer.get(src)) is not None and p.op_type == "Slice" and not p.domain:
            ins = list(p.inputs) + [""] * (5 - len(p.inputs))
            vals = [self.inits.get(x) if x else None for x in ins[1:5]]
            if self.g.opset < 10 or vals[0] is None or vals[1] is None or vals[0].size != 1:
                break
            c, stop = int(vals[0].reshape(-1)[0]), int(vals[1].reshape(-1)[0])
            if c < 0 or stop < 2**62 or (ins[3] and vals[2] is None) or (ins[3] and vals[2].tolist() not in (
                    [0], [-1])) or (ins[4] and (vals[3] is None or vals[3].tolist() != [1])):
                break
            src, off = ins[0], off + c
        return src, off

    def shape(self, x: str) -> tuple[Any, ...] | None:
        if x in self.inits:
            return self.inits[x].shape
        v = self.g.value_info.get(x) or next((v for v in self.g.inputs if v.name == x), None)
        return None if v is None else v.shape

    def proves(self, e: Elem, k: int, v: int) -> bool:
        """``e`` is ``v`` at iteration ``k``: it reads a Concat of vectors of known lengths there, and the part
        it reads is a constant that holds ``v`` (``Concat(offsets, [len(ids)])``)."""
        src, off = self.base(e)
        p = self.producer.get(src)
        if p is None or p.op_type != "Concat" or p.domain or int(p.attrs.get("axis", 0)) not in (0, -1):
            return False
        at = k + off
        for x in p.inputs:
            shape = self.shape(x)
            if shape is None or len(shape) != 1 or not isinstance(shape[0], int):
                return False
            if at < shape[0]:
                return x in self.inits and int(self.inits[x].reshape(-1)[at]) == v
            at -= shape[0]
        return False

    def rank(self, x: str) -> int | None:
        v = self.g.value_info.get(x) or next((v for v in self.g.inputs if v.name == x), None)
        if v is not None and v.shape is not None:
            return len(v.shape)
        p = self.producer.get(x)
        if p is not None and p.op_type == "Reshape" and p.inputs[1] in self.inits:
            return int(self.inits[p.inputs[1]].size)
        return None

    def ungathered(self, rows: str) -> tuple[str, str]:
        """``(table, ids)`` where ``rows`` is ``Gather(table, ids) * 1`` with 1-D ``ids`` (dynamo's per-sample
        weights of an EmbeddingBag without them): the bag reads the table's rows itself; else ``(rows, "")``."""
        p = self.producer.get(rows)
        if p is None or p.op_type != "Mul" or p.domain:
            return rows, ""
        for gathered, ones in (p.inputs, p.inputs[::-1]):
            w = self.inits.get(ones)
            q = self.producer.get(gathered)
            if w is None or not np.all(w == 1) or q is None or q.op_type != "Gather" or q.domain or \
                    int(q.attrs.get("axis", 0)) != 0 or self.rank(q.inputs[1]) != 1:
                continue
            table = self.inits.get(q.inputs[0])
            if table is None or w.ndim > table.ndim:
                continue
            row = table.shape[1:]  # the product keeps the gathered shape (rows, *row): 1 or row's size
            if all(d in (1, r) for d, r in zip(w.shape[::-1], row[::-1])):
                return q.inputs[0], q.inputs[1]
        return rows, ""

    def bag(self, b: Bag, trips: int | str) -> str:
        rows = b.rows
        data, index = (rows.table, rows.src) if rows.table else self.ungathered(rows.src)
        (starts, first), (ends, last) = self.base(rows.start), self.base(rows.end)
        attrs: dict[str, Any] = {"mode": b.mode, "start": first, "end": last}
        if b.empty is not None:
            attrs["empty"] = b.empty
        bags = self.const("bags", np.array(trips, np.int64)) if isinstance(trips, int) else trips
        return self.emit("CuvilEmbeddingBag", [data, index, starts, bags] + ([] if ends == starts else [ends]),
                         **attrs)

    def unsqueeze(self, x: str, out: str) -> None:
        if self.g.opset >= 13:
            self.emit("Unsqueeze", [x, self.const("bag_axes", np.array([1], np.int64))], [out])
        else:
            self.emit("Unsqueeze", [x], [out], axes=[1])

    def concat(self, seq: str, b: Bag, bag: str) -> None:
        """Each reader of the sequence ``seq`` (``ConcatFromSequence`` along axis 0) reads ``bag``, the bags'
        reductions stacked (``(bags, ...)``)."""
        if seq in self.outputs:
            raise _NoMatch(f"its sequence {seq!r} is a graph output")
        for r in self.readers.get(seq, []):
            axis, new_axis = int(r.attrs.get("axis", 0)), int(r.attrs.get("new_axis", 0))
            if r.op_type != "ConcatFromSequence" or axis != 0 or (new_axis == 0 and not b.keep):
                raise _NoMatch(f"its sequence {seq!r} is read by {r}, not by a ConcatFromSequence that stacks "
                               "the bags along axis 0")
            self.dropped.add(id(r))
            if b.keep and new_axis == 1:
                self.unsqueeze(bag, r.outputs[0])
            else:
                self.emit("Identity", [bag], [r.outputs[0]])
