"""One library for two batch sizes versus one library per batch size, at 1 thread: export time, file size,
latency of cuvil.runtime.load(...).run at each size (interleaved, medians) beside onnxruntime.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python docs/examples/bench_symbolic.py bert 20

Models (cuvil.models.zoo, onnx.helper, seeded random weights, symbolic 'batch'): bert (the 2-layer BERT-style
encoder, hidden 256, sequence 128; inputs x and mask share the batch), resnet_block (the ResNet-style block
at 32x32). Batch sizes 1 and 4.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import numpy as np

BATCHES = (1, 4)


def main(name: str, reps: int) -> None:
    import onnxruntime as ort

    import cuvil
    import cuvil.onnx
    import cuvil.runtime
    from cuvil.models import zoo

    model = {"bert": lambda: zoo.bert_encoder_model(), "resnet_block": lambda: zoo.resnet_block_model(32)}[name]()
    sess = cuvil.onnx.InferenceSession(model, num_threads=1)
    rng = np.random.default_rng(0)
    feeds = {}
    for n in BATCHES:
        feeds[n] = {v.name: rng.standard_normal([n if isinstance(d, str) else d for d in v.shape]).astype(np.float32)
                    for v in sess.get_inputs()}
        t0 = time.perf_counter()
        sess.run(None, feeds[n])  # compiles the signature (kept by the session for the exports)
        print(f"{name}: compile batch {n}: {time.perf_counter() - t0:.1f} s")
    d = tempfile.mkdtemp(prefix=f"cuvil-symbolic-{name}-")
    shapes = {n: {k: a.shape for k, a in f.items()} for n, f in feeds.items()}
    libs = {}
    for key, arg in [*((n, shapes[n]) for n in BATCHES), ("both", [shapes[n] for n in BATCHES])]:
        path = os.path.join(d, f"{name}_{key}.so")
        t0 = time.perf_counter()
        sess.export_library(path, input_shapes=arg)
        print(f"{name}: export {key}: {time.perf_counter() - t0:.2f} s, {os.path.getsize(path) / 2**20:.2f} MiB")
        libs[key] = cuvil.runtime.load(path)
    cuvil.set_num_threads(1)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    onnxrt = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    for n in BATCHES:
        ref = onnxrt.run(None, feeds[n])[0]
        one, both = libs[n].run(None, feeds[n])[0], libs["both"].run(None, feeds[n])[0]
        np.testing.assert_array_equal(one, both)
        print(f"{name} batch {n}: max abs diff to onnxruntime {np.abs(both - ref).max():.2e}")
        f = feeds[n]
        runs = {"one signature": (libs[n].run, f), "two signatures": (libs["both"].run, f),
                "onnxruntime": (onnxrt.run, f)}
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(reps):
            for k, (run, f) in runs.items():
                t0 = time.perf_counter()
                run(None, f)
                times[k].append(time.perf_counter() - t0)
        print(f"{name} batch {n} (medians of {reps}, interleaved): " +
              ", ".join(f"{k} {1e3 * statistics.median(v):.3f} ms" for k, v in times.items()))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bert", int(sys.argv[2]) if len(sys.argv) > 2 else 20)
