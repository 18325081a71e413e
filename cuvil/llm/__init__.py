"""LLMs on CPUs: decoder-only models (LLaMA, Mistral, Qwen2, Phi-3, Gemma) loaded from Hugging Face folders
or model objects, onnxruntime-genai's ONNX models and GGUF files, with int4 / int8 / fp32 weights, a KV cache
updated in place and a generation loop.  See docs/llm.md."""

from __future__ import annotations

from cuvil.llm.weights import Q4, Q8, DecoderConfig, DecoderWeights, Dense, LayerWeights

__all__ = ["Q4", "Q8", "DecoderConfig", "DecoderWeights", "Dense", "LayerWeights"]
