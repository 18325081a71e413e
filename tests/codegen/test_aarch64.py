"""AArch64: NEON code, cross-linked shared objects, and kernels run under qemu-aarch64 against numpy.

The qemu tests need ``aarch64-linux-gnu-gcc`` and ``qemu-aarch64`` (Debian: gcc-aarch64-linux-gnu,
libc6-dev-arm64-cross, qemu-user); they skip without them, and fail under CI=true.
"""

from __future__ import annotations

import os
import re
import subprocess

import numpy as np
import pytest
from toolchain import require

import cuvil
from cuvil import te
from cuvil.errors import TargetError

A76 = "llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a76 -mattr=+neon"
HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "aarch64_harness.c")
APT = "apt-get install -y gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user"


def _matmul(M: int, N: int, K: int) -> tuple[te.Tensor, ...]:
    A = te.placeholder((M, K), name="A")
    B = te.placeholder((K, N), name="B")
    k = te.reduce_axis((0, K), name="k")
    return A, B, te.compute((M, N), lambda i, j: te.sum(A[i, k] * B[k, j], axis=k), name="C")


def test_arm_cpu_table():
    t = cuvil.Target("llvm -mtriple=aarch64-linux-gnu -mcpu=neoverse-v1")
    assert {"neon", "sve"} <= set(t.enabled_features) and t.sve_bits == 256
    assert (t.l1_size, t.l2_size, t.num_cores, t.vector_bits) == (64 << 10, 1 << 20, 64, 128)
    a72 = cuvil.Target("llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a72")
    assert "sve" not in a72.enabled_features and a72.sve_bits == 0 and a72.l1_size == 32 << 10
    no_sve = cuvil.Target("llvm -mtriple=aarch64-linux-gnu -mcpu=neoverse-v1 -mattr=-sve")
    assert "sve" not in no_sve.enabled_features and no_sve.sve_bits == 0
    assert cuvil.Target("llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a76 -num-cores=8").num_cores == 8
    assert "neon" in cuvil.Target("llvm -mtriple=aarch64-linux-gnu").enabled_features


def test_vectorised_matmul_uses_neon_fma():
    A, B, C = _matmul(64, 64, 64)
    s = cuvil.auto_schedule([A, B, C], target=A76)
    m = cuvil.build(s, [A, B, C], target=A76)
    asm = m.get_source("asm")
    assert re.search(r"\bfmla\s+v\d+\.4s", asm), "no NEON fmla on 4 x float32 in the matmul"
    assert "zmm" not in asm and "vfmadd" not in asm
    with pytest.raises(TargetError, match="not this machine"):
        m(np.zeros((64, 64), np.float32), np.zeros((64, 64), np.float32), np.zeros((64, 64), np.float32))


def test_aarch64_library_refused_by_host_loader(tmp_path):
    require("aarch64-linux-gnu-gcc", APT)
    A, B, C = _matmul(8, 8, 8)
    m = cuvil.build(te.create_schedule(C), [A, B, C], target=A76, name="kernel")
    lib = m.export_library(tmp_path / "kernel.so")  # the cross compiler is found from the triple
    with open(lib, "rb") as f:
        head = f.read(20)
    assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 183  # EM_AARCH64
    assert "int32_t kernel(void **args, int64_t *sizes);" in (tmp_path / "kernel.h").read_text()
    with pytest.raises(TargetError, match="aarch64"):
        cuvil.runtime.load(lib)


