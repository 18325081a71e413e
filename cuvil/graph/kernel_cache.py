"""An on-disk cache of lowered kernels (loop IR), so a model compiles its kernels once per machine.

Keys hash the caller's description of a kernel (an ONNX node's op, attributes, input shapes and the
values it was specialised on) with the cuvil version, the source of every cuvil module (a change to
the scheduler or the lowering invalidates everything) and the canonical target.  Entries are
pickled :class:`~cuvil.ir.stmt.LoweredFunc` objects.

A node's kernel is keyed by :func:`node_key` (its op, attributes, what its inputs are and the values its
builder read), and a tuning database by :func:`db_key`.

Linked modules keep their machine code here too (:func:`module_key`, :func:`load_object`,
:func:`store_object`): a model whose kernels and calls are all unchanged skips LLVM (code generation,
O3 and the JIT's machine code) and loads its object file into the JIT.

The directory is ``$CUVIL_CACHE_DIR`` (``off`` disables the cache), else ``~/.cache/cuvil/kernels``.
A corrupt or unreadable entry is a miss, never an error.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import tempfile
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np


def cache_dir() -> str | None:
    """The cache directory, or None when caching is off."""
    d = os.environ.get("CUVIL_CACHE_DIR")
    if d is not None and d.strip().lower() in ("", "off", "0", "none"):
        return None
    return d or os.path.join(os.path.expanduser("~"), ".cache", "cuvil", "kernels")


# sources that cannot change a lowered kernel or its machine code (command line, benchmarks, the tuner's
# search and measurement, the session's plumbing, export, loading a .so): editing them keeps the cache
# valid.  The tuning-record lookup and replay (schedule/records.py, database.py, workload.py) are in the
# key, and so is any new file: an omission costs a recompile, never a stale kernel
_NOT_IN_KERNELS = frozenset({
    "autotune/__init__.py", "autotune/api.py", "autotune/measure.py", "autotune/cost_model.py",
    "autotune/whole_models.py", "autotune/search.py", "autotune/space.py", "autotune/worker.py",
    "autotune/database.py", "autotune/replay.py", "autotune/workload.py",  # re-exports of schedule/'s
    "layers.py",
    "cli", "bench", "models", "onnx.py", "decorator.py",
    "frontend", "torch",  # importers write graph IR: a kernel's key holds its op, attributes and shapes
    "graph/export", "graph/profile.py", "runtime/loader.py",
})


@lru_cache(maxsize=1)
def _code_version() -> str:
    """A hash of cuvil's version and of every source file that lowering or code generation runs."""
    import cuvil

    root = os.path.dirname(cuvil.__file__)
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
        dirnames[:] = [d for d in dirnames if (d if rel == "." else f"{rel}/{d}") not in _NOT_IN_KERNELS]
        for f in filenames:
            name = f if rel == "." else f"{rel}/{f}"
            if f.endswith(".py") and name not in _NOT_IN_KERNELS:
                files.append((name, os.path.join(dirpath, f)))
    h = hashlib.sha256(cuvil.__version__.encode())
    for name, path in sorted(files):
        with open(path, "rb") as fh:
            h.update(name.encode() + b"\0" + fh.read())
    return h.hexdigest()


def clear() -> int:
    """Delete every entry of the cache directory (lowered kernels and object code; files of other
    programs are left alone); returns how many were deleted."""
    d = cache_dir()
    n = 0
    if d is None or not os.path.isdir(d):
        return 0
    for sub in os.listdir(d):
        path = os.path.join(d, sub)
        if len(sub) != 2 or not os.path.isdir(path):
            continue
        for f in os.listdir(path):
            if f.endswith((".pkl", ".o", ".tmp")):
                try:
                    os.remove(os.path.join(path, f))
                    n += 1
                except OSError:
                    pass
    return n


def _path(key: Any, suffix: str = ".pkl") -> str | None:
    d = cache_dir()
    if d is None:
        return None
    digest = hashlib.sha256((_code_version() + repr(key)).encode()).hexdigest()
    return os.path.join(d, digest[:2], digest + suffix)


def load(key: Any) -> Any | None:
    """The kernel stored under ``key``, or None."""
    p = _path(key)
    if p is None or not os.path.exists(p):
        return None
    try:
        with open(p, "rb") as f:
            return pickle.load(f)
    except Exception:  # noqa: BLE001 - a damaged entry is a miss
        return None


