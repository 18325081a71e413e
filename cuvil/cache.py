"""In-process caches with a size limit: :class:`BoundedCache`, a mapping that forgets its least recently used
entry once it holds ``max_entries``.

Every module-level cache in cuvil is one of these, created by the module that owns it, with the limit and
the reason for the number next to it.  A miss is never an error, only work done again (a kernel read back
from the on-disk cache, a module JIT-compiled again, a weight packed again).  The caches:

=============================================  =====  ===========================================================
owner                                          limit  what an entry holds (and why the number)
=============================================  =====  ===========================================================
``cuvil.graph.compile._KERNELS``                1024  a lowered kernel and why it fell back: a model has tens of
                                                      distinct kernels (ResNet-50: 44), a few hundred at most, so
                                                      several models stay warm; an evicted one is read back from
                                                      the on-disk kernel cache
``cuvil.graph.compile._FOLDERS``                  16  a JIT module of a kernel that folds constants: folding runs
                                                      while compiling, and a model's layers repeat a few folded
                                                      kernels (bert-base QDQ: 8 distinct, GPT-2: 7); each module
                                                      holds its machine code
``cuvil.graph.ops.nn.matmul._PANELS``           1024  weights packed into panels, shared by the nodes (and the
                                                      programs) reading one array; an entry also leaves with its
                                                      array; the limit is above an LLM's weight count
``cuvil.schedule.bounds._PROVED``                256  the bounds proof of a program the tuner lowers under many
                                                      schedules: one program at a time needs it
``cuvil.target._CPU_CHECKS``                      64  whether LLVM knows a target's CPU and feature names: a
                                                      process names a few targets
``cuvil.codegen.llvm._MACHINES``                  32  an LLVM TargetMachine per (target, relocation model): a
                                                      process compiles for a few targets
``cuvil.autotune.board._EXEC_FACTS``              64  a board's facts, per command prefix: a few boards per process
``cuvil.autotune.exec_board._FLUSH``              64  a board's cache-flush size, per command prefix
``cuvil.autotune.exec_board._REFERENCES``          4  reference outputs computed on a board: one workload at a time
``cuvil.autotune.exec_harness._STAGED``           64  where the timing harness was copied, per board prefix
``cuvil.bench.probe._HANDOFF``                     2  the hand-off probe's kernel, per thread count
``cuvil.bench.registry._HANDOFFS``                 8  the hand-off probes taken, per thread count
``cuvil.graph.profile._BANDWIDTH``                16  a measured streaming bandwidth per (target, threads)
``cuvil.llm.qlinear._MODULES``                   256  a compiled weight contraction (or activation quantizer) per
                                                      kind and shape: a decoder has about 10 (4 projections x
                                                      2 step sizes, the head, the quantizers)
=============================================  =====  ===========================================================

Module-level state that is not a cache, and so has no limit:

- ``cuvil.cache._LIVE``: the live BoundedCaches (weakly), whose locks a forked child replaces;
- ``cuvil.runtime.loader._OPENED``: the libraries this process has dlopened (never unloaded: forgetting one
  would let a later load of a rewritten file get the stale library back from dlopen);
- ``cuvil.target.Target._cache``: interning (a Target is equal only to itself), one per target string;
- ``cuvil.graph.ops.base._REGISTRY``, ``cuvil.frontend.torch_ops.TABLE``: the op builders, filled at import;
- ``cuvil.autotune.board._WORKLOADS``: bounded by hand, at most ``MAX_WORKLOADS`` (4) measuring processes,
  each closed as it goes (a BoundedCache would drop one without closing it); ``cuvil.autotune.board._ROOT``:
  one folder.

``functools.cache`` memoises a few functions of a target or CPU name (``cuvil.target._narrowed``,
``cuvil.codegen.calibrate``, ``cuvil.autotune.exec_harness._build_harness``): one entry per target a process
uses.  Caches owned by an object live as long as it does (a session's programs per input signature:
``cuvil.graph.driver.ModelCompiler``, its 64 most recently used).  Session images on disk
(``cuvil.graph.images``) keep the 8 most recently used.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from typing import Any, TypeVar

from cuvil.errors import ArgumentError

K = TypeVar("K")
V = TypeVar("V")

__all__ = ["BoundedCache"]


class BoundedCache(MutableMapping[K, V]):
    """A dict that keeps at most ``max_entries``, forgetting the least recently used (read or written) entry
    first.  ``name`` says whose cache it is (its ``repr``).  Safe to share between threads::

        c = BoundedCache("example", 2)
        c["a"] = 1; c["b"] = 2; c["a"]      # "a" is now the most recent
        c["c"] = 3                          # forgets "b"
        list(c) == ["a", "c"]

    ``key in c`` does not count as a use; ``c[key]``, ``c.get(key)`` and ``c[key] = v`` do."""

    def __init__(self, name: str, max_entries: int):
        if not isinstance(max_entries, int) or max_entries < 1:
            raise ArgumentError(f"BoundedCache {name!r}: max_entries must be an int >= 1, got {max_entries!r}")
        self.name = name
        self.max_entries = max_entries
        self._data: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()
        _LIVE[id(self)] = self

    def __getitem__(self, key: K) -> V:
        with self._lock:
            value = self._data[key]
            self._data.move_to_end(key)
            return value

    def __setitem__(self, key: K, value: V) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.max_entries:
                self._data.popitem(last=False)

    def __delitem__(self, key: K) -> None:
        with self._lock:
            del self._data[key]

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[K]:
        with self._lock:
            return iter(list(self._data))  # oldest first; a copy, so that use while iterating is safe

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: K, default: Any = None) -> Any:
        with self._lock:
            if key not in self._data:
                return default
            self._data.move_to_end(key)
            return self._data[key]

    def pop(self, key: K, *default: Any) -> Any:
        with self._lock:
            return self._data.pop(key, *default)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def __repr__(self) -> str:
        return f"BoundedCache({self.name!r}, {len(self._data)}/{self.max_entries} entries)"


# every BoundedCache alive, so that a forked child (a compile's worker, cuvil/graph/parallel.py) gets fresh
# locks: one another thread held at the fork would never be released there
_LIVE: weakref.WeakValueDictionary[int, BoundedCache] = weakref.WeakValueDictionary()  # (a mapping: unhashable)


def _fresh_locks_after_fork() -> None:
    for c in list(_LIVE.values()):
        c._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_locks_after_fork)
