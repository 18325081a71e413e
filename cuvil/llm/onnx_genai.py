"""onnxruntime-genai models (the output of ``python -m onnxruntime_genai.models.builder``) ->
:class:`~cuvil.llm.weights.DecoderWeights`.

The folder holds ``genai_config.json`` and ``model.onnx`` (with its external data).  The builder writes,
for a LLaMA-family model, per layer ``i`` (node names ``/model/layers.{i}/...``):

- ``input_layernorm``: ``SimplifiedLayerNormalization`` (layer 0) or ``SkipSimplifiedLayerNormalization``
  (it adds the residual; its output 3 is the sum), gamma ``model.layers.{i}.input_layernorm.weight``;
- ``attn/qkv_proj``: one ``MatMulNBits`` (or ``MatMul``) producing q, k and v concatenated (an ``Add`` of
  ``...qkv_proj.Add.bias`` after it when the model has q/k/v biases), feeding ``GroupQueryAttention``
  (rotary fused: ``do_rotary=1`` with the ``cos_cache`` / ``sin_cache`` initializers);
- ``attn/o_proj``, then ``post_attention_layernorm`` (``SkipSimplifiedLayerNormalization``);
- ``mlp/gate_proj`` -> ``Sigmoid`` and ``Mul`` (SiLU), ``mlp/up_proj``, their ``Mul``, ``mlp/down_proj``;
- and finally ``/model/layers.{L}/final_norm_layernorm`` and ``/lm_head/MatMul``.

``from_onnx_genai`` finds each piece by walking the graph from the embedding ``Gather`` of ``input_ids``
(norm -> projections -> attention -> o -> norm -> MLP -> next norm), not by tensor names.

Weights: ``MatMulNBits`` (4 bits: ``B`` uint8 ``[N, blocks, block / 2]``, element ``2i`` in the low
nibble; ``scales [N, blocks]``; optional ``zero_points``, uint8 packed two per byte low nibble first, or
float; value ``(q - zp) * scale``, ``zp`` 8 when absent) becomes :class:`Q4` with ``offset = -zp * scale``
(exact up to the float rounding of that product; ``symmetric`` when there are no zero points); 8 bits
without zero points become :class:`Q8`.  ``MatMul`` weights (ONNX's ``[K, N]``) are transposed into
:class:`Dense`.  The RoPE base is not in ``genai_config.json``: it is recovered from the rotary caches
(the simplest decimal consistent with every frequency).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from cuvil.errors import ModelError, UnsupportedOpError
from cuvil.llm.gguf import unpermute_rotary
from cuvil.llm.weights import Q4, Q8, DecoderConfig, DecoderWeights, Dense, LayerWeights, Weight

__all__ = ["from_onnx_genai"]

_NORMS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")
_MATMULS = ("MatMulNBits", "MatMul")
_ATTENTION = ("GroupQueryAttention",)


def from_onnx_genai(folder: str | os.PathLike, max_context: int | None = None) -> DecoderWeights:
    """Load an onnxruntime-genai model folder as :class:`DecoderWeights`, keeping its int4 weights.

    Raises :class:`ModelError` naming the node or tensor when the graph is not the builder's decoder
    (a missing initializer, an unexpected op), and :class:`UnsupportedOpError` for what cuvil's decoder
    lacks (attention soft-capping, scaled RoPE, quantized embeddings)."""
    folder = Path(folder)
    cfg_path = folder / "genai_config.json"
    if not cfg_path.is_file():
        raise ModelError(f"{folder}: no genai_config.json (expected an onnxruntime-genai model folder)")
    gc = json.loads(cfg_path.read_text())
    model_cfg = gc.get("model", {})
    dec = model_cfg.get("decoder", {})
    path = folder / dec.get("filename", "model.onnx")
    if not path.is_file():
        raise ModelError(f"{folder}: genai_config.json names {path.name}, which is missing")
    import onnx

    try:
        proto = onnx.load(str(path))
    except Exception as e:  # noqa: BLE001 - onnx raises many types for a damaged file
        raise ModelError(f"{path}: unreadable ONNX model ({e})") from None
    g = _Graph(proto.graph, str(path))
    return _walk(g, dec, model_cfg, max_context)


class _Graph:
    def __init__(self, graph: Any, path: str) -> None:
        from onnx import numpy_helper

        self.path = path
        self._to_array = numpy_helper.to_array
        self.inits = {t.name: t for t in graph.initializer}
        self.producer: dict[str, Any] = {}
        self.consumers: dict[str, list[Any]] = {}
        self.constants: dict[str, Any] = {}
        for n in graph.node:
            for o in n.output:
                if o:
                    self.producer[o] = n
            for i in n.input:
                if i:
                    self.consumers.setdefault(i, []).append(n)
            if n.op_type == "Constant":
                for a in n.attribute:
                    if a.name == "value":
                        self.constants[n.output[0]] = a.t

    def error(self, node: Any, msg: str) -> ModelError:
        return ModelError(f"{self.path}: node {node.name} ({node.op_type}): {msg}")

    def array(self, node: Any, index: int, what: str, through_reshape: bool = False) -> np.ndarray:
        """Input ``index`` of ``node``, which must be an initializer (or a Constant; with ``through_reshape``
        also a Reshape of one, whose data is returned as stored)."""
        name = node.input[index] if index < len(node.input) else ""
        if not name:
            raise self.error(node, f"has no {what} (input {index})")
        src = self.producer.get(name)
        if through_reshape and src is not None and src.op_type == "Reshape" and self.is_const(src.input[0]):
            return self.array(src, 0, what)
        t = self.inits.get(name) or self.constants.get(name)
        if t is None:
            src = self.producer.get(name)
            how = f"computed by {src.op_type} node {src.name}" if src is not None else "missing"
            raise self.error(node, f"its {what} initializer {name} (input {index}) is {how}")
        try:
            return self._to_array(t, base_dir=os.path.dirname(self.path))
        except Exception as e:  # noqa: BLE001 - a damaged initializer (external data missing, ...)
            raise self.error(node, f"its {what} initializer {name} is unreadable ({e})") from None

    def is_const(self, name: str) -> bool:
        return name in self.inits or name in self.constants

    def users(self, name: str, ops: tuple[str, ...]) -> list[Any]:
        return [n for n in self.consumers.get(name, []) if n.op_type in ops]

    def one_user(self, name: str, ops: tuple[str, ...], after: Any, what: str) -> Any:
        found = self.users(name, ops)
        if len(found) != 1:
            got = sorted({f"{n.op_type} {n.name}" for n in self.consumers.get(name, [])})
            raise self.error(after, f"expected one {'/'.join(ops)} ({what}) reading its output {name}; "
                                    f"found {got or 'none'}")
        return found[0]


def _attr(node: Any, name: str, default: Any = None) -> Any:
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            v = helper.get_attribute_value(a)
            return v.decode() if isinstance(v, bytes) else v
    return default


def _f32_value(x: float) -> float:
    return float(str(np.float32(x)))


# ------------------------------------------------------------------------------------------- weights

def _weight(g: _Graph, node: Any) -> Weight:
    """A MatMul / MatMulNBits node's weight as ``[N, K]``."""
    if node.op_type == "MatMul":
        w = g.array(node, 1, "weight")
        if w.ndim != 2:
            raise g.error(node, f"weight is {list(w.shape)}; expected [K, N]")
        return Dense(np.ascontiguousarray(w.T, dtype=np.float32))
    if node.op_type != "MatMulNBits":
        raise g.error(node, "expected a MatMul or MatMulNBits projection")
    k, n, bits, block = (_attr(node, a) for a in ("K", "N", "bits", "block_size"))
    if None in (k, n, bits, block):
        raise g.error(node, "lacks one of the attributes K, N, bits, block_size")
    if len(node.input) > 4 and node.input[4]:
        raise g.error(node, "has a g_idx input (act-order); cuvil reads plain block quantization")
    return _blockwise(g, node, 1, 2, 3, n, k, bits, block)


