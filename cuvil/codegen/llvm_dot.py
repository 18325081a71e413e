"""Packed dot products in LLVM IR: :func:`cuvil.ir.expr.dot4` (four byte products per int32, summed),
:func:`cuvil.ir.expr.dot2_i16` (two 16-bit products per int32, summed in 32 bits) and
:func:`cuvil.ir.expr.dot2_bf16` (two bfloat16 products per int32, summed in float32).

An integer contraction (:mod:`cuvil.graph.ops.quant.kernels`) packs four reduction steps per int32 and sums
``dot4`` over them, because LLVM does not form the CPUs' dot-product instructions from a byte-wise
loop.  In a vector loop ``acc + dot4(u, s)`` becomes one instruction per register of lanes where the
target's features have one (never decided by the CPU's name):

- x86 ``vpdpbusd`` (unsigned x signed bytes; ``avx512vnni`` at 512 bits, with ``avx512vl`` or
  ``avxvnni`` at 256 and 128): ``llvm.x86.avx512.vpdpbusd.{512,256,128}``, the non-saturating form
  (int32 sums wrap as numpy's; ``vpdpbusds`` would clamp);
- AArch64 ``udot`` / ``sdot`` (same-signed bytes, ``dotprod``) and ``usdot`` (``i8mm``):
  ``llvm.aarch64.neon.*dot.v4i32.v16i8``.

Elsewhere (and for scalars) it is the byte arithmetic: :func:`dot4_bytes`.

An x86 CPU without VNNI has no exact 8-bit dot product (``vpmaddubsw`` clamps its 16-bit pair sums), so
the integer contraction widens its bytes to 16 bits when it packs them, two reduction steps per int32,
and sums ``dot2_i16``: ``acc + dot2_i16(u, s)`` is ``vpmaddwd`` (``llvm.x86.avx2.pmadd.wd``,
``llvm.x86.sse2.pmadd.wd``, ``llvm.x86.avx512.pmaddw.d.512``) and an add, which never saturate.  Where
the unsigned operand of a ``dot4_u8s8`` is ``x & c`` with every byte of ``c`` below 128 (4-bit weights:
``w & 0x0F0F0F0F``), ``vpmaddubsw`` cannot saturate (``2 * 127 * 128 < 32767``) and the code generator
emits it and a ``vpmaddwd`` by ones (:func:`dot4_pmaddubsw`) instead of the byte arithmetic.

``acc + dot2_bf16(u, s)`` (float32 lanes) becomes x86's ``vdpbf16ps`` (``avx512bf16``; at 256 and 128
bits with ``avx512vl``): ``llvm.x86.avx512bf16.dpbf16ps.{512,256,128}``, whose operands are vectors of
LLVM's ``bfloat`` (the int32 lanes bitcast).  Elsewhere it is float32 arithmetic on the halves widened
by a shift (:func:`dot2_bf16_arith`).  :func:`bf16_pair_arith` rounds two float32 to bfloat16 (nearest,
ties to even) and packs them, with integer arithmetic on the bits (scalar or vector).
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir

from cuvil.codegen.llvm_expr import I32
from cuvil.ir.expr import DOT2_BF16, DOT2_I16, DOT4_KINDS


def _lanes(b: ir.IRBuilder, v: ir.Value, lo: int, width: int) -> ir.Value:
    """Lanes ``lo .. lo + width`` of vector ``v`` (``v`` itself when it has no more)."""
    if v.type.count == width:
        return v
    return b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, width), list(range(lo, lo + width))))


def _per_register(b: ir.IRBuilder, n: int, width: int, one: Any) -> ir.Value:
    """``one(lo)`` (an instruction's result on lanes ``lo .. lo + width``) for each register of ``width``
    lanes of an ``n``-lane vector, concatenated pairwise (``n / width`` is a power of two)."""
    parts = [one(lo) for lo in range(0, n, width)]
    while len(parts) > 1:
        w = parts[0].type.count
        sel = ir.Constant(ir.VectorType(I32, 2 * w), list(range(2 * w)))
        parts = [b.shuffle_vector(parts[k], parts[k + 1], sel) for k in range(0, len(parts), 2)]
    return parts[0]


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


def dot4_vector(b: ir.IRBuilder, target: Any, name: str, u: ir.Value, s: ir.Value, acc: ir.Value | None,
                u_small: bool = False) -> ir.Value:
    """``acc + dot4(u, s)`` (``acc`` None: 0) over vectors of int32 lanes: one intrinsic per register of
    lanes where ``target`` has the instruction (the lanes split and joined by shuffles); without one,
    ``vpmaddubsw`` + ``vpmaddwd`` when ``u_small`` says that every byte of ``u`` is below 128
    (:func:`dot4_pmaddubsw`), the byte arithmetic otherwise."""
    n = u.type.count
    width = dot4_width(target, name, n)
    if width is None:
        pw = pmaddubsw_width(target, n) if name == "dot4_u8s8" and u_small else None
        d = dot4_bytes(b, u, s, *DOT4_KINDS[name]) if pw is None else dot4_pmaddubsw(b, pw, u, s)
        return d if acc is None else b.add(acc, d)
    if acc is None:
        acc = ir.Constant(u.type, None)  # zeroinitializer
    base, as_bytes = dot4_kinds(target)[name]
    vt = ir.VectorType(I32, width)
    bt = ir.VectorType(ir.IntType(8), 4 * width) if as_bytes else vt
    fname = f"{base}.v{width}i32.v{4 * width}i8" if as_bytes else f"{base}.{32 * width}"
    fn = b.module.globals.get(fname) or ir.Function(b.module, ir.FunctionType(vt, [vt, bt, bt]), fname)

    def byte_part(v: ir.Value, lo: int) -> ir.Value:
        return b.bitcast(_lanes(b, v, lo, width), bt) if as_bytes else _lanes(b, v, lo, width)

    return _per_register(b, n, width, lambda lo: b.call(fn, [_lanes(b, acc, lo, width), byte_part(u, lo),
                                                              byte_part(s, lo)]))


# -- 16-bit pairs ------------------------------------------------------------------------------


def i16_dot_width(target: Any, lanes: int) -> int | None:
    """The int32 lanes of the ``vpmaddwd`` that computes ``lanes`` lanes of ``dot2_i16`` on ``target``
    (16 with AVX512-BW, 8 with AVX2, 4 with SSE2), None on other architectures or for a lane count no
    register width divides into a power of two of registers."""
    feats = set(getattr(target, "enabled_features", ()))
    if not str(getattr(target, "triple", "")).startswith("x86_64"):
        return None
    widths = ([16] if "avx512bw" in feats else []) + ([8] if "avx2" in feats else []) + [4]
    for w in widths:
        if lanes % w == 0 and not (lanes // w) & (lanes // w - 1):
            return w
    return None


_PMADDWD = {16: "llvm.x86.avx512.pmaddw.d.512", 8: "llvm.x86.avx2.pmadd.wd", 4: "llvm.x86.sse2.pmadd.wd"}


def dot2_i16_arith(b: ir.IRBuilder, u: ir.Value, s: ir.Value) -> ir.Value:
    """:func:`cuvil.ir.expr.dot2_i16` of int32 scalars or vectors in 32-bit arithmetic: each half
    sign-extended by shifts, the two products added."""
    sixteen = _splat(u, 16)

    def halves(v: ir.Value) -> tuple[ir.Value, ir.Value]:
        return b.ashr(b.shl(v, sixteen), sixteen), b.ashr(v, sixteen)

    (u0, u1), (s0, s1) = halves(u), halves(s)
    return b.add(b.mul(u0, s0), b.mul(u1, s1))


def dot2_i16_vector(b: ir.IRBuilder, target: Any, u: ir.Value, s: ir.Value, acc: ir.Value | None) -> ir.Value:
    """``acc + dot2_i16(u, s)`` over vectors of int32 lanes: one ``vpmaddwd`` and one add per register of
    lanes on x86 (the lanes split and joined by shuffles), 32-bit arithmetic elsewhere."""
    n = u.type.count
    width = i16_dot_width(target, n)
    if width is None:
        d = dot2_i16_arith(b, u, s)
        return d if acc is None else b.add(acc, d)
    vt = ir.VectorType(I32, width)
    ht = ir.VectorType(ir.IntType(16), 2 * width)
    fname = _PMADDWD[width]
    fn = b.module.globals.get(fname) or ir.Function(b.module, ir.FunctionType(vt, [ht, ht]), fname)

    d = _per_register(b, n, width, lambda lo: b.call(fn, [b.bitcast(_lanes(b, u, lo, width), ht),
                                                          b.bitcast(_lanes(b, s, lo, width), ht)]))
    return d if acc is None else b.add(acc, d)


# -- bfloat16 pairs ---------------------------------------------------------------------------


class BFloatType(ir.Type):
    """LLVM's ``bfloat`` (llvmlite has no such type): only ever the element of a vector that an int32
    vector is bitcast to for the ``vdpbf16ps`` intrinsic."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BFloatType)

    def __hash__(self) -> int:
        return hash(BFloatType)


def bf16_dot_width(target: Any, lanes: int) -> int | None:
    """The float32 lanes of the ``vdpbf16ps`` that computes ``lanes`` lanes of ``acc + dot2_bf16`` on
    ``target`` (16 with AVX512-BF16, 8 or 4 with AVX512-VL too), None without the instruction or for a
    lane count no register width divides into a power of two of registers."""
    feats = set(getattr(target, "enabled_features", ()))
    if not str(getattr(target, "triple", "")).startswith("x86_64") or "avx512bf16" not in feats:
        return None
    widths = [16] + ([8, 4] if "avx512vl" in feats else [])
    for w in widths:
        if lanes % w == 0 and not (lanes // w) & (lanes // w - 1):
            return w
    return None


def _like(v: ir.Value, elem: ir.Type) -> ir.Type:
    return ir.VectorType(elem, v.type.count) if isinstance(v.type, ir.VectorType) else elem


def _splat(v: ir.Value, value: int) -> ir.Constant:
    return ir.Constant(_like(v, I32), value)


def dot2_bf16_arith(b: ir.IRBuilder, u: ir.Value, s: ir.Value) -> ir.Value:
    """:func:`cuvil.ir.expr.dot2_bf16` of int32 scalars or vectors in float32 arithmetic: each half
    widened to float32 by putting its bits on top (a bf16 is the upper half of a float32), the two
    exact products added."""
    ft = _like(u, ir.FloatType())
    mask = _splat(u, -65536)  # 0xFFFF0000

    def halves(v: ir.Value) -> tuple[ir.Value, ir.Value]:
        return b.bitcast(b.shl(v, _splat(v, 16)), ft), b.bitcast(b.and_(v, mask), ft)

    (u0, u1), (s0, s1) = halves(u), halves(s)
    return b.fadd(b.fmul(u1, s1), b.fmul(u0, s0))


def bf16_pair_arith(b: ir.IRBuilder, lo: ir.Value, hi: ir.Value) -> ir.Value:
    """:func:`cuvil.ir.expr.bf16_pair` of float32 scalars or vectors: each rounded to nearest even by
    adding ``0x7FFF + (bit 16)`` to its bits (a carry into the exponent rounds up to the next binade or
    to infinity, as it should), a NaN made quiet instead (adding could turn it into an infinity), and
    the upper halves packed, ``lo``'s in the low 16 bits."""
    it = _like(lo, I32)

    def rounded(x: ir.Value) -> ir.Value:
        bits = b.bitcast(x, it)
        odd = b.and_(b.lshr(bits, _splat(x, 16)), _splat(x, 1))
        near = b.add(bits, b.add(odd, _splat(x, 0x7FFF)))
        return b.select(b.fcmp_unordered("uno", x, x), b.or_(bits, _splat(x, 0x00400000)), near)

    return b.or_(b.lshr(rounded(lo), _splat(lo, 16)), b.and_(rounded(hi), _splat(hi, -65536)))


def dot2_bf16_vector(b: ir.IRBuilder, target: Any, u: ir.Value, s: ir.Value, acc: ir.Value | None) -> ir.Value:
    """``acc + dot2_bf16(u, s)`` over vectors of lanes (int32 pairs in, float32 out): one ``vdpbf16ps``
    per register of lanes where ``target`` has AVX512-BF16 (the lanes split and joined by shuffles),
    float32 arithmetic otherwise."""
    n = u.type.count
    width = bf16_dot_width(target, n)
    ft = ir.VectorType(ir.FloatType(), n)
    if width is None:
        d = dot2_bf16_arith(b, u, s)
        return d if acc is None else b.fadd(acc, d)
    if acc is None:
        acc = ir.Constant(ft, None)
    vt = ir.VectorType(ir.FloatType(), width)
    bt = ir.VectorType(BFloatType(), 2 * width)
    fname = f"llvm.x86.avx512bf16.dpbf16ps.{32 * width}"
    fn = b.module.globals.get(fname) or ir.Function(b.module, ir.FunctionType(vt, [vt, bt, bt]), fname)

    return _per_register(b, n, width, lambda lo: b.call(fn, [_lanes(b, acc, lo, width),
                                                              b.bitcast(_lanes(b, u, lo, width), bt),
                                                              b.bitcast(_lanes(b, s, lo, width), bt)]))


def dot_vector(b: ir.IRBuilder, target: Any, name: str, u: ir.Value, s: ir.Value, acc: ir.Value | None,
               u_small: bool = False) -> ir.Value:
    """``acc + name(u, s)`` over vectors of lanes for any packed dot-product call (``dot4_*``,
    ``dot2_bf16``); ``u_small``: every byte of ``u`` is below 128 (see :func:`dot4_vector`)."""
    if name == DOT2_BF16:
        return dot2_bf16_vector(b, target, u, s, acc)
    if name == DOT2_I16:
        return dot2_i16_vector(b, target, u, s, acc)
    return dot4_vector(b, target, name, u, s, acc, u_small)


# -- unsigned bytes below 128 without VNNI -----------------------------------------------------------------


def pmaddubsw_width(target: Any, lanes: int) -> int | None:
    """The int32 lanes of the ``vpmaddubsw`` + ``vpmaddwd`` pair that computes ``lanes`` lanes of
    ``dot4_u8s8`` on ``target`` (16 with AVX512-BW, 8 with AVX2, 4 with SSSE3), None elsewhere."""
    feats = set(getattr(target, "enabled_features", ()))
    if not str(getattr(target, "triple", "")).startswith("x86_64"):
        return None
    widths = ([16] if "avx512bw" in feats else []) + ([8] if "avx2" in feats else []) + \
        ([4] if "ssse3" in feats else [])
    for w in widths:
        if lanes % w == 0 and not (lanes // w) & (lanes // w - 1):
            return w
    return None


_PMADDUBSW = {16: "llvm.x86.avx512.pmaddubs.w.512", 8: "llvm.x86.avx2.pmadd.ub.sw",
              4: "llvm.x86.ssse3.pmadd.ub.sw.128"}


def dot4_pmaddubsw(b: ir.IRBuilder, width: int, u: ir.Value, s: ir.Value) -> ir.Value:
    """``dot4_u8s8(u, s)`` over vectors of int32 lanes whose ``u`` bytes are all below 128 (a mask
    such as ``w & 0x0F0F0F0F`` says so): ``vpmaddubsw`` (unsigned x signed bytes, pairs summed in 16 bits
    with saturation, which cannot happen here: ``2 * 127 * 128 < 32767``) and ``vpmaddwd`` by ones (the
    16-bit pairs summed in 32 bits), per register of ``width`` lanes: exact, where the byte arithmetic
    (:func:`dot4_bytes`) takes a dozen instructions."""
    n = u.type.count
    bt = ir.VectorType(ir.IntType(8), 4 * width)
    ht = ir.VectorType(ir.IntType(16), 2 * width)
    vt = ir.VectorType(I32, width)
    f1 = b.module.globals.get(_PMADDUBSW[width]) or ir.Function(b.module, ir.FunctionType(ht, [bt, bt]),
                                                                 _PMADDUBSW[width])
    f2 = b.module.globals.get(_PMADDWD[width]) or ir.Function(b.module, ir.FunctionType(vt, [ht, ht]),
                                                               _PMADDWD[width])
    ones = ir.Constant(ht, [1] * (2 * width))

    def one(lo: int) -> ir.Value:
        pairs = b.call(f1, [b.bitcast(_lanes(b, u, lo, width), bt), b.bitcast(_lanes(b, s, lo, width), bt)])
        return b.call(f2, [pairs, ones])

    return _per_register(b, n, width, one)
