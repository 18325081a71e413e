"""Hugging Face decoder-only models -> :class:`~cuvil.llm.weights.DecoderWeights`.

``from_hf`` reads a local folder (``config.json`` and ``*.safetensors``, sharded or not, or
``pytorch_model*.bin``) or a ``transformers`` model object (its state dict).  Every tensor becomes float32:
bf16 and f16 values convert exactly, so fp32 weights equal the checkpoint's bit for bit.

The families and what each changes (the runtime reads these from :class:`DecoderConfig`):

============================  =========================================================================
LlamaForCausalLM              the reference (optional q/k/v biases when ``attention_bias``)
MistralForCausalLM            ``sliding_window``
Qwen2ForCausalLM              q/k/v biases; a sliding window only with ``use_sliding_window`` (and then
                              on every layer: a window on some layers only is refused)
Phi3ForCausalLM               fused ``qkv_proj`` and ``gate_up_proj`` (split here); ``sliding_window``
GemmaForCausalLM              ``norm_offset`` 1, ``embed_scale`` sqrt(hidden) rounded to the embedding's
                              stored dtype (as HF multiplies in that dtype), gelu_tanh, tied embeddings
============================  =========================================================================

RoPE scaling (``rope_parameters`` / ``rope_scaling`` of a type other than "default") and partial rotary
factors are refused with :class:`~cuvil.errors.UnsupportedOpError`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from cuvil.errors import ModelError, UnsupportedOpError
from cuvil.llm.weights import DecoderConfig, DecoderWeights, Dense, LayerWeights

__all__ = ["from_hf", "SUPPORTED_ARCHITECTURES", "read_safetensors"]

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Phi3ForCausalLM": "phi3",
    "GemmaForCausalLM": "gemma",
}

_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
         "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}

# A tensor source: name -> float32 array, plus the stored dtype of a tensor (for Gemma's normaliser).
Tensors = Callable[[str], "np.ndarray | None"]


def from_hf(path_or_model: Any, max_context: int | None = None) -> DecoderWeights:
    """Load a Hugging Face decoder-only model as :class:`DecoderWeights` (float32 :class:`Dense` weights).

    ``path_or_model``: a folder with ``config.json`` and safetensors (or ``pytorch_model*.bin``) files, or a
    ``transformers`` ``*ForCausalLM`` object.  ``max_context`` overrides ``max_position_embeddings``.

    Raises :class:`ModelError` for an unknown architecture (naming it and the supported ones) or a missing
    or misshapen tensor, and :class:`UnsupportedOpError` for RoPE scaling, partial rotary embeddings, biases
    other than q/k/v, or a sliding window on some layers only.  From a model object, float32 parameters are
    shared, not copied (the weights change if the model's parameters do)."""
    if isinstance(path_or_model, (str, os.PathLike)):
        folder = Path(path_or_model)
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise ModelError(f"{folder}: no config.json (expected a Hugging Face model folder)")
        hf = json.loads(cfg_path.read_text())
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else f"(no 'architectures' in config.json, model_type {hf.get('model_type')!r})"
        extra_eos = _generation_eos(folder / "generation_config.json")
        tensors, dtypes = _read_folder(folder)
        source = str(folder)
    else:
        model = path_or_model
        if not hasattr(model, "state_dict") or not hasattr(model, "config"):
            raise ModelError(f"from_hf takes a folder path or a transformers model; got {type(model).__name__}")
        hf = model.config.to_dict()
        arch = type(model).__name__
        extra_eos = ()
        gen = getattr(model, "generation_config", None)
        if gen is not None and getattr(gen, "eos_token_id", None) is not None:
            extra_eos = _as_ids(gen.eos_token_id)
        tensors, dtypes = _read_state_dict(model)
        source = f"{arch} object"
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(f"architecture {arch} is not supported by cuvil.llm; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    family = SUPPORTED_ARCHITECTURES[arch]
    config = _config(hf, family, max_context, extra_eos, dtypes.get("model.embed_tokens.weight"))
    return _assemble(config, tensors, hf, source)


# ---------------------------------------------------------------------------------------------- config

def _as_ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, (list, tuple)):
        return tuple(int(x) for x in v)
    return (int(v),)


def _generation_eos(path: Path) -> tuple[int, ...]:
    if not path.is_file():
        return ()
    return _as_ids(json.loads(path.read_text()).get("eos_token_id"))


def _rope(hf: dict, family: str) -> float:
    """The RoPE base; refuses scaled or partial rotary embeddings.  transformers >= 5 writes
    ``rope_parameters`` ({"rope_theta", "rope_type", ...}); older configs ``rope_theta`` and
    ``rope_scaling``."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or params.get("type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        raise UnsupportedOpError(f"{family}: RoPE scaling {rope_type!r} is not supported (cuvil.llm's rotary "
                                 f"embedding is the plain one, rope_type 'default')")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UnsupportedOpError(f"{family}: partial_rotary_factor {partial} is not supported (rotary on the "
                                 f"whole head only)")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    return float(theta)


def _sliding_window(hf: dict, family: str, layers: int) -> int:
    if family in ("llama", "gemma"):
        return 0
    if family == "qwen2":
        if not hf.get("use_sliding_window"):
            return 0
        window = hf.get("sliding_window") or 0
        types = hf.get("layer_types") or ["sliding_attention" if i >= hf.get("max_window_layers", 0)
                                          else "full_attention" for i in range(layers)]
        sliding = [t == "sliding_attention" for t in types[:layers]]
        if not any(sliding):
            return 0
        if not all(sliding):
            raise UnsupportedOpError(f"qwen2: a sliding window on layers {[i for i, s in enumerate(sliding) if s]} "
                                     f"only; cuvil.llm takes one window for every layer")
        return int(window)
    return int(hf.get("sliding_window") or 0)


def _config(hf: dict, family: str, max_context: int | None, extra_eos: tuple[int, ...],
            embed_dtype: str | None) -> DecoderConfig:
    def need(key: str) -> Any:
        if hf.get(key) is None:
            raise ModelError(f"{family}: config has no {key!r}")
        return hf[key]

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    layers = int(need("num_hidden_layers"))
    act_name = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if family == "gemma" and act_name == "gelu":
        act_name = "gelu_pytorch_tanh"  # HF Gemma's legacy value, meant as the tanh approximation
    if act_name not in _ACTS:
        raise UnsupportedOpError(f"{family}: activation {act_name!r}; cuvil.llm takes "
                                 f"{', '.join(sorted(_ACTS))}")
    embed_scale = 1.0
    if family == "gemma":
        embed_scale = _round_to(math.sqrt(hidden), embed_dtype or "F32")
    eos = tuple(dict.fromkeys(_as_ids(hf.get("eos_token_id")) + extra_eos))
    bos = hf.get("bos_token_id")
    if isinstance(bos, (list, tuple)):
        bos = bos[0] if bos else None
    return DecoderConfig(
        vocab=int(need("vocab_size")), hidden=hidden, layers=layers, heads=heads,
        kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        ffn=int(need("intermediate_size")),
        rope_theta=_rope(hf, family),
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_context=int(max_context or hf.get("max_position_embeddings") or 2048),
        sliding_window=_sliding_window(hf, family, layers),
        tie_embeddings=bool(hf.get("tie_word_embeddings", family == "gemma")),
        act=_ACTS[act_name],
        norm_offset=1.0 if family == "gemma" else 0.0,
        embed_scale=embed_scale,
        family=family,
        bos=None if bos is None else int(bos),
        eos=eos,
    )


_DTYPE_NAMES = {"F32": "F32", "FLOAT32": "F32", "TORCH.FLOAT32": "F32", "F16": "F16", "FLOAT16": "F16",
                "TORCH.FLOAT16": "F16", "BF16": "BF16", "BFLOAT16": "BF16", "TORCH.BFLOAT16": "BF16"}


def _round_to(x: float, dtype: str) -> float:
    """``x`` rounded to a stored dtype ("F32", "F16", "BF16" as safetensors names them, or a torch dtype)."""
    d = _DTYPE_NAMES.get(dtype.upper(), "F32")
    if d == "F16":
        return float(np.float16(x))
    if d == "BF16":
        bits = np.array([x], dtype=np.float32).view(np.uint32)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & np.uint32(0xFFFF0000)  # round to nearest even
        return float(bits.view(np.float32)[0])
    return float(np.float32(x))


# --------------------------------------------------------------------------------------------- tensors

def _assemble(c: DecoderConfig, get: Tensors, hf: dict, source: str) -> DecoderWeights:
    def tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
        t = get(name)
        if t is None:
            raise ModelError(f"{source}: tensor {name} is missing")
        if tuple(t.shape) != shape:
            raise ModelError(f"{source}: tensor {name} is {list(t.shape)}; expected {list(shape)}")
        return np.ascontiguousarray(t, dtype=np.float32)

    def optional(name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        return None if get(name) is None else tensor(name, shape)

    H, q_rows, kv_rows = c.hidden, c.heads * c.head_dim, c.kv_heads * c.head_dim
    layers = []
    for i in range(c.layers):
        p = f"model.layers.{i}."
        for bad in ("self_attn.o_proj.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias"):
            if get(p + bad) is not None:
                raise UnsupportedOpError(f"{source}: tensor {p + bad}: cuvil.llm takes biases on q/k/v only")
        if c.family == "phi3":
            qkv = tensor(p + "self_attn.qkv_proj.weight", (q_rows + 2 * kv_rows, H))
            q, k, v = np.split(qkv, [q_rows, q_rows + kv_rows])
            gate_up = tensor(p + "mlp.gate_up_proj.weight", (2 * c.ffn, H))
            gate, up = np.split(gate_up, 2)
        else:
            q = tensor(p + "self_attn.q_proj.weight", (q_rows, H))
            k = tensor(p + "self_attn.k_proj.weight", (kv_rows, H))
            v = tensor(p + "self_attn.v_proj.weight", (kv_rows, H))
            gate = tensor(p + "mlp.gate_proj.weight", (c.ffn, H))
            up = tensor(p + "mlp.up_proj.weight", (c.ffn, H))
        layers.append(LayerWeights(
            attn_norm=tensor(p + "input_layernorm.weight", (H,)),
            q=_dense(q), k=_dense(k), v=_dense(v),
            o=_dense(tensor(p + "self_attn.o_proj.weight", (H, q_rows))),
            ffn_norm=tensor(p + "post_attention_layernorm.weight", (H,)),
            gate=_dense(gate), up=_dense(up),
            down=_dense(tensor(p + "mlp.down_proj.weight", (H, c.ffn))),
            q_bias=optional(p + "self_attn.q_proj.bias", (q_rows,)),
            k_bias=optional(p + "self_attn.k_proj.bias", (kv_rows,)),
            v_bias=optional(p + "self_attn.v_proj.bias", (kv_rows,)),
        ))
    embed = _dense(tensor("model.embed_tokens.weight", (c.vocab, H)))
    head = embed if c.tie_embeddings else _dense(tensor("lm_head.weight", (c.vocab, H)))
    return DecoderWeights(config=c, embed=embed, layers=tuple(layers), norm=tensor("model.norm.weight", (H,)),
                          head=head, source=source)


def _dense(a: np.ndarray) -> Dense:
    return Dense(np.ascontiguousarray(a, dtype=np.float32))


def _read_state_dict(model: Any) -> tuple[Tensors, dict[str, str]]:
    import torch

    with torch.no_grad():
        sd = {k: v for k, v in model.state_dict().items()}
    dtypes = {k: str(v.dtype) for k, v in sd.items()}

    def get(name: str) -> np.ndarray | None:
        t = sd.get(name)
        if t is None:
            return None
        with torch.no_grad():
            return t.detach().to(device="cpu", dtype=torch.float32).numpy()
    return get, dtypes


def _read_folder(folder: Path) -> tuple[Tensors, dict[str, str]]:
    files = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
    if files:
        entries: dict[str, tuple[Path, dict, int]] = {}
        for f in files:
            if not f.is_file():
                raise ModelError(f"{folder}: shard {f.name} named by the index is missing")
            header, start = _safetensors_header(f)
            for name, meta in header.items():
                entries[name] = (f, meta, start)
        dtypes = {k: m["dtype"] for k, (_, m, _) in entries.items()}

        def get(name: str) -> np.ndarray | None:
            if name not in entries:
                return None
            return _safetensors_tensor(*entries[name][:2], name=name, start=entries[name][2])
        return get, dtypes
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise ModelError(f"{folder}: no *.safetensors or pytorch_model*.bin weights")
    import torch

    sd: dict[str, Any] = {}
    for b in bins:
        sd.update(torch.load(b, map_location="cpu", weights_only=True, mmap=True))

    def get_bin(name: str) -> np.ndarray | None:
        t = sd.get(name)
        return None if t is None else t.to(torch.float32).numpy()
    return get_bin, {k: str(v.dtype) for k, v in sd.items()}


# safetensors: an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}},
# then the data.  Read here (not with safetensors.numpy, which has no bfloat16).
_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16,
              "I8": np.int8, "U8": np.uint8, "I16": np.int16, "I32": np.int32, "I64": np.int64}


def _safetensors_header(path: Path) -> tuple[dict[str, dict], int]:
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ModelError(f"{path}: not a safetensors file (shorter than its header)")
        n = int.from_bytes(raw, "little")
        try:
            header = json.loads(fh.read(n))
        except ValueError as e:
            raise ModelError(f"{path}: unreadable safetensors header ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def _safetensors_tensor(path: Path, meta: dict, name: str, start: int) -> np.ndarray:
    dtype = meta.get("dtype")
    if dtype not in _ST_DTYPES:
        raise ModelError(f"{path}: tensor {name} has dtype {dtype}; cuvil reads {', '.join(_ST_DTYPES)}")
    b, e = meta["data_offsets"]
    shape = tuple(int(s) for s in meta["shape"])
    size = os.path.getsize(path)
    if start + e > size:
        raise ModelError(f"{path}: tensor {name} runs past the end of the file")
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=start + b, shape=(e - b,))
    a = raw.view(_ST_DTYPES[dtype])
    if a.size != math.prod(shape):
        raise ModelError(f"{path}: tensor {name} holds {a.size} values for shape {list(shape)}")
    if dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return a.astype(np.float32).reshape(shape)


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file as float32 (bf16 and f16 converted exactly)."""
    p = Path(path)
    header, start = _safetensors_header(p)
    return {name: _safetensors_tensor(p, meta, name, start) for name, meta in header.items()}
