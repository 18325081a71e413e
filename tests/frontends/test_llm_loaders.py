"""The LLM loaders (Hugging Face folders and objects, GGUF files, onnxruntime-genai models) and the
round-to-nearest quantizer: every loaded tensor equals its source (exactly, or within the quantization
bound), and malformed files are refused with a ModelError naming the tensor."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from cuvil.errors import ArgumentError, ModelError, UnsupportedOpError
from cuvil.llm.weights import Q4, Q8, Dense

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cuvil.llm.hf import from_hf  # noqa: E402
from cuvil.llm.quantize import quantize, quantize_weight  # noqa: E402

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=24, hidden_size=96)),
}


def tiny(family: str, seed: int = 0, **overrides):
    """A 2-layer model of ``family`` with every parameter (norms and biases too) seeded random."""
    cfg_name, model_name, extra = FAMILIES[family]
    cfg = getattr(transformers, cfg_name)(**{**SMALL, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return model


def state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def expected_layer(sd: dict[str, np.ndarray], family: str, i: int) -> dict[str, np.ndarray]:
    p = f"model.layers.{i}."
    e = {"attn_norm": sd[p + "input_layernorm.weight"], "ffn_norm": sd[p + "post_attention_layernorm.weight"],
         "o": sd[p + "self_attn.o_proj.weight"], "down": sd[p + "mlp.down_proj.weight"]}
    if family == "phi3":
        qkv, gate_up = sd[p + "self_attn.qkv_proj.weight"], sd[p + "mlp.gate_up_proj.weight"]
        return {**e, "qkv": qkv, "gate_up": gate_up}
    for n in ("q", "k", "v"):
        e[n] = sd[p + f"self_attn.{n}_proj.weight"]
        if p + f"self_attn.{n}_proj.bias" in sd:
            e[f"{n}_bias"] = sd[p + f"self_attn.{n}_proj.bias"]
    for n in ("gate", "up"):
        e[n] = sd[p + f"mlp.{n}_proj.weight"]
    return e


def check_equals_state(w, sd: dict[str, np.ndarray], family: str) -> None:
    assert np.array_equal(w.embed.w, sd["model.embed_tokens.weight"])
    assert np.array_equal(w.norm, sd["model.norm.weight"])
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    assert np.array_equal(w.head.dequantize(), head)
    for i, L in enumerate(w.layers):
        e = expected_layer(sd, family, i)
        for n in ("attn_norm", "ffn_norm"):
            assert np.array_equal(getattr(L, n), e[n]), (i, n)
        for n in ("o", "down"):
            assert np.array_equal(getattr(L, n).w, e[n]), (i, n)
        if family == "phi3":
            assert np.array_equal(np.concatenate([L.q.w, L.k.w, L.v.w]), e["qkv"])
            assert np.array_equal(np.concatenate([L.gate.w, L.up.w]), e["gate_up"])
            continue
        for n in ("q", "k", "v", "gate", "up"):
            assert np.array_equal(getattr(L, n).w, e[n]), (i, n)
        for n in ("q_bias", "k_bias", "v_bias"):
            if n in e:
                assert np.array_equal(getattr(L, n), e[n]), (i, n)
            else:
                assert getattr(L, n) is None


# ----------------------------------------------------------------------------------------- Hugging Face

@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_folder_and_object_equal_state_dict(tmp_path, family):
    model = tiny(family)
    model.save_pretrained(tmp_path)
    sd = state(model)
    for src in (tmp_path, model):
        w = from_hf(src)
        check_equals_state(w, sd, family)
        c = w.config
        assert (c.layers, c.vocab, c.family) == (2, 128, family)
        assert all(isinstance(getattr(L, n), Dense) for L in w.layers for n in ("q", "k", "v", "o"))
    if family == "llama":
        assert c.rope_theta == 500000.0 and c.sliding_window == 0 and c.act == "silu"
    if family == "mistral":
        assert c.sliding_window == 16
    if family == "qwen2":
        assert w.layers[0].q_bias is not None and c.sliding_window == 0
    if family == "gemma":
        assert (c.norm_offset, c.act, c.head_dim, c.tie_embeddings) == (1.0, "gelu_tanh", 24, True)
        assert c.embed_scale == float(np.float32(np.sqrt(96)))
        assert w.head is w.embed


def test_hf_bf16_sharded_folder(tmp_path):
    model = tiny("gemma").to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    w = from_hf(tmp_path)
    check_equals_state(w, state(model), "gemma")
    # HF Gemma multiplies by sqrt(hidden) in the embedding's dtype: bf16 here
    assert w.config.embed_scale == 9.8125


def test_hf_config_details(tmp_path):
    w = from_hf(tiny("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0))
    assert w.config.sliding_window == 8
    with pytest.raises(UnsupportedOpError, match="sliding window on layers"):
        from_hf(tiny("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1))
    scaled = tiny("llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    assert len(from_hf(scaled).config.rope_inv_freq) == 8     # (tests/frontends/test_llm_rope.py checks the values)
    scaled = tiny("llama", rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    with pytest.raises(UnsupportedOpError, match="RoPE scaling 'yarn' is not supported"):
        from_hf(scaled)
    model = tiny("llama", eos_token_id=[2, 5], max_position_embeddings=64)
    w = from_hf(model, max_context=32)
    assert w.config.eos == (2, 5) and w.config.bos == 1 and w.config.max_context == 32


@pytest.mark.parametrize("family", ["llama", "phi3", "gemma"])
@pytest.mark.slow
def test_hf_transform_equals_quantizing_after(tmp_path, family):
    # each projection quantized as it is read (cuvil.llm.load's int4 / int8) equals quantizing the float32
    # model afterwards; phi3's fused projections are split first, gemma's tied head made from the embedding
    from cuvil.llm.api import convert, load, read

    model = tiny(family)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    names: list[str] = []

    def q4(name: str, a: np.ndarray):
        assert a.dtype == np.float32 and a.flags.c_contiguous
        names.append(name)
        return quantize_weight(a, 4, 32, name=name)
    lean = read(tmp_path, transform=q4)
    assert len(names) == len(set(names)) == 7 * 2 + 1 and "head" in names
    assert isinstance(lean.embed, Dense) and lean.head is not lean.embed
    for bits in (4, 8):
        eager = convert(read(tmp_path), f"int{bits}")
        if family == "llama" and bits == 4:   # (a Generator compiles its kernels: once is enough)
            got = load(tmp_path, "int4", context=16).weights
        else:
            group = 32 if bits == 4 else None
            got = convert(read(tmp_path, transform=lambda n, a, b=bits, g=group: quantize_weight(a, b, g, name=n)),
                          f"int{bits}")
        for a, b in [(got.head, eager.head), (got.embed, eager.embed)] + [
                (getattr(x, n), getattr(y, n)) for x, y in zip(got.layers, eager.layers)
                for n in ("q", "k", "v", "o", "gate", "up", "down")]:
            assert type(a) is type(b) and np.array_equal(a.dequantize(), b.dequantize())
    assert convert(eager, "int8").layers[0].q is eager.layers[0].q      # already int8 per row: kept
    w4 = convert(eager, "int4")
    assert convert(w4, "int4").layers[1].down is w4.layers[1].down      # already int4 in groups of 32: kept


def test_hf_errors(tmp_path):
    model = tiny("llama")
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelError, match="GPT2LMHeadModel.*LlamaForCausalLM.*GemmaForCausalLM"):
        from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import save_file

    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is missing"):
        from_hf(tmp_path)
    with pytest.raises(ModelError, match="config.json"):
        from_hf(tmp_path / "nowhere")


# --------------------------------------------------------------------------------------------- quantize

def _bound_ok(w: np.ndarray, q) -> None:
    n, k = w.shape
    d = q.dequantize()
    assert d.shape == w.shape and d.dtype == np.float32
    scale = np.repeat(np.abs(q.scale), q.group, axis=1)
    err = np.abs(w - d)
    slack = 1e-6 * np.abs(w) + 1e-12
    if isinstance(q, Q4) and q.symmetric:
        # the end opposite the largest magnitude clamps at +7: error up to one scale there
        s_signed = np.repeat(q.scale, q.group, axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            clamped = np.where(s_signed != 0, w / s_signed, 0) > 7.5
        assert np.all(err[~clamped] <= scale[~clamped] / 2 + slack[~clamped])
        assert np.all(err[clamped] <= scale[clamped] + slack[clamped])
    else:
        assert np.all(err <= scale / 2 + slack)


@pytest.mark.parametrize("bits,group,symmetric", [(4, 32, True), (4, 128, True), (4, 32, False),
                                                  (4, 128, False), (8, None, True), (8, 32, True)])
def test_quantize_weight_bounds(bits, group, symmetric):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((24, 256)) * rng.uniform(0.01, 2, (24, 1))).astype(np.float32)
    w[3, :128] = 0.0                      # a zero group
    w[5, 7] = 40.0                        # an outlier
    q = quantize_weight(w, bits, group, symmetric)
    assert isinstance(q, Q4 if bits == 4 else Q8)
    assert q.group == (group or (32 if bits == 4 else 256))
    assert not np.any(q.dequantize()[3, :128])
    _bound_ok(w, q)
    if bits == 4 and symmetric:
        assert q.symmetric and np.array_equal(q.offset, -8 * q.scale)
        # the largest magnitude of each group is exact
        g = np.abs(w.reshape(24, -1, q.group)).argmax(-1)
        ref = np.take_along_axis(w.reshape(24, -1, q.group), g[..., None], -1)
        got = np.take_along_axis(q.dequantize().reshape(24, -1, q.group), g[..., None], -1)
        assert np.array_equal(ref, got)


def test_quantize_model():
    w = from_hf(tiny("llama"))
    q = quantize(w)
    assert isinstance(q.embed, Dense) and np.array_equal(q.embed.w, w.embed.w)
    for L, R in zip(q.layers, w.layers):
        for n in ("q", "k", "v", "o", "gate", "up", "down"):
            a = getattr(L, n)
            assert isinstance(a, Q4) and a.group == 32 and a.symmetric
            _bound_ok(getattr(R, n).w, a)
        assert np.array_equal(L.attn_norm, R.attn_norm)
    assert isinstance(q.head, Q4)
    q8 = quantize(w, bits=8, head="fp32", embed="int8")
    assert isinstance(q8.layers[0].down, Q8) and q8.layers[0].down.group == 96
    assert isinstance(q8.head, Dense) and isinstance(q8.embed, Q8)
    qa = quantize(w, bits=4, group=16, symmetric=False, head="int8", embed="same")
    assert isinstance(qa.layers[1].up, Q4) and not qa.layers[1].up.symmetric and qa.layers[1].up.group == 16
    assert isinstance(qa.head, Q8) and isinstance(qa.embed, Q4)
    assert q.nbytes < w.nbytes / 4
    with pytest.raises(ArgumentError, match="head"):
        quantize(w, head="int4")
    with pytest.raises(ArgumentError, match="symmetric"):
        quantize(w, bits=8, symmetric=False)
    with pytest.raises(ModelError, match="layers.0.down.*group 64 does not divide its 96"):
        quantize(w, group=64)


# ----------------------------------------------------------------------------------------------- GGUF

from cuvil.llm.gguf import from_gguf, permute_rotary, read_gguf, tensor_weight, unpermute_rotary  # noqa: E402

try:  # the gguf package writes the files (cuvil's reader does not need it)
    import gguf

    T = gguf.GGMLQuantizationType
except ImportError:
    gguf = T = None
needs_gguf = pytest.mark.skipif(gguf is None, reason="the gguf package is not installed")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's q/k permutation, written from its description: within each head, the rows
    (i, i + d/2) of HF's rotate-half layout become adjacent rows (2i, 2i + 1)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_blocks(rng, rows: int, cols: int, qtype) -> np.ndarray:
    """Valid random K-quant blocks (random bytes; the f16 super-block scales set to sane values)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    d = rng.uniform(0.001, 0.01, (rows, cols // block, 2)).astype(np.float16).view(np.uint8)
    if qtype == T.Q4_K:
        b[..., 0:4] = d                   # d, dmin
    else:
        b[..., 208:210] = d[..., :2]      # Q6_K: d last
    return b.reshape(rows, -1)


def encode(arr: np.ndarray, qtype, rng) -> tuple[np.ndarray, np.ndarray]:
    """(data to write, its ggml dequantization) for a float [N, K] array."""
    if qtype == T.F32:
        return arr, arr
    if qtype == T.F16:
        data = arr.astype(np.float16)
        return data, data.astype(np.float32)
    if qtype in (T.Q4_K, T.Q6_K):
        data = random_blocks(rng, *arr.shape, qtype)
    else:
        data = gguf.quants.quantize(arr, qtype)
    return data, gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(arr.shape)


def write_gguf(path, model, arch: str = "llama", types: dict | None = None, seed: int = 0, tied: bool = False,
               permute: bool = True, extra=None) -> dict[str, np.ndarray]:
    """Write ``model`` (a tiny HF llama / qwen2) as llama.cpp would; returns each tensor's expected weight
    in HF's layout (the ggml dequantization, q/k permutation undone).  ``extra(writer)`` adds metadata or
    tensors."""
    types = types or {}
    rng = np.random.default_rng(seed)
    c = model.config
    sd = state(model)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if not tied:
        names["output.weight"] = "lm_head.weight"
    hf_names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
                "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(c.num_hidden_layers):
        for g, h in hf_names.items():
            names[f"blk.{i}.{g}.weight"] = f"model.layers.{i}.{h}.weight"
            if f"model.layers.{i}.{h}.bias" in sd:
                names[f"blk.{i}.{g}.bias"] = f"model.layers.{i}.{h}.bias"
    expected = {}
    for g, h in names.items():
        arr = sd[h]
        heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}.get(g.split(".")[-2])
        if heads and permute:
            arr = llama_cpp_permute(arr, heads)
        qtype = types.get(g, T.F32) if arr.ndim == 2 else T.F32
        data, deq = encode(arr, qtype, rng)
        w.add_tensor(g, data, raw_dtype=qtype if qtype not in (T.F32, T.F16) else None)
        expected[g] = llama_cpp_permute_inverse(deq, heads) if heads and permute else deq
    if extra is not None:
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def llama_cpp_permute_inverse(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def check_gguf(w, expected: dict[str, np.ndarray], exact: bool = True) -> None:
    got = {"token_embd.weight": w.embed.dequantize(), "output_norm.weight": w.norm,
           "output.weight": w.head.dequantize()}
    fields = {"attn_norm": "attn_norm", "ffn_norm": "ffn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v",
              "attn_output": "o", "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}
    for i, L in enumerate(w.layers):
        for g, f in fields.items():
            v = getattr(L, f)
            got[f"blk.{i}.{g}.weight"] = v if isinstance(v, np.ndarray) else v.dequantize()
        for g, f in (("attn_q", "q_bias"), ("attn_k", "k_bias"), ("attn_v", "v_bias")):
            if getattr(L, f) is not None:
                got[f"blk.{i}.{g}.bias"] = getattr(L, f)
    for name, e in expected.items():
        assert np.array_equal(got[name], e), name


@needs_gguf
def test_gguf_f32_llama_equals_hf(tmp_path):
    model = tiny("llama")
    write_gguf(tmp_path / "m.gguf", model)
    w = from_gguf(tmp_path / "m.gguf")
    check_equals_state(w, state(model), "llama")      # the q/k permutation is undone exactly
    c = w.config
    assert (c.hidden, c.heads, c.kv_heads, c.head_dim, c.ffn, c.layers) == (64, 4, 2, 16, 96, 2)
    assert (c.rope_theta, c.rms_eps, c.max_context, c.bos, c.eos) == (500000.0, 1e-6, 64, 1, (2,))
    assert not c.tie_embeddings


@needs_gguf
def test_gguf_qwen2_biases_not_permuted(tmp_path):
    model = tiny("qwen2")
    write_gguf(tmp_path / "m.gguf", model, arch="qwen2", permute=False, tied=True)
    w = from_gguf(tmp_path / "m.gguf")
    sd = state(model)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    check_equals_state(w, sd, "qwen2")
    assert w.config.tie_embeddings and w.head is w.embed and w.config.family == "qwen2"


@needs_gguf
def test_gguf_quantized_types(tmp_path):
    # ffn 256 so that ffn_down's rows are whole K-quant super-blocks
    model = tiny("llama", intermediate_size=256)
    types = {"token_embd.weight": T.Q8_0, "output.weight": T.Q4_0}
    for i, down in enumerate((T.Q4_K, T.Q6_K)):
        types.update({f"blk.{i}.attn_q.weight": T.Q4_0, f"blk.{i}.attn_k.weight": T.Q8_0,
                      f"blk.{i}.attn_v.weight": T.Q4_0, f"blk.{i}.attn_output.weight": T.F16,
                      f"blk.{i}.ffn_gate.weight": T.Q8_0, f"blk.{i}.ffn_up.weight": T.Q4_0,
                      f"blk.{i}.ffn_down.weight": down})
    expected = write_gguf(tmp_path / "m.gguf", model, types=types)
    w = from_gguf(tmp_path / "m.gguf")
    check_gguf(w, expected)
    L0, L1 = w.layers
    assert isinstance(L0.q, Q4) and L0.q.symmetric and L0.q.group == 32
    assert isinstance(L0.k, Q8) and L0.k.group == 32
    assert isinstance(L0.down, Q4) and not L0.down.symmetric and L0.down.group == 32      # Q4_K
    assert isinstance(L1.down, Q8) and L1.down.group == 16                                 # Q6_K
    assert isinstance(L0.o, Dense) and isinstance(w.embed, Q8) and isinstance(w.head, Q4)


@needs_gguf
@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"])
def test_gguf_tensor_types_exact(tmp_path, qtype):
    rng = np.random.default_rng(3)
    qt = T[qtype]
    arr = rng.standard_normal((6, 512)).astype(np.float32)
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    if qt == T.BF16:
        data = gguf.quants.quantize(arr, qt)
        ref = gguf.quants.dequantize(data, qt)
    else:
        data, ref = encode(arr, qt, rng)
    w.add_tensor("t", data, raw_dtype=qt if qt not in (T.F32, T.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = read_gguf(tmp_path / "t.gguf").tensors["t"]
    assert t.shape == (6, 512) and t.type == qtype
    assert np.array_equal(tensor_weight(t).dequantize(), np.asarray(ref, np.float32).reshape(6, 512))


def test_rotary_permutation_round_trip():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4 * 16, 64)).astype(np.float32)
    assert np.array_equal(permute_rotary(w, 4), llama_cpp_permute(w, 4))
    assert np.array_equal(unpermute_rotary(llama_cpp_permute(w, 4), 4), w)
    q = quantize_weight(llama_cpp_permute(w, 4), 4, 32)
    # a row reorder of quantized rows is exact
    assert np.array_equal(unpermute_rotary(q, 4).dequantize(), llama_cpp_permute_inverse(q.dequantize(), 4))


def _tensor_info_offset(raw: bytes, name: str) -> int:
    """Where the (n_dims, dims, type) fields of tensor ``name`` start in a GGUF file."""
    key = len(name).to_bytes(8, "little") + name.encode()
    at = raw.rindex(key)   # the tensor table follows the metadata
    return at + len(key)


@needs_gguf
def test_gguf_malformed(tmp_path):
    model = tiny("llama")
    path = tmp_path / "m.gguf"
    write_gguf(path, model)
    raw = path.read_bytes()

    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(raw[:-100])
    with pytest.raises(ModelError, match="tensor blk.1.ffn_down.weight .*runs past the end"):
        from_gguf(bad)
    bad.write_bytes(raw[:40])
    with pytest.raises(ModelError, match="truncated"):
        from_gguf(bad)

    at = _tensor_info_offset(raw, "blk.0.attn_v.weight")
    n_dims = int.from_bytes(raw[at:at + 4], "little")
    t_at = at + 4 + 8 * n_dims
    patched = bytearray(raw)
    patched[t_at:t_at + 4] = (99).to_bytes(4, "little")
    bad.write_bytes(bytes(patched))
    with pytest.raises(ModelError, match="tensor blk.0.attn_v.weight has unknown ggml type id 99"):
        from_gguf(bad)

    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelError, match="not a GGUF"):
        from_gguf(tmp_path / "junk.gguf")


@needs_gguf
def test_gguf_wrong_shape_and_type(tmp_path):
    model = tiny("llama", intermediate_size=256)
    sd = state(model)
    sd_bad = dict(sd)
    sd_bad["model.layers.0.self_attn.k_proj.weight"] = sd["model.layers.0.self_attn.k_proj.weight"][:16]

    class Fake:
        config = model.config

        def state_dict(self):
            return {k: torch.from_numpy(v) for k, v in sd_bad.items()}

    write_gguf(tmp_path / "shape.gguf", Fake(), permute=False)
    with pytest.raises(ModelError, match=r"tensor blk.0.attn_k.weight is \[16, 64\]; expected \[32, 64\]"):
        from_gguf(tmp_path / "shape.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "q5k.gguf"), "llama")
    w.add_tensor("x", np.zeros((2, 176), np.uint8), raw_dtype=T.Q5_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match="tensor x has type Q5_K, which cuvil does not load"):
        tensor_weight(read_gguf(tmp_path / "q5k.gguf").tensors["x"])
    g = gguf.GGUFWriter(str(tmp_path / "arch.gguf"), "gpt2")
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    with pytest.raises(ModelError, match="'gpt2' is not supported.*llama, qwen2"):
        from_gguf(tmp_path / "arch.gguf")


def _torch_greedy(m, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = m.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _ids(n: int, vocab: int = 128) -> list[int]:
    return np.random.default_rng(1).integers(3, vocab, n).tolist()


@needs_gguf
@pytest.mark.slow
def test_gguf_f32_generates_the_hf_models_tokens(tmp_path):
    from cuvil.llm.api import load

    model = tiny("llama")
    write_gguf(tmp_path / "m.gguf", model)
    ids = _ids(13)  # a chunk of 8, then five tokens; 45 positions of the 64
    assert list(load(tmp_path / "m.gguf", chunk=8).generate(ids, 32, stop=())) == _torch_greedy(model, ids, 32)


def ggml_q8_0(w: np.ndarray):
    """ggml's reference Q8_0 rule (``quantize_row_q8_0_ref``) as a :class:`Q8`: per block of 32, ``d = amax /
    127``, ``q = roundf(x / d)`` (computed as ``x * (1 / d)``, halves away from zero), ``d`` stored as f16."""
    n, k = w.shape
    x = w.reshape(n, k // 32, 32).astype(np.float32)
    d = np.abs(x).max(axis=-1) / np.float32(127)
    inv = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, np.float32(1), d))
    y = x * inv[..., None]
    q = (np.sign(y) * np.floor(np.abs(y) + np.float32(0.5))).astype(np.int8)
    return Q8(q=q.reshape(n, k), scale=d.astype(np.float16).astype(np.float32), group=32)


@needs_gguf
@pytest.mark.slow
def test_gguf_q8_0_generates_the_tokens_of_the_same_q8_weights(tmp_path):
    from dataclasses import replace

    from cuvil.llm.api import load, read
    from cuvil.llm.runtime import Generator

    model = tiny("llama")
    n_layers = model.config.num_hidden_layers
    types = {"token_embd.weight": T.Q8_0, "output.weight": T.Q8_0}
    for i in range(n_layers):
        for g in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            types[f"blk.{i}.{g}.weight"] = T.Q8_0
    expected = write_gguf(tmp_path / "m.gguf", model, types=types)
    # the reference: the HF model's weights quantized in memory by the same rule (rows quantize alike
    # before and after llama.cpp's q/k row permutation)
    ref = read(model).with_linears(lambda _n, x: ggml_q8_0(x.w))
    ref = replace(ref, embed=ggml_q8_0(ref.embed.w))
    assert np.array_equal(ref.layers[1].k.dequantize(), expected["blk.1.attn_k.weight"])  # the rule is ggml's
    assert np.array_equal(ref.head.dequantize(), expected["output.weight"])
    gen = load(tmp_path / "m.gguf", chunk=8)
    assert isinstance(gen.weights.layers[0].q, Q8) and gen.weights.layers[0].q.group == 32
    ids = _ids(13)
    want = list(Generator(ref, chunk=8).generate(ids, 32, stop=()))
    assert list(gen.generate(ids, 32, stop=())) == want


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def llama3_rope_factors(theta: float, head_dim: int, scaling: dict) -> np.ndarray:
    """The ``rope_freqs.weight`` factors llama.cpp's converter writes for LLaMA 3.1 (each frequency is divided
    by its factor): 1 for wavelengths below ``old / high_freq_factor``, ``factor`` above ``old /
    low_freq_factor``, ``1 / ((1 - s) / factor + s)`` between, ``s = (old / wavelength - low) / (high - low)``."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    old, lo, hi, f = (scaling[k] for k in ("original_max_position_embeddings", "low_freq_factor",
                                           "high_freq_factor", "factor"))
    out = []
    for fr in freqs:
        wavelen = 2 * np.pi / fr
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(f)
        else:
            s = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - s) / f + s))
    return np.array(out, np.float32)


@needs_gguf
@pytest.mark.slow
def test_gguf_llama3_rope_factors(tmp_path):
    from cuvil.llm.api import load

    model = tiny("llama", rope_scaling=LLAMA3_SCALING, max_position_embeddings=128)
    factors = llama3_rope_factors(500000.0, 16, LLAMA3_SCALING)
    assert sorted(set(np.round(factors, 3).tolist())) != [1.0, 8.0]  # kept, interpolated and divided ones
    write_gguf(tmp_path / "m.gguf", model, extra=lambda w: w.add_tensor("rope_freqs.weight", factors))
    c = from_gguf(tmp_path / "m.gguf").config
    hf = model.model.rotary_emb.inv_freq.numpy()
    np.testing.assert_allclose(np.asarray(c.rope_inv_freq, np.float32), hf, rtol=1e-6, atol=0)
    ids = _ids(13)
    assert list(load(tmp_path / "m.gguf", chunk=8).generate(ids, 32, stop=())) == _torch_greedy(model, ids, 32)


@needs_gguf
@pytest.mark.slow
def test_gguf_linear_rope_scaling_and_refusals(tmp_path):
    from cuvil.llm.api import load

    model = tiny("llama", rope_scaling={"rope_type": "linear", "factor": 4.0})

    def linear(w) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)
    write_gguf(tmp_path / "m.gguf", model, extra=linear)
    c = from_gguf(tmp_path / "m.gguf").config
    assert np.array_equal(np.asarray(c.rope_inv_freq, np.float32), model.model.rotary_emb.inv_freq.numpy())
    ids = _ids(13)
    assert list(load(tmp_path / "m.gguf", chunk=8).generate(ids, 32, stop=())) == _torch_greedy(model, ids, 32)

    def yarn(w) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
    write_gguf(tmp_path / "yarn.gguf", tiny("llama"), extra=yarn)
    with pytest.raises(UnsupportedOpError, match="RoPE scaling 'yarn'"):
        from_gguf(tmp_path / "yarn.gguf")
    write_gguf(tmp_path / "bad.gguf", tiny("llama"),
               extra=lambda w: w.add_tensor("rope_freqs.weight", np.ones(5, np.float32)))
    with pytest.raises(ModelError, match=r"rope_freqs.weight is F32 \[5\]; expected float \[8\]"):
        from_gguf(tmp_path / "bad.gguf")


@needs_gguf
def test_gguf_transform_quantizes_float_tensors_as_read(tmp_path):
    from cuvil.llm.api import convert, read

    model = tiny("llama")
    write_gguf(tmp_path / "m.gguf", model, types={"blk.0.ffn_up.weight": T.Q8_0})
    seen: list[str] = []

    def q4(name: str, a: np.ndarray):
        seen.append(name)
        return quantize_weight(a, 4, 32, name=name)
    lean = read(tmp_path / "m.gguf", transform=q4)
    assert "layers.0.up" not in seen and {"layers.1.q", "layers.0.down", "head"} <= set(seen)
    assert isinstance(lean.layers[0].up, Q8) and isinstance(lean.embed, Dense)
    eager = convert(read(tmp_path / "m.gguf"), "int4")
    for a, b in ((lean.layers[1].q, eager.layers[1].q), (lean.head, eager.head)):
        assert np.array_equal(a.dequantize(), b.dequantize())


# ------------------------------------------------------------------------------------ onnxruntime-genai

def need_genai() -> None:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("onnxruntime-genai is not installed (CI installs it)")
        pytest.skip("onnxruntime-genai is not installed")


def save_with_tokenizer(model, folder) -> None:
    """The builder reads a tokenizer from the folder: a word-level one over the vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(folder)


def build_genai(model, tmp, precision: str, *extra: str):
    hf, out = tmp / "hf", tmp / "ort"
    save_with_tokenizer(model, hf)
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out), "-p",
           precision, "-e", "cpu", "-c", str(tmp / "cache")]
    if extra:
        cmd += ["--extra_options", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return out


# The builder takes every nn.Linear with vocab_size outputs for the lm_head: keep the vocabulary (128)
# apart from the other projections' widths.
GENAI_BUILDS = {  # name: family, config overrides, precision, extra options, expected projection type
    "int4-symmetric-llama": ("llama", dict(max_position_embeddings=128), "int4", (), "Q4 32 symmetric"),
    "int4-zero-points-qwen2": ("qwen2", dict(rope_theta=1e6), "int4", ("is_symmetric=false", "block_size=16"),
                               "Q4 16"),
    "int4-gemma": ("gemma", {}, "int4", (), "Q4 32 symmetric"),
    "int8-mistral": ("mistral", {}, "int8", (), "Q8 32"),
    "fp32-llama": ("llama", {}, "fp32", (), "Dense"),
}


@pytest.fixture(scope="module")
def genai(tmp_path_factory):
    """``genai(name)`` -> (HF model, built folder), each build made once per module."""
    built: dict[str, tuple] = {}

    def get(name: str):
        need_genai()
        if name not in built:
            family, overrides, precision, extra, _ = GENAI_BUILDS[name]
            model = tiny(family, **overrides)
            built[name] = model, build_genai(model, tmp_path_factory.mktemp(name), precision, *extra)
        return built[name]
    return get


def close_to(ref: np.ndarray, w) -> None:
    """``w`` holds ``ref``: exactly when dense, else within its quantization bound (onnxruntime's symmetric
    int4 and int8 round like Q4_0, scale = -max / 8 or / 128: within one scale at the clamped end, half a
    scale elsewhere)."""
    if isinstance(w, Dense):
        assert np.array_equal(w.w, ref)
        return
    err = np.abs(ref - w.dequantize())
    scale = np.repeat(np.abs(w.scale), w.group, axis=1)
    factor = 0.5 if isinstance(w, Q4) and not w.symmetric else 1.0
    assert np.all(err <= scale * factor * (1 + 1e-5) + 1e-7)


@pytest.mark.parametrize("name", list(GENAI_BUILDS))
@pytest.mark.slow
def test_onnx_genai_matches_hf(genai, name):
    from cuvil.llm.onnx_genai import from_onnx_genai

    model, folder = genai(name)
    w = from_onnx_genai(folder)
    ref = from_hf(model)
    c, rc = w.config, ref.config
    for f in ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "rope_theta", "rms_eps",
              "act", "family"):
        assert getattr(c, f) == getattr(rc, f), f
    assert c.max_context == model.config.max_position_embeddings
    kind = GENAI_BUILDS[name][4].split()
    # the builder bakes Gemma's 1 + gamma into its norms, and scales the embedding by a rounded sqrt(hidden)
    offset = np.float32(rc.norm_offset)
    assert c.norm_offset == 0.0 and abs(c.embed_scale - rc.embed_scale) < 0.01
    assert np.array_equal(w.norm, ref.norm + offset)
    for L, R in zip(w.layers, ref.layers):
        assert np.array_equal(L.attn_norm, R.attn_norm + offset) and np.array_equal(L.ffn_norm, R.ffn_norm + offset)
        for n in ("q", "k", "v", "o", "gate", "up", "down"):
            a = getattr(L, n)
            assert type(a).__name__ == kind[0], n
            if kind[0] != "Dense":
                assert a.group == int(kind[1])
            if kind[0] == "Q4":
                assert a.symmetric == ("symmetric" in kind)
            close_to(getattr(R, n).w, a)
        for n in ("q_bias", "k_bias", "v_bias"):
            rb = getattr(R, n)
            assert (getattr(L, n) is None) == (rb is None)
            if rb is not None:
                np.testing.assert_allclose(getattr(L, n), rb, rtol=1e-6, atol=1e-7)
    close_to(ref.head.w, w.head)
    close_to(ref.embed.w, w.embed)      # int4 Gemma: a GatherBlockQuantized table shared with the head


@pytest.mark.slow
def test_onnx_genai_missing_initializer(genai, tmp_path):
    import onnx

    from cuvil.llm.onnx_genai import from_onnx_genai

    _, folder = genai("int4-symmetric-llama")
    m = onnx.load(str(folder / "model.onnx"))
    victim = next(t.name for t in m.graph.initializer if "layers.1" in t.name and "o_proj" in t.name
                  and t.name.endswith("scales"))
    kept = [t for t in m.graph.initializer if t.name != victim]
    del m.graph.initializer[:]
    m.graph.initializer.extend(kept)
    out = tmp_path / "bad"
    out.mkdir()
    onnx.save(m, str(out / "model.onnx"))
    shutil.copy(folder / "genai_config.json", out / "genai_config.json")
    with pytest.raises(ModelError, match=rf"layers\.1/attn/o_proj.*scales initializer {victim} .*missing"):
        from_onnx_genai(out)
    with pytest.raises(ModelError, match="genai_config.json"):
        from_onnx_genai(tmp_path)


def _edited(folder, tmp_path, edit):
    import onnx

    m = onnx.load(str(folder / "model.onnx"))
    edit(m)
    out = tmp_path / "edited"
    out.mkdir(exist_ok=True)
    onnx.save(m, str(out / "model.onnx"))
    shutil.copy(folder / "genai_config.json", out / "genai_config.json")
    return out


def test_onnx_genai_attention_variants(genai, tmp_path):
    from onnx import helper

    from cuvil.llm.onnx_genai import from_onnx_genai

    _, folder = genai("int4-symmetric-llama")
    plain = from_onnx_genai(folder)

    def set_attr(name, value):
        def edit(m):
            for n in m.graph.node:
                if n.op_type == "GroupQueryAttention":
                    kept = [a for a in n.attribute if a.name != name]
                    del n.attribute[:]
                    n.attribute.extend(kept + [helper.make_attribute(name, value)])
        return edit

    # interleaved rotary pairs are GGUF's layout: q / k rows come back in rotate-half order
    w = from_onnx_genai(_edited(folder, tmp_path, set_attr("rotary_interleaved", 1)))
    for L, P in zip(w.layers, plain.layers):
        assert np.array_equal(L.q.dequantize(), unpermute_rotary(P.q.dequantize(), 4))
        assert np.array_equal(L.k.dequantize(), unpermute_rotary(P.k.dequantize(), 2))
        assert np.array_equal(L.v.q, P.v.q)
    assert from_onnx_genai(_edited(folder, tmp_path, set_attr("local_window_size", 16))).config.sliding_window == 16
    with pytest.raises(UnsupportedOpError, match="soft-capping"):
        from_onnx_genai(_edited(folder, tmp_path, set_attr("softcap", 30.0)))
