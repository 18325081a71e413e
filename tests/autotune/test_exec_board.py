"""A board with no Python (issue 18 item 5): cuvil/autotune/exec_board.py measures AArch64 libraries through
``qemu-aarch64 -L /usr/aarch64-linux-gnu`` with the C timing harness (cuvil/autotune/harness.c).

Under qemu the times are not a board's speed, but the check and the ranking of a clearly slower candidate are
real.  Needs aarch64-linux-gnu-gcc and qemu-aarch64 (Debian: gcc-aarch64-linux-gnu libc6-dev-arm64-cross
qemu-user); skipped without them, failed under CI=true (tests/support/toolchain.py).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
import toolchain
from toolchain import require

import cuvil
from cuvil import te
from cuvil.autotune import exec_board

TARGET = "llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a76"  # what the runner cross-compiles candidates with
QEMU = "qemu-aarch64 -L /usr/aarch64-linux-gnu"
APT = "apt-get install -y gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user"
N = 64
# The slower candidate inlines exp into the matmul's reduction (N exps per output element instead of one
# per input element): about 25x slower under qemu here, a gap no noise on a shared machine closes.

# Stand-ins for candidates that fault, with the exported kernel ABI (cuvil/runtime/module.py c_header): a
# NULL store (SIGSEGV) and an endless loop.  cuvil's own code cannot be made to do either: bounds are proven.
FAULTY_C = r"""
#include <stdint.h>
const char *cuvil_module_meta(void) { return "{\"abi\": 1, \"functions\": [\"kernel\"]}"; }
const char *cuvil_meta_kernel(void) { return "{}"; }
int32_t kernel(void **args, int64_t *sizes) {
#ifdef CRASH
    *(volatile float *)0 = 1.0f;
#else
    for (volatile int64_t i = 0;; i++) {}
#endif
    return 0;
}
"""


def _program(short: bool = False) -> tuple[tuple[te.Tensor, ...], te.Tensor]:
    """C = exp(A) @ B (the sum one term short if ``short``: a wrong candidate); and the exp stage."""
    A = te.placeholder((N, N), name="A")
    B = te.placeholder((N, N), name="B")
    E = te.compute((N, N), lambda i, j: te.exp(A[i, j]), name="E")
    k = te.reduce_axis((0, N - 1 if short else N), name="k")
    return (A, B, te.compute((N, N), lambda i, j: te.sum(E[i, k] * B[k, j], axis=k), name="C")), E


def _expected(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.exp(a.astype(np.float64)) @ b


def _lib(tmp_path, name: str, s, args, trial: int) -> tuple[str, bytes, int]:
    path = cuvil.build(s, list(args), target=TARGET, name="kernel").export_library(tmp_path / f"{name}.so")
    blob = open(path, "rb").read()
    return hashlib.sha256(blob).hexdigest(), blob, trial


def _faulty(tmp_path, gcc: str, define: str, trial: int) -> tuple[str, bytes, int]:
    src, so = tmp_path / f"{define}.c", tmp_path / f"{define}.so"
    src.write_text(FAULTY_C)
    subprocess.run([gcc, f"-D{define}", "-O1", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    blob = so.read_bytes()
    return hashlib.sha256(blob).hexdigest(), blob, trial


@pytest.fixture(scope="module")
def board(tmp_path_factory):
    """The libraries: auto_schedule (the untuned reference), exp inlined into the reduction (slower), a
    wrong one (the sum stops one short), a crashing and a hanging one; and the workload's data."""
    gcc = require("aarch64-linux-gnu-gcc", APT)
    require("qemu-aarch64", APT)
    tmp = tmp_path_factory.mktemp("exec_board")
    args, E = _program()
    fast = _lib(tmp, "fast", cuvil.auto_schedule(list(args), target=TARGET), args, 0)
    s = te.create_schedule(args[-1])
    s[E].compute_inline()
    slow = _lib(tmp, "slow", s, args, 1)
    short, _ = _program(short=True)
    wrong = _lib(tmp, "wrong", te.create_schedule(short[-1]), short, 2)
    crash, hang = _faulty(tmp, gcc, "CRASH", 3), _faulty(tmp, gcc, "HANG", 4)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((N, N), np.float32), rng.standard_normal((N, N), np.float32)
    data = {"key": "matmul", "inputs": [a, b], "outputs": [((N, N), "float32")], "reference": None,
            "ref_lib": None, "harness": exec_board.harness_bytes({"arch": "aarch64"})}
    return {"fast": fast, "slow": slow, "wrong": wrong, "crash": crash, "hang": hang, "data": data}


