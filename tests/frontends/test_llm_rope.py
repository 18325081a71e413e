"""Scaled RoPE from Hugging Face configs: LLaMA 3's frequency rule and linear scaling give the inverse
frequencies transformers computes (bit for bit), and tiny models that use them generate transformers'
greedy tokens; other scaling types are refused, naming the type."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llm_torch import prompt, torch_greedy  # noqa: E402

from cuvil.errors import UnsupportedOpError  # noqa: E402
from cuvil.llm.api import load, read  # noqa: E402
from cuvil.llm.hf import from_hf  # noqa: E402
from cuvil.llm.runtime import Generator  # noqa: E402

VOCAB = 320
# original context 64 with head_dim 32: wavelengths 6.3 .. 35000, so the rule keeps the two fastest
# frequencies (wavelength < 64 / 4), interpolates three (16 .. 64) and divides the other eleven
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
LINEAR = {"rope_type": "linear", "factor": 4.0}


def _model(rope_scaling: dict, **kw: object) -> object:
    torch.manual_seed(0)
    cfg = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, rope_scaling=rope_scaling)
    cfg.update(kw)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    with torch.no_grad():  # (larger queries and keys: attention that depends on the positions' angles)
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return m


@pytest.mark.parametrize("scaling", [
    LLAMA3,
    {**LLAMA3, "factor": 3.0, "low_freq_factor": 1.5, "high_freq_factor": 5.0, "original_max_position_embeddings": 50},
    LINEAR,
    {"type": "linear", "factor": 1.7},   # an old config's key, a factor that is not a power of two
], ids=["llama3", "llama3-odd", "linear", "linear-odd"])
def test_inverse_frequencies_equal_transformers(scaling: dict) -> None:
    m = _model(scaling)
    got = read(m).config.rope_inv_freq
    ref = m.model.rotary_emb.inv_freq.numpy()
    assert got is not None and np.array_equal(np.asarray(got, np.float32), ref)


@pytest.mark.parametrize("theta,head_dim,factor", [(500000.0, 128, 8.0), (500000.0, 64, 32.0)],
                         ids=["llama-3.1-8b", "llama-3.2-1b"])
def test_llama3_frequencies_of_the_released_configs(theta: float, head_dim: int, factor: float) -> None:
    # the rope_scaling of LLaMA 3.1 8B and 3.2 1B, read from a config dict (no model built)
    from cuvil.llm.hf import _rope

    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = transformers.LlamaConfig(hidden_size=32 * head_dim, num_attention_heads=32, rope_theta=theta,
                                   max_position_embeddings=131072, rope_scaling=scaling)
    inv, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    got = _rope(cfg.to_dict(), "llama", head_dim)[1]
    assert np.array_equal(np.asarray(got, np.float32), inv.numpy())


@pytest.mark.parametrize("scaling", [LLAMA3, LINEAR], ids=["llama3", "linear"])
@pytest.mark.slow
def test_scaled_rope_greedy_tokens_equal_torch(scaling: dict) -> None:
    m = _model(scaling)
    ids = prompt(19, VOCAB)  # two chunks of 8 and three tokens one by one; 51 positions in all
    gen = load(m, "fp32", chunk=8)
    assert gen.config.rope_inv_freq is not None
    got = list(gen.generate(ids, 32, stop=()))
    assert got == torch_greedy(m, ids, 32)
    # the scaling matters: the plain frequencies give other logits
    w = read(m)
    plain = Generator(replace(w, config=replace(w.config, rope_inv_freq=None)), chunk=8).prefill(ids)
    scaled = Generator(w, chunk=8).prefill(ids)
    assert float(np.abs(plain - scaled).max()) > 0.05 * float(np.abs(scaled).max())


def _folder(tmp_path, **config: object):
    """A tiny LLaMA saved to ``tmp_path`` with ``config`` written over its config.json's keys."""
    _model(None).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    hf = json.loads(path.read_text())
    hf.update(config)
    path.write_text(json.dumps(hf))
    return tmp_path


def test_old_style_rope_scaling_in_a_folder(tmp_path) -> None:
    # transformers 4's keys: rope_theta at the top, rope_scaling with "type"; original_max_position_embeddings
    # taken from the top level when the scaling has none (as transformers does)
    folder = _folder(tmp_path, rope_parameters=None, rope_theta=500000.0, original_max_position_embeddings=64,
                     rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    c = from_hf(folder).config
    ref = _model({**LLAMA3, "rope_theta": 500000.0}).model.rotary_emb.inv_freq.numpy()
    assert c.rope_theta == 500000.0 and np.array_equal(np.asarray(c.rope_inv_freq, np.float32), ref)


@pytest.mark.parametrize("rope_type", ["dynamic", "yarn", "longrope"])
def test_other_scaling_types_are_refused(tmp_path, rope_type: str) -> None:
    folder = _folder(tmp_path, rope_parameters={"rope_type": rope_type, "factor": 4.0, "rope_theta": 10000.0})
    with pytest.raises(UnsupportedOpError, match=f"RoPE scaling '{rope_type}' is not supported"):
        from_hf(folder)


def test_llama3_scaling_without_its_parameters_is_named(tmp_path) -> None:
    from cuvil.errors import ModelError

    folder = _folder(tmp_path, rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0})
    with pytest.raises(ModelError, match="'llama3' has no 'low_freq_factor'"):
        from_hf(folder)
