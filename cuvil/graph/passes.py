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
- :func:`channels_last`: in a model with depthwise convolutions, 2-D convolutions compute NHWC
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
from cuvil.graph.expand_rnn import expand_rnn
from cuvil.graph.ir import Graph, Node
from cuvil.graph.loops import embedding_bag_loops
from cuvil.graph.qdq import match_qdq

Pass = Callable[[Graph], Graph]


def _with(g: Graph, nodes: list[Node], inits: dict[str, np.ndarray] | None = None) -> Graph:
    return replace(g, nodes=nodes, initializers=dict(g.initializers if inits is None else inits))


def _rename_inputs(nodes: list[Node], alias: dict[str, str]) -> list[Node]:
    def resolve(x: str) -> str:
        while x in alias:
            x = alias[x]
        return x

    return [replace(n, inputs=tuple(resolve(x) if x else x for x in n.inputs)) for n in nodes]


def _readers(g: Graph) -> dict[str, list[Node]]:
    out: dict[str, list[Node]] = {}
    for n in g.nodes:
        for x in n.inputs:
            if x:
                out.setdefault(x, []).append(n)
    return out


def remove_identities(g: Graph) -> Graph:
    """``Identity`` and ``Dropout`` (inference: no ``training_mode`` input, its mask unused) as renames."""
    outputs = {v.name for v in g.outputs}
    readers = _readers(g)
    producer = {o: n for n in g.nodes for o in n.outputs if o}
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


_FLAT_REDUCTIONS = frozenset({"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin"})


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
    shapes = {v.name: v.shape for v in (*g.inputs, *g.outputs, *g.value_info.values())}
    taken: dict[str, Any] = {**g.initializers, **{o: 0 for n in g.nodes for o in n.outputs}}
    inits = dict(g.initializers)
    nodes: list[Node] = []
    changed = False
    for n in g.nodes:
        shape = shapes.get(n.inputs[0]) if n.inputs else None
        if (n.op_type not in _FLAT_REDUCTIONS or n.domain or len(n.outputs) != 1 or shape is None
                or not all(isinstance(d, int) and d > 0 for d in shape)):  # (an empty value: nothing to gain)
            nodes.append(n)
            continue
        rank = len(shape)
        axes = _reduced_axes(n, g, rank)
        if axes is None or len(axes) < 2 or axes != list(range(rank - len(axes), rank)):
            nodes.append(n)
            continue
        keep = int(n.attrs.get("keepdims", 1))
        flat = tuple(shape[:rank - len(axes)]) + (int(np.prod(shape[rank - len(axes):])),)
        names = [_fresh(taken, n.outputs[0] + suffix) for suffix in (".shape", ".flat", ".axes", ".reduced", ".out")]
        for x in names:
            taken[x] = 0
        inits[names[0]] = np.array(flat, np.int64)
        nodes.append(Node("Reshape", n.name + ".flatten", (n.inputs[0], names[0]), (names[1],)))
        attrs = dict(n.attrs)
        ins: tuple[str, ...] = (names[1],)
        if len(n.inputs) > 1 and n.inputs[1]:  # axes as an input (ReduceSum from opset 13, the others from 18)
            inits[names[2]] = np.array([len(flat) - 1], np.int64)
            ins = (names[1], names[2])
        else:
            attrs["axes"] = [len(flat) - 1]
        if not keep:
            nodes.append(replace(n, inputs=ins, attrs=attrs))
        else:
            out = tuple(1 if d in axes else x for d, x in enumerate(shape))
            inits[names[4]] = np.array(out, np.int64)
            nodes.append(replace(n, inputs=ins, outputs=(names[3],), attrs=attrs))
            nodes.append(Node("Reshape", n.name + ".unflatten", (names[3], names[4]), n.outputs))
        changed = True
    return _with(g, nodes, inits) if changed else g


def _const(g: Graph, name: str) -> np.ndarray | None:
    return g.initializers.get(name) if name else None


