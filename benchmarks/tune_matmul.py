"""Autotuning a matmul: guided (evolutionary + cost model) against random search, and the tuned kernel
against the untuned auto_schedule and numpy.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/tune_matmul.py            # 1024^3, 3 seeds
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/tune_matmul.py --n 256 --trials 16 --seeds 1

For each seed: a guided run of ``--trials`` trials (its wall time is reported: the issue asks for 64 trials of
the 1024^3 matmul in under 5 minutes) and a random run of as many.  The claim checked: the guided search's best
after half the trials is at least as fast as random search's best after all of them.  At the end every winner
(guided at half and full budget, random at full budget) is rebuilt here and timed again, interleaved with the
untuned schedule and numpy (pinned to the same thread count), so the final columns share one machine state.
Timings on a shared 2-core machine are noisy (a few percent between rounds, more when others compile).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def program(n: int) -> list:
    from cuvil import te

    A = te.placeholder((n, n), name="A")
    B = te.placeholder((n, n), name="B")
    k = te.reduce_axis((0, n), name="k")
    C = te.compute((n, n), lambda i, j: te.sum(A[i, k] * B[k, j], axis=k), name="C")
    return [A, B, C]


def best_of(records: list, first: int) -> object:
    """The best of the first ``first`` records, by time relative to the untuned schedule timed beside it."""
    ok = [r for r in records[:first] if r.ok and r.relative]
    return min(ok, key=lambda r: r.relative) if ok else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--trials", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds are first-seed ... first-seed + seeds - 1")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the final timing")
    opts = ap.parse_args()
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        if var in os.environ:
            print(f"note: {var} is set; numpy's figure is fair only under env -u {var}")

    import cuvil
    from cuvil.autotune import Database, tune
    from cuvil.bench import median_time
    from cuvil.schedule.auto import auto_schedule

    try:
        from threadpoolctl import threadpool_limits  # type: ignore[import-not-found]
    except ImportError:
        threadpool_limits = None
    n, half = opts.n, opts.trials // 2
    flops = 2.0 * n ** 3
    args = program(n)
    tmp = tempfile.mkdtemp(prefix="cuvil-tune-bench-")
    winners: list[tuple[str, dict]] = []
    print(f"matmul {n}^3, {opts.trials} trials per run, {opts.threads} thread(s); db files in {tmp}")
    claim_ok = True
    for seed in range(opts.first_seed, opts.first_seed + opts.seeds):
        row = {}
        for search in ("evolutionary", "random"):
            db = os.path.join(tmp, f"{search}-{seed}.db")
            t0 = time.perf_counter()
            res = tune(args, trials=opts.trials, db=db, num_threads=opts.threads, search=search, seed=seed,
                       progress=True)
            wall = time.perf_counter() - t0
            with Database(db) as d:
                recs = d.records(res.workload_key)
            row[search] = (best_of(recs, half), best_of(recs, opts.trials), wall, res.failed)
        (g_half, g_full, g_wall, g_fail), (_, r_full, r_wall, r_fail) = row["evolutionary"], row["random"]
        won = g_half is not None and r_full is not None and g_half.relative <= r_full.relative
        claim_ok &= won
        print(f"seed {seed}: speed-up over the untuned schedule (timed beside each candidate): guided best@{half} "
              f"{1 / g_half.relative:.2f}x, @{opts.trials} {1 / g_full.relative:.2f}x ({g_wall:.0f} s, {g_fail} "
              f"failed); random best@{opts.trials} {1 / r_full.relative:.2f}x ({r_wall:.0f} s, {r_fail} failed): "
              f"guided@{half} {'>=' if won else '<'} random@{opts.trials}", flush=True)
        winners += [(f"guided@{half} s{seed}", g_half.config), (f"guided@{opts.trials} s{seed}", g_full.config),
                    (f"random@{opts.trials} s{seed}", r_full.config)]

    # the final timing: every winner rebuilt here, all timed in interleaved rounds
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty((n, n), np.float32)
    cuvil.set_num_threads(opts.threads)
    mods = {"untuned auto_schedule": cuvil.build(auto_schedule(args), args)}
    for name, cfg in winners:
        mods[name] = cuvil.build(auto_schedule(args, knobs=cfg), args)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    times: dict[str, list[float]] = {name: [] for name in [*mods, "numpy"]}
    limit = threadpool_limits(opts.threads) if threadpool_limits else None
    try:
        for _ in range(opts.rounds):
            for name, m in mods.items():
                m(a, b, c)
                assert np.max(np.abs(c - ref)) / np.max(np.abs(ref)) < 1e-4, name
                times[name].append(median_time(lambda m=m: m(a, b, c), 3, budget_s=0.1))
            times["numpy"].append(median_time(lambda: a @ b, 3, budget_s=0.1))
    finally:
        if limit is not None:
            limit.unregister() if hasattr(limit, "unregister") else None
    t_np = float(np.median(times["numpy"]))
    print(f"\nfinal timing, median of {opts.rounds} interleaved rounds ({opts.threads} thread(s)):")
    print(f"{'kernel':<26}{'ms':>9}{'GFLOP/s':>10}{'x numpy':>9}")
    for name, ts in times.items():
        t = float(np.median(ts))
        print(f"{name:<26}{t * 1e3:>9.2f}{flops / t / 1e9:>10.1f}{t_np / t:>9.2f}")
    print(f"\nguided best after {half} trials >= random best after {opts.trials} on every seed: {claim_ok} "
          "(speed-ups measured during the runs)")
    return 0 if claim_ok else 1


if __name__ == "__main__":
    sys.exit(main())
