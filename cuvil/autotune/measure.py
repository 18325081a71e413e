"""Building and measuring candidates in isolated processes.

Two interfaces, so measurements can move to remote boards later:

- a :class:`Builder` turns configurations into shared libraries (``build(jobs)``);
- a :class:`Runner` loads them, checks their output and times them (``run(builds)``).

The local ones start their processes as fresh interpreters (``python -m cuvil.autotune.worker``;
never ``fork``: the tuner's process may hold threads and LLVM state; nor multiprocessing's ``spawn``,
which imports the caller's script again and cannot start from a daemonic process).  :class:`LocalBuilder`
keeps one worker per core, each with the te program unpickled once, and compiles a batch
in parallel; :class:`LocalRunner` keeps one process that loads each library
(``cuvil.runtime.load``: no LLVM in it), runs it on the tuner's inputs, compares the
output with the reference (the untuned schedule's output) and times it: a warm-up call,
then ``repeat`` timed runs, each after touching a buffer larger than the last-level cache,
and the median.  The tuner alternates the two, so compilation never runs beside a
measurement.  A worker that crashes (segfault, ``os._exit``) or overruns ``timeout_s``
is killed and restarted; that candidate is marked failed and the run goes on.
:meth:`LocalRunner.final` is the final round of a tuning run: the best candidates and the
untuned schedule timed against each other in interleaved rounds.  What the processes
themselves run is in :mod:`cuvil.autotune.worker`.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

import numpy as np

from cuvil.autotune.space import Config
from cuvil.autotune.worker import build_library, call_module, dump_program, loop_summary

__all__ = ["BuildJob", "BuildResult", "RunResult", "Builder", "Runner", "LocalBuilder", "LocalRunner",
           "build_library", "call_module", "dump_program", "loop_summary"]


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
    def final(self, builds: Sequence[BuildResult], rounds: int = 15) -> list[RunResult]: ...
    def close(self) -> None: ...


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# -- the parent's side ------------------------------------------------------------------------------
class _Proc:
    """One worker process and its connection; restarted when it dies or is killed.

    The worker is a fresh interpreter (``python -m cuvil.autotune.worker FD``), not a fork or a
    multiprocessing child: it imports nothing of the caller's script, and a daemonic process (a Dask
    worker's) may start it.  It talks over one end of a local socket pair, with pickled, length-prefixed
    messages (:class:`multiprocessing.connection.Connection`); its first message names what it runs."""

    def __init__(self, role: str, args: tuple[Any, ...]):
        self.role, self.args = role, args
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure(self) -> Connection:
        if not self.alive():
            self.stop()
            ours, theirs = socket.socketpair()
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
            with theirs:
                self.proc = subprocess.Popen([sys.executable, "-m", "cuvil.autotune.worker", str(theirs.fileno())],
                                             pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
            self.conn = Connection(ours.detach())
            # the caller's import path first (so build_fn / call_fn import by name as they do here), then
            # the role and its arguments, unpickled after the path is set
            self.conn.send((list(sys.path), self.role, pickle.dumps(self.args)))
        assert self.conn is not None
        return self.conn

    def exit_reason(self) -> str:
        if self.proc is None:
            return "no process"
        try:
            code = self.proc.wait(1.0)
        except subprocess.TimeoutExpired:
            return "still running"
        if code < 0:
            try:
                return f"killed by signal {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with status {code}"

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None:
            if kill and self.alive():
                self.proc.kill()
            elif self.alive() and self.conn is not None:
                try:
                    self.conn.send(None)
                except (OSError, ValueError):
                    pass
            try:
                self.proc.wait(2.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(2.0)
        if self.conn is not None:
            self.conn.close()
        self.proc, self.conn = None, None


class LocalBuilder:
    """Compiles candidates in ``workers`` worker processes (default: the cores), ``timeout_s`` each."""

    def __init__(self, args: Sequence[Any], target: str, workers: int | None = None, timeout_s: float = 10.0,
                 build_fn: Callable[..., Any] = build_library):
        payload = dump_program(args)
        n = workers or _cores()
        self.timeout_s = timeout_s
        self.workers = [_Proc("builder", (payload, target, build_fn)) for _ in range(max(1, n))]

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
    """Measures candidates one at a time in one worker process, ``timeout_s`` per candidate."""

    def __init__(self, threads: int = 1, timeout_s: float = 10.0, repeat: int = 5, min_run_s: float = 0.01,
                 flush_bytes: int | None = None, call_fn: Callable[..., Any] = call_module):
        if flush_bytes is None:
            from cuvil.target import Target

            flush_bytes = min(256 << 20, max(8 << 20, 2 * Target("llvm").l3_size))
        self.timeout_s, self.repeat, self.min_run_s = timeout_s, repeat, min_run_s
        self.budget_s: float | None = None  # seconds of timing per candidate in run(); None: timeout_s / 3
        self.proc = _Proc("runner", (threads, flush_bytes, call_fn))
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

    def set_reference(self, outputs: Sequence[Any] | None, path: str) -> None:
        """Use ``outputs`` as the reference and the library at ``path`` as the untuned schedule, without
        running it here (a board is sent the reference computed once for every board of its kind)."""
        self.ref = None if outputs is None else [np.asarray(o) for o in outputs]
        self.ref_path = path
        if self.proc.alive():  # else the next start sends them
            self._send_inputs(self.proc.ensure())

    def _start(self) -> Connection:
        """The runner's pipe; a fresh process is sent the inputs (its reply is read before the next request)."""
        fresh = not self.proc.alive()
        conn = self.proc.ensure()
        if fresh:
            self._acks = 0  # a process that died (killed between requests, say) owes no more replies
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
                    "budget_s": self.budget_s or max(0.5, self.timeout_s / 3)}
            status, value, err = self._ask(("run", b.path, b.trial, opts))
            if status != "ok":
                out.append(RunResult(status, None, err))
                continue
            t, ratio = value
            out.append(RunResult(status, t, err, t / ratio if ratio else None))
            if ratio and (best_rel is None or ratio < best_rel):
                best_rel = ratio
        return out

    def final(self, builds: Sequence[BuildResult], rounds: int = 15) -> list[RunResult]:
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
