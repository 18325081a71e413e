"""Targets: which machine code is generated for, and what that machine offers.

A target is written as a string and parsed once (instances are cached)::

    Target("llvm")                      # this host: triple, CPU and features from LLVM
    Target("llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a76 -mattr=+neon")
    Target("cuda -arch=sm_90")          # PTX through NVRTC (see docs/cuda.md)

Known CPUs bring their caches, core counts and features when ``-mcpu`` names
them: x86 (:data:`X86_CPUS`: the x86-64-v2/v3/v4 levels, Haswell, Skylake-X,
Cascade Lake, Ice Lake, Sapphire / Emerald Rapids, Alder Lake, Zen 3, Zen 4)
and ARM (:data:`ARM_CPUS`: Cortex-A53/A72/A76, Neoverse N1/V1/V2; NEON, and SVE
where the CPU has it).  ``Target("llvm -mcpu=x86-64-v3")`` is AVX2 code that any
newer x86 runs; on such a host it runs here (``is_host``), with the host's caches.

``CUVIL_HOST_TARGET=x86-64-v3`` (any CPU of :data:`X86_CPUS` whose features
this host has) narrows the host: ``Target("llvm")`` is then that CPU, so a whole
run (tests, benchmarks, sessions) compiles the code a machine with that ISA would
get, and runs it here.

``canonical`` spells out the triple, CPU and enabled features in a stable
order; tuning records and compile caches are keyed by it.  ``vector_bits``,
``num_cores`` and the cache sizes feed the schedulers' cost models.

Host detection imports llvmlite lazily, so ``import cuvil.target`` is cheap.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from typing import Any

from cuvil.cache import BoundedCache
from cuvil.errors import TargetError

_DEFAULT_CACHES = {"l1": 32 * 1024, "l2": 1024 * 1024, "l3": 8 * 1024 * 1024}


class CpuInfo:
    """What the cost models need to know about a CPU that is not this host."""

    __slots__ = ("cores", "features", "l1", "l2", "l3", "sve_bits")

    def __init__(self, cores: int, features: str, l1: int, l2: int, l3: int, sve_bits: int = 0):
        self.cores, self.features, self.sve_bits = cores, features, sve_bits
        self.l1, self.l2, self.l3 = l1, l2, l3


_K, _M = 1 << 10, 1 << 20
# typical boards/instances: L1 data per core; L2 per core (per cluster for the A53/A72); L3 or system cache
ARM_CPUS: dict[str, CpuInfo] = {
    "cortex-a53": CpuInfo(4, "+neon", 32 * _K, 512 * _K, 512 * _K),  # Raspberry Pi 3 (no L3: l3 = L2)
    "cortex-a72": CpuInfo(4, "+neon,+crc", 32 * _K, 1 * _M, 1 * _M),  # Raspberry Pi 4 (shared 1 MiB L2, no L3)
    "cortex-a76": CpuInfo(4, "+neon,+crc,+dotprod,+fullfp16", 64 * _K, 512 * _K, 2 * _M),  # Raspberry Pi 5
    "neoverse-n1": CpuInfo(64, "+neon,+crc,+dotprod,+fullfp16", 64 * _K, 1 * _M, 32 * _M),  # AWS Graviton2
    "neoverse-v1": CpuInfo(64, "+neon,+crc,+dotprod,+fullfp16,+sve,+bf16", 64 * _K, 1 * _M, 32 * _M,
                           sve_bits=256),  # AWS Graviton3
    "neoverse-v2": CpuInfo(72, "+neon,+crc,+dotprod,+fullfp16,+sve,+sve2,+bf16", 64 * _K, 1 * _M, 114 * _M,
                           sve_bits=128),  # NVIDIA Grace
}
# x86 CPUs by LLVM name: the features cuvil's code generator reads (LLVM's own names), cumulative levels
_V2 = "+sse,+sse2,+sse3,+ssse3,+sse4.1,+sse4.2,+popcnt,+cx16"
_V3 = _V2 + ",+avx,+avx2,+bmi,+bmi2,+f16c,+fma,+lzcnt,+movbe"
_V4 = _V3 + ",+avx512f,+avx512bw,+avx512cd,+avx512dq,+avx512vl"
_ICX = _V4 + ",+avx512vnni,+avx512vbmi,+avx512vbmi2,+avx512bitalg,+avx512vpopcntdq,+avx512ifma,+gfni,+vaes,+vpclmulqdq"
_SPR = _ICX + ",+avx512bf16,+avx512fp16,+avxvnni,+amx-tile,+amx-int8,+amx-bf16"
X86_CPUS: dict[str, CpuInfo] = {
    "x86-64": CpuInfo(4, "+sse,+sse2", 32 * _K, 256 * _K, 8 * _M),  # the baseline every x86-64 runs
    "x86-64-v2": CpuInfo(4, _V2, 32 * _K, 256 * _K, 8 * _M),  # SSE4.2 (Nehalem and later)
    "x86-64-v3": CpuInfo(4, _V3, 32 * _K, 1 * _M, 16 * _M),  # AVX2 + FMA (Haswell, Zen 1-3, Intel client)
    "x86-64-v4": CpuInfo(4, _V4, 48 * _K, 1 * _M, 32 * _M),  # AVX-512 F/BW/CD/DQ/VL
    "haswell": CpuInfo(4, _V3, 32 * _K, 256 * _K, 8 * _M),
    "skylake-avx512": CpuInfo(16, _V4, 32 * _K, 1 * _M, 22 * _M),
    "cascadelake": CpuInfo(16, _V4 + ",+avx512vnni", 32 * _K, 1 * _M, 22 * _M),
    "icelake-server": CpuInfo(16, _ICX, 48 * _K, 1280 * _K, 36 * _M),
    "sapphirerapids": CpuInfo(32, _SPR, 48 * _K, 2 * _M, 60 * _M),
    "emeraldrapids": CpuInfo(32, _SPR, 48 * _K, 2 * _M, 160 * _M),
    "alderlake": CpuInfo(8, _V3 + ",+avxvnni,+gfni,+vaes,+vpclmulqdq", 48 * _K, 1280 * _K, 24 * _M),  # P-cores
    "znver3": CpuInfo(8, _V3 + ",+sse4a,+vaes,+vpclmulqdq", 32 * _K, 512 * _K, 32 * _M),
    "znver4": CpuInfo(8, _ICX + ",+avx512bf16,+sse4a", 32 * _K, 1 * _M, 32 * _M),
}
HOST_TARGET_ENV = "CUVIL_HOST_TARGET"
# A vector of elements at most this many apart is one masked load of their span and a shuffle in the LLVM
# code generator (cuvil.codegen.llvm_vector_memory), not a load per lane; the auto-scheduler still vectorises
# a window read with such a stride (a stride-2 pool's columns, an int8 contraction's packed bytes)
SPAN_STRIDE = 4
_OPTIONS = {"llvm": ("mtriple", "mcpu", "mattr", "num-cores"), "cuda": ("arch",)}


class Target:
    """A parsed target string; ``Target(s)`` returns the same object for the same ``s``."""

    kind: str
    triple: str
    cpu: str
    features: str  # LLVM feature string as passed to the code generator ("+avx2,-avx512f,...")
    arch: str  # cuda only ("sm_90")
    is_host: bool
    num_cores: int
    l1_size: int
    l2_size: int
    l3_size: int

    _cache: dict[str, Target] = {}

    def __new__(cls, spec: str | Target = "llvm") -> Target:
        if isinstance(spec, Target):
            return spec
        if not isinstance(spec, str):
            raise TargetError(f"a target is a string such as 'llvm' or 'cuda -arch=sm_90', got {spec!r}")
        key = " ".join(spec.split())
        if key == "llvm":
            key = host_spec()
        if key not in cls._cache:
            obj = super().__new__(cls)
            obj._parse(key)
            cls._cache[key] = obj
        return cls._cache[key]

    @classmethod
    def current(cls) -> Target:
        """The host CPU (same as ``Target("llvm")``)."""
        return cls("llvm")

    # -- parsing --------------------------------------------------------------
    def _parse(self, spec: str) -> None:
        words = spec.split()
        if not words:
            raise TargetError("empty target string; use 'llvm' for this host's CPU")
        kind = words[0]
        if kind not in _OPTIONS:
            raise TargetError(f"unknown target kind {kind!r} in {spec!r}; known kinds: llvm, cuda")
        opts: dict[str, str] = {}
        for w in words[1:]:
            m = re.fullmatch(r"-([a-z-]+)=(\S+)", w)
            if m is None or m.group(1) not in _OPTIONS[kind]:
                allowed = ", ".join(f"-{o}=..." for o in _OPTIONS[kind])
                raise TargetError(f"unknown option {w!r} in target {spec!r}; {kind} accepts {allowed}")
            opts[m.group(1)] = m.group(2)
        self.kind = kind
        self.arch = ""
        caches = dict(_DEFAULT_CACHES)
        if kind == "cuda":
            self.arch = opts.get("arch", "sm_80")
            if not re.fullmatch(r"sm_\d+a?", self.arch):
                raise TargetError(f"cuda -arch must look like sm_90, got {self.arch!r}")
            self.triple, self.cpu, self.features, self.is_host = "nvptx64-nvidia-cuda", self.arch, "", False
            self.num_cores = 1
        else:
            host_triple = llvm_binding().get_process_triple()
            self.triple = opts.get("mtriple", host_triple)
            self.is_host = _same_machine(self.triple, host_triple)
            host_cpu = self.is_host and "mcpu" not in opts and "mattr" not in opts
            if host_cpu:
                self.cpu = llvm_binding().get_host_cpu_name()
                self.features = llvm_binding().get_host_cpu_features().flatten()
            else:
                self.cpu = opts.get("mcpu", "generic")
                self.features = _parse_mattr(opts.get("mattr", ""), spec)
            _check_llvm_target(self.triple, spec)
            if not host_cpu:
                _check_cpu(self.triple, self.cpu, self.features, spec)
            table = ARM_CPUS if self.triple.startswith("aarch64") else X86_CPUS if self.triple.startswith(
                "x86_64") else {}
            info = None if host_cpu else table.get(self.cpu)
            if info is not None:
                self.features = _merge_features(info.features, self.features)
            elif self.triple.startswith("aarch64") and not host_cpu and "neon" not in self.features:
                self.features = _merge_features("+neon", self.features)  # every AArch64 CPU has NEON
            if self.is_host and not host_cpu:
                # a named CPU on this host's architecture runs here only if this CPU has all it enables
                self.is_host = not self.missing_here()
            if info is not None and not self.is_host:
                caches.update(l1=info.l1, l2=info.l2, l3=info.l3)
            default_cores = (os.cpu_count() or 1) if self.is_host else info.cores if info is not None else 4
            try:
                self.num_cores = int(opts.get("num-cores", default_cores))
            except ValueError:
                raise TargetError(f"-num-cores must be an integer in {spec!r}") from None
            if self.is_host:  # the code runs on this machine: its caches are the ones that matter
                caches.update(host_caches())
        self.l1_size, self.l2_size, self.l3_size = caches["l1"], caches["l2"], caches["l3"]

    # -- derived facts --------------------------------------------------------
    def missing_here(self) -> list[str]:
        """The enabled features this machine's CPU lacks (empty: code for this target runs here)."""
        if self.kind != "llvm" or not _same_machine(self.triple, llvm_binding().get_process_triple()):
            return ["architecture " + self.triple.split("-")[0]]
        have = {k for k, v in llvm_binding().get_host_cpu_features().items() if v}
        return [f for f in self.enabled_features if f not in have]

    @property
    def enabled_features(self) -> tuple[str, ...]:
        """Names of the enabled features, sorted, without the '+'."""
        return tuple(sorted(f[1:] for f in self.features.split(",") if f.startswith("+")))

    @property
    def canonical(self) -> str:
        if self.kind == "cuda":
            return f"cuda -arch={self.arch}"
        attrs = ",".join("+" + f for f in self.enabled_features)
        return f"llvm -mtriple={self.triple} -mcpu={self.cpu}" + (f" -mattr={attrs}" if attrs else "")

    @property
    def vector_bits(self) -> int:
        """Width of the widest SIMD registers the features enable."""
        feats = set(self.enabled_features)
        if "avx512f" in feats:
            return 512
        if feats & {"avx", "avx2"}:
            return 256
        if any(f.startswith("sse") for f in feats) or "neon" in feats or self.triple.startswith(("x86_64", "aarch64")):
            return 128
        return 0

    @property
    def sve_bits(self) -> int:
        """SVE vector length of a known ARM CPU with SVE enabled (0 otherwise); code stays NEON-wide."""
        info = ARM_CPUS.get(self.cpu)
        return info.sve_bits if info is not None and "sve" in self.enabled_features else 0

    def vector_lanes(self, dtype_bits: int) -> int:
        return max(1, self.vector_bits // dtype_bits)

    def panel_lanes(self, itemsize: int) -> int:
        """Lanes of one vector of ``itemsize``-byte elements, at least 4 (a 128-bit vector of 32-bit values,
        also where the target has no vectors): the unit a packed weight panel is counted in."""
        return max(4, self.vector_bits // (8 * itemsize))

    def panel_width(self, itemsize: int) -> int:
        """The columns of a packed weight panel of ``itemsize``-byte elements: two vectors of lanes
        (:meth:`panel_lanes`), the width NR of the auto-scheduler's register tile for a contraction
        (:mod:`cuvil.schedule.auto`).  The op builders lay constant weights out in panels of this many
        columns (``W[n // P, k, n % P]``), so that each step of the reduction reads the tile's columns as
        contiguous vectors; one number here keeps the layout and the tile in step."""
        return 2 * self.panel_lanes(itemsize)

    @property
    def vector_registers(self) -> int:
        """SIMD registers the code generator can use: 32 with AVX-512 (zmm0-31) and on AArch64 (v0-31),
        16 with SSE/AVX (xmm/ymm0-15)."""
        if self.kind != "llvm":
            return 0
        return 32 if self.vector_bits >= 512 or self.triple.startswith("aarch64") else 16

    @property
    def fma_units(self) -> int:
        """Vector FMA pipes per core (each one vector FMA per cycle): 2 on x86 cores with FMA (the server
        cores; client cores with one 512-bit pipe, or Zen 4 splitting 512-bit FMAs over its two 256-bit
        pipes, reach half of that at 512 bits), 4 x 128-bit on Neoverse V1/V2, 2 on the other listed Arm
        cores, 1 on the A53.  An estimate: ``cuvil bench --ops`` measures the peak."""
        if self.kind != "llvm":
            return 0
        if self.triple.startswith("aarch64"):
            return 1 if self.cpu == "cortex-a53" else 4 if self.cpu in ("neoverse-v1", "neoverse-v2") else 2
        return 2 if "fma" in self.enabled_features else 1

    @property
    def fma_latency(self) -> int:
        """Cycles from one vector FMA to the next that uses its result: 4 on every core cuvil knows (Zen 2-4,
        Skylake and later, Neoverse, Cortex-A76; Haswell and Broadwell have 5).  A register tile needs
        pipes x latency independent accumulators to keep the pipes busy."""
        return 4

    def peak_flops_per_cycle(self, dtype_bits: int = 32) -> int:
        """FLOPs per cycle and core at the full vector width: lanes x FMA units x 2."""
        return self.vector_lanes(dtype_bits) * self.fma_units * 2

    def __repr__(self) -> str:
        return f"Target({self.canonical!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Target, (self.canonical,))


def host_spec() -> str:
    """The target string ``"llvm"`` stands for: this host, or the CPU ``CUVIL_HOST_TARGET`` narrows it to."""
    name = os.environ.get(HOST_TARGET_ENV, "").strip()
    if not name or name == "native":
        return "llvm"
    return _narrowed(name)


@functools.cache
def _narrowed(name: str) -> str:
    """``llvm -mcpu=NAME``, once checked to run here (a TargetError names what this CPU lacks)."""
    if name not in X86_CPUS and name not in ARM_CPUS:
        known = ", ".join(sorted(X86_CPUS) + sorted(ARM_CPUS))
        raise TargetError(f"{HOST_TARGET_ENV}={name!r} names no CPU cuvil knows; known: native, {known}")
    spec = f"llvm -mcpu={name}"
    missing = Target(spec).missing_here()
    if missing:
        raise TargetError(f"{HOST_TARGET_ENV}={name!r} cannot narrow this host: its CPU lacks "
                          f"{', '.join(missing)}; choose a CPU whose features this one has (x86-64-v3 runs on "
                          "any x86 with AVX2)")
    return spec


def llvm_binding() -> Any:
    import llvmlite.binding as llvm

    if not getattr(llvm_binding, "done", False):
        llvm.initialize_all_targets()
        llvm.initialize_all_asmprinters()
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        _load_libgcc(llvm)
        llvm_binding.done = True  # type: ignore[attr-defined]
    return llvm


def _load_libgcc(llvm: Any) -> None:
    """Conversions to float16 that the CPU has no instruction for (double -> half on every x86, float ->
    half without F16C) are calls to libgcc's helpers (``__truncdfhf2``, ...): load libgcc_s so the JIT
    resolves them even where nothing in the process has (a plain ``python`` that imported only numpy; a
    call to an unresolved helper jumped to address 0)."""
    import ctypes.util

    for name in (ctypes.util.find_library("gcc_s"), "libgcc_s.so.1"):
        if name:
            try:
                llvm.load_library_permanently(name)
                return
            except RuntimeError:
                continue


def _same_machine(triple: str, host: str) -> bool:
    arch = triple.split("-")[0]
    return arch == host.split("-")[0] and ("linux" in triple) == ("linux" in host)


def _parse_mattr(mattr: str, spec: str) -> str:
    feats = [f for f in mattr.split(",") if f]
    for f in feats:
        if not re.fullmatch(r"[+-][a-z0-9_.-]+", f):
            raise TargetError(f"feature {f!r} in {spec!r} must be +name or -name (e.g. -mattr=+avx2,+fma)")
    return ",".join(feats)


def _merge_features(defaults: str, given: str) -> str:
    """``defaults`` overridden by ``given`` (a "-sve" in ``given`` removes the default "+sve")."""
    out: dict[str, str] = {}
    for f in [x for x in defaults.split(",") if x] + [x for x in given.split(",") if x]:
        out[f[1:]] = f[0]
    return ",".join(sign + name for name, sign in out.items())


def _check_llvm_target(triple: str, spec: str) -> None:
    try:
        llvm_binding().Target.from_triple(triple)
    except RuntimeError as exc:
        raise TargetError(f"LLVM has no backend for triple {triple!r} (from {spec!r}): {exc}") from None


# (triple, cpu, features) -> LLVM's complaint about them ("" when it knows them all)
_CPU_CHECKS: BoundedCache[tuple[str, str, str], str] = BoundedCache("cuvil.target._CPU_CHECKS", 64)


def _check_cpu(triple: str, cpu: str, features: str, spec: str) -> None:
    """Refuse a CPU or feature name LLVM does not know: LLVM only warns on stderr and goes on with a
    generic CPU, which for x86-64 later aborts the process ("64-bit code requested on a subtarget that
    doesn't support it").  The names are checked once per process by making a target machine with stderr
    captured."""
    if cpu in ("generic", "") and not features:
        return
    key = (triple, cpu, features)
    if key not in _CPU_CHECKS:
        _CPU_CHECKS[key] = _llvm_complaint(triple, cpu, features)
    said = _CPU_CHECKS[key]
    if said:
        known = ", ".join(sorted(ARM_CPUS if triple.startswith("aarch64") else X86_CPUS))
        raise TargetError(f"LLVM does not know {said} in target {spec!r} (CPUs cuvil has facts for: {known}; "
                          f"any CPU name LLVM's backend for {triple.split('-')[0]} accepts works too)")


def _llvm_complaint(triple: str, cpu: str, features: str) -> str:
    """What LLVM writes to stderr when it makes a target machine for ``cpu`` and ``features``, reduced to
    the names it did not recognise ("" for none)."""
    import tempfile

    binding = llvm_binding()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as err:
        try:
            os.dup2(err.fileno(), 2)
            binding.Target.from_triple(triple).create_target_machine(cpu=cpu, features=features)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        text = err.read().decode(errors="replace")
    names = dict.fromkeys(re.findall(r"'([^']+)' is not a recognized (processor|feature)", text))
    return ", ".join(f"the {kind} {name!r}" for name, kind in names)


def host_caches() -> dict[str, int]:
    """L1 data / L2 / L3 sizes in bytes from sysfs, where Linux provides them."""
    out: dict[str, int] = {}
    root = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return out
    for entry in entries:
        if not entry.startswith("index"):
            continue
        try:
            with open(f"{root}/{entry}/level") as f:
                level = int(f.read())
            with open(f"{root}/{entry}/type") as f:
                kind = f.read().strip()
            with open(f"{root}/{entry}/size") as f:
                size = f.read().strip()
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or level not in (1, 2, 3):
            continue
        if cache_bytes(size):
            out[f"l{level}"] = cache_bytes(size)
    return out


def cache_bytes(text: str) -> int:
    """A /sys cache size (``32K``, ``1024K``, ``32M``) in bytes; 0 for text it does not read."""
    m = re.fullmatch(r"(\d+)\s*([KMG]?)", text.strip().upper())
    if not m:
        return 0
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]