def _blockwise(g: _Graph, node: Any, data: int, scales: int, zero_points: int, n: int, k: int, bits: int,
               block: int) -> Weight:
    """Block-quantized rows (MatMulNBits' ``B`` or GatherBlockQuantized's ``data``: uint8 ``[n, k * bits / 8]``,
    4-bit values low nibble first) with their scales ``[n, k / block]`` and optional zero points (uint8
    packed, or float), value ``(q - zp) * scale`` with ``zp`` 8 (4 bits) or 128 (8 bits) when absent."""
    if bits not in (4, 8):
        raise UnsupportedOpError(f"{g.path}: node {node.name}: {bits}-bit weights (cuvil reads 4 and 8)")
    if k % block:
        raise g.error(node, f"K={k} is not a multiple of block_size {block} (padded blocks)")
    blocks = k // block
    b = g.array(node, data, "quantized data", through_reshape=True)
    if b.dtype != np.uint8 or b.size != n * k * bits // 8:
        raise g.error(node, f"quantized data ({node.input[data]}) is {b.dtype} {list(b.shape)}; expected "
                            f"{n * k * bits // 8} uint8 bytes ([{n}, {blocks}, {block * bits // 8}])")
    scale = g.array(node, scales, "scales").astype(np.float32)
    if scale.size != n * blocks:
        raise g.error(node, f"scales ({node.input[scales]}) has {scale.size} values; expected {n} x {blocks}")
    scale = np.ascontiguousarray(scale.reshape(n, blocks))
    zp = None
    if len(node.input) > zero_points and node.input[zero_points]:
        z = g.array(node, zero_points, "zero_points")
        if z.dtype == np.uint8:
            per_row = (blocks * bits + 7) // 8
            if z.size != n * per_row:
                raise g.error(node, f"zero_points ({node.input[zero_points]}) has {z.size} bytes; expected "
                                    f"{n} x {per_row}")
            z = z.reshape(n, per_row)
            if bits == 4:
                z = np.stack([z & 15, z >> 4], axis=-1).reshape(n, -1)[:, :blocks]
            zp = z.astype(np.float32)
        else:
            if z.size != n * blocks:
                raise g.error(node, f"zero_points ({node.input[zero_points]}) has {z.size} values; expected "
                                    f"{n} x {blocks}")
            zp = z.astype(np.float32).reshape(n, blocks)
    if bits == 4:
        q = np.ascontiguousarray(b.reshape(n, k // 2))
        symmetric = zp is None or bool(np.all(zp == 8))
        offset = -(np.float32(8) if zp is None else zp) * scale
        return Q4(q=q, scale=scale, offset=offset.astype(np.float32), group=block, symmetric=symmetric)
    if zp is not None and not np.all(zp == 128):
        raise UnsupportedOpError(f"{g.path}: node {node.name}: 8-bit weights with zero points (cuvil's Q8 is "
                                 f"symmetric)")
    q = (b.reshape(n, k).astype(np.int16) - 128).astype(np.int8)
    return Q8(q=q, scale=scale, group=block)


def _embedding(g: _Graph, gather: Any) -> Weight:
    """The token embedding of a Gather (float table) or GatherBlockQuantized (4/8-bit rows; the builder
    shares them with a tied lm_head through a Reshape)."""
    if gather.op_type == "Gather":
        table = g.array(gather, 0, "embedding")
        if table.ndim != 2:
            raise g.error(gather, f"embedding table is {list(table.shape)}; expected [vocab, hidden]")
        return Dense(np.ascontiguousarray(table.astype(np.float32)))
    bits, block = _attr(gather, "bits", 4), _attr(gather, "block_size", 128)
    if _attr(gather, "gather_axis", 0) != 0 or _attr(gather, "quantize_axis", 1) not in (1, -1):
        raise UnsupportedOpError(f"{g.path}: node {gather.name}: a quantized embedding gathered or quantized "
                                 f"along other axes than rows / hidden")
    scales = g.array(gather, 2, "scales")
    if scales.ndim != 2:
        raise g.error(gather, f"scales are {list(scales.shape)}; expected [vocab, hidden / block]")
    vocab, blocks = scales.shape
    return _blockwise(g, gather, 0, 2, 3, vocab, blocks * block, bits, block)


def _back_to_matmul(g: _Graph, name: str, user: Any, rotary: dict) -> tuple[Any, np.ndarray | None]:
    """The projection producing ``name`` (through a bias ``Add`` and a ``RotaryEmbedding``), and its bias."""
    bias = None
    node = g.producer.get(name)
    while node is not None and node.op_type in ("Add", "RotaryEmbedding"):
        if node.op_type == "RotaryEmbedding":
            rotary.update(cos=(node, 2), sin=(node, 3), interleaved=_attr(node, "interleaved", 0))
            name = node.input[0]
        else:
            const = [i for i, x in enumerate(node.input) if g.is_const(x)]
            if len(const) != 1:
                break
            bias = g.array(node, const[0], "bias").astype(np.float32).reshape(-1)
            if len(node.input) > 4 and node.input[4]:
                raise g.error(node, "unexpected bias input")
            name = node.input[1 - const[0]]
        node = g.producer.get(name)
    if node is None or node.op_type not in _MATMULS:
        what = "a graph input" if node is None else f"{node.op_type} node {node.name}"
        raise g.error(user, f"input {name} should come from a MatMul / MatMulNBits projection; it is {what}")
    if node.op_type == "MatMulNBits" and len(node.input) > 5 and node.input[5]:
        nb = g.array(node, 5, "bias").astype(np.float32).reshape(-1)
        bias = nb if bias is None else bias + nb
    return node, bias


def _rows(w: Weight, start: int, stop: int) -> Weight:
    if isinstance(w, Dense):
        return Dense(np.ascontiguousarray(w.w[start:stop]))
    if isinstance(w, Q4):
        return Q4(q=np.ascontiguousarray(w.q[start:stop]), scale=np.ascontiguousarray(w.scale[start:stop]),
                  offset=np.ascontiguousarray(w.offset[start:stop]), group=w.group, symmetric=w.symmetric)
    return Q8(q=np.ascontiguousarray(w.q[start:stop]), scale=np.ascontiguousarray(w.scale[start:stop]),
              group=w.group)


# --------------------------------------------------------------------------------------------- walk

def _gamma(g: _Graph, norm: Any) -> np.ndarray:
    idx = 1 if norm.op_type == "SimplifiedLayerNormalization" else 2
    return np.ascontiguousarray(g.array(norm, idx, "gamma").astype(np.float32).reshape(-1))


def _theta(g: _Graph, node: Any, cos: np.ndarray, sin: np.ndarray, head_dim: int) -> float:
    """The RoPE base behind ``cos_cache[p, j] = cos(p * theta ** (-2j / head_dim))``: the decimal with
    the fewest significant digits that reproduces every frequency to the caches' precision."""
    half = head_dim // 2
    if cos.ndim != 2 or cos.shape != sin.shape or cos.shape[1] != half or cos.shape[0] < 2:
        raise UnsupportedOpError(f"{g.path}: node {node.name}: rotary caches {list(cos.shape)} do not cover the "
                                 f"whole head ({half} frequencies; partial rotary is not supported)")
    if half < 2:
        return 10000.0
    f = np.arctan2(sin[1].astype(np.float64), cos[1].astype(np.float64))
    j = np.arange(1, half)
    tol = 16 * float(np.finfo(cos.dtype).eps)
    estimate = f[-1] ** (-head_dim / (2 * (half - 1)))
    for digits in range(1, 10):
        cand = float(f"{estimate:.{digits}g}")
        if np.all(np.abs(cand ** (-2 * j / head_dim) / f[1:] - 1) <= tol):
            return cand
    raise UnsupportedOpError(f"{g.path}: node {node.name}: the rotary caches are not plain RoPE of any base "
                             f"(scaled RoPE is not supported)")


def _walk(g: _Graph, dec: dict, model_cfg: dict, max_context: int | None) -> DecoderWeights:
    embed, gather, x, embed_scale = _embedding_input(g, dec)
    n_layers = int(dec.get("num_hidden_layers", 0))
    if n_layers < 1:
        raise ModelError(f"{g.path}: genai_config.json has no decoder.num_hidden_layers")
    norm = g.one_user(x, ("SimplifiedLayerNormalization",), gather, "the first layer's input norm")
    rotary: dict[str, Any] = {}
    layers, acts, windows, eps = [], set(), set(), _attr(norm, "epsilon", 1e-5)
    for _ in range(n_layers):
        layer, attn, act, norm = _layer(g, norm, rotary)
        layers.append(layer)
        windows.add(attn.window)
        acts.add(act)

    heads_out = g.users(norm.output[0], _MATMULS)
    if len(heads_out) != 1:
        raise g.error(norm, "its output should feed one lm_head projection (a model built with "
                            "exclude_lm_head?)")
    head = _weight(g, heads_out[0])
    cos = g.array(rotary["cos"][0], rotary["cos"][1], "cos_cache")
    sin = g.array(rotary["sin"][0], rotary["sin"][1], "sin_cache")
    head_dim = int(dec.get("head_size") or attn.head_dim)
    eos = model_cfg.get("eos_token_id")
    eos = tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    bos = model_cfg.get("bos_token_id")
    if len(windows) > 1 or len(acts) > 1:
        raise UnsupportedOpError(f"{g.path}: layers differ in their attention windows {sorted(windows)} or "
                                 f"activations {sorted(acts)}; cuvil.llm takes one for every layer")
    config = DecoderConfig(
        vocab=embed.shape[0], hidden=embed.shape[1], layers=n_layers, heads=int(attn.heads),
        kv_heads=int(attn.kv_heads), head_dim=head_dim, ffn=layers[0].gate.shape[0],
        rope_theta=_theta(g, rotary["cos"][0], cos, sin, head_dim),
        rms_eps=_f32_value(eps),
        max_context=int(max_context or model_cfg.get("context_length") or cos.shape[0]),
        sliding_window=windows.pop(),
        act=acts.pop(),
        embed_scale=embed_scale,
        family=str(model_cfg.get("type", "llama")),
        bos=None if bos is None else int(bos),
        eos=eos,
    )
    return DecoderWeights(config=config, embed=embed, layers=tuple(layers), norm=_gamma(g, norm), head=head,
                          source=g.path)


def _embedding_input(g: _Graph, dec: dict) -> tuple[Weight, Any, str, float]:
    """The embedding table, its Gather of ``input_ids``, the value the first layer reads (after a scaling
    Mul when the model has one) and that scale (1.0 without one)."""
    ids = dec.get("inputs", {}).get("input_ids", "input_ids")
    gathers = [n for n in g.consumers.get(ids, []) if n.op_type in ("Gather", "GatherBlockQuantized")]
    if len(gathers) != 1:
        raise ModelError(f"{g.path}: no embedding Gather reads {ids} (a model built with exclude_embeds?)")
    gather = gathers[0]
    embed = _embedding(g, gather)
    x = gather.output[0]
    embed_scale = 1.0
    muls = g.users(x, ("Mul",))
    if muls and any(g.is_const(i) for i in muls[0].input):
        mul = muls[0]
        c = g.array(mul, [i for i, n in enumerate(mul.input) if g.is_const(n)][0], "embedding scale")
        if c.size != 1:
            raise g.error(mul, f"embedding scale is {list(c.shape)}; expected a scalar")
        embed_scale, x = float(c.reshape(-1)[0]), mul.output[0]
    return embed, gather, x, embed_scale


class _Attention(NamedTuple):
    """One layer's GroupQueryAttention node, its shape, and its q/k/v projections (rows in rotate-half
    order) with their biases."""

    node: Any
    heads: int
    kv_heads: int
    head_dim: int
    window: int  # the sliding window (0: none)
    q: Weight
    k: Weight
    v: Weight
    q_bias: np.ndarray | None
    k_bias: np.ndarray | None
    v_bias: np.ndarray | None


def _layer(g: _Graph, norm: Any, rotary: dict) -> tuple[LayerWeights, _Attention, str, Any]:
    """The layer whose input norm is ``norm``: its weights, its attention, its MLP's activation and the next
    layer's input norm (the final norm after the last layer)."""
    attn_norm = _gamma(g, norm)
    a = _attention(g, norm, rotary)
    o_node = g.one_user(a.node.output[0], _MATMULS, a.node, "the output projection")
    post = g.one_user(o_node.output[0], ("SkipSimplifiedLayerNormalization",), o_node,
                      "the post-attention norm (an o_proj bias is not supported)")
    if len(post.output) < 4 or not post.output[3]:
        raise g.error(post, "has no residual-sum output (output 3)")
    nxt_norm = g.one_user(post.output[3], ("SkipSimplifiedLayerNormalization",), post,
                          "the next layer's norm")
    down_in = [i for i in nxt_norm.input[:2] if i != post.output[3]]
    down_node, down_bias = _back_to_matmul(g, down_in[0] if down_in else "", nxt_norm, {})
    if down_bias is not None:
        raise g.error(down_node, "has a bias (cuvil's decoder takes biases on q/k/v only)")
    gate_node, up_node, act = _mlp(g, down_node, post.output[0])
    layer = LayerWeights(
        attn_norm=attn_norm, q=a.q, k=a.k, v=a.v, o=_weight(g, o_node), ffn_norm=_gamma(g, post),
        gate=_weight(g, gate_node), up=_weight(g, up_node), down=_weight(g, down_node),
        q_bias=a.q_bias, k_bias=a.k_bias, v_bias=a.v_bias,
    )
    return layer, a, act, nxt_norm


def _attention(g: _Graph, norm: Any, rotary: dict) -> _Attention:
    """The attention fed by ``norm``'s projections (one packed q/k/v projection or three); ``rotary`` gets
    where the rotary caches are and whether pairs are interleaved."""
    h = norm.output[0]
    found = {n.name: n for mm in g.users(h, _MATMULS) for n in _forward_to_attention(g, mm.output[0])}
    if len(found) != 1:
        raise g.error(norm, f"its output should feed the projections of one GroupQueryAttention; found "
                            f"{sorted(found) or 'none'}")
    attn = next(iter(found.values()))
    heads, kv_heads = _attr(attn, "num_heads"), _attr(attn, "kv_num_heads")
    window = max(int(_attr(attn, "local_window_size", -1)), 0)
    if heads is None or kv_heads is None:
        raise g.error(attn, "lacks num_heads / kv_num_heads")
    if _attr(attn, "softcap", 0.0):
        raise UnsupportedOpError(f"{g.path}: node {attn.name}: attention soft-capping is not supported")
    q_node, q_bias = _back_to_matmul(g, attn.input[0], attn, rotary)
    q_w = _weight(g, q_node)
    packed = len(attn.input) < 3 or not attn.input[1]
    if packed:
        total = q_w.shape[0]
        head_dim = total // (heads + 2 * kv_heads)
        if head_dim * (heads + 2 * kv_heads) != total:
            raise g.error(q_node, f"packed q/k/v projection has {total} outputs, not a multiple of "
                                  f"{heads} + 2 x {kv_heads} heads")
        qn, kn = heads * head_dim, kv_heads * head_dim
        q, k, v = _rows(q_w, 0, qn), _rows(q_w, qn, qn + kn), _rows(q_w, qn + kn, total)
        qb = kb = vb = None
        if q_bias is not None:
            qb, kb, vb = q_bias[:qn], q_bias[qn:qn + kn], q_bias[qn + kn:]
    else:
        k_node, kb = _back_to_matmul(g, attn.input[1], attn, rotary)
        v_node, vb = _back_to_matmul(g, attn.input[2], attn, rotary)
        q, k, v, qb = q_w, _weight(g, k_node), _weight(g, v_node), q_bias
        head_dim = q.shape[0] // heads
    if _attr(attn, "do_rotary", 0):
        rotary.update(cos=(attn, 7), sin=(attn, 8), interleaved=_attr(attn, "rotary_interleaved", 0))
    if "cos" not in rotary:
        raise g.error(attn, "no rotary embedding (do_rotary=0 and no RotaryEmbedding before it)")
    if rotary.get("interleaved"):
        # interleaved rotary pairs (2i, 2i+1) are GGUF's layout: reorder rows to rotate-half pairs
        q, k = unpermute_rotary(q, heads), unpermute_rotary(k, kv_heads)
        qb = None if qb is None else unpermute_rotary(qb, heads)
        kb = None if kb is None else unpermute_rotary(kb, kv_heads)
    scale = _attr(attn, "scale", 0.0)
    if scale and abs(scale * math.sqrt(head_dim) - 1) > 1e-5:
        raise UnsupportedOpError(f"{g.path}: node {attn.name}: attention scale {scale} is not "
                                 f"1/sqrt(head_dim={head_dim})")
    return _Attention(attn, heads, kv_heads, head_dim, window, q, k, v, qb, kb, vb)


def _forward_to_attention(g: _Graph, name: str) -> list[Any]:
    """The attention node reading ``name`` directly or through a bias Add / RotaryEmbedding."""
    for _ in range(4):
        users = g.consumers.get(name, [])
        found = [n for n in users if n.op_type in _ATTENTION]
        if found:
            return found
        nxt = [n for n in users if n.op_type in ("Add", "RotaryEmbedding")]
        if len(nxt) != 1:
            return []
        name = nxt[0].output[0]
    return []


def _mlp(g: _Graph, down: Any, h: str) -> tuple[Any, Any, str]:
    """The gate and up projections behind ``down``'s input ``act(gate(h)) * up(h)``, and the activation."""
    mul = g.producer.get(down.input[0])
    if mul is None or mul.op_type != "Mul":
        raise g.error(down, "its input should be the product act(gate) * up (a Mul)")
    projections = {n.output[0]: n for n in g.users(h, _MATMULS)}
    up = [projections[i] for i in mul.input if i in projections]
    other = [i for i in mul.input if i not in projections]
    if len(up) != 1 or len(other) != 1:
        raise g.error(mul, "expected one input straight from the up projection and one from the activation")
    ops, gate, todo, seen = set(), None, [other[0]], set()
    while todo:
        name = todo.pop()
        if name in seen or not name:
            continue
        seen.add(name)
        if name in projections and projections[name] is not up[0]:
            gate = projections[name]
            continue
        node = g.producer.get(name)
        if node is None or node.op_type in _MATMULS or len(seen) > 32:
            continue
        if node.op_type == "Gelu":
            ops.add(f"Gelu:{_attr(node, 'approximate', 'none')}")
        elif node.op_type == "QuickGelu":
            ops.add(f"QuickGelu:{_attr(node, 'alpha', 1.0)}")
        else:
            ops.add(node.op_type)
        todo.extend(node.input)
    if gate is None:
        raise g.error(mul, "found no gate projection behind the activation")
    if ops & {"FastGelu", "Gelu:tanh"}:
        act = "gelu_tanh"
    elif ops & {"Sigmoid", "QuickGelu:1.0"}:
        act = "silu"
    else:
        raise UnsupportedOpError(f"{g.path}: node {mul.name}: activation {sorted(ops)} is not silu or gelu_tanh")
    return gate, up[0], act