def _run_under_qemu(tmp_path, module, arrays: list[np.ndarray], outputs: set[int], sizes: list[int] = (),
                    threads: int = 2) -> list[np.ndarray]:
    """Export ``module`` (named kernel), link the harness for AArch64, run it under qemu; the outputs."""
    gcc = require("aarch64-linux-gnu-gcc", APT)
    qemu = require("qemu-aarch64", APT)
    lib = module.export_library(tmp_path / "kernel.so")
    exe = tmp_path / "harness"
    subprocess.run([gcc, "-O1", f"-DTHREADS={threads}", "-I", str(tmp_path), HARNESS, lib, f"-Wl,-rpath,{tmp_path}",
                    "-o", str(exe)], check=True, capture_output=True, text=True)
    cmd = [qemu, "-L", "/usr/aarch64-linux-gnu", str(exe), str(len(sizes)), *map(str, sizes)]
    for pos, a in enumerate(arrays):
        path = tmp_path / f"arg{pos}.bin"
        if pos not in outputs:
            np.ascontiguousarray(a).tofile(path)
        cmd += ["out" if pos in outputs else "in", str(path), str(a.nbytes)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"qemu run failed ({proc.returncode}): {proc.stderr}"
    assert proc.stdout.startswith("ok meta")
    return [np.fromfile(tmp_path / f"arg{pos}.bin", dtype=arrays[pos].dtype).reshape(arrays[pos].shape)
            for pos in sorted(outputs)]


def test_qemu_auto_scheduled_matmul(tmp_path):
    M, N, K = 67, 80, 45  # tails in every direction
    A, B, C = _matmul(M, N, K)
    target = "llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a76 -mattr=+neon -num-cores=2"
    s = cuvil.auto_schedule([A, B, C], target=target)
    m = cuvil.build(s, [A, B, C], target=target, name="kernel")
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((M, K), np.float32), rng.standard_normal((K, N), np.float32)
    (c,) = _run_under_qemu(tmp_path, m, [a, b, np.zeros((M, N), np.float32)], {2})
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


def test_qemu_softmax_and_dynamic_sizes(tmp_path):
    n, d = te.var("n"), 96
    X = te.placeholder((n, d), name="X")
    k = te.reduce_axis((0, d), name="k")
    mx = te.compute((n,), lambda i: te.max(X[i, k], axis=k), name="mx")
    e = te.compute((n, d), lambda i, j: te.exp(X[i, j] - mx[i]), name="e")
    k2 = te.reduce_axis((0, d), name="k2")
    sm = te.compute((n,), lambda i: te.sum(e[i, k2], axis=k2), name="sm")
    Y = te.compute((n, d), lambda i, j: e[i, j] / sm[i], name="Y")
    target = "llvm -mtriple=aarch64-linux-gnu -mcpu=neoverse-n1"
    s = cuvil.auto_schedule([X, Y], target=target)
    m = cuvil.build(s, [X, Y], target=target, name="kernel")
    rows = 37
    x = np.random.default_rng(1).standard_normal((rows, d)).astype(np.float32) * 4
    (y,) = _run_under_qemu(tmp_path, m, [x, np.zeros((rows, d), np.float32)], {1}, sizes=[rows])
    ref = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
    np.testing.assert_allclose(y, ref / ref.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)


def test_qemu_conv_relu(tmp_path):
    from cuvil.te import ops

    X = te.placeholder((2, 9, 9), name="X")
    W = te.placeholder((4, 2, 3, 3), name="W")
    P = ops.pad(X, (1, 1))
    c, r, s_ = te.reduce_axis((0, 2), "c"), te.reduce_axis((0, 3), "r"), te.reduce_axis((0, 3), "s")
    Y = te.compute((4, 9, 9), lambda o, y, x: te.sum(P[c, y + r, x + s_] * W[o, c, r, s_], axis=[c, r, s_]),
                   name="Y")
    Z = te.compute((4, 9, 9), lambda o, y, x: te.max(Y[o, y, x], te.const(0.0)), name="Z")
    target = "llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a72"
    s = cuvil.auto_schedule([X, W, Z], target=target)
    m = cuvil.build(s, [X, W, Z], target=target, name="kernel")
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((2, 9, 9), np.float32), rng.standard_normal((4, 2, 3, 3), np.float32)
    (z,) = _run_under_qemu(tmp_path, m, [x, w, np.zeros((4, 9, 9), np.float32)], {2})
    xp = np.pad(x.astype(np.float64), ((0, 0), (1, 1), (1, 1)))
    ref = np.zeros((4, 9, 9))
    for r_ in range(3):
        for s2 in range(3):
            ref += np.einsum("oc,cyx->oyx", w[:, :, r_, s2], xp[:, r_:r_ + 9, s2:s2 + 9])
    np.testing.assert_allclose(z, np.maximum(ref, 0), rtol=1e-4, atol=1e-5)


def test_qemu_parallel_loop_on_libgomp(tmp_path):
    X = te.placeholder((64, 200), name="X")
    Y = te.compute((64, 200), lambda i, j: te.sigmoid(X[i, j]) * 2 + 1, name="Y")
    s = te.create_schedule(Y)
    i, j = s[Y].op.axis
    jo, ji = s[Y].split(j, factor=8)
    s[Y].parallel(i)
    s[Y].vectorize(ji)
    m = cuvil.build(s, [X, Y], target=A76, name="kernel")
    assert m.uses_threads
    x = np.random.default_rng(3).standard_normal((64, 200)).astype(np.float32) * 5
    (y,) = _run_under_qemu(tmp_path, m, [x, np.zeros_like(x)], {1}, threads=4)
    np.testing.assert_allclose(y, 2 / (1 + np.exp(-x.astype(np.float64))) + 1, rtol=1e-5)
