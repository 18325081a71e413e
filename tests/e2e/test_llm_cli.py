"""``cuvil generate`` and ``cuvil bench --llm`` on a tiny Hugging Face folder: the printed tokens are
transformers' greedy ones, mistakes are one-line errors, and the benchmark's cuvil row runs by the anchors'
protocol."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cuvil.errors import ArgumentError  # noqa: E402
from cuvil.llm.bench import cuvil_rates, files  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, object]:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=300, max_position_embeddings=128)
    m = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny") / "hf"
    m.save_pretrained(path)
    return path, m


def _cuvil(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cuvil.cli", *args], capture_output=True, text=True, timeout=600)


def test_generate_prints_torch_greedy_tokens(folder: tuple[pathlib.Path, object]) -> None:
    path, m = folder
    ids = [5, 17, 42, 7, 99]
    r = _cuvil("generate", str(path), "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", "12",
               "--weights", "fp32")
    assert r.returncode == 0, r.stderr
    got = [int(t) for t in r.stdout.split()]
    with torch.no_grad():
        ref = m.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                         pad_token_id=0)[0, len(ids):].tolist()
    eos = set(m.generation_config.eos_token_id if isinstance(m.generation_config.eos_token_id, list)
              else [m.generation_config.eos_token_id])
    stop = next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))
    assert got == ref[:stop]
    assert "decode:" in r.stderr and "tok/s" in r.stderr


def test_generate_mistakes_are_one_line(folder: tuple[pathlib.Path, object], tmp_path: pathlib.Path) -> None:
    path, _ = folder
    r = _cuvil("generate", str(path), "--prompt", "hello")
    assert r.returncode == 1 and "has no tokenizer" in r.stderr and "Traceback" not in r.stderr
    r = _cuvil("generate", str(path), "--prompt-ids", "1,x")
    assert r.returncode == 1 and "--prompt-ids" in r.stderr
    r = _cuvil("generate", str(tmp_path), "--prompt-ids", "1")
    assert r.returncode == 1 and "not a GGUF file" in r.stderr


@pytest.mark.slow
def test_bench_finds_files_and_runs_cuvil(folder: tuple[pathlib.Path, object], tmp_path: pathlib.Path) -> None:
    path, _ = folder
    assert files(str(path.parent)) == {"hf": str(path)}
    with pytest.raises(ArgumentError, match="no Hugging Face folder"):
        files(str(tmp_path))
    r = cuvil_rates(str(path), "int4", prompt=16, new_tokens=4, threads=1, repeats=1)
    assert r.prefill_tok_s > 0 and r.decode_tok_s > 0 and r.cpu_s > 0
    assert r.detail["weight_bytes"] > 0 and np.isfinite(r.detail["load_and_compile_s"])
