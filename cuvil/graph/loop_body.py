"""The symbolic reading of an ONNX ``Loop`` body (for :mod:`cuvil.graph.loops`): each value of the body
as a constant, the iteration number plus a constant, an element of an outer vector, rows of a table, their
reduction, or the sequence built so far (:class:`_Body`); anything else is :class:`_NoMatch`, with why."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from cuvil.graph.ir import Graph
from cuvil.graph.ops.shape import constant_value

# -- the symbolic values of a loop body --------------------------------------------------------------


@dataclass(frozen=True)
class Known:
    value: np.ndarray
    name: str = ""  # an initializer of the outer graph: its name


def _outer(v: Any) -> str | None:
    """The name of the outer graph's tensor ``v`` (computed at run time, or an initializer), else None."""
    return v if isinstance(v, str) else v.name if isinstance(v, Known) and v.name else None


@dataclass(frozen=True)
class Counter:
    """``k + offset`` (``k`` the iteration number), of shape ``()`` or ``(1,)``."""

    offset: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Elem:
    """``src[k + offset]`` of the outer vector ``src``, of shape ``()`` or ``(1,)``."""

    src: str
    offset: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Rows:
    """``src[start:end]`` along axis 0, gathered from ``table`` (``table[src[start:end]]``) when given."""

    src: str
    start: Elem
    end: Elem | int  # an int: a constant end (only inside dynamo's branch for the last bag)
    table: str = ""


@dataclass(frozen=True)
class Bag:
    mode: str
    rows: Rows
    keep: bool
    empty: float | None = None  # the value of an empty bag, where the body says (If(s == e, ...))


@dataclass(frozen=True)
class EmptyTest:
    start: Elem
    end: Elem


@dataclass(frozen=True)
class Exit:
    """The exit condition ``k + offset < bound``."""

    offset: int
    bound: int


@dataclass(frozen=True)
class At:
    """The condition ``k == bag`` (dynamo writes the last bag apart)."""

    bag: int


@dataclass(frozen=True)
class Span:
    """``stop - start``: the rows from a bag's start to the constant ``stop`` (dynamo's last mean)."""

    start: Elem
    stop: int


@dataclass(frozen=True)
class Positive:
    span: Span


@dataclass(frozen=True)
class Ratio:
    """``bag / span`` (a sum over a span), or the sum where the span is not positive."""

    bag: Bag
    span: Span


@dataclass(frozen=True)
class Seq:
    """The sequence a loop carries: empty (``item`` None) or one ``item`` appended per iteration."""

    item: Bag | None


class _NoMatch(Exception):
    pass


_REDUCE = {"ReduceSum": "sum", "ReduceMean": "mean", "ReduceMax": "max"}


def _attrs(n: Any) -> dict[str, Any]:
    import onnx
    from onnx import numpy_helper

    out: dict[str, Any] = {}
    for a in n.attribute:
        if a.type == onnx.AttributeProto.TENSOR:
            out[a.name] = numpy_helper.to_array(a.t)
        elif a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
            out[a.name] = a
        else:
            v = onnx.helper.get_attribute_value(a)
            out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


