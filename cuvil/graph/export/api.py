"""Where an exported run finds each buffer (:func:`plan_layout`) and the C API around the linked
graphs (:func:`api_ir`), for :func:`cuvil.graph.export.export_graph`.

A library holds one or more *signatures*: the same model compiled for given values of its
symbolic sizes (batch ``N`` = 1, 4, ...).  Each has its own slot-table entry (``cuvil.graph.link``)
and :class:`Layout`; the constants of all of them share one blob (equal arrays stored once).
Without symbolic sizes the API is the one-signature form::

    int32_t p_run(const float *x, float *y);
    int32_t p_run_array(const void *const *inputs, void *const *outputs, void *workspace);
    int64_t p_workspace_size(void);

and with symbolic sizes (here one, ``N``) the sizes come first and choose the signature::

    int32_t p_run(int64_t N, const float *x, float *y);
    int32_t p_run_array(const int64_t *sizes, const void *const *inputs, void *const *outputs, void *workspace);
    int64_t p_workspace_size(int64_t N);        /* -1: no signature for these sizes */

Status: 0 success, 1 out of memory, 2 a NULL pointer, 3 no compiled signature for the sizes, 4 an
index out of range (a Gather's, read from an input): ``const char *p_last_error(void)`` then says which
node and index, for the calling thread (an empty string after a successful run).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cuvil.errors import CuvilError

ALIGN = 64
STATUS = {0: "success", 1: "out of memory (the workspace or a kernel's temporary buffer)",
          2: "a NULL input or output pointer", 3: "no compiled signature for these sizes",
          4: "an index out of range (see <prefix>_last_error())"}
ERROR_BYTES = 512  # the thread's last error message, NUL included


@dataclass(frozen=True)
class TensorSpec:
    """A model input or output of the exported library: name, numpy dtype name, static shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        from cuvil.dtype import ONNX_TYPE_NAMES

        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "type": f"tensor({ONNX_TYPE_NAMES.get(self.dtype, self.dtype)})"}


def align(x: int) -> int:
    return (x + ALIGN - 1) // ALIGN * ALIGN


class Blob:
    """The read-only constants of a library: arrays placed at 64-byte aligned offsets, each distinct
    content once (signatures of one model share their weights)."""

    def __init__(self) -> None:
        self.chunks: list[tuple[int, bytes]] = []  # (offset, bytes)
        self.nbytes = 0
        self._at: dict[bytes, int] = {}

    def add(self, a: np.ndarray) -> int:
        """The offset of ``a``'s bytes in the blob (added if no equal bytes are there yet)."""
        data = np.ascontiguousarray(a).tobytes()
        off = self._at.get(data)
        if off is None:
            off = align(self.nbytes)
            self.chunks.append((off, data))
            self.nbytes = off + len(data)
            self._at[data] = off
        return off


@dataclass(frozen=True)
class Layout:
    """Where each slot of a compiled graph lives in an exported run.

    ``place[slot]`` is ``("input", i)``, ``("output", j)``, ``("blob", offset)`` or
    ``("workspace", offset)``; ``copies`` are ``(output j, ("blob" | "slot", offset | slot), nbytes)``
    done after the kernels (outputs known at compile time, outputs that share a buffer).
    """

    place: dict[int, tuple[str, int]]
    copies: tuple[tuple[int, tuple[str, int], int], ...]
    workspace_bytes: int


