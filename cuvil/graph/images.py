"""Session images: what a session compiled from a model file, kept so that the next session of the same
file starts without importing, checking or compiling anything.

    key = image_key(path, options_key)      # None: the file cannot be named (bytes, a ModelProto)
    state = load(key)                        # a dict the session wrote, or None
    save(key, state)                         # pickled (arrays and loop IR; no native code)

An image holds the prepared graph (its weights included), the compiled programs (their constants, loop
IR, calls and memory plan) and the model's metadata; the programs' machine code stays in the kernel
cache, where :class:`cuvil.graph.link.LinkedModule` finds it.  The key is the file's path, size and
last change, the compile options and every cuvil source file: a changed model or a changed cuvil is a
miss.  Images live in ``<kernel cache>/images``; the
:data:`KEEP` most recently used are kept, older ones are deleted when a new one is written.  A damaged
image is a miss, never an error; ``CUVIL_CACHE_DIR=off`` turns images off with the rest of the cache.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
from functools import lru_cache
from typing import Any

from cuvil.graph import kernel_cache

__all__ = ["KEEP", "image_key", "load", "save"]

KEEP = 8  # images of this many sessions (a model's image is about twice its weights: ResNet-50's ~200 MB)


def _dir() -> str | None:
    d = kernel_cache.cache_dir()
    return None if d is None else os.path.join(d, "images")


def image_key(path: Any, options_key: Any) -> str | None:
    """The name of the image of model file ``path`` compiled with ``options_key``; None when ``path``
    is not a readable file."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    what = ("session image", _sources(), os.path.realpath(path), st.st_size, st.st_mtime_ns, options_key)
    return hashlib.sha256(repr(what).encode()).hexdigest() + ".img"


@lru_cache(maxsize=1)
def _sources() -> str:
    """A hash of cuvil's version and every one of its source files (the importers and the session too: an
    image holds what they made)."""
    import cuvil

    root = os.path.dirname(cuvil.__file__)
    h = hashlib.sha256(cuvil.__version__.encode())
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for f in sorted(filenames):
            if f.endswith(".py"):
                with open(os.path.join(dirpath, f), "rb") as fh:
                    h.update(os.path.relpath(os.path.join(dirpath, f), root).encode() + b"\0" + fh.read())
    return h.hexdigest()


def load(key: str | None) -> dict[str, Any] | None:
    """The state saved under ``key``, or None."""
    d = _dir()
    if key is None or d is None:
        return None
    p = os.path.join(d, key)
    try:
        with open(p, "rb") as f:
            state = pickle.load(f)
        os.utime(p)  # recently used
    except Exception:  # noqa: BLE001 - a missing or damaged image is a miss
        return None
    return state if isinstance(state, dict) else None


def save(key: str | None, state: dict[str, Any]) -> None:
    """Keep ``state`` under ``key`` (written atomically), then delete all but the :data:`KEEP` most recently
    used images.  Failures (a full disk, state that cannot be pickled) are ignored: a session without an
    image starts the usual way."""
    d = _dir()
    if key is None or d is None:
        return
    try:
        data = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(d, key))
        images = sorted((e for e in os.scandir(d) if e.name.endswith(".img")), key=lambda e: e.stat().st_mtime_ns)
        for e in images[:-KEEP]:
            os.remove(e.path)
    except Exception:  # noqa: BLE001 - an image is an optimisation
        return
