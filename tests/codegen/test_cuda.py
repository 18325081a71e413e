"""CUDA: bind, shared-memory staging, CUDA C -> PTX through NVRTC, ptxas checks, and the launch path.

PTX is produced and checked on any machine (NVRTC and ptxas come from the cuda extra's wheels);
running kernels needs a GPU: those tests skip with the reason where there is none.
"""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
from toolchain import missing

import cuvil
from cuvil import te
from cuvil.errors import ScheduleError, TargetError

SM90 = "cuda -arch=sm_90"


@pytest.fixture(scope="module", autouse=True)
def cuda_tools():
    try:
        import cuda.bindings.nvrtc  # noqa: F401
    except ImportError:
        missing('cuda-python is not installed (pip install -e ".[cuda]")')
    from cuvil.codegen.nvrtc import find_ptxas

    if find_ptxas() is None:
        missing("ptxas not found (the nvidia-cuda-nvcc wheel of the cuda extra provides it)")


def _matmul(M, N, K, dtype="float32"):
    A = te.placeholder((M, K), dtype, name="A")
    B = te.placeholder((K, N), dtype, name="B")
    k = te.reduce_axis((0, K), name="k")
    return A, B, te.compute((M, N), lambda i, j: te.sum(A[i, k] * B[k, j], axis=k), name="C")


def _loop_bodies(ptx: str) -> list[str]:
    """The PTX between each loop label and the branch back to it."""
    out = []
    for label in set(re.findall(r"^(\$L__BB\d+_\d+):", ptx, flags=re.M)):
        start = ptx.index(label + ":")
        back = ptx.find(f"bra.uni \t{label};", start)
        back = back if back >= 0 else ptx.find(f"{label};", start + len(label) + 1)
        if back > start:
            out.append(ptx[start:back])
    return out


def test_auto_scheduled_matmul_stages_tiles_in_shared_memory():
    A, B, C = _matmul(512, 512, 512)
    s = cuvil.auto_schedule([A, B, C], target=SM90)
    m = cuvil.build(s, [A, B, C], target=SM90)
    cu, ptx = m.get_source("cuda"), m.get_source("ptx")
    assert "__shared__ float A_shared" in cu and "__syncthreads();" in cu
    assert ".target sm_90" in ptx and "bar.sync" in ptx
    inner = [body for body in _loop_bodies(ptx) if "ld.shared" in body and "fma.rn.f32" in body]
    assert inner, "no loop of the matmul reads shared memory and does FMAs"
    report = m.check_ptx()
    assert "bytes smem" in report and "spill" in report
    assert [k.block for k in m.program.kernels] == [(16, 16, 1)]
    assert tuple(int(g.value) for g in m.program.kernels[0].grid) == (4, 4, 1)  # 128 x 128 tiles
    assert "float C_local[64];" in cu  # 8 x 8 accumulators per thread, in registers


def test_elementwise_with_runtime_size_and_every_dtype_path():
    n = te.var("n")
    X = te.placeholder((n,), "float16", "X")
    Y = te.placeholder((n,), "int32", "Y")
    Z = te.compute((n,), lambda i: te.if_then_else(Y[i] // 3 % 2 == 0, te.cast(X[i], "float32") * 2,
                                                    te.exp(te.cast(X[i], "float32"))), name="Z")
    W = te.compute((n,), lambda i: te.cast(te.max(Z[i], te.const(0.5)) > 1, "int8"), name="W")
    s = cuvil.auto_schedule([X, Y, W], target=SM90)
    m = cuvil.build(s, [X, Y, W], target=SM90)
    m.check_ptx()
    assert "long long n" in m.get_source("cuda")
    k = m.program.kernels[0]
    assert k.block == (256, 1, 1) and "n" in str(k.grid[0])


def test_bind_legality_and_errors():
    A, B, C = _matmul(64, 64, 64)
    s = te.create_schedule(C)
    i, j = s[C].op.axis
    (k,) = s[C].op.reduce_axis
    with pytest.raises(ScheduleError, match="bound to threadIdx.x.*carries"):
        s[C].bind(k, "threadIdx.x")
    with pytest.raises(ScheduleError, match="unknown thread tag"):
        s[C].bind(i, "warp.x")
    s[C].bind(i, "blockIdx.x")
    with pytest.raises(ScheduleError, match="already bound to blockIdx.x"):
        s[C].bind(j, "blockIdx.x")
    s[C].bind(j, "threadIdx.x")
    assert [st.op for st in s.trace][-2:] == ["bind", "bind"]
    with pytest.raises(TargetError, match="bound to a GPU thread"):
        cuvil.build(s, [A, B, C], target="llvm")
    s2 = te.create_schedule(C)
    for step in s.trace:  # a trace with bind replays
        s2.apply_step(step)
    m = cuvil.build(s2, [A, B, C], target=SM90)
    assert m.program.kernels[0].grid[0].value == 64 and m.program.kernels[0].block == (64, 1, 1)
    with pytest.raises(ScheduleError, match="unknown scope 'texture'"):
        s2.cache_read(A, "texture", [C])


