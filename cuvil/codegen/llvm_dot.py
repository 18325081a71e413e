"""8-bit dot products in LLVM IR: :func:`cuvil.ir.expr.dot4` (four byte products per int32, summed).

An integer contraction (:mod:`cuvil.graph.ops.qkernels`) packs four reduction steps per int32 and sums
``dot4`` over them, because LLVM does not form the CPUs' dot-product instructions from a byte-wise
loop.  In a vector loop ``acc + dot4(u, s)`` becomes one instruction per register of lanes where the
target's features have one (never decided by the CPU's name):

- x86 ``vpdpbusd`` (unsigned x signed bytes; ``avx512vnni`` at 512 bits, with ``avx512vl`` or
  ``avxvnni`` at 256 and 128): ``llvm.x86.avx512.vpdpbusd.{512,256,128}``, the non-saturating form
  (int32 sums wrap as numpy's; ``vpdpbusds`` would clamp);
- AArch64 ``udot`` / ``sdot`` (same-signed bytes, ``dotprod``) and ``usdot`` (``i8mm``):
  ``llvm.aarch64.neon.*dot.v4i32.v16i8``.

Elsewhere (and for scalars) it is the byte arithmetic: :func:`dot4_bytes`.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir

from cuvil.codegen.llvm_expr import I32
from cuvil.ir.expr import DOT4_KINDS


def dot4_kinds(target: Any) -> dict[str, tuple[str, bool]]:
    """The :func:`cuvil.ir.expr.dot4` calls ``target`` has an instruction for: name -> (LLVM intrinsic
    name without its type suffix, whether it takes the bytes as ``<16 x i8>``)."""
    feats = set(getattr(target, "enabled_features", ()))
    triple = str(getattr(target, "triple", ""))
    if triple.startswith(("x86_64", "i686", "i386")):
        if "avx512vnni" in feats or "avxvnni" in feats:
            return {"dot4_u8s8": ("llvm.x86.avx512.vpdpbusd", False)}
        return {}
    if triple.startswith("aarch64"):
        kinds = {}
        if "dotprod" in feats:
            kinds |= {"dot4_u8u8": ("llvm.aarch64.neon.udot", True), "dot4_s8s8": ("llvm.aarch64.neon.sdot", True)}
        if "i8mm" in feats:
            kinds["dot4_u8s8"] = ("llvm.aarch64.neon.usdot", True)
        return kinds
    return {}


def dot4_width(target: Any, name: str, lanes: int) -> int | None:
    """The int32 lanes of the instruction that computes ``lanes`` lanes of the dot4 call ``name`` on
    ``target`` (x86: 16 with AVX512-VNNI, 8 or 4 with AVX512-VL or AVX-VNNI; AArch64: 4), None without
    one or for a lane count no register width divides into a power of two of registers."""
    if name not in dot4_kinds(target):
        return None
    feats = set(getattr(target, "enabled_features", ()))
    if str(getattr(target, "triple", "")).startswith("aarch64"):
        widths = [4]
    else:
        widths = ([16] if "avx512vnni" in feats else []) + (
            [8, 4] if "avxvnni" in feats or {"avx512vnni", "avx512vl"} <= feats else [])
    for w in widths:
        if lanes % w == 0 and not (lanes // w) & (lanes // w - 1):
            return w
    return None


def dot4_bytes(b: ir.IRBuilder, u: ir.Value, s: ir.Value, u_signed: bool = False, s_signed: bool = True
               ) -> ir.Value:
    """:func:`cuvil.ir.expr.dot4` of int32 scalars or vectors, byte by byte: both seen as bytes (bitcast),
    extended (``u`` unsigned and ``s`` signed unless the flags say otherwise), multiplied, and the four
    products of each int32 summed (lanes ``4 l + t`` gathered by shuffles). (Shifting each byte into
    place instead miscompiled once LLVM's SLP vectoriser merged the shifts of four unrolled rows.)"""
    n = u.type.count if isinstance(u.type, ir.VectorType) else 1
    i8s = ir.VectorType(ir.IntType(8), 4 * n)
    wide = ir.VectorType(I32, 4 * n)
    p = b.mul((b.sext if u_signed else b.zext)(b.bitcast(u, i8s), wide),
              (b.sext if s_signed else b.zext)(b.bitcast(s, i8s), wide))
    total: ir.Value | None = None
    for t in range(4):
        part = b.shuffle_vector(p, p, ir.Constant(ir.VectorType(I32, n), [4 * lane + t for lane in range(n)]))
        total = part if total is None else b.add(total, part)
    assert total is not None
    return total if n > 1 else b.extract_element(total, ir.Constant(I32, 0))


def dot4_vector(b: ir.IRBuilder, target: Any, name: str, u: ir.Value, s: ir.Value, acc: ir.Value | None
                ) -> ir.Value:
    """``acc + dot4(u, s)`` (``acc`` None: 0) over vectors of int32 lanes: one intrinsic per register of
    lanes where ``target`` has the instruction (the lanes split and joined by shuffles), the byte
    arithmetic otherwise."""
    n = u.type.count
    width = dot4_width(target, name, n)
    if width is None:
        d = dot4_bytes(b, u, s, *DOT4_KINDS[name])
        return d if acc is None else b.add(acc, d)
    if acc is None:
        acc = ir.Constant(u.type, None)  # zeroinitializer
    base, as_bytes = dot4_kinds(target)[name]
    vt = ir.VectorType(I32, width)
    bt = ir.VectorType(ir.IntType(8), 4 * width) if as_bytes else vt
    fname = f"{base}.v{width}i32.v{4 * width}i8" if as_bytes else f"{base}.{32 * width}"
    fn = b.module.globals.get(fname) or ir.Function(b.module, ir.FunctionType(vt, [vt, bt, bt]), fname)

    def part(v: ir.Value, lo: int) -> ir.Value:
        if width == n:
            return v
        return b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, width), list(range(lo, lo + width))))

    def byte_part(v: ir.Value, lo: int) -> ir.Value:
        return b.bitcast(part(v, lo), bt) if as_bytes else part(v, lo)

    parts = [b.call(fn, [part(acc, lo), byte_part(u, lo), byte_part(s, lo)]) for lo in range(0, n, width)]
    while len(parts) > 1:  # concatenate pairwise (n / width is a power of two)
        w = parts[0].type.count
        sel = ir.Constant(ir.VectorType(I32, 2 * w), list(range(2 * w)))
        parts = [b.shuffle_vector(parts[k], parts[k + 1], sel) for k in range(0, len(parts), 2)]
    return parts[0]
