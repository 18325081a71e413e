"""cuvil fp32 beside cuvil ``precision="bf16"`` on the registry's BERT-base and ResNet-50, one command.

    python benchmarks/bf16_models.py                         # full configs, 1 thread
    python benchmarks/bf16_models.py --config ci --models resnet50

Per model (exported by the registry's default exporter, :mod:`cuvil.models.registry`): both sessions compiled
(:class:`cuvil.onnx.InferenceSession`, ``num_threads=1``; the compile wall time of each), then timed by
``cuvil bench --registry``'s 1-thread protocol (:func:`cuvil.bench.registry.time_together`: the two engines
in this process, called in turn call by call on fresh random inputs, medians of the process CPU time and
of the wall time per call), and on the example inputs the error of bf16 against fp32 per output:
``max |y_bf16 - y_fp32| / max |y_fp32|`` (normwise: elementwise relative errors are unbounded where an
output is near zero; docs/precision.md gives the bound per element).  The load average is printed before
and after.  Needs torch and transformers for the export (``pip install -e '.[torch]'``).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

MODELS = ("bert-base", "resnet50")


def _session(path: str, precision: str) -> tuple[object, float]:
    from cuvil.onnx import InferenceSession

    t0 = time.perf_counter()
    sess = InferenceSession(path, num_threads=1, precision=precision)
    return sess, time.perf_counter() - t0


def emulated(path: str, example: dict[str, np.ndarray]) -> list[np.ndarray] | None:
    """onnxruntime's outputs of the model at ``path`` with bf16 rounding emulated in float32 (None
    without onnxruntime): the weights of every contraction that cuvil computes in bf16 (MatMul / Gemm /
    Conv of one group, constant float32 weights) rounded to bfloat16, and ``Cast`` to bfloat16 and back on
    its activation.  What cuvil's bf16 should differ from by float32 summation order only."""
    try:
        import onnx
        import onnxruntime as ort  # type: ignore[import-not-found]
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        return None
    from cuvil.graph.ops.nn.bf16 import round_bf16

    m = onnx.load(path)
    inits = {i.name: i for i in m.graph.initializer}
    nodes = []
    for n in m.graph.node:
        skip = any((a.name == "group" and a.i > 1) or (a.name == "transA" and a.i) for a in n.attribute)
        if n.op_type in ("Conv", "MatMul", "Gemm") and len(n.input) > 1 and n.input[1] in inits and not skip:
            w = numpy_helper.to_array(inits[n.input[1]])
            if w.dtype == np.float32 and (w.ndim == 2 or n.op_type == "Conv"):
                inits[n.input[1]].CopyFrom(numpy_helper.from_array(
                    (round_bf16(w).astype(np.uint32) << 16).view(np.float32), n.input[1]))
                lo, back = f"{n.name}.bf16", f"{n.name}.bf16.f32"
                nodes += [helper.make_node("Cast", [n.input[0]], [lo], to=TensorProto.BFLOAT16),
                          helper.make_node("Cast", [lo], [back], to=TensorProto.FLOAT)]
                n.input[0] = back
        nodes.append(n)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, example)


def _err(ys: list[np.ndarray], refs: list[np.ndarray]) -> float:
    """The largest ``max |y - ref| / max |ref|`` over the float outputs."""
    return max(float(np.max(np.abs(a.astype(np.float64) - b)) / max(float(np.max(np.abs(b))), 1e-30))
               for a, b in zip(ys, refs) if b.dtype.kind == "f" and b.size)


def bench(model: str, config: str, rounds: int, budget_s: float) -> str:
    """One table line for ``model``: compile seconds, medians (ms) and the outputs' error."""
    import cuvil
    from cuvil.bench.registry import Runner, time_together
    from cuvil.models import registry

    path = registry.export(model, config)
    example = registry.example_inputs(model, config)
    cuvil.set_num_threads(1)
    (fp32, c32), (bf16, c16) = _session(path, "fp32"), _session(path, "bf16")
    y32 = fp32.run(None, example)  # type: ignore[attr-defined]
    y16 = bf16.run(None, example)  # type: ignore[attr-defined]
    err = _err(y16, y32)
    emu = emulated(path, example)
    err_emu = "-" if emu is None else f"{_err(emu, y32):.2e} {_err(y16, emu):.2e}"
    runners = [Runner(lambda f, s=s: s.run(None, f)) for s in (fp32, bf16)]  # type: ignore[attr-defined]
    (cpu32, wall32), (cpu16, wall16) = time_together(runners, example, 1, rounds, budget_s)
    return (f"{model:<10} {config:<5} {c32:6.1f} {c16:6.1f}   {cpu32 * 1e3:8.2f} {wall32 * 1e3:8.2f}   "
            f"{cpu16 * 1e3:8.2f} {wall16 * 1e3:8.2f}   {cpu32 / cpu16:5.2f}x   {err:.2e}   {err_emu}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="full", choices=("full", "ci"))
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated registry names")
    ap.add_argument("--rounds", type=int, default=5, help="at least 2x this many calls of each, in turn")
    ap.add_argument("--budget", type=float, default=10.0, help="timing seconds per model")
    args = ap.parse_args(argv)

    from cuvil.bench.models import load_average
    from cuvil.target import Target

    feats = Target("llvm").enabled_features
    print(f"cuvil fp32 vs bf16 at 1 thread; avx512bf16: {'yes' if 'avx512bf16' in feats else 'NO (bf16 runs fp32)'}")
    print(f"load average before: {load_average()}")
    print("error: max |y - ref| / max |ref| over the outputs; emulated: onnxruntime with the same bf16 rounding")
    print(f"{'model':<10} {'conf':<5} {'compile s':>13}   {'fp32 ms':>8} {'':>8}   {'bf16 ms':>8} {'':>8}   "
          f"{'speedup':>6}   {'error vs fp32':>13}   {'emulated vs fp32, bf16 vs emulated'}")
    print(f"{'':<16} {'fp32':>6} {'bf16':>6}   {'cpu':>8} {'wall':>8}   {'cpu':>8} {'wall':>8}   {'(cpu)':>6}")
    for model in [m for m in args.models.split(",") if m]:
        print(bench(model, args.config, args.rounds, args.budget), flush=True)
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
