"""Whole models: cuvil's InferenceSession beside onnxruntime, same process, same thread count.

ResNet-18 and MobileNetV2 (224x224, batch 1) and a 2-layer BERT-style encoder (hidden 256, 4 heads,
sequence 128) built with onnx.helper and seeded random weights (torch is not needed), plus an MLP:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/models.py [--threads 1,2] [--only resnet]
        [--unfused] [--profile]

Prints compile time, median latency of each and the ratio onnxruntime / cuvil (1.0 = as fast), and
checks that the outputs agree (rtol 1e-3, atol 1e-4 scaled to the output's magnitude).  ``--unfused``
also compiles every node as its own kernel (``compile_graph(..., fuse=False)``) and times it in the
same interleaved rounds; ``--profile`` prints each model's per-kernel profile (cuvil.graph.profile).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from cuvil.bench.ops import median_time
from cuvil.models.zoo import bert_encoder_model, mlp, mobilenet_v2, resnet18


def _feeds(name: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    if name == "bert":
        return {"x": rng.standard_normal((1, 128, 256)).astype(np.float32),
                "mask": np.ones((1, 128), np.float32)}
    if name == "mlp":
        return {"x": rng.standard_normal((64, 784)).astype(np.float32)}
    return {"x": rng.standard_normal((1, 3, 224, 224)).astype(np.float32)}


def _unfused(sess: object, feeds: dict[str, np.ndarray], threads: int) -> object:
    """The session's graph compiled with one kernel per node: a function running it on ``feeds``."""
    from cuvil.graph.compile import compile_graph

    known = {k: feeds[k] for k in sess._compiler.specialised}
    shapes = {k: v.shape for k, v in feeds.items() if k not in known}
    prog = compile_graph(sess._graph, shapes, known, sess.target, fuse=False)
    if prog.module is not None:
        prog.module.session_threads = threads
        prog.module._set_threads(threads)
    return lambda: prog.run(feeds)


MODELS = {"resnet18": resnet18, "mobilenet_v2": mobilenet_v2, "bert": bert_encoder_model, "mlp": mlp}


def main() -> int:
    import onnxruntime as ort

    import cuvil.onnx

    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--only", default=None)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--unfused", action="store_true", help="also time every node as its own kernel")
    ap.add_argument("--profile", action="store_true", help="print each model's per-kernel profile")
    ap.add_argument("--profile-rows", type=int, default=20)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    ok = True
    print(f"{'model':<14}{'compile s':>10}{'thr':>5}{'cuvil ms':>10}{'ort ms':>9}{'ort/cuvil':>11}"
          + (f"{'unfused ms':>13}{'ort/unfused':>13}" if args.unfused else ""))
    for name, build in MODELS.items():
        if args.only and args.only not in name:
            continue
        model = build()
        feeds = _feeds(name, rng)
        for th in (int(t) for t in args.threads.split(",")):
            t0 = time.perf_counter()
            sess = cuvil.onnx.InferenceSession(model, num_threads=th)
            sess.run(None, feeds)  # compiles here when the model has symbolic dimensions
            compile_s = time.perf_counter() - t0
            opts = ort.SessionOptions()
            opts.intra_op_num_threads, opts.inter_op_num_threads = th, 1
            ref_sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
            want = ref_sess.run(None, feeds)[0]
            runs = {"cuvil": lambda s=sess, f=feeds: s.run(None, f),
                    "ort": lambda s=ref_sess, f=feeds: s.run(None, f)}
            if args.unfused:
                runs["unfused"] = _unfused(sess, feeds, th)
            for variant, fn in runs.items():
                if variant == "ort":
                    continue
                got = fn()
                got = got[0] if isinstance(got, list) else next(iter(got.values()))
                if not np.allclose(got, want, rtol=1e-3, atol=1e-4 * max(1.0, float(np.abs(want).max()))):
                    ok = False
                    print(f"{name} ({variant}): cuvil and onnxruntime disagree (max abs diff "
                          f"{np.abs(got - want).max():.2e})")
            times: dict[str, list[float]] = {k: [] for k in runs}
            for _ in range(3):  # interleaved: the machine's load changes over seconds
                for k, fn in runs.items():
                    times[k].append(median_time(fn, args.repeat, budget_s=0.0))
            tc, to = float(np.median(times["cuvil"])), float(np.median(times["ort"]))
            extra = ""
            if args.unfused:
                tu = float(np.median(times["unfused"]))
                extra = f"{tu * 1e3:>13.2f}{to / tu:>13.2f}"
            print(f"{name:<14}{compile_s:>10.1f}{th:>5}{tc * 1e3:>10.2f}{to * 1e3:>9.2f}{to / tc:>11.2f}{extra}",
                  flush=True)
            if args.profile:
                (prog,) = sess.programs()
                print(prog.profile(feeds).table(args.profile_rows), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
