"""``cuvil.autotune.tune``: search a program's schedule knobs, measure safely, remember everything.

    res = cuvil.autotune.tune([A, B, C], target="llvm", trials=64, db="cuvil-tuning.db")
    print(res)                                   # best time, GFLOP/s, how many were measured now
    f = cuvil.build(s, [A, B, C], tuning_db="cuvil-tuning.db")   # replays the best record's trace

The loop: the untuned auto-schedule is built first and run once; its outputs are the
reference.  Then, until the workload has ``trials`` records (earlier runs count), the
search proposes a batch, the builder compiles it (all cores), the runner measures it
(alone), and each result is committed to the database as it arrives.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cuvil.autotune.database import FINAL_MARGIN, Database, Record
from cuvil.autotune.measure import Builder, BuildJob, BuildResult, LocalBuilder, LocalRunner, Runner, RunResult
from cuvil.autotune.search import STRATEGIES, Search
from cuvil.autotune.space import Space, config_hash
from cuvil.autotune.workload import Workload, workload_of
from cuvil.errors import ArgumentError, CuvilError

log = logging.getLogger("cuvil.autotune")


@dataclass
class TuneResult:
    """What a tuning run found (the best record of the workload, this run's or an earlier one's)."""

    best_time_s: float | None
    gflops: float | None
    trace: str  # JSON steps (cuvil.schedule.trace.trace_from_json reads them)
    config: dict[str, Any]
    workload_key: str
    target: str
    threads: int
    measured: int  # candidates measured by this call (0: the database already had ``trials``)
    trials: int  # records of this workload in the database now
    failed: int = 0  # this call's candidates that failed (build, crash, timeout, wrong output)
    untuned_time_s: float | None = None
    curve: list[float] = field(default_factory=list)  # best so far after each of this call's trials (seconds,
    # relative to the untuned schedule and scaled by its time in this call's first batch)
    speedup: float | None = None  # the untuned schedule's time / the best's (in the final round when there was one)
    final: list[tuple[dict[str, Any], float]] = field(default_factory=list)  # this call's final round: each
    # finalist's configuration and its time relative to the untuned schedule's, fastest first

    def __str__(self) -> str:
        if self.best_time_s is None:
            return f"workload {self.workload_key}: no correct candidate in {self.trials} trials"
        rate = f", {self.gflops:.1f} GFLOP/s" if self.gflops else ""
        base = f", {self.speedup:.2f}x the untuned schedule" if self.speedup else ""
        return (f"workload {self.workload_key}: best {self.best_time_s * 1e3:.3f} ms{rate}{base} "
                f"({self.measured} measured now, {self.failed} failed, {self.trials} in the database)")


def _open_db(db: Any) -> tuple[Database, bool]:
    if isinstance(db, Database):
        return db, False
    return Database(db), True


def _shapes(args: Sequence[Any]) -> list[tuple[Any, tuple[int, ...], str, bool]]:
    from cuvil.schedule.axes import const_int
    from cuvil.te.tensor import PlaceholderOp, Tensor

    out = []
    for a in args:
        if not isinstance(a, Tensor):
            raise ArgumentError(f"tune: size variable {a.name} in the arguments; the tuner needs constant shapes "
                                "(build the program with the sizes you want to tune for)")
        dims = [const_int(d) for d in a.shape]
        if any(d is None for d in dims):
            raise ArgumentError(f"tune: tensor {a.name} has the symbolic shape {tuple(map(str, a.shape))}; "
                                "the tuner needs constant shapes")
        out.append((a, tuple(dims), a.dtype, isinstance(a.op, PlaceholderOp)))  # type: ignore[arg-type]
    return out


def random_inputs(args: Sequence[Any], seed: int = 0) -> list[np.ndarray]:
    """Inputs the tuner runs candidates on: floats ~ N(0, 1), integers in [0, 4), random bools."""
    rng = np.random.default_rng(seed)
    out = []
    for _, shape, dtype, is_input in _shapes(args):
        if not is_input:
            continue
        dt = np.dtype(dtype)
        if dt.kind == "f":
            out.append(rng.standard_normal(shape).astype(dt))
        elif dt.kind == "b":
            out.append(rng.random(shape) < 0.5)
        else:
            out.append(rng.integers(0, 4, size=shape).astype(dt))
    return out


def tune(args: Sequence[Any], target: Any = None, trials: int = 64, db: Any = "cuvil-tuning.db",
         timeout_s: float = 10.0, num_threads: int | None = None, *, search: str = "evolutionary",
         seed: int = 0, batch_size: int | None = None, inputs: Sequence[np.ndarray] | None = None,
         builder: Builder | None = None, runner: Runner | None = None, progress: bool | None = None,
         repeat: int = 5, build_timeout_s: float | None = None, final_top: int = 4,
         final_rounds: int = 15, label: str | None = None) -> TuneResult:
    """Tune the schedule of the program with arguments ``args`` until the database holds ``trials`` records.

    ``timeout_s`` bounds one candidate's run (``build_timeout_s`` its build; by default ``6 * timeout_s``,
    lowered after four builds to 5x their median, at least 20 s: compiling a big packed contraction takes
    seconds, more on a busy machine, and a candidate isl chokes on stalls its whole batch); a candidate that fails
    (refused, crashed, hung, wrong output) counts as a trial.  ``num_threads`` (default: cuvil's
    thread count) is the thread count candidates run with; records are kept per thread count.
    ``search`` is "evolutionary" (model-guided) or "random"; ``inputs`` replaces the random inputs
    (one array per input tensor); ``builder`` / ``runner`` replace the local process-based ones (fresh
    interpreters: ``tune`` works at a script's top level and inside a daemonic process).  A runner on
    boards (``runner=cuvil.autotune.DaskRunner(..., board="rpi5")``) brings the boards' compile target
    (``target`` defaults to it; a given one must be one the boards can run), their thread count and the
    board kind its records are filed under.  Progress (trials,
    best so far, failures, ETA) goes to stderr: one updating line on a terminal, a line per batch otherwise
    (a notebook, a pipe); ``progress=False`` turns it off.  ``label`` names the program in those lines (e.g.
    ``Conv 1x64x56x56 * 64x64x3x3 (+Relu)``; its workload key follows, shortened), else the key alone.

    A run ends with a final round when anything was measured since the workload's last one: the
    ``final_top`` best records (by their time relative to the untuned schedule during the run) and the
    untuned schedule itself are timed against each other in ``final_rounds`` interleaved rounds by the
    same runner, and the winner of that round is the database's best from then on (the untuned schedule
    when nothing beat it), with the time it had there.  In-run times are optimistic for the best of many
    noisy measurements; the final round is not.  ``final_top=0`` skips it (several calls that add trials
    bit by bit, then one with the default to finish: :func:`cuvil.autotune.whole_models.tune_kernels`).
    """
    from cuvil.runtime.threads import get_num_threads

    _check_arguments(trials, timeout_s, search, num_threads)
    tgt = _measuring_target(target, runner)
    wl = workload_of(args, tgt)
    tag = f"{label} [{wl.key[:8]}]" if label else wl.key
    shapes = _shapes(args)
    threads = num_threads or getattr(runner, "threads", None) or get_num_threads()
    database, owned = _open_db(db)
    database = database.on(getattr(runner, "board", None) or "")  # records of the board kind that measures
    try:
        done = database.count(wl.key, wl.target, threads)
        if done >= trials and (final_top <= 0 or not database.final_stale(wl.key, wl.target, threads)):
            return _result(database, wl, threads, 0, 0, [], None)  # (a run killed in its final round goes on)
        if inputs is None:
            inputs = random_inputs(args, seed)
        n_in = sum(1 for s in shapes if s[3])
        if len(inputs) != n_in:
            raise ArgumentError(f"tune: {len(inputs)} input arrays for {n_in} input tensors")
        space = Space(args, tgt, threads)
        strategy: Search = STRATEGIES[search](space, seed=seed)
        strategy.budget = trials
        for r in database.records(wl.key, wl.target, threads):
            strategy.observe(r.config, r.time_s if r.ok else None, r.ref_time_s)
        with tempfile.TemporaryDirectory(prefix="cuvil-tune-") as tmp:
            own_builder, own_runner = builder is None, runner is None
            builder = builder or LocalBuilder(args, tgt.canonical, timeout_s=build_timeout_s or 6 * timeout_s)
            runner = runner or LocalRunner(threads, timeout_s=timeout_s, repeat=repeat)
            try:
                show = _progress(progress)
                adapt = own_builder and build_timeout_s is None  # the limit follows the builds' own times
                res, kept = _loop(args, wl, threads, trials, done, database, space, strategy, builder, runner,
                                  list(inputs), shapes, tmp, batch_size or 8, show, adapt, tag)
                if final_top > 0 and database.final_stale(wl.key, wl.target, threads):
                    final = _final_round(wl, threads, database, space, builder, runner, kept, tmp, final_top,
                                         final_rounds, show, tag)
                    res = _result(database, wl, threads, res.measured, res.failed, res.curve, res.untuned_time_s,
                                  final)
                return res
            finally:
                if own_builder:
                    builder.close()
                if own_runner:
                    runner.close()
    finally:
        if owned:
            database.close()


def _check_arguments(trials: Any, timeout_s: Any, search: str, num_threads: Any) -> None:
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ArgumentError(f"tune: trials must be a positive int, got {trials!r}")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ArgumentError(f"tune: timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if search not in STRATEGIES:
        raise ArgumentError(f"tune: unknown search {search!r}; use one of {', '.join(STRATEGIES)}")
    if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                    or num_threads < 1):
        raise ArgumentError(f"tune: num_threads must be a positive int or None, got {num_threads!r}")


def _measuring_target(target: Any, runner: Runner | None) -> Any:
    """The target candidates are compiled for: ``target``, else the boards' of a runner on boards (which also
    checks a given one), else the host's; without such a runner only this machine's CPU can measure."""
    from cuvil.target import Target

    if target is None:  # a runner on boards (cuvil.autotune.DaskRunner) knows what they run
        target = getattr(runner, "target", None) or "llvm"
    tgt = target if isinstance(target, Target) else Target(target)
    check = getattr(runner, "check_target", None)
    if check is not None:
        check(tgt)  # the boards' CPUs must run what tgt compiles (a clear error before the first trial)
    elif tgt.kind != "llvm" or not tgt.is_host:
        raise ArgumentError(f"tune: measuring needs this machine's CPU ('llvm'); {tgt.canonical!r} needs a remote "
                            "runner on boards of that target (cuvil.autotune.DaskRunner)")
    return tgt


def _progress(flag: bool | None) -> str:
    """How a run reports on stderr: "line" (one line kept up to date: a terminal), "log" (a line per batch:
    a notebook, a pipe, a log file) or "" (``progress=False``)."""
    if flag is False:
        return ""
    return "line" if sys.stderr.isatty() else "log"


@dataclass
class _Progress:
    """What :func:`_loop` has seen so far in this call."""

    best_rel: float | None  # the best time relative to the untuned schedule (earlier runs' records count)
    measured: int = 0
    failed: int = 0
    curve: list[float] = field(default_factory=list)
    untuned: float | None = None
    ref0: float | None = None  # the untuned time beside this run's first candidate: the curve's scale
    kept: dict[str, BuildResult] = field(default_factory=dict)  # config hash -> the build of every correct
    # candidate of this call


def _loop(args: Sequence[Any], wl: Workload, threads: int, trials: int, done: int, db: Database, space: Space,
          strategy: Search, builder: Builder, runner: Runner, inputs: list[np.ndarray], shapes: list[Any],
          tmp: str, batch: int, show: str, adapt: bool = False, tag: str = ""
          ) -> tuple[TuneResult, dict[str, BuildResult]]:
    runner.set_inputs(inputs, [(shape, dtype) for _, shape, dtype, is_in in shapes if not is_in])
    default = space.default()
    best = db.best(wl.key, wl.target, threads)
    run = _Progress(best.relative if best is not None else None)
    first = config_hash(default) not in strategy.seen  # a fresh run: the untuned schedule is trial 0
    ref_build = None
    ref_path = os.path.join(tmp, "reference.so")
    build_s: list[float] = []
    limit = float(getattr(builder, "timeout_s", 60.0))
    start = time.monotonic()
    while done < trials:
        n = min(batch, trials - done)
        if first:
            strategy.seen.add(config_hash(default))  # measured in this batch: not to be proposed again
        cfgs = ([default] if first else []) + strategy.propose(n - first)
        if not cfgs:
            log.info("tune: the search space of %s is exhausted after %d trials", wl.describe(), done)
            break
        jobs = [BuildJob(done + k, c, ref_path if first and k == 0 else os.path.join(tmp, f"cand{done + k}.so"))
                for k, c in enumerate(cfgs)]
        extra = [] if ref_build is not None or first else [BuildJob(-1, default, ref_path)]
        builds = builder.build(extra + jobs)
        build_s += [b.seconds for b in builds if b.status == "ok"]
        if adapt and len(build_s) >= 4:  # a candidate that builds 5x longer than usual is stuck (isl blowing up):
            # give up on it sooner than the first limit (the batch waits for it), but never under 20 s
            builder.timeout_s = max(20.0, min(limit, 5.0 * float(np.median(build_s))))  # type: ignore[attr-defined]
        if ref_build is None:
            ref_build = _reference(wl, runner, builds[0])
            run.kept[config_hash(default)] = ref_build
            builds = builds[len(extra):]
        results = runner.run(builds, run.best_rel)  # each timed in turns with the untuned schedule
        results = _confirm(runner, builds, results, run.best_rel)
        for b, r in zip(builds, results):
            _record(run, wl, threads, db, strategy, b, r, jobs[0].trial if first else None, ref_path)
        done += len(cfgs)
        first = False
        if show:
            _show(run, wl, show, tag, done, trials, start)
    return _result(db, wl, threads, run.measured, run.failed, run.curve, run.untuned), run.kept


def _reference(wl: Workload, runner: Runner, ref_build: BuildResult) -> BuildResult:
    """Run the untuned schedule's build: its outputs are the reference every candidate must match."""
    if ref_build.status != "ok":
        raise CuvilError(f"tune: the untuned schedule of {wl.describe()} does not build: {ref_build.error}")
    ref = runner.reference(ref_build)
    if ref.status != "ok":
        raise CuvilError(f"tune: the untuned schedule of {wl.describe()} does not run: {ref.error}")
    return ref_build


