"""What the tuner's worker processes run: building a candidate's library, and checking and timing libraries.

:mod:`cuvil.autotune.measure` starts them as fresh interpreters, ``python -m cuvil.autotune.worker FD``
(:func:`main`; FD is its end of a socket pair), in two roles: ``_builder_main`` (one per core; it
unpickles the te program once and builds each configuration it is sent) and ``_runner_main`` (one
process: loads each library with :func:`cuvil.runtime.load`, runs it on the tuner's inputs, compares the
output with the reference and times it).  Timing: a warm-up call, then rounds of ``number`` calls (a
run of at least ``min_run_s``), each after writing a buffer larger than the last-level cache, the
candidate in turns with the untuned schedule; medians.  The final round of a tuning run times several
libraries against each other the same way (:func:`_final_round`).
"""

from __future__ import annotations

import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from cuvil.autotune.space import Config


def build_library(args: Sequence[Any], target: str, config: Config, path: str, trial: int) -> tuple[str, dict]:
    """The default build function: auto_schedule with the knobs, lower, compile, export ``path``.

    Returns the schedule's trace (JSON) and a summary of the loop IR."""
    from cuvil.pipeline import lower
    from cuvil.runtime.module import Module
    from cuvil.schedule.auto import auto_schedule
    from cuvil.schedule.trace import trace_to_json

    class _ExportOnly(Module):  # compile and export; no JIT in the builder
        def _jit(self) -> None:
            pass

    s = auto_schedule(list(args), target, knobs=config)
    func = lower(s, list(args))
    _ExportOnly(func, target).export_library(path)
    return trace_to_json(s.trace), loop_summary(func)


def call_module(module: Any, arrays: Sequence[Any], trial: int) -> None:
    """The default call function of the runner."""
    module(*arrays)


def loop_summary(func: Any) -> dict[str, Any]:
    """Counts and extents of the loops of a lowered function, by kind (kept with each record)."""
    from cuvil.ir.stmt import Allocate, Block, For, If, LetStmt, Store

    out: dict[str, Any] = {"loops": 0, "depth": 0, "stores": 0}
    stack: list[tuple[Any, int]] = [(func.body, 0)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, For):
            out["loops"] += 1
            out["depth"] = max(out["depth"], d + 1)
            if x.kind != "serial":
                ext = getattr(x.extent, "value", None)
                out.setdefault(x.kind, []).append(int(ext) if isinstance(ext, int) else -1)
            stack.append((x.body, d + 1))
        elif isinstance(x, Block):
            stack.extend((s, d) for s in x.stmts)
        elif isinstance(x, (LetStmt, Allocate)):
            stack.append((x.body, d))
        elif isinstance(x, If):
            stack.extend((b, d) for b in (x.then_body, x.else_body) if b is not None)
        elif isinstance(x, Store):
            out["stores"] += 1
    return out


def _new_tensor() -> Any:
    from cuvil.te.tensor import Tensor

    return Tensor.__new__(Tensor)


def _set_tensor(t: Any, state: tuple[Any, ...]) -> None:
    for k, v in zip(("op", "shape", "dtype", "name"), state):
        object.__setattr__(t, k, v)


class _ProgramPickler(pickle.Pickler):
    """Pickles a te program: tensors are immutable (no ``__setattr__``), so their state is set afterwards,
    which also lets an operation and its output tensor refer to each other."""

    def reducer_override(self, obj: Any) -> Any:
        from cuvil.te.tensor import Tensor

        if type(obj) is Tensor:
            return _new_tensor, (), (obj.op, obj.shape, obj.dtype, obj.name), None, None, _set_tensor
        return NotImplemented


def dump_program(args: Sequence[Any]) -> bytes:
    """``args`` (a te program's arguments) as bytes a worker process can load with ``pickle.loads``."""
    import io

    buf = io.BytesIO()
    _ProgramPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(list(args))
    return buf.getvalue()


