"""A board with no Python: measurements through a command prefix and a small C timing harness.

``cuvil worker tls://... --board arm --exec "qemu-aarch64 -L /usr/aarch64-linux-gnu"`` (or ``--exec "ssh pi"``)
runs the Dask worker on a host machine; each measurement runs ``harness.c`` (cross-built by
:func:`~cuvil.autotune.exec_harness.harness_bytes` on the tuner's host and sent with the workload) through
the prefix (:mod:`cuvil.autotune.exec_harness`).  The harness dlopens each library and calls its entry
point by name, so one build serves every kernel; inputs, libraries and outputs travel on its stdin and
stdout, so the board shares nothing with this host but the command.  It times with the local runner's
protocol (cuvil/autotune/worker.py); this side checks its outputs with the same tolerance rule.

Under qemu-user the times are not the board's speed, but the check against the reference and the ranking
of a clearly slower candidate are real: that is how CI tests an AArch64 board.

Runs on the board's worker: only the standard library, numpy and :mod:`cuvil.autotune.worker`; never
islpy or llvmlite.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from cuvil.autotune.exec_harness import exec_facts, harness_bytes, harness_command, parse_facts, run_facts, split_prefix
from cuvil.autotune.worker import _mismatch
from cuvil.cache import BoundedCache
from cuvil.errors import ArgumentError, TargetError

__all__ = ["exec_facts", "harness_bytes", "measure"]

GRACE_S = 5.0  # past the harness's own alarm (qemu's start, a slow link) before this side kills it


def _result(status: str, seconds: float | None = None, ratio: float | None = None, error: str = "") -> dict[str, Any]:
    return {"status": status, "seconds": seconds, "ratio": ratio, "error": error}


def _records(data: dict[str, Any], libs: Sequence[bytes]) -> bytes:
    """The harness's stdin: inputs, outputs filled with NaN (0 for integers: an unwritten element shows), libraries."""
    parts = []
    for a in data["inputs"]:
        raw = np.ascontiguousarray(a).tobytes()
        parts += [f"in {len(raw)} -\n".encode(), raw]
    for shape, dtype in data["outputs"]:
        dt = np.dtype(dtype)
        raw = np.full(tuple(shape), np.nan if dt.kind == "f" else 0, dt).tobytes()
        parts += [f"out {len(raw)} -\n".encode(), raw]
    for lib in libs:
        parts += [f"lib {len(lib)} -\n".encode(), lib]
    parts.append(b"end 0 -\n")
    return b"".join(parts)


def _signature_error(meta: dict[str, Any], data: dict[str, Any]) -> str:
    """Why the library's signature (its cuvil_meta JSON) does not fit the workload's arrays; "" if it does."""
    want = [(tuple(np.shape(a)), np.asarray(a).dtype.name, False) for a in data["inputs"]]
    want += [(tuple(s), np.dtype(d).name, True) for s, d in data["outputs"]]
    have = [(tuple(p["shape"]), p["dtype"], bool(p["output"])) for p in meta.get("params", [])
            if p.get("kind") == "buffer"]
    if meta.get("size_vars") or have != want:
        return f"the library's signature {have} (sizes {meta.get('size_vars')}) does not fit the workload's {want}"
    return ""


Judge = Callable[[list[dict[str, Any]], list[list[np.ndarray]]], list[int]]


