"""One prepared check of cuvil's CUDA target on a machine with an NVIDIA GPU (under 5 minutes).

    pip install -e ".[test,cuda]"        # plus torch for the cuBLAS / bandwidth references
    python benchmarks/gpu_check.py [--out gpu_check.json] [--quick]

1. Correctness: the end-to-end test suite (tests/e2e/test_e2e_*.py) runs with one hypothesis example
   per property; every program it builds is also auto-scheduled for CUDA, run on the GPU on the same
   inputs, and compared with the CPU module (which the tests compare with numpy).
2. fp32 matmul 4096^3: cuvil's auto-scheduled kernel against torch.matmul (cuBLAS, TF32 off).
3. Memory-bound kernels: a row reduction and an element-wise a * b + c against the bandwidth torch
   reaches on the same operation and on a plain copy.

Each part reports its own failure and the others still run; the summary is printed and written to
--out as JSON.  Exit status 1 if a kernel computed a wrong result.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = "cuda -arch=sm_90"


def _arch() -> str:
    """sm_XY of GPU 0 (through cuda-python), else sm_90."""
    try:
        from cuda.bindings import driver as cu

        cu.cuInit(0)
        _, dev = cu.cuDeviceGet(0)
        a = cu.CUdevice_attribute
        _, major = cu.cuDeviceGetAttribute(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        _, minor = cu.cuDeviceGetAttribute(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
        return f"sm_{major}{minor}"
    except Exception:
        return "sm_90"


def check_suite(quick: bool) -> dict[str, Any]:
    """Part 1: the e2e programs on the GPU against the CPU."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.jsonl")
        support = os.path.join(ROOT, "tests", "support")  # the plugin and the e2e tests' helpers
        env = dict(os.environ, CUVIL_PTX_REPORT=report, CUVIL_GPU_RUN="1", CUVIL_PTX_EXAMPLES="1",
                   PYTHONPATH=os.pathsep.join([support, os.environ.get("PYTHONPATH", "")]))
        files = ["test_e2e_elementwise.py", "test_e2e_nn.py"] if quick else \
            ["test_e2e_elementwise.py", "test_e2e_index.py", "test_e2e_nn.py", "test_e2e_reductions.py"]
        t0 = time.time()
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "cuda_ptx_plugin", "-p",
                                   "no:cacheprovider", *files], cwd=os.path.join(ROOT, "tests", "e2e"), env=env,
                                  capture_output=True, text=True, timeout=200)
            rc, tail = proc.returncode, proc.stdout[-600:]
        except subprocess.TimeoutExpired as exc:  # keep what was checked in the time allowed
            rc, tail = "timeout after 200 s", str(exc.stdout or "")[-600:]
        recs = [json.loads(x) for x in open(report)] if os.path.exists(report) else []
    runs = [r for r in recs if r["schedule"] == "gpu-run"]
    builds = [r for r in recs if r["schedule"] != "gpu-run"]
    bad = [r for r in recs if not r["ok"]]
    return {"seconds": round(time.time() - t0, 1), "pytest_rc": rc, "pytest_tail": tail, "ptx_builds": len(builds),
            "ptx_ok": sum(r["ok"] for r in builds), "gpu_runs": len(runs), "gpu_runs_ok": sum(r["ok"] for r in runs),
            "failures": [f"{r['test']} ({r['schedule']}): {r.get('error', '')[:300]}" for r in bad[:20]]}


def _median_ms(fn, repeat: int = 5) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return float(np.median(times))


def check_matmul(n: int) -> dict[str, Any]:
    """Part 2: fp32 matmul n^3 against cuBLAS."""
    import cuvil
    from cuvil import te

    A = te.placeholder((n, n), name="A")
    B = te.placeholder((n, n), name="B")
    k = te.reduce_axis((0, n), "k")
    C = te.compute((n, n), lambda i, j: te.sum(A[i, k] * B[k, j], axis=k), name="C")
    t0 = time.time()
    s = cuvil.auto_schedule([A, B, C], target=TARGET)
    m = cuvil.build(s, [A, B, C], target=TARGET)
    out: dict[str, Any] = {"n": n, "compile_s": round(time.time() - t0, 2),
                           "kernels": [(kk.block, kk.shared_bytes) for kk in m.program.kernels]}
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    c = np.zeros((n, n), np.float32)
    m(a, b, c)
    sec = m.time(a, b, c, number=3, repeat=5)
    flops = 2.0 * n ** 3
    out["cuvil_ms"] = round(sec * 1e3, 3)
    out["cuvil_gflops"] = round(flops / sec / 1e9, 1)
    try:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        ta, tb = torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda()
        ref = (ta @ tb).cpu().numpy()
        err = float(np.abs(c - ref).max() / np.abs(ref).max())
        out["max_rel_err_vs_cublas"] = err
        out["correct"] = err < 1e-4
        ms = _median_ms(lambda: ta @ tb)
        out["cublas_ms"] = round(ms, 3)
        out["cublas_gflops"] = round(flops / ms / 1e6, 1)
        out["ratio_to_cublas"] = round(ms / (sec * 1e3), 3)
    except ImportError:
        ref = a[:64].astype(np.float64) @ b
        out["correct"] = bool(np.allclose(c[:64], ref, rtol=1e-3, atol=1e-3))
        out["cublas"] = "torch not installed"
    return out


