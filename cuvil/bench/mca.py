"""llvm-mca's estimate of a kernel's inner loop: find the loop in the assembly, run llvm-mca, read its report.

For CPUs that are not here (Arm cores above all) the speed of cuvil's code can still be estimated: LLVM's
own scheduling model of the core, through ``llvm-mca``, simulates a loop body and says how many cycles an
iteration takes and which execution resource limits it.  ``benchmarks/arm_mca.py`` applies this to the
contraction kernels of whole models; the pieces are here so a test or another tool can use them::

    asm = module.get_source("asm")                     # compiled for -mtriple=aarch64-linux-gnu -mcpu=neoverse-n1
    loop = hot_loop(asm, "k3")                         # k3's register-tile loop (most accumulating fmla)
    rep = run_mca(loop.text(), "neoverse-n1")          # llvm-mca-19 -mtriple=aarch64 -mcpu=neoverse-n1 ...
    pipes = fma_pipes("neoverse-n1")                   # FMA pipes in llvm-mca's model (2.0), and their names
    est = estimate(loop, rep, pipes)                   # cycles/iteration against the FMA bound

The **FMA bound** of a loop is its vector floating-point multiply/add instructions (``fmla``, ``fmul``,
``fadd``, ... on ``v`` or ``z`` registers) over the FMA pipes: the cycles an iteration takes if nothing
but the FP pipes limits it.  The pipes come from llvm-mca itself: 16 independent ``fmla v.4s`` are
simulated and pipes = 16 / their block reciprocal throughput (2 on neoverse-n1, 4 on neoverse-v1, and 1
on cortex-a76, which llvm-mca 19 models with the Cortex-A57 scheduling model: a 128-bit fmla takes both
of its 64-bit FP pipes).  Efficiency = bound / llvm-mca's cycles per iteration (total cycles / iterations).

Loops are found by their backward branches: in one function, a branch to a label above it closes a loop
spanning the label's line to the branch; a loop containing no other loop is innermost.  A kernel's
functions are those the graph linker and code generator emit for it: ``k3``, ``k3_checked``, ``k3.body``,
``k3.par0``, ...  llvm-mca sees the loop's lines as straight-line code (branches inside it included, as
if not taken), the usual way to analyse a loop body.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from dataclasses import dataclass, field

from cuvil.errors import CuvilError

MCA_NAMES = ("llvm-mca-19", "llvm-mca")
ITERATIONS = 100

_LABEL = re.compile(r"^\s*([A-Za-z_.$][\w.$]*):")
_BRANCH = re.compile(r"^\s*(?:b(?:\.\w+)?|cbn?z|tbn?z)\s+(?:[^/]*,\s*)?(\.L[\w$.]+)\s*(?://.*)?$")
_FP_OP = re.compile(r"^\s*(fmla|fmls|fmul|fmulx|fadd|fsub|fmad|fmsb|fnmla|fnmls)\s+([vz]\d+\.\d*[bhsd])\b")
_FMLA = re.compile(r"^\s*(fmla|fmls)\s+[vz]\d+\.")
_FPREG = re.compile(r"\b[vqdshbz](\d+)\b")  # a SIMD/FP register under any of its names (v3, q3, d3, s3, z3)


class McaError(CuvilError):
    """llvm-mca is missing, failed, or printed a report this module cannot read."""


# -- finding the loop ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Loop:
    """One loop of the assembly: the lines from its head label to its backward branch (inclusive)."""

    function: str
    label: str
    start: int  # line numbers in the whole listing
    end: int
    lines: tuple[str, ...]

    @property
    def instructions(self) -> tuple[str, ...]:
        """The instruction lines (no labels, directives or comments), stripped."""
        out = []
        for line in self.lines:
            s = line.split("//")[0].strip()
            if s and not s.startswith(".") and not _LABEL.match(s):
                out.append(s)
        return tuple(out)

    @property
    def fp_ops(self) -> int:
        """Vector floating-point multiply / add instructions (what the FMA pipes execute)."""
        return sum(1 for s in self.instructions if _FP_OP.match(s))

    @property
    def fmla(self) -> int:
        """Vector fused multiply-adds (``fmla``/``fmls``)."""
        return sum(1 for s in self.instructions if _FMLA.match(s))

    @property
    def accumulators(self) -> frozenset[int]:
        """The SIMD registers the loop's fmla/fmls accumulate into across iterations: those whose first
        mention in the body is as an fmla's destination (live-in, read-modify-write) and that nothing but
        fmla writes.  A contraction's register tile; not a polynomial's registers, which are set each
        iteration before its fmla."""
        seen: set[int] = set()
        carried: set[int] = set()
        written_otherwise: set[int] = set()
        for s in self.instructions:
            mnemonic, operands = _split(s)
            dest = _destinations(mnemonic, operands)
            if _FMLA.match(s):
                if dest and dest[0] not in seen:
                    carried.add(dest[0])
            else:
                written_otherwise.update(dest)
            seen.update(int(r) for r in _FPREG.findall(operands))
        return frozenset(carried - written_otherwise)

    @property
    def accumulating(self) -> int:
        """The fmla/fmls into :attr:`accumulators`: the multiply-adds of a contraction's inner loop."""
        acc = self.accumulators
        return sum(1 for s in self.instructions if _FMLA.match(s) and _destinations(*_split(s))[0] in acc)

    def text(self) -> str:
        """The loop as llvm-mca input: instructions and labels, without directives and comments."""
        out = []
        for line in self.lines:
            s = line.split("//")[0].rstrip()
            if not s.strip() or (s.strip().startswith(".") and not _LABEL.match(s)):
                continue
            out.append(s if _LABEL.match(s) else "\t" + s.strip())
        return "\n".join(out) + "\n"


