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

from cuvil.cache import BoundedCache

_KERNEL = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)  # k_checked


def contraction_flops(args: list[Any]) -> tuple[float, str]:
    """The work of a kernel's contractions (the sums of products among the te operations behind
    ``args``): 2 x their multiply-adds, a packed dot product counting each of its products, and the
    kind of those products (``"fp32"``, ``"int8"``, ``"bf16"``; ``""`` without a contraction).  A
    Winograd convolution counts its tile contraction, fewer than the direct convolution's."""
    from cuvil.ir.expr import DOT2_BF16, DOT2_I16, DOT4_KINDS, Cast
    from cuvil.schedule.axes import const_int
    from cuvil.schedule.contraction import product_operands
    from cuvil.te.tensor import ComputeOp, Tensor

    seen: set[int] = set()
    todo = [a.op for a in args if isinstance(a, Tensor)]
    total, kind = 0.0, ""
    while todo:
        op = todo.pop()
        if id(op) in seen:
            continue
        seen.add(id(op))
        todo.extend(t.op for t in op.input_tensors)
        if not isinstance(op, ComputeOp) or not op.reduce_axis or product_operands(op.body) is None:
            continue
        ext = [const_int(a.extent) for a in (*op.axis, *op.reduce_axis)]
        if any(e is None for e in ext):
            continue
        src = op.body.source
        while isinstance(src, Cast):
            src = src.value
        name = getattr(src, "name", "")  # a packed dot product counts each of its products
        per = 4 if name in DOT4_KINDS else 2 if name in (DOT2_I16, DOT2_BF16) else 1
        total += 2.0 * per * math.prod(ext)  # type: ignore[arg-type]
        kind = kind or ("bf16" if name == DOT2_BF16 else "int8" if per > 1 else
                        "fp32" if op.dtype == "float32" else op.dtype)
    return total, kind


@dataclass(frozen=True)
class CallTime:
    """One kernel call: what it computes (ops and first node), its buffers' shapes and median seconds,
    and its contractions' work (:func:`contraction_flops`)."""

    index: int
    label: str
    shapes: str
    seconds: float
    flops: float = 0.0
    kind: str = ""
    bytes: float = 0.0  # the sizes of its buffers (inputs and outputs): the least memory traffic it can have


