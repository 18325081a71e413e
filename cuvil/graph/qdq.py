"""QDQ matching: the quantized operators of a model in onnxruntime's QDQ format become integer ones.

``onnxruntime.quantization.quantize_static`` (QDQ format) writes every quantized operator as float
arithmetic between DequantizeLinear and QuantizeLinear nodes::

    xq -> DQ(sx, zx) --\\
    wq -> DQ(sw, zw) ---> Conv -> [Relu] -> Q(sy, zy) -> yq          (bias: DQ(int32 b, sx * sw))
    bq -> DQ(sx * sw) -/

:func:`match_qdq` turns each such Conv / Gemm / MatMul into one integer contraction with its
requantization epilogue (``CuvilQLinearConv`` / ``CuvilQLinearMatMul``, QLinearConv's arithmetic; a kept
Relu becomes ``Max(y, zy)``, which fuses into it); one whose output is not quantized keeps a float32
output, still from the integer contraction.  Between the contractions:

- data movement (MaxPool, Reshape, Transpose, Flatten, Squeeze, Unsqueeze, and Concat) between a DQ and
  a Q of the same scale and zero point runs on the 8-bit values (MaxPool as ``CuvilMaxPool8``);
- Add, Mul, Sigmoid, LeakyRelu, GlobalAveragePool, Softmax and Concat of other scales become onnxruntime's
  QLinear operators (:mod:`cuvil.graph.ops.quant.ms`), which compute what the float chain does, rounded once;
- any other Q / DQ node stays, computed element-wise (exact ONNX semantics).

A chain of unary float ops (or ops with a scalar constant) from a DQ to a Q (BERT's ``Div -> Erf``)
becomes one lookup in a table of the 256 codes (:mod:`cuvil.graph.qdq_table`).

``quantize_dynamic``'s ``MatMulInteger / ConvInteger -> Cast -> Mul(scale)`` becomes one node that scales
the int32 sums in its epilogue (``CuvilMatMulIntegerToFloat`` / ``CuvilConvIntegerToFloat``).

:func:`integer_contractions` counts what a compiled session runs: integer contractions, and the float
contractions left (the number a quantized model should bring to 0).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from cuvil.graph.ir import Graph, Node
from cuvil.graph.qdq_table import TABLE_OPS, match_table
from cuvil.graph.rewrite import Match, Pattern, Rewrite, rewrite

INTEGER_CONTRACTIONS = frozenset({"CuvilQLinearConv", "CuvilQLinearConvNHWC", "CuvilQLinearMatMul", "QLinearConv",
                                  "QLinearMatMul", "MatMulInteger", "ConvInteger", "QGemm",
                                  "CuvilMatMulIntegerToFloat", "CuvilConvIntegerToFloat"})
FLOAT_CONTRACTIONS = frozenset({"Conv", "CuvilConvNHWC", "Gemm", "MatMul", "ConvTranspose", "Einsum"})
_MOVES = frozenset({"MaxPool", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze"})
_QLINEAR = {"Add": "QLinearAdd", "Mul": "QLinearMul", "Sigmoid": "QLinearSigmoid", "LeakyRelu": "QLinearLeakyRelu",
            "GlobalAveragePool": "QLinearGlobalAveragePool", "Softmax": "QLinearSoftmax"}


@dataclass(frozen=True)
class _Q:
    """A Q or DQ node's quantization: its value input, scale and zero point names and values."""

    node: Node
    scale: np.ndarray
    zero: np.ndarray | None

    @property
    def per_tensor(self) -> bool:
        return self.scale.size == 1 and (self.zero is None or self.zero.size == 1)

    def same(self, other: _Q) -> bool:
        return (self.per_tensor and other.per_tensor and float(self.scale.reshape(-1)[0]) ==
                float(other.scale.reshape(-1)[0]) and self.zp == other.zp and self.dtype == other.dtype)

    @property
    def zp(self) -> int:
        return 0 if self.zero is None else int(self.zero.reshape(-1)[0])

    @property
    def dtype(self) -> str:
        return "uint8" if self.zero is None else self.zero.dtype.name


