"""The semantics of a quantized ONNX file, which results are checked against: never a vendor's fused kernels.

onnxruntime's fused integer kernels (QLinearConv, QLinearMatMul, MatMulInteger, ConvInteger, com.microsoft
QGemm, and the QLinearConv / QLinearMatMul its graph optimizer makes of DQ -> Conv / MatMul -> Q) take
their u8 x s8 products through MLAS, which on x86 CPUs without VNNI multiplies with ``vpmaddubsw``: each
pair of products is added into a *saturating* 16-bit sum, so their results there lie a few output steps
from the semantics (3-11 steps measured on a Zen 3).  The semantics are:

- for a file in QDQ form (DequantizeLinear -> float op -> QuantizeLinear): the file itself, run by
  onnxruntime with every graph optimization off (:func:`semantics_session`), so that no QDQ group becomes
  a fused integer kernel and the float ops run as written;
- for a file with integer operators (a QOperator file, com.microsoft's QLinear operators, the
  MatMulInteger / ConvInteger of ``quantize_dynamic``): the same model with each of them written in the
  plain operators that define it (:func:`semantics_model`: DQ -> float operator -> Q, or exact integer
  arithmetic), run the same way.

tests/support/quant_reference.py and ``cuvil bench --registry --quant`` (its ``sem`` columns) compare against them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


def _ort() -> Any:
    import onnxruntime

    return onnxruntime


def semantics_session(model: str | bytes) -> Any:
    """onnxruntime with every graph optimization off: Q / DQ run as the element-wise operators ONNX defines
    around float Conv / MatMul / Gemm (no QDQ group fused into an integer kernel)."""
    ort = _ort()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def run_semantics(model: str | bytes, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    return semantics_session(model).run(None, dict(feeds))



class _Rewriter:
    """Builds the nodes that replace one integer operator, naming new values after it."""

    def __init__(self, k: int, ranks: dict[str, int]):
        from onnx import TensorProto, helper

        self.h, self.T, self.k, self.ranks, self.nodes, self.n = helper, TensorProto, k, ranks, [], 0

    def node(self, op: str, inputs: list[str], **attrs: Any) -> str:
        self.n += 1
        out = f"_sem{self.k}_{self.n}"
        self.nodes.append(self.h.make_node(op, inputs, [out], **attrs))
        return out

    def const(self, values: list, dtype: Any) -> str:
        self.n += 1
        out = f"_sem{self.k}_{self.n}"
        t = self.h.make_tensor(out, dtype, [len(values)] if len(values) != 1 else [], values)
        self.nodes.append(self.h.make_node("Constant", [], [out], value=t))
        return out

    def dq(self, x: str, scale: str, zero: str, axis: int = 1) -> str:
        """DequantizeLinear; ``axis`` is the one a scale with one value per slice runs along."""
        return self.node("DequantizeLinear", [x, scale] + ([zero] if zero else []), axis=axis)

    def q(self, y: str, scale: str, zero: str, out: str) -> None:
        self.nodes.append(self.h.make_node("QuantizeLinear", [y, scale] + ([zero] if zero else []), [out]))


def _arg(n: Any, i: int) -> str:
    return n.input[i] if len(n.input) > i else ""


def semantics_model(model: Any) -> bytes:
    """``model`` (an onnx ModelProto) with every operator onnxruntime runs through a fused integer kernel
    rewritten as the plain operators that define it, to run with :func:`semantics_session`:

    - QLinearConv, QLinearMatMul, com.microsoft QGemm / QLinearAdd / QLinearMul / QLinearSigmoid /
      QLinearLeakyRelu / QLinearSoftmax / QLinearGlobalAveragePool / QLinearAveragePool / QLinearConcat ->
      DequantizeLinear of each quantized input (an int32 bias with the scale ``x_scale * w_scale``, QGemm's
      times ``alpha``), the float operator, QuantizeLinear with the output's scale and zero point: the
      QDQ form onnxruntime's quantizer writes for the same quantization;
    - MatMulInteger -> Cast to int32, Sub the zero points, an int32 MatMul: exact (|acc| < 2**31 while
      K < 33000);
    - ConvInteger -> Cast to float, Sub the zero points, a float Conv, Cast to int32 (onnxruntime has no
      integer or double Conv): exact while the partial sums stay below 2**24, and past that within float32's
      relative rounding of the sum (an int32 sum that large is rounded to float32 by the Cast -> Mul that
      follows it in ``quantize_dynamic``'s files anyway).

    Every other node (MaxPool, Reshape, Transpose ... on 8-bit values: exact in any engine) is kept.  An
    integer operator this does not know raises NotImplementedError."""
    import onnx

    model = onnx.ModelProto.FromString(model.SerializeToString())
    g = model.graph
    ranks = {i.name: len(i.dims) for i in g.initializer}
    nodes = []
    for k, n in enumerate(g.node):
        r = _Rewriter(k, ranks)
        if not _rewrite(r, n):
            nodes.append(n)
            continue
        nodes.extend(r.nodes)
    del g.node[:]
    g.node.extend(nodes)
    return model.SerializeToString()


_UNARY = {"QLinearSigmoid": "Sigmoid", "QLinearLeakyRelu": "LeakyRelu", "QLinearSoftmax": "Softmax",
          "QLinearGlobalAveragePool": "GlobalAveragePool", "QLinearAveragePool": "AveragePool"}
_FUSED = {"QLinearConv", "QLinearMatMul", "QGemm", "QLinearAdd", "QLinearMul", "QLinearConcat", "MatMulInteger",
          "ConvInteger", *_UNARY}


def _rewrite(r: _Rewriter, n: Any) -> bool:
    """Append ``n``'s plain form to ``r``; False for a node kept as it is."""
    h, T, op = r.h, r.T, n.op_type
    if op not in _FUSED:
        if op.startswith(("QLinear", "QGemm", "QAttention", "QOrdered", "DynamicQuantizeMatMul")) or "Integer" in op:
            raise NotImplementedError(f"no plain form of the integer operator {op} ({n.name!r})")
        return False
    attrs = {a.name: h.get_attribute_value(a) for a in n.attribute}
    out = n.output[0]
    if op in ("MatMulInteger", "ConvInteger"):
        conv = op == "ConvInteger"
        to = T.FLOAT if conv else T.INT32
        ins = []
        for j in (0, 1):
            v = r.node("Cast", [n.input[j]], to=to)
            zero = _arg(n, j + 2)
            if zero:
                z = r.node("Cast", [zero], to=to)
                # a scalar, or one zero point per output channel (a ConvInteger's weights: [M] -> [M, 1, ...]),
                # per row (a MatMulInteger's a: [M] -> [M, 1]) or per column (its b: broadcasts as it is)
                shape = [-1] + [1] * (r.ranks.get(n.input[1], 4) - 1) if conv and j == 1 else \
                    [-1, 1] if not conv and j == 0 else None
                if shape is not None:
                    z = r.node("Reshape", [z, r.const(shape, T.INT64)])
                v = r.node("Sub", [v, z])
            ins.append(v)
        if conv:
            r.nodes.append(h.make_node("Cast", [r.node("Conv", ins, **attrs)], [out], to=T.INT32))
        else:
            r.nodes.append(h.make_node("MatMul", ins, [out]))
        return True
    if op == "QLinearConv":
        x, w = r.dq(*n.input[0:3]), r.dq(*n.input[3:6], axis=0)
        ins = [x, w]
        if _arg(n, 8):
            ins.append(r.dq(n.input[8], r.node("Mul", [n.input[1], n.input[4]]), "", axis=0))
        r.q(r.node("Conv", ins, **attrs), n.input[6], _arg(n, 7), out)
    elif op == "QLinearMatMul":
        a, b = r.dq(*n.input[0:3], axis=-2), r.dq(*n.input[3:6], axis=-1)
        r.q(r.node("MatMul", [a, b]), n.input[6], _arg(n, 7), out)
    elif op == "QGemm":
        alpha = float(attrs.get("alpha", 1.0))
        a = r.dq(*n.input[0:3])
        b = r.dq(*n.input[3:6], axis=0 if attrs.get("transB", 0) else 1)
        ins = [a, b]
        if _arg(n, 6):
            scale = r.node("Mul", [r.node("Mul", [n.input[1], n.input[4]]), r.const([alpha], T.FLOAT)])
            ins.append(r.dq(n.input[6], scale, "", axis=0))
        kw = {"alpha": alpha, "transA": int(attrs.get("transA", 0)), "transB": int(attrs.get("transB", 0))}
        y = r.node("Gemm", ins, **kw)
        if _arg(n, 7):
            r.q(y, n.input[7], _arg(n, 8), out)
        else:  # no y_scale: a float output
            r.nodes.append(h.make_node("Identity", [y], [out]))
    elif op in ("QLinearAdd", "QLinearMul"):
        a, b = r.dq(*n.input[0:3]), r.dq(n.input[3], n.input[4], _arg(n, 5))
        r.q(r.node(op[7:], [a, b]), n.input[6], _arg(n, 7), out)
    elif op == "QLinearConcat":
        parts = [r.dq(*n.input[i:i + 3]) for i in range(2, len(n.input), 3)]
        r.q(r.node("Concat", parts, axis=attrs["axis"]), n.input[0], _arg(n, 1), out)
    else:
        kw = dict(attrs)
        if op == "QLinearSoftmax":
            if int(kw.pop("opset", 13)) < 13 and int(kw.get("axis", -1)) != -1:
                raise NotImplementedError(f"{n.name!r}: Softmax before opset 13 over several axes")
        if kw.pop("channels_last", 0):
            raise NotImplementedError(f"{n.name!r}: {op} with channels_last=1")
        x = r.dq(n.input[0], n.input[1], _arg(n, 2))
        r.q(r.node(_UNARY[op], [x], **kw), n.input[3], _arg(n, 4), out)
    return True


def registry_semantics(model: str, config: str, scheme: str) -> str | bytes:
    """The semantics of ``cuvil.models.registry.quantize.quantize(model, config, scheme)``, to run with
    :func:`semantics_session`: a static QDQ file itself; for the QOperator and the dynamic schemes the file
    rewritten by :func:`semantics_model`.  (Not the QDQ file onnxruntime's quantizer writes from the same
    float model: on BERT that one quantizes the last LayerNorm's weight and output and gives the CLS slice
    its input's scale, which the QOperator file does not.)"""
    import onnx

    from cuvil.models.registry import quantize

    path = quantize.quantize(model, config, scheme)
    sch = quantize.get_scheme(scheme)
    if sch.method == "static" and sch.fmt == "qdq":
        return path
    return semantics_model(onnx.load(path))
