"""``cuvil bench --llm MODEL``: cuvil's prefill and decode rates beside llama.cpp, onnxruntime-genai and eager
PyTorch on the same weights, with the decode rate memory bandwidth allows (:mod:`cuvil.llm.anchors` has
the protocol; cuvil runs it the same way, in a child process of its own).

MODEL is a folder as ``benchmarks/llm_models.py`` writes it (``hf/``, ``gguf/q4_0.gguf``, ``ort-int4/``), or
a Hugging Face folder with the other files given by ``--gguf`` / ``--ort``.  Rows: cuvil int4 (group 32,
quantized from the HF weights), cuvil on the GGUF Q4_0 file, cuvil on the onnxruntime-genai model, then
the anchors that are there.  A missing engine is a row saying why, not an error (llama-bench is not on PyPI).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from cuvil.errors import ArgumentError, CuvilError
from cuvil.llm.anchors import (
    _MARK,
    NEW_TOKENS,
    PROMPT,
    AnchorResult,
    _check,
    _prompt_ids,
    bandwidth_bound,
    child_result,
    llama_cpp,
    ort_genai,
    torch_eager,
)

__all__ = ["cuvil_rates", "files", "run"]


def files(model: str, gguf: str | None = None, ort: str | None = None) -> dict[str, str]:
    """The model's files by kind (``hf``, ``gguf``, ``ort``): those given, else those found in ``model``."""
    p = Path(model)
    found: dict[str, str] = {}
    hf = p / "hf" if (p / "hf" / "config.json").exists() else p if (p / "config.json").exists() else None
    if hf is not None:
        found["hf"] = str(hf)
    g = Path(gguf) if gguf else p / "gguf" / "q4_0.gguf"
    if g.is_file():
        found["gguf"] = str(g)
    o = Path(ort) if ort else p / "ort-int4"
    if (o / "genai_config.json").exists():
        found["ort"] = str(o)
    if not found:
        raise ArgumentError(f"{model}: no Hugging Face folder (config.json, or hf/config.json), GGUF file or "
                            "onnxruntime-genai folder there")
    return found


def cuvil_rates(source: str, weights: str = "as-stored", prompt: int = PROMPT, new_tokens: int = NEW_TOKENS,
                threads: int = 1, repeats: int = 3, seed: int = 0, timeout: float = 3600.0) -> AnchorResult:
    """cuvil's rates on ``source`` (any :func:`cuvil.llm.load` path) by the anchors' protocol, in a child."""
    _check(prompt, new_tokens, threads, repeats)
    args = dict(source=str(source), weights=weights, prompt=prompt, new_tokens=new_tokens, threads=threads,
                repeats=repeats, seed=seed)
    return child_result("cuvil.llm.bench", args, timeout, f"cuvil {weights}")


def _child(a: dict[str, Any]) -> dict[str, Any]:
    from cuvil.llm.api import load
    from cuvil.runtime.threads import set_num_threads

    set_num_threads(a["threads"])
    t0 = time.perf_counter()
    gen = load(a["source"], a["weights"], context=a["prompt"] + a["new_tokens"] + 8)
    ids = _prompt_ids(a["prompt"], gen.config.vocab, a["seed"])

    def once(prompt: list[int], new: int) -> tuple[float, float]:
        gen.reset()
        t0 = time.perf_counter()
        gen.prefill(prompt)
        tok = gen.greedy()
        t1 = time.perf_counter()
        for _ in range(new):
            gen.decode(tok)
            tok = gen.greedy()
        t2 = time.perf_counter()
        return len(prompt) / (t1 - t0), new / (t2 - t1)

    once(ids, 2)  # compiles the prefill and decode steps
    ready = time.perf_counter() - t0
    rates = [once(ids, a["new_tokens"]) for _ in range(a["repeats"])]
    kinds = sorted({type(L.q).__name__ for L in gen.weights.layers})
    return {"engine": f"cuvil {a['weights']} ({'/'.join(kinds)})", "prefill_tok_s": [r[0] for r in rates],
            "decode_tok_s": [r[1] for r in rates],
            "detail": {"load_and_compile_s": round(ready, 1), "weight_bytes": gen.weights.nbytes}}


def run(model: str, threads: list[int], gguf: str | None = None, ort: str | None = None,
        llama_bench: str | None = None, repeats: int = 3, prompt: int = PROMPT, new_tokens: int = NEW_TOKENS,
        torch: bool = True) -> int:
    """Print the table (one row per engine and thread count)."""
    f = files(model, gguf, ort)
    rows: list[tuple[str, int, Any]] = []
    plan: list[tuple[str, Any]] = []
    if "hf" in f:
        plan.append(("cuvil int4 g32 (from HF)", lambda t: cuvil_rates(f["hf"], "int4", prompt, new_tokens, t,
                                                                     repeats)))
    if "gguf" in f:
        plan.append(("cuvil GGUF as stored", lambda t: cuvil_rates(f["gguf"], "as-stored", prompt, new_tokens,
                                                                  t, repeats)))
        plan.append(("llama.cpp", lambda t: llama_cpp(f["gguf"], prompt, new_tokens, t, max(repeats, 3),
                                                      llama_bench)))
    if "ort" in f:
        plan.append(("cuvil onnxruntime-genai model", lambda t: cuvil_rates(f["ort"], "as-stored", prompt,
                                                                           new_tokens, t, repeats)))
        plan.append(("onnxruntime-genai", lambda t: ort_genai(f["ort"], prompt, new_tokens, t, repeats)))
    if "hf" in f and torch:
        plan.append(("torch eager fp32", lambda t: torch_eager(f["hf"], prompt, new_tokens, t, 1)))
    print(f"cuvil bench --llm {model}: prompt {prompt}, {new_tokens} new tokens, greedy; load {_load()}")
    print(f"{'engine':44s} {'thr':>3s} {'prefill tok/s':>13s} {'decode tok/s':>12s} {'cpu s':>7s} {'wall s':>7s}")
    bound_bytes = None
    for t in threads:
        for label, fn in plan:
            try:
                r = fn(t)
            except CuvilError as e:
                print(f"{label:44s} {t:3d}  skipped: {str(e).splitlines()[0][:120]}")
                continue
            rows.append((label, t, r))
            if bound_bytes is None and r.detail.get("weight_bytes"):
                bound_bytes = r.detail["weight_bytes"]
            print(f"{r.engine[:44]:44s} {t:3d} {r.prefill_tok_s:13.1f} {r.decode_tok_s:12.2f} {r.cpu_s:7.1f} "
                  f"{r.wall_s:7.1f}", flush=True)
        if bound_bytes:
            print(f"{'bandwidth bound (cuvil int4 bytes)':44s} {t:3d} {'':13s} "
                  f"{bandwidth_bound(bound_bytes, t):12.2f}", flush=True)
    return 0


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


if __name__ == "__main__":
    print(_MARK + json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
