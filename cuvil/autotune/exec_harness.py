"""The timing harness of a board with no Python, and the command prefix that reaches it.

:func:`harness_bytes` cross-builds ``harness.c`` (beside this file) for a board's architecture on the
tuner's host; :func:`harness_command` puts it where the prefix can run it; :func:`exec_facts` reads the
board's facts through the prefix with the harness's ``facts`` mode.  :mod:`cuvil.autotune.exec_board`
measures with it.

Two kinds of prefix: an emulator (its program is ``qemu-*``) runs a binary of this machine's file system,
so the harness is written to the caller's private temporary folder; anything else (``ssh pi``, ``adb
shell``, ``docker exec box``) is a remote command runner: the harness is copied there once per process
and harness build, through ``PREFIX sh -s`` (a script holding it in base64) into a private folder
(``mktemp -d``), and run from that path.  The board needs ``sh``, ``mktemp`` and ``base64``.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from cuvil.cache import BoundedCache
from cuvil.errors import ArgumentError, TargetError

__all__ = ["HARNESS_SOURCE", "compiler_for", "exec_facts", "harness_bytes", "harness_command", "parse_facts",
           "run_facts", "split_prefix"]

HARNESS_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness.c")

# Linux's AArch64 HWCAP / HWCAP2 bits (arch/arm64/include/uapi/asm/hwcap.h) by the names /proc/cpuinfo
# gives them, as cuvil.autotune.board reports a board's features (board_target maps them to LLVM's).  Read
# from the auxiliary vector: under qemu-user /proc/cpuinfo is the host's.
_HWCAP = ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop "
          "sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs sb paca pacg").split()
_HWCAP2 = ("dcpodp sve2 sveaes svepmull svebitperm svesha3 svesm4 flagm2 frint svei8mm svef32mm svef64mm svebf16 "
           "i8mm bf16 dgh rng bti mte").split()


def compiler_for(arch: str) -> str:
    """The C compiler that builds for ``arch``: this machine's ``cc`` for its own, else the GNU cross compiler."""
    if arch == platform.machine():
        names = ["cc", "gcc"]
    else:
        names = [f"{arch}-linux-gnu-gcc"]
    for name in names:
        if shutil.which(name):
            return name
    raise TargetError(f"building the timing harness for {arch!r} needs a C compiler: none of {', '.join(names)} "
                      f"is on PATH (Debian: apt-get install gcc-{arch.replace('_', '-')}-linux-gnu)")


def harness_bytes(facts: dict[str, Any]) -> bytes:
    """The timing harness (``harness.c``) built for the board's architecture (``facts["arch"]``), as an
    executable's bytes; built once per architecture and harness source in a process."""
    arch = facts.get("arch")
    if not isinstance(arch, str) or not arch:
        raise ArgumentError(f"harness_bytes: the board's facts name no architecture (facts['arch'] = {arch!r})")
    with open(HARNESS_SOURCE, "rb") as f:
        source = f.read()
    return _build_harness(arch, hashlib.sha256(source).hexdigest())