def test_bind_mapping_errors_at_codegen():
    X = te.placeholder((64, 64), name="X")
    Y = te.compute((64, 64), lambda i, j: X[i, j] + 1, name="Y")
    s = te.create_schedule(Y)
    i, j = s[Y].op.axis
    s[Y].bind(i, "threadIdx.x")
    s[Y].bind(j, "blockIdx.x")
    with pytest.raises(ScheduleError, match="blockIdx must be the outermost"):
        cuvil.build(s, [X, Y], target=SM90)
    s = te.create_schedule(Y)
    i, j = s[Y].op.axis
    s[Y].bind(i, "threadIdx.x")
    s[Y].bind(j, "threadIdx.y")
    with pytest.raises(ScheduleError, match="at most 1024"):
        cuvil.build(s, [X, Y], target=SM90)


def test_unbound_program_is_one_thread_kernel_and_sources():
    X = te.placeholder((10,), name="X")
    k = te.reduce_axis((0, 10), "k")
    Y = te.compute((), lambda: te.sum(X[k], axis=k), name="Y")
    m = cuvil.build(te.create_schedule(Y), [X, Y], target=SM90)
    assert m.program.kernels[0].block == (1, 1, 1)
    assert "for (r" not in m.get_source("loops") and "Y[0]" in m.get_source("cuda")
    assert m.get_source("ptx").startswith("//")
    with pytest.raises(cuvil.errors.ArgumentError, match="unknown source format"):
        m.get_source("asm")
    m.check_ptx()


def test_import_cuvil_does_not_import_cuda_bindings():
    code = ("import sys, cuvil; cuvil.Target('cuda -arch=sm_90'); "
            "import cuvil.schedule.auto_gpu, cuvil.codegen.cuda, cuvil.runtime.cuda; "
            "print([m for m in sys.modules if m.startswith(('cuda', 'pycuda'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _gpu():
    from cuvil.runtime.cuda_driver import gpu_available

    ok, why = gpu_available()
    if not ok:
        pytest.skip(f"no GPU: {why}")


@pytest.mark.gpu
def test_gpu_matmul_against_numpy():
    _gpu()
    A, B, C = _matmul(300, 200, 100)
    s = cuvil.auto_schedule([A, B, C], target=SM90)
    m = cuvil.build(s, [A, B, C], target=SM90)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((300, 100), np.float32), rng.standard_normal((100, 200), np.float32)
    c = np.zeros((300, 200), np.float32)
    m(a, b, c)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
    assert 0 < m.time(a, b, c, number=3, repeat=3) < 1


def test_without_gpu_a_call_says_why():
    from cuvil.runtime.cuda_driver import gpu_available

    ok, _ = gpu_available()
    if ok:
        pytest.skip("this machine has a GPU")
    X = te.placeholder((4,), name="X")
    Y = te.compute((4,), lambda i: X[i] * 2, name="Y")
    m = cuvil.build(cuvil.auto_schedule([X, Y], target=SM90), [X, Y], target=SM90)
    with pytest.raises(TargetError, match="CUDA|GPU"):
        m(np.ones(4, np.float32), np.zeros(4, np.float32))
    with pytest.raises(cuvil.errors.ShapeError):  # arguments are checked before the GPU is looked for
        m(np.ones(5, np.float32), np.zeros(4, np.float32))


def test_gpu_check_script_says_why_without_gpu(tmp_path):
    from cuvil.runtime.cuda_driver import gpu_available

    if gpu_available()[0]:
        pytest.skip("this machine has a GPU: run benchmarks/gpu_check.py itself")
    script = __file__.replace("tests/codegen/test_cuda.py", "benchmarks/gpu_check.py")
    proc = subprocess.run([sys.executable, script, "--out", str(tmp_path / "g.json")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "no GPU here" in proc.stdout
    assert '"gpu": false' in (tmp_path / "g.json").read_text()