def _read_exact(stream: BinaryIO, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _session(cmd: list[str], stdin: bytes, specs: Sequence[tuple[Any, Any]], judge: Judge, limit_s: float,
             tmp: str) -> tuple[str, dict[int, tuple[float, float | None]], str]:
    """One harness process: send ``stdin``, read each library's meta and checked outputs, let ``judge`` pick
    the libraries to time (it may record their errors), read the times.  Returns a status ("ok", "crash",
    "timeout", "error"), the times by library, and an error."""
    with open(os.path.join(tmp, "stderr"), "w+b") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            proc.kill()

        timer = threading.Timer(limit_s + GRACE_S, kill)
        timer.start()
        times: dict[int, tuple[float, float | None]] = {}
        protocol = ""
        try:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(stdin)
            proc.stdin.flush()
            metas: list[dict[str, Any]] = []
            outs: list[list[np.ndarray]] = []
            while line := proc.stdout.readline():
                text = line.decode(errors="replace").rstrip("\n")
                word, *rest = text.split(" ", 2 if text.startswith("meta ") else 3)  # meta: JSON with spaces
                if word == "meta":
                    metas.append(json.loads(rest[1]))
                    outs.append([])
                elif word == "data":
                    shape, dtype = specs[int(rest[1])]
                    raw = _read_exact(proc.stdout, int(rest[2]))
                    outs[int(rest[0])].append(np.frombuffer(raw, np.dtype(dtype)).reshape(tuple(shape)).copy())
                elif word == "checked":
                    live = judge(metas, outs)
                    proc.stdin.write(f"go {' '.join(map(str, live))}\n".encode() if live else b"quit\n")
                    proc.stdin.close()
                elif word == "time":
                    t, ratio = float(rest[1]), float(rest[2])
                    times[int(rest[0])] = (t, ratio if np.isfinite(ratio) else None)
        except (BrokenPipeError, EOFError, OSError):
            pass  # the harness died: its exit status says how
        except (ValueError, KeyError, IndexError) as exc:  # output that is not the protocol: stop it
            proc.kill()
            protocol = f"the harness's output does not follow its protocol: {type(exc).__name__}: {exc}"
        finally:
            if proc.stdin is not None and not proc.stdin.closed:
                try:
                    proc.stdin.close()  # the harness reads end of input as "quit"
                except OSError:
                    pass
            rc = proc.wait()
            timer.cancel()
        err.seek(0)
        text = err.read().decode(errors="replace").strip()[-2000:]
    if protocol:
        return "error", times, protocol
    if killed.is_set() or rc in (-signal.SIGALRM, 128 + signal.SIGALRM):
        return "timeout", times, f"the run took longer than {limit_s:g} s"
    if rc < 0 or 128 < rc < 192:  # killed by a signal: here (qemu re-raises the guest's), or a remote shell's 128 + N
        sig = -rc if rc < 0 else rc - 128
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return "crash", times, f"the candidate crashed the harness ({name}): {text}"
    if rc == 255:  # ssh's own failure (the board unreachable, or the remote process killed): not the candidate's
        return "error", times, f"the command failed (exit status 255: ssh could not reach the board?): {text}"
    if rc != 0:
        return "error", times, text or f"the harness exited with status {rc}"
    return "ok", times, ""


def _hashed(item: tuple[str, bytes] | tuple[str, bytes, int] | None) -> str:
    """Why a library's bytes do not match its sha256 ("" when they do)."""
    if item is None:
        return ""
    sha, blob = item[0], item[1]
    got = hashlib.sha256(blob).hexdigest()
    return "" if got == str(sha).lower() else f"the library's sha256 is {got}, not {sha}: not run"


@dataclass(frozen=True)
class _Harness:
    """The harness staged for one measure() call: the command that runs it, the workload, the options."""

    cmd: list[str]
    data: dict[str, Any]
    opts: dict[str, Any]
    timeout_s: float
    threads: int
    flush_bytes: int
    tmp: str

    def session(self, mode: str, blobs: Sequence[bytes], judge: Judge, budget_s: float, best_rel: float | None,
                limit_s: float) -> tuple[str, dict[int, tuple[float, float | None]], str]:
        o = self.opts
        args = ["time", mode, str(self.threads), str(self.flush_bytes), str(int(o.get("repeat", 5))),
                repr(float(o.get("min_run_s", 0.01))), repr(float(budget_s)),
                repr(float(best_rel) if best_rel is not None else -1.0), str(int(o.get("rounds", 15))),
                str(max(1, int(limit_s + 0.999)))]
        return _session([*self.cmd, *args], _records(self.data, blobs), self.data["outputs"], judge, limit_s,
                        self.tmp)


# prefix -> bytes the harness writes to flush the board's caches (a few boards per process)
_FLUSH: BoundedCache[str, int] = BoundedCache("cuvil.autotune.exec_board._FLUSH", 64)
# (prefix, untuned library, inputs) -> reference outputs computed on the board: one workload at a time
_REFERENCES: BoundedCache[tuple[str, str, str], list[np.ndarray]] = BoundedCache(
    "cuvil.autotune.exec_board._REFERENCES", 4)


def _flush_bytes(prefix: str, cmd: list[str]) -> int:
    """Twice the board's last-level cache (8 MiB to 256 MiB, as the local runner), read once per prefix."""
    got = _FLUSH.get(prefix)
    if got is None:
        try:
            caches = parse_facts(run_facts(cmd, prefix), prefix)["caches"]
        except TargetError:
            caches = {}
        got = _FLUSH[prefix] = min(256 << 20, max(8 << 20, 2 * int(caches.get("L3") or caches.get("L2") or 0)))
    return got


def _threads(opts: dict[str, Any]) -> int:
    """The kernels' thread count: opts["threads"], else the board's (``cuvil worker --threads``)."""
    if opts.get("threads"):
        return int(opts["threads"])
    from cuvil.autotune.board import board_config

    return board_config().threads


def _fingerprint(arrays: Sequence[Any]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def measure(prefix: str, data: dict[str, Any], libs: list[tuple[str, bytes, int]], kind: str,
            opts: dict[str, Any]) -> dict[str, Any]:
    """Check and time ``libs`` through the harness behind ``prefix`` (see the module docstring).

    ``kind`` "reference": run libs[0] once and return its outputs; "run": each library checked against
    ``data["reference"]`` (computed here from ``data["ref_lib"]`` when not given, once per library and
    inputs) and timed in turns with ``ref_lib``, one harness process each, so a crash or a hang costs only
    its trial (``timeout_s`` each); "final": ``ref_lib`` (when given) first, then ``libs``, in interleaved
    rounds in one process (``timeout_s`` per library), so ``results`` has one entry more than ``libs``,
    as :func:`cuvil.autotune.board.measure` has.  Returns ``{"board": {}, "results": [...], "outputs":
    [...] | None}``; every file goes to a private temporary folder, removed afterwards."""
    if kind not in ("reference", "run", "final"):
        raise ArgumentError(f"measure: kind {kind!r} is not one of 'reference', 'run', 'final'")
    argv = split_prefix(prefix)
    n_out = len(libs) + (kind == "final" and data.get("ref_lib") is not None)
    tmp = tempfile.mkdtemp(prefix="cuvil-exec-")
    try:
        try:
            cmd = harness_command(argv, data["harness"], tmp)
            flush = int(opts.get("flush_bytes") or _flush_bytes(prefix, cmd))
        except (TargetError, OSError) as exc:
            return {"board": {}, "results": [_result("error", error=str(exc)) for _ in range(n_out)], "outputs": None}
        h = _Harness(cmd, data, opts, float(opts.get("timeout_s", 10.0)), _threads(opts), flush, tmp)
        if kind == "reference":
            return _reference(h, libs[0])
        ref_lib = data.get("ref_lib")
        if ref_lib is not None and _hashed(ref_lib):
            msg = f"the untuned schedule's library: {_hashed(ref_lib)}: nothing run"
            return {"board": {}, "results": [_result("badhash", error=msg) for _ in range(n_out)], "outputs": None}
        if ref_lib is not None and data.get("reference") is None:
            key = (prefix, ref_lib[0], _fingerprint(data["inputs"]))
            reference = _REFERENCES.get(key)
            if reference is None:
                got = _reference(h, (ref_lib[0], ref_lib[1], -1))
                res = got["results"][0]
                if res["status"] != "ok":
                    msg = f"the untuned library failed: {res['error']}"
                    return {"board": {}, "results": [_result(res["status"], error=msg) for _ in range(n_out)],
                            "outputs": None}
                reference = _REFERENCES[key] = got["outputs"]
            h = dataclasses.replace(h, data={**data, "reference": reference})
        return {"board": {}, "results": (_run if kind == "run" else _final)(h, libs), "outputs": None}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _reference(h: _Harness, item: tuple[str, bytes, int]) -> dict[str, Any]:
    if _hashed(item):
        return {"board": {}, "results": [_result("badhash", error=_hashed(item))], "outputs": None}
    got: list[list[np.ndarray]] = []
    bad: list[str] = []

    def judge(metas: list[dict[str, Any]], outs: list[list[np.ndarray]]) -> list[int]:
        bad.append(_signature_error(metas[0], h.data))
        got.extend(outs)
        return []

    status, _, err = h.session("run", [item[1]], judge, 0.0, None, h.timeout_s)
    if status == "ok" and (not bad or bad[0]):
        status, err = "error", (bad[0] if bad else "the harness returned no outputs")
    outputs = got[0] if status == "ok" else None
    return {"board": {}, "results": [_result(status, error=err)], "outputs": outputs}


def _run(h: _Harness, libs: list[tuple[str, bytes, int]]) -> list[dict[str, Any]]:
    reference, ref_lib = h.data.get("reference"), h.data.get("ref_lib")
    best = h.opts.get("best_rel")
    budget = float(h.opts.get("budget_s", max(0.5, h.timeout_s / 3)))
    results = []
    for item in libs:
        if _hashed(item):
            results.append(_result("badhash", error=_hashed(item)))
            continue
        if reference is None:
            results.append(_result("error", error="no reference outputs: run the untuned schedule first"))
            continue
        verdict: list[tuple[str, str]] = []
        judge = functools.partial(_judge_candidate, h.data, reference, verdict)
        blobs = [item[1]] + ([ref_lib[1]] if ref_lib is not None else [])
        status, times, err = h.session("run", blobs, judge, budget, best, h.timeout_s)
        if status == "ok" and verdict and verdict[0][0] != "ok":
            results.append(_result(verdict[0][0], error=verdict[0][1]))
        elif status == "ok" and 0 in times:
            t, ratio = times[0]
            results.append(_result("ok", t, ratio))
            if ratio is not None and (best is None or ratio < best):
                best = ratio
        else:
            results.append(_result("error" if status == "ok" else status, error=err or "the harness gave no time"))
    return results


def _judge_candidate(data: dict[str, Any], reference: Sequence[np.ndarray], verdict: list[tuple[str, str]],
                     metas: list[dict[str, Any]], outs: list[list[np.ndarray]]) -> list[int]:
    """A "run" harness's candidate (library 0) checked: time both libraries, or none (``verdict`` says why)."""
    sig = _signature_error(metas[0], data)
    wrong = "" if sig else _mismatch(outs[0], reference)
    verdict.append(("error", sig) if sig else ("wrong", wrong) if wrong else ("ok", ""))
    return [] if sig or wrong else list(range(len(outs)))


def _final(h: _Harness, libs: list[tuple[str, bytes, int]]) -> list[dict[str, Any]]:
    """The final round: entry 0 is ``ref_lib`` (else the first library); a library equal to it is that entry."""
    reference, ref_lib = h.data.get("reference"), h.data.get("ref_lib")
    base = (ref_lib[0], ref_lib[1]) if ref_lib is not None else (libs[0][0], libs[0][1]) if libs else None
    entries: list[bytes] = [base[1]] if base else []
    where = [0] if ref_lib is not None else []  # result i -> its entry in the harness (-1: bad hash)
    for item in libs:
        if _hashed(item):
            where.append(-1)
        elif base is not None and item[0] == base[0]:
            where.append(0)
        else:
            where.append(len(entries))
            entries.append(item[1])
    errors: dict[int, tuple[str, str]] = {}

    def judge(metas: list[dict[str, Any]], outs: list[list[np.ndarray]]) -> list[int]:
        for k, (meta, out) in enumerate(zip(metas, outs)):
            sig = _signature_error(meta, h.data)
            wrong = "" if sig or reference is None else _mismatch(out, reference)
            if sig or wrong:
                errors[k] = ("error", sig) if sig else ("wrong", wrong)
        return [k for k in range(len(outs)) if k not in errors]

    n = len(entries)
    budget = float(h.opts.get("budget_s", h.timeout_s * n / 2))
    status, times, err = h.session("final", entries, judge, budget, None, h.timeout_s * n) if n else ("ok", {}, "")
    items = ([(ref_lib[0], ref_lib[1], -1)] if ref_lib is not None else []) + list(libs)
    out = []
    for item, k in zip(items, where):
        if k < 0:
            out.append(_result("badhash", error=_hashed(item)))
        elif status != "ok":
            out.append(_result(status, error=err))
        elif k in errors:
            out.append(_result(errors[k][0], error=errors[k][1]))
        elif k in times:
            out.append(_result("ok", times[k][0], times[k][1]))
        else:
            out.append(_result("error", error="the harness gave no time"))
    return out
