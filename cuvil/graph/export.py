"""A compiled graph -> one shared library with a C entry point, and a header that documents it.

``export_graph(prog, inputs, "model.so")`` writes ``model.so`` and ``model.h``.  The library holds
the module the in-process graph runs (its optimised LLVM IR, parsed again: nothing is emitted or
optimised twice), the constants (one read-only blob, assembled with ``.incbin`` and linked into
the same file) and these symbols, all prefixed (``model_`` by default, from the file name) so
several models load into one process::

    int32_t model_run(const float *x, ..., float *y, ...);           /* typed: inputs, then outputs */
    int32_t model_run_array(const void *const *inputs, void *const *outputs, void *workspace);
    int64_t model_workspace_size(void);                              /* bytes; workspace may be NULL */
    void    model_set_num_threads(int32_t n);                        /* n <= 0: libgomp's default */
    const char *model_meta(void);                                    /* the signature as JSON */

plus ``cuvil_module_meta`` (``{"abi", "kind": "model", "prefix"}``), the one unprefixed symbol,
which :func:`cuvil.runtime.load` reads first (as for single kernels).  Everything else (kernels,
the slot-table entry ``graph``, the weights) has internal or hidden linkage.

A run fills the slot table that the linked entry point reads (``cuvil.graph.link``): inputs and
outputs are the caller's pointers, constants point into the blob, temporaries into the workspace
at the static memory plan's offsets (``prog.memory``); an output computed at compile time is
copied from the blob.  Status: 0 success, 1 out of memory (the workspace or a kernel's heap
buffer), 2 a NULL input or output pointer.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cuvil.errors import ArgumentError, CuvilError, ShapeError, TargetError

MODEL_ABI = 1
_ALIGN = 64
STATUS = {0: "success", 1: "out of memory (the workspace or a kernel's temporary buffer)",
          2: "a NULL input or output pointer"}
_C_TYPES = {"float16": "uint16_t", "float32": "float", "float64": "double", "bool": "uint8_t", "int8": "int8_t",
            "int16": "int16_t", "int32": "int32_t", "int64": "int64_t", "uint8": "uint8_t", "uint16": "uint16_t",
            "uint32": "uint32_t", "uint64": "uint64_t"}


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
        from cuvil.frontend.onnx import _TYPE_STR

        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "type": f"tensor({_TYPE_STR.get(self.dtype, self.dtype)})"}


@dataclass(frozen=True)
class Layout:
    """Where each slot of a compiled graph lives in an exported run.

    ``place[slot]`` is ``("input", i)``, ``("output", j)``, ``("blob", offset)`` or
    ``("workspace", offset)``; ``copies`` are ``(output j, ("blob" | "slot", offset | slot), nbytes)``
    done after the kernels (outputs known at compile time, outputs that share a buffer).
    """

    place: dict[int, tuple[str, int]]
    copies: tuple[tuple[int, tuple[str, int], int], ...]
    blob: tuple[tuple[int, bytes], ...]  # (offset, bytes)
    blob_bytes: int
    workspace_bytes: int


def _align(x: int) -> int:
    return (x + _ALIGN - 1) // _ALIGN * _ALIGN


def plan_layout(prog: Any, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> Layout:
    """The :class:`Layout` of ``prog`` (a ``CompiledGraph``) for an exported run."""
    place: dict[int, tuple[str, int]] = {}
    feeds = dict((name, slot) for slot, name in prog._feeds)
    for i, spec in enumerate(inputs):
        slot = feeds[spec.name]
        s = prog.slots[slot]
        if s.dtype != spec.dtype or s.size != math.prod(spec.shape):
            raise CuvilError(f"internal error: input {spec.name!r} is slot {slot} of {s.size} x {s.dtype}, not "
                             f"{spec.shape} x {spec.dtype}")
        place[slot] = ("input", i)
    blob: list[tuple[int, bytes]] = []
    blob_end = 0

    def in_blob(a: np.ndarray) -> int:
        nonlocal blob_end
        data = np.ascontiguousarray(a).tobytes()
        off = _align(blob_end)
        blob.append((off, data))
        blob_end = off + len(data)
        return off

    for slot, s in enumerate(prog.slots):
        if s.kind == "const":
            place[slot] = ("blob", in_blob(s.array))
    copies = []
    for j, ((_name, e), spec) in enumerate(zip(prog.outputs, outputs)):
        if isinstance(e, np.ndarray):
            copies.append((j, ("blob", in_blob(e)), spec.nbytes))
        elif e.slot not in place and prog.slots[e.slot].kind == "temp" and \
                prog.slots[e.slot].size * np.dtype(prog.slots[e.slot].dtype).itemsize == spec.nbytes:
            place[e.slot] = ("output", j)
        else:
            copies.append((j, ("slot", e.slot), spec.nbytes))
    arena = prog.memory.arena_bytes
    ws_end = arena
    for slot, s in enumerate(prog.slots):
        if slot in place:
            continue
        if s.kind != "temp":
            raise CuvilError(f"internal error: slot {slot} ({s.kind}) has no place in the exported library")
        if slot in prog.memory.offsets:
            place[slot] = ("workspace", prog.memory.offsets[slot])
        else:  # an output's buffer that is copied out (or a temporary the plan left out)
            off = _align(ws_end)
            place[slot] = ("workspace", off)
            ws_end = off + max(s.size, 1) * np.dtype(s.dtype).itemsize
    return Layout(place, tuple(copies), tuple(blob), blob_end, _align(ws_end) if ws_end else 0)


def resolve_shapes(feeds: Sequence[Any], input_shapes: Any = None,
                   ran_with: Sequence[dict[str, tuple[int, ...]]] = ()) -> dict[str, tuple[int, ...]]:
    """The static shape of every fed input (``feeds``: graph ValueInfos) for an exported library.

    ``input_shapes`` ({name: shape}) fixes symbolic dimensions; without it, the model's own shapes
    when they are all known, else the shapes of ``ran_with`` if it holds exactly one signature
    (the session ran with those).  Each given shape must agree with the declared rank, the
    declared sizes and itself (a symbol has one value across inputs).
    """
    declared = {v.name: v.shape for v in feeds}
    if input_shapes is None:
        symbolic = {n: s for n, s in declared.items() if s is None or not all(isinstance(d, int) for d in s)}
        if not symbolic:
            return {n: tuple(s) for n, s in declared.items()}  # type: ignore[arg-type]
        if len(ran_with) == 1:
            input_shapes = dict(ran_with[0])
        else:
            n, s = next(iter(symbolic.items()))
            dims = "unknown rank" if s is None else ", ".join(
                f"dimension {k} ({d or '?'})" for k, d in enumerate(s) if not isinstance(d, int))
            example = ", ".join(f"{name!r}: {tuple(d if isinstance(d, int) else 1 for d in (sh or ()))}"
                                for name, sh in declared.items())
            ran = (f"; the session ran with {len(ran_with)} signatures "
                   f"({'; '.join(str(dict(r)) for r in ran_with[:4])}{' ...' if len(ran_with) > 4 else ''}), "
                   "so none is the current one" if ran_with else "")
            raise ShapeError(f"input {n!r} has a symbolic shape {list(s or [])} ({dims}){ran}; a library is "
                             f"compiled for fixed shapes: pass export_library(path, input_shapes={{{example}}})")
    if not isinstance(input_shapes, dict):
        raise ArgumentError(f"input_shapes must be a dict {{input name: shape}}, got {type(input_shapes).__name__}")
    unknown = [n for n in input_shapes if n not in declared]
    if unknown:
        raise ArgumentError(f"input_shapes names unknown input(s) {', '.join(repr(n) for n in unknown)}; the "
                            f"model's inputs are {', '.join(declared)}")
    shapes: dict[str, tuple[int, ...]] = {}
    symbols: dict[str, tuple[int, str]] = {}
    for n, want in declared.items():
        if n not in input_shapes:
            if want is None or not all(isinstance(d, int) for d in want):
                raise ShapeError(f"input {n!r} has a symbolic shape {list(want or [])}: give it in input_shapes")
            shapes[n] = tuple(want)
            continue
        got = input_shapes[n]
        if not isinstance(got, (tuple, list)) or not all(
                isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 1 for d in got):
            raise ShapeError(f"input_shapes[{n!r}] must be a tuple of positive ints, got {got!r}")
        got = tuple(int(d) for d in got)
        if want is not None:
            if len(got) != len(want):
                raise ShapeError(f"input_shapes[{n!r}] = {got} has rank {len(got)}; the model declares "
                                 f"{list(want)} (rank {len(want)})")
            for k, (w, g) in enumerate(zip(want, got)):
                if isinstance(w, int) and w != g:
                    raise ShapeError(f"input_shapes[{n!r}]: dimension {k} must be {w} (the model declares "
                                     f"{list(want)}), got {g}")
                if isinstance(w, str):
                    if w in symbols and symbols[w][0] != g:
                        raise ShapeError(f"input_shapes[{n!r}]: dimension {k} ({w}) is {g}, but {w} is "
                                         f"{symbols[w][0]} in input {symbols[w][1]!r}")
                    symbols.setdefault(w, (g, n))
        shapes[n] = got
    return shapes


def default_prefix(path: str) -> str:
    """The C prefix of a library's symbols from its file name: ``out/resnet-18.so`` -> ``resnet_18``."""
    stem = os.path.basename(path).split(".")[0]
    stem = re.sub(r"[^A-Za-z0-9_]", "_", stem) or "model"
    return f"m_{stem}" if stem[0].isdigit() else stem


