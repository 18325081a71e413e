"""Hugging Face ``transformers`` models built from configs with seeded random weights (nothing is
downloaded), wrapped so the exported outputs are plain tensors.

``"full"`` is the published size (BERT-base, DistilBERT-base, GPT-2 small, a LLaMA-style decoder of
8 layers x 1024, t5-small's encoder, whisper-tiny's encoder, wav2vec 2.0 base, DINOv2-S/14) at sequence
128 (whisper: 1x80x3000; wav2vec 2.0: 1x16000 samples; DINOv2: 1x3x224x224); ``"ci"`` keeps the same
modules with 2 layers of width 64 at sequence 16 (whisper: 1x80x100; wav2vec 2.0: 1x1600; DINOv2:
1x3x56x56).

Attention is ``attn_implementation="sdpa"``, transformers' default: both exporters take it (the dynamo
exporter writes it as MatMul / Softmax with the mask through Where; TorchScript's symbolic likewise).
The causal LMs get an attention mask too: besides being what generation feeds, it keeps
``masking_utils`` off its packed-sequence check (``torch.diff``), which the TorchScript exporter
cannot export.  Masks are padded (zeros at the end; at the start for the decode step), and padded
ids are the pad token.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from cuvil.models.registry.common import SEED, seeded

Built = tuple[nn.Module, dict[str, torch.Tensor], list[str]]
_ATTN = "sdpa"


class _Plain(nn.Module):
    """Calls ``model(**{names[i]: args[i]}, **fixed)`` and returns the named fields of its output."""

    def __init__(self, model: nn.Module, names: Sequence[str], outputs: Sequence[str], **fixed: Any):
        super().__init__()
        self.model, self.names, self.outputs, self.fixed = model, list(names), list(outputs), fixed

    def forward(self, *args: torch.Tensor) -> Any:
        out = self.model(**dict(zip(self.names, args)), **self.fixed)
        values = tuple(getattr(out, k) for k in self.outputs)
        return values[0] if len(values) == 1 else values


def _text_inputs(vocab: int, seq: int, pad: int, names: Sequence[str], left_pad: bool = False
                 ) -> dict[str, torch.Tensor]:
    """Seeded token ids (the last quarter padding), the attention mask, and token types (two segments)."""
    gen = torch.Generator().manual_seed(SEED + 3)
    ids = torch.randint(0, vocab, (1, seq), generator=gen)
    mask = torch.ones(1, seq, dtype=torch.int64)
    padded = slice(0, seq // 4) if left_pad else slice(seq - seq // 4, seq)
    mask[:, padded] = 0
    ids[:, padded] = pad
    types = torch.zeros(1, seq, dtype=torch.int64)
    types[:, seq // 3: seq - seq // 4] = 1
    every = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    return {n: every[n] for n in names}


def _model(cls_name: str, config: Any) -> nn.Module:
    import transformers

    seeded()
    return getattr(transformers, cls_name)(config).eval()


def bert(config: str) -> Built:
    """``BertModel`` at BERT-base (Devlin et al. 2018): 12 layers, hidden 768, 12 heads, FFN 3072,
    vocab 30522; ids, mask and token types at sequence 128; last hidden state and pooled output."""
    from transformers import BertConfig

    full = config == "full"
    vocab, seq = (30522, 128) if full else (512, 16)
    size = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072) if full \
        else dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  max_position_embeddings=128)  # 128: the dynamic-length tests run sequences up to 128
    model = _model("BertModel", BertConfig(vocab_size=vocab, attn_implementation=_ATTN, pad_token_id=0, **size))
    names = ["input_ids", "attention_mask", "token_type_ids"]
    outputs = ["last_hidden_state", "pooler_output"]
    return _Plain(model, names, outputs).eval(), _text_inputs(vocab, seq, 0, names), outputs


def distilbert(config: str) -> Built:
    """``DistilBertModel`` (Sanh et al. 2019): 6 layers, dim 768, 12 heads, FFN 3072; ids and mask at
    sequence 128; last hidden state."""
    from transformers import DistilBertConfig

    full = config == "full"
    vocab, seq = (30522, 128) if full else (512, 16)
    size = dict(dim=768, n_layers=6, n_heads=12, hidden_dim=3072) if full \
        else dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128, max_position_embeddings=64)
    model = _model("DistilBertModel", DistilBertConfig(vocab_size=vocab, attn_implementation=_ATTN, pad_token_id=0,
                                                       **size))
    names = ["input_ids", "attention_mask"]
    return _Plain(model, names, ["last_hidden_state"]).eval(), _text_inputs(vocab, seq, 0, names), \
        ["last_hidden_state"]


def _gpt2_config(full: bool) -> Any:
    from transformers import GPT2Config

    if full:  # GPT-2 small (Radford et al. 2019)
        return GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                          attn_implementation=_ATTN, use_cache=False)
    return GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=511,
                      eos_token_id=511, attn_implementation=_ATTN, use_cache=False)


def gpt2(config: str) -> Built:
    """``GPT2LMHeadModel`` at GPT-2 small: 12 layers, 768, 12 heads, vocab 50257; ids and mask at
    sequence 128; logits."""
    cfg = _gpt2_config(config == "full")
    seq = 128 if config == "full" else 16
    names = ["input_ids", "attention_mask"]
    model = _Plain(_model("GPT2LMHeadModel", cfg), names, ["logits"], use_cache=False).eval()
    return model, _text_inputs(cfg.vocab_size, seq, cfg.eos_token_id, names), ["logits"]


def llama(config: str) -> Built:
    """``LlamaForCausalLM`` (Touvron et al. 2023: RMSNorm, rotary positions, SwiGLU MLP) with grouped
    KV heads: 8 layers, hidden 1024, 16 heads / 4 KV heads, MLP 2816 (~8/3 x hidden, as LLaMA sizes
    its MLP), vocab 32000; ids and mask at sequence 128; logits."""
    from transformers import LlamaConfig

    full = config == "full"
    vocab, seq = (32000, 128) if full else (512, 16)
    size = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                num_key_value_heads=4, max_position_embeddings=2048) if full \
        else dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    cfg = LlamaConfig(vocab_size=vocab, attn_implementation=_ATTN, use_cache=False, pad_token_id=0, **size)
    names = ["input_ids", "attention_mask"]
    model = _Plain(_model("LlamaForCausalLM", cfg), names, ["logits"], use_cache=False).eval()
    return model, _text_inputs(vocab, seq, 0, names), ["logits"]


def t5_encoder(config: str) -> Built:
    """``T5EncoderModel`` at t5-small (Raffel et al. 2019): 6 layers, d_model 512, 8 heads of 64, FFN 2048
    (ReLU), relative position buckets, vocab 32128; ids and mask at sequence 128; last hidden state."""
    from transformers import T5Config

    full = config == "full"
    vocab, seq = (32128, 128) if full else (512, 16)
    size = dict(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8) if full \
        else dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
    cfg = T5Config(vocab_size=vocab, attn_implementation=_ATTN, use_cache=False, decoder_start_token_id=0, **size)
    names = ["input_ids", "attention_mask"]
    model = _Plain(_model("T5EncoderModel", cfg), names, ["last_hidden_state"]).eval()
    return model, _text_inputs(vocab, seq, 0, names), ["last_hidden_state"]


def whisper_encoder(config: str) -> Built:
    """``WhisperEncoder`` at whisper-tiny (Radford et al. 2022): two conv stems (the second stride 2),
    sinusoidal positions, 4 layers, d_model 384, 6 heads, FFN 1536, GELU; a 1x80x3000 log-mel input
    (30 s); last hidden state (1x1500x384)."""
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    full = config == "full"
    size = dict(d_model=384, encoder_layers=4, encoder_attention_heads=6, encoder_ffn_dim=1536,
                max_source_positions=1500) if full \
        else dict(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128, max_source_positions=50)
    cfg = WhisperConfig(num_mel_bins=80, attn_implementation=_ATTN, use_cache=False, **size)
    seeded()
    model = _Plain(WhisperEncoder(cfg).eval(), ["input_features"], ["last_hidden_state"]).eval()
    frames = 2 * size["max_source_positions"]
    x = torch.randn(1, 80, frames, generator=torch.Generator().manual_seed(SEED + 2))
    return model, {"input_features": x}, ["last_hidden_state"]


def wav2vec2(config: str) -> Built:
    """``Wav2Vec2Model`` at wav2vec 2.0 base (Baevski et al. 2020): a 7-layer Conv1d feature encoder over
    the raw waveform (512 channels, kernels 10,3,3,3,3,2,2, strides 5,2,2,2,2,2,2, GroupNorm on the first,
    GELU), a grouped positional convolution (kernel 128, 16 groups, weight-normalised), 12 post-norm
    layers of 768 with 12 heads and FFN 3072; one second at 16 kHz (1x16000); last hidden state (1x49x768).
    ci: 3 conv layers of 32 (kernels 10,3,2, strides 5,2,2), positions kernel 16 in 4 groups, 2 layers
    of 64, 1x1600."""
    from transformers import Wav2Vec2Config

    full = config == "full"
    size = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072) if full \
        else dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  conv_dim=(32, 32, 32), conv_kernel=(10, 3, 2), conv_stride=(5, 2, 2),
                  num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)
    cfg = Wav2Vec2Config(feat_extract_norm="group", do_stable_layer_norm=False, attn_implementation=_ATTN, **size)
    model = _Plain(_model("Wav2Vec2Model", cfg), ["input_values"], ["last_hidden_state"]).eval()
    x = torch.randn(1, 16000 if full else 1600, generator=torch.Generator().manual_seed(SEED + 2))
    return model, {"input_values": x}, ["last_hidden_state"]


def dinov2(config: str) -> Built:
    """``Dinov2Model`` at DINOv2-S/14 (Oquab et al. 2023): 14x14 patches, 12 layers of 384, 6 heads, layer
    scale, learned positions for its 518x518 training size; run at 1x3x224x224, so the positions are
    resampled to the 16x16 grid by bicubic interpolation inside the model, as the published checkpoints
    run at any size; last hidden state and pooled output.  ci: 2 layers of 64, positions for 98x98,
    run at 1x3x56x56."""
    from transformers import Dinov2Config

    full = config == "full"
    size = dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, image_size=518) if full \
        else dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=98)
    cfg = Dinov2Config(patch_size=14, attn_implementation=_ATTN, layerscale_value=0.5, **size)
    outputs = ["last_hidden_state", "pooler_output"]
    model = _Plain(_model("Dinov2Model", cfg), ["pixel_values"], outputs).eval()
    side = 224 if full else 56
    x = torch.randn(1, 3, side, side, generator=torch.Generator().manual_seed(SEED + 2))
    return model, {"pixel_values": x}, outputs


# -- one GPT-2 decode step with the past keys / values as inputs ---------------------------------------------

def _cache_tensors(cache: Any) -> list[torch.Tensor]:
    """[key_0, value_0, key_1, ...] of a transformers cache (``layers`` in 5.x, ``key_cache`` before)."""
    if hasattr(cache, "layers"):
        return [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return [t for k, v in zip(cache.key_cache, cache.value_cache) for t in (k, v)]


class _DecodeStep(nn.Module):
    """``model(input_ids, attention_mask, cache built from past_*)`` -> logits, present_* (flat)."""

    def __init__(self, model: nn.Module, layers: int):
        super().__init__()
        self.model, self.layers = model, layers
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *past: torch.Tensor) -> Any:
        from transformers import DynamicCache

        cache = DynamicCache([(past[2 * i], past[2 * i + 1]) for i in range(self.layers)])
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, **{self.cache_kw: cache})
        present = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        return (out.logits, *_cache_tensors(present))


def gpt2_decode(config: str) -> Built:
    """One decode step of ``GPT2LMHeadModel`` (the GPT-2 small of :func:`gpt2`): one new token after
    127 cached ones (ci: 15); the past keys / values are inputs (``past_key_<i>``, ``past_value_<i>``,
    batch x heads x past x 64) computed by running the model on a seeded prefix; the mask's first
    quarter is left padding; outputs the logits and ``present_key_<i>`` / ``present_value_<i>``."""
    cfg = _gpt2_config(config == "full")
    past_len = 127 if config == "full" else 15
    lm = _model("GPT2LMHeadModel", cfg)
    gen = torch.Generator().manual_seed(SEED + 3)
    prefix = torch.randint(0, cfg.vocab_size, (1, past_len), generator=gen)
    step = _DecodeStep(lm, cfg.n_layer).eval()
    with torch.no_grad():
        out = lm(input_ids=prefix, use_cache=True)
        past = _cache_tensors(getattr(out, "cache", None) or out.past_key_values)
    mask = torch.ones(1, past_len + 1, dtype=torch.int64)
    mask[:, : (past_len + 1) // 4] = 0
    inputs = {"input_ids": torch.randint(0, cfg.vocab_size, (1, 1), generator=gen), "attention_mask": mask}
    for i in range(cfg.n_layer):
        inputs[f"past_key_{i}"], inputs[f"past_value_{i}"] = past[2 * i].clone(), past[2 * i + 1].clone()
    outputs = ["logits"] + [f"present_{kv}_{i}" for i in range(cfg.n_layer) for kv in ("key", "value")]
    return step, inputs, outputs
