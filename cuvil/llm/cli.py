"""``cuvil generate MODEL --prompt-ids 1,2,3 | --prompt TEXT --max-new-tokens N``: tokens printed as they
come, then the prefill and decode rates."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from cuvil.errors import ArgumentError

__all__ = ["add_parsers", "dispatch"]


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate tokens with an LLM (Hugging Face folder, onnxruntime-genai "
                       "folder or GGUF file)")
    p.add_argument("model", help="a Hugging Face folder (config.json), an onnxruntime-genai folder "
                   "(genai_config.json) or a .gguf file")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt-ids", default=None, help="the prompt as token ids, e.g. 1,15043,3186")
    g.add_argument("--prompt", default=None, help="the prompt as text (the folder's tokenizer encodes it)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--weights", default="as-stored", choices=("as-stored", "fp32", "int4", "int8"))
    p.add_argument("--group", type=int, default=32, help="int4: the weights of a group share a scale")
    p.add_argument("--threads", type=int, default=None, help="threads (default: cuvil's)")
    p.add_argument("--context", type=int, default=None, help="positions the KV cache holds")
    p.add_argument("--kv-cache", default="float32", choices=("float32", "int8"), help="the KV cache's values")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def _tokenizer(model: str) -> Any:
    path = Path(model)
    folder = path if path.is_dir() else path.parent
    if not any((folder / n).exists() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise ArgumentError(f"{folder} has no tokenizer (tokenizer.json / tokenizer.model): give --prompt-ids")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def dispatch(args: argparse.Namespace) -> int | None:
    if args.cmd != "generate":
        return None
    from cuvil.llm.api import load

    tok = None
    if args.prompt is not None:
        tok = _tokenizer(args.model)
        ids = list(tok.encode(args.prompt))
    else:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise ArgumentError(f"--prompt-ids {args.prompt_ids!r}: write token ids separated by commas") from None
    if args.threads:
        from cuvil.runtime.threads import set_num_threads

        set_num_threads(args.threads)
    gen = load(args.model, args.weights, context=args.context, group=args.group, kv_cache=args.kv_cache)
    for t in gen.generate(ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed):
        text = tok.decode([t]) if tok is not None else f"{t} "
        sys.stdout.write(text)
        sys.stdout.flush()
    s = gen.stats
    print(f"\nprefill: {s.prompt_tokens} tokens, {s.prefill_tok_s:.1f} tok/s; decode: {s.new_tokens} tokens, "
          f"{s.decode_tok_s:.1f} tok/s", file=sys.stderr)
    return 0
