"""Cold compiles in seconds (issue 29): kernels lowered and compiled to machine code in worker processes
(cuvil/graph/parallel.py), the automatic scheduler's strategies trusted as legal by construction (isl
proves them again under ``CompileOptions(check_schedules=True)``), a warm kernel cache that compiles
nothing, and ``cuvil compile --time``.  Every program here is checked against onnxruntime."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import toolchain
from onnx import TensorProto, helper, numpy_helper

from cuvil.graph import compile as gc
from cuvil.graph import parallel
from cuvil.graph.kernel_cache import fingerprint
from cuvil.options import CompileOptions

ort = toolchain.module("onnxruntime")


def _model(seed: int = 0) -> bytes:
    """Convolutions (3x3 padded, strided, depthwise, 1x1), pooling, a residual add, a matrix product,
    softmax and a reduction: kernels of every strategy the automatic scheduler has."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    inits = {"w1": w(16, 3, 3, 3), "b1": w(16), "w2": w(16, 1, 3, 3), "w3": w(32, 16, 1, 1), "w4": w(32, 32, 3, 3),
             "m": w(32, 10), "axes": np.array([1], np.int64)}
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1], group=16),
        helper.make_node("Add", ["c2", "r1"], ["a2"]),
        helper.make_node("Conv", ["a2", "w3"], ["c3"]),
        helper.make_node("MaxPool", ["c3"], ["p3"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["p3", "w4"], ["c4"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Sigmoid", ["c4"], ["s4"]),
        helper.make_node("Mul", ["c4", "s4"], ["m4"]),
        helper.make_node("GlobalAveragePool", ["m4"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("MatMul", ["f", "m"], ["y0"]),
        helper.make_node("Softmax", ["y0"], ["y"], axis=1),
        helper.make_node("ReduceMax", ["m4", "axes"], ["z"], keepdims=0),
    ]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 20, 20])],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "z")],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def _compile(model: bytes, tmp_path, monkeypatch, name: str, **options):
    """A fresh compile (empty kernel caches) of ``model`` with ``options``; its program and outputs."""
    from cuvil.onnx import InferenceSession

    monkeypatch.setenv("CUVIL_CACHE_DIR", str(tmp_path / name))
    gc.clear_kernels()
    sess = InferenceSession(model, options=CompileOptions(**options))
    x = np.random.default_rng(1).standard_normal((1, 3, 20, 20)).astype(np.float32)
    out = sess.run(None, {"x": x})
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for a, b in zip(out, ref):  # float32 sums of a few hundred terms in another order
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    [prog] = sess.programs()
    return prog


def _kernels(prog) -> list[bytes]:
    """The kernels' loop IR, without their names (a name is the digest of the kernel's cache key, which
    holds the options)."""
    return [fingerprint(dataclasses.replace(k, name="")) for k in prog.kernel_funcs]


@pytest.mark.slow
def test_workers_compile_the_same_kernels_as_this_process(tmp_path, monkeypatch) -> None:
    model = _model()
    submitted = []
    real = parallel.Workers.submit

    def submit(self, fn, *args):
        submitted.append(fn.__name__)
        return real(self, fn, *args)

    monkeypatch.setattr(parallel.Workers, "submit", submit)
    here = _compile(model, tmp_path, monkeypatch, "serial", jobs=1)
    assert submitted == []
    there = _compile(model, tmp_path, monkeypatch, "workers", jobs=2)
    assert submitted.count("lower_task") == there.n_kernels >= 6  # every kernel lowered in a worker ...
    assert submitted.count("kernel_object") == there.n_kernels  # ... and compiled to machine code there
    assert _kernels(here) == _kernels(there)


@pytest.mark.slow
def test_the_strategies_isl_would_prove_are_legal_by_construction(tmp_path, monkeypatch) -> None:
    """The debug mode proves every strategy the automatic scheduler applies; none is refused, so the
    kernels are the ones compiled without the proofs."""
    model = _model(2)
    trusted = _compile(model, tmp_path, monkeypatch, "trusted", jobs=1)
    proved = _compile(model, tmp_path, monkeypatch, "proved", jobs=1, check_schedules=True)
    assert not proved.fallbacks
    assert _kernels(trusted) == _kernels(proved)
    assert CompileOptions(check_schedules=True).key() != CompileOptions().key()  # (cached apart)


