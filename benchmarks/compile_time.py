"""Cold compiles and warm session starts of the registry's models (issue 29's compile floor), beside
onnxruntime's session start on the same file.

    python benchmarks/compile_time.py [MODEL ...] [--config full] [--exporter dynamo] [--jobs N]

Per model, each in a fresh Python process:
- **cold**: ``InferenceSession(path)`` with an empty kernel cache: import, graph passes, kernels (in the
  worker processes), LLVM; wall time, and the CPU time of the process and its workers;
- **warm**: ``InferenceSession(path)`` again, on the cache (and the session image) the cold one left;
- **ort**: ``onnxruntime.InferenceSession(path)`` at its default optimisation level.

The session's construction is timed, after ``import cuvil.onnx`` / ``import onnxruntime`` (Python's own
start and those imports are not; ``onnx`` is imported inside the cold session, by the importer).  The
load average is printed at the end: on a shared machine, quote it with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, resource, sys, time
which, path = sys.argv[1], sys.argv[2]
if which == "ort":
    import onnxruntime as ort
    t, c = time.perf_counter(), time.process_time()
    ort.InferenceSession(path, providers=["CPUExecutionProvider"])
else:
    import cuvil.onnx as co
    from cuvil.options import CompileOptions
    jobs = int(sys.argv[3]) or None
    t, c = time.perf_counter(), time.process_time()
    co.InferenceSession(path, options=CompileOptions(jobs=jobs))
wall, cpu = time.perf_counter() - t, time.process_time() - c
kids = resource.getrusage(resource.RUSAGE_CHILDREN)
print("RESULT " + json.dumps({"wall": wall, "cpu": cpu, "workers": kids.ru_utime + kids.ru_stime}))
"""


def child(which: str, path: str, cache: str, jobs: int) -> dict[str, float]:
    env = dict(os.environ, CUVIL_CACHE_DIR=cache)
    proc = subprocess.run([sys.executable, "-c", CHILD, which, path, str(jobs)], env=env, capture_output=True,
                          text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"{which} {path}: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")


def main() -> None:
    from cuvil.models import registry

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", help="registry names (default: all)")
    ap.add_argument("--config", default="full")
    ap.add_argument("--exporter", default="dynamo")
    ap.add_argument("--jobs", type=int, default=0, help="worker processes (0: one per core)")
    args = ap.parse_args()
    names = args.models or registry.names()
    print(f"{'model':<22}{'cold wall':>10}{'cpu+workers':>12}{'warm wall':>10}{'warm cpu':>9}{'ort':>7}")
    worst = 0.0
    for name in names:
        try:
            path = registry.export(name, args.config, args.exporter)
        except Exception as exc:  # noqa: BLE001 - a model the exporter refuses is reported, not fatal
            print(f"{name:<22} export failed: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        with tempfile.TemporaryDirectory() as cache:
            try:
                cold = child("cuvil", path, cache, args.jobs)
                warm = child("cuvil", path, cache, args.jobs)
            except SystemExit as exc:
                print(f"{name:<22} {exc}")
                continue
        ort = child("ort", path, cache, 0)
        worst = max(worst, cold["wall"])
        print(f"{name:<22}{cold['wall']:>9.1f}s{cold['cpu'] + cold['workers']:>11.1f}s{warm['wall']:>9.2f}s"
              f"{warm['cpu']:>8.2f}s{ort['wall']:>6.2f}s", flush=True)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"slowest cold compile {worst:.1f} s; {os.cpu_count()} cores; load average {load}")


if __name__ == "__main__":
    main()
