"""Tuning boards (issue 18 items 2 and 4): cuvil.autotune.board.measure in-process and as a Dask task on a
board started by ``cuvil scheduler`` / ``cuvil worker`` over TLS on loopback, in an environment where islpy
and llvmlite cannot be imported; a crashing or hanging library costs its trial and the board survives; the
cluster commands' refusals (plain TCP beyond loopback, TLS half given, a client without a certificate)."""

from __future__ import annotations

import ctypes
import hashlib
import json
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import board_cluster
import numpy as np
import pytest
import toolchain

import cuvil
from cuvil import te
from cuvil.autotune import board, cluster

N = 32
OPTS = {"repeat": 2, "min_run_s": 0.001, "timeout_s": 3.0}


def matmul(transposed: bool = False) -> list:
    A = te.placeholder((N, N), name="A")
    B = te.placeholder((N, N), name="B")
    k = te.reduce_axis((0, N), name="k")
    C = te.compute((N, N), lambda i, j: te.sum(A[i, k] * (B[j, k] if transposed else B[k, j]), axis=k), name="C")
    return [A, B, C]


def _lib(path: Path) -> tuple[str, bytes]:
    blob = path.read_bytes()
    return hashlib.sha256(blob).hexdigest(), blob


def _fake(folder: Path, like: Path, stem: str, body: str) -> tuple[str, bytes]:
    """A library with the signature and metadata of ``like`` whose function runs ``body`` (C): a kernel that
    crashes or hangs, as a broken candidate would."""
    lib = ctypes.CDLL(str(like))
    read = {}
    for sym in ("cuvil_module_meta",):
        fn = getattr(lib, sym)
        fn.restype = ctypes.c_char_p
        read[sym] = fn().decode()
    (name,) = json.loads(read["cuvil_module_meta"])["functions"]
    fn = getattr(lib, f"cuvil_meta_{name}")
    fn.restype = ctypes.c_char_p
    read[f"cuvil_meta_{name}"] = fn().decode()
    src = "#include <signal.h>\n#include <unistd.h>\n" + "".join(
        f"const char *{sym}(void) {{ return {json.dumps(text)}; }}\n" for sym, text in read.items())
    src += f"int {name}(void **args, long long *sizes) {{ {body} return 0; }}\n"
    c, so = folder / f"{stem}.c", folder / f"{stem}.so"
    c.write_text(src)
    subprocess.run([toolchain.require("gcc", "apt-get install gcc"), "-shared", "-fPIC", "-O1", "-o", str(so),
                    str(c)], check=True)
    return _lib(so)


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> dict[str, tuple[str, bytes]]:
    folder = tmp_path_factory.mktemp("libs")
    out = {}
    for stem, args, auto in (("ref", matmul(), False), ("fast", matmul(), True), ("wrong", matmul(True), False)):
        s = cuvil.auto_schedule(args, "llvm") if auto else te.create_schedule(args[-1])
        cuvil.build(s, args).export_library(str(folder / f"{stem}.so"))
        out[stem] = _lib(folder / f"{stem}.so")
    out["crash"] = _fake(folder, folder / "ref.so", "crash", "raise(SIGSEGV);")
    out["hang"] = _fake(folder, folder / "ref.so", "hang", "for (;;) sleep(1);")
    return out


def _tls_talks(host: str, port: int, ca: str, cert: tuple[str, str] | None) -> bool:
    """Whether a TLS client (trusting ``ca``, showing ``cert``) gets through the handshake and one exchange:
    under TLS 1.3 a refused client certificate shows on the first read."""
    ctx = ssl.create_default_context(cafile=ca)
    ctx.check_hostname = False
    if cert is not None:
        ctx.load_cert_chain(*cert)
    try:
        with socket.create_connection((host, port), timeout=5) as raw, ctx.wrap_socket(raw) as tls:
            tls.settimeout(1.0)
            try:
                return tls.recv(1) != b""
            except TimeoutError:
                return True  # connected, and the server waits for the client to speak
    except (ssl.SSLError, ConnectionError):
        return False