def test_a_trusted_schedule_changed_by_hand_is_proved_again(monkeypatch) -> None:
    import cuvil
    from cuvil import pipeline, te

    proofs = []
    real = pipeline.check_program
    monkeypatch.setattr(pipeline, "check_program", lambda s, outs: proofs.append(len(s.trace)) or real(s, outs))
    A = te.placeholder((64, 96), name="A")
    r = te.reduce_axis((0, 96), name="r")
    B = te.compute((64,), lambda i: te.sum(A[i, r] * A[i, r], axis=r), name="B")
    s = cuvil.auto_schedule([A, B])
    assert s.trusted_steps == len(s.trace) > 0 and not s.prove_deferred
    cuvil.lower(s, [A, B])
    assert proofs == []  # the automatic scheduler's schedule as it made it: not proved again
    s[B].unroll(s[B].leaves[-1])  # a step by hand: the build proves the whole schedule
    cuvil.lower(s, [A, B])
    assert proofs == [len(s.trace)]
    assert cuvil.auto_schedule([A, B], prove=True).trusted_steps == -1


def test_a_warm_cache_compiles_nothing(tmp_path, monkeypatch) -> None:
    model = _model(3)
    _compile(model, tmp_path, monkeypatch, "warm", jobs=2)
    gc.clear_kernels()
    asked = []

    def refuse(*args, **kwargs):
        asked.append(args)
        raise AssertionError("compiled again")

    monkeypatch.setattr(gc, "lower_kernel", refuse)
    monkeypatch.setattr(parallel.Workers, "submit", refuse)
    monkeypatch.setattr(parallel, "kernel_object", refuse)
    from cuvil.onnx import InferenceSession

    monkeypatch.setenv("CUVIL_CACHE_DIR", str(tmp_path / "warm"))
    sess = InferenceSession(model, options=CompileOptions(jobs=2))
    x = np.zeros((1, 3, 20, 20), np.float32)
    sess.run(None, {"x": x})
    assert asked == []


@pytest.mark.slow
def test_lost_workers_leave_the_compile_to_this_process(tmp_path, monkeypatch) -> None:
    """A worker that dies (here: every lowering task exits its process) breaks the pool; the graph is
    compiled again in this process, with the same result."""
    monkeypatch.setattr(parallel, "lower_task", _die)
    prog = _compile(_model(4), tmp_path, monkeypatch, "lost", jobs=2)
    assert prog.n_kernels >= 6


def _die(*args):
    os._exit(3)


def test_jobs_must_be_a_positive_int() -> None:
    from cuvil.errors import ArgumentError

    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ArgumentError, match="jobs"):
            CompileOptions(jobs=bad)


@pytest.mark.slow
def test_cli_compile_prints_the_time_of_each_stage(tmp_path) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(_model(5))
    env = dict(os.environ, CUVIL_CACHE_DIR=str(tmp_path / "cli"))
    out = subprocess.run([sys.executable, "-m", "cuvil.cli", "compile", str(path), "--time", "-j", "2"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("wall time per stage"))
    for stage in ("import", "graph passes", "kernels", "llvm", "total", "2 worker processes"):
        assert stage in line


@pytest.mark.slow
def test_workers_forked_while_another_thread_compiles_do_not_hang() -> None:
    """Another thread inside an LLVM call (llvmlite's lock held: a long O3 run of another model) when a
    compile forks its workers: the fork waits for the lock, so no worker starts holding a lock nobody will
    release (it would wait forever in its first LLVM call)."""
    import threading

    from llvmlite.binding import ffi

    import cuvil
    from cuvil import te

    x = te.placeholder((64,), name="x")
    y = te.compute((64,), lambda i: x[i] * 2.0, name="y")
    func = cuvil.lower(cuvil.auto_schedule([x, y]), [x, y], name="k0")
    held = threading.Event()

    def busy() -> None:
        with ffi.lib._lock:
            held.set()
            threading.Event().wait(2.0)

    t = threading.Thread(target=busy)
    t.start()
    held.wait(30)
    with parallel.Workers(2) as w:
        obj = w.submit(parallel.kernel_object, func, "llvm").result(timeout=120)
    t.join(30)
    assert len(obj) > 0


def test_a_forked_child_gets_fresh_cache_locks() -> None:
    """A BoundedCache whose lock another thread holds at a fork is usable in the child."""
    import threading

    from cuvil.cache import BoundedCache

    c = BoundedCache("test.fork", 4)
    c._lock.acquire()  # as if another thread were inside c[...] when the fork happens
    try:
        pid = os.fork()
        if pid == 0:  # the child: would block forever on the inherited lock
            c["x"] = 1
            os._exit(0 if c["x"] == 1 else 1)
        deadline = threading.Event()
        for _ in range(300):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            deadline.wait(0.1)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the child hung on the cache's inherited lock")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        c._lock.release()