def fold_batchnorm(g: Graph) -> Graph:
    """Fold inference BatchNormalization into the Conv/Gemm before it (constants only)."""
    readers = _readers(g)
    outputs = {v.name for v in g.outputs}
    producer = {o: n for n in g.nodes for o in n.outputs if o}
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


def _depthwise(n: Node, g: Graph) -> bool:
    w = _const(g, n.inputs[1]) if n.op_type == "Conv" and not n.domain and len(n.inputs) > 1 else None
    return w is not None and w.ndim == 4 and w.shape[1] == 1 and int(n.attrs.get("group", 1)) == w.shape[0] > 1


def _dense_nhwc(w: np.ndarray, nhwc_input: bool, n: Node) -> bool:
    """A ``group`` 1 convolution computed channels-last: 1x1 ones, and windows up to 3x3 that read NCHW
    (a network's stem).  (A 7x7 stem, and a 3x3 stride-2 convolution reading NHWC, overran isl's
    operation bound while being scheduled; they stay NCHW.)"""
    if int(n.attrs.get("group", 1)) != 1:
        return False
    taps = int(np.prod(w.shape[2:]))
    return taps == 1 or (taps <= 9 and not nhwc_input)


def _pays(g: Graph) -> bool:
    """Channels last pays in models with depthwise convolutions (MobileNet-style)."""
    return any(_depthwise(n, g) for n in g.nodes)


_INT8_CONVS = frozenset({"CuvilQLinearConv", "QLinearConv"})
# 8-bit element-wise ops -> the positions of their data inputs (the others: per-tensor scales and zero
# points, or a lookup table)
_INT8_ELEMENTWISE = {"QLinearAdd": (0, 3), "QLinearMul": (0, 3), "QLinearSigmoid": (0,), "QLinearLeakyRelu": (0,),
                     "CuvilQLinearLookup": (0,), "QuantizeLinear": (0,), "DequantizeLinear": (0,)}


def _int8_conv(n: Node, g: Graph) -> bool:
    """A quantized 2-D convolution with a quantized output, constant weights and input zero point."""
    if n.domain or n.op_type not in _INT8_CONVS or len(n.inputs) < 7 or not n.inputs[6] or len(n.outputs) != 1:
        return False
    w = _const(g, n.inputs[3])
    zx = n.inputs[2] if len(n.inputs) > 2 else ""
    return (w is not None and w.ndim == 4 and (not zx or _const(g, zx) is not None)
            and n.attrs.get("auto_pad", "NOTSET") in ("NOTSET", b"NOTSET"))


def _spatial_mean(n: Node, g: Graph) -> bool:
    """A ``ReduceMean`` of a 4-D value over its two spatial axes that keeps them (a global average pool)."""
    if n.op_type != "ReduceMean" or n.domain or len(n.outputs) != 1 or int(n.attrs.get("keepdims", 1)) != 1:
        return False
    axes = n.attrs.get("axes")
    if len(n.inputs) > 1 and n.inputs[1]:
        a = _const(g, n.inputs[1])
        axes = None if a is None else a.reshape(-1).tolist()
    return axes is not None and sorted(int(x) % 4 for x in axes) == [2, 3]


def _perm(n: Node) -> list[int] | None:
    """The permutation of a 4-D ``Transpose`` node, else None."""
    if n.op_type != "Transpose" or n.domain or len(n.outputs) != 1:
        return None
    perm = n.attrs.get("perm")
    return [int(p) for p in perm] if perm is not None and len(perm) == 4 else None


