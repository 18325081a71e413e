"""Issue 30's floor check "fp32 greedy tokens are identical to eager torch's" at a full model's shape: the Hugging
Face folder in transformers (float32, eager) and in cuvil (``cuvil.llm.load(folder, "fp32")``), the same seeded
prompt, greedy tokens compared one by one.

    python benchmarks/llm_fp32_check.py /work/anchors/models/full/hf [--prompt 64] [--new 32]

Needs torch and transformers, and memory for both copies of the weights (TinyLlama: about 13 GB; cuvil prefills
token by token, chunk 1, to keep one weight layout).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    a = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    import cuvil
    from cuvil.llm import load

    torch.set_num_threads(1)
    cuvil.set_num_threads(1)
    m = AutoModelForCausalLM.from_pretrained(a.folder, dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(3, m.config.vocab_size, a.prompt).tolist()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = m.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False, pad_token_id=0)
    ref = out[0, len(ids):].tolist()
    print(f"torch eager fp32: {time.perf_counter() - t0:.1f} s {ref}", flush=True)
    del m
    t0 = time.perf_counter()
    gen = load(a.folder, "fp32", chunk=1, context=a.prompt + a.new + 1)
    got = list(gen.generate(ids, a.new, stop=()))
    print(f"cuvil fp32: {time.perf_counter() - t0:.1f} s {got}")
    same = sum(x == y for x, y in zip(got, ref))
    print(f"{'identical' if got == ref else 'DIFFERENT'}: {same} of {len(ref)} tokens equal")
    return 0 if got == ref else 1


if __name__ == "__main__":
    sys.exit(main())