def store(key: Any, func: Any) -> None:
    """Keep ``func`` under ``key`` (written atomically; failures to write are ignored)."""
    _write(_path(key), pickle.dumps(func, protocol=pickle.HIGHEST_PROTOCOL))


def _write(p: str | None, data: bytes) -> None:
    if p is None:
        return
    try:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(p), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, p)
    except OSError:
        pass


class _Canonical(pickle.Pickler):
    """A pickler whose bytes do not depend on which equal strings are one object (interning differs
    between processes: a kernel lowered in a worker pickles apart from the same kernel lowered here)."""

    def persistent_id(self, obj: Any) -> Any:
        return b"s" + obj.encode("utf-8", "surrogatepass") if type(obj) is str else None


def fingerprint(obj: Any) -> bytes:
    """The pickled bytes of ``obj`` (loop IR), with every string written out in full: equal kernels lowered
    in different processes have equal fingerprints."""
    buf = io.BytesIO()
    _Canonical(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def module_key(kernels: Sequence[Any], calls: Sequence[Any], target: Any, entry: str) -> str:
    """A digest of everything a linked module's machine code depends on: its kernels (the
    :func:`fingerprint` of their loop IR, which is deterministic, or a string that identifies one), its
    calls, the entry name and the canonical target (the cuvil sources are added by
    :func:`load_object`/:func:`store_object`)."""
    from cuvil.target import Target

    h = hashlib.sha256(f"{Target(target).canonical}\0{entry}\0{list(calls)!r}\0".encode())
    for k in kernels:
        h.update(k.encode() + b"\0" if isinstance(k, str) else fingerprint(k))
    return h.hexdigest()


def load_object(key: str) -> bytes | None:
    """The object code stored under ``key`` (from :func:`module_key`), or None."""
    p = _path(("object", key), ".o")
    if p is None or not os.path.exists(p):
        return None
    try:
        with open(p, "rb") as f:
            return f.read()
    except OSError:
        return None


def store_object(key: str, data: bytes) -> None:
    """Keep a linked module's object code under ``key`` (written atomically; failures are ignored)."""
    _write(_path(("object", key), ".o"), bytes(data))


# -- what a kernel's key holds ---------------------------------------------------------------


def _digest(a: Any) -> str:
    from cuvil.graph.compiled import contiguous

    a = np.asarray(a)
    return hashlib.sha1(contiguous(a).tobytes() + str((a.dtype, a.shape)).encode()).hexdigest()


def _attr_key(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return ("array", _digest(v))
    if isinstance(v, (list, tuple)):
        return tuple(_attr_key(x) for x in v)
    return repr(v)


def node_key(ctx: Any, target: str) -> tuple:
    """The key of one node's kernel (``ctx``: its builder's :class:`~cuvil.graph.ops.base.NodeCtx`): target, op,
    opset, attributes, what its inputs are, the input values its builder read, its outputs, its variant."""
    from cuvil.graph.ops.base import Fused, Runtime

    n = ctx.node
    # shape, dtype and whether the value is known at compile time (builders may branch on that)
    # (an input computed by an earlier member of a fused kernel: which member, and its kernel shape)
    spec = tuple(None if e is None else (tuple(e.shape), e.dtype, False) if isinstance(e, Runtime) else (
        "fused", e.member, tuple(e.shape), e.dtype, e.kernel_shape) if isinstance(e, Fused) else (
        tuple(e.shape), e.dtype.name, True) for e in ctx.entries)
    values = tuple((i, _digest(ctx.entries[i])) for i in sorted(ctx.value_reads))
    attrs = tuple(sorted((k, _attr_key(v)) for k, v in n.attrs.items()))
    return (target, n.op_type, ctx.opset, attrs, spec, values, len(n.outputs)) + ((ctx.variant,) if ctx.variant else ())


def db_key(tuning_db: Any) -> tuple | None:
    """What a kernel cache key records of a tuning database: its file's identity and last change (a new
    record makes every kernel look again); None when it cannot be told (a database in memory)."""
    path = os.fspath(tuning_db) if isinstance(tuning_db, (str, os.PathLike)) else getattr(tuning_db, "path", None)
    if path is None or path == ":memory:":
        return None
    try:
        st = os.stat(path)
    except OSError:
        return ("tuning_db", os.path.abspath(path), "absent")
    board = getattr(tuning_db, "board", None)  # a database scoped to a board kind (Database.on) replays its records
    return ("tuning_db", os.path.abspath(path), st.st_mtime_ns, st.st_size) + ((board,) if board is not None else ())
