"""``cuvil.llm.load``: a model from where users keep it, with the weights they ask for, compiled for this
CPU.

Where from: a Hugging Face model object or folder (``config.json``), an onnxruntime-genai folder
(``genai_config.json``), a GGUF file, or :class:`~cuvil.llm.weights.DecoderWeights`.  Which weights:
``"as-stored"`` keeps the file's (a GGUF Q4_0 stays 4-bit, an HF checkpoint float32), ``"fp32"``
dequantizes everything, ``"int4"`` and ``"int8"`` quantize the float weights by round-to-nearest
(:func:`cuvil.llm.quantize.quantize`) and keep the weights that already are 4- or 8-bit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from cuvil.errors import ArgumentError, ModelError
from cuvil.llm.runtime import Generator
from cuvil.llm.weights import DecoderWeights, Dense

__all__ = ["WEIGHTS", "load", "read"]

WEIGHTS = ("as-stored", "fp32", "int4", "int8")


def read(source: Any, max_context: int | None = None) -> DecoderWeights:
    """The weights of ``source`` as stored (see the module's docstring for the sources)."""
    if isinstance(source, DecoderWeights):
        return source
    if isinstance(source, (str, os.PathLike)):
        p = Path(source)
        if not p.exists():
            raise ModelError(f"{p}: no such file or folder")
        if p.is_file() and p.suffix.lower() == ".gguf":
            from cuvil.llm.gguf import from_gguf

            return _context(from_gguf(p), max_context)
        if p.is_dir() and (p / "genai_config.json").exists():
            from cuvil.llm.onnx_genai import from_onnx_genai

            return _context(from_onnx_genai(p), max_context)
        if p.is_dir() and (p / "config.json").exists():
            from cuvil.llm.hf import from_hf

            return from_hf(p, max_context=max_context)
        raise ModelError(f"{p}: not a GGUF file (.gguf), an onnxruntime-genai folder (genai_config.json) or a "
                         "Hugging Face folder (config.json)")
    if type(source).__module__.startswith("transformers"):
        from cuvil.llm.hf import from_hf

        return from_hf(source, max_context=max_context)
    raise ArgumentError(f"cuvil.llm.load takes a path, a transformers model or DecoderWeights; got "
                        f"{type(source).__name__}")


def _context(w: DecoderWeights, max_context: int | None) -> DecoderWeights:
    if max_context is None:
        return w
    from dataclasses import replace

    return replace(w, config=replace(w.config, max_context=int(max_context)))


def convert(w: DecoderWeights, weights: str = "as-stored", group: int = 32) -> DecoderWeights:
    """``w`` with the weights asked for (see the module's docstring): int4 in groups of ``group``, int8 with
    a scale per row."""
    if weights not in WEIGHTS:
        raise ArgumentError(f"weights={weights!r}: choose one of {', '.join(WEIGHTS)}")
    if weights == "as-stored":
        return w
    if weights == "fp32":
        return w.with_linears(lambda _n, x: x if isinstance(x, Dense) else Dense(x.dequantize()))
    from cuvil.llm.quantize import quantize

    return quantize(w, bits=4, group=group) if weights == "int4" else quantize(w, bits=8)


def load(source: Any, weights: str = "as-stored", *, context: int | None = None, chunk: int = 64,
         group: int = 32, kv_cache: str = "float32", target: Any = None) -> Generator:
    """A :class:`~cuvil.llm.runtime.Generator` for ``source`` with ``weights`` ("as-stored", "fp32",
    "int4", "int8"; int4 quantizes in groups of ``group``) and a cache of ``context`` positions
    (``kv_cache``: "float32" or "int8")."""
    w = convert(read(source, max_context=context), weights, group)
    return Generator(w, context=context, chunk=chunk, target=target, kv_cache=kv_cache)