class _Body:
    """Symbolic evaluation of a loop body (and the If branches inside it)."""

    def __init__(self, outer: Graph, proves: Any):
        self.outer = outer
        self.proves = proves  # proves(e, k, v): the Elem e is the constant v at iteration k

    def value(self, env: dict[str, Any], name: str) -> Any:
        if name in env:
            return env[name]
        if name in self.outer.initializers:
            return Known(np.asarray(self.outer.initializers[name]), name)
        return name  # an outer value computed at run time

    def run(self, g: Any, env: dict[str, Any]) -> list[Any]:
        from onnx import numpy_helper

        env = dict(env)
        for t in g.initializer:
            env[t.name] = Known(numpy_helper.to_array(t))
        for n in g.node:
            ins = [self.value(env, x) if x else None for x in n.input]
            outs = self.node(n, ins, _attrs(n), env)
            if len(outs) != len(n.output):
                raise _NoMatch(f"{n.op_type} node {n.name!r} in the body")
            env.update(zip(n.output, outs))
        return [self.value(env, o.name) for o in g.output]

    def node(self, n: Any, ins: list[Any], a: dict[str, Any], env: dict[str, Any]) -> list[Any]:
        op = n.op_type
        what = f"{op} node {n.name!r} in the body"
        x = ins[0] if ins else None
        if op == "Constant" and constant_value(a) is not None:
            return [Known(constant_value(a))]
        if ins and all(isinstance(v, Known) for v in ins if v is not None):
            folded = _fold(op, [v.value for v in ins if v is not None], a)
            if folded is not None:
                return [Known(np.asarray(folded))]
        if op == "Identity":
            return [x]
        if op in ("Cast", "CastLike") and isinstance(x, (Counter, Elem)):
            to = a.get("to") if op == "Cast" else None
            if to is not None and to not in (6, 7):  # int32, int64
                raise _NoMatch(what)
            return [x]
        if op == "CastLike" and isinstance(x, Known) and np.issubdtype(x.value.dtype, np.integer):
            return [x]
        if op == "Cast" and isinstance(x, Span) and a.get("to") in (1, 11):  # float, double
            return [x]
        if op == "Equal" and {type(x), type(ins[1])} == {Counter, Known}:
            c, k = (x, ins[1]) if isinstance(x, Counter) else (ins[1], x)
            if k.value.size == 1:
                return [At(int(k.value.reshape(-1)[0]) - c.offset)]
        if op == "Sub" and isinstance(x, Known) and x.value.size == 1 and isinstance(ins[1], Elem):
            return [Span(ins[1], int(x.value.reshape(-1)[0]))]
        if op == "Greater" and isinstance(x, Span) and isinstance(ins[1], Known) and np.all(ins[1].value == 0):
            return [Positive(x)]
        if op == "Div" and isinstance(x, Bag) and x.mode == "sum" and isinstance(ins[1], Span):
            return [Ratio(x, ins[1])]
        if op == "If" and isinstance(x, (At, Positive)):
            then = self.run(a["then_branch"].g, env)
            other = self.run(a["else_branch"].g, env)
            if len(then) != 1 or len(other) != 1:
                raise _NoMatch(what)
            return [self.if_at(x, then[0], other[0], what) if isinstance(x, At) else
                    self.if_positive(x, then[0], other[0], what)]
        if op in ("Reshape", "Unsqueeze", "Squeeze") and isinstance(x, (Counter, Elem)):
            if op == "Reshape":
                shape = [int(v) for v in _known(ins[1], what).reshape(-1)]
                if any(v not in (1, -1) for v in shape) or len(shape) > 1:
                    raise _NoMatch(what)
                new: tuple[int, ...] = (1,) * len(shape)
            else:
                new = (1,) if op == "Unsqueeze" else ()
            return [replace(x, shape=new)]
        if op in ("Add", "Sub") and isinstance(x, Counter) and isinstance(ins[1], Known) and ins[1].value.size == 1:
            c = int(ins[1].value.reshape(-1)[0])
            return [replace(x, offset=x.offset + (c if op == "Add" else -c))]
        if op == "Add" and isinstance(ins[1], Counter) and isinstance(x, Known) and x.value.size == 1:
            return [replace(ins[1], offset=ins[1].offset + int(x.value.reshape(-1)[0]))]
        if op == "Gather" and int(a.get("axis", 0)) == 0 and _outer(x):
            i = ins[1]
            if isinstance(i, Counter):
                return [Elem(_outer(x), i.offset, i.shape)]
            if isinstance(i, Rows) and not i.table:
                return [replace(i, table=_outer(x))]
        if op == "Slice" and _outer(x):
            return [self.slice(ins, a, what)]
        if op in _REDUCE and isinstance(x, Rows):
            axes = ([int(v) for v in _known(ins[1], what).reshape(-1)] if len(ins) > 1 and ins[1] is not None
                    else [int(v) for v in a.get("axes", [])])
            if axes != [0]:
                raise _NoMatch(f"{what}: it reduces axes {axes}, not the rows (axis 0)")
            return [Bag(_REDUCE[op], x, bool(int(a.get("keepdims", 1))))]
        if op == "Equal" and isinstance(x, Elem) and isinstance(ins[1], Elem):
            return [EmptyTest(x, ins[1])]
        if op == "Less" and isinstance(x, Counter) and isinstance(ins[1], Known) and ins[1].value.size == 1:
            return [Exit(x.offset, int(ins[1].value.reshape(-1)[0]))]
        if op == "If" and isinstance(x, EmptyTest):
            return [self.if_empty(x, a, env, what)]
        if op == "SequenceInsert" and len(ins) == 2 and isinstance(x, Seq) and x.item is None and \
                isinstance(ins[1], Bag):
            return [Seq(ins[1])]
        raise _NoMatch(what)

    def slice(self, ins: list[Any], a: dict[str, Any], what: str) -> Any:
        x, s, e = _outer(ins[0]), ins[1], ins[2]
        for k in (3, 4):  # axes [0], steps [1]
            if len(ins) > k and ins[k] is not None and [int(v) for v in _known(ins[k], what).reshape(-1)] != [k - 3]:
                raise _NoMatch(f"{what}: a slice along an axis other than 0 or with a step")
        if isinstance(s, Counter) and isinstance(e, Counter) and s.shape == e.shape == (1,) and \
                e.offset == s.offset + 1:
            return Elem(x, s.offset, (1,))
        if isinstance(s, Elem) and s.shape == (1,) and (isinstance(e, Elem) and e.shape == (1,)):
            return Rows(x, s, e)
        if isinstance(s, Elem) and s.shape == (1,) and isinstance(e, Known) and e.value.size == 1:
            return Rows(x, s, int(e.value.reshape(-1)[0]))
        raise _NoMatch(what)

    def if_at(self, c: At, then: Any, other: Any, what: str) -> Any:
        """``k == bag ? then : other`` where ``then`` is ``other`` with its end the constant the bag's end
        is known to be (dynamo's last bag runs to the end of the ids: the end of the offsets extended by it)."""
        if isinstance(then, Ratio) and isinstance(other, Bag) and other.mode == "mean" and \
                then.bag.rows == other.rows and then.span.start == other.rows.start:
            rows, stop = other.rows, then.span.stop  # sum / (stop - start) there: the mean if end == stop
        elif isinstance(then, Rows) and isinstance(other, Rows) and isinstance(then.end, int) and \
                replace(then, end=other.end) == other:
            rows, stop = other, then.end
        else:
            raise _NoMatch(f"{what}: bag {c.bag} is not the others' reduction with its end a constant")
        if not isinstance(rows.end, Elem) or not self.proves(rows.end, c.bag, stop):
            raise _NoMatch(f"{what}: bag {c.bag} runs to {stop}, which is not known to be its end offset (the "
                           "last offset of an EmbeddingBag with include_last_offset: not recognised)")
        return other

    def if_positive(self, c: Positive, then: Any, other: Any, what: str) -> Any:
        if isinstance(then, Ratio) and then.span == c.span and other == then.bag:
            return then
        raise _NoMatch(what)

    def if_empty(self, t: EmptyTest, a: dict[str, Any], env: dict[str, Any], what: str) -> Bag:
        then = self.run(a["then_branch"].g, env)
        other = self.run(a["else_branch"].g, env)
        if len(then) != 1 or len(other) != 1 or not isinstance(then[0], Known) or not isinstance(other[0], Bag):
            raise _NoMatch(f"{what}: not 'a constant if the bag is empty, else its reduction'")
        v, bag = then[0].value, other[0]
        if not isinstance(bag, Bag) or bag.rows.start != t.start or bag.rows.end != t.end or v.size == 0 or \
                not np.all(v == v.reshape(-1)[0]):
            raise _NoMatch(f"{what}: not 'a constant if the bag is empty, else its reduction'")
        return replace(bag, empty=float(v.reshape(-1)[0]))


