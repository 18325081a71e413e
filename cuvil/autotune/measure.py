"""Building and measuring candidates in isolated processes.

Two interfaces, so measurements can move to remote boards later:

- a :class:`Builder` turns configurations into shared libraries (``build(jobs)``);
- a :class:`Runner` loads them, checks their output and times them (``run(builds)``).

The local ones start their processes with multiprocessing's ``spawn`` context (never
``fork``: the tuner's process may hold threads and LLVM state).  :class:`LocalBuilder`
keeps one worker per core, each with the te program unpickled once, and compiles a batch
in parallel; :class:`LocalRunner` keeps one process that loads each library
(``cuvil.runtime.load``: no LLVM in it), runs it on the tuner's inputs, compares the
output with the reference (the untuned schedule's output) and times it: a warm-up call,
then ``repeat`` timed runs, each after touching a buffer larger than the last-level cache,
and the median.  The tuner alternates the two, so compilation never runs beside a
measurement.  A worker that crashes (segfault, ``os._exit``) or overruns ``timeout_s``
is killed and restarted; that candidate is marked failed and the run goes on.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

import numpy as np

from cuvil.autotune.space import Config


@dataclass
class BuildJob:
    trial: int  # the candidate's number in this workload's tuning (0 = the untuned schedule)
    config: Config
    path: str  # where the library goes


@dataclass
class BuildResult:
    trial: int
    config: Config
    status: str  # "ok" | "build_error" | "build_timeout" | "build_crash"
    path: str = ""
    trace: str = "[]"
    loop_features: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    seconds: float = 0.0


@dataclass
class RunResult:
    status: str  # "ok" | "run_error" | "run_timeout" | "run_crash" | "wrong"
    time_s: float | None = None
    error: str = ""
    ref_time_s: float | None = None  # the untuned schedule's time, timed in turns with the candidate


class Builder(Protocol):
    def build(self, jobs: Sequence[BuildJob]) -> list[BuildResult]: ...
    def close(self) -> None: ...


class Runner(Protocol):
    def set_inputs(self, inputs: Sequence[Any], outputs: Sequence[tuple[tuple[int, ...], str]]) -> None: ...
    def reference(self, build: BuildResult) -> RunResult: ...
    def run(self, builds: Sequence[BuildResult], best_rel: float | None = None) -> list[RunResult]: ...
    def final(self, builds: Sequence[BuildResult], rounds: int = 7) -> list[RunResult]: ...
    def close(self) -> None: ...


# -- what the worker processes run ------------------------------------------------------------------
def build_library(args: Sequence[Any], target: str, config: Config, path: str, trial: int) -> tuple[str, dict]:
    """The default build function: auto_schedule with the knobs, lower, compile, export ``path``.

    Returns the schedule's trace (JSON) and a summary of the loop IR."""
    from cuvil.pipeline import lower
    from cuvil.runtime.module import Module
    from cuvil.schedule.auto import auto_schedule
    from cuvil.schedule.trace import trace_to_json

    class _ExportOnly(Module):  # compile and export; no JIT in the builder
        def _jit(self) -> None:
            pass

    s = auto_schedule(list(args), target, knobs=config)
    func = lower(s, list(args))
    _ExportOnly(func, target).export_library(path)
    return trace_to_json(s.trace), loop_summary(func)


def call_module(module: Any, arrays: Sequence[Any], trial: int) -> None:
    """The default call function of the runner."""
    module(*arrays)


def loop_summary(func: Any) -> dict[str, Any]:
    """Counts and extents of the loops of a lowered function, by kind (kept with each record)."""
    from cuvil.ir.stmt import Allocate, Block, For, If, LetStmt, Store

    out: dict[str, Any] = {"loops": 0, "depth": 0, "stores": 0}
    stack: list[tuple[Any, int]] = [(func.body, 0)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, For):
            out["loops"] += 1
            out["depth"] = max(out["depth"], d + 1)
            if x.kind != "serial":
                ext = getattr(x.extent, "value", None)
                out.setdefault(x.kind, []).append(int(ext) if isinstance(ext, int) else -1)
            stack.append((x.body, d + 1))
        elif isinstance(x, Block):
            stack.extend((s, d) for s in x.stmts)
        elif isinstance(x, (LetStmt, Allocate)):
            stack.append((x.body, d))
        elif isinstance(x, If):
            stack.extend((b, d) for b in (x.then_body, x.else_body) if b is not None)
        elif isinstance(x, Store):
            out["stores"] += 1
    return out


def _new_tensor() -> Any:
    from cuvil.te.tensor import Tensor

    return Tensor.__new__(Tensor)