def plan_layout(prog: Any, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], blob: Blob) -> Layout:
    """The :class:`Layout` of ``prog`` (a ``CompiledGraph``) for an exported run; its constants go to ``blob``."""
    place: dict[int, tuple[str, int]] = {}
    feeds = dict((name, slot) for slot, name in prog._feeds)
    for i, spec in enumerate(inputs):
        slot = feeds[spec.name]
        s = prog.slots[slot]
        if s.dtype != spec.dtype or s.size != math.prod(spec.shape):
            raise CuvilError(f"internal error: input {spec.name!r} is slot {slot} of {s.size} x {s.dtype}, not "
                             f"{spec.shape} x {spec.dtype}")
        place[slot] = ("input", i)
    for slot, s in enumerate(prog.slots):
        if s.kind == "const":
            place[slot] = ("blob", blob.add(s.array))
    copies = []
    for j, ((_name, e), spec) in enumerate(zip(prog.outputs, outputs)):
        if isinstance(e, np.ndarray):
            copies.append((j, ("blob", blob.add(e)), spec.nbytes))
        elif e.slot not in place and prog.slots[e.slot].kind == "temp" and \
                prog.slots[e.slot].size * np.dtype(prog.slots[e.slot].dtype).itemsize == spec.nbytes:
            place[e.slot] = ("output", j)
        else:
            copies.append((j, ("slot", e.slot), spec.nbytes))
    ws_end = prog.memory.arena_bytes
    for slot, s in enumerate(prog.slots):
        if slot in place:
            continue
        if s.kind != "temp":
            raise CuvilError(f"internal error: slot {slot} ({s.kind}) has no place in the exported library")
        if slot in prog.memory.offsets:
            place[slot] = ("workspace", prog.memory.offsets[slot])
        else:  # an output's buffer that is copied out (or a temporary the plan left out)
            off = align(ws_end)
            place[slot] = ("workspace", off)
            ws_end = off + max(s.size, 1) * np.dtype(s.dtype).itemsize
    return Layout(place, tuple(copies), align(ws_end) if ws_end else 0)


@dataclass(frozen=True)
class SignatureCode:
    """One signature of the library: its sizes (empty without symbolic sizes), the slot-table entry
    ``int32_t <entry>(void **)`` of its linked graph, its number of slots and its layout."""

    sizes: tuple[int, ...]
    entry: str
    n_slots: int
    layout: Layout
    messages: dict[int, str] = field(default_factory=dict)  # (call << 16 | check) -> printf format of the index


def api_ir(prefix: str, target: Any, signatures: Sequence[SignatureCode], n_in: int, n_out: int, blob_bytes: int,
           n_sizes: int = 0) -> str:
    """The LLVM IR text of the exported C API around the signatures' slot-table entries (declared
    here, defined by the linked modules; see cuvil.graph.link).  ``n_sizes`` = 0: the API of one
    fixed signature; else every function takes the ``n_sizes`` symbolic sizes first."""
    from llvmlite import ir

    from cuvil.codegen.llvm_expr import I32, I64, PTR
    from cuvil.graph.link import new_module

    if not n_sizes and len(signatures) != 1:
        raise CuvilError(f"internal error: {len(signatures)} signatures without symbolic sizes")
    module = new_module(prefix, target)
    blob = None
    if blob_bytes:
        blob = ir.GlobalVariable(module, ir.ArrayType(ir.IntType(8), blob_bytes), f"{prefix}.weights")
        blob.linkage = "external"
        blob.storage_class = "hidden"
        blob.align = ALIGN

    def fn(name: str, ret: ir.Type, args: Sequence[ir.Type], internal: bool = False) -> ir.Function:
        f = ir.Function(module, ir.FunctionType(ret, list(args)), name)
        f.attributes.add("nounwind")
        if internal:
            f.linkage = "internal"
        return f

    malloc, free = fn("malloc", PTR, [I64]), fn("free", ir.VoidType(), [PTR])
    memcpy = module.declare_intrinsic("llvm.memcpy", [PTR, PTR, I64])
    entries: dict[str, tuple[ir.Function, ir.Function]] = {}
    for sig in signatures:
        if sig.entry not in entries:
            entries[sig.entry] = (fn(sig.entry, I32, [PTR, PTR]),
                                  fn(f"{sig.entry}_set_num_threads", ir.VoidType(), [I32]))
    # const char *last_error(void): this thread's message of its last failed bounds check ("" after a success)
    text = ir.GlobalVariable(module, ir.ArrayType(ir.IntType(8), ERROR_BYTES), f"{prefix}.error")
    text.linkage = "internal"  # and thread_local, written into the text below (llvmlite has no spelling for it)
    text.initializer = ir.Constant(ir.ArrayType(ir.IntType(8), ERROR_BYTES), None)
    last = fn(f"{prefix}_last_error", PTR, [])
    ir.IRBuilder(last.append_basic_block("entry")).ret(text)
    snprintf = ir.Function(module, ir.FunctionType(I32, [PTR, I64, PTR], var_arg=True), "snprintf")
    report = _report_function(fn(f"{prefix}.report", ir.VoidType(), [PTR, I64], internal=True), module,
                              signatures, text, snprintf)
    runs = [_run_signature(fn(f"{prefix}.run{k}", I32, [PTR, PTR, PTR], internal=True), entries[sig.entry][0], sig,
                           n_in, n_out, blob, malloc, free, memcpy, text, report, k)
            for k, sig in enumerate(signatures)]
    _public_functions(module, fn, prefix, signatures, runs, [e[1] for e in entries.values()], n_in, n_out, n_sizes)
    # one message per thread (exported libraries only: the in-process JIT has no thread-local storage)
    ir_text, n = re.subn(rf'^(@"{re.escape(prefix)}\.error" = internal) global', r"\1 thread_local global", str(module),
                         flags=re.M)
    if n != 1:
        raise CuvilError("internal error: the error message buffer was not made thread-local")
    return ir_text


