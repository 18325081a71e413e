"""Where a compiled model's time goes: each kernel call timed on its own, on the run's buffers.

    prog = compile_graph(graph, {"x": (1, 3, 224, 224)}, {})
    prof = prog.profile({"x": x})        # or profile(prog, feeds)
    print(prof)                           # one row per call, slowest first

The model runs once (so every buffer holds the values a real run sees), then each call's kernel is
called alone through its native entry point in the linked module (the same machine code the whole
run uses, at the session's thread count) and timed by its median.  A kernel timed alone finds its
inputs in cache more often than inside a run, so the sum of the rows is usually a little below the
time of a whole run, which the table prints for comparison.
"""

from __future__ import annotations

import ctypes
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

_KERNEL = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)  # k_checked


@dataclass(frozen=True)
class CallTime:
    """One kernel call: what it computes (ops and first node), its buffers' shapes and median seconds."""

    index: int
    label: str
    shapes: str
    seconds: float


@dataclass(frozen=True)
class Profile:
    calls: tuple[CallTime, ...]
    run_seconds: float  # one whole run (all calls in one native call), median

    @property
    def total(self) -> float:
        return sum(c.seconds for c in self.calls)

    def by_op(self) -> dict[str, float]:
        """Seconds per op pattern (``Conv+Add+Relu``), summed over calls."""
        out: dict[str, float] = {}
        for c in self.calls:
            key = c.label.split(" ")[0]
            out[key] = out.get(key, 0.0) + c.seconds
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def table(self, top: int | None = None) -> str:
        total = self.total or 1.0
        rows = sorted(self.calls, key=lambda c: -c.seconds)[:top]
        lines = [f"{'#':>4} {'us':>9} {'share':>6}  {'op':<40} shapes"]
        for c in rows:
            lines.append(f"{c.index:>4} {c.seconds * 1e6:>9.1f} {c.seconds / total:>6.1%}  {c.label:<40} {c.shapes}")
        lines.append(f"sum of calls {self.total * 1e3:.2f} ms, whole run {self.run_seconds * 1e3:.2f} ms, "
                     f"{len(self.calls)} calls")
        lines.append("by op: " + ", ".join(f"{k} {v * 1e3:.2f} ms ({v / total:.0%})" for k, v in self.by_op().items()))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _median(fn: Any, repeat: int, budget_s: float = 0.05) -> float:
    fn()
    ts: list[float] = []
    start = time.perf_counter()
    while len(ts) < repeat or (time.perf_counter() - start < budget_s and len(ts) < 200):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def _entries(prog: Any, arrays: list[np.ndarray]) -> list[tuple[int, str, str, Any]]:
    """Each kernel call of ``prog`` as (index, label, kernel name, a function that makes the call on
    ``arrays`` through the kernel's own entry point in the linked module)."""
    engine = prog.module._engine  # the linked module: each kernel keeps its own entry point
    if engine is None:
        from cuvil.errors import TargetError

        raise TargetError(f"this model was compiled for {prog.target.canonical!r}, not this machine: it cannot "
                          "be profiled here")
    pointers = [a.ctypes.data for a in arrays]
    out = []
    for k, (call, label) in enumerate(zip(prog.kernel_calls, prog.labels)):
        fn = _KERNEL(engine.get_function_address(f"{call.kernel}_checked"))
        argv = (ctypes.c_void_p * max(1, len(call.args)))(*[pointers[s] for s in call.args])

        def one(fn: Any = fn, argv: Any = argv, what: str = f"kernel call {k} ({label})", k: int = k) -> None:
            err = (ctypes.c_int64 * 3)()
            rc = fn(ctypes.addressof(argv), None, ctypes.addressof(err))
            if rc == 4:
                from cuvil.errors import BoundsError

                raise BoundsError(prog.bounds_message(k, int(err[0]), str(int(err[1]))))
            if rc:
                from cuvil.errors import CuvilError

                raise CuvilError(f"{what} failed (it could not allocate its temporary memory)")

        out.append((k, label, call.kernel, one))
    return out


def profile(prog: Any, feeds: Mapping[str, np.ndarray], repeat: int = 10) -> Profile:
    """Time every kernel call of ``prog`` (a :class:`~cuvil.graph.compiled.CompiledGraph`) on ``feeds``."""
    arrays = prog.buffers(feeds)
    run_s = _median(lambda: prog.run_buffers(arrays), repeat)
    if prog.module is None:
        return Profile((), run_s)
    funcs = {f.name: f for f in prog.kernel_funcs}
    out = []
    for k, label, kernel, one in _entries(prog, arrays):
        shapes = " ".join("x".join(str(getattr(d, "value", d)) for d in b.shape) for b in _buffers(funcs[kernel]))
        out.append(CallTime(k, label, shapes, _median(one, repeat)))
    return Profile(tuple(out), run_s)


@dataclass(frozen=True)
class CallEvent:
    """One kernel call of a timed run: when it started (``time.perf_counter()`` seconds) and took."""

    index: int
    label: str
    kernel: str
    start: float
    seconds: float


def timed_run(prog: Any, feeds: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[CallEvent]]:
    """One run of ``prog`` on ``feeds`` with every kernel call timed: the calls in order, each through
    its own entry point on the run's buffers (what a session with profiling runs).  Returns the
    outputs, as ``prog.run`` does, and one event per call."""
    arrays = prog.buffers(feeds)
    events = []
    if prog.module is not None:
        for k, label, kernel, one in _entries(prog, arrays):
            t0 = time.perf_counter()
            one()
            events.append(CallEvent(k, label, kernel, t0, time.perf_counter() - t0))
    out = {}
    for name, e in prog.outputs:
        out[name] = e.copy() if isinstance(e, np.ndarray) else arrays[e.slot][:math.prod(e.shape)].reshape(e.shape)
    return out, events


def _buffers(func: Any) -> list[Any]:
    from cuvil.ir.stmt import Buffer

    return [p for p in func.params if isinstance(p, Buffer)]