def _set_tensor(t: Any, state: tuple[Any, ...]) -> None:
    for k, v in zip(("op", "shape", "dtype", "name"), state):
        object.__setattr__(t, k, v)


class _ProgramPickler(pickle.Pickler):
    """Pickles a te program: tensors are immutable (no ``__setattr__``), so their state is set afterwards,
    which also lets an operation and its output tensor refer to each other."""

    def reducer_override(self, obj: Any) -> Any:
        from cuvil.te.tensor import Tensor

        if type(obj) is Tensor:
            return _new_tensor, (), (obj.op, obj.shape, obj.dtype, obj.name), None, None, _set_tensor
        return NotImplemented


def dump_program(args: Sequence[Any]) -> bytes:
    """``args`` (a te program's arguments) as bytes a worker process can load with ``pickle.loads``."""
    import io

    buf = io.BytesIO()
    _ProgramPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(list(args))
    return buf.getvalue()


def _requests(conn: Connection) -> Iterator[Any]:
    """The requests a worker process receives, until the parent sends None or goes away."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        yield msg


def _builder_main(conn: Connection, payload: bytes, target: str, build_fn: Callable[..., Any]) -> None:
    args = pickle.loads(payload)
    for trial, config, path in _requests(conn):
        t0 = time.perf_counter()
        try:
            trace, feats = build_fn(args, target, config, path, trial)
            conn.send(("ok", trace, feats, "", time.perf_counter() - t0))
        except Exception as exc:  # a refused or broken candidate: report it, keep serving
            conn.send(("error", "[]", {}, f"{type(exc).__name__}: {exc}", time.perf_counter() - t0))


def _runner_main(conn: Connection, threads: int, flush_bytes: int, call_fn: Callable[..., Any]) -> None:
    os.environ["CUVIL_NUM_THREADS"] = str(threads)
    from cuvil.runtime import load
    from cuvil.runtime.threads import set_num_threads

    set_num_threads(threads)
    flush = np.zeros(max(1, flush_bytes // 8), dtype=np.float64)
    inputs: list[Any] = []
    specs: list[tuple[tuple[int, ...], str]] = []
    ref: list[np.ndarray] | None = None
    ref_mod: Any = None
    ref_arrays: list[Any] = []
    for msg in _requests(conn):
        kind = msg[0]
        try:
            if kind == "inputs":
                _, inputs, specs, ref, ref_path = msg
                ref_mod = load(ref_path) if ref_path else None
                ref_arrays = [*inputs, *[np.empty(shape, dtype=dt) for shape, dt in specs]]
                conn.send(("ok", None, ""))
                continue
            if kind == "final":
                _, entries, opts = msg
                loaded = [(load(path), [*inputs, *_blank(specs)], trial) for path, trial in entries]
                conn.send(("ok", _final_round(loaded, call_fn, flush, opts, ref or []), ""))
                continue
            _, path, trial, opts = msg
            mod = load(path)
            outs = _blank(specs)
            arrays = [*inputs, *outs]
            call_fn(mod, arrays, trial)
            if kind == "reference":
                conn.send(("ok", outs, ""))
                continue
            err = _mismatch(outs, ref or [])
            if err:
                conn.send(("wrong", None, err))
                continue
            pair = (ref_mod, ref_arrays) if ref_mod is not None else None
            conn.send(("ok", _time(mod, arrays, trial, call_fn, flush, opts, pair), ""))
        except Exception as exc:
            conn.send(("error", None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))


def _mismatch(outs: Sequence[np.ndarray], ref: Sequence[np.ndarray]) -> str:
    for k, (o, r) in enumerate(zip(outs, ref)):
        if o.shape != r.shape:
            return f"output {k}: shape {o.shape}, reference {r.shape}"
        if o.dtype.kind == "f":
            scale = float(np.max(np.abs(r))) if r.size else 0.0
            if np.isnan(o).sum() != np.isnan(r).sum():
                return f"output {k}: NaN where the reference has none (elements left unwritten?)"
            diff = np.abs(o.astype(np.float64) - r.astype(np.float64))
            err = float(np.nanmax(diff)) / max(scale, 1e-30) if diff.size else 0.0
            tol = 1e-4 if o.dtype.itemsize <= 4 else 1e-10
            if err > tol:
                return f"output {k}: max relative error {err:.2e} against the untuned schedule (limit {tol:g})"
        elif not np.array_equal(o, r):
            return f"output {k}: differs from the untuned schedule's output"
    return ""


def _blank(specs: Sequence[tuple[tuple[int, ...], str]]) -> list[np.ndarray]:
    """Output arrays pre-filled with NaN (0 for integers), so an element a candidate leaves unwritten shows."""
    return [np.full(shape, np.nan if np.dtype(dt).kind == "f" else 0, dtype=dt) for shape, dt in specs]


def _timed(call_fn: Callable[..., Any], flush: np.ndarray, mod: Any, arrays: list[Any], trial: int, n: int) -> float:
    """Seconds per call of ``n`` calls, after touching a buffer larger than the last-level cache."""
    np.add(flush, 1.0, out=flush)
    t0 = time.perf_counter()
    for _ in range(n):
        call_fn(mod, arrays, trial)
    return (time.perf_counter() - t0) / n


def _number(first: float, opts: dict[str, Any]) -> int:
    """Calls per timed run: enough for ``min_run_s`` seconds (a timer's resolution and jitter stay small)."""
    return max(1, min(1000, int(float(opts.get("min_run_s", 0.01)) / max(first, 1e-9))))


def _final_round(entries: list[tuple[Any, list[Any], int]], call_fn: Callable[..., Any], flush: np.ndarray,
                 opts: dict[str, Any], ref: Sequence[np.ndarray]) -> list[tuple[str, float | None, float | None, str]]:
    """The end of a tuning run: ``entries`` (module, arrays, trial; the first is the untuned schedule) timed
    against each other in the same process and the same way as every candidate.

    Each entry is called and checked again (the warm-up); then ``rounds`` rounds in which every entry is timed
    once, after a cache flush, each round starting at the next entry (no entry always runs right after the
    flush of another's turn or first in a round).  Per entry: status, median seconds per call, the median
    over rounds of its time divided by the untuned schedule's in the same round, and an error."""
    firsts: list[float | None] = []
    errors: list[str] = []
    for mod, arrays, trial in entries:
        firsts.append(_timed(call_fn, flush, mod, arrays, trial, 1))
        errors.append(_mismatch(arrays[len(arrays) - len(ref):], ref) if ref else "")
    live = [k for k, e in enumerate(errors) if not e]
    numbers = {k: _number(firsts[k] or 0.0, opts) for k in live}
    per_round = sum((firsts[k] or 0.0) * numbers[k] for k in live)
    rounds = max(3, min(int(opts.get("rounds", 7)), int(float(opts.get("budget_s", 10.0)) / max(per_round, 1e-9))))
    times: dict[int, list[float]] = {k: [] for k in live}
    for r in range(rounds):
        for k in live[r % len(live):] + live[: r % len(live)] if live else []:
            mod, arrays, trial = entries[k]
            times[k].append(_timed(call_fn, flush, mod, arrays, trial, numbers[k]))
    base = times.get(0)
    out: list[tuple[str, float | None, float | None, str]] = []
    for k in range(len(entries)):
        if errors[k]:
            out.append(("wrong", None, None, errors[k]))
            continue
        ratio = float(np.median([t / b for t, b in zip(times[k], base)])) if base else None
        out.append(("ok", float(np.median(times[k])), ratio, ""))
    return out


def _time(mod: Any, arrays: list[Any], trial: int, call_fn: Callable[..., Any], flush: np.ndarray,
          opts: dict[str, Any], ref: tuple[Any, list[Any]] | None = None) -> tuple[float, float | None]:
    """Median seconds per call, and the median ratio to the reference (the untuned schedule) timed in turns.

    After the checked call (the warm-up), ``repeat`` rounds: each round flushes the caches (writes a buffer
    larger than the last-level cache) and times ``number`` calls of the reference, then flushes and times the
    candidate.  The ratio of each round compares the two under the same load, which on a shared machine
    changes faster than a batch; a candidate far slower than the best so far gets two rounds, one that looks
    close to it or better twice ``repeat``."""

    def run(m: Any, a: list[Any], t: int, n: int) -> float:
        return _timed(call_fn, flush, m, a, t, n)

    first = run(mod, arrays, trial, 1)
    ref_first = run(ref[0], ref[1], -1, 1) if ref is not None else None
    number = _number(first, opts)
    ref_number = _number(ref_first, opts) if ref_first else 0
    repeat = int(opts.get("repeat", 5))
    best = opts.get("best_rel")
    if best is not None and ref_first and first / ref_first > 3.0 * best:
        repeat = min(repeat, 2)  # clearly worse: a rough time is enough
    elif best is not None and ref_first and first / ref_first < 1.1 * best:
        repeat *= 2  # a contender for the best: the best of many noisy times is optimistic, so time it longer
    per_round = first * number + (ref_first or 0.0) * ref_number
    repeat = max(1, min(repeat, int(float(opts.get("budget_s", 2.0)) / max(per_round, 1e-9))))
    times, ratios = [], []
    for _ in range(repeat):
        r = run(ref[0], ref[1], -1, ref_number) if ref is not None else None
        t = run(mod, arrays, trial, number)
        times.append(t)
        if r:
            ratios.append(t / r)
    return float(np.median(times)), (float(np.median(ratios)) if ratios else None)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# -- the parent's side ------------------------------------------------------------------------------
def _ctx() -> Any:
    return mp.get_context("spawn")


class _Proc:
    """One worker process and its pipe; restarted when it dies or is killed."""

    def __init__(self, target: Callable[..., Any], args: tuple[Any, ...]):
        self.target, self.args = target, args
        self.proc: Any = None
        self.conn: Connection | None = None

    def ensure(self) -> Connection:
        if self.proc is None or not self.proc.is_alive():
            self.stop()
            ctx = _ctx()
            parent, child = ctx.Pipe()
            self.proc = ctx.Process(target=self.target, args=(child, *self.args), daemon=True)
            self.proc.start()
            child.close()
            self.conn = parent
        assert self.conn is not None
        return self.conn

    def exit_reason(self) -> str:
        if self.proc is None:
            return "no process"
        self.proc.join(1.0)
        code = self.proc.exitcode
        if code is not None and code < 0:
            import signal

            try:
                return f"killed by signal {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with status {code}"

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None:
            if kill and self.proc.is_alive():
                self.proc.kill()
            elif self.proc.is_alive() and self.conn is not None:
                try:
                    self.conn.send(None)
                except (OSError, ValueError):
                    pass
            self.proc.join(2.0)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(2.0)
        if self.conn is not None:
            self.conn.close()
        self.proc, self.conn = None, None


class LocalBuilder:
    """Compiles candidates in ``workers`` spawned processes (default: the cores), ``timeout_s`` each."""

    def __init__(self, args: Sequence[Any], target: str, workers: int | None = None, timeout_s: float = 10.0,
                 build_fn: Callable[..., Any] = build_library):
        payload = dump_program(args)
        n = workers or _cores()
        self.timeout_s = timeout_s
        self.workers = [_Proc(_builder_main, (payload, target, build_fn)) for _ in range(max(1, n))]

    def build(self, jobs: Sequence[BuildJob]) -> list[BuildResult]:
        results: dict[int, BuildResult] = {}
        pending = list(enumerate(jobs))
        busy: dict[int, tuple[int, float, float]] = {}  # worker -> (job position, start, deadline)
        while pending or busy:
            for w, proc in enumerate(self.workers):
                if w not in busy and pending:
                    pos, job = pending.pop(0)
                    try:
                        proc.ensure().send((job.trial, job.config, job.path))
                    except (OSError, ValueError):  # a worker that died between batches: start another
                        proc.stop(kill=True)
                        proc.ensure().send((job.trial, job.config, job.path))
                    now = time.monotonic()
                    busy[w] = (pos, now, now + self.timeout_s)
            conns = {self.workers[w].conn: w for w in busy}
            wait_s = max(0.0, min(d for _, _, d in busy.values()) - time.monotonic())
            ready = wait(list(conns), timeout=wait_s)
            for w, (pos, start, deadline) in list(busy.items()):
                job, proc = jobs[pos], self.workers[w]
                res = None
                if proc.conn in ready:
                    try:
                        status, trace, feats, err, secs = proc.conn.recv()  # type: ignore[union-attr]
                        res = BuildResult(job.trial, job.config, "ok" if status == "ok" else "build_error",
                                          job.path if status == "ok" else "", trace, feats, err, secs)
                    except (EOFError, OSError):
                        res = BuildResult(job.trial, job.config, "build_crash",
                                          error=f"the build worker crashed ({proc.exit_reason()})",
                                          seconds=time.monotonic() - start)
                        proc.stop(kill=True)
                elif time.monotonic() >= deadline:
                    proc.stop(kill=True)
                    res = BuildResult(job.trial, job.config, "build_timeout",
                                      error=f"the build took longer than {self.timeout_s:g} s", seconds=self.timeout_s)
                if res is not None:
                    results[pos] = res
                    del busy[w]
        return [results[k] for k in range(len(jobs))]

    def close(self) -> None:
        for p in self.workers:
            p.stop()


class LocalRunner:
    """Measures candidates one at a time in one spawned process, ``timeout_s`` per candidate."""

    def __init__(self, threads: int = 1, timeout_s: float = 10.0, repeat: int = 5, min_run_s: float = 0.01,
                 flush_bytes: int | None = None, call_fn: Callable[..., Any] = call_module):
        if flush_bytes is None:
            from cuvil.target import Target

            flush_bytes = min(256 << 20, max(8 << 20, 2 * Target("llvm").l3_size))
        self.timeout_s, self.repeat, self.min_run_s = timeout_s, repeat, min_run_s
        self.proc = _Proc(_runner_main, (threads, flush_bytes, call_fn))
        self.inputs: list[Any] = []
        self.specs: list[tuple[tuple[int, ...], str]] = []
        self.ref: list[np.ndarray] | None = None
        self.ref_path = ""
        self._acks = 0  # replies to "inputs" messages not read yet

    def set_inputs(self, inputs: Sequence[Any], outputs: Sequence[tuple[tuple[int, ...], str]]) -> None:
        self.inputs, self.specs = list(inputs), list(outputs)
        self.proc.stop()
        self._acks = 0
        self._start()  # boots while the first batch builds

    def _start(self) -> Connection:
        """The runner's pipe; a fresh process is sent the inputs (its reply is read before the next request)."""
        fresh = self.proc.proc is None or not self.proc.proc.is_alive()
        conn = self.proc.ensure()
        if fresh:
            self._send_inputs(conn)
        return conn

    def _send_inputs(self, conn: Connection) -> None:
        conn.send(("inputs", self.inputs, self.specs, self.ref, self.ref_path))
        self._acks += 1

    def _ask(self, msg: tuple[Any, ...], timeout_s: float | None = None) -> tuple[str, Any, str]:
        try:
            conn = self._start()
            while self._acks:
                if not conn.poll(60.0):
                    raise OSError("the runner did not start within 60 s")
                conn.recv()
                self._acks -= 1
            conn.send(msg)
        except (EOFError, OSError) as exc:
            self._acks = 0
            self.proc.stop(kill=True)
            return "run_crash", None, f"the runner could not start: {exc}"
        limit = timeout_s or self.timeout_s
        if not conn.poll(limit):
            self.proc.stop(kill=True)
            return "run_timeout", None, f"the run took longer than {limit:g} s"
        try:
            status, value, err = conn.recv()
        except (EOFError, OSError):
            reason = self.proc.exit_reason()
            self.proc.stop(kill=True)
            return "run_crash", None, f"the candidate crashed the runner ({reason})"
        return {"ok": "ok", "wrong": "wrong"}.get(status, "run_error"), value, err

    def reference(self, build: BuildResult) -> RunResult:
        """Run the untuned build once; its outputs become the reference every candidate must match, and
        every candidate is timed in turns with it (its library must stay at ``build.path``)."""
        status, value, err = self._ask(("reference", build.path, build.trial, {}))
        if status == "ok":
            self.ref, self.ref_path = value, build.path
            self._send_inputs(self._start())
        return RunResult(status, None, err)

    def run(self, builds: Sequence[BuildResult], best_rel: float | None = None) -> list[RunResult]:
        """Check and time each build; ``best_rel`` (the best time relative to the untuned one so far) lets a
        clearly slower candidate off with fewer rounds."""
        out = []
        for b in builds:
            if b.status != "ok":
                out.append(RunResult(b.status, None, b.error))
                continue
            opts = {"repeat": self.repeat, "min_run_s": self.min_run_s, "best_rel": best_rel,
                    "budget_s": max(0.5, self.timeout_s / 3)}
            status, value, err = self._ask(("run", b.path, b.trial, opts))
            if status != "ok":
                out.append(RunResult(status, None, err))
                continue
            t, ratio = value
            out.append(RunResult(status, t, err, t / ratio if ratio else None))
            if ratio and (best_rel is None or ratio < best_rel):
                best_rel = ratio
        return out

    def final(self, builds: Sequence[BuildResult], rounds: int = 7) -> list[RunResult]:
        """The final round of a tuning run: ``builds`` (the first is the untuned schedule) checked again and
        timed against each other in ``rounds`` interleaved rounds (see ``_final_round``); each result's
        ``ref_time_s`` is its time divided by its median ratio to the untuned schedule.  If the round fails
        (a crash, the time limit: ``timeout_s`` per build), every build gets that failure."""
        opts = {"rounds": rounds, "min_run_s": self.min_run_s, "budget_s": self.timeout_s * len(builds) / 2}
        status, value, err = self._ask(("final", [(b.path, b.trial) for b in builds], opts),
                                       self.timeout_s * len(builds))
        if status != "ok":
            return [RunResult(status, None, err) for _ in builds]
        return [RunResult(st, t, e, t / ratio if t and ratio else None) for st, t, ratio, e in value]

    def close(self) -> None:
        self.proc.stop()
