"""Issue 30's model files in one command: a LLaMA-shaped decoder with seeded random weights, as a Hugging Face
folder, as GGUF files (f16, Q4_0, Q8_0) for llama.cpp and as onnxruntime-genai's int4 ONNX model, so cuvil
and the other engines (:mod:`cuvil.llm.anchors`) run the same weights.

    python benchmarks/llm_models.py /work/anchors/models                  # TinyLlama-1.1B shape
    python benchmarks/llm_models.py OUT --config ci                       # 2 layers, hidden 256
    python benchmarks/llm_models.py OUT --llama-cpp SRC --llama-quantize BIN   # and the GGUF files

Writes, under ``OUT/<config>/``:

- ``hf/``: ``config.json``, ``model.safetensors`` (float16) and a byte-fallback BPE tokenizer
  (``tokenizer.json``, LLaMA's ``<unk> <s> </s>`` then the 256 byte tokens, then seeded merges up to the
  vocabulary size): nothing is fetched.  Weights: ``N(0, 0.02)`` for every matrix (``torch.Generator``
  seeded with ``--seed``), ones for the norms;
- ``gguf/f16.gguf`` (llama.cpp's ``convert_hf_to_gguf.py`` from ``--llama-cpp``, the llama.cpp source
  folder, with its ``gguf-py`` first on the path), ``gguf/q4_0.gguf`` and ``gguf/q8_0.gguf``
  (``--llama-quantize``); skipped when those are not given;
- ``ort-int4/``: ``python -m onnxruntime_genai.models.builder -p int4 -e cpu`` (MatMulNBits, 4-bit blocks
  of 32, symmetric, accuracy level 4: its defaults for the CPU); skipped with ``--no-ort``.

A file already there is kept (delete it to rebuild it).  Needs torch, transformers, safetensors; the GGUF
files also sentencepiece (the converter imports it); the ONNX model onnxruntime-genai and onnx_ir.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

# the decoder shapes: "full" is TinyLlama-1.1B's (22 layers, hidden 2048, grouped-query attention 32 / 4)
CONFIGS: dict[str, dict[str, int]] = {
    "full": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000),
    "ci": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=32000),
}
SPECIALS = ("<unk>", "<s>", "</s>")
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"()-"


def _log(msg: str) -> None:
    print(f"[llm_models {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def tokenizer_vocab(vocab_size: int, seed: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A LLaMA-style byte-fallback BPE vocabulary of exactly ``vocab_size`` entries and its merges: the three
    specials, the byte tokens ``<0x00>``..``<0xFF>``, the word-start mark and :data:`ALPHABET`, then merges of
    two tokens already in the vocabulary (seeded; at most 8 characters) until it is full."""
    vocab: dict[str, int] = {}
    for tok in (*SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), "\u2581", *ALPHABET):
        vocab[tok] = len(vocab)
    rng = random.Random(seed)
    pieces = ["\u2581", *ALPHABET]
    merges: list[tuple[str, str]] = []
    while len(vocab) < vocab_size:
        a, b = rng.choice(pieces), rng.choice(pieces)
        if "\u2581" in b or len(a) + len(b) > 8 or a + b in vocab:
            continue
        merges.append((a, b))
        vocab[a + b] = len(vocab)
        pieces.append(a + b)
    return vocab, merges


def write_hf(folder: Path, config: str, seed: int) -> None:
    """The Hugging Face folder: config, float16 safetensors weights, tokenizer (see the module doc)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    shape = CONFIGS[config]
    cfg = LlamaConfig(**shape, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, hidden_act="silu")
    _log(f"{config}: {shape}")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)  # no float32 copy of a 1.1B model in memory
    try:
        model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen))
    model.config.dtype = torch.float16
    model.save_pretrained(folder, safe_serialization=True)
    del model
    vocab, merges = tokenizer_vocab(shape["vocab_size"], seed)
    tok = LlamaTokenizer(vocab=vocab, merges=merges, add_prefix_space=True)
    tok.save_pretrained(folder)
    _log(f"wrote {folder}")


def write_gguf(hf: Path, out: Path, llama_cpp: Path, quantize: Path) -> list[Path]:
    """``f16.gguf`` by llama.cpp's converter, then ``q4_0.gguf`` and ``q8_0.gguf`` by ``llama-quantize``."""
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / "f16.gguf"
    if not f16.exists():
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(llama_cpp / "gguf-py"), *filter(None, [os.environ.get("PYTHONPATH")])]))
        _run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf), "--outtype", "f16",
              "--outfile", str(f16)], env)
    made = [f16]
    for kind in ("Q4_0", "Q8_0"):
        path = out / f"{kind.lower()}.gguf"
        if not path.exists():
            _run([str(quantize), str(f16), str(path), kind])
        made.append(path)
    return made


def write_ort(hf: Path, out: Path, cache: Path) -> Path:
    """onnxruntime-genai's int4 CPU model of ``hf`` (its builder's defaults: blocks of 32, symmetric)."""
    if not (out / "genai_config.json").exists():
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        _run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
              "-p", "int4", "-e", "cpu", "-c", str(cache)], env)
    return out


def _run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    _log("$ " + " ".join(cmd))
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env)
    _log(f"  done in {time.perf_counter() - t0:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="output folder (files go under OUT/<config>/)")
    ap.add_argument("--config", choices=sorted(CONFIGS), default="full")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama-cpp", type=Path, help="llama.cpp's source folder (convert_hf_to_gguf.py, gguf-py)")
    ap.add_argument("--llama-quantize", type=Path, help="the llama-quantize binary")
    ap.add_argument("--no-ort", action="store_true", help="skip onnxruntime-genai's int4 model")
    args = ap.parse_args(argv)
    if (args.llama_cpp is None) != (args.llama_quantize is None):
        ap.error("--llama-cpp and --llama-quantize go together")
    root = args.out / args.config
    hf = root / "hf"
    if not (hf / "model.safetensors").exists():
        write_hf(hf, args.config, args.seed)
    made: dict[str, object] = {"hf": str(hf)}
    if args.llama_cpp is not None:
        made["gguf"] = [str(p) for p in write_gguf(hf, root / "gguf", args.llama_cpp, args.llama_quantize)]
    if not args.no_ort:
        made["ort_int4"] = str(write_ort(hf, root / "ort-int4", root / "ort-cache"))
    print(json.dumps(made, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
