"""``cuvil bench --registry``: the registry's real models (:mod:`cuvil.models.registry`) beside onnxruntime.

One protocol, so figures compare across sessions::

    cuvil bench --registry                                  # every model, full size, dynamo export, 1 and 2 threads
    cuvil bench --registry resnet50,gpt2 --exporter dynamo,torchscript --threads 1
    cuvil bench --registry --config ci                      # the small configurations (seconds each)
    cuvil bench --registry --threads 1 --profile 5          # and each model's 5 longest kernels below half of
                                                            # the peak (contractions) or the bandwidth (the rest)

Per model and exporter it prints:

- **cold**: the compile time in a fresh process with an empty kernel cache (wall), and the number of
  fallbacks the compile took (kernels whose planned schedule isl or the scheduler refused);
- at 1 thread: cuvil and onnxruntime called **alternately, call by call**, in this process, each
  call on fresh random inputs (floats redrawn; ids and masks kept), after warm-up calls; the median
  **process CPU time** per call and, beside it, the median wall time;
- at 2 threads: **each engine in its own process** (neither engine's thread pool shares the process
  with the other's, as when a user runs one of them), timed in blocks after a pause, the two
  processes alternated ``--rounds`` times (at least 5); median wall and CPU time per call;
- the ratio **cuvil / onnxruntime** of the medians (> 1: cuvil is slower), CPU time at 1 thread,
  wall time at 2 threads;
- above 1 thread, ``probe``: how much faster N threads ran a kernel whose threads read what another wrote
  in the call before than one thread did (:mod:`cuvil.bench.probe`; the lower of before and after the
  timing), marked LOW below half of the median this run has seen: the host then moved data between the
  vCPUs far slower than in its good periods, and the multi-thread figures of both engines say little.
  Such a timing is taken again (3 tries in all) and the one with the best probe kept;
- whether every output matches onnxruntime: ``numpy.allclose(rtol=1e-3, atol=1e-4)``.

cuvil runs untuned (no tuning database), bounds checks as shipped, through
``cuvil.onnx.InferenceSession.run(None, feeds)``; onnxruntime with default SessionOptions except
``intra_op_num_threads=N`` and ``inter_op_num_threads=1``.  The last lines give, per thread count,
the geometric mean of the ratios and the worst model, and the load average before and after.

The timing machinery is shared with ``cuvil bench --registry --torch`` (:mod:`cuvil.bench.torch`): an engine is
a :data:`Spec` (the function that loads and compiles it, by name, so a child process can build it) and, built, a
:class:`Runner`; :func:`time_together` alternates any number of them in this process, :func:`engines_apart` puts
each in a process of its own.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cuvil.bench.models import _ort_session, load_average
from cuvil.bench.probe import handoff_scaling
from cuvil.cache import BoundedCache

SETTLE_S = 0.2  # a pause before each 2-thread block: onnxruntime's pool spins for tens of ms after a run
PROBE_SETTLE_S = 1.0  # before the probes: the check's 2-thread onnxruntime session in this process spins ~1 s
PROBE_TRIES = 3  # a multi-thread timing taken while the probes were LOW is taken again, this many times in all
# threads -> the hand-off probes this process has taken (cuvil/bench/probe.py); their median is the typical one
_HANDOFFS: BoundedCache[int, list[float]] = BoundedCache("cuvil.bench.registry._HANDOFFS", 8)


@dataclass
class Result:
    """What the registry benchmark measured for one (model, exporter)."""

    model: str
    exporter: str
    compile_s: float | None = None
    fallbacks: int | None = None
    # threads -> (cuvil cpu, cuvil wall, ort cpu, ort wall), seconds per call (medians)
    latency: dict[int, tuple[float, float, float, float]] = field(default_factory=dict)
    ok: bool = True
    max_err: float = 0.0
    error: str = ""
    gaps: str = ""  # with --profile N: the N longest kernels below half of the peak or the bandwidth
    # threads -> the hand-off probe (cuvil/bench/probe.py), the lower of before and after the timing
    probe: dict[int, float] = field(default_factory=dict)

    def ratio(self, t: int) -> float:
        """cuvil / onnxruntime at ``t`` threads: CPU time at 1 thread, wall time above."""
        c_cpu, c_wall, o_cpu, o_wall = self.latency[t]
        return c_cpu / o_cpu if t == 1 else c_wall / o_wall


def _fresh(example: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Inputs like ``example``: float inputs redrawn (standard normal), integer and bool inputs (ids,
    masks) kept, since their valid values depend on the model."""
    return {n: rng.standard_normal(a.shape).astype(a.dtype) if a.dtype.kind == "f" else a
            for n, a in example.items()}


