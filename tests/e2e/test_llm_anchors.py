"""cuvil.llm.anchors (issue 30): the other engines' figures, on the ci-size model that
benchmarks/llm_models.py makes (2 layers, hidden 256, seeded random weights).

onnxruntime-genai and PyTorch eager run for real (pip installs both: under CI=true a missing one fails);
llama.cpp is not pip-installable, so its real run is skipped unless CUVIL_LLAMA_BENCH (llama-bench, with
llama-quantize beside it) and CUVIL_LLAMA_CPP (its source folder, for convert_hf_to_gguf.py) are set;
llama-bench's JSON is parsed from a stand-in script everywhere.
"""

from __future__ import annotations

import json
import os
import pathlib
import stat
import subprocess
import sys

import pytest
import toolchain

from cuvil.errors import ArgumentError, TargetError
from cuvil.llm import anchors

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "llm_models.py"
SMALL = dict(prompt=16, new_tokens=8, threads=1, repeats=1, timeout=600.0)


def _make(out: pathlib.Path, *extra: str) -> None:
    subprocess.run([sys.executable, str(SCRIPT), str(out), "--config", "ci", *extra], check=True,
                   stdout=subprocess.DEVNULL, env=dict(os.environ, HF_HUB_OFFLINE="1"))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> pathlib.Path:
    toolchain.module("torch", "pip install -e '.[torch]'")
    toolchain.module("transformers", "pip install -e '.[torch]'")
    out = tmp_path_factory.mktemp("llm-models")
    _make(out, "--no-ort")
    return out / "ci"


@pytest.fixture(scope="module")
def ort_model(models: pathlib.Path) -> pathlib.Path:
    toolchain.module("onnxruntime_genai", "pip install onnxruntime-genai onnx_ir")
    toolchain.module("onnx_ir", "pip install onnxruntime-genai onnx_ir")
    _make(models.parent)  # the Hugging Face folder is kept; adds ort-int4/
    return models / "ort-int4"


@pytest.mark.slow
def test_hf_folder(models: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    cfg = json.loads((models / "hf" / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (256, 2, 32000)
    tok = AutoTokenizer.from_pretrained(models / "hf")
    assert len(tok) == 32000
    text = "Hello, world: 42 tokens (and a byte \u00e9)"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.slow
def test_torch_eager(models: pathlib.Path) -> None:
    r = anchors.torch_eager(models / "hf", **SMALL)
    assert r.engine == "torch eager fp32" and r.detail["threads"] == 1
    assert r.prefill_tok_s > 0 and r.decode_tok_s > 0 and 0 < r.cpu_s and 0 < r.wall_s
    assert (r.prompt, r.new_tokens, r.threads) == (16, 8, 1)


@pytest.mark.slow
def test_ort_genai(ort_model: pathlib.Path) -> None:
    r = anchors.ort_genai(ort_model, **SMALL)
    assert r.engine == "onnxruntime-genai int4"
    assert r.prefill_tok_s > 0 and r.decode_tok_s > 0 and 0 < r.cpu_s and 0 < r.wall_s


@pytest.mark.slow
def test_llama_cpp(models: pathlib.Path) -> None:
    bench, src = os.environ.get("CUVIL_LLAMA_BENCH"), os.environ.get("CUVIL_LLAMA_CPP")
    if not (bench and src):
        pytest.skip("llama.cpp: set CUVIL_LLAMA_BENCH (llama-bench, llama-quantize beside it) and CUVIL_LLAMA_CPP "
                    "(its source folder) to run it")
    _make(models.parent, "--no-ort", "--llama-cpp", src,
          "--llama-quantize", str(pathlib.Path(bench).parent / "llama-quantize"))
    r = anchors.llama_cpp(models / "gguf" / "q4_0.gguf", prompt=16, new_tokens=8, threads=1, repeats=1)
    assert "Q4_0" in r.engine and r.prefill_tok_s > 0 and r.decode_tok_s > 0


def _fake_bench(tmp_path: pathlib.Path, tests: list[dict]) -> pathlib.Path:
    exe = tmp_path / "llama-bench"
    exe.write_text(f"#!{sys.executable}\nimport sys\nprint('loading...', file=sys.stderr)\n"
                   f"print({json.dumps(json.dumps(tests))})\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def test_llama_bench_json(tmp_path: pathlib.Path) -> None:
    """llama-bench -o json: one object per test; the rates are the medians of samples_ts."""
    common = {"model_type": "llama 1B Q4_0", "build_commit": "abc", "n_batch": 2048}
    exe = _fake_bench(tmp_path, [
        {**common, "n_prompt": 128, "n_gen": 0, "avg_ts": 30.0, "samples_ts": [29.0, 31.0, 35.0]},
        {**common, "n_prompt": 0, "n_gen": 64, "avg_ts": 12.0, "samples_ts": [12.0, 11.0, 14.0]}])
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    r = anchors.llama_cpp(gguf, threads=2, llama_bench=exe)
    assert (r.engine, r.prefill_tok_s, r.decode_tok_s, r.threads) == ("llama.cpp llama 1B Q4_0", 31.0, 12.0, 2)
    assert r.wall_s > 0 and r.cpu_s >= 0 and r.detail["build_commit"] == "abc"
    bad = _fake_bench(tmp_path, [{**common, "n_prompt": 128, "n_gen": 0, "avg_ts": 30.0}])
    with pytest.raises(TargetError, match="decode"):
        anchors.llama_cpp(gguf, llama_bench=bad)


def test_missing_tools(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing engine is a TargetError that says how to install it."""
    monkeypatch.delenv("CUVIL_LLAMA_BENCH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(TargetError, match="llama-cpp-python"):
        anchors.find_llama_bench()
    with pytest.raises(TargetError, match="not an executable"):
        anchors.llama_cpp(tmp_path / "m.gguf", llama_bench=tmp_path / "nothing")
    monkeypatch.setenv("CUVIL_LLAMA_BENCH", str(tmp_path / "nothing"))
    with pytest.raises(TargetError, match="CUVIL_LLAMA_BENCH"):
        anchors.find_llama_bench()
    monkeypatch.setattr(anchors.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(TargetError, match="pip install onnxruntime-genai"):
        anchors.ort_genai(tmp_path)
    with pytest.raises(TargetError, match="pip install torch"):
        anchors.torch_eager(tmp_path)


def test_arguments(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ArgumentError, match="threads"):
        anchors.ort_genai(tmp_path, threads=0)
    with pytest.raises(ArgumentError, match="no model folder"):
        anchors.torch_eager(tmp_path / "absent")
    with pytest.raises(ArgumentError, match="weight_bytes"):
        anchors.bandwidth_bound(0)


def test_bandwidth_bound() -> None:
    one = anchors.bandwidth_bound(1e9, threads=1)
    assert 0.1 < one < 1e4  # GB/s over 1 GB: any machine's memory
    assert anchors.bandwidth_bound(2e9, threads=1) == pytest.approx(one / 2)  # measured once per thread count
