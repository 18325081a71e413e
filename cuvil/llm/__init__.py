"""LLMs on CPUs: decoder-only models (LLaMA, Mistral, Qwen2, Phi-3, Gemma) loaded from Hugging Face folders
or model objects, onnxruntime-genai's ONNX models and GGUF files, with int4 / int8 / fp32 weights, a KV cache
updated in place and a generation loop.  See docs/llm.md."""

from __future__ import annotations

from cuvil.lazy import lazy_attributes
from cuvil.llm.weights import Q4, Q8, DecoderConfig, DecoderWeights, Dense, LayerWeights

_LAZY = {"load": ("cuvil.llm.api", "load"), "read": ("cuvil.llm.api", "read"),
         "Generator": ("cuvil.llm.runtime", "Generator"), "quantize": ("cuvil.llm.quantize", "quantize"),
         "quantize_weight": ("cuvil.llm.quantize", "quantize_weight"), "from_hf": ("cuvil.llm.hf", "from_hf"),
         "from_gguf": ("cuvil.llm.gguf", "from_gguf"), "from_onnx_genai": ("cuvil.llm.onnx_genai", "from_onnx_genai")}

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)


__all__ = ["Q4", "Q8", "DecoderConfig", "DecoderWeights", "Dense", "Generator", "LayerWeights", "from_gguf", "from_hf",
           "from_onnx_genai", "load", "quantize", "quantize_weight", "read"]