_C_KEYWORDS = frozenset(
    "auto break case char const continue default do double else enum extern float for goto if inline int long "
    "register restrict return short signed sizeof static struct switch typedef union unsigned void volatile while "
    "bool true false".split())


def c_identifiers(names: Sequence[str], taken: set[str]) -> list[str]:
    """Distinct C identifiers for tensor names (parameters of the typed entry point; upper-cased in macro
    names, so they are distinct ignoring case too).  ``taken`` holds the upper-cased ones already used."""
    out = []
    for n in names:
        ident = re.sub(r"[^A-Za-z0-9_]", "_", n) or "t"
        if ident[0].isdigit() or ident in _C_KEYWORDS:
            ident = f"t_{ident}"
        base, k = ident, 1
        while ident.upper() in taken:
            k += 1
            ident = f"{base}_{k}"
        taken.add(ident.upper())
        out.append(ident)
    return out


def _c_string(s: str) -> str:
    """A C string literal of ``s`` (UTF-8, anything but printable ASCII as octal escapes)."""
    return '"' + "".join(chr(c) if 32 <= c < 127 and c not in (34, 92) else f"\\{c:03o}"
                         for c in s.encode()) + '"'


def _comment(s: str) -> str:
    """``s`` made safe inside a C block comment."""
    return s.replace("*/", "* /").replace("\n", " ")