def _int8_elementwise(n: Node, g: Graph, phys: dict[str, str]) -> bool:
    """An 8-bit element-wise node (:data:`_INT8_ELEMENTWISE`) reading a channels-last value, whose other
    data inputs are channels-last too or scalars, and whose scales, zero points and tables are constants
    (one value each for Q / DQ: per tensor)."""
    data = _INT8_ELEMENTWISE.get(n.op_type) if not n.domain and len(n.outputs) == 1 else None
    if data is None or not any(k < len(n.inputs) and n.inputs[k] in phys for k in data):
        return False
    per_tensor = n.op_type in ("QuantizeLinear", "DequantizeLinear")
    for k, x in enumerate(n.inputs):
        c = _const(g, x) if x else None
        if k in data:
            if x and x not in phys and (c is None or c.size != 1):
                return False
        elif x and (c is None or (per_tensor and c.size != 1)):
            return False
    return True


_Grids = dict[str, tuple[Node, Node, tuple[int, ...]]]
_Tokens = dict[str, tuple[Node, tuple[int, ...]]]


def _token_grids(g: Graph) -> tuple[_Grids, _Tokens]:
    """A transformer's token grids, which are channels-last images already: ``Reshape(Transpose(t, [0, 2, 1]),
    (N, C, H, W))`` of tokens ``t`` of shape ``(N, H * W, C)`` (the image a SegFormer Mix-FFN's depthwise
    convolution reads) is ``t``'s buffer seen as ``(N, H, W, C)``, and ``Transpose(Reshape(y, (N, C, H * W)),
    [0, 2, 1])`` of an image ``y`` (back to tokens) is ``y``'s NHWC buffer seen as ``(N, H * W, C)``.  Returns
    {grid: (transpose, reshape, NHWC shape)} and {tokens: (the reshape it reads, token shape)}, each where
    the intermediate value has that one reader and every shape is static."""
    shapes = {v.name: v.shape for v in (*g.inputs, *g.outputs, *g.value_info.values())}
    readers = _readers(g)
    made = {o: n for n in g.nodes for o in n.outputs if o}

    def static(x: str) -> tuple[int, ...] | None:
        sh = shapes.get(x)
        return tuple(sh) if sh is not None and all(isinstance(d, int) for d in sh) else None

    def only_reader(x: str, n: Node) -> bool:
        return x not in {v.name for v in g.outputs} and [r is n for r in readers.get(x, [])] == [True]

    grids: _Grids = {}
    tokens: _Tokens = {}
    for n in g.nodes:
        if n.domain or n.op_type not in ("Reshape", "Transpose") or len(n.outputs) != 1 or not n.inputs:
            continue
        prev = made.get(n.inputs[0])
        if prev is None or prev.domain or len(prev.outputs) != 1 or not only_reader(prev.outputs[0], n):
            continue
        src, mid, dst = static(prev.inputs[0]), static(prev.outputs[0]), static(n.outputs[0])
        if src is None or mid is None or dst is None:
            continue
        perm = [int(p) for p in prev.attrs.get("perm", [])] if prev.op_type == "Transpose" else None
        if (n.op_type == "Reshape" and perm == [0, 2, 1] and len(src) == 3 and len(dst) == 4
                and dst[:2] == (src[0], src[2]) and dst[2] * dst[3] == src[1]):
            grids[n.outputs[0]] = (prev, n, (dst[0], dst[2], dst[3], dst[1]))
        elif (n.op_type == "Transpose" and prev.op_type == "Reshape" and _perm3(n) == [0, 2, 1] and len(src) == 4
              and mid == (src[0], src[1], src[2] * src[3])):
            tokens[n.outputs[0]] = (prev, dst)
    return grids, tokens


def _perm3(n: Node) -> list[int] | None:
    perm = n.attrs.get("perm")
    return [int(p) for p in perm] if perm is not None and len(perm) == 3 else None


