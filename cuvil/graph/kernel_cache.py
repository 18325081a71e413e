"""An on-disk cache of lowered kernels (loop IR), so a model compiles its kernels once per machine.

Keys hash the caller's description of a kernel (an ONNX node's op, attributes, input shapes and the
values it was specialised on) with the cuvil version, the source of every cuvil module (a change to
the scheduler or the lowering invalidates everything) and the canonical target.  Entries are
pickled :class:`~cuvil.ir.stmt.LoweredFunc` objects; LLVM code generation still runs per model.

The directory is ``$CUVIL_CACHE_DIR`` (``off`` disables the cache), else ``~/.cache/cuvil/kernels``.
A corrupt or unreadable entry is a miss, never an error.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
from functools import lru_cache
from typing import Any


def cache_dir() -> str | None:
    """The cache directory, or None when caching is off."""
    d = os.environ.get("CUVIL_CACHE_DIR")
    if d is not None and d.strip().lower() in ("", "off", "0", "none"):
        return None
    return d or os.path.join(os.path.expanduser("~"), ".cache", "cuvil", "kernels")


@lru_cache(maxsize=1)
def _code_version() -> str:
    import cuvil

    root = os.path.dirname(cuvil.__file__)
    h = hashlib.sha256(cuvil.__version__.encode())
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for f in sorted(filenames):
            if f.endswith(".py"):
                with open(os.path.join(dirpath, f), "rb") as fh:
                    h.update(f.encode() + fh.read())
    return h.hexdigest()


def _path(key: Any) -> str | None:
    d = cache_dir()
    if d is None:
        return None
    digest = hashlib.sha256((_code_version() + repr(key)).encode()).hexdigest()
    return os.path.join(d, digest[:2], digest + ".pkl")


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
    p = _path(key)
    if p is None:
        return
    try:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(p), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(func, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, p)
    except OSError:
        pass
