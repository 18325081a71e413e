"""A decoder-only LLM as data: its configuration and its weights, in the one format every loader writes
(Hugging Face folders and model objects, onnxruntime-genai's ONNX models, GGUF files, ``quantize``) and
the kernels read.

A linear layer's weight is ``[N, K]`` (N outputs, K inputs, as ``torch.nn.Linear``), in one of three forms:

- :class:`Dense`: float32.
- :class:`Q4`: 4-bit values ``q`` in 0..15, two per byte (element ``2i`` of a row in the low nibble of byte
  ``i``, ``2i + 1`` in the high one: onnxruntime's MatMulNBits order), in groups of ``group`` consecutive
  inputs, each group with a scale and an offset: ``w[n, k] = q[n, k] * scale[n, g] + offset[n, g]``
  (``g = k // group``).  One form covers symmetric weights (``offset = -8 * scale``: GGUF Q4_0,
  MatMulNBits without zero points), zero points (``offset = -zp * scale``: MatMulNBits, Q4_1) and
  K-quants' minimums (``offset = -dmin * m``: Q4_K).
- :class:`Q8`: int8 values, one scale per group (GGUF Q8_0: group 32; weight-only int8: group K).

Nothing here runs at inference time: ``dequantize`` is for references and tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from cuvil.errors import ModelError

__all__ = ["Dense", "Q4", "Q8", "Weight", "DecoderConfig", "LayerWeights", "DecoderWeights", "default_inv_freq",
           "stack", "weight_shape"]


@dataclass(frozen=True, eq=False)
class Dense:
    """A float32 weight ``[N, K]``."""

    w: np.ndarray

    def __post_init__(self) -> None:
        if self.w.dtype != np.float32 or self.w.ndim != 2:
            raise ModelError(f"a dense weight is float32 [N, K]; got {self.w.dtype} {list(self.w.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.w.shape[0]), int(self.w.shape[1]))

    def dequantize(self) -> np.ndarray:
        return self.w

    @property
    def nbytes(self) -> int:
        return int(self.w.nbytes)


@dataclass(frozen=True, eq=False)
class Q4:
    """4-bit weights in groups: ``w[n, k] = q[n, k] * scale[n, k // group] + offset[n, k // group]``.

    ``q``: uint8 ``[N, K // 2]`` (low nibble first); ``scale`` and ``offset``: float32 ``[N, K // group]``;
    ``symmetric`` says that ``offset == -8 * scale`` (kernels then need not read the offsets)."""

    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray
    group: int
    symmetric: bool = False

    def __post_init__(self) -> None:
        n, half = self.q.shape if self.q.ndim == 2 else (0, 0)
        k = 2 * half
        if self.q.dtype != np.uint8 or self.q.ndim != 2:
            raise ModelError(f"Q4 values are uint8 [N, K / 2]; got {self.q.dtype} {list(self.q.shape)}")
        if self.group < 2 or self.group % 2 or k % self.group:
            raise ModelError(f"Q4 group {self.group} must be even and divide K={k}")
        want = (n, k // self.group)
        for what, a in (("scale", self.scale), ("offset", self.offset)):
            if a.dtype != np.float32 or a.shape != want:
                raise ModelError(f"Q4 {what} is {a.dtype} {list(a.shape)}; expected float32 {list(want)}")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), 2 * int(self.q.shape[1]))

    def values(self) -> np.ndarray:
        """The 4-bit values as uint8 ``[N, K]``."""
        lo, hi = self.q & 15, self.q >> 4
        return np.stack([lo, hi], axis=-1).reshape(self.q.shape[0], -1)

    def dequantize(self) -> np.ndarray:
        n, k = self.shape
        v = self.values().reshape(n, k // self.group, self.group).astype(np.float32)
        w = v * self.scale[:, :, None] + self.offset[:, :, None]
        return w.reshape(n, k)

    @property
    def nbytes(self) -> int:
        """Bytes a kernel streams: the values, the scales, and the offsets unless symmetric."""
        return int(self.q.nbytes + self.scale.nbytes + (0 if self.symmetric else self.offset.nbytes))


@dataclass(frozen=True, eq=False)
class Q8:
    """8-bit weights in groups: ``w[n, k] = q[n, k] * scale[n, k // group]`` (``q`` int8 ``[N, K]``,
    ``scale`` float32 ``[N, K // group]``)."""

    q: np.ndarray
    scale: np.ndarray
    group: int

    def __post_init__(self) -> None:
        if self.q.dtype != np.int8 or self.q.ndim != 2:
            raise ModelError(f"Q8 values are int8 [N, K]; got {self.q.dtype} {list(self.q.shape)}")
        n, k = self.q.shape
        if self.group < 1 or k % self.group:
            raise ModelError(f"Q8 group {self.group} must divide K={k}")
        if self.scale.dtype != np.float32 or self.scale.shape != (n, k // self.group):
            raise ModelError(f"Q8 scale is {self.scale.dtype} {list(self.scale.shape)}; expected float32 "
                             f"{[n, k // self.group]}")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def dequantize(self) -> np.ndarray:
        n, k = self.shape
        v = self.q.reshape(n, k // self.group, self.group).astype(np.float32)
        return (v * self.scale[:, :, None]).reshape(n, k)

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + self.scale.nbytes)


Weight = Dense | Q4 | Q8


def weight_shape(w: Weight) -> tuple[int, int]:
    return w.shape


def default_inv_freq(theta: float, head_dim: int) -> np.ndarray:
    """Plain RoPE's inverse frequencies ``1 / theta ** (2i / head_dim)``, float32 as transformers computes
    them: the exponent and the reciprocal in float32, the power correctly rounded (in float64, then to
    float32), as torch's float32 power gives it at all but rare frequencies (numpy's float32 power is up to
    an ulp off at a fifth of them)."""
    e = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    power = (np.float64(np.float32(theta)) ** e.astype(np.float64)).astype(np.float32)
    return (np.float32(1) / power).astype(np.float32)


@dataclass(frozen=True)
class DecoderConfig:
    """The shape of a LLaMA-family decoder (LLaMA, Mistral, Qwen2, Phi-3, Gemma).

    ``norm_offset``: RMSNorm multiplies by ``norm_offset + gamma`` (Gemma: 1); ``embed_scale``: the token
    embedding is multiplied by it (Gemma: sqrt(hidden)); ``act``: "silu" or "gelu_tanh" on the gate;
    ``sliding_window``: a token attends to at most that many positions (itself included), 0 = all;
    ``rope_inv_freq``: the rotary inverse frequencies (head_dim / 2 of them) when a scaling rule (LLaMA 3's,
    linear, ...) changes them, else None (``theta ** (-2i / head_dim)``)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_context: int = 2048
    sliding_window: int = 0
    tie_embeddings: bool = False
    act: str = "silu"
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    family: str = "llama"
    bos: int | None = None
    eos: tuple[int, ...] = ()
    rope_inv_freq: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ModelError(f"{self.heads} attention heads are not a multiple of {self.kv_heads} key/value heads")
        if self.head_dim % 2:
            raise ModelError(f"head_dim {self.head_dim} must be even (rotary pairs)")
        if self.rope_inv_freq is not None and len(self.rope_inv_freq) != self.head_dim // 2:
            raise ModelError(f"{len(self.rope_inv_freq)} rotary frequencies for head_dim {self.head_dim}; expected "
                             f"{self.head_dim // 2}")
        if self.act not in ("silu", "gelu_tanh"):
            raise ModelError(f"activation {self.act!r}: cuvil's decoders take 'silu' or 'gelu_tanh'")


@dataclass(frozen=True, eq=False)
class LayerWeights:
    """One decoder layer: RMSNorm gammas (float32 [hidden]), the projections ``[N, K]`` and optional
    q/k/v biases (Qwen2)."""

    attn_norm: np.ndarray
    q: Weight
    k: Weight
    v: Weight
    o: Weight
    ffn_norm: np.ndarray
    gate: Weight
    up: Weight
    down: Weight
    q_bias: np.ndarray | None = None
    k_bias: np.ndarray | None = None
    v_bias: np.ndarray | None = None


@dataclass(frozen=True, eq=False)
class DecoderWeights:
    """A whole decoder: ``embed`` is float32 [vocab, hidden] (or a quantized weight of that shape);
    ``head`` is the output projection [vocab, hidden] (the embedding's matrix when tied)."""

    config: DecoderConfig
    embed: Weight
    layers: tuple[LayerWeights, ...]
    norm: np.ndarray
    head: Weight
    source: str = field(default="")

    def __post_init__(self) -> None:
        c = self.config
        if len(self.layers) != c.layers:
            raise ModelError(f"{len(self.layers)} layers of weights for a config of {c.layers}")
        if self.embed.shape != (c.vocab, c.hidden):
            raise ModelError(f"token embedding is {list(self.embed.shape)}; expected {[c.vocab, c.hidden]}")
        if self.head.shape != (c.vocab, c.hidden):
            raise ModelError(f"output head is {list(self.head.shape)}; expected {[c.vocab, c.hidden]}")
        q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
        want = {"q": (q, c.hidden), "k": (kv, c.hidden), "v": (kv, c.hidden), "o": (c.hidden, q),
                "gate": (c.ffn, c.hidden), "up": (c.ffn, c.hidden), "down": (c.hidden, c.ffn)}
        for i, layer in enumerate(self.layers):
            for name, shape in want.items():
                got = getattr(layer, name).shape
                if got != shape:
                    raise ModelError(f"layer {i}: weight {name} is {list(got)}; expected {list(shape)}")
            for name in ("attn_norm", "ffn_norm"):
                g = getattr(layer, name)
                if g.dtype != np.float32 or g.shape != (c.hidden,):
                    raise ModelError(f"layer {i}: {name} is {g.dtype} {list(g.shape)}; expected float32 "
                                     f"[{c.hidden}]")

    def with_linears(self, f: Callable[[str, Weight], Weight]) -> DecoderWeights:
        """The same model with every projection (and the head) replaced by ``f(name, weight)``."""
        names = ("q", "k", "v", "o", "gate", "up", "down")
        layers = tuple(replace(L, **{n: f(f"layers.{i}.{n}", getattr(L, n)) for n in names})
                       for i, L in enumerate(self.layers))
        return replace(self, layers=layers, head=f("head", self.head))

    @property
    def nbytes(self) -> int:
        """Bytes of the weights a decode step streams (the projections and the head)."""
        total = self.head.nbytes
        for L in self.layers:
            total += sum(getattr(L, n).nbytes for n in ("q", "k", "v", "o", "gate", "up", "down"))
        return int(total)


def stack(*weights: Weight) -> Weight:
    """One weight whose outputs are those of ``weights`` in order (the fused q/k/v or gate/up projection of a
    layer): all of one form, with the same K (and group)."""
    first = weights[0]
    if any(type(w) is not type(first) or w.shape[1] != first.shape[1] for w in weights):
        raise ModelError("weights stacked into one projection must share their form and input size; got "
                         + ", ".join(f"{type(w).__name__} {list(w.shape)}" for w in weights))
    if isinstance(first, Dense):
        return Dense(np.concatenate([w.w for w in weights]))
    if isinstance(first, Q4):
        if any(w.group != first.group for w in weights):
            raise ModelError("4-bit weights stacked into one projection must share their group size")
        return Q4(np.concatenate([w.q for w in weights]), np.concatenate([w.scale for w in weights]),
                  np.concatenate([w.offset for w in weights]), first.group,
                  all(w.symmetric for w in weights))
    if any(w.group != first.group for w in weights):
        raise ModelError("8-bit weights stacked into one projection must share their group size")
    return Q8(np.concatenate([w.q for w in weights]), np.concatenate([w.scale for w in weights]), first.group)
