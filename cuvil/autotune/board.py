"""The board's side of tuning on target boards: what a Dask worker started by ``cuvil worker`` runs.

A board measures candidates the tuner compiled elsewhere.  :func:`measure` is the Dask task: it gets the
workload's inputs (sent once per workload and board), the candidates' libraries as bytes with their
sha256, and the timing options; it checks each hash, writes the libraries to a private folder and
measures them with the tuner's own machinery: a :class:`~cuvil.autotune.measure.LocalRunner` per
workload, whose child is a fresh interpreter that the runner kills when a kernel crashes or hangs, so a
bad kernel costs its trial and never the Dask worker.  :func:`facts` describes the board (architecture,
CPU features, caches, versions) and :func:`boards` lists the boards a scheduler knows, for the tuner's
checks before its first trial.

This module imports neither islpy nor llvmlite (a board runs exported libraries only), nor
``distributed`` until a function needs it.

Per-process state.  The board's name, the kernels' thread count and an exec prefix come from, first,
:func:`configure` (``cuvil worker`` calls it in the worker's own process: it runs no nanny), else the
environment variables ``CUVIL_BOARD``, ``CUVIL_BOARD_THREADS`` and ``CUVIL_BOARD_EXEC`` (set them before
starting any other Dask worker, e.g. a ``LocalCluster``'s), else the worker's ``cuvil-board-NAME``
resource, else ``local`` with one thread.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cuvil.autotune.board_facts import host_facts
from cuvil.cache import BoundedCache
from cuvil.errors import ArgumentError

RESOURCE_PREFIX = "cuvil-board-"  # a board of kind NAME is a Dask worker with the resource cuvil-board-NAME=1
KINDS = ("reference", "run", "final")
STATUSES = ("ok", "wrong", "crash", "timeout", "error", "badhash")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_STATUS = {"ok": "ok", "wrong": "wrong", "run_crash": "crash", "run_timeout": "timeout", "run_error": "error"}
MAX_WORKLOADS = 4  # runners (each a child process holding its workload's inputs) kept per board process


@dataclass(frozen=True)
class BoardConfig:
    """What a board process measures with: its kind's name, the kernels' threads, an exec prefix or None."""

    name: str
    threads: int = 1
    exec_prefix: str | None = None

    @property
    def resource(self) -> str:
        return RESOURCE_PREFIX + self.name


def check_name(name: str) -> str:
    """A board name is a Dask resource suffix: letters, digits, ``_ . -``, at most 63 characters."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ArgumentError(f"board name {name!r}: use letters, digits, '_', '.' and '-' (at most 63 characters, "
                            "starting with a letter or digit), e.g. rpi5")
    return name


_CONFIG: BoardConfig | None = None


def configure(name: str, threads: int = 1, exec_prefix: str | None = None) -> BoardConfig:
    """Set this process's board (``cuvil worker`` does, before its worker starts)."""
    global _CONFIG
    if threads < 1:
        raise ArgumentError(f"board {name!r}: threads must be at least 1, got {threads}")
    _CONFIG = BoardConfig(check_name(name), int(threads), exec_prefix or None)
    return _CONFIG


def _current_worker() -> Any:
    try:
        from distributed import get_worker
    except ImportError:
        return None
    try:
        return get_worker()
    except ValueError:  # not inside a Dask worker (measure called in-process)
        return None


def board_config() -> BoardConfig:
    """This process's board (see the module's docstring for where it comes from)."""
    if _CONFIG is not None:
        return _CONFIG
    name = os.environ.get("CUVIL_BOARD")
    if not name:
        worker = _current_worker()
        res = getattr(getattr(worker, "state", None), "total_resources", None) or {}
        names = sorted(k[len(RESOURCE_PREFIX):] for k in res if k.startswith(RESOURCE_PREFIX))
        name = names[0] if names else "local"
    threads = int(os.environ.get("CUVIL_BOARD_THREADS", "1") or 1)
    return BoardConfig(check_name(name), max(1, threads), os.environ.get("CUVIL_BOARD_EXEC") or None)


# -- facts ----------------------------------------------------------------------------------------
_EXEC_FACTS: BoundedCache[str, dict[str, Any]] = BoundedCache("cuvil.autotune.board._EXEC_FACTS", 64)  # per board


