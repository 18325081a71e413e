"""A compiled graph -> one shared library with a C entry point, and a header that documents it.

``export_graph([prog], feeds, [shapes], "model.so")`` writes ``model.so`` and ``model.h``.  ``cc`` links
into the library:

1. the kernels' object files, those the compile made for the JIT (position independent; each kernel is
   compiled once, :meth:`cuvil.graph.link.LinkedModule.kernel_objects`), each distinct kernel once;
2. one object of glue: each signature's slot-table entry (:func:`cuvil.graph.link.emit_graph`, the
   kernels declared) and the C API around them (:func:`cuvil.graph.export.api.api_ir`);
3. the constants: one read-only blob, assembled with ``.incbin``.

Its symbols are all prefixed (``model_`` by default, from the file name) so several models load into
one process::

    int32_t model_run(const float *x, ..., float *y, ...);           /* typed: inputs, then outputs */
    int32_t model_run_array(const void *const *inputs, void *const *outputs, void *workspace);
    int64_t model_workspace_size(void);                              /* bytes; workspace may be NULL */
    void    model_set_num_threads(int32_t n);                        /* n <= 0: libgomp's default */
    const char *model_meta(void);                                    /* the signature as JSON */

plus ``cuvil_module_meta`` (``{"abi", "kind": "model", "prefix"}``), the one unprefixed symbol,
which :func:`cuvil.runtime.load` reads first (as for single kernels).  Everything else (kernels,
the slot-table entries, the weights) is local to the library (a linker version script).

A model with symbolic sizes (an ONNX ``dim_param`` such as a batch ``N``) can be exported for
several signatures (``input_shapes=[{...}, {...}]``): one compiled graph per signature, linked
into one library (a kernel equal in two signatures has one name and is linked once), one blob of
constants, and the sizes as the first arguments (ABI 2)::

    int32_t model_run(int64_t N, const float *x, float *y);
    int32_t model_run_array(const int64_t *sizes, const void *const *inputs, void *const *outputs, void *ws);
    int64_t model_workspace_size(int64_t N);                         /* -1: N not compiled */

A run fills the slot table that the linked entry point reads (``cuvil.graph.link``; layouts and
the C API in :mod:`cuvil.graph.export.api`, the header in :mod:`cuvil.graph.export.header`).  Status: 0
success, 1 out of memory, 2 a NULL pointer, 3 sizes with no compiled signature.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cuvil.errors import ArgumentError, CuvilError, TargetError
from cuvil.graph.export.api import ALIGN, STATUS, Blob, SignatureCode, TensorSpec, api_ir, plan_layout
from cuvil.graph.export.header import C_TYPES, c_identifiers, c_string, model_header
from cuvil.graph.export.signatures import SymbolicSize, default_prefix, size_values, symbolic_dim

__all__ = ["MODEL_ABI", "SIZES_ABI", "export_graph", "kernel_objects"]

MODEL_ABI = 1  # one fixed signature; a library with symbolic sizes is ABI 2 (the sizes come first)
SIZES_ABI = 2
API = ("run", "run_array", "workspace_size", "set_num_threads", "meta", "last_error")  # <prefix>_<name>


def _bounds_messages(prog: Any) -> dict[int, str]:
    """The printf format (``%lld``: the index) of each bounds check of each kernel call of ``prog``,
    keyed ``call << 16 | check`` (the error record the linked graph fills, cuvil.graph.link)."""
    sites = {k.name: len(k.checks) for k in prog.kernel_funcs}
    out = {}
    for call, kc in enumerate(prog.kernel_calls):
        for site in range(1, sites.get(kc.kernel, 0) + 1):
            if site >= 1 << 16:
                break
            text = prog.bounds_message(call, site, "\0").replace("%", "%%").replace("\0", "%lld")
            out[call << 16 | site] = text
    return out


def export_graph(progs: Sequence[Any], feeds: Sequence[Any], shapes: Sequence[Mapping[str, tuple[int, ...]]],
                 path: str | os.PathLike[str], target: Any = "llvm", *, sizes: Sequence[SymbolicSize] = (),
                 declared_outputs: Mapping[str, Any] | None = None, prefix: str | None = None,
                 cc: str | None = None, name: str = "") -> str:
    """Write the shared library of ``progs`` (``CompiledGraph``s for ``target``, one per signature) at
    ``path`` and its header beside it (suffix ``.h``).

    ``feeds`` are the model's inputs (graph ValueInfos), in the order of the C entry point;
    ``shapes[k]`` the input shapes ``progs[k]`` was compiled for; ``sizes`` the symbolic sizes (none:
    one fixed signature, today's ABI 1); ``declared_outputs`` the model's output shapes by name (for
    the symbolic names of output dimensions); ``prefix`` names the C symbols (default: from the
    file name); ``cc`` links (default ``cc``, or the GNU cross compiler for another triple); ``name``
    is the model's name in the header.  Returns the library's path.
    """
    from cuvil.target import Target

    tgt = Target(target)
    path, prefix, cc = _check_request(tgt, os.fspath(path), prefix, cc)
    if len(progs) != len(shapes) or (len(progs) != 1 and not sizes):
        raise CuvilError(f"internal error: {len(progs)} compiled graphs for {len(shapes)} signatures")
    blob = Blob()
    sig_inputs, sig_outputs, layouts = [], [], []
    for prog, sig in zip(progs, shapes):
        inputs, outputs = _tensor_specs(prog, feeds, sig)
        sig_inputs.append(inputs)
        sig_outputs.append(outputs)
        layouts.append(plan_layout(prog, inputs, outputs, blob))
    objects = kernel_objects(progs)  # 1.
    values = [size_values(sizes, [sig[v.name] for v in feeds]) for sig in shapes]
    threads = any(f.startswith("GOMP_") for f in _imports(objects))  # a kernel with a parallel loop
    meta = _meta(prefix, name, tgt, feeds, sizes, values, sig_inputs, sig_outputs, layouts, blob,
                 declared_outputs or {}, threads)
    code = [SignatureCode(vals, f"s{k}.graph", len(prog.slots), lay, _bounds_messages(prog))
            for k, (vals, prog, lay) in enumerate(zip(values, progs, layouts))]
    glue = _glue_object(progs, code, meta, tgt, len(sig_inputs[0]), len(sig_outputs[0]), blob.nbytes, len(sizes))  # 2.
    meta["imports"] = _imports([glue, *objects])  # (in the header, not in the library's own meta)
    header = model_header(meta, os.path.basename(path))
    _link(path, cc, prefix, [glue, *objects], blob, header, threads)  # 3.
    return path


def _check_request(tgt: Any, path: str, prefix: str | None, cc: str | None) -> tuple[str, str, str]:
    """``path``, the C ``prefix`` and the linker ``cc`` of an export, checked (defaults filled in)."""
    from cuvil.runtime.module import cross_compiler

    if tgt.kind != "llvm":
        raise TargetError(f"export_library writes CPU libraries (llvm targets), not {tgt.canonical!r}")
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
    return path, prefix, cc


def _tensor_specs(prog: Any, feeds: Sequence[Any], sig: Mapping[str, tuple[int, ...]]
                  ) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The inputs and outputs of one signature, each with a C type."""
    inputs = [TensorSpec(v.name, v.dtype or "float32", tuple(sig[v.name])) for v in feeds]
    outputs = [TensorSpec(n, e.dtype.name, tuple(e.shape)) if isinstance(e, np.ndarray) else
               TensorSpec(n, e.dtype, tuple(e.shape)) for n, e in prog.outputs]
    for spec in (*inputs, *outputs):
        if spec.dtype not in C_TYPES:
            raise ArgumentError(f"tensor {spec.name!r} has dtype {spec.dtype}, which has no C type here")
    return inputs, outputs


def _meta(prefix: str, name: str, tgt: Any, feeds: Sequence[Any], sizes: Sequence[SymbolicSize],
          values: list[tuple[int, ...]], sig_inputs: list, sig_outputs: list, layouts: list, blob: Blob,
          declared: Mapping[str, Any], threads: bool) -> dict[str, Any]:
    """The library's signature as ``<prefix>_meta()`` returns it (JSON; the header is written from it)."""
    inputs, outputs = sig_inputs[0], sig_outputs[0]
    meta: dict[str, Any] = {
        "abi": SIZES_ABI if sizes else MODEL_ABI, "kind": "model", "prefix": prefix, "name": name,
        "target": tgt.canonical, "inputs": [t.to_json() for t in inputs], "outputs": [t.to_json() for t in outputs],
        "workspace_bytes": max(lay.workspace_bytes for lay in layouts), "constant_bytes": blob.nbytes,
        "threads": "libgomp" if threads else "none",
        "status": {str(k): v.replace("<prefix>", prefix) for k, v in STATUS.items() if sizes or k != 3}}
    if not sizes:
        return meta
    c_names = c_identifiers([s.name for s in sizes], set())
    meta["sizes"] = [{"name": s.name, "c_name": c, "dims": [list(d) for d in s.dims]} for s, c in zip(sizes, c_names)]
    for i, v in enumerate(feeds):
        meta["inputs"][i]["shape"] = list(inputs[i].shape) if v.shape is None else list(v.shape)
    for j, t in enumerate(meta["outputs"]):
        per_sig = [outs[j].shape for outs in sig_outputs]
        if len({len(sh) for sh in per_sig}) != 1:
            t["shape"] = None
            continue
        want = declared.get(t["name"]) or ()
        t["shape"] = [symbolic_dim([sh[d] for sh in per_sig], sizes, values, want[d] if d < len(want) else None)
                      for d in range(len(per_sig[0]))]
    meta["signatures"] = [{"sizes": list(vals), "inputs": [list(t.shape) for t in ins],
                           "outputs": [list(t.shape) for t in outs], "workspace_bytes": lay.workspace_bytes}
                          for vals, ins, outs, lay in zip(values, sig_inputs, sig_outputs, layouts)]
    return meta


def kernel_objects(progs: Sequence[Any]) -> list[bytes]:
    """The object file of each distinct kernel of ``progs`` (a kernel's name is its identity, so a kernel
    of two signatures is linked once): the ones the compile made, where they are position independent."""
    seen: dict[str, str] = {}  # name -> identity
    out = []
    for prog in progs:
        if prog.module is None:
            continue
        for k, ident, obj in zip(prog.module.kernels, prog.module.kernel_ids, prog.module.kernel_objects()):
            if k.name not in seen:
                seen[k.name] = ident
                out.append(obj)
            elif seen[k.name] != ident:
                raise CuvilError(f"internal error: two different kernels are named {k.name}")
    return out


def _glue_object(progs: Sequence[Any], code: Sequence[SignatureCode], meta: dict[str, Any], tgt: Any, n_in: int,
                 n_out: int, blob_bytes: int, n_sizes: int) -> bytes:
    """One object file with each signature's slot-table entry (its kernels declared) and the C API, every
    symbol but the API's internal."""
    from cuvil.codegen import llvm as cg
    from cuvil.graph.link import emit_graph, new_module

    prefix = meta["prefix"]
    module = new_module(prefix, tgt)
    for prog, sig in zip(progs, code):
        emit_graph(module, prog.kernel_funcs, prog.kernel_calls, tgt, sig.entry, declare=True)
    mod = cg.optimize(cg.finish_ir_text(str(module), tgt), tgt, reloc="pic")
    text = api_ir(prefix, tgt, code, n_in, n_out, blob_bytes, n_sizes)
    text = cg.add_string_constant(text, f"{prefix}_meta", json.dumps(meta, separators=(",", ":")))
    text = cg.add_string_constant(text, "cuvil_module_meta", json.dumps(
        {"abi": meta["abi"], "kind": "model", "prefix": prefix}))
    mod.link_in(cg.optimize(text, tgt, reloc="pic"))
    api = {f"{prefix}_{x}" for x in API} | {"cuvil_module_meta"}
    for v in (*mod.functions, *mod.global_variables):
        if not v.is_declaration and v.name not in api:
            v.linkage = "internal"  # (two models never clash; unused code goes)
    return bytes(cg.object_code(mod, tgt))


def _imports(objects: Sequence[bytes]) -> list[str]:
    """The symbols the library takes from other libraries: those its objects use and none defines."""
    used: set[str] = set()
    defined: set[str] = set()
    for obj in objects:
        u, d = _elf_symbols(obj)
        used |= u
        defined |= d
    return sorted(n for n in used - defined if not n.startswith(("llvm.", "_GLOBAL_OFFSET_TABLE_")))


def _elf_symbols(obj: bytes) -> tuple[set[str], set[str]]:
    """The global symbols an ELF64 (little-endian) object file uses undefined, and those it defines."""
    if obj[:4] != b"\x7fELF" or obj[4] != 2 or obj[5] != 1:
        raise CuvilError("internal error: a kernel's object file is not a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", obj, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", obj, 0x3A)
    # (name, type, flags, addr, offset, size, link, info, addralign, entsize)
    sections = [struct.unpack_from("<IIQQQQIIQQ", obj, shoff + i * shentsize) for i in range(shnum)]
    used, defined = set(), set()
    for sec in sections:
        if sec[1] != 2:  # SHT_SYMTAB
            continue
        strings = sections[sec[6]][4]
        for off in range(sec[4], sec[4] + sec[5], 24):
            st_name, st_info, _other, st_shndx = struct.unpack_from("<IBBH", obj, off)
            if not st_name or st_info >> 4 not in (1, 2):  # STB_GLOBAL, STB_WEAK
                continue
            name = obj[strings + st_name:obj.index(b"\0", strings + st_name)].decode()
            (defined if st_shndx else used).add(name)
    return used, defined


def _link(path: str, cc: str, prefix: str, objects: Sequence[bytes], blob: Blob, header: str, threads: bool) -> None:
    """Link ``objects`` and the constants into the library at ``path`` (only the C API exported), and write
    ``header`` beside it.  Both are written under temporary names in the target folder and renamed at the
    end: a failed export leaves neither a partial file nor a header without its library."""
    try:
        tmp_dir = tempfile.TemporaryDirectory(prefix=".cuvil-export-", dir=os.path.dirname(os.path.abspath(path)))
    except OSError as exc:
        raise ArgumentError(f"cannot write {path!r}: {exc}") from None
    with tmp_dir as tmp:
        files = []
        for i, obj in enumerate(objects):
            files.append(os.path.join(tmp, f"{prefix}.{i}.o"))
            with open(files[-1], "wb") as f:
                f.write(obj)
        if blob.nbytes:
            files.append(_blob_object(cc, tmp, f"{prefix}.weights", blob))
        script = os.path.join(tmp, "exports.map")
        with open(script, "w") as f:
            f.write("{ global: " + " ".join(f"{prefix}_{x};" for x in API) + " cuvil_module_meta; local: *; };\n")
        libs = ["-lm"] + (["-lgomp"] if threads else [])
        lib = os.path.join(tmp, "lib.so")
        proc = subprocess.run([cc, "-shared", "-o", lib, *files, *libs, f"-Wl,--version-script={script}"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise TargetError(f"linking {path} with {cc} failed:\n{proc.stderr.strip()}")
        with open(os.path.join(tmp, "lib.h"), "w") as f:
            f.write(header)
        os.replace(os.path.join(tmp, "lib.h"), os.path.splitext(path)[0] + ".h")
        os.replace(lib, path)


def _blob_object(cc: str, tmp: str, symbol: str, blob: Blob) -> str:
    """An object file holding the constants as one read-only, hidden symbol (assembled by ``cc``)."""
    data = os.path.join(tmp, "weights.bin")
    with open(data, "wb") as f:
        for off, chunk in blob.chunks:
            f.write(b"\0" * (off - f.tell()))
            f.write(chunk)
    src = os.path.join(tmp, "weights.S")
    with open(src, "w") as f:
        f.write(f'\t.section .rodata.cuvil_weights,"a"\n\t.balign {ALIGN}\n\t.globl "{symbol}"\n'
                f'\t.hidden "{symbol}"\n"{symbol}":\n\t.incbin {c_string(data)}\n'
                '\t.section .note.GNU-stack,"",%progbits\n')
    obj = os.path.join(tmp, "weights.o")
    proc = subprocess.run([cc, "-c", "-o", obj, src], capture_output=True, text=True)
    if proc.returncode != 0:
        raise TargetError(f"assembling the constants with {cc} failed:\n{proc.stderr.strip()}")
    return obj