class _View(Rewrite):
    """The graph's producers, readers and constants, for the matcher."""

    def q(self, n: Node | None, op: str) -> _Q | None:
        """``n`` as a Q or DQ node (``op``) with constant scale and zero point, else None."""
        if n is None or n.op_type != op or n.domain or len(n.inputs) < 2 or int(n.attrs.get("block_size", 0) or 0):
            return None
        s = self.const(n.inputs[1])
        z = self.const(n.inputs[2]) if len(n.inputs) > 2 and n.inputs[2] else None
        if s is None or (len(n.inputs) > 2 and n.inputs[2] and z is None) or s.dtype != np.float32:
            return None
        if z is not None and z.dtype.name not in ("uint8", "int8", "int32"):
            return None
        if op == "QuantizeLinear" and z is None and int(n.attrs.get("output_dtype", 0) or 0) not in (0, 2):
            return None
        return _Q(n, s, z)

    def dq_of(self, name: str) -> _Q | None:
        return self.q(self.uses.producer.get(name), "DequantizeLinear")

    def only_reader(self, name: str) -> Node | None:
        return self.uses.only_reader(name)


def match_qdq(g: Graph) -> Graph:
    """Every matched QDQ pattern (:data:`PATTERNS`, see the module docstring) replaced; the DQ / Q nodes it
    leaves unread are removed by the dead-node pass."""
    if not any(n.op_type in ("DequantizeLinear", "MatMulInteger", "ConvInteger") and not n.domain for n in g.nodes):
        return g
    return rewrite(g, PATTERNS, _View(g))


def _requant_target(v: _View, n: Node) -> tuple[_Q | None, Node | None]:
    """The QuantizeLinear that alone reads ``n``'s output (through a Relu that alone reads it), if any."""
    r = v.only_reader(n.outputs[0])
    relu = None
    if r is not None and r.op_type == "Relu" and not r.domain:
        relu, r = r, v.only_reader(r.outputs[0])
    q = v.q(r, "QuantizeLinear")
    if q is None or not q.per_tensor or q.dtype not in ("uint8", "int8"):
        return None, None
    return q, relu