def _data(key: str = "mm32") -> dict:
    rng = np.random.default_rng(0)
    return {"key": key, "inputs": [rng.standard_normal((N, N), dtype=np.float32) for _ in range(2)],
            "outputs": [((N, N), "float32")], "reference": None, "ref_lib": None, "harness": None}


def test_measure_in_process_statuses(libs) -> None:
    data = _data("in-process")
    ref = board.measure(data, [(*libs["ref"], 0)], "reference", OPTS)
    assert [r["status"] for r in ref["results"]] == ["ok"]
    a, b = data["inputs"]
    np.testing.assert_allclose(ref["outputs"][0], a @ b, rtol=1e-5, atol=1e-5)  # float32 sums of 32 terms
    data = dict(data, reference=ref["outputs"], ref_lib=libs["ref"])
    sha, blob = libs["fast"]
    damaged = blob[:99] + bytes([blob[99] ^ 1]) + blob[100:]
    batch = [(sha, blob, 1), (*libs["wrong"], 2), (sha, damaged, 3), (*libs["crash"], 4), (*libs["hang"], 5),
             (sha, blob, 6)]
    out = board.measure(data, batch, "run", OPTS)
    got = [r["status"] for r in out["results"]]
    assert got == ["ok", "wrong", "badhash", "crash", "timeout", "ok"], out["results"]
    assert "SIGSEGV" in out["results"][3]["error"] and "3 s" in out["results"][4]["error"]
    for r in (out["results"][0], out["results"][5]):  # timed after the crash and the hang too
        assert r["seconds"] > 0 and r["ratio"] > 0 and np.isfinite(r["ratio"])
    assert out["outputs"] is None and out["board"]["name"] == "local" and out["board"]["address"] is None
    final = board.measure(data, [(sha, blob, 1), (*libs["wrong"], 2)], "final", dict(OPTS, rounds=3))
    assert [r["status"] for r in final["results"]] == ["ok", "ok", "wrong"]  # the untuned schedule first
    assert final["results"][0]["ratio"] == 1.0 and final["results"][1]["ratio"] > 0
    # no reference sent: the board computes it from ref_lib (once per workload) and checks against it
    alone = board.measure(dict(_data("computed"), ref_lib=libs["ref"]), [(*libs["wrong"], 1), (sha, blob, 2)], "run",
                          OPTS)
    assert [r["status"] for r in alone["results"]] == ["wrong", "ok"]
    bad_ref = board.measure(dict(data, ref_lib=(sha, b"not it")), [(sha, blob, 1)], "final", OPTS)
    assert [r["status"] for r in bad_ref["results"]] == ["badhash", "badhash"]


def test_measure_bad_arguments_are_cuvil_errors(libs) -> None:
    with pytest.raises(cuvil.ArgumentError, match="kind 'bench' is not one of"):
        board.measure(_data(), [], "bench", OPTS)
    with pytest.raises(cuvil.ArgumentError, match="data must be a dict with key, inputs, outputs"):
        board.measure({"inputs": []}, [], "run", OPTS)
    with pytest.raises(cuvil.ArgumentError, match="board name 'a b'"):
        board.configure("a b")


def test_board_modules_need_neither_islpy_nor_llvmlite(tmp_path, libs) -> None:
    """A board has numpy, distributed and cuvil without its compiler: facts and measure work there."""
    lib = tmp_path / "fast.so"
    lib.write_bytes(libs["fast"][1])
    code = f"""
import hashlib, sys, numpy as np
for m in ("islpy", "llvmlite"):
    try:
        __import__(m)
    except ImportError:
        pass
    else:
        sys.exit(m + " imported")
from cuvil.autotune import board, cluster
import cuvil.cli
f = board.facts()
assert f["arch"] and f["cores"] >= 1 and f["caches"]["L1d"] > 0 and f["cpu_features"], f
blob = open({str(lib)!r}, "rb").read()
rng = np.random.default_rng(0)
data = {{"key": "k", "inputs": [rng.standard_normal(({N}, {N}), dtype=np.float32) for _ in range(2)],
        "outputs": [(({N}, {N}), "float32")], "reference": None, "ref_lib": None, "harness": None}}
out = board.measure(data, [(hashlib.sha256(blob).hexdigest(), blob, 0)], "reference", {{"timeout_s": 10}})
assert out["results"][0]["status"] == "ok", out
print("mods", sorted(m for m in sys.modules if m.split(".")[0] in ("islpy", "llvmlite")))
"""
    env = board_cluster.env_for(tmp_path / "home", block=True)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "mods []" in res.stdout


