"""Model builders: small PyTorch-like ONNX models made with onnx.helper, seeded random weights.

Used by ``cuvil bench`` (whole models beside onnxruntime), the tests and ``benchmarks/models.py``
(torch is not needed).  Each builder returns an ``onnx.ModelProto``; the graphs use the op patterns
PyTorch's exporter emits (BatchNorm after Conv, Clip as ReLU6, Shape -> Gather -> Unsqueeze -> Concat
-> Reshape for dynamic reshapes, erf GELU spelled as Div/Erf/Add/Mul).

    from cuvil.models.zoo import resnet18
    sess = cuvil.onnx.InferenceSession(resnet18(224).SerializeToString())

:data:`MODELS` names the whole models ``cuvil bench`` runs, each with its inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from onnx import TensorProto, helper, numpy_helper


class _Builder:
    """Collects nodes and seeded random initializers; ``model()`` makes the ModelProto."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.nodes: list = []
        self.inits: list = []
        self.n = 0

    def name(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}_{self.n}"

    def weight(self, shape: tuple[int, ...], scale: float | None = None, positive: bool = False,
               dtype: type = np.float32) -> str:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        s = scale if scale is not None else 1.0 / np.sqrt(fan_in)
        a = self.rng.standard_normal(shape) * s
        if positive:
            a = np.abs(a) + 0.5
        name = self.name("w")
        self.inits.append(numpy_helper.from_array(a.astype(dtype), name))
        return name

    def const(self, value: np.ndarray) -> str:
        name = self.name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs: object) -> str | list[str]:
        outs = [self.name(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.name(op_type), **attrs))
        return outs[0] if n_out == 1 else outs

    # -- layers ---------------------------------------------------------------------
    def conv_bn(self, x: str, cin: int, cout: int, k: int, stride: int = 1, group: int = 1, act: str | None = "relu"
                ) -> str:
        w = self.weight((cout, cin // group, k, k))
        y = self.op("Conv", [x, w], kernel_shape=[k, k], strides=[stride, stride], pads=[k // 2] * 4, group=group)
        y = self.op("BatchNormalization", [y, self.weight((cout,), positive=True), self.weight((cout,), 0.1),
                                           self.weight((cout,), 0.1), self.weight((cout,), positive=True)],
                    epsilon=1e-5)
        if act == "relu":
            y = self.op("Relu", [y])
        elif act == "relu6":
            y = self.op("Clip", [y, self.const(np.array(0.0, np.float32)), self.const(np.array(6.0, np.float32))])
        return y

    def linear(self, x: str, din: int, dout: int) -> str:
        y = self.op("MatMul", [x, self.weight((din, dout))])
        return self.op("Add", [y, self.weight((dout,), 0.1)])

    def layer_norm(self, x: str, d: int) -> str:
        return self.op("LayerNormalization", [x, self.weight((d,), positive=True), self.weight((d,), 0.1)],
                       axis=-1, epsilon=1e-12)

    def model(self, inputs: list, outputs: list, opset: int = 17) -> object:
        g = helper.make_graph(self.nodes, "model", inputs, outputs, initializer=self.inits)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def resnet_block_model(size: int = 32, seed: int = 0) -> object:
    """Stem conv 7x7/2 + BN + ReLU, MaxPool 3x3/2, a basic block, a downsampling block with a 1x1
    projection, GlobalAveragePool, Flatten, Gemm: ResNet-18's layer types at small sizes."""
    b = _Builder(seed)
    y = b.conv_bn("x", 3, 16, 7, stride=2)
    y = b.op("MaxPool", [y], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    h = b.conv_bn(y, 16, 16, 3)
    h = b.conv_bn(h, 16, 16, 3, act=None)
    y = b.op("Relu", [b.op("Add", [h, y])])
    h = b.conv_bn(y, 16, 32, 3, stride=2)
    h = b.conv_bn(h, 32, 32, 3, act=None)
    proj = b.conv_bn(y, 16, 32, 1, stride=2, act=None)
    y = b.op("Relu", [b.op("Add", [h, proj])])
    y = b.op("Flatten", [b.op("GlobalAveragePool", [y])], axis=1)
    y = b.op("Gemm", [y, b.weight((10, 32)), b.weight((10,), 0.1)], transB=1)
    b.nodes[-1].output[0] = "logits"
    return b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, size, size])],
                   [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])])