def _contraction(v: _View, n: Node) -> Match | None:
    """DQ(x), DQ(w) [, DQ(int32 b)] -> Conv / Gemm / MatMul [-> Relu] [-> Q]: one integer contraction with its
    requantization epilogue (a kept Relu: ``Max(y, zy)``), or a float32 output where no Q reads it."""
    if len(n.inputs) < 2 or len(n.outputs) != 1:
        return None
    dx, dw = v.dq_of(n.inputs[0]), v.dq_of(n.inputs[1])
    if dx is None or dw is None or not dx.per_tensor or dx.dtype not in ("uint8", "int8"):
        return None
    if dw.dtype not in ("uint8", "int8"):
        return None
    w = v.const(dw.node.inputs[0])
    axis = int(dw.node.attrs.get("axis", 1))
    w_in, sw, zw = dw.node.inputs[0], dw.node.inputs[1], dw.node.inputs[2] if len(dw.node.inputs) > 2 else ""
    if n.op_type == "Conv":
        if w is None or (not dw.per_tensor and axis != 0):
            return None
        op = "CuvilQLinearConv"
    else:
        if n.op_type == "Gemm":
            if (int(n.attrs.get("transA", 0)) or float(n.attrs.get("alpha", 1.0)) != 1.0
                    or float(n.attrs.get("beta", 1.0)) != 1.0 or w is None or w.ndim != 2):
                return None
            if int(n.attrs.get("transB", 0)):
                if not dw.per_tensor and axis % 2 != 0:
                    return None
                w_in = v.new_const(w_in + ".T", np.ascontiguousarray(w.T))
                axis = 1
        if w is None and not dw.per_tensor:
            return None
        if not dw.per_tensor and (w is None or axis % w.ndim != w.ndim - 1):
            return None
        op = "CuvilQLinearMatMul"
    bias = ""
    if len(n.inputs) > 2 and n.inputs[2]:
        db = v.dq_of(n.inputs[2])
        b = v.const(db.node.inputs[0]) if db is not None else None
        if b is None or b.dtype != np.int32 or db.zp != 0:
            return None
        want = (dx.scale.reshape(-1)[0] * dw.scale.reshape(-1)).astype(np.float32)
        if not np.allclose(db.scale.reshape(-1), want, rtol=1e-5, atol=0):
            return None
        bias = db.node.inputs[0]
    q, relu = _requant_target(v, n)
    ins = [dx.node.inputs[0], dx.node.inputs[1], dx.node.inputs[2] if len(dx.node.inputs) > 2 else "",
           w_in, sw, zw, q.node.inputs[1] if q else "", q.node.inputs[2] if q and len(q.node.inputs) > 2 else "",
           bias]
    attrs = {k: a for k, a in n.attrs.items() if k in ("group", "pads", "strides", "dilations", "kernel_shape",
                                                      "auto_pad")}
    if q is None:
        return Match((Node(op, n.name, tuple(ins), n.outputs, attrs),))
    if relu is None:
        return Match((Node(op, n.name, tuple(ins), q.node.outputs, attrs),), (q.node,))
    pre = n.outputs[0] + ".q"
    zname = v.new_const(n.name + ".relu_floor", np.array(q.zp, q.dtype))
    return Match((Node(op, n.name, tuple(ins), (pre,), attrs), Node("Max", relu.name, (pre, zname), q.node.outputs)),
                 (q.node, relu))


def _integer_to_float(v: _View, n: Node) -> Match | None:
    """``MatMulInteger -> Cast(float) -> Mul(scale)`` (``ConvInteger`` likewise; quantize_dynamic's form)
    as one node whose kernel scales the int32 sums: the int32 result never goes to memory, and the bias
    Add after it fuses as an epilogue."""
    cast = v.only_reader(n.outputs[0]) if len(n.outputs) == 1 else None
    if cast is None or cast.op_type != "Cast" or cast.domain or int(cast.attrs.get("to", 0)) != 1:
        return None
    mul = v.only_reader(cast.outputs[0])
    if mul is None or mul.op_type != "Mul" or mul.domain or len(mul.inputs) != 2:
        return None
    scale = mul.inputs[1] if mul.inputs[0] == cast.outputs[0] else mul.inputs[0]
    info = v.g.value_info.get(scale)
    shape = v.const(scale).shape if v.const(scale) is not None else (info.shape if info is not None else None)
    if shape is None or not all(isinstance(d, int) for d in shape) or int(np.prod(shape)) != 1:
        return None  # per-column scales: the Mul stays (its broadcasting is the model's)
    ins = tuple(n.inputs) + ("",) * (4 - len(n.inputs)) + (scale,)
    op = "CuvilMatMulIntegerToFloat" if n.op_type == "MatMulInteger" else "CuvilConvIntegerToFloat"
    return Match((Node(op, n.name, ins, mul.outputs, dict(n.attrs)),), (cast,), at=mul)  # after its scale


def _dq_to_q(v: _View, n: Node) -> tuple[_Q, list[_Q]] | None:
    """The Q that alone reads ``n``'s output and the DQs of its data inputs (of every input for Concat, Add and
    Mul; else the first), all per tensor and of one 8-bit type; else None."""
    if len(n.outputs) != 1:
        return None
    q = v.q(v.only_reader(n.outputs[0]), "QuantizeLinear")
    if q is None or not q.per_tensor or q.dtype not in ("uint8", "int8"):
        return None
    data = [x for x in n.inputs if x]
    ins = [v.dq_of(x) for x in (data if n.op_type in ("Concat", "Add", "Mul") else data[:1])]
    if any(d is None or not d.per_tensor or d.dtype != q.dtype for d in ins):
        return None
    return q, ins  # type: ignore[return-value]


