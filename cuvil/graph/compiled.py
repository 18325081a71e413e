"""A compiled graph: its buffers (slots), its linked native module, its memory plan, and how to run it.

:func:`cuvil.graph.compile.compile_model` makes one; ``prog.run({"x": x})`` is one native call.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import math
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from cuvil.errors import BoundsError, CuvilError
from cuvil.graph.ops.base import INDEX_TAG, Runtime


@dataclass
class Slot:
    """One buffer of a compiled graph: a fed input, a constant, or a temporary a kernel writes."""

    kind: str  # "feed" | "const" | "temp"
    dtype: str
    size: int  # elements
    name: str = ""
    array: np.ndarray | None = None


def contiguous(a: Any) -> np.ndarray:
    """A C-contiguous array that keeps a 0-d array 0-d (np.ascontiguousarray makes it 1-d)."""
    if type(a) is np.ndarray and a.flags.c_contiguous:
        return a  # the common case, without np.require's microseconds
    return np.require(np.asarray(a), requirements="C")


def link(calls: list[tuple[Any, tuple[int, ...]]], target: Any, workers: Any = None,
         keys: Mapping[int, tuple] | None = None) -> tuple[list[Any], list[Any], Any]:
    """The distinct kernels of ``calls``, the calls by the kernels' names, and the one native module whose
    entry point makes the calls in order (None when there are none); its kernels' machine code is made by
    ``workers`` (:class:`cuvil.graph.parallel.Workers`; None: here).  A kernel's identity is the digest of
    its cache key (``keys``: id of a kernel -> its key), else of its loop IR; it names the kernel
    (``k`` + 12 hex digits: equal kernels of two compiled graphs have one name, cuvil/graph/link.py) and
    its machine code in the kernel cache."""
    from cuvil.graph import kernel_cache
    from cuvil.graph.link import KernelCall, LinkedModule

    names: dict[int, str] = {}
    kernels = []
    ids = []
    linked_calls = []
    for func, args in calls:
        if id(func) not in names:
            key = (keys or {}).get(id(func))
            ident = (hashlib.sha256(repr(key).encode()).hexdigest() if key is not None else
                     kernel_cache.module_key([func], [], target, "kernel"))
            names[id(func)] = f"k{ident[:12]}"
            kernels.append(dataclasses.replace(func, name=names[id(func)]))
            ids.append(ident)
        linked_calls.append(KernelCall(names[id(func)], args))
    module = LinkedModule(kernels, linked_calls, target, workers=workers, kernel_ids=ids) if linked_calls else None
    return kernels, linked_calls, module


def temp_bytes(slots: list[Slot], outputs: list[tuple[str, Runtime | np.ndarray]]) -> dict[int, int]:
    """The bytes of each temporary the caller does not get back (those share the arena)."""
    returned = {e.slot for _, e in outputs if isinstance(e, Runtime)}
    return {k: max(s.size, 1) * np.dtype(s.dtype).itemsize for k, s in enumerate(slots)
            if s.kind == "temp" and k not in returned}


class CompiledGraph:
    """A graph compiled for fixed input shapes: ``run(feeds) -> {output name: array}``, one native call."""

    def __init__(self, slots: list[Slot], kernels: list[Any], kernel_calls: list[Any], module: Any,
                 memory: Any, outputs: list[tuple[str, Runtime | np.ndarray]], target: Any, labels: list[str],
                 fallbacks: tuple[str, ...] = (), call_nodes: list[tuple[Any, ...]] | None = None,
                 call_flops: list[tuple[float, str]] | None = None):
        self.slots = slots
        self.outputs = outputs
        self.target = target
        self.labels = list(labels)
        self.kernel_calls = kernel_calls  # per call: the kernel's name in the module and its slots
        self.kernel_funcs = kernels
        self.n_kernels = len(kernels)
        self.n_calls = len(kernel_calls)
        self.module = module
        self.memory = memory  # cuvil.graph.memplan.MemoryPlan of the temporaries
        self.fallbacks = fallbacks  # one line per kernel that took a plainer schedule than planned
        # per call: the graph nodes its kernel computes, in fused-member order (for bounds errors)
        self.call_nodes = call_nodes if call_nodes is not None else [()] * len(kernel_calls)
        # per call: its contractions' work and kind (cuvil.graph.profile.contraction_flops), for the profile
        self.call_flops = call_flops if call_flops is not None else [(0.0, "")] * len(kernel_calls)
        self._feeds = [(k, s.name) for k, s in enumerate(slots) if s.kind == "feed"]
        self._consts = {k: s.array for k, s in enumerate(slots) if s.kind == "const"}
        self._temp_bytes = temp_bytes(slots, outputs)
        # temporaries returned to the caller: a fresh array whenever the caller still holds the last one
        self._returned = [k for k, s in enumerate(slots) if s.kind == "temp" and k not in memory.offsets]
        self._tls = threading.local()  # each thread's kept buffers (see _kept)

    def __getstate__(self) -> dict[str, Any]:
        """What a session image keeps (cuvil/graph/images.py): everything but the native module and the
        threads' buffers; the module is loaded again from the kernel cache's machine code."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("module", "_tls")}
        state["_module"] = None if self.module is None else (self.module.entry, self.module.kernel_ids)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        from cuvil.graph.link import LinkedModule

        module = state.pop("_module")
        self.__dict__.update(state)
        self._tls = threading.local()
        self.module = None if module is None else LinkedModule(self.kernel_funcs, self.kernel_calls, self.target,
                                                               module[0], kernel_ids=module[1])

    def run(self, feeds: Mapping[str, np.ndarray], out: Mapping[str, np.ndarray] | None = None
            ) -> dict[str, np.ndarray]:
        """``{output name: array}`` for ``feeds``.  ``out`` ({name: array}, checked by the caller:
        C-contiguous, of the output's shape and dtype) are the caller's buffers of those outputs: a
        kernel writes into one directly where the output is a buffer of its own, else it is copied
        there; the result then holds the caller's arrays."""
        arrays = self._varying(feeds)  # the temporaries in the arena need no array: their pointers are fixed
        bound = {}
        if out:
            bound = self._bind(arrays, out)
        self.run_buffers(arrays)  # type: ignore[arg-type]
        result = {}
        for name, e in self.outputs:
            if isinstance(e, np.ndarray):
                value = e.copy() if out is None or name not in out else e
            else:
                value = arrays[e.slot][:math.prod(e.shape)].reshape(e.shape)
            if out is not None and name in out:
                if name not in bound:
                    np.copyto(out[name], value.reshape(out[name].shape))
                value = out[name]
            result[name] = value
        return result

    def _bind(self, arrays: dict[int, np.ndarray], out: Mapping[str, np.ndarray]) -> set[str]:
        """Put the caller's output buffers in place of the returned temporaries they can replace (an
        output with a slot of its own, the slot's size exactly the output's); the names bound."""
        uses: dict[int, int] = {}
        for _, e in self.outputs:
            if isinstance(e, Runtime):
                uses[e.slot] = uses.get(e.slot, 0) + 1
        returned = set(self._returned)
        bound = set()
        for name, e in self.outputs:
            buf = out.get(name)
            if (buf is None or not isinstance(e, Runtime) or e.slot not in returned or uses[e.slot] != 1
                    or self.slots[e.slot].size != buf.size or buf.size == 0
                    or np.dtype(self.slots[e.slot].dtype) != buf.dtype):
                continue
            arrays[e.slot] = buf.reshape(-1)
            bound.add(name)
        return bound

    def profile(self, feeds: Mapping[str, np.ndarray], repeat: int = 10) -> Any:
        """Each kernel call timed on its own buffers (see :mod:`cuvil.graph.profile`)."""
        from cuvil.graph.profile import profile

        return profile(self, feeds, repeat)

    def run_buffers(self, arrays: list[np.ndarray]) -> None:
        """One run of every kernel on ``arrays`` (from :meth:`buffers`)."""
        if self.module is not None:
            err = (ctypes.c_int64 * 3)()
            rc = self.module.call_array(self._pointers(arrays), err)
            if rc == 4:
                raise BoundsError(self.bounds_message(int(err[2]), int(err[0]), str(int(err[1]))) +
                                  "; the run stopped there, without reading or writing outside any tensor")
            if rc:
                raise CuvilError("the compiled model failed to allocate its temporary memory (status "
                                 f"{rc})")

    def bounds_message(self, call: int, site: int, value: str) -> str:
        """What the failed bounds check ``site`` of kernel call ``call`` says about index ``value``: the
        node and its input for an ONNX index (a Gather's), else the kernel's buffer and dimension."""
        if not 0 <= call < len(self.kernel_calls):
            return f"a bounds check failed (call {call}, check {site}, index {value})"
        kernel = self.kernel_funcs[[k.name for k in self.kernel_funcs].index(self.kernel_calls[call].kernel)]
        label = self.labels[call] if call < len(self.labels) else f"kernel call {call}"
        if not 1 <= site <= len(kernel.checks):
            return f"{label}: a bounds check failed (check {site}, index {value})"
        c = kernel.checks[site - 1]
        nodes = self.call_nodes[call] if call < len(self.call_nodes) else ()
        member, i = divmod(c.tag, INDEX_TAG) if c.tag >= 0 else (-1, -1)
        n = c.extent
        valid = f"{-int(n)} .. {int(n) - 1}" if n.lstrip("-").isdigit() and c.wrap else (
            f"0 .. {int(n) - 1}" if n.lstrip("-").isdigit() else f"0 .. {n} - 1")
        if 0 <= member < len(nodes):
            op_type, name, inputs = nodes[member]
            src = f" in input {i} ({inputs[i]!r})" if 0 <= i < len(inputs) else ""
            return (f"{op_type} node {name!r}: index {value}{src} is out of range for a dimension of size {n} "
                    f"(valid indices: {valid})")
        return f"{label}: index {value} is out of range for {c.what} (size {n}; valid {valid})"

    def _varying(self, feeds: Mapping[str, np.ndarray]) -> dict[int, np.ndarray]:
        """The arrays of the slots whose pointers change from run to run: the feeds and the outputs
        returned to the caller.  (:meth:`buffers` makes a view of every slot: with an unrolled LSTM's
        two thousand temporaries that cost 2.8 ms a run.)"""
        kept = self._kept()
        if kept.get("arena") is None:  # 64-byte aligned, as the plan's offsets are (a cache line, an AVX-512 vector)
            raw = np.empty(max(self.memory.arena_bytes, 1) + 64, np.uint8)
            start = -raw.ctypes.data % 64
            kept["arena"] = raw[start:start + max(self.memory.arena_bytes, 1)]
        arrays = {k: contiguous(feeds[name]) for k, name in self._feeds}
        for k in self._returned:
            last = kept.get(k)
            if last is None or sys.getrefcount(last) > 3:  # kept's reference, `last`, the argument
                last = kept[k] = np.empty(max(self.slots[k].size, 1), self.slots[k].dtype)
            arrays[k] = last
        return arrays

    def buffers(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """One array per slot: the feeds and returned outputs (:meth:`_varying`), the constants, and the
        other temporaries as views of this thread's arena."""
        arrays: list[np.ndarray | None] = [None] * len(self.slots)
        for k, a in self._varying(feeds).items():
            arrays[k] = a
        for k, a in self._consts.items():
            arrays[k] = a
        arena = self._kept()["arena"]
        for k, off in self.memory.offsets.items():
            arrays[k] = arena[off:off + self._temp_bytes[k]].view(self.slots[k].dtype)
        return arrays  # type: ignore[return-value]

    def _pointers(self, arrays: list[np.ndarray]) -> Any:
        """The slots' data pointers as this thread's ctypes array: the constants' and the arena's set
        once per thread (a numpy array's pointer costs a microsecond to read; a model has a hundred
        buffers), the feeds' and outputs' each run."""
        kept = self._kept()
        arr = kept.get("pointers")
        arena = kept.get("arena")
        if arr is None or kept.get("pointers_of") is not arena:
            base = arena.ctypes.data if arena is not None else 0
            fixed = {k: a.ctypes.data for k, a in self._consts.items()}
            fixed.update({k: base + off for k, off in self.memory.offsets.items()})
            n = len(self.slots)
            arr = (ctypes.c_void_p * max(1, n))(*[fixed.get(k, 0) for k in range(n)])
            kept["pointers"], kept["pointers_of"] = arr, arena  # type: ignore[assignment]
            kept["varying"] = [k for k in range(n) if k not in fixed]  # type: ignore[assignment]
        for k in kept["varying"]:  # type: ignore[attr-defined]
            arr[k] = arrays[k].ctypes.data
        return arr

    def _kept(self) -> dict[Any, np.ndarray]:
        """This thread's buffers from its last run: the arena, and the outputs (a thread runs one model
        at a time).  Fresh multi-megabyte arrays on every run cost page faults: a depthwise convolution
        at 112x112 ran 0.78 ms on kept buffers and 1.87 ms on fresh ones."""
        kept = getattr(self._tls, "kept", None)
        if kept is None:
            kept = self._tls.kept = {}
        return kept
