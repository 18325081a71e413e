"""Named x86 targets carry their features, and CUVIL_HOST_TARGET narrows the host (cuvil/target.py)."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

import cuvil
from cuvil import te
from cuvil.errors import TargetError
from cuvil.target import X86_CPUS, Target

X86 = Target("llvm").triple.startswith("x86_64")
needs_x86 = pytest.mark.skipif(not X86, reason="needs an x86-64 host")


def _host_has(*features: str) -> bool:
    """Whether this machine's CPU (not a narrowed host) has every one of ``features``."""
    import llvmlite.binding as llvm

    from cuvil.target import llvm_binding

    llvm_binding()
    have = {k for k, v in llvm.get_host_cpu_features().items() if v}
    return set(features) <= have


@pytest.mark.parametrize("cpu, bits, regs, has, lacks", [
    ("x86-64-v3", 256, 16, {"avx2", "fma", "f16c"}, {"avx512f", "avx512vnni", "avxvnni"}),
    ("znver3", 256, 16, {"avx2", "fma"}, {"avx512f", "avx512vnni"}),
    ("x86-64-v4", 512, 32, {"avx512f", "avx512bw", "avx512vl"}, {"avx512vnni", "avx512bf16"}),
    ("znver4", 512, 32, {"avx512f", "avx512vnni", "avx512bf16"}, {"amx-int8", "avxvnni"}),
    ("sapphirerapids", 512, 32, {"avx512vnni", "avx512bf16", "avx512fp16", "amx-int8"}, set()),
    ("alderlake", 256, 16, {"avx2", "avxvnni"}, {"avx512f"}),
    ("x86-64-v2", 128, 16, {"sse4.2"}, {"avx"}),
])
def test_named_x86_cpus_carry_their_features(cpu, bits, regs, has, lacks):
    t = Target(f"llvm -mtriple=x86_64-linux-gnu -mcpu={cpu}")
    assert (t.vector_bits, t.vector_registers) == (bits, regs)
    assert has <= set(t.enabled_features) and not lacks & set(t.enabled_features)
    assert f"-mcpu={cpu}" in t.canonical and Target(t.canonical) is not None
    # -mattr still adds and removes features on top of the CPU's own
    t2 = Target(f"llvm -mtriple=x86_64-linux-gnu -mcpu={cpu} -mattr=-fma,+avxvnni")
    assert "fma" not in t2.enabled_features and "avxvnni" in t2.enabled_features


def test_every_table_level_includes_the_one_below():
    lv = [set(Target(f"llvm -mtriple=x86_64-linux-gnu -mcpu={c}").enabled_features)
          for c in ("x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4")]
    assert all(a < b for a, b in zip(lv, lv[1:]))
    for name in X86_CPUS:
        feats = set(Target(f"llvm -mtriple=x86_64-linux-gnu -mcpu={name}").enabled_features)
        assert {"sse", "sse2"} <= feats, name


@needs_x86
def test_a_named_cpu_runs_here_only_if_this_cpu_has_its_features():
    v3 = Target("llvm -mcpu=x86-64-v3")
    assert v3.is_host == _host_has("avx2", "fma")
    spr = Target("llvm -mcpu=sapphirerapids")
    assert spr.is_host == (not spr.missing_here())
    if not _host_has("amx-int8"):
        assert "amx-int8" in spr.missing_here() and not spr.is_host


@needs_x86
@pytest.mark.skipif(not X86 or not _host_has("avx2", "fma"), reason="needs avx2 and fma: this CPU lacks them")
def test_x86_64_v3_code_is_ymm_and_runs_here():
    """AVX2 code (no zmm register, no EVEX-only instruction) compiled for x86-64-v3 runs on this newer x86
    and computes numpy's result."""
    A = te.placeholder((64, 96), name="A")
    B = te.placeholder((96, 80), name="B")
    k = te.reduce_axis((0, 96), name="k")
    C = te.compute((64, 80), lambda i, j: te.sum(A[i, k] * B[k, j], axis=k), name="C")
    t = Target("llvm -mcpu=x86-64-v3")
    f = cuvil.build(cuvil.auto_schedule([A, B, C], t), [A, B, C], target=t)
    asm = f.get_source("asm")
    assert "%ymm" in asm and "%zmm" not in asm and "{%k" not in asm
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((64, 96), dtype=np.float32), rng.standard_normal((96, 80), dtype=np.float32)
    c = np.zeros((64, 80), np.float32)
    f(a, b, c)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