def _exec_facts(prefix: str) -> dict[str, Any]:
    """The facts of a board reached through ``prefix`` (cuvil.autotune.exec_board; unknown until it exists)."""
    found = _EXEC_FACTS.get(prefix)
    if found is None:
        try:
            from cuvil.autotune.exec_board import exec_facts
        except ImportError as exc:
            found = {"arch": "unknown", "triple": None, "cpu_features": [], "caches": {"L1d": 0, "L2": 0, "L3": 0},
                     "cores": None, "governor": None, "error": f"exec boards are not available: {exc}"}
        else:
            found = dict(exec_facts(prefix))
        _EXEC_FACTS[prefix] = found
    return dict(found)


def facts(config: BoardConfig | None = None) -> dict[str, Any]:
    """This board's facts: ``arch``, ``triple`` (a hint), ``cpu_features`` (sorted), ``caches`` (bytes),
    ``cores``, ``governor`` (None if unreadable), the ``cuvil``, ``numpy``, ``python`` and ``distributed``
    versions, ``hostname``, and the board's ``board`` name, ``threads`` and ``exec`` prefix.  For an exec
    board the machine's fields describe the board behind the prefix, not this host."""
    cfg = config or board_config()
    out = host_facts()
    if cfg.exec_prefix:
        out.update(_exec_facts(cfg.exec_prefix))
        out.setdefault("hostname", socket.gethostname())
    out.update(board=cfg.name, threads=cfg.threads, exec=cfg.exec_prefix)
    return out


def facts_hash(f: dict[str, Any]) -> str:
    """A short hash of a board's facts but its hostname: two boards of one model, set up alike, share it."""
    same = {k: v for k, v in f.items() if k != "hostname"}
    return hashlib.sha256(json.dumps(same, sort_keys=True, default=str).encode()).hexdigest()[:16]


def identity(config: BoardConfig | None = None) -> dict[str, Any]:
    """Who measured: the board's name, its worker's address (None outside a worker), host, pid, facts hash."""
    cfg = config or board_config()
    worker = _current_worker()
    f = facts(cfg)
    return {"name": cfg.name, "address": getattr(worker, "address", None), "hostname": f.get("hostname"),
            "pid": os.getpid(), "facts_hash": facts_hash(f)}


def describe() -> dict[str, Any]:
    """This process's board and facts (what :func:`boards` asks each worker through ``client.run``)."""
    cfg = board_config()
    return {"board": cfg.name, "threads": cfg.threads, "exec": cfg.exec_prefix, "facts": facts(cfg),
            "pid": os.getpid()}


def boards(client: Any, name: str | None = None) -> list[dict[str, Any]]:
    """The boards a Dask scheduler knows (of kind ``name``, or all): per worker with a ``cuvil-board-*``
    resource, ``address``, ``board`` (its kind), ``facts`` (:func:`facts`, None if the worker did not
    answer), ``busy`` (a task in progress or queued there), ``tasks`` (how many) and ``resources``."""
    info = client.scheduler_info(n_workers=-1)["workers"]
    found = {addr: w for addr, w in info.items()
             if any(k.startswith(RESOURCE_PREFIX) for k in (w.get("resources") or {}))}
    if name is not None:
        found = {a: w for a, w in found.items() if RESOURCE_PREFIX + name in (w.get("resources") or {})}
    if not found:
        return []
    processing = client.processing(workers=list(found))
    answers = client.run(describe, workers=list(found), on_error="return")
    out = []
    for addr, w in sorted(found.items()):
        kinds = sorted(k[len(RESOURCE_PREFIX):] for k in w.get("resources") or {} if k.startswith(RESOURCE_PREFIX))
        ans = answers.get(addr)
        desc = ans if isinstance(ans, dict) else {}
        tasks = len(processing.get(addr, ()))
        out.append({"address": addr, "board": name if name is not None else kinds[0], "kinds": kinds,
                    "facts": desc.get("facts"), "threads": desc.get("threads"), "exec": desc.get("exec"),
                    "busy": tasks > 0, "tasks": tasks, "resources": dict(w.get("resources") or {}),
                    "error": "" if desc else f"the worker did not describe itself: {ans!r}"})
    return out


# -- measuring ----------------------------------------------------------------------------------------
@dataclass
class _Workload:
    """One workload's runner on this board: its child process holds the inputs (and the reference)."""

    runner: Any  # LocalRunner
    folder: str
    inputs_fp: str
    ref_fp: str = ""  # fingerprint of the reference outputs and the untuned library the runner holds
    ref_sha: str = ""  # the untuned library's sha256 ("" when none)


_LOCK = threading.Lock()
_WORKLOADS: OrderedDict[tuple[str, BoardConfig], _Workload] = OrderedDict()
_ROOT: list[str] = []  # this process's private folder, made on first use


