"""The pattern rewriter (cuvil/graph/rewrite.py) on small graphs, with no compilation: first match wins,
consumed nodes are not written, a replacement can stand where a later node of its subgraph stood, and a
graph nothing matched comes back as it is."""

import numpy as np

from cuvil.graph.ir import Graph, Node, ValueInfo
from cuvil.graph.rewrite import Match, Pattern, Rewrite, rewrite


def _graph(nodes, inits=None):
    return Graph("g", [ValueInfo("x", "float32", (2, 3))], [ValueInfo(nodes[-1].outputs[0], "float32", (2, 3))],
                 dict(inits or {}), nodes, 17)


def _ops(g):
    return [(n.op_type, n.inputs, n.outputs) for n in g.nodes]


def test_uses_index_producers_and_readers():
    a, b = Node("Relu", "a", ("x",), ("t",)), Node("Add", "b", ("t", "t"), ("y",))
    uses = _graph([a, b]).uses()
    assert uses.producer == {"t": a, "y": b}
    assert uses.readers["t"] == [b, b] and uses.only_reader("t") is None  # read twice: not an only reader
    assert uses.only_reader("x") is a and uses.only_reader("y") is None  # (a graph output)


def test_a_match_consumes_its_subgraph_and_the_first_pattern_wins():
    g = _graph([Node("Relu", "r", ("x",), ("t",)), Node("Neg", "n", ("t",), ("u",)), Node("Exp", "e", ("u",), ("y",))])

    def fuse(rw, n):  # Relu -> Neg (its only reader): one node
        neg = rw.uses.only_reader(n.outputs[0])
        return Match((Node("NegRelu", n.name, n.inputs, neg.outputs),), (neg,)) if neg.op_type == "Neg" else None

    def never(rw, n):
        raise AssertionError("a later pattern was tried after a match")

    out = rewrite(g, (Pattern("relu-neg", {"Relu"}, fuse), Pattern("never", {"Relu"}, never)), Rewrite(g))
    assert _ops(out) == [("NegRelu", ("x",), ("u",)), ("Exp", ("u",), ("y",))]
    assert _ops(g)[0][0] == "Relu"  # the input graph is not changed


def test_a_replacement_can_stand_at_a_later_node_and_add_constants():
    g = _graph([Node("Relu", "r", ("x",), ("t",)), Node("Exp", "s", ("x",), ("k",)), Node("Mul", "m", ("t", "k"), ("y",))])

    def at_mul(rw, n):
        mul = rw.uses.only_reader(n.outputs[0])
        two = rw.new_const("two", np.float32(2))
        return Match((Node("ScaledRelu", n.name, (n.inputs[0], mul.inputs[1], two), mul.outputs),), at=mul)

    out = rewrite(g, (Pattern("scaled", {"Relu"}, at_mul),), Rewrite(g))
    assert _ops(out) == [("Exp", ("x",), ("k",)), ("ScaledRelu", ("x", "k", "two"), ("y",))]
    assert set(out.initializers) == {"two"}


def test_no_match_returns_the_graph_and_otherwise_sees_the_rest():
    g = _graph([Node("Relu", "r", ("x",), ("y",))])
    assert rewrite(g, (Pattern("none", {"Relu"}, lambda rw, n: None),), Rewrite(g)) is g
    out = rewrite(g, (), Rewrite(g), otherwise=lambda rw, n: [Node("Identity", "i", n.inputs, ("x2",)),
                                                             Node("Relu", "r", ("x2",), n.outputs)])
    assert [n.op_type for n in out.nodes] == ["Identity", "Relu"]


def test_fresh_names_skip_taken_ones():
    g = _graph([Node("Relu", "r", ("x",), ("y",)), Node("Relu", "r2", ("y",), ("y.nchw",))])
    rw = Rewrite(g)
    assert rw.fresh("y.nchw") == "y.nchw1" and rw.fresh("y.nchw") == "y.nchw2" and rw.fresh("z") == "z"