def _report_function(f: Any, module: Any, signatures: Sequence[SignatureCode], text: Any, snprintf: Any) -> Any:
    """Define ``void f(int64_t err[3], int64_t signature)``: the message of a failed bounds check (err:
    check, index, call) written to the thread's ``text``, from each signature's ``messages``."""
    from llvmlite import ir

    from cuvil.codegen.llvm_expr import I64, PTR

    err, which = f.args
    b = ir.IRBuilder(f.append_basic_block("entry"))
    load = [b.load(b.gep(err, [ir.Constant(I64, i)], inbounds=True, source_etype=I64), typ=I64) for i in range(3)]
    key = b.or_(b.shl(load[2], ir.Constant(I64, 16)), load[0])
    strings: dict[str, Any] = {}

    def fmt(message: str) -> Any:
        if message not in strings:
            data = bytearray(message.encode()[:ERROR_BYTES - 64]) + b"\0"
            g = ir.GlobalVariable(module, ir.ArrayType(ir.IntType(8), len(data)), f"{f.name}.m{len(strings)}")
            g.linkage, g.global_constant = "internal", True
            g.initializer = ir.Constant(ir.ArrayType(ir.IntType(8), len(data)), data)
            strings[message] = g
        return strings[message]

    def write(bb: Any, message: str) -> None:
        wb = ir.IRBuilder(bb)
        wb.call(snprintf, [text, ir.Constant(I64, ERROR_BYTES), fmt(message), load[1]])
        wb.ret_void()

    generic = f.append_basic_block("generic")
    write(generic, "index %lld is out of range (a bounds check failed)")
    sig_switch = b.switch(which, generic)
    for k, sig in enumerate(signatures):
        bb = f.append_basic_block(f"sig{k}")
        sig_switch.add_case(ir.Constant(I64, k), bb)
        sb = ir.IRBuilder(bb)
        sw = sb.switch(key, generic)
        for case, message in sorted(sig.messages.items()):
            cb = f.append_basic_block(f"sig{k}.{case}")
            sw.add_case(ir.Constant(I64, case), cb)
            write(cb, message)
    del PTR
    return f


