"""``cuvil bench [model.onnx ...]``: whole models beside onnxruntime.

For each model it prints

- the compile time with a cold kernel cache and again with that cache warm (each in a fresh Python
  process, so neither reuses the other's in-memory kernels; the cache is a temporary directory),
- the static memory plan: the arena the intermediate buffers share against the sum of all of them
  (what one allocation per buffer would take),
- at each thread count, the median latency of cuvil and of onnxruntime in this process, both limited
  to that many threads (cuvil: ``cuvil.set_num_threads``; onnxruntime: ``intra_op_num_threads``,
  one inter-op thread), timed in interleaved rounds, and the ratio onnxruntime / cuvil (> 1: cuvil
  is faster),
- how many kernels fell back to a plainer schedule than planned (``CompiledGraph.fallbacks``: isl
  refused a strategy or gave up; each one is listed under the model's row),
- whether the outputs agree (rtol 1e-3, atol 1e-4 of the output's magnitude).

Inputs are random (:func:`cuvil.graph.feeds.random_feeds`: token ids within their embedding's rows)
of the shapes ``--shapes`` gives, else the declared ones (1 for a symbolic dimension); a cuvil.models.zoo
model without ``--shapes`` takes its own inputs.  With no model it runs the onnx wheel's light
models that compile in reasonable time (:data:`cuvil.models.resolve.LIGHT`) and ResNet-18, MobileNetV2, the BERT-style
encoder and the MLP of :mod:`cuvil.models.zoo`::

    cuvil bench                              # the default set
    cuvil bench model.onnx --threads 1,2     # one model
    cuvil bench bert.onnx --shapes input_ids=4,128 mask=4,128   # random inputs of these shapes
    cuvil bench --models resnet18,light_squeezenet --no-cold
    cuvil bench resnet18 --threads 1 --profile 8    # and its 8 slowest kernel calls (cuvil.graph.profile)
    cuvil bench resnet18 --tuning-db tuned.db        # kernels replayed from `cuvil tune` records

With ``--tuning-db`` the cuvil column is the model compiled with the database's best schedules
(``InferenceSession(..., tuning_db=)``), and the untuned compilation is timed in the same rounds
(column "untuned"): what the tuning bought, end to end.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class ModelResult:
    """What ``cuvil bench`` measured for one model."""

    name: str
    nodes: int = 0
    calls: int = 0
    kernels: int = 0
    compile_cold_s: float | None = None
    compile_warm_s: float | None = None
    compile_here_s: float = 0.0  # in this process (with the warm cache unless --no-cold)
    arena_bytes: int = 0
    total_bytes: int = 0
    latency: dict[int, tuple[float, float]] = field(default_factory=dict)  # threads -> (cuvil s, ort s)
    max_err: float = 0.0
    ok: bool = True
    error: str = ""
    profile: str = ""  # the slowest kernel calls at the first thread count (--profile)
    untuned: dict[int, float] = field(default_factory=dict)  # with a tuning database: threads -> untuned s
    fallbacks: list[str] = field(default_factory=list)  # kernels that took a plainer schedule (prog.fallbacks)


# -- compiling ------------------------------------------------------------------------------------


def compile_model(path: str, feeds: dict[str, np.ndarray], options: Any = None, tuning_db: Any = None) -> Any:
    """The model at ``path`` compiled as an InferenceSession compiles it (:class:`cuvil.graph.driver.ModelCompiler`:
    graph passes, then one kernel per node group) for the shapes of ``feeds``; specialised on the values of
    inputs that decide a shape; with ``tuning_db``, each kernel with a record replays its best schedule.
    ``options``: a :class:`cuvil.options.CompileOptions` or a target string.  Returns (the prepared graph,
    the program)."""
    from cuvil.frontend.onnx import import_model
    from cuvil.graph.driver import ModelCompiler
    from cuvil.options import CompileOptions

    mc = ModelCompiler(import_model(path), CompileOptions.of(options, tuning_db=tuning_db))
    return mc.graph, mc.for_feeds(feeds)


def _child() -> None:
    """In a fresh process: compile ``argv[1]`` for the inputs in ``argv[2]`` (.npz), print the seconds."""
    path, npz = sys.argv[1], sys.argv[2]
    with np.load(npz) as z:
        feeds = {k: z[k] for k in z.files}
    t0 = time.perf_counter()
    compile_model(path, feeds)
    print("CUVIL_BENCH " + json.dumps({"compile_s": time.perf_counter() - t0}))


def _compile_in_child(path: str, npz: str, cache: str) -> float:
    env = dict(os.environ, CUVIL_CACHE_DIR=cache)
    code = "from cuvil.bench.models import _child; _child()"
    proc = subprocess.run([sys.executable, "-c", code, path, npz], env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("CUVIL_BENCH "):
            return float(json.loads(line[len("CUVIL_BENCH "):])["compile_s"])
    from cuvil.errors import CuvilError

    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    raise CuvilError(f"compiling {path} in a child process failed: {tail[0]}")


# -- timing ---------------------------------------------------------------------------------------


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as benchmarks print them."""
    return ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"