def _record(run: _Progress, wl: Workload, threads: int, db: Database, strategy: Search, b: BuildResult,
            r: RunResult, untuned_trial: int | None, ref_path: str) -> None:
    """Commit one candidate's result to the database and the search; keep its library while it is correct
    (for the final round), delete it otherwise.  ``untuned_trial``: the trial that is the untuned schedule."""
    ref_s = r.ref_time_s
    run.ref0 = run.ref0 or ref_s
    rec = Record(wl.key, wl.target, threads, config_hash(b.config), b.config, r.status, r.time_s, b.trace,
                 wl.names, {"loops": b.loop_features, "build_s": round(b.seconds, 3)}, r.error, wl.flops,
                 ref_time_s=ref_s)
    db.add(rec)
    strategy.observe(b.config, r.time_s if r.status == "ok" else None, ref_s)
    run.measured += 1
    run.failed += r.status != "ok"
    if r.status == "ok" and r.time_s is not None:
        if b.trial == untuned_trial:
            run.untuned = r.time_s
        rel = r.time_s / ref_s if ref_s else None
        if rel is not None:
            run.best_rel = rel if run.best_rel is None else min(run.best_rel, rel)
    else:
        log.info("tune: trial %d failed (%s): %s", b.trial, r.status, r.error.splitlines()[0] if r.error
                 else "")
    run.curve.append(run.best_rel * run.ref0 if run.best_rel is not None and run.ref0 else math.inf)
    if r.status == "ok":
        run.kept[config_hash(b.config)] = b  # the library stays until the final round
    elif b.path and b.path != ref_path and os.path.exists(b.path):
        os.unlink(b.path)