def _move(v: _View, n: Node) -> Match | None:
    """DQ -> data movement (or a Concat) -> Q, all of one scale and zero point: the node on the 8-bit codes
    (MaxPool as ``CuvilMaxPool8``, vectorised for 8-bit values)."""
    io = _dq_to_q(v, n)
    if io is None:
        return None
    q, ins = io
    if not all(d.same(q) for d in ins) or (n.op_type == "MaxPool" and len([o for o in n.outputs if o]) != 1):
        return None
    op = "CuvilMaxPool8" if n.op_type == "MaxPool" else n.op_type
    codes = tuple(d.node.inputs[0] for d in ins) + tuple(n.inputs[len(ins):])
    return Match((replace(n, op_type=op, inputs=codes, outputs=q.node.outputs),), (q.node,))


def _qlinear(v: _View, n: Node) -> Match | None:
    """DQ -> Add / Mul / Sigmoid / LeakyRelu / GlobalAveragePool / Softmax / Concat (of other scales) -> Q:
    onnxruntime's QLinear operator (:mod:`cuvil.graph.ops.quant.ms`)."""
    io = _dq_to_q(v, n)
    if io is None:
        return None
    q, ins = io
    qs = (q.node.inputs[1], q.node.inputs[2] if len(q.node.inputs) > 2 else "")
    trip = [(i[0], i[1], i[2] if len(i) > 2 else "") for i in (d.node.inputs for d in ins)]
    if n.op_type == "Concat":
        new = Node("QLinearConcat", n.name, qs + tuple(x for t in trip for x in t), q.node.outputs, dict(n.attrs))
    elif n.op_type in ("Add", "Mul"):
        if len(trip) != 2:
            return None
        new = Node(_QLINEAR[n.op_type], n.name, trip[0] + trip[1] + qs, q.node.outputs)
    else:
        attrs = {**n.attrs, "opset": v.g.opset} if n.op_type == "Softmax" else dict(n.attrs)
        new = Node(_QLINEAR[n.op_type], n.name, trip[0] + qs, q.node.outputs, attrs)
    return Match((new,), (q.node,))


PATTERNS = (  # in the order they are tried
    Pattern("DQ -> unary float ops -> Q: one lookup in a 256-code table", TABLE_OPS, match_table),
    Pattern("DQ -> Conv / Gemm / MatMul [-> Relu] [-> Q]: an integer contraction", {"Conv", "Gemm", "MatMul"},
            _contraction),
    Pattern("MatMulInteger / ConvInteger -> Cast -> Mul(scale): scaled in the epilogue",
            {"MatMulInteger", "ConvInteger"}, _integer_to_float),
    Pattern("DQ -> data movement -> Q of one scale: on the 8-bit codes", _MOVES | {"Concat"}, _move),
    Pattern("DQ -> Add / Mul / Sigmoid / ... -> Q: a QLinear operator", {*_QLINEAR, "Concat"}, _qlinear),
)


def integer_contractions(session_or_graph: Any) -> dict[str, list[str]]:
    """The contractions a session (``cuvil.onnx.InferenceSession``) or an optimized graph runs, by kind:
    ``{"integer": [node names], "float": [node names]}``; a quantized model should have no "float" ones."""
    g = getattr(session_or_graph, "_graph", session_or_graph)
    out: dict[str, list[str]] = {"integer": [], "float": []}
    for n in g.nodes:
        if n.domain:
            continue
        if n.op_type in INTEGER_CONTRACTIONS:
            out["integer"].append(n.name)
        elif n.op_type in FLOAT_CONTRACTIONS:
            out["float"].append(n.name)
    return out