OPTS = {"repeat": 3, "min_run_s": 0.005, "budget_s": 2.0, "rounds": 5, "timeout_s": 20.0}


def _with_reference(board) -> dict:
    out = exec_board.measure(QEMU, board["data"], [board["fast"]], "reference", OPTS)
    assert out["results"][0]["status"] == "ok", out["results"][0]["error"]
    return {**board["data"], "reference": out["outputs"], "ref_lib": board["fast"][:2]}


def test_facts_through_qemu(board, tmp_path):
    """The board's facts, by /proc/cpuinfo's names as cuvil.autotune.board reports them; the target the
    runner derives from them (board_target.target_of) compiles a library this board runs."""
    from cuvil.autotune.board_target import target_of, uncovered

    facts = exec_board.exec_facts(QEMU)
    assert facts["arch"] == "aarch64" and facts["triple"] == "aarch64-unknown-linux-gnu" and facts["exec"] == QEMU
    assert {"asimd", "fp"} <= set(facts["cpu_features"]) and "avx2" not in facts["cpu_features"]  # not the host's
    assert uncovered(TARGET, facts) == []  # qemu's CPU runs what cortex-a76 code needs
    assert set(facts["caches"]) == {"L1d", "L2", "L3"} and facts["caches"]["L1d"] > 0
    assert facts["cores"] >= 1 and facts["cuvil"] == cuvil.__version__ and facts["numpy"] == np.__version__
    target = target_of(facts)
    assert target.startswith("llvm -mtriple=aarch64-linux-gnu -mcpu=generic -mattr=") and "+neon" in target
    args, _ = _program()
    path = cuvil.build(te.create_schedule(args[-1]), list(args), target=target, name="kernel").export_library(
        tmp_path / "k.so")
    blob = open(path, "rb").read()
    out = exec_board.measure(QEMU, board["data"], [(hashlib.sha256(blob).hexdigest(), blob, 0)], "reference", OPTS)
    a, b = board["data"]["inputs"]
    np.testing.assert_allclose(out["outputs"][0], _expected(a, b), rtol=1e-4, atol=1e-4)


def test_reference_run_and_ranking(board):
    data = _with_reference(board)
    a, b = data["inputs"]
    (c,) = data["reference"]
    np.testing.assert_allclose(c, _expected(a, b), rtol=1e-4, atol=1e-4)  # 64-term sums of exp(x) y
    out = exec_board.measure(QEMU, data, [board["slow"], board["fast"], board["wrong"]], "run", OPTS)
    slow, fast, wrong = out["results"]
    assert (slow["status"], fast["status"], wrong["status"]) == ("ok", "ok", "wrong"), out
    assert "max relative error" in wrong["error"]
    # both timed in turns with auto_schedule's library (how much slower the inlined exp is, is a speed claim:
    # benchmarks/board_floor.py; a wall-clock bound here would flake on a shared machine)
    for r in (slow, fast):
        assert r["seconds"] > 0 and r["ratio"] > 0 and np.isfinite(r["ratio"]), out
    assert wrong["seconds"] is None and wrong["ratio"] is None  # a wrong output is not timed


def test_final_round(board):
    """ref_lib first, then the libraries (as cuvil.autotune.board.measure answers); the reference outputs
    computed on the board from ref_lib when the tuner sends none."""
    data = {**board["data"], "ref_lib": board["fast"][:2]}
    out = exec_board.measure(QEMU, data, [board["slow"], board["wrong"], board["fast"]], "final", OPTS)
    ref, slow, wrong, fast = out["results"]
    assert [r["status"] for r in out["results"]] == ["ok", "ok", "wrong", "ok"], out
    assert ref["ratio"] == 1.0 and fast["ratio"] == 1.0 and slow["ratio"] > 0 and np.isfinite(slow["ratio"])
    assert "max relative error" in wrong["error"]