@functools.cache
def _build_harness(arch: str, source_sha: str) -> bytes:
    cc = compiler_for(arch)
    with tempfile.TemporaryDirectory(prefix="cuvil-harness-") as tmp:
        exe = os.path.join(tmp, "harness")
        proc = subprocess.run([cc, "-O2", "-std=gnu11", "-o", exe, HARNESS_SOURCE, "-ldl", "-lm"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise TargetError(f"building the timing harness for {arch} with {cc} failed:\n{proc.stderr.strip()}")
        with open(exe, "rb") as f:
            return f.read()


def split_prefix(prefix: str) -> list[str]:
    try:
        argv = shlex.split(prefix)
    except ValueError as exc:
        raise ArgumentError(f"the exec prefix {prefix!r} is not a valid command line: {exc}") from None
    return argv


def _emulator(argv: Sequence[str]) -> str | None:
    """The architecture a ``qemu-ARCH[-static]`` prefix emulates; None for any other prefix."""
    name = os.path.basename(argv[0]) if argv else ""
    if not name.startswith("qemu-"):
        return None
    return name[len("qemu-"):].removesuffix("-static")


# (remote prefix, harness sha256) -> its path there (a few boards per process; a miss copies it again)
_STAGED: BoundedCache[tuple[tuple[str, ...], str], str] = BoundedCache("cuvil.autotune.exec_harness._STAGED", 64)


def harness_command(argv: list[str], harness: bytes, tmp: str) -> list[str]:
    """The command that runs the harness through the prefix ``argv`` (staging it where it must run)."""
    if not argv or _emulator(argv):
        path = os.path.join(tmp, "harness")
        with open(path, "wb") as f:
            f.write(harness)
        os.chmod(path, 0o700)
        return [*argv, path]
    key = (tuple(argv), hashlib.sha256(harness).hexdigest())
    staged = _STAGED.get(key)
    if staged is None:
        body = base64.encodebytes(harness).decode()
        script = ('set -e\nd=$(mktemp -d "${TMPDIR:-/tmp}/cuvil-harness-XXXXXX")\n'
                  f"base64 -d > \"$d/harness\" <<'CUVIL_EOF'\n{body}CUVIL_EOF\n"
                  'chmod 700 "$d/harness"\necho "$d/harness"\n')
        try:
            proc = subprocess.run([*argv, "sh", "-s"], input=script.encode(), capture_output=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise TargetError(f"copying the timing harness through {shlex.join(argv)!r} failed: {exc}") from None
        lines = proc.stdout.decode(errors="replace").split()
        if proc.returncode != 0 or not lines:
            raise TargetError(f"copying the timing harness through {shlex.join(argv)!r} failed "
                              f"(exit status {proc.returncode}): {proc.stderr.decode(errors='replace').strip()}")
        staged = _STAGED[key] = lines[-1]
    return [*argv, staged]


def _board_arch(argv: list[str]) -> str:
    emulated = _emulator(argv)
    if emulated:
        return emulated
    if not argv:
        return platform.machine()
    try:
        proc = subprocess.run([*argv, "uname", "-m"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TargetError(f"the board behind {shlex.join(argv)!r} does not answer `uname -m`: {exc}") from None
    if proc.returncode != 0 or not proc.stdout.strip():
        raise TargetError(f"the board behind {shlex.join(argv)!r} does not answer `uname -m` "
                          f"(exit status {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout.split()[-1]


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)


def _features(arch: str, hwcap: list[str], flags: list[str]) -> list[str]:
    if arch == "aarch64" and len(hwcap) == 2:
        caps, caps2 = (int(h, 16) for h in hwcap)
        return sorted({n for b, n in enumerate(_HWCAP) if caps >> b & 1} |
                      {n for b, n in enumerate(_HWCAP2) if caps2 >> b & 1})
    return sorted(set(flags))


def run_facts(cmd: list[str], what: str) -> str:
    """The output of the harness's ``facts`` mode, run by ``cmd`` (:func:`harness_command`)."""
    try:
        proc = subprocess.run([*cmd, "facts"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TargetError(f"the timing harness did not run through {what!r}: {exc}") from None
    if proc.returncode != 0:
        raise TargetError(f"the timing harness did not run through {what!r} (exit status {proc.returncode}): "
                          f"{proc.stderr.strip()}")
    return proc.stdout


def parse_facts(text: str, prefix: str) -> dict[str, Any]:
    """The facts in the output of the harness's ``facts`` mode, with the keys of
    :func:`cuvil.autotune.board.facts`.  The versions are this process's: its Python checks and times
    the board's results.  ``board`` and ``threads`` are None (the board's worker fills them)."""
    import cuvil

    seen: dict[str, list[str]] = {}
    caches = {"L1d": 0, "L2": 0, "L3": 0}
    for line in text.splitlines():
        key, *rest = line.split() or [""]
        level = rest[0].replace("Data", "d").replace("Unified", "") if key == "cache" and len(rest) == 2 else ""
        if level in caches:
            caches[level] = max(caches[level], _size(rest[1]))
        elif key != "cache":
            seen[key] = rest
    arch = (seen.get("arch") or ["unknown"])[0]
    system = (seen.get("system") or ["linux"])[0].lower()
    return {"arch": arch, "triple": f"{arch}-unknown-{system}-gnu" if system == "linux" else f"{arch}-unknown-{system}",
            "cpu_features": _features(arch, seen.get("hwcap", []), seen.get("cpuflags", [])),
            "caches": caches, "cores": int((seen.get("cores") or ["1"])[0]),
            "governor": (seen.get("governor") or [None])[0], "cuvil": cuvil.__version__, "numpy": np.__version__,
            "python": platform.python_version(), "hostname": (seen.get("host") or [""])[0], "board": None,
            "threads": None, "exec": prefix}


def exec_facts(prefix: str) -> dict[str, Any]:
    """The facts of the board behind ``prefix``, read there by the harness (its ``facts`` mode): the
    architecture (uname; for a ``qemu-ARCH`` prefix, ARCH picks the harness to build), CPU features (the
    auxiliary vector on AArch64, /proc/cpuinfo's flags elsewhere), caches, cores, governor and host name.
    Needs the C compiler for the board's architecture on this machine (:func:`compiler_for`)."""
    argv = split_prefix(prefix)
    with tempfile.TemporaryDirectory(prefix="cuvil-exec-") as tmp:
        cmd = harness_command(argv, harness_bytes({"arch": _board_arch(argv)}), tmp)
        return parse_facts(run_facts(cmd, prefix), prefix)
