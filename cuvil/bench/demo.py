"""``cuvil demo``: an auto-scheduled matmul and conv2d+relu (no tuning, no hand schedule), checked against
numpy and timed beside numpy and onnxruntime by the operator benchmark's protocol (:mod:`cuvil.bench.ops`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from cuvil.bench.ops import Workload, _onnx_model, compare

__all__ = ["demo", "target_line"]


def demo(size: int = 512, rounds: int = 3) -> int:
    """An auto-scheduled matmul and conv2d+relu, checked against numpy and timed beside numpy and
    onnxruntime (interleaved rounds, all cores; ratio = their time / cuvil's, > 1: cuvil is faster)."""
    import cuvil

    try:
        import onnxruntime  # type: ignore[import-not-found]  # noqa: F401

        have_ort = True
    except ImportError:
        have_ort = False
    threads = cuvil.get_num_threads()
    print(f"cuvil {cuvil.__version__}; target: {target_line(cuvil.Target('llvm'))}")
    print(f"auto_schedule (no tuning, no hand schedule), {threads} thread(s); ratio = their time / cuvil's "
          f"(> 1: cuvil is faster), medians of {rounds} interleaved rounds"
          + ("" if have_ort else "; onnxruntime not installed (pip install onnxruntime)"))
    print(f"{'kernel':<32}{'compile':>9}{'cuvil':>10}{'numpy':>10}{'ratio':>7}{'onnxrt':>10}{'ratio':>7}"
          f"{'max rel err':>13}")
    ok = True
    for w in (_demo_matmul(size), _demo_conv_relu()):
        (c,) = compare(w, [threads], rounds, have_ort)
        ok &= c.ok
        numpy_s = f"{c.numpy_s * 1e3:>8.2f}ms{c.numpy_ratio:>7.2f}" if c.numpy_s is not None else f"{'-':>10}{'-':>7}"
        ort_s = f"{c.ort_s * 1e3:>8.2f}ms{c.ort_ratio:>7.2f}" if c.ort_s is not None else f"{'-':>10}{'-':>7}"
        print(f"{w.name:<32}{c.compile_s:>8.1f}s{c.cuvil_s * 1e3:>8.2f}ms{numpy_s}{ort_s}{c.max_rel_err or 0:>13.1e}"
              + "".join(f"  {p}" for p in c.problems))
    print("results match numpy and onnxruntime" if ok else "MISMATCH (see above)")
    return 0 if ok else 1


def target_line(t: Any) -> str:
    """``x86_64 znver3: AVX2 (8 fp32 lanes, FMA), 16 cores, L2 512 KiB`` (``cuvil info``: all of it)."""
    isa = ("AVX-512" if t.vector_bits >= 512 else "AVX2" if t.vector_bits == 256 else
           "NEON" if t.triple.startswith("aarch64") else "SSE")
    fma = ", FMA" if t.fma_units else ""
    return (f"{t.arch or t.triple.split('-')[0]} {t.cpu}: {isa} ({t.vector_lanes(32)} fp32 lanes{fma}), "
            f"{t.num_cores} cores, L2 {t.l2_size // 1024} KiB")


def _demo_matmul(n: int) -> Any:
    def build() -> tuple[list[Any], list[np.ndarray]]:
        from cuvil import te
        from cuvil.te import ops

        rng = np.random.default_rng(0)
        A = te.placeholder((n, n), name="A")
        B = te.placeholder((n, n), name="B")
        return [A, B, ops.matmul(A, B)], [rng.standard_normal((n, n), dtype=np.float32),
                                          rng.standard_normal((n, n), dtype=np.float32)]

    return Workload(f"matmul {n}x{n}x{n}", build, np.matmul, 2.0 * n ** 3,
                    onnx=lambda xs: _onnx_model("MatMul", xs, (n, n)))


def _demo_conv_relu(n: int = 1, c: int = 64, h: int = 56, f: int = 64) -> Any:
    def build() -> tuple[list[Any], list[np.ndarray]]:
        from cuvil import te
        from cuvil.te import ops

        rng = np.random.default_rng(0)
        X = te.placeholder((n, c, h, h), name="X")
        W = te.placeholder((f, c, 3, 3), name="W")
        Y = ops.relu(ops.conv2d_nchw(X, W, stride=1, padding=1))
        return [X, W, Y], [rng.standard_normal((n, c, h, h), dtype=np.float32),
                           rng.standard_normal((f, c, 3, 3), dtype=np.float32)]

    def model(xs: list[np.ndarray]) -> Any:
        from onnx import TensorProto, helper

        vi = helper.make_tensor_value_info
        g = helper.make_graph([helper.make_node("Conv", ["x0", "x1"], ["c"], pads=[1, 1, 1, 1]),
                               helper.make_node("Relu", ["c"], ["y"])], "conv_relu",
                              [vi("x0", TensorProto.FLOAT, list(xs[0].shape)), vi("x1", TensorProto.FLOAT,
                                                                                 list(xs[1].shape))],
                              [vi("y", TensorProto.FLOAT, [n, f, h, h])])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])

    return Workload(f"conv2d {c}->{f} 3x3 {h}x{h} + relu", build, _conv_relu_ref, 2.0 * n * f * h * h * c * 9,
                    onnx=model)


def _conv_relu_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """numpy reference: 3x3 convolution with padding 1 as a sum of shifted matmuls, then relu."""
    n, c, h, wd = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = np.zeros((n, w.shape[0], h, wd), x.dtype)
    for dy in range(3):
        for dx in range(3):
            out += np.einsum("fc,nchw->nfhw", w[:, :, dy, dx], xp[:, :, dy:dy + h, dx:dx + wd])
    return np.maximum(out, 0)