def test_faults_cost_only_their_trial(board):
    data = _with_reference(board)
    slow_sha, slow_blob, _ = board["slow"]
    tampered = (slow_sha, slow_blob[:-1] + bytes([slow_blob[-1] ^ 1]), 5)
    out = exec_board.measure(QEMU, data, [board["crash"], board["hang"], tampered, board["fast"]], "run",
                             {**OPTS, "timeout_s": 2.0})
    crash, hang, bad, fast = out["results"]
    assert crash["status"] == "crash" and "SIGSEGV" in crash["error"], crash
    assert hang["status"] == "timeout" and "longer than 2 s" in hang["error"], hang  # its own limit, not more
    assert bad["status"] == "badhash" and slow_sha in bad["error"]
    assert fast["status"] == "ok"  # after a crash, a hang and a bad hash, the next trial still measures


def test_remote_shell_prefix(board, tmp_path):
    """A prefix that is not an emulator is a remote shell: the harness is copied through `PREFIX sh -s`
    (`env` stands in for ssh here, with an x86-64 harness and library) and run from where it landed."""
    require("gcc", "apt-get install -y gcc")
    args, _ = _program()
    blob = open(cuvil.build(te.create_schedule(args[-1]), list(args), name="kernel").export_library(tmp_path / "k.so"),
                "rb").read()
    item = (hashlib.sha256(blob).hexdigest(), blob, 0)
    facts = exec_board.exec_facts("env")
    data = {**board["data"], "harness": exec_board.harness_bytes(facts)}
    out = exec_board.measure("env", data, [item], "reference", OPTS)
    a, b = data["inputs"]
    np.testing.assert_allclose(out["outputs"][0], _expected(a, b), rtol=1e-4, atol=1e-4)


def test_board_side_imports_no_compiler():
    """What a board's worker imports to measure: neither islpy nor llvmlite."""
    code = ("import sys; sys.modules['islpy'] = None; sys.modules['llvmlite'] = None\n"
            "import cuvil.autotune.exec_board as e; print(e.measure.__name__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0 and proc.stdout.strip() == "measure", proc.stderr


def test_bad_prefix_and_kind():
    with pytest.raises(cuvil.errors.ArgumentError, match="kind"):
        exec_board.measure(QEMU, {}, [], "time", {})
    with pytest.raises(cuvil.errors.ArgumentError, match="not a valid command line"):
        exec_board.measure("qemu-aarch64 'unclosed", {}, [], "run", {})
    with pytest.raises(cuvil.errors.ArgumentError, match="architecture"):
        exec_board.harness_bytes({})


@pytest.mark.slow
def test_cuvil_worker_exec_measures_through_qemu(board, tmp_path):
    """`cuvil worker ADDRESS --board arm --exec "qemu-aarch64 -L ..."` (a subprocess where islpy and llvmlite
    cannot be imported) publishes the board's facts and measures the Dask task board.measure through qemu."""
    toolchain.module("distributed", "pip install distributed")
    from board_cluster import start_scheduler, start_worker
    from distributed import Client

    from cuvil.autotune import board as board_mod

    res = {"cuvil-board-arm": 1}
    with start_scheduler(tmp_path, None) as sched, \
            start_worker(tmp_path, sched.address, "arm", None, "--exec", QEMU) as worker:
        assert "aarch64" in worker.line and "exec" in worker.line, worker.line
        with Client(sched.address, timeout=30) as client:
            (found,) = board_mod.boards(client, "arm")
            assert found["facts"]["arch"] == "aarch64" and found["exec"] == QEMU, found
            ref = client.submit(board_mod.measure, board["data"], [board["fast"]], "reference", OPTS,
                                resources=res, pure=False).result(120)
            assert ref["results"][0]["status"] == "ok", ref
            data = {**board["data"], "reference": ref["outputs"], "ref_lib": board["fast"][:2]}
            out = client.submit(board_mod.measure, data, [board["slow"], board["wrong"]], "run", OPTS,
                                resources=res, pure=False).result(120)
    slow, wrong = out["results"]
    assert (slow["status"], wrong["status"]) == ("ok", "wrong") and slow["ratio"] > 0, out
