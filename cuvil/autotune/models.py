"""Tuning several kernels at once (a whole model): spend the trials where they cut latency most.

:func:`tune_kernels` takes the distinct kernels of a model, each with how often it runs.
Every kernel first gets ``warmup`` trials (its untuned schedule among them); after that each
round gives ``chunk`` trials to the kernel whose share of the model's time, ``count x best
time``, is largest, discounted by how much its last round improved it (a kernel that stopped
improving gets fewer), until ``trials`` are spent.  Records land in one database, so
``cuvil.build(..., tuning_db=db)`` (and the ONNX session, once it passes ``tuning_db`` to
its kernel builds) picks each kernel's best.

:func:`tune_model` reads an ONNX file and tunes its kernels; it needs the importer to list a
model's distinct kernels (``cuvil.frontend.onnx.kernel_programs``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cuvil.errors import ArgumentError


@dataclass
class KernelResult:
    key: str
    count: int  # how often the model runs the kernel
    trials: int
    best_time_s: float | None
    untuned_time_s: float | None


def tune_kernels(kernels: Sequence[tuple[Sequence[Any], int]], trials: int = 64, db: Any = "cuvil-tuning.db",
                 target: Any = "llvm", timeout_s: float = 10.0, num_threads: int | None = None, *,
                 warmup: int = 4, chunk: int = 8, progress: bool | None = None, seed: int = 0,
                 tune_fn: Any = None, history: list[tuple[int, float]] | None = None) -> list[KernelResult]:
    """Tune ``kernels`` (pairs of te arguments and run count) with ``trials`` trials in all (see the module doc).

    ``tune_fn`` replaces :func:`cuvil.autotune.tune` (same signature), e.g. to tune on a remote board;
    ``history`` (a list) receives ``(trials spent, estimated model seconds)`` after each round."""
    from cuvil.autotune.api import tune as default_tune

    tune = tune_fn or default_tune

    if not kernels:
        raise ArgumentError("tune_kernels: no kernels to tune")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ArgumentError(f"tune_kernels: trials must be a positive int, got {trials!r}")
    state: list[Any] = [None] * len(kernels)
    gain = [1.0] * len(kernels)
    budget = trials

    def step(k: int, n: int) -> None:
        nonlocal budget
        before = state[k]
        want = (before.trials if before is not None else 0) + n
        res = tune(kernels[k][0], target, trials=want, db=db, timeout_s=timeout_s, num_threads=num_threads,
                   progress=progress, seed=seed + k, final_top=0)  # one final round per kernel, at the end
        budget -= res.measured
        if before is not None and res.untuned_time_s is None:
            res.untuned_time_s = before.untuned_time_s
        state[k] = res
        if history is not None and all(st is not None for st in state):
            est = sum(c * (st.best_time_s or st.untuned_time_s or 0.0) for (_, c), st in zip(kernels, state))
            history.append((sum(st.trials for st in state), est))
        if res.trials < want:  # the space is exhausted
            gain[k] = 0.0
        elif before is not None and before.best_time_s and res.best_time_s:
            gain[k] = 0.5 * gain[k] + 0.5 * max(0.05, 10 * (before.best_time_s - res.best_time_s) / before.best_time_s)

    for k in range(len(kernels)):
        if budget <= 0:
            break
        step(k, min(warmup, budget))
    while budget > 0:
        weights = [(c * (s.best_time_s or 0.0) * g if s is not None else 0.0)
                   for (_, c), s, g in zip(kernels, state, gain)]
        k = max(range(len(kernels)), key=lambda i: weights[i])
        if weights[k] <= 0:
            break
        step(k, min(chunk, budget))
    for k, st in enumerate(state):  # the final round of each kernel (its best candidates against its untuned)
        if st is not None:
            res = tune(kernels[k][0], target, trials=st.trials, db=db, timeout_s=timeout_s,
                       num_threads=num_threads, progress=progress, seed=seed + k)
            if res.untuned_time_s is None:
                res.untuned_time_s = st.untuned_time_s
            state[k] = res
    return [KernelResult(s.workload_key, c, s.trials, s.best_time_s, s.untuned_time_s)
            for (_, c), s in zip(kernels, state) if s is not None]


def tune_model(path: str | os.PathLike[str], trials: int = 64, db: Any = "cuvil-tuning.db", target: Any = "llvm",
               timeout_s: float = 10.0, num_threads: int | None = None, progress: bool | None = None,
               history: list[tuple[int, float]] | None = None) -> list[KernelResult]:
    """Tune the distinct kernels of the ONNX model at ``path`` with ``trials`` trials in all."""
    from cuvil.frontend.onnx import kernel_programs

    kernels = kernel_programs(os.fspath(path), target)
    return tune_kernels(kernels, trials, db, target, timeout_s, num_threads, progress=progress, history=history)
