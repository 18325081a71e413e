"""The cost of the run-time bounds checks (issue 17): each registry model run with and without them.

    python benchmarks/bounds_cost.py bert-base:ci gpt2:ci distilbert:ci bert-base:full --rounds 21

Two sessions of each model (``bounds_checks=True`` / ``False``) in one process at 1 thread; each
round runs one then the other (the order alternating), ``--runs`` runs each, timed in process CPU
time; the ratio is of the medians over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import cuvil
import cuvil.onnx
from cuvil.models import registry


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+", help="name:config, e.g. bert-base:ci")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    cuvil.set_num_threads(1)
    for spec in args.models:
        name, config = spec.split(":")
        path = registry.export(name, config=config)
        feeds = registry.example_inputs(name, config=config)
        sessions = {on: cuvil.onnx.InferenceSession(path, num_threads=1, bounds_checks=on) for on in (True, False)}
        for s in sessions.values():
            s.run(None, feeds)  # warm
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                t0 = time.process_time()
                for _ in range(args.runs):
                    sessions[on].run(None, feeds)
                times[on].append((time.process_time() - t0) / args.runs)
        on, off = statistics.median(times[True]), statistics.median(times[False])
        print(f"{spec:24s} checks on {on * 1e3:9.3f} ms  off {off * 1e3:9.3f} ms  ratio {on / off:.4f}", flush=True)


if __name__ == "__main__":
    main()