def export_graph(prog: Any, inputs: Sequence[TensorSpec], path: str | os.PathLike[str], target: Any = "llvm", *,
                 prefix: str | None = None, cc: str | None = None, name: str = "") -> str:
    """Write the shared library of ``prog`` (a ``CompiledGraph`` for ``target``) at ``path`` and its
    header beside it (suffix ``.h``).

    ``inputs`` are the fed inputs, in the order of the C entry point; ``prefix`` names the C
    symbols (default: from the file name); ``cc`` links (default ``cc``, or the GNU cross compiler
    for another triple); ``name`` is the model's name in the header.  Returns the library's path.
    """
    from cuvil.codegen import llvm as cg
    from cuvil.runtime.module import cross_compiler
    from cuvil.target import Target

    tgt = Target(target)
    if tgt.kind != "llvm":
        raise TargetError(f"export_library writes CPU libraries (llvm targets), not {tgt.canonical!r}")
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ArgumentError(f"cannot write {path!r}: the folder {folder!r} does not exist")
    prefix = default_prefix(path) if prefix is None else prefix
    if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", prefix) or prefix == "cuvil_module":
        raise ArgumentError(f"prefix {prefix!r} is not a C identifier (or is the reserved 'cuvil_module'); the "
                            "library's symbols are <prefix>_run ...")
    if cc is None:
        cc = "cc" if tgt.is_host else cross_compiler(tgt.triple)
    if shutil.which(cc) is None:
        raise TargetError(f"cannot link a shared library: the C compiler {cc!r} is not on PATH")
    outputs = [TensorSpec(n, e.dtype.name, tuple(e.shape)) if isinstance(e, np.ndarray) else
               TensorSpec(n, e.dtype, tuple(e.shape)) for n, e in prog.outputs]
    for spec in (*inputs, *outputs):
        if spec.dtype not in _C_TYPES:
            raise ArgumentError(f"tensor {spec.name!r} has dtype {spec.dtype}, which has no C type here")
    layout = plan_layout(prog, inputs, outputs)
    mod = _linked_module(prog, tgt)
    uses_threads = any(f.name == "GOMP_parallel" for f in mod.functions)
    meta = {"abi": MODEL_ABI, "kind": "model", "prefix": prefix, "name": name, "target": tgt.canonical,
            "inputs": [t.to_json() for t in inputs], "outputs": [t.to_json() for t in outputs],
            "workspace_bytes": layout.workspace_bytes, "constant_bytes": layout.blob_bytes,
            "threads": "libgomp" if uses_threads else "none", "status": {str(k): v for k, v in STATUS.items()}}
    text = api_ir(prefix, tgt, prog.module.entry if prog.module is not None else "graph", len(prog.slots),
                  len(inputs), len(outputs), layout)
    text = cg.add_string_constant(text, f"{prefix}_meta", json.dumps(meta, separators=(",", ":")))
    text = cg.add_string_constant(text, "cuvil_module_meta", json.dumps(
        {"abi": MODEL_ABI, "kind": "model", "prefix": prefix}))
    mod.link_in(cg.optimize(text, tgt, reloc="pic"))
    _internalize(mod, {f"{prefix}_{x}" for x in ("run", "run_array", "workspace_size", "set_num_threads", "meta")}
                 | {"cuvil_module_meta"})
    imports = sorted(f.name for f in mod.functions if f.is_declaration and not f.name.startswith("llvm."))
    obj = cg.object_code(mod, tgt)
    with tempfile.TemporaryDirectory(prefix="cuvil-export-") as tmp:
        files = [os.path.join(tmp, f"{prefix}.o")]
        with open(files[0], "wb") as f:
            f.write(obj)
        if layout.blob_bytes:
            files.append(_blob_object(cc, tmp, f"{prefix}.weights", layout))
        libs = ["-lm"] + (["-lgomp"] if uses_threads else [])
        proc = subprocess.run([cc, "-shared", "-o", path, *files, *libs], capture_output=True, text=True)
        if proc.returncode != 0:
            raise TargetError(f"linking {path} with {cc} failed:\n{proc.stderr.strip()}")
    meta["imports"] = imports
    with open(os.path.splitext(path)[0] + ".h", "w") as f:
        f.write(model_header(meta, os.path.basename(path)))
    return path


