"""``cuvil generate MODEL --prompt-ids 1,2,3 | --prompt TEXT --max-new-tokens N``: tokens printed as they
come, then the prefill and decode rates (the model loads through :func:`cuvil.llm.load`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from cuvil.errors import ArgumentError

__all__ = ["generate_cmd"]


def _tokenizer(model: str) -> Any:
    path = Path(model)
    folder = path if path.is_dir() else path.parent
    if not any((folder / n).exists() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise ArgumentError(f"{folder} has no tokenizer (tokenizer.json / tokenizer.model): give --prompt-ids")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def generate_cmd(args: argparse.Namespace) -> int:
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