def channels_last(g: Graph) -> Graph:
    """In a model with depthwise convolutions, 2-D convolutions (depthwise, or ``group`` 1 as
    :func:`_dense_nhwc` says; constant weights) compute channels-last: ``Conv`` -> ``CuvilConvNHWC``
    (cuvil/graph/ops/layout.py), element-wise nodes between them (scalar constants only)
    keep the layout, a ``GlobalAveragePool`` (or a ``ReduceMean`` over H and W that keeps them) of a
    channels-last value reads it as it is, and any other reader gets a ``Transpose`` back to NCHW.
    Graph outputs stay NCHW.

    In a quantized model every quantized 2-D convolution computes channels-last
    (``CuvilQLinearConvNHWC``, cuvil/graph/ops/qconv_nhwc.py: each pixel's requantized channels are one
    vector store, and the next convolution reads four channels as one word), and so do the 8-bit ops
    between them: the QLinear element-wise ops, per-tensor Q / DQ, 8-bit max pools (``layout="NHWC"``)
    and ``QLinearGlobalAveragePool``.  (ResNet-50 QDQ U8S8 at 1 thread: 26.0 -> 21.9 ms.)

    The model's own transposes between the layouts cancel against this: ``Transpose(x, [0, 3, 1,
    2])`` (an NHWC value made NCHW, as ConvNeXt does around its LayerNorms) is ``x``'s buffer seen as a
    channels-last value, and ``Transpose(y, [0, 2, 3, 1])`` of a channels-last ``y`` is ``y``'s buffer
    itself; each is written only if a reader needs it."""
    floats, ints = _pays(g), any(_int8_conv(n, g) for n in g.nodes)
    if not floats and not ints:
        return g
    from cuvil.graph.fuse import ELEMENTWISE

    outputs = {v.name for v in g.outputs}
    taken: dict[str, Any] = {**g.initializers, **{o: 0 for n in g.nodes for o in n.outputs}}
    phys: dict[str, str] = {}  # a value computed channels-last -> its buffer (NHWC shape)
    deferred: dict[str, tuple[Node, ...]] = {}  # the model's transposes to NCHW, written when an NCHW reader needs them
    grids, tokens = _token_grids(g) if floats else ({}, {})
    inits = dict(g.initializers)
    to_grid = {tr.outputs[0] for tr, _, _ in grids.values()}  # written only if an NCHW reader needs the grid
    flats = {r.outputs[0] for r, _ in tokens.values()}
    flattened: set[str] = set()  # an image's Reshape to (N, C, H * W) that its token Transpose reads as NHWC
    rename: dict[str, str] = {}  # a transpose to NHWC of a channels-last value -> that value's buffer
    back: dict[str, str] = {}
    bytes_: set[str] = set()  # the channels-last values of 8 bits
    nodes: list[Node] = []

    def nchw(x: str) -> str:
        if x not in phys:
            return x
        if x in deferred:
            nodes.extend(deferred.pop(x))
            back[x] = x
        if x not in back:
            back[x] = _fresh(taken, x + ".nchw")
            taken[back[x]] = 0
            nodes.append(Node("Transpose", back[x], (phys[x],), (back[x],), {"perm": [0, 3, 1, 2]}))
        return back[x]

    def scalar(x: str) -> bool:
        c = _const(g, x)
        return c is not None and c.size == 1

    def buf(x: str) -> str:  # what a reader that takes either layout reads
        return phys[x] if x in phys else rename.get(x, x)

    for n in g.nodes:
        out = n.outputs[0] if n.outputs else ""
        w = _const(g, n.inputs[1]) if n.op_type == "Conv" and not n.domain and len(n.inputs) > 1 else None
        if (floats and w is not None and w.ndim == 4 and out not in outputs and len(n.outputs) == 1
                and n.attrs.get("auto_pad", "NOTSET") in ("NOTSET", b"NOTSET")
                and (_dense_nhwc(w, n.inputs[0] in phys, n) or _depthwise(n, g))):
            attrs = {**n.attrs, "in_layout": "NHWC" if n.inputs[0] in phys else "NCHW"}
            nodes.append(replace(n, op_type="CuvilConvNHWC", attrs=attrs, inputs=tuple(buf(x) for x in n.inputs)))
            phys[out] = out
        elif ints and out not in outputs and _int8_conv(n, g):
            attrs = {**n.attrs, "in_layout": "NHWC" if n.inputs[0] in phys else "NCHW"}
            nodes.append(replace(n, op_type="CuvilQLinearConvNHWC", attrs=attrs,
                                 inputs=tuple(buf(x) for x in n.inputs)))
            phys[out] = out
            bytes_.add(out)
        elif ints and out not in outputs and _int8_elementwise(n, g, phys):
            nodes.append(replace(n, inputs=tuple(buf(x) for x in n.inputs)))
            phys[out] = out
            if n.op_type != "DequantizeLinear":
                bytes_.add(out)
        elif (not n.domain and n.op_type in ("CuvilMaxPool8", "MaxPool") and n.inputs[0] in bytes_
              and out not in outputs and len([o for o in n.outputs if o]) == 1):
            # (a QOperator file max-pools the 8-bit values with ONNX's MaxPool)
            nodes.append(Node("CuvilMaxPool8", n.name, (phys[n.inputs[0]],), (out,), {**n.attrs, "layout": "NHWC"}))
            phys[out] = out
            bytes_.add(out)
        elif (n.op_type == "QLinearGlobalAveragePool" and not n.domain and n.inputs[0] in phys
              and not int(n.attrs.get("channels_last", 0))):
            nodes.append(replace(n, op_type="CuvilQLinearGlobalAveragePoolNHWC",
                                 inputs=tuple(buf(x) for x in n.inputs)))
        elif _perm(n) == [0, 3, 1, 2] and out not in outputs and n.inputs[0] not in phys:
            phys[out] = buf(n.inputs[0])
            deferred[out] = (replace(n, inputs=(phys[out],)),)
        elif out in to_grid and n.inputs[0] not in phys:
            pass  # (deferred with the grid's Reshape, next)
        elif out in grids and grids[out][0].inputs[0] not in phys:  # tokens seen as an NHWC image
            tr, _, nhwc = grids[out]
            view = _fresh(taken, out + ".nhwc")
            taken[view] = 0
            inits[view + ".shape"] = np.asarray(nhwc, np.int64)
            nodes.append(Node("Reshape", view, (tr.inputs[0], view + ".shape"), (view,)))
            phys[out] = view
            deferred[out] = (tr, n)
        elif out in flats and n.inputs[0] in phys and n.inputs[0] not in bytes_:
            flattened.add(out)  # (its one reader, the token Transpose, reads the image's buffer instead)
        elif out in tokens and n.inputs[0] in flattened:  # an NHWC image seen as tokens
            r, shape = tokens[out]
            inits[out + ".shape"] = np.asarray(shape, np.int64)
            nodes.append(Node("Reshape", n.name, (phys[r.inputs[0]], out + ".shape"), (out,)))
        elif _perm(n) == [0, 2, 3, 1] and out not in outputs and n.inputs[0] in phys:
            rename[out] = phys[n.inputs[0]]
        elif (not n.domain and n.op_type in ELEMENTWISE and out not in outputs and len(n.outputs) == 1
              and any(x in phys for x in n.inputs) and all(not x or x in phys or scalar(x) for x in n.inputs)):
            nodes.append(replace(n, inputs=tuple(buf(x) for x in n.inputs)))
            phys[out] = out
        elif (((n.op_type == "GlobalAveragePool" and not n.domain) or _spatial_mean(n, g)) and n.inputs[0] in phys
              and n.inputs[0] not in bytes_):
            # (a ReduceMean over H and W: squeeze-and-excitation's x.mean((2, 3), keepdim=True))
            nodes.append(Node("CuvilGlobalAveragePoolNHWC", n.name, (phys[n.inputs[0]],), n.outputs))
        else:
            ins = tuple(nchw(x) if x in phys else rename.get(x, x) for x in n.inputs)
            nodes.append(replace(n, inputs=ins) if ins != n.inputs else n)
    return _with(g, nodes, inits)


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
