"""Kernels compiled in parallel across the cores: isl (scheduling, lowering) and LLVM (O3, machine code)
run in worker processes, one kernel per task.

    with Workers(workers_for(options)) as w:     # forked on the first submit, ended at the end
        fut = w.submit(lower_task, label, args, placeholders, options)
        func, why = lowered(fut)                 # the loop IR; the workers' log lines are logged here
        objects = w.map_kernel_objects(kernels, target)   # one object file per kernel, in order

Each compile forks its own workers (never spawns them: a spawned worker would import the user's
``__main__`` again, and a script without a ``__name__`` guard would run twice), so they run the code
and settings of this process as they are when it compiles.  te tensors and loop IR travel pickled (a few
KB per kernel).  A worker that dies (killed, out of memory) raises :class:`WorkersLost`, and the caller
compiles in this process instead.

Lowering and LLVM are deterministic, so a kernel compiled in a worker is byte-identical to one compiled
here (``CompileOptions(jobs=1)`` compiles everything in this process).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

__all__ = ["Workers", "WorkersLost", "kernel_object", "lower_task", "lowered", "workers_for"]


class WorkersLost(RuntimeError):
    """A worker process died; the caller compiles in this process instead."""


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def workers_for(options: Any) -> int:
    """The worker processes a compile with ``options`` uses: ``options.jobs``, or every core this
    process may run on; 1 (no workers) where processes cannot be forked (not Linux/macOS)."""
    jobs = getattr(options, "jobs", None) or cores()
    return 1 if jobs <= 1 or sys.platform not in ("linux", "darwin") else jobs


class Workers:
    """Up to ``jobs`` worker processes for one compile, forked the first time a task is submitted (so
    they see this process as it is then) and ended by :meth:`close`.  A fork and its end cost ~25 ms
    (a 2-core Zen 4, with 1.2 GB resident)."""

    def __init__(self, jobs: int):
        self.jobs = jobs
        self._pool: ProcessPoolExecutor | None = None

    @property
    def started(self) -> bool:
        """Whether the workers were forked (a task was submitted)."""
        return self._pool is not None

    def submit(self, fn: Any, *args: Any) -> Future:
        """Run ``fn(*args)`` in a worker; :class:`WorkersLost` when they are gone."""
        try:
            if self._pool is not None:
                return self._pool.submit(fn, *args)
            import multiprocessing

            self._pool = ProcessPoolExecutor(self.jobs, mp_context=multiprocessing.get_context("fork"))
            with _llvm_lock():  # the first submit forks every worker (a fork pool does not spawn later)
                return self._pool.submit(fn, *args)
        except (BrokenProcessPool, RuntimeError, OSError) as exc:
            raise WorkersLost(str(exc)) from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def map_kernel_objects(self, kernels: Sequence[Any], target: str, reloc: str = "default") -> list[bytes]:
        """:func:`kernel_object` of each kernel, in order: in the workers when there are several kernels
        and workers, else (or when the workers are lost) in this process."""
        if self.jobs > 1 and len(kernels) > 1:
            try:
                futs = [self.submit(kernel_object, k, target, reloc) for k in kernels]
                return [result(f) for f in futs]
            except WorkersLost:
                pass
        return [kernel_object(k, target, reloc) for k in kernels]


def _llvm_lock() -> Any:
    """llvmlite's lock around every LLVM call, held while the workers are forked: had another thread of this
    process held it (compiling another model), each child would wait for it forever.  Held here, the
    children start holding it themselves (a reentrant lock of their only thread)."""
    import contextlib

    from llvmlite.binding import ffi

    lock = getattr(getattr(ffi, "lib", None), "_lock", None)
    return lock if lock is not None and hasattr(lock, "__enter__") else contextlib.nullcontext()


def result(fut: Future) -> Any:
    """``fut``'s result; :class:`WorkersLost` when its worker died."""
    try:
        return fut.result()
    except BrokenProcessPool as exc:
        raise WorkersLost(str(exc)) from None


# -- the tasks ------------------------------------------------------------------------------------


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name, record.levelno, record.getMessage()))


def lower_task(label: str, args: list[Any], placeholders: list[Any], options: Any
               ) -> tuple[Any, str | None, list[tuple[str, int, str]]]:
    """In a worker: :func:`cuvil.graph.compile.lower_kernel`, with the log lines it wrote (the
    scheduler's fallbacks) for the parent to log."""
    from cuvil.graph.compile import lower_kernel

    keep = _Keep()
    root = logging.getLogger("cuvil")
    old = root.level
    root.addHandler(keep)
    root.setLevel(logging.DEBUG)
    saved = root.propagate
    root.propagate = False  # the parent logs them, once
    try:
        func, why = lower_kernel(label, args, placeholders, options)
    finally:
        root.removeHandler(keep)
        root.setLevel(old)
        root.propagate = saved
    return func, why, keep.records


def lowered(fut: Future) -> tuple[Any, str | None]:
    """A :func:`lower_task`'s kernel and why it fell back, its log lines logged here (as the serial
    compile logs them); its error raised here."""
    func, why, records = result(fut)
    for name, level, msg in records:
        logging.getLogger(name).log(level, "%s", msg)
    return func, why


def kernel_object(func: Any, target: str, reloc: str = "default") -> bytes:
    """One kernel's object file for ``target`` (relocation model ``reloc``: :func:`cuvil.graph.link.kernel_reloc`):
    its function emitted alone into a module, O3, machine code.  The entry point of a linked module (the JIT's,
    or an exported library's) calls it by name.  This is where a kernel's machine code is made."""
    from cuvil.codegen import llvm as cg
    from cuvil.graph.link import new_module, object_file
    from cuvil.target import Target

    tgt = Target(target)
    module = new_module(func.name, tgt)
    cg.emit_function(module, func, tgt)
    return object_file(module, tgt, reloc)