def _show(run: _Progress, wl: Workload, show: str, tag: str, done: int, trials: int, start: float) -> None:
    """The progress line after a batch: trials, best so far, failures, ETA (see :func:`_progress`)."""
    eta = (time.monotonic() - start) / run.measured * (trials - done)
    best_rel, ref0 = run.best_rel, run.ref0
    best_s = best_rel * ref0 if best_rel is not None and ref0 else None
    rate = f" ({wl.flops / best_s / 1e9:.1f} GFLOP/s)" if best_s and wl.flops else ""
    best_txt = f"{best_s * 1e3:.3f} ms{rate}, {1 / best_rel:.2f}x the untuned" if best_s and best_rel \
        else "none yet"
    text = (f"[cuvil tune {tag or wl.key}] {done}/{trials} trials, best {best_txt}, {run.failed} failed, "
            f"eta {eta:.0f} s")
    if show == "line":
        print(f"\r{text}   ", end="" if done < trials else "\n", file=sys.stderr, flush=True)
    else:
        print(text, file=sys.stderr, flush=True)


CONFIRM_WITHIN = 1.03  # a candidate within 3% of the best so far (or faster) is measured a second time


def _confirm(runner: Runner, builds: Sequence[BuildResult], results: list[RunResult],
             best_rel: float | None) -> list[RunResult]:
    """Measure again, after the rest of the batch, each candidate that looks at least about as fast as the best
    so far (its time relative to the untuned schedule within :data:`CONFIRM_WITHIN` of the best before this
    batch, or of this batch's best), and keep the geometric mean of the two.  On this shared machine one
    measurement (5-10 rounds within ~0.1 s) can be off by 30%: an A^T B^T 512^3 candidate measured 1.20x the
    untuned schedule and its twin with another ``ku`` 0.72x, both really ~0.85x; the best of many such draws
    is mostly luck, and the search then breeds from it.  A second measurement seconds later halves the
    variance where it matters.  A candidate that fails the second time is recorded as failed."""
    rel = [r.time_s / r.ref_time_s if r.status == "ok" and r.time_s and r.ref_time_s else None for r in results]
    seen = [x for x in rel if x is not None]
    if not seen:
        return results
    bar = min([*seen, *([best_rel] if best_rel is not None else [])]) * CONFIRM_WITHIN
    again = [k for k, x in enumerate(rel) if x is not None and x <= bar]
    second = runner.run([builds[k] for k in again], None)
    out = list(results)
    for k, r2 in zip(again, second):
        r1 = results[k]
        if r2.status != "ok" or not r2.time_s or not r2.ref_time_s:
            out[k] = r2
            continue
        out[k] = RunResult("ok", math.sqrt(r1.time_s * r2.time_s), r1.error,  # type: ignore[operator]
                           math.sqrt(r1.ref_time_s * r2.ref_time_s))  # type: ignore[operator]
    return out