@dataclass(frozen=True)
class Profile:
    calls: tuple[CallTime, ...]
    run_seconds: float  # one whole run (all calls in one native call), median
    peak: float = 0.0  # float32 flop/s of the cores the run uses (measured: cuvil.codegen.calibrate), 0: unknown
    bandwidth: float = 0.0  # bytes/s a streaming copy reaches on those cores (measured: stream_bandwidth), 0: unknown

    def efficiency(self, c: CallTime) -> tuple[float, str] | None:
        """How close call ``c`` comes to the machine's limit: (its float32 FLOP rate / the peak, "peak") for a
        float32 contraction, else (its buffers' bytes per second / the streaming bandwidth, "bandwidth");
        None when the limit is unknown or the call took no time."""
        if not c.seconds:
            return None
        if c.kind == "fp32" and c.flops:
            return (c.flops / c.seconds / self.peak, "peak") if self.peak else None
        return (c.bytes / c.seconds / self.bandwidth, "bandwidth") if self.bandwidth and c.bytes else None

    def gaps(self, below: float = 0.5) -> list[tuple[CallTime, float, str]]:
        """The calls below ``below`` of their limit (:meth:`efficiency`), the longest first: where the next
        speed-up is."""
        out = []
        for c in self.calls:
            e = self.efficiency(c)
            if e is not None and e[0] < below:
                out.append((c, *e))
        return sorted(out, key=lambda g: -g[0].seconds)

    def gaps_table(self, top: int | None = None, below: float = 0.5) -> str:
        """:meth:`gaps` as lines: share of the calls' time, the fraction of the limit, the call."""
        total = self.total or 1.0
        rows = self.gaps(below)
        lines = [f"  {c.seconds / total:>6.1%} of the time at {e:>4.0%} of the {what:<9}  #{c.index} {c.label} "
                 f"{c.shapes}" for c, e, what in rows[:top]]
        share = sum(c.seconds for c, _, _ in rows) / total
        head = (f"kernels below {below:.0%} of the peak (contractions) or of the bandwidth (the rest): {len(rows)} "
                f"calls, {share:.0%} of the calls' time")
        return "\n".join([head, *lines])

    def contractions(self) -> tuple[float, float]:
        """(flops, seconds) of the calls with float32 contractions: their aggregate rate is flops / seconds."""
        fp = [c for c in self.calls if c.kind == "fp32" and c.flops]
        return sum(c.flops for c in fp), sum(c.seconds for c in fp)

    def summary(self) -> str:
        """One line: the float32 contractions' FLOPs over their time, and the share of the peak that is."""
        flops, secs = self.contractions()
        if not secs:
            return "no float32 contraction"
        rate = flops / secs
        peak = f", {rate / self.peak:.0%} of the measured peak {self.peak / 1e9:.0f} GFLOP/s" if self.peak else ""
        return (f"float32 contractions: {flops / 1e9:.2f} GFLOP in {secs * 1e3:.2f} ms = {rate / 1e9:.1f} GFLOP/s"
                f"{peak} ({secs / (self.total or 1.0):.0%} of the calls' time)")

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
        lines = [f"{'#':>4} {'us':>9} {'share':>6} {'GF/s':>7} {'peak':>5}  {'op':<40} shapes"]
        for c in rows:
            rate = c.flops / c.seconds if c.flops and c.seconds else 0.0
            gf = f"{rate / 1e9:>7.1f}" if rate else f"{'-':>7}"
            pk = f"{rate / self.peak:>5.0%}" if rate and self.peak and c.kind == "fp32" else f"{'-':>5}"
            lines.append(f"{c.index:>4} {c.seconds * 1e6:>9.1f} {c.seconds / total:>6.1%} {gf} {pk}  "
                         f"{c.label:<40} {c.shapes}")
        lines.append(f"sum of calls {self.total * 1e3:.2f} ms, whole run {self.run_seconds * 1e3:.2f} ms, "
                     f"{len(self.calls)} calls")
        lines.append(self.summary())
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
    work = getattr(prog, "call_flops", None) or [(0.0, "")] * prog.n_calls
    out = []
    for k, label, kernel, one in _entries(prog, arrays):
        bufs = _buffers(funcs[kernel])
        shapes = " ".join("x".join(str(getattr(d, "value", d)) for d in b.shape) for b in bufs)
        size = sum(math.prod(int(getattr(d, "value", 1)) for d in b.shape) * np.dtype(b.dtype).itemsize for b in bufs)
        out.append(CallTime(k, label, shapes, _median(one, repeat), *work[k], bytes=float(size)))
    return Profile(tuple(out), run_s, _peak(prog.target), stream_bandwidth(prog.target))


# (canonical target, threads) -> bytes/s: a process profiles on one machine, at a few thread counts
_BANDWIDTH: BoundedCache[tuple[str, int], float] = BoundedCache("cuvil.graph.profile._BANDWIDTH", 16)


def stream_bandwidth(target: Any = "llvm", mib: int = 64) -> float:
    """Bytes per second a copy of ``mib`` MiB of float32 (compiled by cuvil: vector loops, parallel over the
    session's threads) moves, reads and writes counted: the bandwidth a memory-bound kernel can reach.
    Measured once per process, target and thread count (the fastest of a few copies); 0.0 when the
    target is not this machine."""
    import cuvil
    from cuvil import te
    from cuvil.runtime.threads import get_num_threads
    from cuvil.target import Target

    tgt = Target(target)
    key = (tgt.canonical, get_num_threads())
    if key not in _BANDWIDTH:
        if not tgt.is_host:
            return 0.0
        n = mib * 1024 * 1024 // 4
        x = te.placeholder((n,), name="x")
        y = te.compute((n,), lambda i: x[i], name="y")
        mod = cuvil.build(cuvil.auto_schedule([x, y], tgt), [x, y], tgt)
        a, b = np.ones(n, np.float32), np.empty(n, np.float32)
        best = math.inf
        for _ in range(5):
            t0 = time.perf_counter()
            mod(a, b)
            best = min(best, time.perf_counter() - t0)
        _BANDWIDTH[key] = 2 * 4 * n / best
    return _BANDWIDTH[key]


def _peak(target: Any) -> float:
    """The float32 peak of the cores a run uses (the session's threads; see cuvil.codegen.calibrate)."""
    from cuvil.codegen.calibrate import fma_peak
    from cuvil.runtime.threads import get_num_threads

    try:
        return fma_peak(target) * max(1, get_num_threads())
    except Exception:  # noqa: BLE001 - a profile without a peak still says where the time goes
        return 0.0


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
