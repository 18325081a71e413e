"""Graph passes: pure functions from a :class:`~cuvil.graph.ir.Graph` to a smaller, equivalent one.

Each pass is one concern and returns a new graph (the input is not changed); :func:`optimize` runs
them in order and can report the graph after each one (``cuvil compile --dump``)::

    Conv(x, W)            -> y           Conv(x, W * s[f], b * s[f] + t[f]) -> z
    BatchNormalization(y) -> z     =>    (s = scale / sqrt(var + eps), t = bias - mean * s)

- :func:`cuvil.graph.loops.embedding_bag_loops`: a ``Loop`` over the bags of an embedding bag (and the
  sequence ops around it) becomes one ``CuvilEmbeddingBag`` node, one with a constant trip count is
  unrolled; any other ``Loop`` is refused by name.
- :func:`remove_identities`: ``Identity`` and inference-mode ``Dropout`` become renames.
- :func:`cuvil.graph.qdq.match_qdq`: onnxruntime's QDQ patterns (DQ -> Conv/Gemm/MatMul -> Q, Q/DQ
  around element-wise and data-movement ops) become integer contractions and QLinear operators.
- :func:`fold_batchnorm`: an inference ``BatchNormalization`` whose parameters are constants, after
  a ``Conv`` (or a ``Gemm`` without transposed outputs) with constant weights that nothing else
  reads, is folded into that node's weights and bias (numpy, at compile time).
- :func:`eliminate_common_subexpressions`: two nodes of the same op, attributes and inputs compute
  the same values; the second is dropped and its readers read the first.
- :func:`eliminate_dead_nodes`: nodes whose outputs no graph output needs are dropped, and
  initializers no node reads.
- :func:`cuvil.graph.channels_last.channels_last`: in a model with depthwise convolutions, 2-D convolutions compute NHWC
  (``CuvilConvNHWC``), element-wise nodes between them keep that layout, other readers get a
  ``Transpose`` back (MobileNetV2 at 224, one thread: 42.1 -> 25.6 ms, onnxruntime 25.3 ms).
- :func:`flatten_trailing_reductions`: a reduction over the last axes of a static shape reduces one axis
  of the value flattened (a free ``Reshape`` on each side).

Graph outputs keep their names: a pass that would rename a graph output keeps the node instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from cuvil.errors import ArgumentError
from cuvil.graph.channels_last import channels_last
from cuvil.graph.expand_rnn import expand_rnn
from cuvil.graph.ir import Graph, Node
from cuvil.graph.loops import embedding_bag_loops
from cuvil.graph.qdq import match_qdq
from cuvil.graph.rewrite import Match, Pattern, Rewrite, rewrite

Pass = Callable[[Graph], Graph]


def _with(g: Graph, nodes: list[Node], inits: dict[str, np.ndarray] | None = None) -> Graph:
    return replace(g, nodes=nodes, initializers=dict(g.initializers if inits is None else inits))


def _rename_inputs(nodes: list[Node], alias: dict[str, str]) -> list[Node]:
    def resolve(x: str) -> str:
        while x in alias:
            x = alias[x]
        return x

    return [replace(n, inputs=tuple(resolve(x) if x else x for x in n.inputs)) for n in nodes]


def remove_identities(g: Graph) -> Graph:
    """``Identity`` and ``Dropout`` (inference: no ``training_mode`` input, its mask unused) as renames."""
    outputs = {v.name for v in g.outputs}
    uses = g.uses()
    readers, producer = uses.readers, uses.producer
    alias: dict[str, str] = {}
    renamed: dict[int, tuple[str, str]] = {}  # id(producer) -> (its output, the graph output it now writes)
    kept: list[Node] = []
    for n in g.nodes:
        dropout = (n.op_type == "Dropout" and not n.domain and len(n.inputs) < 3
                   and all(not readers.get(o) and o not in outputs for o in n.outputs[1:]))
        if not (n.op_type == "Identity" and not n.domain or dropout):
            kept.append(n)
        elif n.outputs[0] not in outputs:
            alias[n.outputs[0]] = n.inputs[0]
        else:  # the graph output keeps its name: the producer writes it, if nothing else reads its value
            src = producer.get(n.inputs[0])
            if (src is None or src.op_type in ("Identity", "Dropout") or n.inputs[0] in outputs
                    or len(readers.get(n.inputs[0], [])) != 1 or id(src) in renamed):
                kept.append(n)
            else:
                renamed[id(src)] = (n.inputs[0], n.outputs[0])
    if not alias and not renamed:
        return g
    kept = [replace(n, outputs=tuple(renamed[id(n)][1] if o == renamed[id(n)][0] else o for o in n.outputs))
            if id(n) in renamed else n for n in kept]
    return _with(g, _rename_inputs(kept, alias))


def constants_as_initializers(g: Graph) -> Graph:
    """``Constant`` nodes (TorchScript exports write one per scalar: Clip's bounds, Reshape's shapes) become
    initializers, so the passes after this one see their values (a Clip with constant bounds keeps a
    channels-last layout and fuses into its convolution).  Graph outputs stay nodes."""
    from cuvil.graph.ops.shape import constant_value

    outputs = {v.name for v in g.outputs}
    inits = dict(g.initializers)
    nodes = []
    for n in g.nodes:
        v = constant_value(n.attrs) if n.op_type == "Constant" and not n.domain and len(n.outputs) == 1 else None
        if v is None or n.outputs[0] in outputs or n.outputs[0] in inits:
            nodes.append(n)
        else:
            inits[n.outputs[0]] = v
    return g if len(nodes) == len(g.nodes) else _with(g, nodes, inits)


def elementwise_before_reshapes(g: Graph) -> Graph:
    """An element-wise node whose operands are reshaped values (and scalar constants) computes on the
    values before the reshape, and the reshape follows it: ``Gemm -> Reshape -> GELU`` (how exporters
    write a linear layer on a 3-D input) becomes ``Gemm -> GELU -> Reshape``, so the GELU fuses into
    the Gemm's epilogue.  Only where every operand's shapes, before and after, are static and alike."""
    from cuvil.graph.fuse import ELEMENTWISE

    shapes = {v.name: v.shape for v in (*g.inputs, *g.outputs, *g.value_info.values())}
    taken: dict[str, Any] = {**g.initializers, **{o: 0 for n in g.nodes for o in n.outputs}}
    source: dict[str, Node] = {}  # a reshaped value -> the Reshape (or the node standing for it)
    nodes: list[Node] = []
    changed = False

    def static(x: str) -> tuple[int, ...] | None:
        s = shapes.get(x)
        return tuple(s) if s is not None and all(isinstance(d, int) for d in s) else None

    for n in g.nodes:
        if (n.op_type == "Reshape" and not n.domain and len(n.inputs) == 2 and _const(g, n.inputs[1]) is not None
                and static(n.inputs[0]) and static(n.outputs[0])):
            source[n.outputs[0]] = n
            nodes.append(n)
            continue
        operands = [x for x in n.inputs if x and not (_const(g, x) is not None and _const(g, x).size == 1)]
        if (not n.domain and n.op_type in ELEMENTWISE and len(n.outputs) == 1 and operands
                and all(x in source for x in operands)
                and len({(static(source[x].inputs[0]), static(x)) for x in operands}) == 1
                and static(n.outputs[0]) == static(operands[0])):
            before = _fresh(taken, n.outputs[0] + ".flat")
            taken[before] = 0
            ins = tuple(source[x].inputs[0] if x in source else x for x in n.inputs)
            nodes.append(replace(n, inputs=ins, outputs=(before,)))
            r = source[operands[0]]
            shapes[before] = static(r.inputs[0])
            source[n.outputs[0]] = Node("Reshape", n.name + ".reshape", (before, r.inputs[1]), n.outputs, r.attrs)
            nodes.append(source[n.outputs[0]])
            changed = True
            continue
        nodes.append(n)
    return _with(g, nodes) if changed else g


def _reduced_axes(n: Node, g: Graph, rank: int) -> list[int] | None:
    """The axes a reduction node reduces (sorted, non-negative), when they are constants; else None."""
    axes = n.attrs.get("axes")
    if len(n.inputs) > 1 and n.inputs[1]:
        a = _const(g, n.inputs[1])
        axes = None if a is None else a.reshape(-1).tolist()
    if not axes:
        return None
    return sorted({int(x) % rank for x in axes})


def flatten_trailing_reductions(g: Graph) -> Graph:
    """A ``ReduceMean`` / ``ReduceSum`` / ``ReduceMax`` / ``ReduceMin`` over the last two or more axes of a
    value of static shape reduces one axis of the value flattened (a ``Reshape``, which costs nothing) and
    takes its shape back after::

        y = ReduceMean(x[1, 1000, 12, 12], axes=[2, 3])  =>  f = Reshape(x, [1, 1000, 144])
                                                             r = ReduceMean(f, axes=[2])
                                                             y = Reshape(r, [1, 1000, 1, 1])

    One unit-stride axis is reduced in vector lanes; over two axes the scheduler summed one element at a time
    (SqueezeNet's global mean of 1000 x 12 x 12 at 1 thread: 71 -> 9 us, onnxruntime 18)."""
    if g.opset < 5:  # (Reshape took its shape as an attribute)
        return g
    return rewrite(g, _FLATTEN, Rewrite(g))


def _flatten_reduction(rw: Rewrite, n: Node) -> Match | None:
    shape = rw.static(n.inputs[0]) if n.inputs else None
    if len(n.outputs) != 1 or shape is None or not all(d > 0 for d in shape):  # (an empty value: nothing to gain)
        return None
    rank = len(shape)
    axes = _reduced_axes(n, rw.g, rank)
    if axes is None or len(axes) < 2 or axes != list(range(rank - len(axes), rank)):
        return None
    keep = int(n.attrs.get("keepdims", 1))
    flat = tuple(shape[:rank - len(axes)]) + (int(np.prod(shape[rank - len(axes):])),)
    names = [rw.fresh(n.outputs[0] + suffix) for suffix in (".shape", ".flat", ".axes", ".reduced", ".out")]
    rw.inits[names[0]] = np.array(flat, np.int64)
    nodes = [Node("Reshape", n.name + ".flatten", (n.inputs[0], names[0]), (names[1],))]
    attrs = dict(n.attrs)
    ins: tuple[str, ...] = (names[1],)
    if len(n.inputs) > 1 and n.inputs[1]:  # axes as an input (ReduceSum from opset 13, the others from 18)
        rw.inits[names[2]] = np.array([len(flat) - 1], np.int64)
        ins = (names[1], names[2])
    else:
        attrs["axes"] = [len(flat) - 1]
    if not keep:
        return Match((*nodes, replace(n, inputs=ins, attrs=attrs)))
    rw.inits[names[4]] = np.array(tuple(1 if d in axes else x for d, x in enumerate(shape)), np.int64)
    return Match((*nodes, replace(n, inputs=ins, outputs=(names[3],), attrs=attrs),
                  Node("Reshape", n.name + ".unflatten", (names[3], names[4]), n.outputs)))


_FLATTEN = (Pattern("a reduction over the trailing axes -> Reshape, a reduction of one axis, Reshape",
                    {"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin"}, _flatten_reduction),)


def _const(g: Graph, name: str) -> np.ndarray | None:
    return g.initializers.get(name) if name else None


def fold_batchnorm(g: Graph) -> Graph:
    """Fold inference BatchNormalization into the Conv/Gemm before it (constants only)."""
    uses = g.uses()
    readers, producer = uses.readers, uses.producer
    outputs = {v.name for v in g.outputs}
    inits = dict(g.initializers)
    replaced: dict[int, Node] = {}  # id(Conv/Gemm) -> the folded node, writing the BN's output
    removed: set[int] = set()  # id(BN)
    for bn in g.nodes:
        if bn.op_type != "BatchNormalization" or bn.domain or any(bn.outputs[1:]) or bn.attrs.get("training_mode"):
            continue
        params = [_const(g, x) for x in bn.inputs[1:5]]
        prev = producer.get(bn.inputs[0])
        if prev is None or len(params) != 4 or any(p is None for p in params) or id(prev) in replaced:
            continue
        if len(readers.get(bn.inputs[0], [])) != 1 or bn.inputs[0] in outputs:
            continue  # the un-normalised values are needed elsewhere
        scale, bias, mean, var = (np.asarray(p, np.float64) for p in params)  # type: ignore[arg-type]
        s = scale / np.sqrt(var + float(bn.attrs.get("epsilon", 1e-5)))
        new = _fold_into(prev, s, bias - mean * s, g, inits)
        if new is not None:
            replaced[id(prev)] = replace(new, outputs=(bn.outputs[0],) + new.outputs[1:])
            removed.add(id(bn))
    if not replaced:
        return g
    return _with(g, [replaced.get(id(n), n) for n in g.nodes if id(n) not in removed], inits)


def _fold_into(prev: Node, s: np.ndarray, t: np.ndarray, g: Graph, inits: dict[str, np.ndarray]) -> Node | None:
    """``prev`` with its weights scaled by ``s`` per output channel and bias ``b * s + t`` (new initializers)."""
    if prev.domain or prev.op_type not in ("Conv", "Gemm"):
        return None
    w = _const(g, prev.inputs[1]) if len(prev.inputs) > 1 else None
    b = _const(g, prev.inputs[2]) if len(prev.inputs) > 2 else None
    if w is None or (len(prev.inputs) > 2 and prev.inputs[2] and b is None) or w.dtype.kind != "f":
        return None
    if prev.op_type == "Conv":
        if w.shape[0] != s.shape[0]:
            return None
        w2 = w * s.reshape((-1,) + (1,) * (w.ndim - 1))
    else:  # Gemm: Y = alpha * A' B' + beta * C, output channels along B's columns
        if prev.attrs.get("transB", 0):
            w2 = w * s.reshape(-1, 1) if w.shape[0] == s.shape[0] else None
        else:
            w2 = w * s.reshape(1, -1) if w.shape[-1] == s.shape[0] else None
        if w2 is None or float(prev.attrs.get("beta", 1.0)) != 1.0 or (b is not None and b.shape != s.shape):
            return None
    bias = (b.astype(np.float64) if b is not None else np.zeros_like(s)) * s + t
    wname, bname = _fresh(inits, prev.inputs[1] + ".bn"), _fresh(inits, prev.name + ".bn_bias")
    inits[wname] = w2.astype(w.dtype)
    inits[bname] = bias.astype(w.dtype)
    return replace(prev, inputs=(prev.inputs[0], wname, bname))


def _fresh(taken: dict[str, Any], base: str) -> str:
    name, k = base, 1
    while name in taken:
        name, k = f"{base}{k}", k + 1
    return name


def _attr_key(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return ("array", v.dtype.str, v.shape, v.tobytes())
    if isinstance(v, (list, tuple)):
        return tuple(_attr_key(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _attr_key(x)) for k, x in v.items()))
    return v


def eliminate_common_subexpressions(g: Graph) -> Graph:
    """Drop a node that repeats an earlier one (same op, domain, attributes and inputs)."""
    outputs = {v.name for v in g.outputs}
    seen: dict[Any, Node] = {}
    alias: dict[str, str] = {}
    kept: list[Node] = []
    for n in _rename_inputs(g.nodes, {}):
        n = _rename_inputs([n], alias)[0]
        try:
            key = (n.domain, n.op_type, n.inputs, _attr_key(n.attrs), len(n.outputs))
            hash(key)
        except TypeError:
            kept.append(n)
            continue
        first = seen.get(key)
        if first is not None and not any(o in outputs for o in n.outputs) and n.op_type not in _RANDOM:
            alias.update({o: f for o, f in zip(n.outputs, first.outputs) if o})
            continue
        seen.setdefault(key, n)
        kept.append(n)
    return _with(g, kept) if alias else g


_RANDOM = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}