def _split(instruction: str) -> tuple[str, str]:
    """(mnemonic, operands) of an instruction line."""
    parts = instruction.split(None, 1)
    return parts[0], parts[1] if len(parts) > 1 else ""


def _destinations(mnemonic: str, operands: str) -> list[int]:
    """The SIMD/FP registers an instruction writes: its first operand (a register list in braces counts
    whole; ``ldp`` writes two), none for stores and compares."""
    if (mnemonic.startswith(("st", "cmp", "fcmp", "cmn", "tst", "b.", "prfm"))
            or mnemonic in ("b", "bl", "br", "blr", "ret", "cbz", "cbnz", "tbz", "tbnz")):
        return []
    if operands.startswith("{"):
        first = operands[:operands.find("}") + 1]
    else:
        ops = operands.split(",")
        first = ",".join(ops[:2]) if mnemonic in ("ldp", "ldnp") else ops[0]
    return [int(r) for r in _FPREG.findall(first)]


def functions(asm: str) -> dict[str, tuple[int, int]]:
    """Each function of an assembly listing (a label that is not local, ``.L...``) -> its line range [start, end)."""
    lines = asm.splitlines()
    starts = []
    for n, line in enumerate(lines):
        m = _LABEL.match(line)
        if m and not m.group(1).startswith(".L") and not line[:1].isspace():
            starts.append((n, m.group(1)))
    return {name: (n, starts[k + 1][0] if k + 1 < len(starts) else len(lines)) for k, (n, name) in enumerate(starts)}


def find_loops(asm: str, names: set[str] | None = None) -> list[Loop]:
    """The loops of the functions ``names`` (every function when None), outermost and inner alike.

    A loop is a local label and the last branch below it, in the same function, that jumps back to it."""
    lines = asm.splitlines()
    loops = []
    for fn, (lo, hi) in functions(asm).items():
        if names is not None and fn not in names:
            continue
        labels: dict[str, int] = {}
        back: dict[str, int] = {}
        for n in range(lo, hi):
            m = _LABEL.match(lines[n])
            if m:
                labels[m.group(1)] = n
                continue
            b = _BRANCH.match(lines[n])
            if b and b.group(1) in labels:
                back[b.group(1)] = n  # the last backward branch to a label closes its loop
        for label, end in back.items():
            start = labels[label]
            loops.append(Loop(fn, label, start, end, tuple(lines[start:end + 1])))
    return sorted(loops, key=lambda x: x.start)