def _blob_object(cc: str, tmp: str, symbol: str, layout: Layout) -> str:
    """An object file holding the constants as one read-only, hidden symbol (assembled by ``cc``)."""
    data = os.path.join(tmp, "weights.bin")
    with open(data, "wb") as f:
        for off, chunk in layout.blob:
            f.write(b"\0" * (off - f.tell()))
            f.write(chunk)
    src = os.path.join(tmp, "weights.S")
    with open(src, "w") as f:
        f.write(f'\t.section .rodata.cuvil_weights,"a"\n\t.balign {_ALIGN}\n\t.globl "{symbol}"\n'
                f'\t.hidden "{symbol}"\n"{symbol}":\n\t.incbin {_c_string(data)}\n'
                '\t.section .note.GNU-stack,"",%progbits\n')
    obj = os.path.join(tmp, "weights.o")
    proc = subprocess.run([cc, "-c", "-o", obj, src], capture_output=True, text=True)
    if proc.returncode != 0:
        raise TargetError(f"assembling the constants with {cc} failed:\n{proc.stderr.strip()}")
    return obj


def _linked_module(prog: Any, target: Any) -> Any:
    """The graph's kernels and slot-table entry as an LLVM module, already optimised: the session's own
    (its kernels are not emitted or optimised a second time), or an empty entry for a graph with no call."""
    from cuvil.codegen import llvm as cg
    from cuvil.graph.link import link_ir

    if prog.module is not None:
        return prog.module.optimized()[0].clone()  # a copy: the API is linked into it
    return cg.optimize(link_ir([], [], target), target, reloc="pic")


