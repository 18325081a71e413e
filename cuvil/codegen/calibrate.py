"""The host's floating-point peak, measured: what "% of peak" in a profile is a fraction of.

A CPU's peak is lanes x FMA pipes x 2 x its clock (:meth:`cuvil.target.Target.peak_flops_per_cycle`),
and the clock is the fact a virtual machine does not tell: ``/proc/cpuinfo``'s MHz is the nominal one,
boost clocks vary, and Zen 4 splits a 512-bit FMA over two 256-bit pipes.  So the peak is measured once
per process and target: a loop of independent vector FMA chains (enough to cover the FMA latency of
every pipe, few enough to stay in registers), JIT-compiled for the target's CPU and features, timed at
one thread.  It is an upper bound no kernel with loads and stores can reach::

    from cuvil.codegen.calibrate import fma_peak
    fma_peak("llvm")                  # flop/s of one core, float32, at the target's vector width
    fma_peak("llvm -mcpu=x86-64-v3")  # AVX2 code on this (newer) CPU

Only the host can be measured (a target this machine cannot run raises TargetError).
"""

from __future__ import annotations

import ctypes
import functools
import struct
import time

from cuvil.errors import TargetError
from cuvil.target import Target, llvm_binding

_LOOP = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p)


def _ir(target: Target, lanes: int, chains: int) -> str:
    """LLVM IR of ``fma_loop(n, out)``: ``chains`` independent ``acc = fma(acc, m, c)`` on vectors of
    ``lanes`` float32 (a multiply and an add on an x86 without FMA), ``n`` times, their sum stored (so
    nothing is dead)."""
    vt = f"<{lanes} x float>"

    def splat(x: float) -> str:  # LLVM writes a float constant as the double of the same value, in hex
        bits = struct.unpack("<Q", struct.pack("<d", struct.unpack("<f", struct.pack("<f", x))[0]))[0]
        return "<" + ", ".join([f"float 0x{bits:016X}"] * lanes) + ">"

    init = splat(1.0)
    m, c = splat(1 - 2**-23), splat(1e-7)  # acc stays near 1: no overflow, no denormals
    body = []
    for j in range(chains):
        body.append(f"  %a{j} = phi {vt} [{init}, %entry], [%b{j}, %loop]")
    for j in range(chains):
        if "fma" in target.enabled_features or not target.triple.startswith("x86_64"):
            body.append(f"  %b{j} = call {vt} @llvm.fma.v{lanes}f32({vt} %a{j}, {vt} {m}, {vt} {c})")
        else:  # no FMA instruction (llvm.fma would be a call of fmaf per lane): a multiply and an add
            body.append(f"  %p{j} = fmul {vt} %a{j}, {m}")
            body.append(f"  %b{j} = fadd {vt} %p{j}, {c}")
    total = "%b0"
    tail = []
    for j in range(1, chains):
        tail.append(f"  %s{j} = fadd {vt} {total}, %b{j}")
        total = f"%s{j}"
    return "\n".join([
        f'target triple = "{target.triple}"',
        f"declare {vt} @llvm.fma.v{lanes}f32({vt}, {vt}, {vt})",
        "define void @fma_loop(i64 %n, ptr %out) {",
        "entry:",
        "  br label %loop",
        "loop:",
        "  %i = phi i64 [0, %entry], [%i.next, %loop]",
        *body,
        "  %i.next = add i64 %i, 1",
        "  %done = icmp sge i64 %i.next, %n",
        "  br i1 %done, label %exit, label %loop",
        "exit:",
        *tail,
        f"  store {vt} {total}, ptr %out, align 4",
        "  ret void",
        "}",
    ])


@functools.cache
def _measure(canonical: str, seconds: float) -> float:
    import llvmlite.binding as llvm

    target = Target(canonical)
    if target.kind != "llvm" or not target.is_host:
        raise TargetError(f"the FMA peak of {canonical!r} cannot be measured here: it is not this machine")
    lanes = max(1, target.vector_lanes(32))
    # independent chains: twice FMA latency x pipes, within the register file
    chains = max(1, min(target.vector_registers - 2, target.fma_latency * max(1, target.fma_units) * 2))
    llvm_binding()
    mod = llvm.parse_assembly(_ir(target, lanes, chains))
    mod.verify()
    tm = llvm.Target.from_triple(target.triple).create_target_machine(cpu=target.cpu, features=target.features,
                                                                        opt=2, codemodel="jitdefault")
    engine = llvm.create_mcjit_compiler(mod, tm)
    engine.finalize_object()
    fn = _LOOP(engine.get_function_address("fma_loop"))
    out = (ctypes.c_float * lanes)()
    n = 1000
    while True:  # grow the trip count until one call takes a tenth of the budget
        t0 = time.perf_counter()
        fn(n, ctypes.addressof(out))
        dt = time.perf_counter() - t0
        if dt > seconds / 10 or n > 1 << 40:
            break
        n *= 4
    best = dt
    for _ in range(5):  # the fastest of a few calls: a busy machine only ever slows a call down
        t0 = time.perf_counter()
        fn(n, ctypes.addressof(out))
        best = min(best, time.perf_counter() - t0)
    del engine
    return n * chains * lanes * 2 / best


def fma_peak(target: Target | str = "llvm", seconds: float = 0.05) -> float:
    """Float32 flop/s of one core of this machine running ``target``'s code: measured once per process."""
    return _measure(Target(target).canonical, seconds)