def innermost(loops: list[Loop]) -> list[Loop]:
    """The loops that contain no other loop."""
    return [a for a in loops if not any(b is not a and a.start <= b.start and b.end <= a.end
                                        and (b.start, b.end) != (a.start, a.end) for b in loops)]


def kernel_functions(asm: str, kernel: str) -> set[str]:
    """The functions emitted for linked kernel ``kernel``: itself, ``_checked``, ``.body``, ``.parN``..."""
    return {f for f in functions(asm)
            if f == kernel or f == f"{kernel}_checked" or f.startswith(f"{kernel}.")}


def hot_loop(asm: str, kernel: str | None = None) -> Loop | None:
    """The contraction's inner loop: of the innermost loops (of ``kernel``'s functions, or of the whole
    listing) with vector FP multiply/adds, the one with the most accumulating fmla (a register tile's),
    then the most FP multiply/adds (an epilogue's polynomial has many fmla, none accumulating); the
    earliest among equals; None when no innermost loop has vector FP multiply/adds."""
    names = kernel_functions(asm, kernel) if kernel is not None else None
    best, best_key = None, (0, 0)
    for loop in innermost(find_loops(asm, names)):
        key = (loop.accumulating, loop.fp_ops)
        if loop.fp_ops and key > best_key:
            best, best_key = loop, key
    return best


# -- llvm-mca's report --------------------------------------------------------------------------------


@dataclass(frozen=True)
class McaReport:
    """What llvm-mca's default views say about one block."""

    iterations: int
    instructions: int
    total_cycles: int
    uops: int
    block_rthroughput: float
    resources: tuple[tuple[str, str], ...]  # per pressure column: (index, resource name), e.g. ("2.0", "N1UnitL")
    pressure: tuple[float, ...]  # per column: cycles per iteration the resource (unit) is busy
    bottlenecks: dict[str, float] = field(default_factory=dict)  # -bottleneck-analysis: cause -> % of cycles

    @property
    def cycles_per_iteration(self) -> float:
        return self.total_cycles / self.iterations

    def unit_pressure(self) -> dict[str, float]:
        """Resource name -> mean cycles per iteration over its units (a group of two loads units counts once)."""
        sums: dict[str, list[float]] = {}
        for (_, name), p in zip(self.resources, self.pressure):
            sums.setdefault(name, []).append(p)
        return {name: sum(ps) / len(ps) for name, ps in sums.items()}


def _num(text: str, key: str, cast: type = int) -> float:
    m = re.search(rf"^{re.escape(key)}:\s*([0-9.]+)", text, re.M)
    if m is None:
        raise McaError(f"llvm-mca report without {key!r}")
    return cast(m.group(1))


def parse_report(text: str) -> McaReport:
    """Read llvm-mca's summary, resource list, resource pressure per iteration and (when present) the
    bottleneck analysis."""
    resources = tuple((m.group(1), m.group(2)) for m in re.finditer(r"^\[(\d+(?:\.\d+)?)\]\s+-\s+(\S+)\s*$",
                                                                    text[:text.find("Resource pressure per")], re.M))
    pressure: tuple[float, ...] = ()
    m = re.search(r"Resource pressure per iteration:[ \t]*\n([^\n]*)\n([^\n]*)\n", text)
    if m:
        columns = re.findall(r"\[([\d.]+)\]", m.group(1))
        values = m.group(2).split()
        if len(columns) != len(values):
            raise McaError("llvm-mca's resource pressure line does not match its columns")
        by_index = dict(zip(columns, (0.0 if v == "-" else float(v) for v in values)))
        pressure = tuple(by_index.get(idx, 0.0) for idx, _ in resources)
    bottlenecks = {}
    for b in re.finditer(r"^\s*(?:-\s+)?([A-Za-z][\w ]*?):?\s+\[\s*([\d.]+)%\s*\]", text, re.M):
        bottlenecks[b.group(1).strip()] = float(b.group(2))
    return McaReport(int(_num(text, "Iterations")), int(_num(text, "Instructions")), int(_num(text, "Total Cycles")),
                     int(_num(text, "Total uOps")), float(_num(text, "Block RThroughput", float)), resources,
                     pressure, bottlenecks)


