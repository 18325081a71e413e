"""Measuring candidates on target boards: a :class:`~cuvil.autotune.measure.Runner` over Dask distributed.

    runner = cuvil.autotune.DaskRunner("tls://host:8786", board="rpi5", security=sec)
    cuvil.autotune.tune([A, B, C], runner=runner, trials=64)    # compiled for the boards, timed on them

A board is a Dask worker with the resource ``cuvil-board-NAME`` (``cuvil worker ... --board NAME``); each
measurement is one task, :func:`cuvil.autotune.board.measure`, pinned to the kind by that resource, with the
library's bytes and sha256.  The workload's inputs, the reference outputs and the untuned library travel
once per workload and board (scattered to every board of the kind); the board times each candidate in turns
with the untuned library, as the local runner does, in a child process it kills when a kernel crashes or
hangs.  Several boards of a kind share a batch: every candidate is its own task and the scheduler gives the
next one to whichever board is free.  The final round runs on one board (its ratios compare within one
machine).

Before the first trial the constructor checks the cluster: a board of the kind exists (else the error names
the kinds there are), each runs this cuvil's version and can describe itself, and their CPUs can run what
the host compiles: the target comes from the first board's facts (:mod:`cuvil.autotune.board_target`) and is
``runner.target``, which ``tune`` compiles for when no target is given.

Faults are data.  A board that dies mid-measurement (its task fails with ``KilledWorker``) has the task sent
again to another board of the kind; if that one dies too, the trial is recorded as ``run_lost``.  A dying
board takes every task it holds with it, the one that killed it and any other it had been given, so the
tasks that died are sent again one at a time (a suspect waits until the one before it has come back): an
innocent task never dies twice beside the culprit, and only the culprit is lost.  A reply
that is not a measurement (times not finite or not positive, a missing result) or that is wildly
inconsistent with the other boards of the kind (the untuned schedule timed more than
:data:`INCONSISTENT` x apart) quarantines that board for the rest of the run, with a line on stderr; its
task goes to another board.  A task no board answers within a generous limit is a ``run_timeout``; when no
board of the kind is left for :data:`GONE_GRACE_S` seconds, what is pending is ``run_lost``.

Builds and measurements do not overlap: ``tune`` builds a batch, then measures it (the search needs a
batch's times to propose the next).  Each measurement is its own task, so a batch spreads over the boards.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cuvil.autotune.measure import BuildResult, RunResult
from cuvil.errors import ArgumentError, CuvilError

INCONSISTENT = 10.0  # the untuned schedule timed this many times apart on two boards of a kind: one is broken
GONE_GRACE_S = 20.0  # no board of the kind for this long: what is pending is lost (a restarting nanny is quick)
MAX_SENDS = 5  # a task sent this often (boards dying, data lost with them, quarantines) is given up
_STATUS = {"ok": "ok", "wrong": "wrong", "crash": "run_crash", "timeout": "run_timeout", "error": "run_error",
           "badhash": "run_error"}


class BoardError(CuvilError):
    """The boards cannot measure for this run (none of the kind, a version or CPU mismatch, unreachable)."""


@dataclass
class _Task:
    """One measurement task: what it measures, where it may run, and how often it was sent."""

    libs: list[tuple[str, bytes, int]]
    kind: str
    count: int  # results expected
    sent: int = 0  # times submitted
    deaths: int = 0  # boards that died while measuring it
    tried: list[str] = field(default_factory=list)  # boards that died or were quarantined under it
    pin: bool = False  # one board only (the final round)
    future: Any = None


@dataclass
class _Round:
    """One :meth:`DaskRunner._dispatch` call: its tasks, their outcomes so far (None: not yet), the tasks that
    died once and wait to be sent again one at a time, and the one of those on a board now."""

    tasks: list[_Task]
    opts: dict[str, Any]
    out: list[Any]
    suspects: list[int] = field(default_factory=list)
    flying: int | None = None

    def fail(self, k: int, status: str, why: str) -> None:
        self.out[k] = [RunResult(status, None, why) for _ in range(self.tasks[k].count)]

    def done(self) -> bool:
        return all(o is not None for o in self.out)


class DaskRunner:
    """Measures candidates on the Dask workers of board kind ``board`` (see the module doc).

    ``address`` is the scheduler's (``tls://host:8786``) and ``security`` a
    :class:`distributed.security.Security` for TLS; or ``client`` is a connected :class:`distributed.Client`
    (not closed by :meth:`close`).  ``timeout_s`` bounds one candidate's run on the board; ``repeat`` and
    ``min_run_s`` are the local runner's timing options.  ``measure`` replaces the board task (a function
    with :func:`cuvil.autotune.board.measure`'s signature; the tests inject faults with it)."""

    def __init__(self, address: str | None = None, *, board: str, security: Any = None, client: Any = None,
                 timeout_s: float = 10.0, repeat: int = 5, min_run_s: float = 0.01, connect_timeout_s: float = 20.0,
                 measure: Any = None, quiet: bool = False):
        from cuvil.autotune import board as boardmod

        boardmod.check_name(board)
        if client is None and not address:
            raise ArgumentError("DaskRunner: give the scheduler's address (e.g. 'tls://host:8786') or client=")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ArgumentError(f"DaskRunner: timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.board, self.resource = board, boardmod.RESOURCE_PREFIX + board
        self.timeout_s, self.repeat, self.min_run_s = float(timeout_s), int(repeat), float(min_run_s)
        self.quiet = quiet
        self._measure = measure or boardmod.measure
        self.quarantined: dict[str, str] = {}  # board address -> why
        self._ref_s: dict[str, list[float]] = {}  # board address -> this workload's untuned times there
        self._data: dict[str, Any] | None = None
        self._scattered: Any = None
        self._own = client is None
        self.client = client if client is not None else _connect(address, security, connect_timeout_s)
        try:
            self.boards = self._check(boardmod)
        except BaseException:
            self.close()
            raise
        self.facts: dict[str, Any] = self.boards[0]["facts"]
        self.threads = int(self.facts.get("threads") or 1)  # the kernels' thread count on the board

    # -- before the first trial ---------------------------------------------------------------------
    def _check(self, boardmod: Any) -> list[dict[str, Any]]:
        import cuvil
        from cuvil.autotune.board_target import target_of, uncovered
        from cuvil.target import Target

        found = boardmod.boards(self.client, self.board)
        if not found:
            kinds = sorted({k for b in boardmod.boards(self.client) for k in b.get("kinds") or [b["board"]]})
            there = f"the boards there are of kind {', '.join(kinds)}" if kinds else "it has no boards at all"
            raise BoardError(f"no board of kind {self.board!r} in the cluster at {self._where()}: {there} "
                             f"(start one with: cuvil worker {self._where()} --board {self.board})")
        for b in found:
            f = b.get("facts")
            if not isinstance(f, dict):
                raise BoardError(f"board {b['address']} ({self.board}) did not describe itself: {b.get('error')}")
            if f.get("error"):
                raise BoardError(f"board {b['address']} ({self.board}) cannot measure: {f['error']}")
            if f.get("cuvil") != cuvil.__version__:
                raise BoardError(f"board {b['address']} ({self.board}) runs cuvil {f.get('cuvil')}, this host "
                                 f"{cuvil.__version__}: install the same version on both")
        self.target = target_of(found[0]["facts"], boardmod.host_facts())
        tgt = Target(self.target)
        for b in found:
            missing = uncovered(tgt, b["facts"])
            if missing:
                raise BoardError(f"board {b['address']} ({self.board}) cannot run code compiled for "
                                 f"{tgt.canonical!r}: it lacks {', '.join(missing)} (boards of one kind must "
                                 "share a CPU)")
        return found

    def check_target(self, target: Any) -> None:
        """Refuse (a clear error, before the first trial) a target the boards' CPUs cannot run."""
        from cuvil.autotune.board_target import uncovered
        from cuvil.target import Target

        tgt = Target(target)
        if tgt.kind != "llvm":
            raise BoardError(f"board kind {self.board!r} runs CPU code; {tgt.canonical!r} is not a CPU target")
        for b in self.boards:
            missing = uncovered(tgt, b["facts"])
            if missing:
                raise BoardError(f"board {b['address']} ({self.board}) cannot run code compiled for "
                                 f"{tgt.canonical!r}: it lacks {', '.join(missing)}; leave target out to compile "
                                 f"for the board ({self.target!r})")

    def _where(self) -> str:
        return str(getattr(getattr(self.client, "scheduler", None), "address", None) or "the scheduler")

    # -- the Runner protocol ----------------------------------------------------------------------------
    def set_inputs(self, inputs: Sequence[Any], outputs: Sequence[tuple[tuple[int, ...], str]]) -> None:
        harness = None
        if any(b["facts"].get("exec") for b in self.boards):
            from cuvil.autotune.exec_board import harness_bytes

            harness = harness_bytes(self.facts)
        self._release()
        self._ref_s = {}  # the untuned schedule's times are compared within a workload
        self._data = {"key": uuid.uuid4().hex, "inputs": [np.asarray(a) for a in inputs],
                      "outputs": [(tuple(int(d) for d in s), str(dt)) for s, dt in outputs], "reference": None,
                      "ref_lib": None, "harness": harness}

    def reference(self, build: BuildResult) -> RunResult:
        """Run the untuned build on one board; its outputs and library then go to every board of the kind."""
        if self._data is None:
            raise ArgumentError("DaskRunner.reference: call set_inputs first")
        lib = _lib(build)
        task = _Task([lib], "reference", 1)
        reply = self._dispatch([task], {"timeout_s": self.timeout_s})[0]
        if isinstance(reply, list):
            return reply[0]
        res = reply["results"][0]
        outs = reply.get("outputs")
        if res.get("status") != "ok" or not outs:
            return RunResult(_STATUS.get(str(res.get("status")), "run_error"), None, str(res.get("error") or ""))
        self._data = dict(self._data, reference=[np.asarray(o) for o in outs], ref_lib=(lib[0], lib[1]))
        self._scatter()
        return RunResult("ok")

    def run(self, builds: Sequence[BuildResult], best_rel: float | None = None) -> list[RunResult]:
        """Check and time each build on the boards (one task each, shared by the boards of the kind)."""
        opts = {"repeat": self.repeat, "min_run_s": self.min_run_s, "best_rel": best_rel,
                "budget_s": max(0.5, self.timeout_s / 3), "timeout_s": self.timeout_s}
        out: list[RunResult | None] = [RunResult(b.status, None, b.error) if b.status != "ok" else None
                                       for b in builds]
        todo = [k for k, r in enumerate(out) if r is None]
        replies = self._dispatch([_Task([_lib(builds[k])], "run", 1) for k in todo], opts)
        for k, reply in zip(todo, replies):
            out[k] = reply[0] if isinstance(reply, list) else _run_result(reply["results"][0])
        return out  # type: ignore[return-value]

    def final(self, builds: Sequence[BuildResult], rounds: int = 15) -> list[RunResult]:
        """The final round on one board: ``builds[0]`` is the untuned schedule, the rest are timed against it and
        each other.  After :meth:`reference` the boards hold the untuned library (and check every finalist
        against its outputs); a final round alone (a workload measured in an earlier call) sends it too."""
        opts = {"rounds": rounds, "min_run_s": self.min_run_s, "budget_s": self.timeout_s * len(builds) / 2,
                "timeout_s": self.timeout_s}
        if self._data is None:
            raise ArgumentError("DaskRunner.final: call set_inputs first")
        held = self._data.get("ref_lib") is not None  # the boards hold the untuned library: it goes first there
        task = _Task([_lib(b) for b in builds[1 if held else 0:]], "final", len(builds), pin=True)
        reply = self._dispatch([task], opts)[0]
        if isinstance(reply, list):
            return reply
        return [_run_result(r) for r in reply["results"]]

    def close(self) -> None:
        """Forget the workload's data on the boards; close the client if this runner opened it."""
        try:
            self._release()
        finally:
            if self._own and getattr(self, "client", None) is not None:
                self.client.close()
                self.client = None

    # -- tasks --------------------------------------------------------------------------------------
    def _live(self) -> list[str]:
        """The addresses of the boards of the kind the scheduler knows now, quarantined ones left out."""
        try:
            info = self.client.scheduler_info(n_workers=-1)["workers"]  # (every worker, not the first 5)
        except TypeError:  # distributed before 2025: every worker always
            info = self.client.scheduler_info()["workers"]
        return sorted(a for a, w in info.items() if self.resource in (w.get("resources") or {})
                      and a not in self.quarantined)

    def _boards_now(self, wait_s: float = GONE_GRACE_S) -> list[str]:
        """The live boards of the kind, waiting up to ``wait_s`` for one (a nanny restarting a dead board)."""
        end = time.monotonic() + wait_s
        live = self._live()
        while not live and time.monotonic() < end:
            time.sleep(0.5)
            live = self._live()
        return live

    def _scatter(self) -> None:
        if self._scattered is not None:
            self._scattered.release()
        live = self._boards_now()
        self._scattered = self.client.scatter([self._data], workers=live or None, broadcast=True, hash=False)[0]

    def _release(self) -> None:
        if self._scattered is not None:
            self._scattered.release()
        self._scattered = None

    def _submit(self, task: _Task, opts: dict[str, Any]) -> bool:
        """Send ``task`` to a board it has not failed on; False when there is none."""
        live = [a for a in self._boards_now() if a not in task.tried]
        if not live:
            return False
        if self._scattered is not None and self._scattered.status != "finished":
            self._scatter()  # every board holding the workload's data died: send it again
        workers = live[:1] if task.pin else (live if self.quarantined or task.tried else None)
        data = self._scattered if self._scattered is not None and task.kind != "reference" else self._data
        task.sent += 1
        task.future = self.client.submit(self._measure, data, task.libs, task.kind, opts, pure=False,
                                         resources={self.resource: 1}, workers=workers, allow_other_workers=False)
        return True

    def _dispatch(self, tasks: list[_Task], opts: dict[str, Any]) -> list[Any]:
        """Run ``tasks`` on the boards; per task, its reply (a dict) or the failure (a list of RunResults)."""
        from distributed import wait as dask_wait

        rd = _Round(tasks, opts, [None] * len(tasks))
        for k, t in enumerate(tasks):
            if not self._submit(t, opts):
                rd.fail(k, "run_lost", self._none_left())
        per = self.timeout_s * (3 + tasks[0].count if tasks else 0)
        limit = 60.0 + per * math.ceil(len(tasks) / max(1, len(self._live())))
        deadline = time.monotonic() + limit
        gone: float | None = None
        while not rd.done():
            self._send_suspect(rd)
            if rd.done():
                break
            pending = {t.future: k for k, t in enumerate(tasks) if rd.out[k] is None and k not in rd.suspects}
            try:
                dask_wait(list(pending), timeout=2.0, return_when="FIRST_COMPLETED")
            except TimeoutError:
                pass
            for fut, k in pending.items():
                if fut.status in ("finished", "error", "cancelled", "lost"):
                    self._settle(rd, k, *_outcome(fut))
            if rd.done():
                break
            now = time.monotonic()
            gone = None if self._live() else (gone or now)
            for k, t in enumerate(tasks):
                if rd.out[k] is None and (now >= deadline or (gone is not None and now - gone > GONE_GRACE_S)):
                    t.future.cancel()
                    if now >= deadline:
                        rd.fail(k, "run_timeout", f"no reply from the boards of kind {self.board!r} within "
                                                  f"{limit:.0f} s (a board that stopped answering?)")
                    else:
                        rd.fail(k, "run_lost", self._none_left())
        return rd.out

    def _send_suspect(self, rd: _Round) -> None:
        """Send the next task that died once, when no other such task is on a board."""
        if rd.flying is not None and rd.out[rd.flying] is not None:
            rd.flying = None
        while rd.flying is None and rd.suspects:
            k = rd.suspects.pop(0)
            if rd.tasks[k].sent >= MAX_SENDS or not self._submit(rd.tasks[k], rd.opts):
                rd.fail(k, "run_lost", self._none_left())
            else:
                rd.flying = k
                if not self.quiet:
                    print(f"cuvil: a board of kind {self.board!r} died mid-measurement; its task is rerouted",
                          file=sys.stderr, flush=True)

    def _settle(self, rd: _Round, k: int, what: str, value: Any) -> None:
        """Task ``k``'s future has ended with ``what`` (:func:`_outcome`): keep the reply, send the task
        again (elsewhere), or fail it."""
        t = rd.tasks[k]
        if what == "reply":
            why = self._judge(value, t)
            if why is None:
                rd.out[k] = value
                return
            addr = str((value.get("board") or {}).get("address") if isinstance(value, dict) else "?")
            self._quarantine(addr, why)
            t.tried.append(addr)
            if t.sent >= MAX_SENDS or not self._submit(t, rd.opts):
                rd.fail(k, "run_error", f"a board returned no usable measurement ({why}); {self._none_left()}")
        elif what == "error":
            rd.fail(k, "run_error", f"the board task failed: {type(value).__name__}: {value}")
        else:  # "died": the board died under it; "dropped": its data went with another board
            if what == "died":
                t.deaths += 1
                dead = str(getattr(getattr(value, "last_worker", None), "address", "") or "")
                if dead:
                    t.tried.append(dead)
            if t.deaths >= 2:
                rd.fail(k, "run_lost", f"the board measuring it died, and so did the one it was rerouted to "
                                       f"({value})")
            elif what == "died":  # sent again when no other suspect is on a board (see the docstring)
                rd.suspects.append(k)
                if rd.flying == k:
                    rd.flying = None
            elif t.sent >= MAX_SENDS or not self._submit(t, rd.opts):
                rd.fail(k, "run_lost", self._none_left())

    def _none_left(self) -> str:
        q = f" ({len(self.quarantined)} quarantined)" if self.quarantined else ""
        return f"no board of kind {self.board!r} is left in the cluster{q}"

    def _judge(self, reply: Any, task: _Task) -> str | None:
        """Why a board's reply is not a measurement (None when it is one)."""
        results = reply.get("results") if isinstance(reply, dict) else None
        if not isinstance(results, list) or len(results) != task.count:
            return f"{len(results) if isinstance(results, list) else 'no'} results for {task.count} libraries"
        addr = str((reply.get("board") or {}).get("address"))
        for r in results:
            if not isinstance(r, dict) or r.get("status") not in _STATUS:
                return f"a result that is not one: {r!r:.80}"
            if r["status"] != "ok" or task.kind == "reference":
                continue
            t, ratio = r.get("seconds"), r.get("ratio")
            if not _positive(t) or (ratio is not None and not _positive(ratio)):
                return f"a time of {t!r} s (ratio {ratio!r}): not finite and positive"
        if task.kind == "run" and results[0]["status"] == "ok" and results[0].get("ratio"):
            ref = float(results[0]["seconds"]) / float(results[0]["ratio"])
            others = [x for a, ts in self._ref_s.items() if a != addr and a not in self.quarantined for x in ts]
            if others:
                mid = float(np.median(others))
                if max(ref, mid) / min(ref, mid) > INCONSISTENT:
                    return (f"it timed the untuned schedule at {ref * 1e3:.3g} ms, the other boards of the kind at "
                            f"{mid * 1e3:.3g} ms")
            self._ref_s.setdefault(addr, []).append(ref)
        return None

    def _quarantine(self, addr: str, why: str) -> None:
        if addr in self.quarantined:
            return
        self.quarantined[addr] = why
        self._ref_s.pop(addr, None)
        if not self.quiet:
            print(f"cuvil: board {addr} ({self.board}) quarantined for this run: {why}", file=sys.stderr, flush=True)


def _connect(address: str | None, security: Any, timeout_s: float) -> Any:
    from distributed import Client

    if str(address).startswith("tls://") and not getattr(security, "tls_client_cert", None):
        raise BoardError(f"{address}: TLS needs this host's certificate: security=distributed.security.Security("
                         "tls_ca_file=..., tls_client_cert=..., tls_client_key=..., require_encryption=True)")
    try:
        return Client(address, security=security, timeout=timeout_s)
    except (OSError, TimeoutError, ValueError) as exc:
        raise BoardError(f"cannot reach the Dask scheduler at {address}: {type(exc).__name__}: {exc}") from None


def _outcome(fut: Any) -> tuple[str, Any]:
    """What became of a finished task: ("reply", the board's reply), ("died", KilledWorker: the board died
    under it), ("dropped", why: cancelled, e.g. the data it needed was lost with a dead board, or no board
    could take it) or ("error", the exception the task raised)."""
    from distributed import KilledWorker

    try:
        if fut.status == "finished":
            return "reply", fut.result()
        exc = fut.exception() if fut.status == "error" else None
    except Exception as caught:  # noqa: BLE001 (cancelled between the status and the result)
        return "dropped", caught
    if isinstance(exc, KilledWorker):
        return "died", exc
    if exc is None or type(exc).__name__ in ("NoValidWorkerError", "NoWorkerError"):  # no board could take it
        # (cuvil scheduler's no-workers-timeout): sent again once one is back, else lost
        return "dropped", exc or fut.status
    return "error", exc


def _lib(build: BuildResult) -> tuple[str, bytes, int]:
    with open(build.path, "rb") as f:
        blob = f.read()
    return hashlib.sha256(blob).hexdigest(), blob, int(build.trial)


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _run_result(r: dict[str, Any]) -> RunResult:
    status = _STATUS[str(r["status"])]
    t, ratio = r.get("seconds"), r.get("ratio")
    if status != "ok":
        return RunResult(status, None, str(r.get("error") or r["status"]))
    return RunResult("ok", float(t), str(r.get("error") or ""), float(t) / float(ratio) if ratio else None)
