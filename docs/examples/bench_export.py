"""Export a model and time it four ways at 1 thread: the session, cuvil.runtime.load(...).run, the C
example (docs/examples/run_model.c, one workspace for all runs) and onnxruntime, interleaved, medians.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python docs/examples/bench_export.py resnet18 15

Models: resnet18 (224x224), mobilenet (224x224), mlp (784-1024-1024-10, batch 64), built with
onnx.helper by cuvil.models.zoo (seeded random weights). Needs gcc and onnxruntime.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(name: str, reps: int) -> None:
    import onnxruntime as ort

    import cuvil
    import cuvil.onnx
    import cuvil.runtime
    from cuvil.models import zoo

    model = {"resnet18": lambda: zoo.resnet18(224), "mobilenet": lambda: zoo.mobilenet_v2(224),
             "mlp": lambda: zoo.mlp()}[name]()
    d = tempfile.mkdtemp(prefix=f"cuvil-export-{name}-")
    t0 = time.perf_counter()
    sess = cuvil.onnx.InferenceSession(model, num_threads=1)
    t1 = time.perf_counter()
    lib = sess.export_library(os.path.join(d, "model.so"))
    t2 = time.perf_counter()
    print(f"{name}: session compile {t1 - t0:.1f} s, export {t2 - t1:.1f} s, "
          f"model.so {os.path.getsize(lib) / 2**20:.1f} MiB in {d}")
    cuvil.set_num_threads(1)
    loaded = cuvil.runtime.load(lib)
    inp = loaded.get_inputs()[0]
    x = np.random.default_rng(0).standard_normal(inp.shape).astype(np.float32)
    x.tofile(os.path.join(d, "x.bin"))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    onnxrt = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    ref = onnxrt.run(None, {inp.name: x})[0]
    exe = os.path.join(d, "run_model")
    subprocess.run(["gcc", "-O2", "-o", exe, os.path.join(ROOT, "docs", "examples", "run_model.c"), f"-I{d}",
                    f"-L{d}", "-l:model.so", "-Wl,-rpath,$ORIGIN"], check=True)
    subprocess.run([exe, "--threads", "1", "--out", d, os.path.join(d, "x.bin")], check=True, capture_output=True)
    from_c = np.fromfile(os.path.join(d, "output0.bin"), ref.dtype).reshape(ref.shape)
    y_sess = sess.run(None, {inp.name: x})[0]
    y_load = loaded.run(None, {inp.name: x})[0]
    print(f"max |diff| to onnxruntime: session {np.abs(y_sess - ref).max():.3g}, loaded "
          f"{np.abs(y_load - ref).max():.3g}, C {np.abs(from_c - ref).max():.3g}; session == loaded == C: "
          f"{np.array_equal(y_sess, y_load) and np.array_equal(y_load, from_c)}")
    fns = {"session": lambda: sess.run(None, {inp.name: x}), "loaded": lambda: loaded.run(None, {inp.name: x}),
           "onnxruntime": lambda: onnxrt.run(None, {inp.name: x})}
    times: dict[str, list[float]] = {k: [] for k in [*fns, "C"]}
    for _ in range(reps):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
        out = subprocess.run([exe, "--threads", "1", "--runs", "5", os.path.join(d, "x.bin")], check=True,
                             capture_output=True, text=True).stdout
        times["C"].append(float(out.split("latency: ")[1].split()[0]) / 1e3)
    print(", ".join(f"{k} {statistics.median(v) * 1e3:.2f} ms" for k, v in times.items()),
          f"(medians of {reps}, interleaved, 1 thread)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "mlp", int(sys.argv[2]) if len(sys.argv) > 2 else 20)