def _ort_session(path: str, threads: int) -> Any:
    import onnxruntime as ort  # type: ignore[import-not-found]

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def _compare(ours: dict[str, np.ndarray], ref: list[np.ndarray], names: list[str]) -> tuple[bool, float]:
    ok, worst = True, 0.0
    for n, r in zip(names, ref):
        y = ours[n]
        if y.shape != r.shape:
            return False, math.inf
        scale = float(np.max(np.abs(r))) if r.size else 0.0
        if r.dtype.kind == "f":
            err = float(np.max(np.abs(y.astype(np.float64) - r))) if r.size else 0.0
            worst = max(worst, err / scale if scale else err)
            ok &= bool(np.allclose(y, r, rtol=1e-3, atol=1e-4 * max(scale, 1.0)))
        else:
            ok &= bool(np.array_equal(y, r))
    return ok, worst


def bench_one(name: str, threads: list[int], cold: bool = True, rounds: int = 5, budget_s: float = 0.3,
              profile_top: int = 0, tuning_db: str | None = None,
              shapes: dict[str, tuple[int, ...]] | None = None) -> ModelResult:
    """Measure one model (see the module docstring)."""
    import cuvil
    from cuvil.bench.ops import SETTLE_S, median_time
    from cuvil.models.resolve import resolve_inputs

    res = ModelResult(name)
    with tempfile.TemporaryDirectory(prefix="cuvil-bench-") as work:
        res.name, path, feeds = resolve_inputs(name, work, shapes)
        if cold:
            npz = os.path.join(work, "feeds.npz")
            np.savez(npz, **feeds)
            cache = os.path.join(work, "kernels")
            res.compile_cold_s = _compile_in_child(path, npz, cache)
            res.compile_warm_s = _compile_in_child(path, npz, cache)
            os.environ["CUVIL_CACHE_DIR"], saved = cache, os.environ.get("CUVIL_CACHE_DIR")
        t0 = time.perf_counter()
        try:
            graph, prog = compile_model(path, feeds, tuning_db=tuning_db)
            res.compile_here_s = time.perf_counter() - t0
            base = compile_model(path, feeds)[1] if tuning_db else None  # the untuned program beside it
        finally:
            if cold:
                if saved is None:
                    del os.environ["CUVIL_CACHE_DIR"]
                else:
                    os.environ["CUVIL_CACHE_DIR"] = saved
        res.nodes, res.calls, res.kernels = len(graph.nodes), prog.n_calls, prog.n_kernels
        res.fallbacks = [str(f) for f in prog.fallbacks]
        res.arena_bytes, res.total_bytes = prog.memory.arena_bytes, prog.memory.total_bytes
        names = [v.name for v in graph.outputs]
        run_feeds = {n: a for n, a in feeds.items() if n in {v.name for v in graph.feeds}}
        for t in threads:
            ort_sess = _ort_session(path, t)
            cuvil.set_num_threads(t)
            try:
                ref = ort_sess.run(names, feeds)
                for p in [prog] + ([base] if base is not None else []):  # the untuned one is checked too
                    ok, err = _compare(p.run(run_feeds), ref, names)
                    res.ok &= ok
                    res.max_err = max(res.max_err, err)
                runs = [lambda: prog.run(run_feeds), lambda s=ort_sess: s.run(names, feeds)]
                if base is not None:
                    runs.append(lambda: base.run(run_feeds))
                times: list[list[float]] = [[] for _ in runs]
                for r in range(rounds):  # interleaved, each round starting with the next one
                    for k in [(r + j) % len(runs) for j in range(len(runs))]:
                        if t > 1:  # the other one's idle threads stop spinning first (see cuvil.bench.ops.interleaved)
                            time.sleep(SETTLE_S)
                        times[k].append(median_time(runs[k], repeat=3, budget_s=budget_s))
                res.latency[t] = (float(np.median(times[0])), float(np.median(times[1])))
                if base is not None:
                    res.untuned[t] = float(np.median(times[2]))
                if profile_top and not res.profile:
                    from cuvil.graph.profile import profile

                    res.profile = f"{res.name} at {t} thread(s):\n" + profile(prog, run_feeds).table(profile_top)
            finally:
                cuvil.set_num_threads(None)
    return res