def eliminate_dead_nodes(g: Graph) -> Graph:
    """Drop nodes no graph output depends on, and initializers nothing reads."""
    needed = {v.name for v in g.outputs}
    kept: list[Node] = []
    for n in reversed(g.nodes):
        if any(o in needed for o in n.outputs if o):
            kept.append(n)
            needed.update(x for x in n.inputs if x)
    kept.reverse()
    inits = {k: v for k, v in g.initializers.items() if k in needed}
    if len(kept) == len(g.nodes) and len(inits) == len(g.initializers):
        return g
    inputs = [v for v in g.inputs if v.name in needed or v.name not in g.initializers]
    return replace(g, nodes=kept, initializers=inits, inputs=inputs)


PASSES: tuple[tuple[str, Pass], ...] = (
    ("constants as initializers", constants_as_initializers),
    ("embedding-bag loops", embedding_bag_loops),
    ("expand recurrent nodes", expand_rnn),
    ("remove identities", remove_identities),
    ("quantized operators", match_qdq),
    ("element-wise before reshapes", elementwise_before_reshapes),
    ("fold batch normalization", fold_batchnorm),
    ("common subexpressions", eliminate_common_subexpressions),
    ("dead nodes", eliminate_dead_nodes),
    ("channels last", channels_last),
    ("flatten trailing reductions", flatten_trailing_reductions),
)


def optimize(g: Graph, dump: Callable[[str, Graph], None] | None = None, names: Sequence[str] | None = None
             ) -> Graph:
    """``g`` after every pass of :data:`PASSES` (or those in ``names``), in order; ``dump(name, graph)`` sees
    each result."""
    if names is not None:
        unknown = set(names) - {n for n, _ in PASSES}
        if unknown:
            raise ArgumentError(f"unknown graph pass(es) {', '.join(sorted(map(repr, unknown)))}; the passes: "
                                + ", ".join(repr(n) for n, _ in PASSES))
    for name, p in PASSES:
        if names is not None and name not in names:
            continue
        g = p(g)
        if dump is not None:
            dump(name, g)
    return g


def graph_str(g: Graph) -> str:
    """One line per node: ``outputs = op(inputs)``, then the counts."""
    lines = [f"graph {g.name}: inputs {[v.name for v in g.feeds]}, outputs {[v.name for v in g.outputs]}"]
    for n in g.nodes:
        lines.append(f"  {', '.join(n.outputs)} = {n.op_type}({', '.join(n.inputs)})")
    lines.append(f"  {len(g.nodes)} nodes, {len(g.initializers)} initializers")
    return "\n".join(lines)
