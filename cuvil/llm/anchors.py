"""The other engines' LLM speed on this machine (issue 30's anchors): llama.cpp (``llama-bench``),
onnxruntime-genai and PyTorch eager, each on the same prompt length, number of new tokens and thread count,
each in a child process of its own (thread pools and environment variables do not leak between engines
or into the caller), and the bound memory bandwidth puts on decoding.

Protocol, the same for every engine:

- ``prompt`` random token ids (seeded; never a special token) are prefilled: the prefill rate is
  ``prompt / time`` from the first token id in to the first new token out (its logits and argmax);
- then ``new_tokens`` decode steps, each one token in and the next (greedy) out, the KV cache grown in
  place: the decode rate is ``new_tokens / time``;
- end of sequence never stops a run (the weights are random: it may come early);
- a warm-up run first (a short one in the Python engines, llama-bench's own), then ``repeats`` timed runs;
  each rate is the median over them.

llama-bench measures the two phases as two tests (``-p PROMPT -n NEW``): its decode runs from an empty KV
cache rather than after the prompt, which at these lengths changes little (attention over 128 more
positions against a forward pass through every weight).

``cpu_s`` and ``wall_s`` are the child process's, from start to exit (loading, warm-up and every timed run):
their ratio says how many cores an engine kept busy (spinning thread pools included).  Nothing here
imports torch, transformers or onnxruntime_genai in the caller: only the children do.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from cuvil.errors import ArgumentError, TargetError

__all__ = ["AnchorResult", "llama_cpp", "ort_genai", "torch_eager", "bandwidth_bound", "find_llama_bench"]

PROMPT = 128
NEW_TOKENS = 64
_MARK = "CUVIL-ANCHOR-RESULT "
_LLAMA_INSTALL = ("build llama.cpp's llama-bench from the sources the llama-cpp-python sdist ships (`pip download "
                  "--no-deps --no-binary :all: llama-cpp-python`, untar, cmake -S .../vendor/llama.cpp -B build, "
                  "`cmake --build build --target llama-bench llama-quantize`), then pass its path or set "
                  "CUVIL_LLAMA_BENCH")
_INSTALL = {
    "onnxruntime_genai": "pip install onnxruntime-genai onnx_ir",
    "torch": "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
    "transformers": "pip install transformers safetensors",
}


@dataclass(frozen=True)
class AnchorResult:
    """One engine's figures: tokens per second in each phase, and the child process's CPU and wall time."""

    engine: str
    threads: int
    prompt: int
    new_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    cpu_s: float
    wall_s: float
    detail: dict[str, Any] = field(default_factory=dict)

    def row(self) -> str:
        """One line: engine, threads, both rates, CPU seconds over wall seconds."""
        return (f"{self.engine:<28} t={self.threads}  prefill {self.prefill_tok_s:8.1f} tok/s  "
                f"decode {self.decode_tok_s:7.2f} tok/s  cpu {self.cpu_s:6.1f} s / wall {self.wall_s:6.1f} s")


def _check(prompt: int, new_tokens: int, threads: int, repeats: int) -> None:
    for name, v in (("prompt", prompt), ("new_tokens", new_tokens), ("threads", threads), ("repeats", repeats)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ArgumentError(f"{name} must be a positive int, got {v!r}")


def _child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def _run_child(cmd: list[str], env: dict[str, str], timeout: float, what: str) -> tuple[str, float, float]:
    """Run ``cmd``; its stdout, and its CPU seconds (user + system, from the kernel's accounting of exactly
    this child) and wall seconds.  A non-zero exit or a timeout raises TargetError with stderr's tail."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, stdin=subprocess.DEVNULL)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - t0 > timeout:
                proc.kill()
                os.wait4(proc.pid, 0)
                proc.returncode = -9
                raise TargetError(f"{what} ran past {timeout:.0f} s: killed")
            time.sleep(0.02)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
    if proc.returncode != 0:
        tail = "\n".join(stderr.strip().splitlines()[-15:])
        raise TargetError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return stdout, usage.ru_utime + usage.ru_stime, wall


def find_llama_bench(path: str | os.PathLike[str] | None = None) -> str:
    """The llama-bench binary: ``path``, else ``$CUVIL_LLAMA_BENCH``, else ``llama-bench`` on PATH."""
    candidate = path if path is not None else os.environ.get("CUVIL_LLAMA_BENCH") or shutil.which("llama-bench")
    if candidate is None:
        raise TargetError(f"llama-bench not found: {_LLAMA_INSTALL}")
    if not (os.path.isfile(candidate) and os.access(candidate, os.X_OK)):
        raise TargetError(f"llama-bench {candidate!r} is not an executable file: {_LLAMA_INSTALL}")
    return str(candidate)


