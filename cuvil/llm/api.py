"""``cuvil.llm.load``: a model from where users keep it, with the weights they ask for, compiled for this
CPU.

Where from: a Hugging Face model object or folder (``config.json``), an onnxruntime-genai folder
(``genai_config.json``), a GGUF file, or :class:`~cuvil.llm.weights.DecoderWeights`.  Which weights:
``"as-stored"`` keeps the file's (a GGUF Q4_0 stays 4-bit, an HF checkpoint float32), ``"fp32"``
dequantizes everything, ``"int4"`` and ``"int8"`` quantize the float weights by round-to-nearest
(:func:`cuvil.llm.quantize.quantize`, as each tensor is read: a model never sits in memory as float32)
and keep the projections already in that form (symmetric 4-bit in the asked groups, 8-bit per row).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from cuvil.errors import ArgumentError, ModelError
from cuvil.llm.runtime import Generator
from cuvil.llm.weights import Q4, Q8, DecoderWeights, Dense, Weight

__all__ = ["WEIGHTS", "load", "read"]

WEIGHTS = ("as-stored", "fp32", "int4", "int8")


def read(source: Any, max_context: int | None = None, *,
         transform: Callable[[str, np.ndarray], Weight] | None = None) -> DecoderWeights:
    """The weights of ``source`` as stored (see the module's docstring for the sources).

    ``transform(name, w)``: made from each float projection (and the head) of a Hugging Face model or a
    GGUF file as it is read, from its float32 ``[N, K]`` array (see :func:`cuvil.llm.hf.from_hf`), so that
    a quantizer never holds the float32 model; other sources ignore it (:func:`convert` finishes)."""
    if isinstance(source, DecoderWeights):
        return source
    if isinstance(source, (str, os.PathLike)):
        p = Path(source)
        if not p.exists():
            raise ModelError(f"{p}: no such file or folder")
        if p.is_file() and p.suffix.lower() == ".gguf":
            from cuvil.llm.gguf import from_gguf

            return _context(from_gguf(p, transform=transform), max_context)
        if p.is_dir() and (p / "genai_config.json").exists():
            from cuvil.llm.onnx_genai import from_onnx_genai

            return _context(from_onnx_genai(p), max_context)
        if p.is_dir() and (p / "config.json").exists():
            from cuvil.llm.hf import from_hf

            return from_hf(p, max_context=max_context, transform=transform)
        raise ModelError(f"{p}: not a GGUF file (.gguf), an onnxruntime-genai folder (genai_config.json) or a "
                         "Hugging Face folder (config.json)")
    if type(source).__module__.startswith("transformers"):
        from cuvil.llm.hf import from_hf

        return from_hf(source, max_context=max_context, transform=transform)
    raise ArgumentError(f"cuvil.llm.load takes a path, a transformers model or DecoderWeights; got "
                        f"{type(source).__name__}")


def _context(w: DecoderWeights, max_context: int | None) -> DecoderWeights:
    if max_context is None:
        return w
    return replace(w, config=replace(w.config, max_context=int(max_context)))


def convert(w: DecoderWeights, weights: str = "as-stored", group: int = 32) -> DecoderWeights:
    """``w`` with the weights asked for (see the module's docstring): int4 in groups of ``group``, int8 with
    a scale per row (:func:`cuvil.llm.quantize.quantize`: the embedding float32, the head quantized as the
    projections).  A projection already in the asked form (int4: symmetric 4-bit in groups of ``group``;
    int8: 8-bit with a scale per row) is kept as it is: quantizing it again would give it back (int4) or
    round its scales once more (int8)."""
    if weights not in WEIGHTS:
        raise ArgumentError(f"weights={weights!r}: choose one of {', '.join(WEIGHTS)}")
    if weights == "as-stored":
        return w
    if weights == "fp32":
        return w.with_linears(lambda _n, x: x if isinstance(x, Dense) else Dense(x.dequantize()))
    quant = _quantizer(weights, group)
    if weights == "int4":
        def done(x: Weight) -> bool:
            return isinstance(x, Q4) and x.symmetric and x.group == group
    else:
        def done(x: Weight) -> bool:
            return isinstance(x, Q8) and x.group == x.shape[1]
    out = w.with_linears(lambda name, x: x if done(x) else quant(name, x))
    embed = w.embed if isinstance(w.embed, Dense) else Dense(w.embed.dequantize().astype(np.float32))
    return replace(out, embed=embed)


def _quantizer(weights: str, group: int) -> Callable[[str, Any], Weight]:
    """Round-to-nearest into ``weights`` ("int4": symmetric, groups of ``group``; "int8": per row)."""
    from cuvil.llm.quantize import quantize_weight

    bits, g = (4, group) if weights == "int4" else (8, None)
    return lambda name, x: quantize_weight(x, bits, g, True, name=name)


def load(source: Any, weights: str = "as-stored", *, context: int | None = None, chunk: int = 64,
         group: int = 32, kv_cache: str = "float32", target: Any = None, options: Any = None) -> Generator:
    """A :class:`~cuvil.llm.runtime.Generator` for ``source`` with ``weights`` ("as-stored", "fp32",
    "int4", "int8"; int4 quantizes in groups of ``group``) and a cache of ``context`` positions
    (``kv_cache``: "float32" or "int8"), its prefill and decode steps compiled; ``options``: a
    :class:`~cuvil.options.CompileOptions` whose ``check_schedules`` has isl prove the contractions' schedules."""
    if weights not in WEIGHTS:
        raise ArgumentError(f"weights={weights!r}: choose one of {', '.join(WEIGHTS)}")
    # int4 / int8: each projection is quantized as it is read (the float32 model is never whole in memory)
    lean = _quantizer(weights, group) if weights in ("int4", "int8") else None
    w = convert(read(source, max_context=context, transform=lean), weights, group)
    return Generator(w, context=context, chunk=chunk, target=target, kv_cache=kv_cache, options=options).compile()