def _in_child(env: str, code: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUVIL_HOST_TARGET": env})


@needs_x86
@pytest.mark.skipif(not X86 or not _host_has("avx2", "fma"), reason="needs avx2 and fma: this CPU lacks them")
def test_cuvil_host_target_narrows_the_host():
    r = _in_child("x86-64-v3", "import cuvil; t = cuvil.Target('llvm'); "
                  "print(t is cuvil.Target('llvm -mcpu=x86-64-v3'), t.is_host, t.vector_bits, t.cpu)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "256", "x86-64-v3"]


def test_cuvil_host_target_refuses_what_this_cpu_cannot_run():
    r = _in_child("no-such-cpu", "import cuvil; cuvil.Target('llvm')")
    assert r.returncode != 0 and "names no CPU cuvil knows" in r.stderr and "x86-64-v3" in r.stderr
    if X86 and not _host_has("amx-int8"):
        r = _in_child("sapphirerapids", "import cuvil; cuvil.Target('llvm')")
        assert r.returncode != 0 and "cannot narrow this host" in r.stderr and "amx-int8" in r.stderr


def test_unknown_target_still_errors():
    with pytest.raises(TargetError):
        Target("llvm -mcpu")


def test_constants_fold_on_this_machine_when_compiling_for_another():
    """A graph compiled for an Arm board folds its constant subgraphs (a Gather of constant ids: BERT's
    position embeddings) with kernels compiled for this machine, which can run them."""
    pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    from cuvil.frontend.onnx import import_model
    from cuvil.graph.compile import compile_graph, prepare

    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    ids = np.array([[0, 3, 9]], np.int64)
    g = helper.make_graph([helper.make_node("Gather", ["table", "ids"], ["pos"]),
                           helper.make_node("Add", ["x", "pos"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(table, "table"), numpy_helper.from_array(ids, "ids")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    arm = Target("llvm -mtriple=aarch64-linux-gnu -mcpu=neoverse-n1")
    prog = compile_graph(prepare(import_model(model)), {"x": (1, 3, 4)}, {}, arm)
    assert prog.target.canonical == arm.canonical and "fadd" in prog.module.get_source("asm")


@needs_x86
@pytest.mark.skipif(not X86 or not _host_has("avx2", "fma"), reason="needs avx2 and fma: this CPU lacks them")
def test_bench_target_narrows_cuvil_and_the_torch_anchors():
    """``cuvil bench --target x86-64-v3``: cuvil compiles for it, and PyTorch's kernels are held to AVX2."""
    code = ("import os, cuvil; from cuvil.cli.bench import narrow_host; narrow_host('x86-64-v3'); "
            "print(cuvil.Target('llvm').cpu, os.environ['ONEDNN_MAX_CPU_ISA'], os.environ['ATEN_CPU_CAPABILITY'])")
    r = _in_child("", code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["x86-64-v3", "AVX2", "avx2"]
    r = subprocess.run([sys.executable, "-m", "cuvil.cli", "bench", "--ops", "--target", "no-such-cpu"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "names no CPU cuvil knows" in r.stderr, r.stderr


@pytest.mark.parametrize("spec, said", [
    ("llvm -mcpu=banana", "the processor 'banana'"),
    ("llvm -mcpu=x86-64-v3 -mattr=+bananas", "the feature '+bananas'"),
    ("llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a99", "the processor 'cortex-a99'"),
])
def test_a_cpu_or_feature_llvm_does_not_know_is_refused(spec, said):
    with pytest.raises(TargetError, match=re.escape(f"LLVM does not know {said} in target {spec!r}")):
        cuvil.Target(spec)


def test_cpus_llvm_knows_without_cuvil_facts_are_accepted():
    assert cuvil.Target("llvm -mcpu=tigerlake").cpu == "tigerlake"
