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

RoPE scaling (``rope_parameters`` / ``rope_scaling``): "linear" and "llama3" become
``DecoderConfig.rope_inv_freq`` (computed as transformers computes them, :func:`rope_inv_freq`); other types
(dynamic, yarn, longrope) and partial rotary factors are refused with
:class:`~cuvil.errors.UnsupportedOpError`.
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
from cuvil.llm.weights import DecoderConfig, DecoderWeights, Dense, LayerWeights, Weight, default_inv_freq

__all__ = ["from_hf", "SUPPORTED_ARCHITECTURES", "read_safetensors", "rope_inv_freq"]

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


def from_hf(path_or_model: Any, max_context: int | None = None,
            transform: Callable[[str, np.ndarray], Weight] | None = None) -> DecoderWeights:
    """Load a Hugging Face decoder-only model as :class:`DecoderWeights` (float32 :class:`Dense` weights).

    ``path_or_model``: a folder with ``config.json`` and safetensors (or ``pytorch_model*.bin``) files, or a
    ``transformers`` ``*ForCausalLM`` object.  ``max_context`` overrides ``max_position_embeddings``.

    ``transform(name, w)``, when given, makes each projection and the output head from its float32
    ``[N, K]`` array as it is read (names as :meth:`DecoderWeights.with_linears`: ``"layers.3.q"``,
    ``"head"``; a tied head is made from the embedding's matrix, the embedding itself stays float32), and
    the float32 array is dropped at once: with a quantizer (``cuvil.llm.load(folder, "int4")``) the model
    never exists in float32 as a whole.  Safetensors files are memory-mapped, one tensor converted at a
    time.

    Raises :class:`ModelError` for an unknown architecture (naming it and the supported ones) or a missing
    or misshapen tensor, and :class:`UnsupportedOpError` for RoPE scaling other than linear and LLaMA 3's,
    partial rotary embeddings, biases other than q/k/v, or a sliding window on some layers only.  From a
    model object, float32 parameters are shared, not copied (the weights change if the model's parameters
    do)."""
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
    return _assemble(config, tensors, source, transform)


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


def rope_inv_freq(rope_type: str, params: dict, theta: float, head_dim: int, where: str = "") -> np.ndarray | None:
    """The inverse frequencies of a scaled RoPE (None for "default"), in float32 with transformers' steps
    (``modeling_rope_utils``; a Python scalar meets a float32 tensor as a float32, ``a / t`` is
    ``(1 / t) * a``).

    - "linear": ``inv / factor``.
    - "llama3" (LLaMA 3.1 / 3.2): with ``wavelen = 2 pi / inv``, frequencies whose wavelength is below
      ``original_max_position_embeddings / high_freq_factor`` are kept, those above ``... / low_freq_factor``
      divided by ``factor``, and those between interpolated: ``s = (old / wavelen - low) / (high - low)``,
      ``inv' = (1 - s) * inv / factor + s * inv``.

    Other types (dynamic, yarn, longrope, ...) raise :class:`UnsupportedOpError` naming the type."""
    if rope_type == "default":
        return None
    f32 = np.float32

    def need(key: str) -> float:
        if params.get(key) is None:
            raise ModelError(f"{where}RoPE scaling {rope_type!r} has no {key!r}")
        return float(params[key])

    inv = default_inv_freq(theta, head_dim)
    if rope_type == "linear":
        return (inv / f32(need("factor"))).astype(f32)
    if rope_type == "llama3":
        factor, low, high = need("factor"), need("low_freq_factor"), need("high_freq_factor")
        old = need("original_max_position_embeddings")
        if high <= low:
            raise ModelError(f"{where}RoPE scaling 'llama3': high_freq_factor {high} must exceed low_freq_factor "
                             f"{low}")
        wavelen = (f32(1) / inv) * f32(2 * math.pi)
        low_wavelen, high_wavelen = f32(old / low), f32(old / high)
        scaled = np.where(wavelen > low_wavelen, inv / f32(factor), inv).astype(f32)
        smooth = ((f32(1) / wavelen) * f32(old) - f32(low)) / f32(high - low)
        smoothed = (f32(1) - smooth) * scaled / f32(factor) + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(f32)
    raise UnsupportedOpError(f"{where}RoPE scaling {rope_type!r} is not supported; cuvil.llm takes rope_type "
                             f"'default', 'linear' and 'llama3'")


