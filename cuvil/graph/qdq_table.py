"""A DQ -> float chain -> Q run as one lookup in a 256-entry table.

Between two quantized tensors, ``quantize_static`` leaves the float ops it has no QLinear form for
(BERT's GELU: ``DQ -> Div(sqrt 2) -> Erf -> Q``) as element-wise float arithmetic between a
DequantizeLinear and a QuantizeLinear.  When every op of the chain is unary (or binary with a scalar
constant), its output code depends only on the input's 8-bit code, so the whole chain is a table of
256 codes computed when compiling: one byte read and one byte written per element at run time instead
of a float kernel (dequantize, divide, erf), a QuantizeLinear kernel and the QLinear kernels of ``+ 1`` and
``* 0.5`` (registry BERT-base ``full``, QDQ U8S8, 1 thread, cuvil.graph.profile: 12 x (0.27 + 0.10 + 0.06
+ 0.04) = 5.6 ms of kernels per run become 12 lookups, 1.3 ms).  A chain of one multiply or add stays a
QLinear kernel (vectorised arithmetic beats a gather there).

The table evaluates the chain as ONNX defines it in float32: the dequantized value
``float32(code - zero) * scale``, float32 arithmetic with the constants, Erf / Tanh / Sigmoid computed in
float64 and rounded once to float32 (within half an ulp of the exact value; a float32 library can be an
ulp away, which moves an output code only when the value lies that close to a rounding boundary), then
QuantizeLinear (float32 division, round half to even, saturation).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cuvil.graph.ir import Node
from cuvil.graph.rewrite import Match

_UNARY = {
    "Erf": lambda x: np.array([math.erf(float(t)) for t in x], np.float64),
    "Tanh": lambda x: np.tanh(x.astype(np.float64)),
    "Sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x.astype(np.float64))),
    "Relu": lambda x: np.maximum(x, np.float32(0)),
    "Neg": lambda x: -x,
    "Abs": np.abs,
}
_TRANSCENDENTAL = frozenset({"Erf", "Tanh", "Sigmoid"})  # a table always pays for these
_BINARY = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide}
TABLE_OPS = frozenset(_UNARY) | frozenset(_BINARY)  # the ops a chain is made of
_RANGE = {"uint8": (0, 255), "int8": (-128, 127)}


def _scalar(v: Any, name: str) -> np.float32 | None:
    """``name`` as one float32 constant: an initializer, or a DQ of a one-value initializer (``+ 1`` in a
    QDQ GELU), dequantized as DequantizeLinear does; else None."""
    dq = v.dq_of(name)
    if dq is not None:
        c = v.const(dq.node.inputs[0])
        if c is None or c.size != 1 or not dq.per_tensor or dq.dtype not in _RANGE:
            return None
        return np.float32(np.float32(int(c.reshape(-1)[0]) - dq.zp) * np.float32(dq.scale.reshape(-1)[0]))
    c = v.const(name)
    if c is None or c.dtype != np.float32 or c.size != 1:
        return None
    return np.float32(c.reshape(-1)[0])


def _codes_input(v: Any, n: Node) -> Any:
    """The DQ (per tensor, 8-bit) of a run-time tensor that ``n`` reads, else None."""
    for x in n.inputs:
        d = v.dq_of(x) if x else None
        if d is not None and v.const(d.node.inputs[0]) is None:
            return d if d.per_tensor and d.dtype in _RANGE else None
    return None


def _requant(q: Any) -> Any:
    """A Q -> DQ pair inside a chain as a step: quantized, then dequantized."""
    s, z = np.float32(q.scale.reshape(-1)[0]), q.zp
    return lambda x: (_quantize(x, s, z, q.dtype).astype(np.int64) - z).astype(np.float32) * s


def _step(v: Any, n: Node, src: str) -> Any:
    """Node ``n`` (reading ``src``) as a function of float32 arrays, or None if it is not one the table
    takes (a unary op, or a binary op with a float32 scalar constant on the other side)."""
    if n.domain or len(n.outputs) != 1 or not n.outputs[0]:
        return None
    if n.op_type in _UNARY and len(n.inputs) == 1:
        f = _UNARY[n.op_type]
        return lambda x: f(x).astype(np.float32)
    if n.op_type in _BINARY and len(n.inputs) == 2 and n.inputs.count(src) == 1:
        other = n.inputs[1] if n.inputs[0] == src else n.inputs[0]
        c, g = _scalar(v, other), _BINARY[n.op_type]
        if c is None:
            return None
        if n.inputs[0] == src:
            return lambda x: g(x, c).astype(np.float32)
        return lambda x: g(c, x).astype(np.float32)
    return None


def _quantize(x: np.ndarray, scale: np.float32, zero: int, qtype: str) -> np.ndarray:
    lo, hi = _RANGE[qtype]
    with np.errstate(all="ignore"):
        q = np.rint(x / scale).astype(np.float64) + zero
    return np.clip(np.nan_to_num(q, nan=0.0), lo, hi).astype(qtype)


def match_table(v: Any, n: Node) -> Match | None:
    """``n`` as the first float op of a ``DQ -> chain -> Q`` (see the module docstring; ``v`` is
    :class:`cuvil.graph.qdq._View`): a ``CuvilQLinearLookup`` node (the codes, the table) writing the
    last Q's output, the rest of the chain consumed; None when the chain does not fit.  A Q -> DQ
    pair of one scale inside the chain is a step of it (rounded there, as the model does), so
    ``Erf -> Q -> DQ -> Add(1) -> Q`` is one table too."""
    if n.domain or n.op_type not in TABLE_OPS:
        return None
    dx = _codes_input(v, n)
    if dx is None:
        return None
    steps: list[Any] = []
    chain: list[Node] = []
    best = None
    src, cur = dx.node.outputs[0], n
    while True:
        f = _step(v, cur, src)
        if f is None:
            break
        steps.append(f)
        chain.append(cur)
        nxt = v.only_reader(cur.outputs[0])
        q = v.q(nxt, "QuantizeLinear")
        if q is None:
            if nxt is None:
                break
            src, cur = cur.outputs[0], nxt
            continue
        if not q.per_tensor or q.dtype not in _RANGE:
            break
        best = (list(steps), list(chain), q)
        dq = v.q(v.only_reader(q.node.outputs[0]), "DequantizeLinear")
        after = v.only_reader(dq.node.outputs[0]) if dq is not None and dq.same(q) else None
        if after is None:
            break
        steps.append(_requant(q))
        chain += [q.node, dq.node]
        src, cur = dq.node.outputs[0], after
    if best is None:
        return None
    steps, chain, q = best
    ops = [c.op_type for c in chain if c.op_type not in ("QuantizeLinear", "DequantizeLinear")]
    if len(ops) < 2 and not _TRANSCENDENTAL.intersection(ops):
        return None  # one multiply or add: its vectorised QLinear kernel beats a gather (BERT's 128x768 scale
        # of Q and K: QLinearMul 16 us, a lookup 29 us)
    lo = _RANGE[dx.dtype][0]
    x = (np.arange(lo, lo + 256, dtype=np.int64) - dx.zp).astype(np.float32) * np.float32(dx.scale.reshape(-1)[0])
    with np.errstate(all="ignore"):
        for f in steps:
            x = f(x)
    table = _quantize(x, np.float32(q.scale.reshape(-1)[0]), q.zp, q.dtype)
    name = n.outputs[0] + ".table"
    while name in v.inits:
        name += "_"
    v.inits[name] = table
    return Match((Node("CuvilQLinearLookup", n.name, (dx.node.inputs[0], name), q.node.outputs),), (*chain[1:], q.node))