def _root() -> str:
    if not _ROOT:
        _ROOT.append(tempfile.mkdtemp(prefix="cuvil-board-"))  # mode 0700: this user's only
        atexit.register(_cleanup)
    return _ROOT[0]


def _cleanup() -> None:
    with _LOCK:
        while _WORKLOADS:
            _, wl = _WORKLOADS.popitem()
            wl.runner.close()
        for r in _ROOT:
            shutil.rmtree(r, ignore_errors=True)
        _ROOT.clear()


def _fingerprint(arrays: Sequence[Any] | None, *extra: Any) -> str:
    h = hashlib.sha256(repr(extra).encode())
    for a in arrays or ():
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.view(np.uint8).reshape(-1).data if a.size else b"")
    return h.hexdigest()


def _flush_bytes(f: dict[str, Any]) -> int:
    l3 = int((f.get("caches") or {}).get("L3") or 0) or int((f.get("caches") or {}).get("L2") or 0)
    return min(256 << 20, max(8 << 20, 2 * l3))


def _workload(data: dict[str, Any], cfg: BoardConfig, opts: dict[str, Any]) -> _Workload:
    from cuvil.autotune.measure import LocalRunner

    key = (str(data["key"]), cfg)
    specs = [(tuple(int(d) for d in shape), str(dt)) for shape, dt in data["outputs"]]
    fp = _fingerprint(data["inputs"], specs)
    wl = _WORKLOADS.get(key)
    if wl is not None and wl.inputs_fp != fp:  # the same key with other inputs: start afresh
        _WORKLOADS.pop(key)
        wl.runner.close()
        shutil.rmtree(wl.folder, ignore_errors=True)
        wl = None
    if wl is None:
        folder = tempfile.mkdtemp(prefix="w-", dir=_root())
        runner = LocalRunner(threads=cfg.threads, timeout_s=float(opts.get("timeout_s", 10.0)),
                             flush_bytes=_flush_bytes(facts(cfg)))
        runner.set_inputs([np.asarray(a) for a in data["inputs"]], specs)
        wl = _WORKLOADS[key] = _Workload(runner, folder, fp)
        while len(_WORKLOADS) > MAX_WORKLOADS:
            _, old = _WORKLOADS.popitem(last=False)
            old.runner.close()
            shutil.rmtree(old.folder, ignore_errors=True)
    _WORKLOADS.move_to_end(key)
    r = wl.runner
    r.timeout_s = float(opts.get("timeout_s", r.timeout_s))
    r.repeat = int(opts.get("repeat", r.repeat))
    r.min_run_s = float(opts.get("min_run_s", r.min_run_s))
    r.budget_s = float(opts["budget_s"]) if opts.get("budget_s") else None
    return wl


def _write(folder: str, sha: str, blob: bytes) -> str | None:
    """The library's path in ``folder``, or None when its bytes do not hash to ``sha``."""
    if not isinstance(blob, (bytes, bytearray, memoryview)) or hashlib.sha256(blob).hexdigest() != str(sha).lower():
        return None
    path = os.path.join(folder, f"{str(sha).lower()}.so")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.part"
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    return path


def _result(status: str, seconds: float | None = None, ratio: float | None = None, error: str = "") -> dict:
    return {"status": status, "seconds": seconds, "ratio": ratio, "error": error}


def _from_run(r: Any) -> dict[str, Any]:
    ratio = r.time_s / r.ref_time_s if r.time_s and r.ref_time_s else None
    return _result(_STATUS.get(r.status, "error"), r.time_s, ratio, r.error)


def _check(data: Any, libs: Any, kind: Any) -> None:
    if kind not in KINDS:
        raise ArgumentError(f"measure: kind {kind!r} is not one of {', '.join(KINDS)}")
    if not isinstance(data, dict) or any(k not in data for k in ("key", "inputs", "outputs")):
        raise ArgumentError("measure: data must be a dict with key, inputs, outputs (and reference, ref_lib, "
                            "harness)")
    if not isinstance(libs, (list, tuple)) or not all(isinstance(x, (list, tuple)) and len(x) == 3 for x in libs):
        raise ArgumentError("measure: libs must be a list of (sha256 hex, library bytes, trial)")
    if kind == "reference" and len(libs) != 1:
        raise ArgumentError(f"measure: kind 'reference' runs one library, got {len(libs)}")


