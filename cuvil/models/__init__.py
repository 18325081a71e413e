"""Models to compile, kept out of the compiler: nothing under ``cuvil/`` outside the tools (``cuvil.cli``,
``cuvil.bench``) imports this package, and ``import cuvil`` does not load it.

- :mod:`cuvil.models.zoo`: small PyTorch-like ONNX models written with onnx.helper (needs onnx only);
- :mod:`cuvil.models.registry`: real architectures in torch.nn and Hugging Face transformers, exported to
  ONNX; torch is imported only when a model is built (``pip install cuvil[torch]``);
- :mod:`cuvil.models.resolve`: the one way a model name on the command line becomes an ONNX file and
  inputs (a file, a zoo name, ``light_<name>`` of the onnx wheel, a registry name).

This ``__init__`` imports nothing: each submodule loads on first use.
"""
