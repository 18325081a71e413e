"""What a board is: the facts :func:`cuvil.autotune.board.facts` reports, read from this machine.

Architecture, CPU features (/proc/cpuinfo's ``flags`` on x86, ``Features`` on AArch64), cache sizes
(/sys/devices/system/cpu/cpu0/cache), the cores this process may use, the frequency governor, the versions
that must match the tuner's.  Plain files and ``platform``: nothing here needs islpy, llvmlite or
``distributed`` (its version is read if it is installed).
"""

from __future__ import annotations

import os
import platform
import socket
from typing import Any

import numpy as np

_HOST_FACTS: dict[str, Any] | None = None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cpu_features(arch: str, cpuinfo: str | None = None) -> list[str]:
    """The CPU's feature flags, sorted, from ``cpuinfo`` (default: /proc/cpuinfo's text)."""
    text = (_read("/proc/cpuinfo") or "") if cpuinfo is None else cpuinfo
    field = "features" if arch.lower() in ("aarch64", "arm64") or arch.startswith("arm") else "flags"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() == field:
            return sorted(set(value.split()))
    return []


def _caches() -> dict[str, int]:
    """L1d, L2 and L3 sizes in bytes, from /sys (0 where the kernel does not say): the reader the compile
    target's cache model uses (importing cuvil.target loads no LLVM)."""
    from cuvil.target import host_caches

    found = host_caches()
    return {"L1d": found.get("l1", 0), "L2": found.get("l2", 0), "L3": found.get("l3", 0)}


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _triple(arch: str) -> str:
    system = platform.system().lower()
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(arch.lower(), arch.lower())
    if system == "darwin":
        return f"{'arm64' if arch == 'aarch64' else arch}-apple-darwin"
    return f"{arch}-unknown-{system}-gnu" if system == "linux" else f"{arch}-unknown-{system}"


def _versions() -> dict[str, str | None]:
    import cuvil

    try:
        import distributed

        dist: str | None = distributed.__version__
    except ImportError:
        dist = None
    return {"cuvil": cuvil.__version__, "numpy": np.__version__, "python": platform.python_version(),
            "distributed": dist}


def host_facts() -> dict[str, Any]:
    """This machine's facts (no board fields); read once per process."""
    global _HOST_FACTS
    if _HOST_FACTS is None:
        arch = platform.machine()
        _HOST_FACTS = {"arch": arch, "triple": _triple(arch), "cpu_features": cpu_features(arch),
                       "caches": _caches(), "cores": _cores(),
                       "governor": _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"),
                       **_versions(), "hostname": socket.gethostname()}
    return dict(_HOST_FACTS)
