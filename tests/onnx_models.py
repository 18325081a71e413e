"""The ONNX model builders now live in :mod:`cuvil.zoo`; this module re-exports them for the tests and
``benchmarks/models.py``."""

from cuvil.zoo import (  # noqa: F401
    MODELS,
    _Builder,
    bert_encoder_model,
    mlp,
    mobilenet_v2,
    mobilenet_v2_block_model,
    resnet18,
    resnet_block_model,
)
