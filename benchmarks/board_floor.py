"""Issue 18's Floor, end to end, in one command: tuning ResNet-18 against two boards over TLS.

    python benchmarks/board_floor.py [--trials 32] [--kill-after 10] [--rounds 21] [--keep DIR]

What it does, each step a subprocess started the way a user would start it:

1. makes a certificate authority and a certificate for the scheduler, the boards and the tuner (mutual TLS);
2. ``cuvil scheduler`` on tls://127.0.0.1 (any free port) and two ``cuvil worker ... --board floor``, each in
   its own temporary folder and HOME, in an environment where ``islpy`` and ``llvmlite`` cannot be imported
   (a folder first on PYTHONPATH whose ``islpy`` and ``llvmlite`` packages raise ImportError): a board runs
   exported libraries only, and they reach it as bytes;
3. ``cuvil tune resnet18 --trials N --cluster tls://... --board floor`` (the tuner compiles, the boards
   measure); once ``--kill-after`` records are in the database, one worker is killed with SIGKILL;
4. checks that the run finished, that every trial is recorded (N records of board kind ``floor``, each with a
   status) and that every record committed before the kill is still there, unchanged;
5. ``cuvil bench resnet18 --tuning-db DB --threads 1 --rounds R --no-cold``: the tuned session (the boards'
   records replayed) beside the untuned one, medians of R interleaved rounds; the Floor asks for the tuned
   one within 1.02x of the untuned or faster.

Exit status 0 when every check passes.  The boards here are this machine, so the tuner compiles for
``"llvm"`` (a board whose CPU flags are this host's) and ``cuvil bench`` replays the boards' records.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
BOARD = "floor"


def make_certs(folder: str) -> dict[str, tuple[str, str]]:
    """A CA (``ca``: its certificate twice) and a certificate and key signed by it per role, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def write(name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[str, str]:
        crt, pem = os.path.join(folder, f"{name}.crt"), os.path.join(folder, f"{name}.key")
        with open(crt, "wb") as f:
            f.write(cert.public_bytes(serialization.Encoding.PEM))
        with open(pem, "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
        os.chmod(pem, 0o600)
        return crt, pem

    def build(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, sign: ec.EllipticCurvePrivateKey,
              ca: bool) -> x509.Certificate:
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                             x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                critical=False)
        return b.sign(sign, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cuvil floor CA")])
    out = {"ca": write("ca", build("cuvil floor CA", ca_key, ca_name, ca_key, True), ca_key)}
    for role in ("scheduler", "worker", "tuner"):
        key = ec.generate_private_key(ec.SECP256R1())
        out[role] = write(role, build(f"cuvil {role}", key, ca_name, ca_key, False), key)
    return out


def board_env(root: str, name: str) -> tuple[dict[str, str], str]:
    """The environment and folder of one board process: its own HOME and TMPDIR, islpy and llvmlite blocked."""
    blocked = os.path.join(root, "blocked")
    for pkg in ("islpy", "llvmlite"):
        os.makedirs(os.path.join(blocked, pkg), exist_ok=True)
        with open(os.path.join(blocked, pkg, "__init__.py"), "w") as f:
            f.write(f"raise ImportError('{pkg} is not installed on this board (benchmarks/board_floor.py)')\n")
    home = os.path.join(root, name)
    os.makedirs(os.path.join(home, "tmp"), exist_ok=True)
    env = dict(os.environ, HOME=home, TMPDIR=os.path.join(home, "tmp"),
               PYTHONPATH=os.pathsep.join([blocked, REPO]), CUVIL_CACHE_DIR=os.path.join(home, "cache"))
    return env, home


def tls(certs: dict[str, tuple[str, str]], role: str) -> list[str]:
    return ["--tls-ca-file", certs["ca"][0], "--tls-cert", certs[role][0], "--tls-key", certs[role][1]]


def cuvil(*args: str) -> list[str]:
    return [sys.executable, "-m", "cuvil.cli", *args]


def start_scheduler(root: str, certs: dict[str, tuple[str, str]], procs: list) -> str:
    env, home = board_env(root, "scheduler")
    log = open(os.path.join(home, "log.txt"), "w+")
    p = subprocess.Popen(cuvil("scheduler", "--port", "0", *tls(certs, "scheduler")), cwd=home, env=env,
                         stdout=log, stderr=subprocess.STDOUT)
    procs.append(p)
    end = time.monotonic() + 60
    while time.monotonic() < end and p.poll() is None:
        log.seek(0)
        m = re.search(r"listening at (tls://\S+)", log.read())
        if m:
            return m.group(1)
        time.sleep(0.2)
    log.seek(0)
    raise SystemExit(f"the scheduler did not start:\n{log.read()}")


def start_worker(root: str, name: str, address: str, certs: dict[str, tuple[str, str]]) -> subprocess.Popen:
    env, home = board_env(root, name)
    check = subprocess.run([sys.executable, "-c", "import cuvil.autotune.board, cuvil.runtime\n"
                            "for m in ('islpy', 'llvmlite'):\n"
                            "    try:\n        __import__(m)\n    except ImportError:\n        continue\n"
                            "    raise SystemExit(m + ' imports on the board')"], cwd=home, env=env,
                           capture_output=True, text=True)
    if check.returncode:
        raise SystemExit(f"board {name}'s environment is wrong: {check.stdout}{check.stderr}")
    log = open(os.path.join(home, "log.txt"), "w")
    return subprocess.Popen(cuvil("worker", address, "--board", BOARD, "--threads", "1", *tls(certs, "worker")),
                            cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT)


def client(address: str, certs: dict[str, tuple[str, str]]) -> object:
    from distributed import Client
    from distributed.security import Security

    sec = Security(tls_ca_file=certs["ca"][0], tls_client_cert=certs["tuner"][0], tls_client_key=certs["tuner"][1],
                   require_encryption=True)
    return Client(address, security=sec, timeout=30)


def kill_when_busy(c: object, worker: subprocess.Popen, wait_s: float = 120.0) -> bool:
    """SIGKILL ``worker`` once it is measuring (a task in progress there), or after ``wait_s``; whether it was
    measuring when it died."""
    pids = c.run(os.getpid)  # type: ignore[attr-defined]
    addr = next(a for a, pid in pids.items() if pid == worker.pid)
    end = time.monotonic() + wait_s
    busy = False
    while time.monotonic() < end and not busy:
        busy = bool(c.processing(workers=[addr]).get(addr))  # type: ignore[attr-defined]
        if not busy:
            time.sleep(0.05)
    worker.send_signal(signal.SIGKILL)
    return busy


def records(db: str) -> list[tuple]:
    from cuvil.autotune.database import Database

    if not os.path.exists(db):
        return []
    with Database(db) as d:
        return [(r.workload, r.config_hash, r.status, r.time_s, r.ref_time_s) for r in d.on(BOARD).records()]


def bench(db: str, model: str, rounds: int) -> tuple[float, float, str]:
    """(tuned ms, untuned ms, the bench's output) at one thread."""
    out = subprocess.run(cuvil("bench", model, "--tuning-db", db, "--threads", "1", "--rounds", str(rounds),
                               "--no-cold"), capture_output=True, text=True, cwd=REPO)
    text = out.stdout + out.stderr
    row = next((line for line in text.splitlines() if line.startswith(model + " ")), "")
    ms = re.findall(r"([\d.]+)ms", row)  # the tuned session, onnxruntime, the untuned session
    if out.returncode or len(ms) != 3:
        raise SystemExit(f"cuvil bench failed ({out.returncode}):\n{text}")
    return float(ms[0]), float(ms[2]), text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet18", help="the zoo model to tune (the Floor: resnet18)")
    ap.add_argument("--trials", type=int, default=32)
    ap.add_argument("--kill-after", type=int, default=10, help="kill one board once this many records are in")
    ap.add_argument("--rounds", type=int, default=21, help="interleaved rounds of cuvil bench (at least 10; this "
                    "shared machine swung 10%% between two runs of 11); 0: no speed check (the test's run: speed is "
                    "a benchmark's figure, not a unit test's)")
    ap.add_argument("--keep", default=None, help="keep the folders (certificates, logs, database) here")
    a = ap.parse_args(argv)
    root = a.keep or tempfile.mkdtemp(prefix="cuvil-floor-")
    os.makedirs(root, exist_ok=True)
    procs: list[subprocess.Popen] = []
    checks: list[tuple[str, bool]] = []
    t0 = time.monotonic()
    try:
        certs = make_certs(root)
        address = start_scheduler(root, certs, procs)
        workers = [start_worker(root, f"board{k}", address, certs) for k in (1, 2)]
        procs += workers
        watcher = client(address, certs)
        watcher.wait_for_workers(2, timeout=120)  # type: ignore[attr-defined]
        print(f"[floor] scheduler {address}, 2 boards of kind {BOARD!r} (islpy and llvmlite not importable there), "
              f"{time.monotonic() - t0:.0f} s", flush=True)
        db = os.path.join(root, "tuning.db")
        tuner_log = open(os.path.join(root, "tune.log"), "w+")
        tuner = subprocess.Popen(cuvil("tune", a.model, "--trials", str(a.trials), "--db", db, "--cluster",
                                       address, "--board", BOARD, *tls(certs, "tuner")), cwd=root,
                                 stdout=tuner_log, stderr=subprocess.STDOUT,
                                 env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                     filter(None, [REPO, os.environ.get("PYTHONPATH")]))))
        procs.append(tuner)
        before: list[tuple] = []
        while tuner.poll() is None:
            before = records(db)
            if len(before) >= a.kill_after:
                break
            time.sleep(0.5)
        killed, busy = tuner.poll() is None, False
        if killed:
            busy = kill_when_busy(watcher, workers[0])
            before = records(db)  # every record committed up to the kill
            print(f"[floor] killed board 1 (SIGKILL) {'while it measured' if busy else 'while idle'}, with "
                  f"{len(before)} records in, {time.monotonic() - t0:.0f} s", flush=True)
        watcher.close()  # type: ignore[attr-defined]
        code = tuner.wait()
        tuner_log.seek(0)
        log = tuner_log.read()
        print(log[-3000:], flush=True)
        after = records(db)
        statuses: dict[str, int] = {}
        for r in after:
            statuses[r[2]] = statuses.get(r[2], 0) + 1
        print(f"[floor] tune exited {code} after {time.monotonic() - t0:.0f} s; {len(after)} records of board "
              f"{BOARD!r}: {statuses}", flush=True)
        checks.append(("the tuner finished", code == 0))
        checks.append((f"one board killed mid-run, {'mid-measurement' if killed and busy else 'idle'} (after "
                       f"{len(before)} records)", killed))
        checks.append((f"every trial recorded ({len(after)} of {a.trials})", len(after) == a.trials))
        checks.append(("no record committed before the kill was lost or changed", set(before) <= set(after)))
        checks.append(("the run completed on the other board", workers[1].poll() is None and code == 0))
        if a.rounds <= 0:
            return _verdict(checks, t0)
        tuned, untuned, text = bench(db, a.model, a.rounds)
        print(text, flush=True)
        ratio = tuned / untuned
        checks.append((f"tuned {tuned:.2f} ms / untuned {untuned:.2f} ms = {ratio:.3f} (<= 1.02, median of "
                       f"{a.rounds} interleaved rounds)", ratio <= 1.02))
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        if a.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    return _verdict(checks, t0)


def _verdict(checks: list[tuple[str, bool]], t0: float) -> int:
    for what, ok in checks:
        print(f"[floor] {'PASS' if ok else 'FAIL'}: {what}")
    print(f"[floor] {time.monotonic() - t0:.0f} s in all")
    return 0 if checks and all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
