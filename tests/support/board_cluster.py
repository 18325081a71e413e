"""Helpers for tests that start tuning boards: TLS certificates, and ``cuvil scheduler`` / ``cuvil worker`` as
subprocesses, each in its own folder and HOME, the workers where islpy and llvmlite cannot be imported
(as on a board that has only ``pip install --no-deps cuvil``, numpy and distributed).

    certs = make_certs(tmp_path / "certs")
    with start_scheduler(tmp_path, certs) as sched, start_worker(tmp_path, sched.address, "b1", certs) as w:
        client = Client(sched.address, security=client_security(certs))
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

BLOCKER = '''"""Makes islpy and llvmlite unimportable (a board's environment; tests/support/board_cluster.py)."""
import sys


class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("islpy", "llvmlite"):
            raise ImportError(f"{name} is not installed on this board (blocked by the test)")
        return None


sys.meta_path.insert(0, _Blocked())
'''


def blocked_path(folder: Path) -> str:
    """A folder holding a sitecustomize.py that blocks islpy and llvmlite: put it first on PYTHONPATH."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(BLOCKER)
    return str(folder)


def env_for(home: Path, block: bool) -> dict[str, str]:
    """The environment of a board process: its own HOME and temporary folder, cuvil importable (the
    checkout first), islpy and llvmlite blocked if ``block``."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "tmp").mkdir(exist_ok=True)
    path = [blocked_path(home / "block")] if block else []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUVIL_BOARD", "DASK_"))}
    env.update(HOME=str(home), TMPDIR=str(home / "tmp"), PYTHONPATH=os.pathsep.join(path + [str(ROOT)]),
               PYTHONUNBUFFERED="1")
    return env


def make_certs(folder: Path) -> dict[str, str]:
    """A CA, a certificate for the cluster's nodes (scheduler and workers; 127.0.0.1 and localhost) and one
    for clients, all signed by the CA; PEM files in ``folder``.  Also a certificate from another CA
    (``rogue``), which the cluster must refuse."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def save(stem: str, key: Any, cert: Any) -> None:
        (folder / f"{stem}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                               serialization.PrivateFormat.PKCS8,
                                                               serialization.NoEncryption()))
        (folder / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def ca(stem: str) -> tuple[Any, Any]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(stem)).issuer_name(name(stem))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
                .sign(key, hashes.SHA256()))
        save(stem, key, cert)
        return key, cert

    def leaf(stem: str, issuer: tuple[Any, Any]) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        san = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
        cert = (x509.CertificateBuilder().subject_name(name(stem)).issuer_name(issuer[1].subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(san, critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .sign(issuer[0], hashes.SHA256()))
        save(stem, key, cert)

    cluster_ca = ca("ca")
    leaf("node", cluster_ca)
    leaf("client", cluster_ca)
    leaf("rogue", ca("rogue-ca"))
    return {"ca": str(folder / "ca.crt"), "node_cert": str(folder / "node.crt"), "node_key": str(folder / "node.key"),
            "client_cert": str(folder / "client.crt"), "client_key": str(folder / "client.key"),
            "rogue_cert": str(folder / "rogue.crt"), "rogue_key": str(folder / "rogue.key")}


def tls_args(certs: dict[str, str] | None, who: str = "node") -> list[str]:
    if certs is None:
        return []
    return ["--tls-ca-file", certs["ca"], "--tls-cert", certs[f"{who}_cert"], "--tls-key", certs[f"{who}_key"]]


def client_security(certs: dict[str, str], who: str = "client") -> Any:
    from distributed.security import Security

    return Security(tls_ca_file=certs["ca"], tls_client_cert=certs[f"{who}_cert"],
                    tls_client_key=certs[f"{who}_key"], require_encryption=True)


class Server:
    """A ``cuvil scheduler`` or ``cuvil worker`` subprocess; ``address`` once it printed its ready line."""

    def __init__(self, argv: list[str], home: Path, block: bool, ready: str, timeout_s: float = 60.0,
                 prefix: tuple[str, ...] = ()):
        self.home = home
        env = env_for(home, block)
        self.log = open(home / "stderr.log", "wb")
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "cuvil.cli", *argv], cwd=str(home), env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.log, text=True)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout], daemon=True).start()  # type: ignore
        deadline = time.monotonic() + timeout_s
        self.line = ""
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if line.startswith(ready):
                self.line = line.strip()
                break
        if not self.line:
            self.stop()
            raise RuntimeError(f"{' '.join(argv)} did not start: {self.stderr()[-3000:]}")
        self.address = next(w.rstrip(",") for w in self.line.split() if "://" in w and w.startswith(("tls", "tcp")))

    def stderr(self) -> str:
        self.log.flush()
        return (self.home / "stderr.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_scheduler(tmp: Path, certs: dict[str, str] | None, *extra: str) -> Server:
    """``cuvil scheduler`` on 127.0.0.1, a free port, TLS if ``certs``."""
    return Server(["scheduler", "--port", "0", *tls_args(certs), *extra], tmp / "scheduler", block=True,
                  ready="cuvil scheduler: listening at")


def start_worker(tmp: Path, address: str, board: str, certs: dict[str, str] | None, *extra: str,
                 home: str | None = None, prefix: tuple[str, ...] = ()) -> Server:
    """``cuvil worker ADDRESS --board BOARD`` where islpy and llvmlite cannot be imported (run through
    ``prefix``, e.g. ``ip netns exec NS``, if given)."""
    return Server(["worker", address, "--board", board, *tls_args(certs), *extra], tmp / (home or f"worker-{board}"),
                  block=True, ready="cuvil worker: board", prefix=prefix)
