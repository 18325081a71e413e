"""The compile target of a board, from the facts it publishes (:func:`cuvil.autotune.board.facts`).

A board runs no LLVM, so it cannot name its CPU the way LLVM does; it reports its architecture and the CPU
feature flags of ``/proc/cpuinfo``.  The tuner's host turns those into a target string:

- a board whose architecture and flags are exactly this host's compiles for ``"llvm"`` itself (this host's
  LLVM CPU name and features: the same code a user on this kind of machine gets, and records that
  ``cuvil.build(target="llvm")`` finds);
- another x86-64 board: ``llvm -mtriple=x86_64-linux-gnu -mcpu=x86-64-vN -mattr=+...`` (the level its flags
  reach, plus every flag LLVM has a feature for);
- an AArch64 board: ``llvm -mtriple=aarch64-linux-gnu -mcpu=generic -mattr=+neon,...`` from its hwcaps.

:func:`uncovered` is the check the other way round: the target features a board's flags do not provide
(a board that cannot run what a given target compiles).
"""

from __future__ import annotations

from typing import Any

from cuvil.target import X86_CPUS

# /proc/cpuinfo flag -> LLVM feature (flags absent here have no code generation meaning for cuvil)
X86_FEATURES = {
    "sse": "sse", "sse2": "sse2", "pni": "sse3", "ssse3": "ssse3", "sse4_1": "sse4.1", "sse4_2": "sse4.2",
    "sse4a": "sse4a", "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c", "bmi1": "bmi", "bmi2": "bmi2",
    "abm": "lzcnt", "popcnt": "popcnt", "movbe": "movbe", "adx": "adx", "aes": "aes", "pclmulqdq": "pclmul",
    "sha_ni": "sha", "vaes": "vaes", "vpclmulqdq": "vpclmulqdq", "gfni": "gfni", "cx16": "cx16",
    "avx512f": "avx512f", "avx512cd": "avx512cd", "avx512bw": "avx512bw", "avx512dq": "avx512dq",
    "avx512vl": "avx512vl", "avx512ifma": "avx512ifma", "avx512vbmi": "avx512vbmi",
    "avx512_vbmi2": "avx512vbmi2", "avx512_vnni": "avx512vnni", "avx512_bitalg": "avx512bitalg",
    "avx512_vpopcntdq": "avx512vpopcntdq", "avx512_bf16": "avx512bf16", "avx512_fp16": "avx512fp16",
    "avx_vnni": "avxvnni", "amx_tile": "amx-tile", "amx_int8": "amx-int8", "amx_bf16": "amx-bf16",
}
AARCH64_FEATURES = {
    "asimd": "neon", "asimddp": "dotprod", "asimdhp": "fullfp16", "crc32": "crc", "sve": "sve", "sve2": "sve2",
    "i8mm": "i8mm", "bf16": "bf16", "atomics": "lse", "asimdrdm": "rdm",
}
# (-mcpu, the LLVM features it implies), highest first: the levels of cuvil.target's table
_X86_LEVELS = tuple((name, {f[1:] for f in X86_CPUS[name].features.split(",")})
                    for name in ("x86-64-v4", "x86-64-v3", "x86-64-v2"))


def _arch(facts: dict[str, Any]) -> str:
    arch = str(facts.get("arch") or "").lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(arch, arch)


def llvm_features(facts: dict[str, Any]) -> set[str]:
    """The LLVM features a board's CPU flags provide (those cuvil knows; see the tables above)."""
    table = X86_FEATURES if _arch(facts) == "x86_64" else AARCH64_FEATURES if _arch(facts) == "aarch64" else {}
    return {table[f] for f in facts.get("cpu_features") or () if f in table}


def same_cpu(facts: dict[str, Any], host: dict[str, Any]) -> bool:
    """Whether a board's CPU is this host's: the same architecture and the same feature flags."""
    return _arch(facts) == _arch(host) and set(facts.get("cpu_features") or ()) == set(host.get("cpu_features")
                                                                                       or ())


def target_of(facts: dict[str, Any], host: dict[str, Any] | None = None) -> str:
    """The target string cuvil compiles for a board with ``facts`` (``host``: this machine's facts)."""
    from cuvil.errors import TargetError

    arch = _arch(facts)
    cores = facts.get("cores")
    tail = f" -num-cores={int(cores)}" if isinstance(cores, int) and cores > 0 else ""
    if host is not None and same_cpu(facts, host) and not facts.get("exec"):
        return "llvm"
    feats = sorted(llvm_features(facts))
    if arch == "x86_64":
        cpu = next((name for name, need in _X86_LEVELS if need <= set(feats)), "x86-64")
        attrs = ",".join("+" + f for f in feats)
        return f"llvm -mtriple=x86_64-linux-gnu -mcpu={cpu}" + (f" -mattr={attrs}" if attrs else "") + tail
    if arch == "aarch64":
        attrs = ",".join("+" + f for f in sorted(set(feats) | {"neon"}))
        return f"llvm -mtriple=aarch64-linux-gnu -mcpu=generic -mattr={attrs}" + tail
    raise TargetError(f"board {facts.get('board')!r} reports the architecture {facts.get('arch')!r}; cuvil "
                      "compiles for x86_64 and aarch64 boards")


def uncovered(target: Any, facts: dict[str, Any]) -> list[str]:
    """The features ``target`` compiles with that a board with ``facts`` lacks (only features cuvil knows how
    to read from a board's flags are compared), or ``["architecture ..."]`` when the architectures differ."""
    from cuvil.target import Target

    tgt = Target(target)
    arch = tgt.triple.split("-")[0]
    if arch != _arch(facts):
        return [f"architecture {arch} (the board is {facts.get('arch')})"]
    known = set(X86_FEATURES.values()) if arch == "x86_64" else set(AARCH64_FEATURES.values())
    have = llvm_features(facts) | ({"neon"} if arch == "aarch64" else set())
    return sorted(f for f in tgt.enabled_features if f in known and f not in have)