def llama_cpp(gguf_path: str | os.PathLike[str], prompt: int = PROMPT, new_tokens: int = NEW_TOKENS,
              threads: int = 1, repeats: int = 5, llama_bench: str | os.PathLike[str] | None = None,
              timeout: float = 3600.0) -> AnchorResult:
    """llama.cpp on the GGUF file ``gguf_path``: ``llama-bench -m FILE -p PROMPT -n NEW -t THREADS -r REPEATS
    -o json``, each rate the median of its samples."""
    _check(prompt, new_tokens, threads, repeats)
    exe = find_llama_bench(llama_bench)
    if not os.path.isfile(gguf_path):
        raise ArgumentError(f"no GGUF file at {str(gguf_path)!r}")
    cmd = [exe, "-m", str(gguf_path), "-p", str(prompt), "-n", str(new_tokens), "-t", str(threads),
           "-r", str(repeats), "-o", "json"]
    stdout, cpu, wall = _run_child(cmd, _child_env(threads), timeout, "llama-bench")
    try:
        tests = json.loads(stdout[stdout.index("["):])
    except ValueError as e:
        raise TargetError(f"llama-bench printed no JSON list: {stdout[-500:]!r}") from e
    rates: dict[str, float] = {}
    for t in tests:
        phase = "prefill" if t["n_prompt"] > 0 and t["n_gen"] == 0 else "decode" if t["n_gen"] > 0 else None
        if phase:
            rates[phase] = statistics.median(t.get("samples_ts") or [t["avg_ts"]])
    if set(rates) != {"prefill", "decode"}:
        raise TargetError(f"llama-bench's JSON lacks a prefill or a decode test: {tests!r}")
    first = tests[0]
    detail = {k: first.get(k) for k in ("build_commit", "model_type", "model_size", "model_n_params", "cpu_info",
                                         "n_batch", "n_ubatch", "type_k", "flash_attn")}
    detail["samples_ts"] = {("prefill" if t["n_gen"] == 0 else "decode"): t.get("samples_ts") for t in tests}
    return AnchorResult(f"llama.cpp {first.get('model_type', '')}".strip(), threads, prompt, new_tokens,
                        rates["prefill"], rates["decode"], cpu, wall, detail)


def _python_anchor(engine: str, folder: str | os.PathLike[str], prompt: int, new_tokens: int, threads: int,
                   repeats: int, seed: int, timeout: float, modules: tuple[str, ...]) -> AnchorResult:
    _check(prompt, new_tokens, threads, repeats)
    for mod in modules:
        if importlib.util.find_spec(mod) is None:
            raise TargetError(f"{engine} needs the Python module {mod}, which is not installed: {_INSTALL[mod]}")
    if not os.path.isdir(folder):
        raise ArgumentError(f"no model folder at {str(folder)!r}")
    args = dict(engine=engine, folder=str(folder), prompt=prompt, new_tokens=new_tokens, threads=threads,
                repeats=repeats, seed=seed)
    return child_result("cuvil.llm.anchors", args, timeout, engine)


def child_result(module: str, args: dict[str, Any], timeout: float, what: str) -> AnchorResult:
    """Run ``python -m module JSON(args)`` (args with prompt, new_tokens and threads), whose last line marked
    ``_MARK`` holds its rates per repeat: the medians, with the child's CPU and wall seconds."""
    threads = args["threads"]
    cmd = [sys.executable, "-m", module, json.dumps(args)]
    stdout, cpu, wall = _run_child(cmd, _child_env(threads), timeout, what)
    lines = [ln for ln in stdout.splitlines() if ln.startswith(_MARK)]
    if not lines:
        raise TargetError(f"{what}'s child printed no result: {stdout[-500:]!r}")
    res = json.loads(lines[-1][len(_MARK):])
    return AnchorResult(res["engine"], threads, args["prompt"], args["new_tokens"],
                        statistics.median(res["prefill_tok_s"]), statistics.median(res["decode_tok_s"]), cpu, wall,
                        res["detail"])


def ort_genai(folder: str | os.PathLike[str], prompt: int = PROMPT, new_tokens: int = NEW_TOKENS,
              threads: int = 1, repeats: int = 3, seed: int = 0, timeout: float = 3600.0) -> AnchorResult:
    """onnxruntime-genai on its model folder (``genai_config.json``, ``model.onnx``), greedy, with
    ``threads`` intra-op threads and one inter-op thread (set through ``og.Config.overlay``)."""
    return _python_anchor("onnxruntime-genai", folder, prompt, new_tokens, threads, repeats, seed, timeout,
                          ("onnxruntime_genai",))


