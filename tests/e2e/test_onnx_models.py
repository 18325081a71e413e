"""Whole models through cuvil.onnx.InferenceSession, compared with onnxruntime and ONNX's shipped outputs.

* The "light" models in the onnx wheel, fed as ONNX's backend runner feeds them (``arange(n) / n``)
  and compared with the shipped output, then again with their ConstantOfShape weights replaced by
  seeded random tensors and a random input, compared with onnxruntime.  Compiling all nine takes
  several minutes (on 2 cores), so the default run covers AlexNet; ``CUVIL_TEST_LIGHT=all``
  runs all nine (``CUVIL_TEST_LIGHT=name,name`` picks some).
* PyTorch-like models built with onnx.helper (tests/support/onnx_models.py): a ResNet-style stack, two
  MobileNetV2 blocks and a 2-layer BERT-style encoder (hidden 256, 4 heads, sequence 128, erf GELU),
  within rtol 1e-3, atol 1e-4 of onnxruntime.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import toolchain

onnx = toolchain.module("onnx")
ort = toolchain.module("onnxruntime")
from onnx import numpy_helper  # noqa: E402
from onnx_models import (  # noqa: E402
    bert_encoder_model,
    mlp,
    mobilenet_v2,
    mobilenet_v2_block_model,
    resnet18,
    resnet_block_model,
)

import cuvil.onnx  # noqa: E402

LIGHT_DIR = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
ALL_LIGHT = ["bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet", "squeezenet",
             "vgg19", "zfnet512"]
_choice = os.environ.get("CUVIL_TEST_LIGHT", "bvlc_alexnet")
LIGHT = ALL_LIGHT if _choice == "all" else [n for n in _choice.split(",") if n]


def _ort_run(model: object, feeds: dict) -> list:
    data = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)


def randomize_weights(model: object, seed: int = 0) -> object:
    """Replace every ConstantOfShape whose shape is an initializer by a seeded random initializer
    (positive where it feeds a BatchNormalization scale or variance)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    rng = np.random.default_rng(seed)
    inits = {t.name: t for t in m.graph.initializer}
    positive = {n.input[k] for n in m.graph.node if n.op_type == "BatchNormalization" for k in (1, 4)
                if len(n.input) > k}
    keep = []
    for n in m.graph.node:
        if n.op_type == "ConstantOfShape" and n.input[0] in inits:
            shape = tuple(int(d) for d in numpy_helper.to_array(inits[n.input[0]]))
            fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 10
            a = rng.standard_normal(shape) / np.sqrt(fan_in)
            if n.output[0] in positive:
                a = np.abs(a) + 0.5
            m.graph.initializer.append(numpy_helper.from_array(a.astype(np.float32), n.output[0]))
            if m.ir_version < 4:  # before IR 4, an initializer is typed by a graph input of the same name
                m.graph.input.append(onnx.helper.make_tensor_value_info(n.output[0], onnx.TensorProto.FLOAT, shape))
        else:
            keep.append(n)
    del m.graph.node[:]
    m.graph.node.extend(keep)
    return m


@pytest.mark.slow
@pytest.mark.parametrize("name", LIGHT)
def test_light_model(name: str) -> None:
    path = os.path.join(LIGHT_DIR, f"light_{name}.onnx")
    sess = cuvil.onnx.InferenceSession(path)
    (inp,) = sess.get_inputs()
    shape = tuple(d if isinstance(d, int) else 1 for d in inp.shape)
    n = int(np.prod(shape))
    x = (np.arange(n).reshape(shape) / n).astype(np.float32)  # what ONNX's backend runner feeds
    (y,) = sess.run(None, {inp.name: x})
    expected = numpy_helper.to_array(onnx.load_tensor(os.path.join(LIGHT_DIR, f"light_{name}_output_0.pb")))
    np.testing.assert_allclose(y, expected, rtol=1e-3, atol=1e-7)

    model = randomize_weights(onnx.load(path))
    sess = cuvil.onnx.InferenceSession(model)
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    (y,) = sess.run(None, {inp.name: x})
    (ref,) = _ort_run(model, {inp.name: x})
    scale = float(np.max(np.abs(ref)))
    assert np.std(ref) > 1e-3 * scale  # random weights: the output is not a constant
    np.testing.assert_allclose(y, ref, rtol=1e-3, atol=1e-4 * scale)  # softmax outputs are ~1e-3


@pytest.mark.parametrize("build, batch", [pytest.param(resnet_block_model, 2, marks=pytest.mark.slow),
                                          (mobilenet_v2_block_model, 1),
                                          pytest.param(bert_encoder_model, 1, marks=pytest.mark.slow)])
def test_pytorch_like_model(build: object, batch: int) -> None:
    model = build()
    onnx.checker.check_model(model)
    sess = cuvil.onnx.InferenceSession(model)
    rng = np.random.default_rng(3)
    feeds = {}
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) else batch for d in i.shape]
        feeds[i.name] = ((rng.random(shape) > 0.2).astype(np.float32) if i.name == "mask"
                         else rng.standard_normal(shape).astype(np.float32))
    got = sess.run(None, feeds)
    ref = _ort_run(model, feeds)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype
        np.testing.assert_allclose(g, r, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("build", [pytest.param(lambda: resnet18(size=64), marks=pytest.mark.slow),
                                   pytest.param(lambda: mobilenet_v2(size=64), marks=pytest.mark.slow), mlp],
                         ids=["resnet18", "mobilenet_v2", "mlp"])
def test_whole_model(build: object) -> None:
    # every layer of ResNet-18 and MobileNetV2 (at 64x64 to keep compile and run short; benchmarks/models.py
    # runs them at 224x224) and an MLP, BatchNorm folded, weights packed at compile time
    model = build()
    onnx.checker.check_model(model)
    sess = cuvil.onnx.InferenceSession(model)
    (inp,) = sess.get_inputs()
    x = np.random.default_rng(4).standard_normal(inp.shape).astype(np.float32)
    (got,) = sess.run(None, {inp.name: x})
    (ref,) = _ort_run(model, {inp.name: x})
    np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-4 * max(1.0, float(np.abs(ref).max())))