def find_mca() -> str:
    """The llvm-mca executable (llvm-mca-19 first: Debian's llvm 14 knows few Arm cores)."""
    for name in MCA_NAMES:
        path = shutil.which(name)
        if path:
            return path
    raise McaError("llvm-mca not found: apt-get install llvm-19 (it provides llvm-mca-19)")


def mca_command(cpu: str, triple: str = "aarch64", iterations: int = ITERATIONS) -> list[str]:
    """The llvm-mca command line (reading the block on stdin)."""
    return [find_mca(), f"-mtriple={triple}", f"-mcpu={cpu}", f"-iterations={iterations}", "-bottleneck-analysis"]


def run_mca(block: str, cpu: str, triple: str = "aarch64", iterations: int = ITERATIONS) -> McaReport:
    """llvm-mca's report on ``block`` (assembly text) for ``cpu``."""
    proc = subprocess.run(mca_command(cpu, triple, iterations), input=block, capture_output=True, text=True,
                          timeout=120)
    if proc.returncode != 0:
        raise McaError(f"llvm-mca -mcpu={cpu} failed: {proc.stderr.strip()[:400]}")
    return parse_report(proc.stdout)


# -- the FMA bound ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pipes:
    """The FMA pipes of a CPU as llvm-mca models them: how many 128-bit fmla issue per cycle, on which units."""

    count: float
    units: tuple[str, ...]


CALIBRATION = "".join(f"\tfmla\tv{i}.4s, v30.4s, v31.4s\n" for i in range(16))


@functools.cache
def fma_pipes(cpu: str, triple: str = "aarch64") -> Pipes:
    """16 independent ``fmla v.4s`` through llvm-mca: pipes = 16 / block reciprocal throughput; the units
    are the resources they keep busy."""
    rep = run_mca(CALIBRATION, cpu, triple)
    units = tuple(dict.fromkeys(name for (_, name), p in zip(rep.resources, rep.pressure) if p > 0))
    return Pipes(16 / rep.block_rthroughput, units)


@dataclass(frozen=True)
class Estimate:
    """One loop against its FMA bound."""

    fp_ops: int
    fmla: int
    instructions: int
    cycles: float  # llvm-mca: cycles per iteration
    bound: float  # fp_ops / FMA pipes
    bottleneck: str
    report: McaReport

    @property
    def efficiency(self) -> float:
        return self.bound / self.cycles if self.cycles else 0.0


def bottleneck(rep: McaReport, pipes: Pipes) -> str:
    """The resource with the most cycles per iteration (the FMA pipes as one group), or "latency" when the
    iteration takes clearly longer than any resource is busy (a dependence chain sets the pace)."""
    units = rep.unit_pressure()
    groups = {}  # the FP pipes first: they win a tie
    if pipes.units and all(u in units for u in pipes.units):
        fp = sum(units.pop(u) for u in pipes.units) / len(pipes.units)
        groups["FP(" + "+".join(u.removeprefix(_prefix(pipes.units)) for u in pipes.units) + ")"] = fp
    groups.update(units)
    if not groups:
        return "?"
    name, busy = max(groups.items(), key=lambda kv: kv[1])
    if rep.cycles_per_iteration > 1.1 * busy:
        return f"latency ({name} {busy:.1f})"
    return f"{name} {busy:.1f}"


def _prefix(units: tuple[str, ...]) -> str:
    """The common prefix of the units' names up to 'Unit' (``N1UnitV0``, ``N1UnitV1`` -> ``N1Unit``)."""
    common = units[0]
    for u in units[1:]:
        while not u.startswith(common):
            common = common[:-1]
    k = common.find("Unit")
    return common[:k + 4] if k >= 0 else ""


def estimate(loop: Loop, rep: McaReport, pipes: Pipes) -> Estimate:
    return Estimate(loop.fp_ops, loop.fmla, len(loop.instructions), rep.cycles_per_iteration,
                    loop.fp_ops / pipes.count, bottleneck(rep, pipes), rep)
