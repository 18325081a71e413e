"""cuvil.llm's generation against eager transformers: greedy tokens of fp32 models equal torch's exactly
(LLaMA with grouped-query attention, Mistral's sliding window, Qwen2's biases, Phi-3's fused projections,
Gemma's norms and activation), prompts across chunk boundaries, prefix caching, and 4-bit weights against the same weights
dequantized."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llm_torch import prompt, torch_greedy  # noqa: E402

from cuvil.errors import ArgumentError, ShapeError  # noqa: E402
from cuvil.llm.api import convert, load, read  # noqa: E402
from cuvil.llm.runtime import Generator  # noqa: E402

VOCAB = 320


def _model(family: str, **kw: object) -> object:
    torch.manual_seed(0)
    common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256)
    common.update(kw)
    if family == "llama":
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif family == "mistral":
        m = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=8, **common))
    elif family == "qwen2":
        m = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
        with torch.no_grad():  # (biases start at zero: give them values)
            for layer in m.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.normal_(0, 0.5)
    elif family == "phi3":
        m = transformers.Phi3ForCausalLM(transformers.Phi3Config(pad_token_id=0, **common))
    elif family == "gemma":
        m = transformers.GemmaForCausalLM(transformers.GemmaConfig(head_dim=32, **common))
        with torch.no_grad():  # (norm weights start at zero: 1 + w would hide a missing offset)
            for name, p in m.named_parameters():
                if "norm" in name:
                    p.normal_(0, 0.3)
    else:
        raise AssertionError(family)
    return m.eval()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "phi3", "gemma"])
@pytest.mark.slow
def test_fp32_greedy_tokens_equal_torch(family: str) -> None:
    m = _model(family)
    ids = prompt(19, VOCAB)  # two chunks of 8 and three tokens one by one
    gen = load(m, "fp32", chunk=8)
    assert gen.config.family == family or family == "llama"
    got = list(gen.generate(ids, 32, stop=()))
    assert got == torch_greedy(m, ids, 32)


def test_logits_equal_torch_across_chunks_and_prefix_cache() -> None:
    m = _model("llama")
    gen = Generator(read(m), chunk=8)
    for n in (1, 7, 8, 13, 17):  # one token, a padded chunk, a whole one, chunk + 5 (padded), chunk + 9 (+1)
        ids = prompt(n, VOCAB, seed=n)
        gen.reset()
        got = gen.prefill(ids).copy()
        with torch.no_grad():
            ref = m(torch.tensor([ids])).logits[0, -1].numpy()
        # float32 sums in another order: a few units in the last place of logits of size ~1
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5)
    ids = prompt(20, VOCAB, seed=3)
    gen.reset()
    gen.prefill(ids[:12])
    assert gen.tokens == ids[:12]
    again = gen.prefill(ids).copy()  # the first 12 stay in the cache
    assert gen.tokens == ids
    gen.reset()
    np.testing.assert_allclose(again, gen.prefill(ids), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_int4_logits_match_the_dequantized_model() -> None:
    m = _model("llama")
    w4 = convert(read(m), "int4", group=32)
    deq = convert(w4, "fp32")
    ids = prompt(12, VOCAB)
    exact = Generator(deq, chunk=8).prefill(ids).copy()
    # 4-bit weights, float32 activations: the same products as the dequantized model, summed per group
    f32 = Generator(w4, chunk=8, activations="float32").prefill(ids).copy()
    np.testing.assert_allclose(f32, exact, rtol=0, atol=1e-4 * float(np.abs(exact).max()))
    # int8 activations (per group of 32: error <= scale / 2 = max|x| / 254 a value) move each logit by
    # about 1/254 of its terms' size; measured here well under 5% of the largest logit
    i8 = Generator(w4, chunk=8).prefill(ids).copy()
    assert float(np.abs(i8 - exact).max()) <= 0.05 * float(np.abs(exact).max())
    assert int(np.argmax(i8)) == int(np.argmax(exact))


@pytest.mark.slow
def test_int8_kv_cache_stays_close_to_float32() -> None:
    m = _model("llama")
    w = read(m)
    ids = prompt(19, VOCAB)
    exact = Generator(w, chunk=8).prefill(ids).copy()
    q = Generator(w, chunk=8, kv_cache="int8")
    got = q.prefill(ids).copy()
    # keys and values rounded to 1/254 of their row's largest magnitude: measured 0.3% of the largest logit
    assert float(np.abs(got - exact).max()) <= 0.02 * float(np.abs(exact).max())
    assert list(q.generate(ids, 16, stop=())) == torch_greedy(m, ids, 16)


@pytest.mark.slow
def test_a_batch_of_prompts_of_three_lengths_equals_each_alone() -> None:
    m = _model("llama")
    gen = Generator(read(m), chunk=8)
    prompts = [prompt(n, VOCAB, seed=n) for n in (5, 19, 11)]
    got = gen.generate_batch(prompts, 12, stop=())
    assert got == [torch_greedy(m, p, 12) for p in prompts]
    assert gen.generate_batch(prompts[:1], 0) == [[]]


def test_bad_inputs_are_named() -> None:
    gen = Generator(read(_model("llama")), chunk=8, context=16)
    with pytest.raises(ArgumentError, match="outside the vocabulary"):
        gen.prefill([1, VOCAB + 3])
    with pytest.raises(ShapeError, match="context of 16"):
        gen.prefill(prompt(17, VOCAB))
    with pytest.raises(ArgumentError, match="weights="):
        convert(read(_model("llama")), "int3")