def _final_round(wl: Workload, threads: int, db: Database, space: Space, builder: Builder, runner: Runner,
                 kept: dict[str, BuildResult], tmp: str, top: int, rounds: int, show: str, tag: str = ""
                 ) -> list[tuple[dict, float]]:
    """Time the ``top`` best records (by in-run relative time), the database's best so far and the untuned
    schedule against each other (see :func:`tune`); record the round; the finalists fastest first."""
    if not hasattr(runner, "final"):
        log.info("tune: the runner has no final round; the best in-run measurement stands")
        return []
    default = space.default()
    dh = config_hash(default)
    recs = [r for r in db.records(wl.key, wl.target, threads) if r.ok and r.relative]
    chosen = [r.config for r in sorted(recs, key=lambda r: r.relative)[:top]]  # type: ignore[arg-type,return-value]
    best = db.best(wl.key, wl.target, threads)
    configs: dict[str, dict[str, Any]] = {dh: default}
    for c in chosen + ([best.config] if best is not None else []):
        configs.setdefault(config_hash(c), c)
    if len(configs) < 2:
        return []
    missing = [BuildJob(-2 - n, c, os.path.join(tmp, f"final{n}.so"))
               for n, (h, c) in enumerate(configs.items()) if h not in kept or not os.path.exists(kept[h].path)]
    for b in builder.build(missing) if missing else []:
        kept[config_hash(b.config)] = b
    builds = [kept[h] for h in configs if h in kept and kept[h].status == "ok"]
    if not builds or config_hash(builds[0].config) != dh:
        log.warning("tune: the untuned schedule of %s did not build for the final round; the best in-run "
                    "measurement stands", wl.describe())
        return []
    results = runner.final(builds, rounds)
    if results[0].status != "ok" or not results[0].time_s:
        log.warning("tune: the final round of %s failed (%s); the best in-run measurement stands", wl.describe(),
                    results[0].error.splitlines()[0] if results[0].error else results[0].status)
        return []
    have = {r.config_hash for r in db.records(wl.key, wl.target, threads)}
    entries = []
    for b, r in zip(builds, results):
        h = config_hash(b.config)
        if r.status != "ok" or not r.time_s or not r.ref_time_s:
            log.warning("tune: finalist %s of %s failed in the final round (%s)", h, wl.describe(), r.status)
            continue
        if h not in have:  # the untuned schedule of a database that never measured it (an imported log)
            db.add(Record(wl.key, wl.target, threads, h, b.config, "ok", r.time_s, b.trace, wl.names,
                          {"loops": b.loop_features}, "", wl.flops, ref_time_s=r.ref_time_s))
        entries.append((h, b.config, r.time_s, r.ref_time_s))
    db.set_final(wl.key, wl.target, threads, [(h, t, ref) for h, _, t, ref in entries])
    out = sorted(((c, t / ref) for _, c, t, ref in entries), key=lambda x: x[1])
    if show:
        won = "the untuned schedule" if config_hash(out[0][0]) == dh else f"{1 / out[0][1]:.2f}x the untuned"
        if config_hash(out[0][0]) != dh and out[0][1] > 1.0 - FINAL_MARGIN:
            won = f"the untuned schedule (the fastest other, {1 / out[0][1]:.2f}x, is within the margin)"
        print(f"[cuvil tune {tag or wl.key}] final round of {len(entries)} ({rounds} rounds): {won}", file=sys.stderr)
    return out


def _result(db: Database, wl: Workload, threads: int, measured: int, failed: int, curve: list[float],
            untuned: float | None, final: list[tuple[dict, float]] | None = None) -> TuneResult:
    best = db.best(wl.key, wl.target, threads)
    total = db.count(wl.key, wl.target, threads)
    if best is None:
        return TuneResult(None, None, "[]", {}, wl.key, wl.target, threads, measured, total, failed, untuned, curve)
    t, rel = best.time_s, best.relative
    if best.final_relative is not None and not db.final_stale(wl.key, wl.target, threads):  # the round's winner
        t, rel, untuned = best.final_time_s, best.final_relative, best.final_ref_s
    gf = wl.flops / t / 1e9 if wl.flops and t else None
    return TuneResult(t, gf, best.trace, best.config, wl.key, wl.target, threads, measured, total, failed, untuned,
                      curve, 1.0 / rel if rel else None, list(final or []))
