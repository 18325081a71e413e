"""Memory in a vector body (a mixin of :class:`cuvil.codegen.llvm_vector.VectorLoops`): loads and stores of
all lanes at once.

The flattened index of an access is kept as :class:`Lanes` (uniform, affine, or a vector); by its stride:

- stride 1: one (unaligned: ``align`` = element size) vector load/store, masked where the loop's last
  vector is partial (``llvm.masked.load`` / ``llvm.masked.store``);
- stride 0: a scalar load (then broadcast when combined with vectors); a store keeps the last lane's value;
- elements 2 to ``SPAN_STRIDE`` apart (cuvil.target): one masked load of the span and a shuffle;
- anything else: a gather/scatter of per-lane scalar loads/stores, in lane order.

float16 is ``<V x half>`` in memory and ``<V x float>`` in registers, bool ``<V x i8>`` / ``<V x i1>``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llvmlite import ir

from cuvil import dtype as dt
from cuvil.codegen.llvm_expr import I32, I64, InternalError, mem_type
from cuvil.ir.expr import Expr, Load, Var
from cuvil.ir.stmt import Store
from cuvil.target import SPAN_STRIDE


class Lanes:
    """A value in a vector body: ``stride`` None -> ``value`` is a vector; an int -> ``value`` is a
    scalar and lane ``l`` holds ``value + stride * l`` (stride 0: the same value in every lane)."""

    __slots__ = ("value", "stride")

    def __init__(self, value: ir.Value, stride: int | None):
        self.value = value
        self.stride = stride


def _signed(v: int, width: int) -> int:
    v &= (1 << width) - 1
    return v - (1 << width) if v >> (width - 1) else v


class VectorMemory:
    """Loads and stores of a vector body; :class:`cuvil.codegen.llvm_vector.VectorLoops` sets ``_vec``
    (loop variable, base, lanes, memo) and gives the expression side (``vexpr``, ``vec``) and the
    masks of a partial vector (``_valid_mask``, ``_live``)."""

    builder: ir.IRBuilder
    env: dict[Var, ir.Value]
    target: Any
    _vec: Any
    storage: Any
    to_memory: Any
    to_i64: Any
    vexpr: Callable[[Expr], Lanes]
    vec: Callable[[Lanes], ir.Value]
    _valid_mask: Callable[[int], ir.Constant | None]
    _live: Callable[[int], int]

    def _vstore(self, s: Store) -> None:
        if s.value.dtype != s.buffer.dtype:
            raise InternalError(f"internal error in LLVM codegen: storing a {s.value.dtype} value into "
                                f"{s.buffer.name}: {s.buffer.dtype} needs a Cast")
        b = self.builder
        _, _, lanes, _ = self._vec
        val = self.vexpr(s.value)
        ptr, flat = self._vflat(s.buffer, s.indices)
        mt = mem_type(s.buffer.dtype)
        if flat.stride == 0:  # every lane writes one element: the last lane's value stays
            last = ir.Constant(I32, self._live(lanes) - 1)
            v = val.value if val.stride == 0 else b.extract_element(self.vec(val), last)
            b.store(self.to_memory(v, s.buffer.dtype), b.gep(ptr, [flat.value], inbounds=True, source_etype=mt))
            return
        data = self.to_memory(self.vec(val), s.buffer.dtype)
        mask = self._valid_mask(lanes)
        if flat.stride == 1 and mask is not None:
            addr = b.gep(ptr, [flat.value], inbounds=True, source_etype=mt)
            fn = self._masked_intrinsic("store", data.type, mask.type)
            b.call(fn, [data, addr, ir.Constant(I32, dt.nbytes(s.buffer.dtype)), mask])
            return
        if flat.stride == 1:
            st = b.store(data, b.gep(ptr, [flat.value], inbounds=True, source_etype=mt))
            st.align = dt.nbytes(s.buffer.dtype)
            return
        idx = self.vec(flat)
        for lane in range(self._live(lanes)):  # scatter, in lane order
            k = ir.Constant(I32, lane)
            addr = b.gep(ptr, [b.extract_element(idx, k)], inbounds=True, source_etype=mt)
            b.store(b.extract_element(data, k), addr)

    def _masked_load(self, ptr: ir.Value, index: ir.Value, vt: ir.VectorType, mask: ir.Value, align: int
                     ) -> ir.Value:
        """``vt`` from ``ptr[index ...]`` (elements ``align`` bytes apart), lanes off ``mask`` not read (zero)."""
        addr = self.builder.gep(ptr, [index], inbounds=True, source_etype=vt.element)
        fn = self._masked_intrinsic("load", vt, mask.type)
        return self.builder.call(fn, [addr, ir.Constant(I32, align), mask, ir.Constant(vt, None)])

    def _masked_intrinsic(self, kind: str, vt: ir.VectorType, mask_t: ir.Type) -> ir.Function:
        """``llvm.masked.load`` / ``llvm.masked.store`` for vectors of type ``vt``."""
        mt = vt.element
        suffix = f"v{vt.count}" + (f"i{mt.width}" if isinstance(mt, ir.IntType) else
                                   {"float": "f32", "double": "f64", "half": "f16"}[str(mt)])
        name = f"llvm.masked.{kind}.{suffix}.p0"
        fn = self.builder.module.globals.get(name)
        if fn is None:
            sig = (ir.FunctionType(vt, [ir.PointerType(), I32, mask_t, vt]) if kind == "load" else
                   ir.FunctionType(ir.VoidType(), [vt, ir.PointerType(), I32, mask_t]))
            fn = ir.Function(self.builder.module, sig, name)
        return fn

    def _vflat(self, buffer: Any, indices: tuple[Expr, ...]) -> tuple[ir.Value, Lanes]:
        """The buffer's pointer and the row-major flat index (int64 lanes) of ``indices``."""
        ptr, dims = self.storage(buffer, indices)
        b = self.builder
        flat: Lanes | None = None if indices else Lanes(ir.Constant(I64, 0), 0)  # a 0-d buffer: element 0
        for idx, dim in zip(indices, dims):
            i = self._vindex(idx)
            if flat is None:
                flat = i
                continue
            if flat.stride is not None and isinstance(dim, ir.Constant):
                flat = Lanes(b.mul(flat.value, dim, flags=("nsw",)), _signed(flat.stride * int(dim.constant), 64))
            elif flat.stride == 0:
                flat = Lanes(b.mul(flat.value, dim, flags=("nsw",)), 0)
            else:
                flat = Lanes(b.mul(self.vec(flat), self.vec(Lanes(dim, 0)), flags=("nsw",)), None)
            if flat.stride is not None and i.stride is not None:
                flat = Lanes(b.add(flat.value, i.value, flags=("nsw",)), _signed(flat.stride + i.stride, 64))
            else:
                flat = Lanes(b.add(self.vec(flat), self.vec(i), flags=("nsw",)), None)
        assert flat is not None
        return ptr, flat

    def _vindex(self, idx: Expr) -> Lanes:
        x = self.vexpr(idx)
        if not dt.is_int(idx.dtype):
            raise InternalError(f"internal error in LLVM codegen: index of dtype {idx.dtype} is not an integer")
        if dt.bits(idx.dtype) == 64:
            return x
        if x.stride == 0:
            return Lanes(self.to_i64(x.value, idx.dtype), 0)
        v = self.vec(x)
        i64 = ir.VectorType(I64, v.type.count)
        signed = dt.is_signed(idx.dtype)
        return Lanes(self.builder.sext(v, i64) if signed else self.builder.zext(v, i64), None)

    def _vload(self, e: Load) -> Lanes:
        if e.dtype != e.buffer.dtype:
            raise InternalError(f"internal error in LLVM codegen: {e} has dtype {e.dtype}, its buffer {e.buffer.dtype}")
        b = self.builder
        _, _, lanes, _ = self._vec
        ptr, flat = self._vflat(e.buffer, e.indices)
        mt = mem_type(e.dtype)
        if flat.stride == 0:
            v = b.load(b.gep(ptr, [flat.value], inbounds=True, source_etype=mt), typ=mt)
            return Lanes(self._from_memory(v, e.dtype), 0)
        vt = ir.VectorType(mt, lanes)
        mask = self._valid_mask(lanes)
        if flat.stride == 1 and mask is not None:
            v = self._masked_load(ptr, flat.value, vt, mask, dt.nbytes(e.dtype))
        elif flat.stride == 1:
            v = b.load(b.gep(ptr, [flat.value], inbounds=True, source_etype=mt), typ=vt)
            v.align = dt.nbytes(e.dtype)
        elif (strided := self._span_load(ptr, flat, lanes, e.dtype)) is not None:
            v = strided
        else:  # gather: one scalar load per lane
            idx = self.vec(flat)
            v = ir.Constant(vt, None)
            for lane in range(self._live(lanes)):
                k = ir.Constant(I32, lane)
                x = b.load(b.gep(ptr, [b.extract_element(idx, k)], inbounds=True, source_etype=mt), typ=mt)
                v = b.insert_element(v, x, k)
        return Lanes(self._from_memory(v, e.dtype), None)

    def _span_load(self, ptr: ir.Value, flat: Lanes, lanes: int, dtype: str, lane_mask: ir.Value | None = None
                   ) -> ir.Value | None:
        """Elements 2 to ``SPAN_STRIDE`` apart (the bytes an int8 contraction packs four to an int32, a
        stride-2 pool's columns): one masked load of the span (only the lanes' own elements are read: never
        past the buffer) and a shuffle, instead of a scalar load per lane; None for anything else.  (SqueezeNet's
        3x3 / 2 max pool over 96 x 109 x 109 at 1 thread: 300 -> 243 us with the same schedule.)  With
        ``lane_mask`` (a select's side) only the lanes on it are read: the span's mask is both, at no cost
        (a padded stride-2 window's edge)."""
        stride = flat.stride
        if stride is None or not 2 <= stride <= SPAN_STRIDE or dtype == "bool":
            return None
        live = self._live(lanes)
        span = lanes * stride
        vt = ir.VectorType(mem_type(dtype), span)
        mask: ir.Value = ir.Constant(ir.VectorType(ir.IntType(1), span),
                                     [int(i % stride == 0 and i // stride < live) for i in range(span)])
        if lane_mask is not None:  # lane k's bit at element k * stride of the span, the others off
            none = ir.Constant(lane_mask.type, None)
            spread = self.builder.shuffle_vector(lane_mask, none, ir.Constant(
                ir.VectorType(I32, span), [i // stride if i % stride == 0 else lanes for i in range(span)]))
            mask = self.builder.and_(mask, spread)
        wide = self._masked_load(ptr, flat.value, vt, mask, dt.nbytes(dtype))
        return self.builder.shuffle_vector(wide, wide, ir.Constant(ir.VectorType(I32, lanes),
                                                                   [stride * lane for lane in range(lanes)]))

    def _from_memory(self, v: ir.Value, dtype: str) -> ir.Value:
        b = self.builder
        if dtype == "float16":
            return b.fpext(v, ir.VectorType(ir.FloatType(), v.type.count) if isinstance(v.type, ir.VectorType)
                           else ir.FloatType())
        if dtype == "bool":
            return b.icmp_unsigned("!=", v, ir.Constant(v.type, 0))
        return v