def _run_signature(f: Any, graph: Any, sig: SignatureCode, n_in: int, n_out: int, blob: Any, malloc: Any,
                   free: Any, memcpy: Any, text: Any, report: Any, k: int) -> Any:
    """Define ``int32_t f(const void *const *inputs, void *const *outputs, void *workspace)``: one run of
    the signature's graph (NULL checks, the workspace, the slot table, copies of outputs, the message of
    a failed bounds check)."""
    from llvmlite import ir

    from cuvil.codegen.llvm_expr import I32, I64, PTR

    layout = sig.layout
    ins, outs, ws_arg = f.args
    b = ir.IRBuilder(f.append_basic_block("entry"))
    null = ir.Constant(PTR, None)
    i8 = ir.IntType(8)
    b.store(ir.Constant(i8, 0), b.gep(text, [ir.Constant(I64, 0), ir.Constant(I64, 0)], inbounds=True))
    err = b.alloca(ir.ArrayType(I64, 3), name="err")
    b.store(ir.Constant(ir.ArrayType(I64, 3), [0, 0, 0]), err)

    def load_ptr(array: ir.Value, i: int) -> ir.Value:
        return b.load(b.gep(array, [ir.Constant(I64, i)], inbounds=True, source_etype=PTR), typ=PTR)

    in_ptrs = [load_ptr(ins, i) for i in range(n_in)]
    out_ptrs = [load_ptr(outs, j) for j in range(n_out)]
    bad = ir.Constant(ir.IntType(1), 0)
    for p in (*in_ptrs, *out_ptrs):
        bad = b.or_(bad, b.icmp_unsigned("==", p, null))
    with b.if_then(bad, likely=False):
        b.ret(ir.Constant(I32, 2))
    ws, raw = ws_arg, null
    if layout.workspace_bytes:
        need = b.icmp_unsigned("==", ws_arg, null)
        pre = b.block
        with b.if_then(need, likely=False):
            got = b.call(malloc, [ir.Constant(I64, layout.workspace_bytes + ALIGN - 1)])
            with b.if_then(b.icmp_unsigned("==", got, null), likely=False):
                b.ret(ir.Constant(I32, 1))
            addr = b.ptrtoint(got, I64)
            aligned = b.and_(b.add(addr, ir.Constant(I64, ALIGN - 1)), ir.Constant(I64, -ALIGN))
            mine = b.inttoptr(aligned, PTR)
            got_block = b.block
        ws = b.phi(PTR, name="ws")
        ws.add_incoming(ws_arg, pre)
        ws.add_incoming(mine, got_block)
        raw = b.phi(PTR, name="raw")
        raw.add_incoming(null, pre)
        raw.add_incoming(got, got_block)
    table = b.alloca(ir.ArrayType(PTR, max(sig.n_slots, 1)), name="slots")
    for slot in range(sig.n_slots):
        kind, k = layout.place[slot]
        if kind == "input":
            p = in_ptrs[k]
        elif kind == "output":
            p = out_ptrs[k]
        elif kind == "blob":
            p = b.gep(blob, [ir.Constant(I64, 0), ir.Constant(I64, k)], inbounds=True)
        else:
            p = b.gep(ws, [ir.Constant(I64, k)], inbounds=True, source_etype=i8)
        b.store(p, b.gep(table, [ir.Constant(I64, 0), ir.Constant(I64, slot)], inbounds=True))
    rc = b.call(graph, [b.bitcast(table, PTR), b.bitcast(err, PTR)])
    with b.if_then(b.icmp_signed("==", rc, ir.Constant(I32, 4)), likely=False):
        b.call(report, [b.bitcast(err, PTR), ir.Constant(I64, k)])
    if layout.copies:
        with b.if_then(b.icmp_signed("==", rc, ir.Constant(I32, 0))):
            for j, (kind, k), nbytes in layout.copies:
                if kind == "blob":
                    src = b.gep(blob, [ir.Constant(I64, 0), ir.Constant(I64, k)], inbounds=True)
                else:
                    src = b.load(b.gep(table, [ir.Constant(I64, 0), ir.Constant(I64, k)], inbounds=True), typ=PTR)
                b.call(memcpy, [out_ptrs[j], src, ir.Constant(I64, nbytes), ir.Constant(ir.IntType(1), 0)])
    if layout.workspace_bytes:
        with b.if_then(b.icmp_unsigned("!=", raw, null)):
            b.call(free, [raw])
    b.ret(rc)
    return f


