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

    if not kernels:
        raise ArgumentError("tune_kernels: no kernels to tune")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ArgumentError(f"tune_kernels: trials must be a positive int, got {trials!r}")
    rounds = _Rounds(kernels, tune_fn or default_tune, trials, target, runner, progress, seed, history,
                     {"db": db, "timeout_s": timeout_s, "num_threads": num_threads})
    for k in range(len(kernels)):  # every kernel's first trials (its untuned schedule among them)
        if rounds.budget <= 0:
            break
        rounds.step(k, min(warmup, rounds.budget))
    if rounds.errors and len(rounds.errors) == len(kernels):
        raise next(iter(rounds.errors.values()))
    while rounds.budget > 0:
        k = rounds.most_time()
        if k is None:
            break
        rounds.step(k, min(chunk, rounds.budget))
    rounds.final_rounds()
    return rounds.results()


class _Rounds:
    """The state of :func:`tune_kernels`: each kernel's latest :class:`~cuvil.autotune.api.TuneResult`,
    the kernels whose tuning failed, how much each kernel's last round improved it, the trials left."""

    def __init__(self, kernels: Sequence[tuple[Any, ...]], tune: Any, trials: int, target: Any, runner: Any,
                 progress: bool | None, seed: int, history: list[tuple[int, float]] | None,
                 options: dict[str, Any]):
        self.kernels, self.tune, self.target, self.runner = kernels, tune, target, runner
        self.progress, self.seed, self.history, self.options = progress, seed, history, options
        self.names = [str(k[2]) if len(k) > 2 else "" for k in kernels]
        self.state: list[Any] = [None] * len(kernels)
        self.errors: dict[int, CuvilError] = {}
        self.gain = [1.0] * len(kernels)
        self.budget = trials

    def extra(self, k: int) -> dict[str, Any]:
        """Only what is given (a tune_fn written without these stays usable)."""
        return {**({"runner": self.runner} if self.runner is not None else {}),
                **({"label": self.names[k]} if self.names[k] else {})}

    def attempt(self, k: int, **kw: Any) -> Any:
        """Tune kernel ``k``; None (and the error kept, a line on stderr) when its tuning fails."""
        try:
            return self.tune(self.kernels[k][0], self.target, **self.options, progress=self.progress,
                             seed=self.seed + k, **kw, **self.extra(k))
        except (ArgumentError, TargetError):
            raise
        except CuvilError as exc:
            self.errors[k] = exc
            if self.progress is not False:
                print(f"[cuvil tune {self.names[k] or f'kernel {k}'}] not tuned: {first_line(exc)}",
                      file=sys.stderr, flush=True)
            return None

    def step(self, k: int, n: int) -> None:
        """``n`` more trials for kernel ``k`` (no final round yet: one per kernel, at the end)."""
        before = self.state[k]
        want = (before.trials if before is not None else 0) + n
        res = self.attempt(k, trials=want, final_top=0)
        if res is None:
            self.state[k], self.gain[k] = None, 0.0
            return
        self.budget -= res.measured
        if before is not None and res.untuned_time_s is None:
            res.untuned_time_s = before.untuned_time_s
        self.state[k] = res
        if self.history is not None and all(st is not None or i in self.errors for i, st in enumerate(self.state)):
            est = sum(kern[1] * (st.best_time_s or st.untuned_time_s or 0.0)
                      for kern, st in zip(self.kernels, self.state) if st is not None)
            self.history.append((sum(st.trials for st in self.state), est))
        if res.trials < want:  # the space is exhausted
            self.gain[k] = 0.0
        elif before is not None and before.best_time_s and res.best_time_s:
            self.gain[k] = 0.5 * self.gain[k] + 0.5 * max(
                0.05, 10 * (before.best_time_s - res.best_time_s) / before.best_time_s)

    def most_time(self) -> int | None:
        """The kernel with the largest share of the model's time (count x best time), discounted by its
        gain; None when no kernel is worth more trials."""
        weights = [(kern[1] * (s.best_time_s or 0.0) * g if s is not None else 0.0)
                   for kern, s, g in zip(self.kernels, self.state, self.gain)]
        k = max(range(len(self.kernels)), key=lambda i: weights[i])
        return None if weights[k] <= 0 else k

    def final_rounds(self) -> None:
        """The final round of each kernel (its best candidates against its untuned schedule)."""
        for k, st in enumerate(self.state):
            if st is not None:
                res = self.attempt(k, trials=st.trials)
                if res is not None and res.untuned_time_s is None:
                    res.untuned_time_s = st.untuned_time_s
                self.state[k] = res

    def results(self) -> list[KernelResult]:
        out = []
        for k, (kern, st) in enumerate(zip(self.kernels, self.state)):
            if st is not None:
                out.append(KernelResult(st.workload_key, kern[1], st.trials, st.best_time_s, st.untuned_time_s,
                                        self.names[k]))
            elif k in self.errors:
                key = workload_of(kern[0], self.target or getattr(self.runner, "target", None) or "llvm").key
                out.append(KernelResult(key, kern[1], 0, None, None, self.names[k], first_line(self.errors[k])))
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