def measure(data: dict[str, Any], libs: list[tuple[str, bytes, int]], kind: str,
            opts: dict[str, Any]) -> dict[str, Any]:
    """The Dask task: measure ``libs`` on this board; see docs/boards.md for the protocol.

    ``kind`` "reference": run ``libs[0]`` and return its outputs; "run": check each library against
    ``data["reference"]`` and time it in turns with ``data["ref_lib"]`` (no reference but a ref_lib: this
    board computes it from the ref_lib, once per workload); "final": the final round, ref_lib (when given)
    first, then the libraries, so ``results`` has one entry more than ``libs``.  A library whose bytes do
    not hash to its sha256 is "badhash" and never loaded."""
    _check(data, libs, kind)
    cfg = board_config()
    if cfg.exec_prefix:
        try:
            from cuvil.autotune import exec_board
        except ImportError as exc:
            raise ArgumentError(f"board {cfg.name}: --exec boards need cuvil.autotune.exec_board ({exc})") from None
        out = exec_board.measure(cfg.exec_prefix, data, libs, kind, opts)
        out.setdefault("board", identity(cfg))
        return out
    with _LOCK:  # one measurement at a time per board process (a Dask board has one thread anyway)
        out = _measure(data, libs, kind, opts, cfg)
    out["board"] = identity(cfg)
    return out


def _measure(data: dict[str, Any], libs: Sequence[tuple[str, bytes, int]], kind: str, opts: dict[str, Any],
             cfg: BoardConfig) -> dict[str, Any]:
    from cuvil.autotune.measure import BuildResult

    wl = _workload(data, cfg, opts)
    r = wl.runner
    paths = [_write(wl.folder, sha, blob) for sha, blob, _ in libs]
    bad = _result("badhash", error="the library's bytes do not match its sha256 (damaged in transit?): not run")
    builds = [BuildResult(int(trial), None, "ok", p) for (_, _, trial), p in zip(libs, paths)]  # type: ignore[arg-type]
    if kind == "reference":
        if paths[0] is None:
            return {"results": [bad], "outputs": None}
        res = r.reference(builds[0])
        ok = res.status == "ok"
        wl.ref_fp, wl.ref_sha = (_fingerprint(r.ref, libs[0][0].lower()), libs[0][0].lower()) if ok else ("", "")
        return {"results": [_from_run(res)], "outputs": list(r.ref) if res.status == "ok" else None}
    ref_build = None
    if data.get("ref_lib") is not None:
        ref_sha, ref_blob = data["ref_lib"]
        ref_path = _write(wl.folder, ref_sha, ref_blob)
        if ref_path is None:
            bad_ref = _result("badhash", error="the untuned library's bytes do not match its sha256: nothing run")
            return {"results": [dict(bad_ref) for _ in range(len(libs) + (kind == "final"))], "outputs": None}
        ref_build = BuildResult(-1, None, "ok", ref_path)  # type: ignore[arg-type]
        reference = data.get("reference")
        fp = _fingerprint(reference, ref_sha.lower()) if reference is not None else ""
        if reference is None and wl.ref_sha != ref_sha.lower():
            res = r.reference(ref_build)  # no reference sent: this board computes it once
            if res.status != "ok":
                failed = _result(_STATUS.get(res.status, "error"), error=f"the untuned library failed: {res.error}")
                return {"results": [dict(failed) for _ in range(len(libs) + (kind == "final"))], "outputs": None}
            wl.ref_fp, wl.ref_sha = _fingerprint(r.ref, ref_sha.lower()), ref_sha.lower()
        elif reference is not None and wl.ref_fp != fp:
            r.set_reference(list(reference), ref_path)
            wl.ref_fp, wl.ref_sha = fp, ref_sha.lower()
    elif data.get("reference") is not None:
        fp = _fingerprint(data["reference"], "")
        if wl.ref_fp != fp:
            r.set_reference(list(data["reference"]), "")
            wl.ref_fp, wl.ref_sha = fp, ""
    good = [k for k, p in enumerate(paths) if p is not None]
    results: list[dict[str, Any]] = [dict(bad) for _ in libs]
    if kind == "run":
        for k, res in zip(good, r.run([builds[k] for k in good], best_rel=opts.get("best_rel"))):
            results[k] = _from_run(res)
    else:
        entries = ([ref_build] if ref_build is not None else []) + [builds[k] for k in good]
        done = r.final(entries, rounds=int(opts.get("rounds", 15))) if entries else []
        head = [_from_run(done.pop(0))] if ref_build is not None else []
        for k, res in zip(good, done):
            results[k] = _from_run(res)
        results = head + results
    for p in paths:  # the candidates' files (the untuned one stays for the workload's life)
        if p is not None and (ref_build is None or p != ref_build.path):
            try:
                os.unlink(p)
            except OSError:
                pass
    return {"results": results, "outputs": None}
