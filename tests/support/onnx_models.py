"""The ONNX model builders now live in :mod:`cuvil.models.zoo`; this module re-exports them for the tests and
``benchmarks/models.py``."""

from cuvil.models.zoo import (  # noqa: F401
    MODELS,
    _Builder,
    bert_encoder_model,
    mlp,
    mobilenet_v2,
    mobilenet_v2_block_model,
    resnet18,
    resnet_block_model,
)


def float_model(nodes, inputs, outputs, inits):
    """A float32 opset-17 model of ``nodes``: ``inputs`` as (name, shape) pairs, ``outputs`` by name (shapes
    left to inference), ``inits`` as {name: array} initializers."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
                          [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
