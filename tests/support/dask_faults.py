"""Faults for tests/autotune/test_dask_runner.py: a build function whose one candidate never finishes (the tuner's
builder imports it by name), and board tasks that die or lie (pickled by value to the Dask workers)."""

from __future__ import annotations

import os
import signal
from typing import Any

from cuvil.autotune.worker import build_library, loop_summary

HANG = 2  # the trial whose kernel runs for hours


def hanging_build(args: Any, target: str, config: Any, path: str, trial: int) -> Any:
    """Trial :data:`HANG` builds a kernel with the candidate's arguments that sums over 2^30 terms per output
    element (hours): the board must kill it and report a timeout."""
    if trial != HANG:
        return build_library(args, target, config, path, trial)
    from cuvil import te
    from cuvil.pipeline import lower
    from cuvil.runtime.module import Module

    class _ExportOnly(Module):
        def _jit(self) -> None:
            pass

    a, b, c = args
    n = int(a.shape[1].value)
    k = te.reduce_axis((0, 1 << 30), name="k")
    slow = te.compute(c.shape, lambda i, j: te.sum(a[i, k % n] * b[k % n, j], axis=k), name=c.name)
    func = lower(te.create_schedule([slow]), [a, b, slow])
    _ExportOnly(func, target).export_library(path)
    return "[]", loop_summary(func)


def garbage_on_worker0(data: Any, libs: Any, kind: str, opts: Any) -> Any:
    """The board task, except that the worker named 0 reports times that are not finite."""
    from distributed import get_worker

    from cuvil.autotune.board import measure

    out = measure(data, libs, kind, opts)
    if get_worker().name == 0 and kind != "reference":
        for r in out["results"]:
            r["seconds"] = float("nan")
    return out


def die_once(marker: str) -> Any:
    """A board task that kills its own worker (SIGKILL) the first time a "run" task starts anywhere
    (``marker`` is created then); every other call measures."""

    def task(data: Any, libs: Any, kind: str, opts: Any) -> Any:
        from cuvil.autotune.board import measure

        if kind == "run":
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
                os.kill(os.getpid(), signal.SIGKILL)
            except FileExistsError:
                pass
        return measure(data, libs, kind, opts)

    return task


def die_on_trial(trial: int) -> Any:
    """A board task that kills its worker whenever it is given trial ``trial`` (a board that reboots)."""

    def task(data: Any, libs: Any, kind: str, opts: Any) -> Any:
        from cuvil.autotune.board import measure

        if kind == "run" and any(int(t) == trial for _, _, t in libs):
            os.kill(os.getpid(), signal.SIGKILL)
        return measure(data, libs, kind, opts)

    return task