def _requests(conn: Connection) -> Iterator[Any]:
    """The requests a worker process receives, until the parent sends None or goes away."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        yield msg


def _builder_main(conn: Connection, payload: bytes, target: str, build_fn: Callable[..., Any]) -> None:
    args = pickle.loads(payload)
    for trial, config, path in _requests(conn):
        t0 = time.perf_counter()
        try:
            trace, feats = build_fn(args, target, config, path, trial)
            conn.send(("ok", trace, feats, "", time.perf_counter() - t0))
        except Exception as exc:  # a refused or broken candidate: report it, keep serving
            conn.send(("error", "[]", {}, f"{type(exc).__name__}: {exc}", time.perf_counter() - t0))


def _runner_main(conn: Connection, threads: int, flush_bytes: int, call_fn: Callable[..., Any]) -> None:
    os.environ["CUVIL_NUM_THREADS"] = str(threads)
    from cuvil.runtime import load
    from cuvil.runtime.threads import set_num_threads

    set_num_threads(threads)
    flush = np.zeros(max(1, flush_bytes // 8), dtype=np.float64)
    inputs: list[Any] = []
    specs: list[tuple[tuple[int, ...], str]] = []
    ref: list[np.ndarray] | None = None
    ref_mod: Any = None
    ref_arrays: list[Any] = []
    for msg in _requests(conn):
        kind = msg[0]
        try:
            if kind == "inputs":
                _, inputs, specs, ref, ref_path = msg
                inputs = [_placed(a.shape, a.dtype, a) for a in map(np.asarray, inputs)]
                ref_mod = load(ref_path) if ref_path else None
                ref_arrays = [*inputs, *_blank(specs)]
                conn.send(("ok", None, ""))
                continue
            if kind == "final":
                _, entries, opts = msg
                loaded = [(load(path), [*inputs, *_blank(specs)], trial) for path, trial in entries]
                conn.send(("ok", _final_round(loaded, call_fn, flush, opts, ref or []), ""))
                continue
            _, path, trial, opts = msg
            mod = load(path)
            outs = _blank(specs)
            arrays = [*inputs, *outs]
            call_fn(mod, arrays, trial)
            if kind == "reference":
                conn.send(("ok", outs, ""))
                continue
            err = _mismatch(outs, ref or [])
            if err:
                conn.send(("wrong", None, err))
                continue
            pair = (ref_mod, ref_arrays) if ref_mod is not None else None
            conn.send(("ok", _time(mod, arrays, trial, call_fn, flush, opts, pair), ""))
        except Exception as exc:
            conn.send(("error", None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))


def _mismatch(outs: Sequence[np.ndarray], ref: Sequence[np.ndarray]) -> str:
    for k, (o, r) in enumerate(zip(outs, ref)):
        if o.shape != r.shape:
            return f"output {k}: shape {o.shape}, reference {r.shape}"
        if o.dtype.kind == "f":
            scale = float(np.max(np.abs(r))) if r.size else 0.0
            if np.isnan(o).sum() != np.isnan(r).sum():
                return f"output {k}: NaN where the reference has none (elements left unwritten?)"
            diff = np.abs(o.astype(np.float64) - r.astype(np.float64))
            err = float(np.nanmax(diff)) / max(scale, 1e-30) if diff.size else 0.0
            tol = 1e-4 if o.dtype.itemsize <= 4 else 1e-10
            if err > tol:
                return f"output {k}: max relative error {err:.2e} against the untuned schedule (limit {tol:g})"
        elif not np.array_equal(o, r):
            return f"output {k}: differs from the untuned schedule's output"
    return ""


def _blank(specs: Sequence[tuple[tuple[int, ...], str]]) -> list[np.ndarray]:
    """Output arrays pre-filled with NaN (0 for integers), so an element a candidate leaves unwritten shows."""
    return [_placed(shape, dt, np.nan if np.dtype(dt).kind == "f" else 0) for shape, dt in specs]


PLACE_OFFSET = 16  # bytes past a page boundary: where numpy's large arrays start (glibc's mmap chunk header)


def _placed(shape: Sequence[int], dtype: Any, fill: Any) -> np.ndarray:
    """An array of ``shape`` filled with ``fill`` (an array or a scalar), starting :data:`PLACE_OFFSET` bytes
    past a page boundary, as a large array a user's numpy allocates does.  Where an operand sits decides
    split loads and 4K aliasing with the other operands: unpickled here, the inputs sat 2336 bytes past a
    page, and an A^T B^T 512^3 schedule reading one unpacked timed 1.3x faster in the runner than in the
    user's process; placed alike, every candidate sees the layout the user's arrays will have."""
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    raw = np.empty(nbytes + 4096 + PLACE_OFFSET, np.uint8)
    start = (PLACE_OFFSET - raw.ctypes.data) % 4096
    out = raw[start:start + nbytes].view(dt).reshape(shape)
    out[...] = fill
    return out


def _timed(call_fn: Callable[..., Any], flush: np.ndarray | None, mod: Any, arrays: list[Any], trial: int,
           n: int) -> float:
    """Seconds per call of ``n`` calls, after touching a buffer larger than the last-level cache (``flush``)."""
    if flush is not None:
        np.add(flush, 1.0, out=flush)
    t0 = time.perf_counter()
    for _ in range(n):
        call_fn(mod, arrays, trial)
    return (time.perf_counter() - t0) / n


def _number(warm: Sequence[float], opts: dict[str, Any]) -> int:
    """Calls per timed run, one count for all the libraries compared: enough for ``min_run_s`` seconds of the
    fastest (by a call with warm caches; a timer's resolution and jitter stay small), but at most 10x that for
    the slowest.  One count, because each run's first call after the flush is cold: with counts that differ,
    the one timed with fewer calls carries more of that cost (a 128^3 candidate 1.5x slower than the untuned
    schedule measured 1.5x faster when its count came from a cold call)."""
    min_run = float(opts.get("min_run_s", 0.01))
    n = int(min_run / max(min(warm), 1e-9))
    return max(1, min(1000, n, int(10 * min_run / max(max(warm), 1e-9))))


def _final_round(entries: list[tuple[Any, list[Any], int]], call_fn: Callable[..., Any], flush: np.ndarray,
                 opts: dict[str, Any], ref: Sequence[np.ndarray]) -> list[tuple[str, float | None, float | None, str]]:
    """The end of a tuning run: ``entries`` (module, arrays, trial; the first is the untuned schedule) timed
    against each other in the same process.

    Each entry is called and checked again (the warm-up) and called once more with warm caches (its count of
    calls per run: :func:`_number`); then ``rounds`` rounds in which every entry is timed once, after a cache
    flush and one untimed call (the steady state of a kernel called in a loop, as the user's process and
    numpy's timing see it: timed straight after the flush, a 1024^3 matmul carries ~5% of cold misses, as
    much as finalists differ by), each round starting at the next entry.  Per entry: status, median seconds
    per call, the median over rounds of its time divided by the untuned schedule's in the same round, and
    an error."""
    warm: dict[int, float] = {}
    errors: list[str] = []
    for k, (mod, arrays, trial) in enumerate(entries):
        _timed(call_fn, flush, mod, arrays, trial, 1)
        errors.append(_mismatch(arrays[len(arrays) - len(ref):], ref) if ref else "")
        warm[k] = _timed(call_fn, None, mod, arrays, trial, 1)
    live = [k for k, e in enumerate(errors) if not e]
    number = _number([warm[k] for k in live], opts) if live else 1
    per_round = sum(warm[k] * number for k in live)
    rounds = max(3, min(int(opts.get("rounds", 15)), int(float(opts.get("budget_s", 10.0)) / max(per_round, 1e-9))))
    times: dict[int, list[float]] = {k: [] for k in live}
    for r in range(rounds):
        for k in live[r % len(live):] + live[: r % len(live)] if live else []:
            mod, arrays, trial = entries[k]
            _timed(call_fn, flush, mod, arrays, trial, 1)  # from a flushed cache, then warm: as in a user's loop
            times[k].append(_timed(call_fn, None, mod, arrays, trial, number))
    base = times.get(0)
    out: list[tuple[str, float | None, float | None, str]] = []
    for k in range(len(entries)):
        if errors[k]:
            out.append(("wrong", None, None, errors[k]))
            continue
        ratio = float(np.median([t / b for t, b in zip(times[k], base)])) if base else None
        out.append(("ok", float(np.median(times[k])), ratio, ""))
    return out


def _time(mod: Any, arrays: list[Any], trial: int, call_fn: Callable[..., Any], flush: np.ndarray,
          opts: dict[str, Any], ref: tuple[Any, list[Any]] | None = None) -> tuple[float, float | None]:
    """Median seconds per call, and the median ratio to the reference (the untuned schedule) timed in turns.

    After the checked call (the warm-up), ``repeat`` rounds: each round flushes the caches (writes a buffer
    larger than the last-level cache), calls the reference once and times ``number`` more calls of it, then
    does the same for the candidate (every other round the candidate first): the steady state of a kernel
    called in a loop, as the final round (:func:`_final_round`) and the user's process see it.  (Timed
    straight after the flush, a run's first call is cold: the A^T B^T 512^3 matmul's candidates, 3 MiB
    of operands, ranked by cold calls measured 1.35x the untuned schedule in-run and 1.04x in the final
    round, and the search chased them.)  The ratio of each round compares the two under the
    same load, which on a shared machine changes faster than a batch; a candidate far slower than the best so
    far gets two rounds, one that looks close to it or better twice ``repeat``."""

    def run(m: Any, a: list[Any], t: int, n: int) -> float:
        _timed(call_fn, flush, m, a, t, 1)  # from a flushed cache, then warm: as the final round times it
        return _timed(call_fn, None, m, a, t, n)

    first = _timed(call_fn, None, mod, arrays, trial, 1)  # warm: the checked call came just before
    ref_first = _timed(call_fn, None, ref[0], ref[1], -1, 1) if ref is not None else None
    number = ref_number = _number([first] + ([ref_first] if ref_first else []), opts)
    repeat = int(opts.get("repeat", 5))
    best = opts.get("best_rel")
    if best is not None and ref_first and first / ref_first > 3.0 * best:
        repeat = min(repeat, 2)  # clearly worse: a rough time is enough
    elif best is not None and ref_first and first / ref_first < 1.1 * best:
        repeat *= 2  # a contender for the best: the best of many noisy times is optimistic, so time it longer
    per_round = first * number + (ref_first or 0.0) * ref_number
    repeat = max(1, min(repeat, int(float(opts.get("budget_s", 2.0)) / max(per_round, 1e-9))))
    times, ratios = [], []
    for k in range(repeat):  # the two take turns going first (the second of a pair ran ~10% faster here)
        r = run(ref[0], ref[1], -1, ref_number) if ref is not None and k % 2 == 0 else None
        t = run(mod, arrays, trial, number)
        if ref is not None and k % 2:
            r = run(ref[0], ref[1], -1, ref_number)
        times.append(t)
        if r:
            ratios.append(t / r)
    return float(np.median(times)), (float(np.median(ratios)) if ratios else None)


def main(argv: Sequence[str] | None = None) -> None:
    """A worker process: ``python -m cuvil.autotune.worker FD``.  The first message on the connection FD is
    the parent's import path, the role ("builder" or "runner") and its arguments, pickled; then the role's
    loop serves requests until the parent sends None or goes away."""
    fd = int((argv if argv is not None else sys.argv[1:])[0])
    conn = Connection(fd)
    try:
        path, role, args = conn.recv()
    except (EOFError, OSError):
        return
    sys.path[:] = path  # build_fn / call_fn import by name, as in the parent
    entry = {"builder": _builder_main, "runner": _runner_main}[role]
    try:
        entry(conn, *pickle.loads(args))
    except (BrokenPipeError, ConnectionResetError):  # the tuner went away mid-request (killed): nothing to say
        pass


if __name__ == "__main__":
    main()
