"""Tuning several kernels at once (a whole model): spend the trials where they cut latency most.

:func:`tune_kernels` takes the distinct kernels of a model, each with how often it runs (and a name for
people, e.g. ``Conv 1x64x56x56 * 64x64x3x3 (+Relu)``, which the progress lines and results carry).
Every kernel first gets ``warmup`` trials (its untuned schedule among them); after that each
round gives ``chunk`` trials to the kernel whose share of the model's time, ``count x best
time``, is largest, discounted by how much its last round improved it (a kernel that stopped
improving gets fewer), until ``trials`` are spent.  Records land in one database, so
``cuvil.build(..., tuning_db=db)`` (and the ONNX session, once it passes ``tuning_db`` to
its kernel builds) picks each kernel's best.

:func:`tune_model` reads an ONNX model and tunes its kernels (listed, named, by
:func:`cuvil.graph.compile.kernel_programs`).  Both take a ``runner`` (the
:class:`~cuvil.autotune.measure.Runner` protocol, e.g. one that measures on boards) that every kernel's
:func:`~cuvil.autotune.tune` call uses; the caller closes it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cuvil.autotune.workload import workload_of
from cuvil.errors import ArgumentError, CuvilError, TargetError
from cuvil.schedule.fallback import first_line


@dataclass
class KernelResult:
    key: str
    count: int  # how often the model runs the kernel
    trials: int
    best_time_s: float | None
    untuned_time_s: float | None
    name: str = ""  # for people: the op and its shapes (kernel_programs' names), "" when none was given
    error: str = ""  # why the kernel was not tuned (its untuned schedule does not build or run), "" when it was

    @property
    def title(self) -> str:
        """The name with the workload key shortened after it (the key alone without a name)."""
        return f"{self.name} [{self.key[:8]}]" if self.name else self.key


def tune_kernels(kernels: Sequence[tuple[Any, ...]], trials: int = 64, db: Any = "cuvil-tuning.db",
                 target: Any = "llvm", timeout_s: float = 10.0, num_threads: int | None = None, *,
                 warmup: int = 4, chunk: int = 8, progress: bool | None = None, seed: int = 0,
                 tune_fn: Any = None, history: list[tuple[int, float]] | None = None,
                 runner: Any = None) -> list[KernelResult]:
    """Tune ``kernels`` (te arguments, run count and optionally a name) with ``trials`` trials in all (see the
    module doc).

    ``runner`` goes to every :func:`cuvil.autotune.tune` call (None: each call starts local workers);
    ``tune_fn`` replaces :func:`cuvil.autotune.tune` itself (same signature); ``history`` (a list) receives
    ``(trials spent, estimated model seconds)`` after each round.

    A kernel whose tuning fails (its untuned schedule does not build or run on the tuner's random inputs)
    is left out with a line on stderr and its result carries the error; the others are tuned.  Mistakes in
    the arguments, a target the runner cannot measure, or every kernel failing raise."""
    from cuvil.autotune.api import tune as default_tune

    tune = tune_fn or default_tune

    if not kernels:
        raise ArgumentError("tune_kernels: no kernels to tune")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ArgumentError(f"tune_kernels: trials must be a positive int, got {trials!r}")
    names = [str(k[2]) if len(k) > 2 else "" for k in kernels]

    def extra(k: int) -> dict[str, Any]:  # only what is given (a tune_fn written without these stays usable)
        return {**({"runner": runner} if runner is not None else {}), **({"label": names[k]} if names[k] else {})}

    state: list[Any] = [None] * len(kernels)
    errors: dict[int, CuvilError] = {}
    gain = [1.0] * len(kernels)
    budget = trials

    def attempt(k: int, **kw: Any) -> Any:
        try:
            return tune(kernels[k][0], target, db=db, timeout_s=timeout_s, num_threads=num_threads,
                        progress=progress, seed=seed + k, **kw, **extra(k))
        except (ArgumentError, TargetError):
            raise
        except CuvilError as exc:
            errors[k] = exc
            if progress is not False:
                print(f"[cuvil tune {names[k] or f'kernel {k}'}] not tuned: {first_line(exc)}", file=sys.stderr,
                      flush=True)
            return None

    def step(k: int, n: int) -> None:
        nonlocal budget
        before = state[k]
        want = (before.trials if before is not None else 0) + n
        res = attempt(k, trials=want, final_top=0)  # (one final round per kernel, at the end)
        if res is None:
            state[k], gain[k] = None, 0.0
            return
        budget -= res.measured
        if before is not None and res.untuned_time_s is None:
            res.untuned_time_s = before.untuned_time_s
        state[k] = res
        if history is not None and all(st is not None or i in errors for i, st in enumerate(state)):
            est = sum(kern[1] * (st.best_time_s or st.untuned_time_s or 0.0) for kern, st in zip(kernels, state)
                      if st is not None)
            history.append((sum(st.trials for st in state), est))
        if res.trials < want:  # the space is exhausted
            gain[k] = 0.0
        elif before is not None and before.best_time_s and res.best_time_s:
            gain[k] = 0.5 * gain[k] + 0.5 * max(0.05, 10 * (before.best_time_s - res.best_time_s) / before.best_time_s)

    for k in range(len(kernels)):
        if budget <= 0:
            break
        step(k, min(warmup, budget))
    if errors and len(errors) == len(kernels):
        raise next(iter(errors.values()))
    while budget > 0:
        weights = [(kern[1] * (s.best_time_s or 0.0) * g if s is not None else 0.0)
                   for kern, s, g in zip(kernels, state, gain)]
        k = max(range(len(kernels)), key=lambda i: weights[i])
        if weights[k] <= 0:
            break
        step(k, min(chunk, budget))
    for k, st in enumerate(state):  # the final round of each kernel (its best candidates against its untuned)
        if st is not None:
            res = attempt(k, trials=st.trials)
            if res is not None and res.untuned_time_s is None:
                res.untuned_time_s = st.untuned_time_s
            state[k] = res
    out = []
    for k, (kern, st) in enumerate(zip(kernels, state)):
        if st is not None:
            out.append(KernelResult(st.workload_key, kern[1], st.trials, st.best_time_s, st.untuned_time_s, names[k]))
        elif k in errors:
            key = workload_of(kern[0], target or getattr(runner, "target", None) or "llvm").key
            out.append(KernelResult(key, kern[1], 0, None, None, names[k], first_line(errors[k])))
    return out


def tune_model(model: Any, trials: int = 64, db: Any = "cuvil-tuning.db", target: Any = None,
               timeout_s: float = 10.0, num_threads: int | None = None, progress: bool | None = None,
               history: list[tuple[int, float]] | None = None, *,
               shapes: Mapping[str, tuple[int, ...]] | None = None, runner: Any = None) -> list[KernelResult]:
    """Tune the distinct kernels of ``model`` (an .onnx path, its bytes, a ModelProto or an imported graph)
    with ``trials`` trials in all.  ``shapes`` ({input: shape}) fixes symbolic input dimensions; ``runner``
    measures every kernel (see :func:`tune_kernels`); ``target`` defaults to the runner's, else ``"llvm"``."""
    from cuvil.frontend.onnx import import_model, load_model
    from cuvil.graph.compile import kernel_programs
    from cuvil.graph.ir import Graph

    target = target or getattr(runner, "target", None) or "llvm"
    graph = model if isinstance(model, Graph) else import_model(load_model(
        os.fspath(model) if isinstance(model, (str, os.PathLike)) else model))
    kernels = kernel_programs(graph, target, shapes, named=True)
    if progress is not False:
        calls = sum(k[1] for k in kernels)
        print(f"[cuvil tune] {len(kernels)} distinct kernel{'s' * (len(kernels) != 1)} ({calls} "
              f"call{'s' * (calls != 1)} a run), {trials} trials", file=sys.stderr, flush=True)
    return tune_kernels(kernels, trials, db, target, timeout_s, num_threads, progress=progress, history=history,
                        runner=runner)