def test_facts_parse_x86_and_aarch64() -> None:
    from cuvil.autotune.board_facts import cpu_features
    from cuvil.target import cache_bytes

    x86 = "processor\t: 0\nflags\t\t: fpu avx2 fma sse4_2 avx2\nbugs\t\t: spectre_v1\n"
    arm = "processor\t: 0\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm crc32 asimddp\nCPU part\t: 0xd0b\n"
    assert cpu_features("x86_64", x86) == ["avx2", "fma", "fpu", "sse4_2"]
    assert cpu_features("aarch64", arm) == ["asimd", "asimddp", "crc32", "evtstrm", "fp"]
    assert [cache_bytes(t) for t in ("48K", "2048K", "32M", "?")] == [48 << 10, 2 << 20, 32 << 20, 0]
    f = board.facts()
    assert f["board"] == "local" and f["exec"] is None and f["threads"] == 1 and f["cuvil"] == cuvil.__version__
    assert f["caches"]["L1d"] > 0 and f["cores"] >= 1 and f["cpu_features"] == sorted(f["cpu_features"])
    assert board.facts_hash(f) == board.facts_hash(dict(f, hostname="elsewhere"))


def test_refusals(tmp_path, capsys) -> None:
    from cuvil.cli import main

    cases = [
        (["scheduler", "--host", "0.0.0.0"], "listening on 0.0.0.0 is beyond this machine"),
        (["worker", "tcp://192.0.2.1:8786", "--board", "b"], "the scheduler at 192.0.2.1 is beyond this machine"),
        (["worker", "tls://127.0.0.1:8786", "--board", "b"], "is a TLS address: give --tls-ca-file"),
        (["worker", "127.0.0.1:8786", "--board", "b", "--tls-cert", "x.crt"], "TLS needs all three"),
        (["worker", "127.0.0.1:8786", "--board", "two words"], "board name 'two words'"),
        (["cluster", "status", "tcp://192.0.2.1:8786"], "anyone who can reach it can run code"),
    ]
    for argv, message in cases:
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith("cuvil: error: ") and message in err, (argv, err)
    assert cluster.is_loopback("127.0.0.1") and cluster.is_loopback("::1") and cluster.is_loopback("localhost")
    assert not cluster.is_loopback("0.0.0.0") and not cluster.is_loopback("") and not cluster.is_loopback("192.0.2.1")