def _public_functions(module: Any, fn: Any, prefix: str, signatures: Sequence[SignatureCode], runs: Sequence[Any],
                      setters: Sequence[Any], n_in: int, n_out: int, n_sizes: int) -> None:
    """Define ``<prefix>_workspace_size``, ``_run_array``, ``_run`` and ``_set_num_threads`` in ``module``
    (``fn`` declares a function; ``runs[k]`` runs signature k; ``setters`` set each entry's threads)."""
    from llvmlite import ir

    from cuvil.codegen.llvm_expr import I32, I64, PTR

    null = ir.Constant(PTR, None)
    i32 = lambda v: ir.Constant(I32, v)  # noqa: E731
    i64 = lambda v: ir.Constant(I64, v)  # noqa: E731

    def dispatch(b: ir.IRBuilder, f: ir.Function, sizes: Sequence[ir.Value], found: Any, missing: ir.Value) -> None:
        """Return ``found(b, k)`` for the signature k whose sizes are ``sizes``, else ``missing``."""
        for k, sig in enumerate(signatures):
            same = ir.Constant(ir.IntType(1), 1)
            for v, want in zip(sizes, sig.sizes):
                same = b.and_(same, b.icmp_signed("==", v, i64(want)))
            hit, nxt = f.append_basic_block(f"sig{k}"), f.append_basic_block(f"not{k}")
            b.cbranch(same, hit, nxt)
            b.position_at_end(hit)
            b.ret(found(b, k))
            b.position_at_end(nxt)
        b.ret(missing)

    # int64_t workspace_size([int64_t N, ...])
    size = fn(f"{prefix}_workspace_size", I64, [I64] * n_sizes)
    sb = ir.IRBuilder(size.append_basic_block("entry"))
    if n_sizes:
        dispatch(sb, size, size.args, lambda b, k: i64(signatures[k].layout.workspace_bytes), i64(-1))
    else:
        sb.ret(i64(signatures[0].layout.workspace_bytes))

    # int32_t run_array([const int64_t *sizes,] const void *const *inputs, void *const *outputs, void *workspace)
    run_array = fn(f"{prefix}_run_array", I32, [PTR] * (4 if n_sizes else 3))
    *sizes_arg, ins, outs, ws = run_array.args
    ins.name, outs.name, ws.name = "inputs", "outputs", "workspace"
    b = ir.IRBuilder(run_array.append_basic_block("entry"))
    if n_sizes:
        sizes_arg[0].name = "sizes"
        with b.if_then(b.icmp_unsigned("==", sizes_arg[0], null), likely=False):
            b.ret(i32(2))
        values = [b.load(b.gep(sizes_arg[0], [i64(i)], inbounds=True, source_etype=I64), typ=I64)
                  for i in range(n_sizes)]
        dispatch(b, run_array, values, lambda b, k: b.call(runs[k], [ins, outs, ws]), i32(3))
    else:
        b.ret(b.call(runs[0], [ins, outs, ws]))

    # int32_t run([int64_t N, ...,] const T *in0, ..., T *out0, ...): the typed form, workspace allocated per call
    run = fn(f"{prefix}_run", I32, [I64] * n_sizes + [PTR] * (n_in + n_out))
    rb = ir.IRBuilder(run.append_basic_block("entry"))
    arrays = []
    for typ, group in ((I64, run.args[:n_sizes]), (PTR, run.args[n_sizes:n_sizes + n_in]),
                       (PTR, run.args[n_sizes + n_in:])):
        arr = rb.alloca(ir.ArrayType(typ, max(len(group), 1)))
        for i, a in enumerate(group):
            rb.store(a, rb.gep(arr, [i64(0), i64(i)], inbounds=True))
        arrays.append(rb.bitcast(arr, PTR))
    rb.ret(rb.call(run_array, [*(arrays if n_sizes else arrays[1:]), null]))

    # void set_num_threads(int32_t n): every signature's kernels
    threads = fn(f"{prefix}_set_num_threads", ir.VoidType(), [I32])
    tb = ir.IRBuilder(threads.append_basic_block("entry"))
    for setter in setters:
        tb.call(setter, [threads.args[0]])
    tb.ret_void()