def _internalize(mod: Any, api: set[str]) -> None:
    """Give every definition but the C API internal linkage (two models never clash; unused code goes)."""
    for v in (*mod.functions, *mod.global_variables):
        if not v.is_declaration and v.name not in api:
            v.linkage = "internal"


def api_ir(prefix: str, target: Any, entry: str, n_slots: int, n_in: int, n_out: int, layout: Layout) -> str:
    """The LLVM IR text of the exported C API around the graph's slot-table entry ``int32_t <entry>(void **)``
    (declared here, defined by the linked module; see cuvil.graph.link)."""
    from llvmlite import ir

    from cuvil.codegen.llvm_expr import I32, I64, PTR
    from cuvil.graph.link import new_module

    module = new_module(prefix, target)
    graph = ir.Function(module, ir.FunctionType(I32, [PTR]), entry)
    setter = ir.Function(module, ir.FunctionType(ir.VoidType(), [I32]), f"{entry}_set_num_threads")
    blob = None
    if layout.blob_bytes:
        blob = ir.GlobalVariable(module, ir.ArrayType(ir.IntType(8), layout.blob_bytes), f"{prefix}.weights")
        blob.linkage = "external"
        blob.storage_class = "hidden"
        blob.align = _ALIGN
    i8 = ir.IntType(8)

    def fn(name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
        f = ir.Function(module, ir.FunctionType(ret, args), name)
        f.attributes.add("nounwind")
        return f

    malloc, free = fn("malloc", PTR, [I64]), fn("free", ir.VoidType(), [PTR])
    memcpy = module.declare_intrinsic("llvm.memcpy", [PTR, PTR, I64])

    size = fn(f"{prefix}_workspace_size", I64, [])
    ir.IRBuilder(size.append_basic_block("entry")).ret(ir.Constant(I64, layout.workspace_bytes))

    # int32_t run_array(const void *const *inputs, void *const *outputs, void *workspace)
    run_array = fn(f"{prefix}_run_array", I32, [PTR, PTR, PTR])
    ins, outs, ws_arg = run_array.args
    ins.name, outs.name, ws_arg.name = "inputs", "outputs", "workspace"
    b = ir.IRBuilder(run_array.append_basic_block("entry"))
    null = ir.Constant(PTR, None)

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
            got = b.call(malloc, [ir.Constant(I64, layout.workspace_bytes + _ALIGN - 1)])
            with b.if_then(b.icmp_unsigned("==", got, null), likely=False):
                b.ret(ir.Constant(I32, 1))
            addr = b.ptrtoint(got, I64)
            aligned = b.and_(b.add(addr, ir.Constant(I64, _ALIGN - 1)), ir.Constant(I64, -_ALIGN))
            mine = b.inttoptr(aligned, PTR)
            got_block = b.block
        ws = b.phi(PTR, name="ws")
        ws.add_incoming(ws_arg, pre)
        ws.add_incoming(mine, got_block)
        raw = b.phi(PTR, name="raw")
        raw.add_incoming(null, pre)
        raw.add_incoming(got, got_block)
    table = b.alloca(ir.ArrayType(PTR, max(n_slots, 1)), name="slots")
    for slot in range(n_slots):
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
    rc = b.call(graph, [b.bitcast(table, PTR)])
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

    # int32_t run(const T *in0, ..., T *out0, ...): the typed form, workspace allocated per call
    run = fn(f"{prefix}_run", I32, [PTR] * (n_in + n_out))
    rb = ir.IRBuilder(run.append_basic_block("entry"))
    arrays = []
    for group in (run.args[:n_in], run.args[n_in:]):
        arr = rb.alloca(ir.ArrayType(PTR, max(len(group), 1)))
        for i, a in enumerate(group):
            rb.store(a, rb.gep(arr, [ir.Constant(I64, 0), ir.Constant(I64, i)], inbounds=True))
        arrays.append(rb.bitcast(arr, PTR))
    rb.ret(rb.call(run_array, [*arrays, null]))

    # void set_num_threads(int32_t n)
    threads = fn(f"{prefix}_set_num_threads", ir.VoidType(), [I32])
    tb = ir.IRBuilder(threads.append_basic_block("entry"))
    tb.call(setter, [threads.args[0]])
    tb.ret_void()

    return str(module)


def _target_lines(target: str) -> str:
    """``triple, cpu`` and the CPU features, wrapped for a C comment."""
    parts = dict(re.findall(r"-(mtriple|mcpu|mattr)=(\S+)", target))
    if "mtriple" not in parts:
        return target
    feats = [f for f in parts.get("mattr", "").split(",") if f]
    out, line = [f"{parts['mtriple']}, CPU {parts.get('mcpu', 'generic')}: it runs only on CPUs with",
                 " *   these features:"], ""
    for f in feats:
        if len(line) + len(f) > 90:
            out.append(f" *   {line.rstrip()}")
            line = ""
        line += f"{f} "
    if line:
        out.append(f" *   {line.rstrip()}")
    return "\n".join(out) if feats else out[0].split(":")[0] + "."


def _nbytes(t: dict[str, Any]) -> int:
    return math.prod(t["shape"]) * np.dtype(t["dtype"]).itemsize


def _shape_str(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def model_header(meta: dict[str, Any], lib_name: str) -> str:
    """The C header of an exported model: the entry points, each tensor, status codes, run-time needs."""
    p = meta["prefix"]
    P = p.upper()
    ins, outs = meta["inputs"], meta["outputs"]
    taken: set[str] = set()
    in_ids = c_identifiers([t["name"] for t in ins], taken)
    out_ids = c_identifiers([t["name"] for t in outs], taken)
    width = max([len(t["name"]) for t in (*ins, *outs)] + [4])

    def rows(ts: list[dict[str, Any]], kind: str) -> list[str]:
        return [f" *   {kind}[{i}] {_comment(t['name']):<{width}} {_C_TYPES[t['dtype']]}{_shape_str(t['shape'])}  "
                f"{math.prod(t['shape'])} elements, {t['type']}" for i, t in enumerate(ts)]

    gomp = meta["threads"] == "libgomp"
    libc = {"malloc", "free", "memcpy", "memset", "memmove", "abort"}
    libm = [f for f in meta["imports"] if f not in libc and not f.startswith(("GOMP_", "omp_"))]
    libs = ", ".join(["libc"] + (["libm"] if libm else []) +
                     (["libgomp (GCC's OpenMP runtime, libgomp.so.1)"] if gomp else []))
    lines = [
        f"/* {os.path.splitext(lib_name)[0]}.h: the C interface of {lib_name}, generated by cuvil.",
        f" * Target: {_target_lines(meta['target'])}",
        f" * Model {_comment(repr(meta['name']))}, compiled for these fixed shapes (dense, row-major, C-contiguous):",
        " *", *rows(ins, "input "), *rows(outs, "output"), " *",
        " * float16 tensors hold IEEE half bits (uint16_t); bool tensors one byte each (0 or 1).",
        f" * Constants: {meta['constant_bytes']} bytes inside {lib_name} (read-only). Workspace for",
        f" * temporaries: {meta['workspace_bytes']} bytes per call, allocated with malloc by {p}_run",
        f" * (or passed to {p}_run_array).",
        " *",
        f" * Needs at run time: {libs}.",
        f" * Symbols it imports: {', '.join(meta['imports']) or 'none'}",
        " *   (and memcpy/memset where LLVM lowers copies to calls).",
        f" * Link: cc main.c -L. -l:{lib_name} -Wl,-rpath,'$ORIGIN'   (or dlopen it).",
        " *",
        f" * Every exported symbol starts with {p}_ (besides cuvil_module_meta, which every cuvil",
        " * library defines for cuvil.runtime.load): several models can live in one process.",
        " */",
        f"#ifndef {P}_H", f"#define {P}_H", "#include <stdint.h>", "", "#ifdef __cplusplus", 'extern "C" {',
        "#endif", "",
        "/* Status codes of the run functions. */",
        f"#define {P}_OK 0", f"#define {P}_ERR_NO_MEMORY 1   /* {STATUS[1]} */",
        f"#define {P}_ERR_NULL_POINTER 2  /* {STATUS[2]} */", "",
        f"#define {P}_NUM_INPUTS {len(ins)}", f"#define {P}_NUM_OUTPUTS {len(outs)}",
        f"#define {P}_WORKSPACE_BYTES {meta['workspace_bytes']}",
        "/* Per tensor, in entry-point order: names, bytes, dtypes; then each one's elements, rank, shape. */",
        f"#define {P}_INPUT_NAMES {{{', '.join(_c_string(t['name']) for t in ins)}}}",
        f"#define {P}_OUTPUT_NAMES {{{', '.join(_c_string(t['name']) for t in outs)}}}",
        f"#define {P}_INPUT_BYTES {{{', '.join(str(_nbytes(t)) for t in ins)}}}",
        f"#define {P}_OUTPUT_BYTES {{{', '.join(str(_nbytes(t)) for t in outs)}}}",
        f"#define {P}_INPUT_DTYPES {{{', '.join(json.dumps(t['dtype']) for t in ins)}}}",
        f"#define {P}_OUTPUT_DTYPES {{{', '.join(json.dumps(t['dtype']) for t in outs)}}}",
    ]
    for kind, ts, ids in (("INPUT", ins, in_ids), ("OUTPUT", outs, out_ids)):
        for t, ident in zip(ts, ids):
            m = f"{P}_{kind}_{ident.upper()}"
            lines += [f"#define {m}_ELEMENTS {math.prod(t['shape'])}", f"#define {m}_RANK {len(t['shape'])}",
                      f"#define {m}_SHAPE {{{', '.join(str(d) for d in t['shape'])}}}"]
    params = [f"const {_C_TYPES[t['dtype']]} *{i}" for t, i in zip(ins, in_ids)] + \
             [f"{_C_TYPES[t['dtype']]} *{i}" for t, i in zip(outs, out_ids)]
    lines += [
        "",
        "/* Run the model once: reads the inputs, writes every output (outputs must not overlap any",
        " * input or each other). Returns 0, or a status code above. Calls from several threads at",
        " * once are safe (each call allocates its own workspace). */",
        f"int32_t {p}_run({', '.join(params) or 'void'});", "",
        f"/* The same with pointer arrays: inputs[{len(ins)}], outputs[{len(outs)}] in the order above.",
        f" * workspace: NULL (allocated per call) or at least {p}_workspace_size() bytes that no other",
        " * call uses at the same time (64-byte alignment is best). */",
        f"int32_t {p}_run_array(const void *const *inputs, void *const *outputs, void *workspace);", "",
        f"/* Bytes of workspace a call needs ({P}_WORKSPACE_BYTES). */",
        f"int64_t {p}_workspace_size(void);", "",
        "/* Threads for the parallel loops of later calls; n <= 0 (the default) lets libgomp choose",
        " * (OMP_NUM_THREADS, else all cores). Set it before starting calls from several threads."
        + ("" if gomp else f"\n * ({lib_name} has no parallel loop: this only records n.)") + " */",
        f"void {p}_set_num_threads(int32_t n);", "",
        "/* The interface above as JSON: inputs and outputs (name, dtype, shape), workspace, target. */",
        f"const char *{p}_meta(void);", "",
        "#ifdef __cplusplus", "}", "#endif", f"#endif /* {P}_H */", "",
    ]
    return "\n".join(lines)