def torch_eager(hf_folder: str | os.PathLike[str], prompt: int = PROMPT, new_tokens: int = NEW_TOKENS,
                threads: int = 1, repeats: int = 3, seed: int = 0, timeout: float = 3600.0) -> AnchorResult:
    """transformers' model of the Hugging Face folder in PyTorch eager, float32, ``torch.set_num_threads``,
    greedy with its KV cache (``past_key_values``), under ``torch.inference_mode``."""
    return _python_anchor("torch eager fp32", hf_folder, prompt, new_tokens, threads, repeats, seed, timeout,
                          ("torch", "transformers"))


def bandwidth_bound(weight_bytes: float, threads: int = 1) -> float:
    """The decode rate (tokens per second) memory bandwidth allows when every step streams
    ``weight_bytes``: :func:`cuvil.graph.profile.stream_bandwidth` at ``threads`` threads (a copy, reads and
    writes counted) over the bytes.  The session's thread count is restored afterwards."""
    from cuvil.graph.profile import stream_bandwidth
    from cuvil.runtime.threads import explicit_num_threads, set_num_threads

    if weight_bytes <= 0:
        raise ArgumentError(f"weight_bytes must be positive, got {weight_bytes!r}")
    _check(1, 1, threads, 1)
    before = explicit_num_threads()
    set_num_threads(threads)
    try:
        bw = stream_bandwidth()
    finally:
        set_num_threads(before)
    return bw / weight_bytes


# ---- the children ---------------------------------------------------------------------------------------------


def _prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(3, vocab, n).tolist()  # 0-2: <unk> <s> </s>


def _child_ort(a: dict[str, Any]) -> dict[str, Any]:
    import onnxruntime_genai as og

    folder, threads = a["folder"], a["threads"]
    config = og.Config(folder)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(config)
    with open(os.path.join(folder, "genai_config.json")) as f:
        vocab = json.load(f)["model"]["vocab_size"]

    def run(prompt: int, new: int) -> tuple[float, float]:
        ids = _prompt_ids(prompt, vocab, a["seed"])
        params = og.GeneratorParams(model)
        total = prompt + new + 1
        params.set_search_options(max_length=total, min_length=total, do_sample=False)
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(ids)  # the prefill's forward pass
        gen.generate_next_token()  # its argmax: the first new token
        t1 = time.perf_counter()
        for _ in range(new):  # each: a forward pass of the last token, then its argmax
            gen.generate_next_token()
        t2 = time.perf_counter()
        assert len(gen.get_sequence(0)) == total
        return prompt / (t1 - t0), new / (t2 - t1)

    run(min(a["prompt"], 16), min(a["new_tokens"], 4))
    rates = [run(a["prompt"], a["new_tokens"]) for _ in range(a["repeats"])]
    return {"engine": "onnxruntime-genai " + _ort_precision(folder), "prefill_tok_s": [r[0] for r in rates],
            "decode_tok_s": [r[1] for r in rates], "detail": {"version": og.__version__}}


def _ort_precision(folder: str) -> str:
    """``int4`` when the model holds MatMulNBits nodes of 4 bits (the builder's -p int4), else ``onnx``."""
    try:
        import onnx

        model = onnx.load(os.path.join(folder, "model.onnx"), load_external_data=False)
        bits = {at.i for n in model.graph.node if n.op_type == "MatMulNBits" for at in n.attribute
                if at.name == "bits"}
        return f"int{bits.pop()}" if len(bits) == 1 else "onnx"
    except Exception:  # noqa: BLE001 - only a label
        return "onnx"


def _child_torch(a: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a["threads"])
    torch.set_num_interop_threads(1)
    model = AutoModelForCausalLM.from_pretrained(a["folder"], dtype=torch.float32)
    model.eval()
    vocab = model.config.vocab_size

    def run(prompt: int, new: int) -> tuple[float, float]:
        ids = torch.tensor([_prompt_ids(prompt, vocab, a["seed"])], dtype=torch.long)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model(input_ids=ids, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            t1 = time.perf_counter()
            past = out.past_key_values
            for _ in range(new):
                out = model(input_ids=nxt, past_key_values=past, use_cache=True)
                past = out.past_key_values
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            t2 = time.perf_counter()
        assert past.get_seq_length() == prompt + new
        return prompt / (t1 - t0), new / (t2 - t1)

    run(min(a["prompt"], 16), min(a["new_tokens"], 4))
    rates = [run(a["prompt"], a["new_tokens"]) for _ in range(a["repeats"])]
    return {"engine": "torch eager fp32", "prefill_tok_s": [r[0] for r in rates],
            "decode_tok_s": [r[1] for r in rates],
            "detail": {"version": torch.__version__, "threads": torch.get_num_threads()}}


def _main(argv: list[str]) -> int:
    a = json.loads(argv[0])
    child = {"onnxruntime-genai": _child_ort, "torch eager fp32": _child_torch}[a["engine"]]
    print(_MARK + json.dumps(child(a)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
