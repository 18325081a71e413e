"""Issue 30's aim, measured: a Llama-3-8B-shaped model loaded as int4 and generating on a 24 GB machine.

    python benchmarks/llm_big_model.py                     # write the folder if missing, then load + generate
    python benchmarks/llm_big_model.py --compare --folder /work/anchors/models/full/hf --no-generate
                                                           # TinyLlama: lean loading against the float32 way

The folder (default ``/work/anchors/models/llama3-8b``, 15 GiB) is a Hugging Face checkpoint of seeded
random bfloat16 weights in LLaMA 3 8B's shape: hidden 4096, 32 layers, 32 heads / 8 key-value heads, ffn
14336, vocabulary 128256, RoPE base 500000 with LLaMA 3.1's scaling (factor 8, low / high frequency
factors 1 / 4, original context 8192).  Matrices are ``N(0, 0.02)`` (numpy's generator seeded per tensor
with ``--seed`` and the tensor's index), norms ones; each tensor is drawn a block of rows at a time and
written to one of four safetensors shards (with ``model.safetensors.index.json``), so the model is never
whole in memory.

Each measurement runs in a child process (one at a time) that reports, as one JSON line: the seconds to
read and quantize (``read_s``), to build the :class:`~cuvil.llm.runtime.Generator` (``generator_s``: it
compiles the kernels), the resident set after each and its peak (``ru_maxrss``), and with ``--tokens N``
the first generation's seconds, then a second generation's decode tokens per second with ``--threads``
threads.  ``--mode lean`` is what ``cuvil.llm.load(folder, weights)`` does (each projection quantized as
it is read: ``read(folder, transform=...)``, then ``convert`` and ``Generator``); ``--mode eager`` reads
every tensor as float32 first and then quantizes (``convert(read(folder))``, the way before lean
loading); ``--mode api`` times the call ``cuvil.llm.load(folder, weights, context=..., chunk=...)`` as a
whole; ``--compare`` runs eager, then lean.  The prefill chunk is 1 by default: a 4-token prompt then runs one
token at a time and only the one-token step is compiled (each step size lays out every weight once more:
3.8 GiB for this model in int4); ``--max-rss-gib`` kills a child that grows past it.

Measured (2 shared cores, 23 GB, 2026-12-05): the 8B folder in int4 reads and quantizes in 85 s to 7.3 GiB
resident (9.8 GiB peak: the float32 head while it is quantized), and runs 3.6 - 4.8 decode tokens/s on one
thread; with chunk 1 the whole process peaks at 14.7 GiB, ``load(folder, "int4", context=1024)`` (chunk 64)
at 18.5 GiB.  TinyLlama (``--compare``): the read's peak 4.9 GiB eager, 1.3 GiB lean.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)
SHARDS = 4


def _log(msg: str) -> None:
    print(f"[llm_big_model {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------ the folder

def hf_config(shape: dict[str, int]) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape,
        "head_dim": shape["hidden_size"] // shape["num_attention_heads"], "hidden_act": "silu",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009], "tie_word_embeddings": False, "attention_bias": False,
        "mlp_bias": False, "torch_dtype": "bfloat16",
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    }


def tensors(shape: dict[str, int]) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, shape, shard) of every tensor, in the order they are written."""
    H, F, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    D = H // shape["num_attention_heads"]
    q, kv = H, shape["num_key_value_heads"] * D
    out: list[tuple[str, tuple[int, ...], int]] = [("model.embed_tokens.weight", (shape["vocab_size"], H), 0)]
    per_shard = -(-L // SHARDS)
    for i in range(L):
        p, s = f"model.layers.{i}.", i // per_shard
        out += [(p + "input_layernorm.weight", (H,), s), (p + "self_attn.q_proj.weight", (q, H), s),
                (p + "self_attn.k_proj.weight", (kv, H), s), (p + "self_attn.v_proj.weight", (kv, H), s),
                (p + "self_attn.o_proj.weight", (H, q), s), (p + "post_attention_layernorm.weight", (H,), s),
                (p + "mlp.gate_proj.weight", (F, H), s), (p + "mlp.up_proj.weight", (F, H), s),
                (p + "mlp.down_proj.weight", (H, F), s)]
    last = SHARDS - 1
    out += [("model.norm.weight", (H,), last), ("lm_head.weight", (shape["vocab_size"], H), last)]
    return out


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even."""
    bits = x.view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


def write_folder(folder: Path, shape: dict[str, int], seed: int) -> None:
    """The checkpoint, tensor by tensor and a block of rows at a time (see the module docstring)."""
    folder.mkdir(parents=True, exist_ok=True)
    entries = tensors(shape)
    weight_map: dict[str, str] = {}
    total = 0
    names = [f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors" for s in range(SHARDS)]
    for s, fname in enumerate(names):
        mine = [(i, n, sh) for i, (n, sh, t) in enumerate(entries) if t == s]
        header: dict[str, dict] = {"__metadata__": {"format": "pt"}}  # type: ignore[dict-item]
        at = 0
        for _, n, sh in mine:
            size = 2 * int(np.prod(sh))
            header[n] = {"dtype": "BF16", "shape": list(sh), "data_offsets": [at, at + size]}
            at += size
            weight_map[n] = fname
        total += at
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        part = folder / (fname + ".part")
        with open(part, "wb") as fh:
            fh.write(len(raw).to_bytes(8, "little") + raw)
            for index, _n, sh in mine:
                rng = np.random.default_rng([seed, index])
                if len(sh) == 1:
                    _bf16(np.ones(sh, np.float32)).tofile(fh)
                    continue
                rows = max(1, (1 << 24) // sh[1])
                for r in range(0, sh[0], rows):
                    block = rng.standard_normal((min(rows, sh[0] - r), sh[1]), dtype=np.float32)
                    block *= np.float32(0.02)
                    _bf16(block).tofile(fh)
        part.rename(folder / fname)
        _log(f"wrote {fname} ({(at + len(raw) + 8) / 2**30:.1f} GiB)")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (folder / "config.json").write_text(json.dumps(hf_config(shape), indent=1))  # last: marks the folder done


# ------------------------------------------------------------------------------------------ measuring

def _rss_gib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def child(args: argparse.Namespace) -> dict:
    import cuvil
    from cuvil.llm.api import convert, read
    from cuvil.llm.quantize import quantize_weight
    from cuvil.llm.runtime import Generator

    cuvil.set_num_threads(args.threads)
    out: dict = {"folder": str(args.folder), "weights": args.weights, "mode": args.mode, "threads": args.threads,
                 "context": args.context}
    if args.mode == "api":  # the call itself, timed as a whole
        from cuvil.llm.api import load

        t0 = time.perf_counter()
        gen = load(args.folder, args.weights, context=args.context or None, chunk=args.chunk)
        out["load_s"] = round(time.perf_counter() - t0, 1)
        return _generate(args, gen, out)
    transform = None
    if args.mode == "lean" and args.weights in ("int4", "int8"):
        bits, group = (4, 32) if args.weights == "int4" else (8, None)

        def transform(name: str, a: np.ndarray) -> object:  # what cuvil.llm.load passes read for int4 / int8
            return quantize_weight(a, bits, group, True, name=name)
    # cuvil.llm.load(folder, weights, context=..., chunk=...) in two timed steps
    t0 = time.perf_counter()
    w = convert(read(args.folder, max_context=args.context, transform=transform), args.weights)
    out["read_s"] = round(time.perf_counter() - t0, 1)
    out["after_read_rss_gib"] = round(_rss_gib(), 2)
    out["after_read_peak_gib"] = round(_peak_gib(), 2)
    t1 = time.perf_counter()
    gen = Generator(w, context=args.context, chunk=args.chunk).compile()  # the steps' kernels, weights laid out
    del w
    out["generator_s"] = round(time.perf_counter() - t1, 1)
    return _generate(args, gen, out)


def _generate(args: argparse.Namespace, gen: Any, out: dict) -> dict:
    out["weights_gib"] = round(gen.weights.nbytes / 2**30, 2)
    out["rss_after_load_gib"] = round(_rss_gib(), 2)
    out["peak_after_load_gib"] = round(_peak_gib(), 2)
    if args.tokens:
        ids = list(range(1000, 1000 + args.prompt))
        t1 = time.perf_counter()
        first = list(gen.generate(ids, args.tokens, stop=()))
        out["first_generate_s"] = round(time.perf_counter() - t1, 1)  # compiling the kernels included
        gen.reset()
        again = list(gen.generate(ids, args.tokens, stop=()))
        st = gen.stats
        out["tokens"] = again
        out["same_tokens_twice"] = first == again
        out["prefill_s"] = round(st.prefill_s, 3)
        out["decode_tok_s"] = round(st.decode_tok_s, 3)
        out["rss_end_gib"] = round(_rss_gib(), 2)
    out["peak_gib"] = round(_peak_gib(), 2)
    return out


def measure(args: argparse.Namespace, mode: str) -> dict:
    """One child process; killed (and reported) if its resident set passes ``--max-rss-gib``."""
    cmd = [sys.executable, __file__, "--child", "--folder", str(args.folder), "--weights", args.weights,
           "--mode", mode, "--tokens", str(args.tokens), "--threads", str(args.threads), "--context",
           str(args.context), "--chunk", str(args.chunk), "--prompt", str(args.prompt)]
    _log(f"{mode}: {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    seen = 0.0
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as fh:
                rss = next((int(x.split()[1]) / 2**20 for x in fh if x.startswith("VmRSS:")), 0.0)
        except OSError:
            rss = 0.0
        seen = max(seen, rss)
        if rss > args.max_rss_gib:
            proc.kill()
            proc.wait()
            _log(f"{mode}: killed at {rss:.2f} GiB resident (--max-rss-gib {args.max_rss_gib})")
            return {"mode": mode, "killed_at_gib": round(rss, 2), "s": round(time.perf_counter() - t0, 1)}
        time.sleep(0.5)
    stdout = proc.stdout.read() if proc.stdout else ""
    if proc.returncode:
        _log(f"{mode}: the child failed (rc {proc.returncode}, {seen:.2f} GiB resident at most)")
        return {"mode": mode, "rc": proc.returncode, "sampled_peak_gib": round(seen, 2)}
    result = json.loads(stdout.strip().splitlines()[-1])
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    _log(json.dumps(result))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--folder", type=Path, default=Path("/work/anchors/models/llama3-8b"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--weights", default="int4", choices=("int4", "int8", "fp32", "as-stored"))
    ap.add_argument("--mode", default="lean", choices=("lean", "eager", "api"))
    ap.add_argument("--compare", action="store_true", help="measure eager, then lean")
    ap.add_argument("--tokens", type=int, default=8, help="tokens to generate (0: load only)")
    ap.add_argument("--no-generate", dest="tokens", action="store_const", const=0)
    ap.add_argument("--prompt", type=int, default=4, help="prompt tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024,
                    help="KV cache positions (0 with --mode api: the config's 131072)")
    ap.add_argument("--chunk", type=int, default=1,
                    help="prefill chunk (1: only the one-token step is compiled and laid out; each step "
                         "size lays out every weight once more)")
    ap.add_argument("--max-rss-gib", type=float, default=19.0, help="kill the child past this resident set")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    if not (args.folder / "config.json").is_file():
        free = os.statvfs(args.folder.parent if args.folder.parent.exists() else "/")
        need = 2 * sum(int(np.prod(s)) for _, s, _ in tensors(LLAMA3_8B))
        if free.f_bavail * free.f_frsize < need * 1.1:
            sys.exit(f"{args.folder}: {need / 2**30:.1f} GiB needed, {free.f_bavail * free.f_frsize / 2**30:.1f} free")
        _log(f"writing {args.folder} ({need / 2**30:.1f} GiB of bfloat16, seed {args.seed})")
        t0 = time.perf_counter()
        write_folder(args.folder, LLAMA3_8B, args.seed)
        _log(f"wrote the folder in {time.perf_counter() - t0:.0f} s")
    results = [measure(args, m) for m in (("eager", "lean") if args.compare else (args.mode,))]
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