def _check(ours: list[np.ndarray], ref: list[np.ndarray]) -> tuple[bool, float]:
    ok, worst = len(ours) == len(ref), 0.0
    for y, r in zip(ours, ref):
        if y.shape != r.shape or y.dtype != r.dtype:
            return False, math.inf
        if r.dtype.kind == "f" and r.size:
            worst = max(worst, float(np.max(np.abs(y.astype(np.float64) - r))))
            ok &= bool(np.allclose(y, r, rtol=1e-3, atol=1e-4))
        else:
            ok &= bool(np.array_equal(y, r))
    return ok, worst


def _medians(samples: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """The median (cpu, wall) of each engine's (cpu, wall) samples."""
    return [(float(np.median([c for c, _ in x])), float(np.median([w for _, w in x]))) for x in samples]


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    c0, w0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - w0


# -- cold compile in a fresh process ----------------------------------------------------------


def _child() -> None:
    """In a fresh process: compile ``argv[1]`` as a session does; print the seconds and the fallbacks."""
    from cuvil.onnx import InferenceSession

    t0 = time.perf_counter()
    sess = InferenceSession(sys.argv[1])
    with np.load(sys.argv[2]) as z:  # a model whose shapes depend on input values compiles on its first run
        sess.run(None, {k: z[k] for k in z.files})
    print("CUVIL_BENCH " + json.dumps({"compile_s": time.perf_counter() - t0, "fallbacks": sess.fallbacks}))


def cold_compile(path: str, feeds: dict[str, np.ndarray]) -> tuple[float, list[str]]:
    """Seconds to compile ``path`` (and run it once) in a fresh process with an empty kernel cache, and
    the fallbacks it took."""
    from cuvil.errors import CuvilError

    with tempfile.TemporaryDirectory(prefix="cuvil-bench-") as work:
        npz = os.path.join(work, "feeds.npz")
        np.savez(npz, **feeds)
        env = dict(os.environ, CUVIL_CACHE_DIR=os.path.join(work, "kernels"))
        code = "from cuvil.bench.registry import _child; _child()"
        proc = subprocess.run([sys.executable, "-c", code, path, npz], env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("CUVIL_BENCH "):
            out = json.loads(line[len("CUVIL_BENCH "):])
            return float(out["compile_s"]), list(out["fallbacks"])
    tail = [x for x in (proc.stderr or proc.stdout).strip().splitlines() if x.strip()][-1:] or ["no output"]
    raise CuvilError(f"compiling {os.path.basename(path)} in a fresh process failed: {tail[0]}")


# -- engines: built in this process or in a process of their own ------------------------------

# an engine as a child process builds it: ("module:function", keyword arguments), JSON-able; the function,
# called with threads=N and the keyword arguments, loads what the engine needs (imports, the model) and
# returns the step that compiles it (timed: the compile time is that step and the first call)
Spec = tuple[str, dict[str, Any]]


def _same(feeds: dict[str, np.ndarray]) -> Any:
    return feeds


@dataclass
class Runner:
    """One engine, compiled: ``call(prepare(feeds))`` is one inference, of which only ``call`` is timed;
    ``to_numpy`` turns what ``call`` returned into the list of output arrays."""

    call: Callable[[Any], Any]
    prepare: Callable[[dict[str, np.ndarray]], Any] = _same
    to_numpy: Callable[[Any], list[np.ndarray]] = list


@dataclass
class Measured:
    """One engine's median (cpu, wall) seconds per call, its compile time (wall: building it and its first
    call), its outputs on the example inputs, or the error that stopped it."""

    cpu: float = math.nan
    wall: float = math.nan
    compile_s: float = math.nan
    outputs: list[np.ndarray] = field(default_factory=list)
    error: str = ""


def onnx_engine(engine: str, path: str, threads: int) -> Callable[[], Runner]:
    """``engine`` ("cuvil": :class:`cuvil.onnx.InferenceSession`, cuvil's threads set process-wide; "ort":
    onnxruntime) on the ONNX file ``path`` at ``threads``, called as ``run(None, feeds)``."""
    if engine == "cuvil":
        import cuvil
        from cuvil.onnx import InferenceSession

        def build() -> Runner:
            sess = InferenceSession(path)
            cuvil.set_num_threads(threads)
            return Runner(lambda feeds: sess.run(None, feeds))
    else:
        def build() -> Runner:
            sess = _ort_session(path, threads)
            return Runner(lambda feeds: sess.run(None, feeds))
    return build


def open_engine(spec: Spec, threads: int, example: dict[str, np.ndarray]) -> tuple[Runner, Any, float]:
    """Load the engine of ``spec`` at ``threads``, compile it and call it once on ``example``: the engine,
    what that call returned, and the seconds the compile and the call took (wall)."""
    module, func = spec[0].split(":")
    build = getattr(importlib.import_module(module), func)(threads=threads, **spec[1])
    t0 = time.perf_counter()
    runner = build()
    first = runner.call(runner.prepare(example))
    return runner, first, time.perf_counter() - t0


def _calls(runner: Runner, example: dict[str, np.ndarray], rng: np.random.Generator, n: int
           ) -> list[tuple[float, float]]:
    """The (cpu, wall) seconds of ``n`` calls, each on fresh inputs."""
    out = []
    for _ in range(n):
        args = runner.prepare(_fresh(example, rng))
        out.append(_timed(lambda args=args: runner.call(args)))
    return out


def _engine_child() -> None:
    """In a fresh process: open the engine of the job ``argv[1]`` (JSON: spec, threads, the example's .npz,
    where to write its outputs on it, the seed of its fresh inputs), call it twice more to warm up (first-call
    costs, page faults of the buffers), print READY and the compile time; then answer each ``run N`` line on
    stdin with the (cpu, wall) seconds of N calls on fresh inputs, as one JSON line.  Only that engine is
    imported."""
    job = json.loads(sys.argv[1])
    with np.load(job["npz"]) as z:
        example = {k: z[k] for k in z.files}
    runner, first, compile_s = open_engine((job["factory"], job["kwargs"]), job["threads"], example)
    if job["outputs"]:
        np.savez(job["outputs"], *runner.to_numpy(first))
    rng = np.random.default_rng(job["seed"])
    _calls(runner, example, rng, 2)
    print("READY " + json.dumps({"compile_s": compile_s}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] != "run":
            break
        print(json.dumps(_calls(runner, example, rng, int(cmd[1]))), flush=True)


class _Engine:
    """One engine in a child process (:func:`_engine_child`), run a block of calls at a time."""

    def __init__(self, spec: Spec, npz: str, threads: int, seed: int, outputs: str | None = None,
                 env: dict[str, str] | None = None):
        from cuvil.errors import CuvilError

        job = {"factory": spec[0], "kwargs": spec[1], "npz": npz, "threads": threads, "outputs": outputs,
               "seed": seed}
        code = "from cuvil.bench.registry import _engine_child; _engine_child()"
        self.log = tempfile.TemporaryFile("w+")  # its stderr (a pipe nobody reads could fill and block it)
        self.proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(job)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("READY "):
                self.compile_s = float(json.loads(line[len("READY "):])["compile_s"])
                return
        self.proc.wait()
        self.log.seek(0)
        err = [x for x in self.log.read().splitlines() if x.strip()][-1:]
        self.close()
        name = spec[1].get("engine", spec[0])
        raise CuvilError(f"{name} in a process of its own did not start: {err[0] if err else 'no output'}")

    def block(self, n: int) -> list[tuple[float, float]]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        from cuvil.errors import CuvilError

        try:
            self.proc.stdin.write(f"run {n}\n")
            self.proc.stdin.flush()
            return [tuple(x) for x in json.loads(self.proc.stdout.readline())]  # type: ignore[misc]
        except (OSError, ValueError):  # the child died (a broken pipe, no answer)
            raise CuvilError(f"the benchmark's child process stopped (exit status {self.proc.poll()})") from None

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _rotation(n: int, k: int) -> list[int]:
    """The order of ``n`` engines in turn ``k``: each goes first in turn (0, 1 / 1, 0 for two)."""
    return [(k + i) % n for i in range(n)]


def _in_blocks(blocks: list[Callable[[int], list[tuple[float, float]]]], rounds: int, budget_s: float
               ) -> list[list[tuple[float, float]]]:
    """Each engine's (cpu, wall) samples, ``blocks[e](n)`` timing n calls of engine e: blocks after a pause,
    the engines in a rotating order, ``max(rounds, 5)`` times; a block as long as ``budget_s`` allows for all
    of them at the first engine's speed."""
    first = blocks[0](1)[0][1]
    per_block = max(3, int(budget_s / max(rounds, 5) / len(blocks) / max(first, 1e-4)))
    samples: list[list[tuple[float, float]]] = [[] for _ in blocks]
    for r in range(max(rounds, 5)):
        for e in _rotation(len(blocks), r):
            time.sleep(SETTLE_S)
            samples[e] += blocks[e](per_block)
    return samples


def engines_apart(specs: list[Spec], example: dict[str, np.ndarray], threads: int, rounds: int, budget_s: float,
                  keep_going: bool = False) -> list[Measured]:
    """Each engine of ``specs`` in a process of its own (started one after the other), timed in blocks after
    a pause (:func:`_in_blocks`); its compile time in that process and its outputs on ``example``.  An engine
    that does not start raises, or with ``keep_going`` is reported in its :class:`Measured` and left out."""
    from cuvil.errors import CuvilError

    res = [Measured() for _ in specs]
    with tempfile.TemporaryDirectory(prefix="cuvil-bench-") as work:
        npz = os.path.join(work, "feeds.npz")
        np.savez(npz, **example)
        engines: list[tuple[int, _Engine]] = []
        try:
            for i, spec in enumerate(specs):
                out = os.path.join(work, f"outputs{i}.npz")
                try:
                    engines.append((i, _Engine(spec, npz, threads, seed=2 + i, outputs=out)))
                except CuvilError as exc:
                    if not keep_going:
                        raise
                    res[i].error = str(exc)
                    continue
                res[i].compile_s = engines[-1][1].compile_s
                with np.load(out) as z:
                    res[i].outputs = [z[f"arr_{k}"] for k in range(len(z.files))]
            if engines:
                samples = _in_blocks([eng.block for _, eng in engines], rounds, budget_s)
                for (i, _), (cpu, wall) in zip(engines, _medians(samples)):
                    res[i].cpu, res[i].wall = cpu, wall
        finally:
            for _, eng in engines:
                eng.close()
    return res


def compile_apart(spec: Spec, example: dict[str, np.ndarray], threads: int, env: dict[str, str]) -> float:
    """Seconds to compile the engine of ``spec`` and call it once, in a fresh process with environment ``env``
    (empty caches, say)."""
    with tempfile.TemporaryDirectory(prefix="cuvil-bench-") as work:
        npz = os.path.join(work, "feeds.npz")
        np.savez(npz, **example)
        eng = _Engine(spec, npz, threads, seed=2, env=env)
        eng.close()
    return eng.compile_s


def _onnx_pair(path: str) -> list[Spec]:
    return [("cuvil.bench.registry:onnx_engine", {"engine": e, "path": path}) for e in ("cuvil", "ort")]


def time_apart(path: str, example: dict[str, np.ndarray], threads: int, rounds: int, budget_s: float
               ) -> tuple[float, float, float, float]:
    """Median (cuvil cpu, cuvil wall, ort cpu, ort wall) seconds per call, each engine in its own
    process, in blocks after a pause, alternated ``max(rounds, 5)`` times (:func:`engines_apart`)."""
    ours, theirs = engines_apart(_onnx_pair(path), example, threads, rounds, budget_s)
    return ours.cpu, ours.wall, theirs.cpu, theirs.wall


# -- latency ----------------------------------------------------------------------------------


def time_together(runners: list[Runner], example: dict[str, np.ndarray], threads: int, rounds: int,
                  budget_s: float) -> list[tuple[float, float]]:
    """Each engine's median (cpu, wall) seconds per call, all in this process, after two warm-up calls each:
    at 1 thread call by call, the engines in a rotating order, at least ``2 * rounds`` turns and then while
    ``budget_s`` lasts (400 turns at most); above, in blocks after a pause (:func:`_in_blocks`;
    :func:`engines_apart` puts each engine in a process of its own)."""
    rng = np.random.default_rng(1)
    for r in runners:  # warm-up: first-call costs, page faults of the buffers
        _calls(r, example, rng, 2)
    if threads != 1:
        return _medians(_in_blocks([lambda n, r=r: _calls(r, example, rng, n) for r in runners], rounds, budget_s))
    samples: list[list[tuple[float, float]]] = [[] for _ in runners]
    t_end = time.perf_counter() + budget_s
    k = 0
    while k < 2 * rounds or (time.perf_counter() < t_end and k < 400):
        for e in _rotation(len(runners), k):
            samples[e] += _calls(runners[e], example, rng, 1)
        k += 1
    return _medians(samples)


def failed_line(exc: BaseException) -> str:
    """An engine's error as one short line: its type and the first line of its message."""
    from cuvil.schedule.fallback import first_line

    return f"{type(exc).__name__}: {first_line(exc, 160)}"


def engines_together(specs: dict[str, Spec], example: dict[str, np.ndarray], rounds: int, budget_s: float
                     ) -> tuple[dict[str, Measured], dict[str, Runner]]:
    """Every engine of ``specs`` opened in this process at 1 thread (one that fails to open has its error in
    its :class:`Measured`; the exporters' warnings are silenced, they would break up the table), then timed
    call by call (:func:`time_together`).  Returns the measurements and the open runners, which the caller
    drops when it is done with them."""
    import warnings

    res = {e: Measured() for e in specs}
    runners: dict[str, Runner] = {}
    for e, spec in specs.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                runner, first, res[e].compile_s = open_engine(spec, 1, example)
            res[e].outputs = runner.to_numpy(first)
            runners[e] = runner
        except Exception as exc:  # noqa: BLE001 -- an engine's failure is its column's, not the table's
            res[e].error = failed_line(exc)
    if runners:
        for e, (cpu, wall) in zip(runners, time_together(list(runners.values()), example, 1, rounds, budget_s)):
            res[e].cpu, res[e].wall = cpu, wall
    return res, runners


def time_pair(ours: Any, theirs: Any, example: dict[str, np.ndarray], threads: int, rounds: int,
              budget_s: float) -> tuple[float, float, float, float]:
    """Median (cuvil cpu, cuvil wall, ort cpu, ort wall) seconds per ``run(None, feeds)``, both engines
    in this process (:func:`time_together`; :func:`time_apart` puts each in its own, as ``bench_one`` does
    above 1 thread)."""
    (cc, cw), (oc, ow) = time_together([Runner(lambda f, s=s: s.run(None, f)) for s in (ours, theirs)], example,
                                       threads, rounds, budget_s)
    return cc, cw, oc, ow


def probe(threads: int) -> float:
    """The hand-off probe (:func:`cuvil.bench.probe.handoff_scaling`) at ``threads``, after a pause (an engine
    that ran last may still spin: after the output check, this process's 2-thread onnxruntime session held
    it ~5-10% low for up to a second), kept in :data:`_HANDOFFS`.  The first call also takes it five times
    over a second, so that the typical value does not rest on one."""
    time.sleep(PROBE_SETTLE_S)
    seen = _HANDOFFS.setdefault(threads, [])
    if not seen:
        for _ in range(5):
            seen.append(handoff_scaling(threads))
            time.sleep(SETTLE_S)
    seen.append(handoff_scaling(threads))
    return seen[-1]


def typical_handoff(threads: int) -> float | None:
    """The median of the hand-off probes this process has taken at ``threads`` (None before the first)."""
    seen = _HANDOFFS.get(threads)
    return float(np.median(seen)) if seen else None


def low_probe(threads: int, handoff: float) -> bool:
    """Whether the cores' hand-off ran below half of the typical one this process has seen (a median: one
    high outlier does not make every later probe low, as the best one seen did)."""
    typical = typical_handoff(threads)
    return typical is not None and handoff < 0.5 * typical


def time_probed(path: str, example: dict[str, np.ndarray], threads: int, rounds: int, budget_s: float
                ) -> tuple[tuple[float, float, float, float], float]:
    """:func:`time_apart` between two runs of the hand-off probe (the lower kept), taken again
    (``PROBE_TRIES`` times in all) while it is low (:func:`low_probe`): the timing with the best probe, and
    that probe."""
    best: tuple[tuple[float, float, float, float], float] | None = None
    for _ in range(PROBE_TRIES):
        before = probe(threads)
        timing = time_apart(path, example, threads, rounds, budget_s)
        after = probe(threads)
        got = min(before, after)
        if best is None or got > best[1]:
            best = (timing, got)
        if not low_probe(threads, got):
            break
    assert best is not None
    return best


def bench_one(model: str, exporter: str, config: str, threads: list[int], rounds: int, budget_s: float,
              cold: bool = True, profile: int = 0) -> Result:
    """Measure one registry model as one exporter writes it (see the module docstring)."""
    import cuvil
    from cuvil.models import registry
    from cuvil.onnx import InferenceSession

    res = Result(model, exporter)
    path = registry.export(model, config=config, exporter=exporter)
    example = registry.example_inputs(model, config=config)
    if cold:
        res.compile_s, fb = cold_compile(path, example)
        res.fallbacks = len(fb)
    sess = InferenceSession(path)
    if res.fallbacks is None:
        sess.run(None, example)
        res.fallbacks = len(sess.fallbacks)
    for t in threads:
        theirs = _ort_session(path, t)
        cuvil.set_num_threads(t)
        try:
            ok, err = _check(sess.run(None, example), theirs.run(None, example))
            res.ok &= ok
            res.max_err = max(res.max_err, err)
            if t == 1:
                res.latency[t] = time_pair(sess, theirs, example, t, rounds, budget_s)
            else:  # this process's engines stay idle: their pools must not spin beside the timed one
                del theirs
                res.latency[t], res.probe[t] = time_probed(path, example, t, rounds, budget_s)
        finally:
            cuvil.set_num_threads(None)
    if profile:  # at 1 thread: the kernels below half of the peak or of the bandwidth
        cuvil.set_num_threads(1)
        try:
            res.gaps = sess.programs()[0].profile(example).gaps_table(profile)
        finally:
            cuvil.set_num_threads(None)
    return res


# -- the table --------------------------------------------------------------------------------


def header(threads: list[int]) -> str:
    cols = "".join(f"{f'{t}T cuvil':>10}{'ort':>9}{'ratio':>7}" for t in threads)
    return f"{'model':<22}{'exporter':<12}{'cold':>7}{'fb':>4}{cols}  check"


def row(r: Result, threads: list[int]) -> str:
    if r.error:
        return f"{r.model:<22}{r.exporter:<12}  {r.error}"
    cols = ""
    for t in threads:
        c_cpu, c_wall, o_cpu, o_wall = r.latency[t]
        ours, theirs = (c_cpu, o_cpu) if t == 1 else (c_wall, o_wall)
        cols += f"{ours * 1e3:>8.2f}ms{theirs * 1e3:>7.2f}ms{r.ratio(t):>7.2f}"
    cold = "-" if r.compile_s is None else f"{r.compile_s:.1f}s"
    fb = "-" if r.fallbacks is None else str(r.fallbacks)
    check = f"ok ({r.max_err:.1e})" if r.ok else f"MISMATCH ({r.max_err:.1e})"
    marks = "".join(f"  probe {r.probe[t]:.2f}x" + (" LOW" if low_probe(t, r.probe[t]) else "")
                    for t in threads if t in r.probe)
    return f"{r.model:<22}{r.exporter:<12}{cold:>7}{fb:>4}{cols}  {check}{marks}"


def summary(results: list[Result], threads: list[int]) -> list[str]:
    """Per thread count: the geometric mean of cuvil / onnxruntime, the worst model, how many above 1.15."""
    lines = []
    for t in threads:
        rs = [(r.ratio(t), f"{r.model}/{r.exporter}") for r in results if not r.error and t in r.latency]
        if not rs:
            continue
        geo = math.exp(sum(math.log(x) for x, _ in rs) / len(rs))
        worst = max(rs)
        line = (f"{t} thread(s): geometric mean cuvil/ort {geo:.3f} over {len(rs)} runs; worst "
                f"{worst[0]:.2f} ({worst[1]}); above 1.15: {sum(x > 1.15 for x, _ in rs)}")
        seen = [(r.probe[t], f"{r.model}/{r.exporter}") for r in results if not r.error and t in r.probe]
        if seen:
            low = [name for p, name in seen if low_probe(t, p)]
            line += (f"; hand-off probe {min(seen)[0]:.2f}-{max(seen)[0]:.2f}x (typical {typical_handoff(t) or 0:.2f}x)"
                     + (f"; LOW during {', '.join(low)}" if low else ""))
        lines.append(line)
    return lines


def banner(config: str, legend: str) -> None:
    """The table's first line: cuvil's version, the host, the load average, the registry config, ``legend``."""
    import cuvil

    tgt = cuvil.Target("llvm")
    print(f"cuvil {cuvil.__version__} on {tgt.triple} {tgt.cpu}, {os.cpu_count()} cores, load {load_average()}; "
          f"registry config {config!r}; {legend}", flush=True)


def finish(results: list[Any], summary_lines: list[str], json_path: str | None) -> int:
    """The table's last lines (``summary_lines``, the load average after); ``results`` (dataclasses with ``error``
    and ``ok``) written to ``json_path`` if given; 1 if any failed or mismatched."""
    for line in summary_lines:
        print(line)
    print(f"load average after: {load_average()}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump([r.__dict__ for r in results], f, indent=1)
    return 1 if any(r.error or not r.ok for r in results) else 0


def run(models: list[str], exporters: list[str], config: str, threads: list[int], rounds: int = 5,
        budget_s: float = 2.0, cold: bool = True, json_path: str | None = None, profile: int = 0) -> int:
    """Benchmark the registry (``models``: all when empty) and print the table; 1 if any failed."""
    from cuvil.errors import CuvilError
    from cuvil.models import registry

    models = models or [n for n in registry.names() if n != "gpt2-decode"]
    banner(config, "cold = compile in a fresh process, empty kernel cache; fb = fallbacks; 1T: median process CPU "
           "time per call, alternating call by call; 2T+: median wall time, each engine in its own process, blocks "
           "after a pause; ratio = cuvil / ort (> 1: cuvil slower)")
    print(header(threads), flush=True)
    results = []
    for model in models:
        for exporter in exporters:
            try:
                r = bench_one(model, exporter, config, threads, rounds, budget_s, cold, profile)
            except (CuvilError, OSError, ValueError, RuntimeError) as exc:
                first = (str(exc).strip().splitlines() or [""])[0][:160]
                r = Result(model, exporter, error=f"{type(exc).__name__}: {first}")
            results.append(r)
            print(row(r, threads), flush=True)
            if r.gaps:
                print("\n".join("    " + line for line in r.gaps.splitlines()), flush=True)
    return finish(results, summary(results, threads), json_path)