def mobilenet_v2_block_model(size: int = 28, seed: int = 1) -> object:
    """Two MobileNetV2 inverted residual blocks (1x1 expand, ReLU6, depthwise 3x3, 1x1 project, residual)."""
    b = _Builder(seed)
    y = b.conv_bn("x", 3, 16, 3, stride=2, act="relu6")
    for stride, cin, cout in ((1, 16, 16), (2, 16, 24)):
        h = b.conv_bn(y, cin, cin * 6, 1, act="relu6")
        h = b.conv_bn(h, cin * 6, cin * 6, 3, stride=stride, group=cin * 6, act="relu6")
        h = b.conv_bn(h, cin * 6, cout, 1, act=None)
        y = b.op("Add", [h, y]) if stride == 1 and cin == cout else h
    y = b.op("GlobalAveragePool", [y])
    b.nodes[-1].output[0] = "features"
    return b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])],
                   [helper.make_tensor_value_info("features", TensorProto.FLOAT, [1, 24, 1, 1])])


def bert_encoder_model(layers: int = 2, hidden: int = 256, heads: int = 4, seq: int = 128, seed: int = 2) -> object:
    """A BERT-style encoder: per layer, multi-head self-attention (Q, K, V projections, scaled dot
    product, softmax over an additive mask), residual + LayerNorm, a 4x FFN with erf GELU, residual +
    LayerNorm.  The head split reads the batch size through Shape -> Gather -> Unsqueeze -> Concat as
    PyTorch exports it."""
    b = _Builder(seed)
    dh = hidden // heads
    x = "x"
    mask = b.op("Mul", [b.op("Sub", [b.const(np.array(1.0, np.float32)), "mask"]),
                        b.const(np.array(-10000.0, np.float32))])
    mask = b.op("Unsqueeze", [mask, b.const(np.array([1, 2], np.int64))])  # [B, 1, 1, S]
    batch = b.op("Unsqueeze", [b.op("Gather", [b.op("Shape", [x]), b.const(np.array(0, np.int64))], axis=0),
                               b.const(np.array([0], np.int64))])
    heads_shape = b.op("Concat", [batch, b.const(np.array([-1, heads, dh], np.int64))], axis=0)
    merge_shape = b.op("Concat", [batch, b.const(np.array([-1, hidden], np.int64))], axis=0)
    for _ in range(layers):
        def split(t: str) -> str:
            return b.op("Transpose", [b.op("Reshape", [t, heads_shape])], perm=[0, 2, 1, 3])

        q, k, v = (split(b.linear(x, hidden, hidden)) for _ in range(3))
        kt = b.op("Transpose", [k], perm=[0, 1, 3, 2])
        scores = b.op("Div", [b.op("MatMul", [q, kt]), b.const(np.array(np.sqrt(dh), np.float32))])
        probs = b.op("Softmax", [b.op("Add", [scores, mask])], axis=-1)
        ctx = b.op("Reshape", [b.op("Transpose", [b.op("MatMul", [probs, v])], perm=[0, 2, 1, 3]), merge_shape])
        x = b.layer_norm(b.op("Add", [b.linear(ctx, hidden, hidden), x]), hidden)
        h = b.linear(x, hidden, 4 * hidden)
        gelu = b.op("Mul", [b.op("Mul", [h, b.op("Add", [b.op("Erf", [b.op("Div", [h, b.const(
            np.array(np.sqrt(2.0), np.float32))])]), b.const(np.array(1.0, np.float32))])]),
            b.const(np.array(0.5, np.float32))])
        x = b.layer_norm(b.op("Add", [b.linear(gelu, 4 * hidden, hidden), x]), hidden)
    b.nodes[-1].output[0] = "hidden"
    return b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", seq, hidden]),
                    helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["batch", seq])],
                   [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", seq, hidden])])


def resnet18(size: int = 224, seed: int = 0) -> object:
    """ResNet-18: 7x7/2 stem, max pool, four stages of two basic blocks (64, 128, 256, 512), avg pool, FC."""
    b = _Builder(seed)
    y = b.conv_bn("x", 3, 64, 7, stride=2)
    y = b.op("MaxPool", [y], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for k in range(2):
            s = stride if k == 0 else 1
            h = b.conv_bn(y, cin, cout, 3, stride=s)
            h = b.conv_bn(h, cout, cout, 3, act=None)
            short = b.conv_bn(y, cin, cout, 1, stride=s, act=None) if (s != 1 or cin != cout) else y
            y = b.op("Relu", [b.op("Add", [h, short])])
            cin = cout
    y = b.op("Flatten", [b.op("GlobalAveragePool", [y])], axis=1)
    y = b.op("Gemm", [y, b.weight((1000, 512)), b.weight((1000,), 0.1)], transB=1)
    b.nodes[-1].output[0] = "logits"
    return b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])],
                   [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 1000])])