@pytest.mark.slow
def test_boards_over_tls(tmp_path, libs) -> None:
    """cuvil scheduler and two cuvil workers over tls:// on loopback (islpy and llvmlite blocked, own HOMEs):
    status lists them, tasks measure there, a crash and a hang cost only their trials, a task for a kind no
    board has fails fast, and a client without the cluster's certificate is refused."""
    distributed = toolchain.module("distributed", "pip install distributed")
    toolchain.module("cryptography", "pip install cryptography")
    certs = board_cluster.make_certs(tmp_path / "certs")
    with board_cluster.start_scheduler(tmp_path, certs, "--no-workers-timeout", "2s",
                                       "--worker-ttl", "3s") as sched, \
            board_cluster.start_worker(tmp_path, sched.address, "b1", certs) as w1, \
            board_cluster.start_worker(tmp_path, sched.address, "b2", certs, "--threads", "2") as w2:
        assert sched.address.startswith("tls://127.0.0.1:") and w1.address.startswith("tls://127.0.0.1:")
        status = subprocess.run([sys.executable, "-m", "cuvil.cli", "cluster", "status", sched.address,
                                 *board_cluster.tls_args(certs, "client")], capture_output=True, text=True,
                                env=board_cluster.env_for(tmp_path / "status", block=True), timeout=60)
        assert status.returncode == 0, status.stderr
        assert "2 board(s)" in status.stdout and "b1" in status.stdout and "2 kernel thread(s)" in status.stdout
        assert w1.address in status.stdout and "idle" in status.stdout
        with distributed.Client(sched.address, security=board_cluster.client_security(certs), timeout=20) as client:
            found = board.boards(client, "b1")
            assert [b["address"] for b in found] == [w1.address] and not found[0]["busy"]
            assert found[0]["facts"]["cuvil"] == cuvil.__version__ and found[0]["facts"]["board"] == "b1"
            assert {b["board"] for b in board.boards(client)} == {"b1", "b2"}
            [data] = client.scatter([_data("tls")], broadcast=True)
            on_b1 = {"resources": {"cuvil-board-b1": 1}, "pure": False}
            ref = client.submit(board.measure, data, [(*libs["ref"], 0)], "reference", OPTS, **on_b1).result()
            assert ref["board"]["address"] == w1.address and ref["results"][0]["status"] == "ok"
            [data2] = client.scatter([dict(_data("tls"), reference=ref["outputs"], ref_lib=libs["ref"])],
                                     broadcast=True)
            batch = [(*libs["crash"], 1), (*libs["fast"], 2), (*libs["hang"], 3), (*libs["wrong"], 4)]
            running = client.submit(board.measure, data2, batch, "run", OPTS, **on_b1)
            t0 = time.monotonic()
            while not board.boards(client, "b1")[0]["busy"] and time.monotonic() - t0 < 10:
                time.sleep(0.1)
            assert board.boards(client, "b1")[0]["busy"] and not board.boards(client, "b2")[0]["busy"]
            out = running.result(timeout=60)
            assert [r["status"] for r in out["results"]] == ["crash", "ok", "timeout", "wrong"]
            again = client.submit(board.measure, data2, [(*libs["fast"], 5)], "run", OPTS, **on_b1).result()
            assert again["results"][0]["status"] == "ok" and again["board"]["pid"] == ref["board"]["pid"]
            assert w1.proc.poll() is None  # the board survived its crashing and hanging candidates
            with pytest.raises(Exception, match="valid worker"):  # no board of this kind: fails (waiting would
                client.submit(board.measure, data2, [], "run", OPTS, resources={"cuvil-board-none": 1},  # time out)
                              pure=False).result(timeout=30)
            # a board that stops answering (SIGSTOP: its connection stays open) is dropped after the TTL
            w2.proc.send_signal(signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                while len(board.boards(client)) == 2 and time.monotonic() - t0 < 20:
                    time.sleep(0.5)
                assert [b["board"] for b in board.boards(client)] == ["b1"], time.monotonic() - t0
            finally:
                w2.proc.send_signal(signal.SIGCONT)
        # the scheduler demands a certificate its CA signed: none, or another CA's, ends the connection
        host, port = sched.address[len("tls://"):].rsplit(":", 1)
        assert _tls_talks(host, int(port), certs["ca"], (certs["client_cert"], certs["client_key"]))
        assert not _tls_talks(host, int(port), certs["ca"], None)
        assert not _tls_talks(host, int(port), certs["ca"], (certs["rogue_cert"], certs["rogue_key"]))
        rogue = subprocess.run([sys.executable, "-m", "cuvil.cli", "cluster", "status", sched.address, "--timeout", "3",
                                *board_cluster.tls_args(certs, "rogue")], capture_output=True, text=True,
                               env=board_cluster.env_for(tmp_path / "rogue", block=True), timeout=60)
        assert rogue.returncode == 1 and "cannot reach the scheduler" in rogue.stderr, rogue.stderr
        assert "check the certificates" in rogue.stderr