def _fold(op: str, vs: list[np.ndarray], a: dict[str, Any]) -> np.ndarray | None:
    """A body node over constants, computed with numpy (the few ops the exporters write there)."""
    if op == "Identity":
        return vs[0]
    if op == "Cast":
        from onnx.helper import tensor_dtype_to_np_dtype

        return vs[0].astype(tensor_dtype_to_np_dtype(int(a["to"])))
    if op == "CastLike":
        return vs[0].astype(vs[1].dtype)
    if op == "Not":
        return np.logical_not(vs[0])
    fs = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Equal": np.equal, "Less": np.less,
          "Greater": np.greater}
    return fs[op](vs[0], vs[1]) if op in fs and len(vs) == 2 else None


def _known(v: Any, what: str) -> np.ndarray:
    if not isinstance(v, Known):
        raise _NoMatch(f"{what}: an input that is not a constant")
    return v.value




def _stays_true(cond: str, cond_in: str, body: Any) -> bool:
    """The body's condition output is its condition input (through Identity) or the constant true."""
    producer = {o: x for x in body.node for o in x.output}
    while cond != cond_in:
        x = producer.get(cond)
        if x is None:
            return False
        if x.op_type == "Constant":
            v = constant_value(_attrs(x))
            return v is not None and v.dtype == bool and bool(np.all(v))
        if x.op_type != "Identity":
            return False
        cond = x.input[0]
    return True
