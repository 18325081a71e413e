"""GGUF files (llama.cpp) -> :class:`~cuvil.llm.weights.DecoderWeights`.

The file is parsed here (header, metadata, tensor table; little-endian GGUF v2/v3), so that a malformed
file is refused with a :class:`ModelError` naming the tensor; the ``gguf`` package is needed only to write
files (tests).

Tensor types and what they become (all exact: the dequantized weight equals ggml's dequantization):

=========  ===================================================================================
F32/F16    :class:`Dense`
BF16       :class:`Dense`
Q8_0       :class:`Q8`, group 32 (blocks: f16 ``d``, 32 int8)
Q4_0       :class:`Q4`, group 32, symmetric (blocks: f16 ``d``, 16 bytes; element ``j`` in the low nibble
           of byte ``j``, element ``j + 16`` in its high nibble: reordered to consecutive pairs)
Q4_1       :class:`Q4`, group 32, offset ``m``
Q5_0       :class:`Q8`, group 32 (``q - 16`` fits int8)
Q4_K       :class:`Q4`, group 32: per 256-block f16 ``d``, ``dmin``, twelve bytes of 6-bit sub-block
           scales and minimums; ``scale = d * sc``, ``offset = -(dmin * m)``
Q6_K       :class:`Q8`, group 16: ``scale = d * sc``, values ``q - 32``
=========  ===================================================================================

RoPE scaling: LLaMA 3's per-frequency factors (the ``rope_freqs.weight`` tensor) and linear scaling
(``{arch}.rope.scaling.factor``) become ``DecoderConfig.rope_inv_freq`` as llama.cpp applies them; yarn and
longrope are refused.

Architectures: ``llama`` (which llama.cpp also writes for Mistral) and ``qwen2``.  llama.cpp's
``convert_hf_to_gguf`` permutes the rows of ``attn_q`` and ``attn_k`` of ``llama`` models so that each
head's rotary pairs are adjacent (rows ``(i, i + d/2)`` of HF's layout become rows ``(2i, 2i + 1)``);
``from_gguf`` undoes it, so the weights are in HF's layout (rotate-half rotary).  A row reorder is exact
for quantized rows too.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cuvil.errors import ModelError, UnsupportedOpError
from cuvil.llm.weights import Q4, Q8, DecoderConfig, DecoderWeights, Dense, LayerWeights, Weight, default_inv_freq

__all__ = ["from_gguf", "read_gguf", "GGUFFile", "GGUFTensor", "SUPPORTED_ARCHITECTURES", "unpermute_rotary"]

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
_PERMUTED = ("llama",)  # architectures whose attn_q / attn_k rows llama.cpp's converter permutes

# ggml type id -> (name, elements per block, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
    28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
}
_LOADABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K")


# ------------------------------------------------------------------------------------------- the file

@dataclass(frozen=True, eq=False)
class GGUFTensor:
    """One tensor: ``shape`` in numpy order (``[N, K]`` for a weight: GGUF lists ``ne0 = K`` first) and
    its raw bytes (a read-only view of the file)."""

    name: str
    type: str
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True, eq=False)
class GGUFFile:
    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]


class _Cursor:
    def __init__(self, buf: np.ndarray, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > len(self.buf):
            raise ModelError(f"{self.path}: truncated GGUF file (in {what} at byte {self.pos})")
        b = self.buf[self.pos:self.pos + n].tobytes()
        self.pos += n
        return b

    def unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.unpack("Q", what)
        return self.take(n, what).decode("utf-8", errors="replace")


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NP_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8",
               11: "<i8", 12: "<f8"}


def _value(cur: _Cursor, vtype: int, key: str) -> Any:
    if vtype in _SCALARS:
        return cur.unpack(_SCALARS[vtype], f"metadata {key}")
    if vtype == 8:
        return cur.string(f"metadata {key}")
    if vtype == 9:
        etype, count = cur.unpack("I", f"metadata {key}"), cur.unpack("Q", f"metadata {key}")
        if etype in _NP_SCALARS:
            size = np.dtype(_NP_SCALARS[etype]).itemsize
            return np.frombuffer(cur.take(size * count, f"metadata {key}"), dtype=_NP_SCALARS[etype])
        return [_value(cur, etype, key) for _ in range(count)]
    raise ModelError(f"{cur.path}: metadata {key} has an unknown value type {vtype}")


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF file's header, metadata and tensor table; the tensors' bytes are memory-mapped.
    Raises :class:`ModelError` (naming the tensor where there is one) for a file that is not GGUF, is
    truncated, or lists a tensor of an unknown type or a size that does not fit its type's blocks."""
    p = str(path)
    if not os.path.isfile(p):
        raise ModelError(f"{p}: no such GGUF file")
    size = os.path.getsize(p)
    buf = np.memmap(p, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    cur = _Cursor(buf, p)
    if cur.take(4, "the magic number") != b"GGUF":
        raise ModelError(f"{p}: not a GGUF file (no 'GGUF' magic number)")
    version = cur.unpack("I", "the version")
    if version not in (2, 3):
        raise ModelError(f"{p}: GGUF version {version} (big-endian or unknown); cuvil reads little-endian v2/v3")
    n_tensors, n_kv = cur.unpack("Q", "the header"), cur.unpack("Q", "the header")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("a metadata key")
        metadata[key] = _value(cur, cur.unpack("I", f"metadata {key}"), key)
    infos = []
    for _ in range(n_tensors):
        name = cur.string("a tensor name")
        n_dims = cur.unpack("I", f"tensor {name}")
        dims = [cur.unpack("Q", f"tensor {name}") for _ in range(n_dims)]
        tid, offset = cur.unpack("I", f"tensor {name}"), cur.unpack("Q", f"tensor {name}")
        infos.append((name, dims, tid, offset))
    align = int(metadata.get("general.alignment", 32))
    start = (cur.pos + align - 1) // align * align
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, tid, offset in infos:
        if tid not in GGML_TYPES:
            raise ModelError(f"{p}: tensor {name} has unknown ggml type id {tid}")
        tname, block, nbytes = GGML_TYPES[tid]
        n = math.prod(dims)
        if dims and dims[0] % block:
            raise ModelError(f"{p}: tensor {name} ({tname}) has rows of {dims[0]} values, not a multiple of "
                             f"its {block}-value blocks")
        length = n // block * nbytes
        if start + offset + length > size:
            raise ModelError(f"{p}: tensor {name} ({tname}, {list(reversed(dims))}) runs past the end of the "
                             f"file (truncated?)")
        data = buf[start + offset:start + offset + length]
        tensors[name] = GGUFTensor(name, tname, tuple(int(d) for d in reversed(dims)), data)
    return GGUFFile(p, version, metadata, tensors)


# -------------------------------------------------------------------------------------- tensor formats

def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _blocks(t: GGUFTensor, nbytes: int) -> np.ndarray:
    """The tensor's bytes as ``[rows, blocks per row, bytes per block]``."""
    rows = math.prod(t.shape[:-1])
    return np.asarray(t.data).reshape(rows, -1, nbytes)


def tensor_weight(t: GGUFTensor, path: str = "") -> Weight:
    """A 2-D GGUF tensor as a :class:`Weight` ``[N, K]`` (see the module docstring for the types)."""
    if len(t.shape) != 2:
        raise ModelError(f"{path}: tensor {t.name} is {list(t.shape)}; expected a matrix")
    n, k = t.shape
    if t.type in ("F32", "F16", "BF16"):
        return Dense(_float(t))
    if t.type == "Q8_0":
        b = _blocks(t, 34)
        return Q8(q=np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, k), scale=_f16(b[..., :2])[..., 0],
                  group=32)
    if t.type in ("Q4_0", "Q4_1"):
        head = 2 if t.type == "Q4_0" else 4
        b = _blocks(t, 16 + head)
        qs = b[..., head:]                                        # [n, blocks, 16]
        v = np.concatenate([qs & 15, qs >> 4], axis=-1)           # element j: low nibble j; j + 16: high
        q = (v[..., 0::2] | (v[..., 1::2] << 4)).reshape(n, k // 2).astype(np.uint8)
        d = _f16(b[..., :2])[..., 0]
        if t.type == "Q4_0":
            return Q4(q=q, scale=d, offset=(np.float32(-8) * d).astype(np.float32), group=32, symmetric=True)
        return Q4(q=q, scale=d, offset=_f16(b[..., 2:4])[..., 0], group=32)
    if t.type == "Q5_0":
        b = _blocks(t, 22)
        d = _f16(b[..., :2])[..., 0]
        qh = np.ascontiguousarray(b[..., 2:6]).view("<u4")[..., 0]                  # [n, blocks]
        high = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        qs = b[..., 6:]
        v = np.concatenate([qs & 15, qs >> 4], axis=-1) | (high << 4)
        return Q8(q=(v.astype(np.int16) - 16).astype(np.int8).reshape(n, k), scale=d, group=32)
    if t.type == "Q4_K":
        b = _blocks(t, 144)                                       # [n, blocks of 256, 144]
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])            # [n, blocks, 1]
        sc, m = _k_scale_min(b[..., 4:16])                        # [n, blocks, 8]
        qs = b[..., 16:].reshape(n, -1, 4, 32)                    # sub-blocks 2c / 2c + 1: low / high nibbles
        v = np.stack([qs & 15, qs >> 4], axis=-2).reshape(n, -1, 8, 32)
        q = (v[..., 0::2] | (v[..., 1::2] << 4)).reshape(n, k // 2).astype(np.uint8)
        scale = (d * sc.astype(np.float32)).reshape(n, k // 32)
        offset = -(dmin * m.astype(np.float32)).reshape(n, k // 32)
        return Q4(q=q, scale=scale.astype(np.float32), offset=offset.astype(np.float32), group=32)
    if t.type == "Q6_K":
        b = _blocks(t, 210)
        ql, qh = b[..., :128].reshape(n, -1, 2, 64), b[..., 128:192].reshape(n, -1, 2, 32)
        sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)  # [n, blocks, 16]
        d = _f16(b[..., 208:210])
        low = np.concatenate([ql & 15, ql >> 4], axis=-1)                             # [n, blocks, 2, 128]
        high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)         # [n, blocks, 2, 128]
        v = (low | (high << 4)).astype(np.int16) - 32
        return Q8(q=v.astype(np.int8).reshape(n, k), scale=(d * sc).reshape(n, k // 16).astype(np.float32),
                  group=16)
    raise ModelError(f"{path}: tensor {t.name} has type {t.type}, which cuvil does not load; it loads "
                     f"{', '.join(_LOADABLE)}")


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and minimums packed in a K-quant's twelve bytes: bytes 0-3 hold scales 0-3
    (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 likewise the minimums; bytes 8-11 the low 4
    bits of scales 4-7 (low nibble) and of minimums 4-7 (high nibble)."""
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    m = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, m


def _float(t: GGUFTensor) -> np.ndarray:
    raw = np.ascontiguousarray(t.data)
    if t.type == "F32":
        a = raw.view("<f4").astype(np.float32)
    elif t.type == "F16":
        a = raw.view("<f2").astype(np.float32)
    elif t.type == "BF16":
        a = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        raise ModelError(f"tensor {t.name} has type {t.type}; expected F32, F16 or BF16")
    return a.reshape(t.shape)


def unpermute_rotary(w: Weight | np.ndarray, heads: int) -> Weight | np.ndarray:
    """Undo llama.cpp's q/k row permutation: GGUF row ``h*d + 2i + s`` is HF row ``h*d + s*d/2 + i``.
    Rows of a :class:`Q4`/:class:`Q8` move with their scales and offsets (exact)."""
    n = w.shape[0]
    d = n // heads
    perm = np.arange(n).reshape(heads, d // 2, 2).swapaxes(1, 2).reshape(-1)
    if isinstance(w, np.ndarray):
        return np.ascontiguousarray(w[perm])
    if isinstance(w, Dense):
        return Dense(np.ascontiguousarray(w.w[perm]))
    if isinstance(w, Q4):
        return Q4(q=np.ascontiguousarray(w.q[perm]), scale=np.ascontiguousarray(w.scale[perm]),
                  offset=np.ascontiguousarray(w.offset[perm]), group=w.group, symmetric=w.symmetric)
    return Q8(q=np.ascontiguousarray(w.q[perm]), scale=np.ascontiguousarray(w.scale[perm]), group=w.group)


def permute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (the inverse of :func:`unpermute_rotary`), for tests and writers."""
    n = w.shape[0]
    d = n // heads
    perm = np.arange(n).reshape(heads, 2, d // 2).swapaxes(1, 2).reshape(-1)
    return np.ascontiguousarray(w[perm])


# ------------------------------------------------------------------------------------------- the model

def from_gguf(path: str | os.PathLike, max_context: int | None = None,
              transform: Callable[[str, np.ndarray], Weight] | None = None) -> DecoderWeights:
    """Load a llama-family GGUF file as :class:`DecoderWeights`, keeping each tensor's quantization
    (see the module docstring).  ``max_context`` overrides ``{arch}.context_length``.

    ``transform(name, w)``, when given, makes each float (F32/F16/BF16) projection and the output head
    from its float32 ``[N, K]`` array (names as :meth:`DecoderWeights.with_linears`: ``"layers.3.q"``,
    ``"head"``; a tied head is made from the embedding's matrix) as it is read, so that a quantizer never
    holds more than one float32 tensor; quantized tensors and the embedding stay as stored."""
    f = read_gguf(path)
    arch = f.metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(f"{f.path}: GGUF architecture {arch!r} is not supported by cuvil.llm; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    r = _Reader(f, arch, transform)
    c = _config(r, max_context)
    layers = [_layer(r, c, i) for i in range(c.layers)]
    H, vocab = c.hidden, c.vocab
    embed = r.weight("token_embd.weight", (vocab, H))
    if not c.tie_embeddings:
        head = r.weight("output.weight", (vocab, H), "head")
    elif transform is not None and isinstance(embed, Dense):
        head = transform("head", embed.w)
    else:
        head = embed
    return DecoderWeights(config=c, embed=embed, layers=tuple(layers), norm=r.vector("output_norm.weight", H),
                          head=head, source=str(Path(f.path)))


class _Reader:
    """A GGUF file's metadata and tensors as :func:`from_gguf` reads them, each lookup checked."""

    def __init__(self, f: GGUFFile, arch: str, transform: Callable[[str, np.ndarray], Weight] | None):
        self.f, self.md, self.p, self.arch, self.transform = f, f.metadata, f.path, arch, transform

    def meta(self, key: str, default: Any = None) -> Any:
        """``{arch}.{key}`` (one value for every layer), ``default`` when absent; an error when that is None."""
        v = self.md.get(f"{self.arch}.{key}", default)
        if v is None:
            raise ModelError(f"{self.p}: GGUF metadata has no {self.arch}.{key}")
        if isinstance(v, np.ndarray):
            if v.size == 0 or np.any(v != v.flat[0]):
                raise UnsupportedOpError(f"{self.p}: {self.arch}.{key} differs between layers ({v.tolist()}); "
                                         f"cuvil.llm takes one value for every layer")
            v = v.flat[0].item()
        return v

    def tensor(self, name: str) -> GGUFTensor:
        if name not in self.f.tensors:
            raise ModelError(f"{self.p}: tensor {name} is missing")
        return self.f.tensors[name]

    def vector(self, name: str, size: int) -> np.ndarray:
        t = self.tensor(name)
        if t.shape != (size,):
            raise ModelError(f"{self.p}: tensor {name} is {list(t.shape)}; expected [{size}]")
        if t.type not in ("F32", "F16", "BF16"):
            raise ModelError(f"{self.p}: tensor {name} has type {t.type}; a norm or bias is F32, F16 or BF16")
        return np.ascontiguousarray(_float(t), dtype=np.float32)

    def weight(self, name: str, shape: tuple[int, int], as_: str | None = None) -> Weight:
        """A projection (``transform``-ed as ``as_`` when it is stored as floats), as stored otherwise."""
        t = self.tensor(name)
        if t.shape != shape:
            raise ModelError(f"{self.p}: tensor {name} is {list(t.shape)}; expected {list(shape)}")
        if self.transform is not None and as_ is not None and t.type in ("F32", "F16", "BF16"):
            return self.transform(as_, _float(t))
        return tensor_weight(t, self.p)

    def bias(self, name: str, size: int) -> np.ndarray | None:
        return self.vector(name, size) if name in self.f.tensors else None


def _config(r: _Reader, max_context: int | None) -> DecoderConfig:
    """The decoder's shape, RoPE, tokens and context from the metadata (and the embedding's shape)."""
    md, p, arch, meta = r.md, r.p, r.arch, r.meta
    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    kv_heads = int(meta("attention.head_count_kv", heads))
    head_dim = int(md.get(f"{arch}.attention.key_length", hidden // heads))
    rot = int(md.get(f"{arch}.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise UnsupportedOpError(f"{p}: rotary on {rot} of {head_dim} head dimensions is not supported")
    theta = float(meta("rope.freq_base", 10000.0))
    inv_freq = _rope_inv_freq(r.f, arch, theta, head_dim)
    embed_t = r.tensor("token_embd.weight")
    if len(embed_t.shape) != 2 or embed_t.shape[1] != hidden:
        raise ModelError(f"{p}: tensor token_embd.weight is {list(embed_t.shape)}; expected [vocab, {hidden}]")
    eos = tuple(dict.fromkeys(int(md[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
                              if md.get(k) is not None))
    bos = md.get("tokenizer.ggml.bos_token_id")
    return DecoderConfig(
        vocab=embed_t.shape[0], hidden=hidden, layers=int(meta("block_count")), heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, ffn=int(meta("feed_forward_length")),
        rope_theta=theta,
        rms_eps=_f32_value(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        max_context=int(max_context or meta("context_length", 2048)),
        sliding_window=int(md.get(f"{arch}.attention.sliding_window", 0) or 0),
        tie_embeddings="output.weight" not in r.f.tensors,
        family=str(arch),
        bos=None if bos is None else int(bos),
        eos=eos,
        rope_inv_freq=None if inv_freq is None else tuple(float(x) for x in inv_freq),
    )


def _layer(r: _Reader, c: DecoderConfig, i: int) -> LayerWeights:
    """Layer ``i``'s tensors (``blk.{i}.*``), q and k rows back in rotate-half order where the converter
    permuted them."""
    H, q_rows, kv_rows = c.hidden, c.heads * c.head_dim, c.kv_heads * c.head_dim
    b, n = f"blk.{i}.", f"layers.{i}."
    q, k = r.weight(b + "attn_q.weight", (q_rows, H), n + "q"), r.weight(b + "attn_k.weight", (kv_rows, H), n + "k")
    qb, kb = r.bias(b + "attn_q.bias", q_rows), r.bias(b + "attn_k.bias", kv_rows)
    if r.arch in _PERMUTED:
        q, k = unpermute_rotary(q, c.heads), unpermute_rotary(k, c.kv_heads)
        qb = None if qb is None else unpermute_rotary(qb, c.heads)
        kb = None if kb is None else unpermute_rotary(kb, c.kv_heads)
    return LayerWeights(
        attn_norm=r.vector(b + "attn_norm.weight", H),
        q=q, k=k, v=r.weight(b + "attn_v.weight", (kv_rows, H), n + "v"),
        o=r.weight(b + "attn_output.weight", (H, q_rows), n + "o"),
        ffn_norm=r.vector(b + "ffn_norm.weight", H),
        gate=r.weight(b + "ffn_gate.weight", (c.ffn, H), n + "gate"),
        up=r.weight(b + "ffn_up.weight", (c.ffn, H), n + "up"),
        down=r.weight(b + "ffn_down.weight", (H, c.ffn), n + "down"),
        q_bias=qb, k_bias=kb, v_bias=r.bias(b + "attn_v.bias", kv_rows),
    )


def _rope_inv_freq(f: GGUFFile, arch: str, theta: float, head_dim: int) -> np.ndarray | None:
    """The rotary inverse frequencies when the file scales them, as llama.cpp applies the scaling: the
    angle of frequency ``i`` at position ``p`` is ``p * theta ** (-2i / head_dim) / rope_freqs[i] * s``
    (``rope_freqs.weight``: LLaMA 3's per-frequency factors, written by ``convert_hf_to_gguf``; ``s = 1 /
    {arch}.rope.scaling.factor``, or the older ``{arch}.rope.scale_linear``, for linear scaling).  None for
    plain RoPE; other scaling types (yarn, longrope) raise :class:`UnsupportedOpError`."""
    md, p = f.metadata, f.path
    kind = md.get(f"{arch}.rope.scaling.type") or "linear"  # llama.cpp's default: the factor scales linearly
    if kind not in ("none", "linear"):
        raise UnsupportedOpError(f"{p}: RoPE scaling {kind!r} ({arch}.rope.scaling.type) is not supported; "
                                 f"cuvil.llm takes 'linear' and LLaMA 3's rope_freqs.weight factors")
    attn = md.get(f"{arch}.rope.scaling.attn_factor")
    if attn not in (None, 1, 1.0):
        raise UnsupportedOpError(f"{p}: {arch}.rope.scaling.attn_factor {attn} is not supported")
    factor = md.get(f"{arch}.rope.scaling.factor") or md.get(f"{arch}.rope.scale_linear") or 0.0
    freqs = f.tensors.get("rope_freqs.weight")
    if freqs is None and float(factor) in (0.0, 1.0):
        return None
    inv = default_inv_freq(theta, head_dim)
    if freqs is not None:
        if freqs.shape != (head_dim // 2,) or freqs.type not in ("F32", "F16", "BF16"):
            raise ModelError(f"{p}: tensor rope_freqs.weight is {freqs.type} {list(freqs.shape)}; expected float "
                             f"[{head_dim // 2}] (one factor per rotary frequency)")
        ff = _float(freqs).astype(np.float32)
        if not np.all(np.isfinite(ff)) or np.any(ff <= 0):
            raise ModelError(f"{p}: tensor rope_freqs.weight holds factors that are not positive: {ff.tolist()}")
        inv = (inv / ff).astype(np.float32)
    if float(factor) not in (0.0, 1.0):
        inv = (inv * (np.float32(1) / np.float32(factor))).astype(np.float32)
    return inv


def _f32_value(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-6, not 9.99999997e-07)."""
    return float(str(np.float32(x)))