def mobilenet_v2(size: int = 224, seed: int = 1) -> object:
    """MobileNetV2 (width 1.0): inverted residual blocks with ReLU6, then 1x1 to 1280, avg pool, FC."""
    b = _Builder(seed)
    y = b.conv_bn("x", 3, 32, 3, stride=2, act="relu6")
    cin = 32
    for t, c, n, s in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                       (6, 160, 3, 2), (6, 320, 1, 1)):
        for k in range(n):
            stride = s if k == 0 else 1
            h = b.conv_bn(y, cin, cin * t, 1, act="relu6") if t != 1 else y
            h = b.conv_bn(h, cin * t, cin * t, 3, stride=stride, group=cin * t, act="relu6")
            h = b.conv_bn(h, cin * t, c, 1, act=None)
            y = b.op("Add", [h, y]) if stride == 1 and cin == c else h
            cin = c
    y = b.conv_bn(y, cin, 1280, 1, act="relu6")
    y = b.op("Flatten", [b.op("GlobalAveragePool", [y])], axis=1)
    y = b.op("Gemm", [y, b.weight((1000, 1280)), b.weight((1000,), 0.1)], transB=1)
    b.nodes[-1].output[0] = "logits"
    return b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])],
                   [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 1000])])


def mlp(batch: int = 64, dims: tuple[int, ...] = (784, 1024, 1024, 10), seed: int = 3) -> object:
    """A multi-layer perceptron: MatMul + Add per layer, ReLU between layers."""
    b = _Builder(seed)
    y = "x"
    for k, (din, dout) in enumerate(zip(dims, dims[1:])):
        y = b.linear(y, din, dout)
        if k < len(dims) - 2:
            y = b.op("Relu", [y])
    b.nodes[-1].output[0] = "logits"
    return b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, dims[0]])],
                   [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, dims[-1]])])


@dataclass(frozen=True)
class ZooModel:
    """A model of the zoo: how to build it and inputs to run it on."""

    name: str
    build: Callable[[], Any]  # -> onnx.ModelProto
    feeds: Callable[[np.random.Generator], dict[str, np.ndarray]]
    note: str = ""


def _image(size: int) -> Callable[[np.random.Generator], dict[str, np.ndarray]]:
    return lambda rng: {"x": rng.standard_normal((1, 3, size, size)).astype(np.float32)}


MODELS: dict[str, ZooModel] = {m.name: m for m in (
    ZooModel("resnet18", lambda: resnet18(224), _image(224), "ResNet-18, 224x224, batch 1"),
    ZooModel("mobilenet_v2", lambda: mobilenet_v2(224), _image(224), "MobileNetV2 (width 1.0), 224x224, batch 1"),
    ZooModel("bert", lambda: bert_encoder_model(), lambda rng: {
        "x": rng.standard_normal((1, 128, 256)).astype(np.float32), "mask": np.ones((1, 128), np.float32)},
        "BERT-style encoder: 2 layers, hidden 256, 4 heads, sequence 128"),
    ZooModel("mlp", lambda: mlp(), lambda rng: {"x": rng.standard_normal((64, 784)).astype(np.float32)},
             "MLP 784-1024-1024-10, batch 64"),
)}
