"""Helpers of the cuvil.llm tests that compare with transformers (the tests import torch and transformers
with ``pytest.importorskip`` first): random prompts and the tokens transformers picks greedily."""

from __future__ import annotations

import numpy as np


def prompt(n: int, vocab: int, seed: int = 1) -> list[int]:
    """``n`` random token ids in ``[1, vocab)``."""
    return np.random.default_rng(seed).integers(1, vocab, n).tolist()


def torch_greedy(m: object, ids: list[int], n: int) -> list[int]:
    """The ``n`` tokens transformers' ``generate`` picks greedily after the prompt ``ids``."""
    import torch

    mask = torch.ones(1, len(ids), dtype=torch.long)
    with torch.no_grad():
        out = m.generate(torch.tensor([ids]), attention_mask=mask, max_new_tokens=n,  # type: ignore[attr-defined]
                         min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()