def _rope(hf: dict, family: str, head_dim: int) -> tuple[float, tuple[float, ...] | None]:
    """The RoPE base and, for a scaled RoPE, the inverse frequencies (:func:`rope_inv_freq`); refuses
    partial rotary embeddings.  transformers >= 5 writes ``rope_parameters`` ({"rope_theta",
    "rope_type", ...}); older configs ``rope_theta`` and ``rope_scaling``."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UnsupportedOpError(f"{family}: partial_rotary_factor {partial} is not supported (rotary on the "
                                 f"whole head only)")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if rope_type == "llama3":
        # as transformers: a top-level original_max_position_embeddings wins, then the parameters', then
        # max_position_embeddings
        old = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = old or hf.get("max_position_embeddings")
    inv = rope_inv_freq(str(rope_type), params, theta, head_dim, where=f"{family}: ")
    return theta, None if inv is None else tuple(float(x) for x in inv)


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
    head_dim = int(hf.get("head_dim") or hidden // heads)
    theta, inv_freq = _rope(hf, family, head_dim)
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
        head_dim=head_dim,
        ffn=int(need("intermediate_size")),
        rope_theta=theta,
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
        rope_inv_freq=inv_freq,
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

def _assemble(c: DecoderConfig, get: Tensors, source: str,
              transform: Callable[[str, np.ndarray], Weight] | None = None) -> DecoderWeights:
    def tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
        t = get(name)
        if t is None:
            raise ModelError(f"{source}: tensor {name} is missing")
        if tuple(t.shape) != shape:
            raise ModelError(f"{source}: tensor {name} is {list(t.shape)}; expected {list(shape)}")
        return np.ascontiguousarray(t, dtype=np.float32)

    def optional(name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        t = get(name)
        if t is None:
            return None
        if tuple(t.shape) != shape:
            raise ModelError(f"{source}: tensor {name} is {list(t.shape)}; expected {list(shape)}")
        return np.ascontiguousarray(t, dtype=np.float32)

    def linear(name: str, a: np.ndarray) -> Weight:
        """The weight ``name`` made from ``a`` at once (the caller keeps no reference to ``a``)."""
        return _dense(a) if transform is None else transform(name, np.ascontiguousarray(a, dtype=np.float32))

    H, q_rows, kv_rows = c.hidden, c.heads * c.head_dim, c.kv_heads * c.head_dim
    layers = []
    for i in range(c.layers):
        p, n = f"model.layers.{i}.", f"layers.{i}."
        for bad in ("self_attn.o_proj.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias"):
            if get(p + bad) is not None:
                raise UnsupportedOpError(f"{source}: tensor {p + bad}: cuvil.llm takes biases on q/k/v only")
        w: dict[str, Weight] = {}
        if c.family == "phi3":
            parts = np.split(tensor(p + "self_attn.qkv_proj.weight", (q_rows + 2 * kv_rows, H)),
                             [q_rows, q_rows + kv_rows])
            w.update((x, linear(n + x, parts.pop(0))) for x in ("q", "k", "v"))
            parts = np.split(tensor(p + "mlp.gate_up_proj.weight", (2 * c.ffn, H)), 2)
            w.update((x, linear(n + x, parts.pop(0))) for x in ("gate", "up"))
        else:
            for x, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                w[x] = linear(n + x, tensor(p + f"self_attn.{x}_proj.weight", (rows, H)))
            for x in ("gate", "up"):
                w[x] = linear(n + x, tensor(p + f"mlp.{x}_proj.weight", (c.ffn, H)))
        w["o"] = linear(n + "o", tensor(p + "self_attn.o_proj.weight", (H, q_rows)))
        w["down"] = linear(n + "down", tensor(p + "mlp.down_proj.weight", (H, c.ffn)))
        layers.append(LayerWeights(
            attn_norm=tensor(p + "input_layernorm.weight", (H,)),
            ffn_norm=tensor(p + "post_attention_layernorm.weight", (H,)),
            q_bias=optional(p + "self_attn.q_proj.bias", (q_rows,)),
            k_bias=optional(p + "self_attn.k_proj.bias", (kv_rows,)),
            v_bias=optional(p + "self_attn.v_proj.bias", (kv_rows,)),
            **w,
        ))
    embed = _dense(tensor("model.embed_tokens.weight", (c.vocab, H)))
    if not c.tie_embeddings:
        head = linear("head", tensor("lm_head.weight", (c.vocab, H)))
    else:
        head = embed if transform is None else transform("head", embed.w)
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
    if dtype == "BF16":  # the bits of a bfloat16 are the top half of a float32's
        bits = a.astype(np.uint32)
        bits <<= 16
        return bits.view(np.float32).reshape(shape)
    return a.astype(np.float32).reshape(shape)


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file as float32 (bf16 and f16 converted exactly)."""
    p = Path(path)
    header, start = _safetensors_header(p)
    return {name: _safetensors_tensor(p, meta, name, start) for name, meta in header.items()}