def check_bandwidth(rows: int, cols: int) -> dict[str, Any]:
    """Part 3: a row sum and a * b + c, in GB/s, beside torch's."""
    import cuvil
    from cuvil import te

    out: dict[str, Any] = {}
    rng = np.random.default_rng(1)
    X = te.placeholder((rows, cols), name="X")
    k = te.reduce_axis((0, cols), "k")
    S = te.compute((rows,), lambda i: te.sum(X[i, k], axis=k), name="S")
    m = cuvil.build(cuvil.auto_schedule([X, S], target=TARGET), [X, S], target=TARGET)
    x = rng.standard_normal((rows, cols), np.float32)
    s = np.zeros(rows, np.float32)
    m(x, s)
    out["rowsum_correct"] = bool(np.allclose(s, x.astype(np.float64).sum(1), rtol=1e-3, atol=1e-2))
    sec = m.time(x, s, number=5, repeat=5)
    out["rowsum_gbps"] = round(x.nbytes / sec / 1e9, 1)
    n = rows * cols
    P, Q, R = (te.placeholder((n,), name=nm) for nm in "PQR")
    Y = te.compute((n,), lambda i: P[i] * Q[i] + R[i], name="Y")
    m2 = cuvil.build(cuvil.auto_schedule([P, Q, R, Y], target=TARGET), [P, Q, R, Y], target=TARGET)
    p, q, r = (rng.standard_normal(n, np.float32) for _ in range(3))
    y = np.zeros(n, np.float32)
    m2(p, q, r, y)
    out["fma_correct"] = bool(np.allclose(y, p.astype(np.float64) * q + r, rtol=1e-5, atol=1e-5))
    sec = m2.time(p, q, r, y, number=5, repeat=5)
    out["fma_gbps"] = round(4 * p.nbytes / sec / 1e9, 1)
    try:
        import torch

        tx = torch.from_numpy(x).cuda()
        out["torch_rowsum_gbps"] = round(x.nbytes / _median_ms(lambda: tx.sum(1)) / 1e6, 1)
        tp, tq, tr = (torch.from_numpy(v).cuda() for v in (p, q, r))
        ty = torch.empty_like(tp)
        out["torch_fma_gbps"] = round(4 * p.nbytes / _median_ms(lambda: torch.addcmul(tr, tp, tq, out=ty)) / 1e6, 1)
        big = torch.empty(n, device="cuda")
        out["torch_copy_gbps"] = round(2 * p.nbytes / _median_ms(lambda: big.copy_(tp)) / 1e6, 1)
    except ImportError:
        out["torch"] = "not installed"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--quick", action="store_true", help="fewer e2e files, a 2048 matmul")
    opts = ap.parse_args()
    global TARGET
    TARGET = f"cuda -arch={_arch()}"
    from cuvil.runtime.cuda_driver import gpu_available

    ok, why = gpu_available()
    result: dict[str, Any] = {"target": TARGET, "gpu": ok, "why": why}
    if not ok:
        print(f"no GPU here: {why}")
        json.dump(result, open(opts.out, "w"), indent=1)
        return 2
    parts = [("suite", lambda: check_suite(opts.quick)),
             ("matmul", lambda: check_matmul(2048 if opts.quick else 4096)),
             ("bandwidth", lambda: check_bandwidth(8192, 8192))]
    for name, fn in parts:
        t0 = time.time()
        try:
            result[name] = fn()
        except Exception as exc:
            result[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000], "trace": traceback.format_exc()[-2000:]}
        result[name]["part_seconds"] = round(time.time() - t0, 1)
        print(f"== {name}: {json.dumps(result[name], indent=1)}", flush=True)
    json.dump(result, open(opts.out, "w"), indent=1)
    wrong = (result["suite"].get("gpu_runs_ok", 0) != result["suite"].get("gpu_runs", -1)
             or not result["matmul"].get("correct", False)
             or not result["bandwidth"].get("rowsum_correct", False)
             or not result["bandwidth"].get("fma_correct", False))
    print("RESULT:", "wrong results (see above)" if wrong else "all kernels correct")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