# -- the table ------------------------------------------------------------------------------------


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.1f}"


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}s"


def header(threads: list[int], tuned: bool = False) -> str:
    cols = "".join(f"{f'{t}T cuvil':>11}{'ort':>9}{'ratio':>7}" + (f"{'untuned':>10}" if tuned else "")
                   for t in threads)
    return (f"{'model':<20}{'nodes->calls(kernels)':>22}{'cold':>8}{'warm':>7}{'here':>7}"
            f"{'arena/sum MiB':>15}{cols}{'fallbacks':>10}  check")


def row(r: ModelResult, threads: list[int]) -> str:
    if r.error:
        return f"{r.name:<20}  {r.error}"
    cols = ""
    for t in threads:
        ours, theirs = r.latency.get(t, (math.nan, math.nan))
        cols += f"{ours * 1e3:>9.2f}ms{theirs * 1e3:>7.2f}ms{theirs / ours:>7.2f}"
        if t in r.untuned:
            cols += f"{r.untuned[t] * 1e3:>8.2f}ms"
    shape = f"{r.nodes}->{r.calls}({r.kernels})"
    check = f"ok ({r.max_err:.1e})" if r.ok else f"MISMATCH ({r.max_err:.1e})"
    return (f"{r.name:<20}{shape:>22}{_fmt_s(r.compile_cold_s):>8}{_fmt_s(r.compile_warm_s):>7}"
            f"{_fmt_s(r.compile_here_s):>7}{_mib(r.arena_bytes) + '/' + _mib(r.total_bytes):>15}{cols}"
            f"{len(r.fallbacks):>10}  {check}")


def run(models: list[str], threads: list[int], cold: bool = True, rounds: int = 5, profile_top: int = 0,
        tuning_db: str | None = None, shapes: dict[str, tuple[int, ...]] | None = None) -> int:
    """Benchmark ``models`` (default: :func:`cuvil.models.resolve.default_models`) and print one row each; 1 if
    any failed."""
    import cuvil
    from cuvil.errors import CuvilError
    from cuvil.models.resolve import default_models

    try:
        import onnxruntime  # noqa: F401  # type: ignore[import-not-found]
    except ImportError:
        print("cuvil bench needs onnxruntime (pip install onnxruntime)", file=sys.stderr)
        return 1
    models = models or default_models()
    tgt = cuvil.Target("llvm")
    print(f"cuvil {cuvil.__version__} on {tgt.triple} {tgt.cpu}, {os.cpu_count()} cores, load {load_average()}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}; compile: cold and warm kernel cache "
          "(fresh processes), here (this process); latency: medians of interleaved rounds; ratio = ort / cuvil")
    if tuning_db:
        print(f"cuvil: kernels replayed from the tuning database {tuning_db} (untuned: compiled without it)")
    print(header(threads, bool(tuning_db)), flush=True)
    failed = False
    profiles = []
    for name in models:
        try:
            r = bench_one(name, threads, cold=cold, rounds=rounds, profile_top=profile_top, tuning_db=tuning_db,
                          shapes=shapes)
        except (CuvilError, OSError, ValueError) as exc:
            r = ModelResult(name, error=f"{type(exc).__name__}: {exc}")
        failed |= bool(r.error) or not r.ok
        print(row(r, threads), flush=True)
        for f in r.fallbacks:  # counted in the row; each one named under it
            print(f"    fallback: {f}", flush=True)
        profiles.append(r.profile)
    for text in filter(None, profiles):
        print(f"\n{text}")
    return 1 if failed else 0
