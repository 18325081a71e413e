"""A compiled graph -> one shared library with a C entry point, and a header that documents it.

``export_graph([prog], feeds, [shapes], "model.so")`` writes ``model.so`` and ``model.h``.  The
library holds the module the in-process graph runs (its optimised LLVM IR, parsed again: nothing
is emitted or optimised twice), the constants (one read-only blob, assembled with ``.incbin`` and
linked into the same file) and these symbols, all prefixed (``model_`` by default, from the file
name) so several models load into one process::

    int32_t model_run(const float *x, ..., float *y, ...);           /* typed: inputs, then outputs */
    int32_t model_run_array(const void *const *inputs, void *const *outputs, void *workspace);
    int64_t model_workspace_size(void);                              /* bytes; workspace may be NULL */
    void    model_set_num_threads(int32_t n);                        /* n <= 0: libgomp's default */
    const char *model_meta(void);                                    /* the signature as JSON */

plus ``cuvil_module_meta`` (``{"abi", "kind": "model", "prefix"}``), the one unprefixed symbol,
which :func:`cuvil.runtime.load` reads first (as for single kernels).  Everything else (kernels,
the slot-table entries, the weights) has internal or hidden linkage.

A model with symbolic sizes (an ONNX ``dim_param`` such as a batch ``N``) can be exported for
several signatures (``input_shapes=[{...}, {...}]``): one compiled graph per signature, linked
into one module (a kernel equal in two signatures is kept once), one blob of constants, and the
sizes as the first arguments (ABI 2)::

    int32_t model_run(int64_t N, const float *x, float *y);
    int32_t model_run_array(const int64_t *sizes, const void *const *inputs, void *const *outputs, void *ws);
    int64_t model_workspace_size(int64_t N);                         /* -1: N not compiled */

A run fills the slot table that the linked entry point reads (``cuvil.graph.link``; layouts and
the C API in ``cuvil.graph.export_api``, the header in ``cuvil.graph.export_header``).  Status: 0
success, 1 out of memory, 2 a NULL pointer, 3 sizes with no compiled signature.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cuvil.errors import ArgumentError, CuvilError, ShapeError, TargetError
from cuvil.graph.export_api import ALIGN, STATUS, Blob, SignatureCode, TensorSpec, api_ir, plan_layout
from cuvil.graph.export_header import C_TYPES, c_identifiers, c_string, model_header

__all__ = ["MODEL_ABI", "STATUS", "SymbolicSize", "TensorSpec", "check_given_shape", "default_prefix", "export_graph",
           "resolve_shapes", "resolve_signatures"]

MODEL_ABI = 1  # one fixed signature; a library with symbolic sizes is ABI 2 (the sizes come first)
SIZES_ABI = 2


@dataclass(frozen=True)
class SymbolicSize:
    """A symbolic size of the model's inputs, an argument of the exported C API: the model's name
    for it (the ONNX ``dim_param``, or ``<input>_dim<k>`` for a dimension without a name) and where
    it appears ((input index, dimension), in input order)."""

    name: str
    dims: tuple[tuple[int, int], ...]


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
                             f"compiled for fixed shapes: pass export_library(path, input_shapes={{{example}}}), "
                             "or a list of such dicts to compile several sizes into it (passed from C as integers)")
    if not isinstance(input_shapes, dict):
        raise ArgumentError(f"input_shapes must be a dict {{input name: shape}} (or a list of them, one per "
                            f"signature), got {type(input_shapes).__name__}")
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
        check_given_shape(f"input_shapes[{n!r}]", n, want, got, symbols)
        shapes[n] = got
    return shapes


def check_given_shape(where: str, name: str, want: Sequence[Any] | None, got: tuple[int, ...],
                      symbols: dict[str, tuple[int, str]]) -> None:
    """Check the shape ``got`` given for input ``name`` against the one the model declares (``want``: ints and
    symbol names; None, nothing declared): its rank, its fixed sizes, and one value per symbol across the inputs
    (``symbols``: symbol -> (value, input) of the inputs checked before; this input's are added).  ``where``
    names the given shape in errors (``input_shapes['x']``, ``--shapes x=1,3,224,224``): the Python API and
    the command line check the same way."""
    if want is None:
        return
    if len(got) != len(want):
        raise ShapeError(f"{where} has rank {len(got)}; the model declares {list(want)} (rank {len(want)})")
    for k, (w, g) in enumerate(zip(want, got)):
        if isinstance(w, int) and w != g:
            raise ShapeError(f"{where}: dimension {k} must be {w} (the model declares {list(want)}), got {g}")
        if isinstance(w, str) and w:
            if w in symbols and symbols[w][0] != g:
                raise ShapeError(f"{where}: dimension {k} ({w}) is {g}, but {w} is {symbols[w][0]} in input "
                                 f"{symbols[w][1]!r}")
            symbols.setdefault(w, (g, name))


def default_prefix(path: str) -> str:
    """The C prefix of a library's symbols from its file name: ``out/resnet-18.so`` -> ``resnet_18``."""
    stem = os.path.basename(path).split(".")[0]
    stem = re.sub(r"[^A-Za-z0-9_]", "_", stem) or "model"
    return f"m_{stem}" if stem[0].isdigit() else stem


def resolve_signatures(feeds: Sequence[Any], input_shapes: Any = None,
                       ran_with: Sequence[dict[str, tuple[int, ...]]] = ()
                       ) -> tuple[list[dict[str, tuple[int, ...]]], tuple[SymbolicSize, ...]]:
    """The input shapes of each signature of an exported library, and its symbolic sizes.

    ``input_shapes`` is a dict (one signature, fixed shapes: see :func:`resolve_shapes`) or a list
    of dicts (one signature each; the model's symbolic sizes become arguments of the C API, even
    for a list of one).  Without symbolic dimensions, or with a dict, there are no sizes.
    """
    if not isinstance(input_shapes, (list, tuple)):
        return [resolve_shapes(feeds, input_shapes, ran_with)], ()
    if not input_shapes:
        raise ArgumentError("input_shapes is an empty list; give one dict {input name: shape} per signature")
    signatures = []
    for i, d in enumerate(input_shapes):
        if not isinstance(d, Mapping):
            raise ArgumentError(f"input_shapes[{i}] must be a dict {{input name: shape}}, got {type(d).__name__}")
        try:
            signatures.append(resolve_shapes(feeds, dict(d)))
        except (ShapeError, ArgumentError) as e:
            raise type(e)(f"input_shapes[{i}]: {e}") from None
    sizes = symbolic_sizes(feeds)
    if not sizes:
        if len(signatures) > 1:
            raise ShapeError(f"the model has no symbolic dimension, so it has one signature; input_shapes gives "
                             f"{len(signatures)}")
        return signatures, ()
    names = [v.name for v in feeds]
    seen: dict[tuple[int, ...], int] = {}
    for i, shapes in enumerate(signatures):
        values = size_values(sizes, [shapes[n] for n in names])
        if values in seen:
            raise ShapeError(f"input_shapes[{i}] repeats the sizes of input_shapes[{seen[values]}] ("
                             + ", ".join(f"{s.name}={v}" for s, v in zip(sizes, values)) + ")")
        seen[values] = i
    for v in feeds:
        if v.shape is None and any(s[v.name] != signatures[0][v.name] for s in signatures):
            raise ShapeError(f"input {v.name!r} declares no shape, so its dimensions have no names to pass from C; "
                             f"give it the same shape in every signature (input_shapes[0] has "
                             f"{signatures[0][v.name]})")
    return signatures, sizes


def symbolic_sizes(feeds: Sequence[Any]) -> tuple[SymbolicSize, ...]:
    """The symbolic sizes of the inputs ``feeds`` (graph ValueInfos), in order of first appearance."""
    found: dict[str, list[tuple[int, int]]] = {}
    for i, v in enumerate(feeds):
        for k, d in enumerate(v.shape or ()):
            if not isinstance(d, int):
                found.setdefault(d if d else f"{v.name}_dim{k}", []).append((i, k))
    return tuple(SymbolicSize(n, tuple(dims)) for n, dims in found.items())


def size_values(sizes: Sequence[SymbolicSize], shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The value of each symbolic size in the input ``shapes`` (input order)."""
    return tuple(int(shapes[s.dims[0][0]][s.dims[0][1]]) for s in sizes)


def _symbolic_dim(values: Sequence[int], sizes: Sequence[SymbolicSize], per_signature: Sequence[Sequence[int]],
                  declared: Any) -> int | str | None:
    """How an output dimension with ``values`` (per signature; ``per_signature``: the sizes' values) reads
    in the sizes: the declared name when it matches, a constant, ``a*N+b`` for a size N it follows,
    else ``None``."""
    for k, s in enumerate(sizes):
        if declared == s.name and all(v == sv[k] for v, sv in zip(values, per_signature)):
            return s.name
    if len(set(values)) == 1:
        return int(values[0])
    for k, s in enumerate(sizes):
        xs = [sv[k] for sv in per_signature]
        if len(set(xs)) < 2:
            continue
        x0, y0 = xs[0], values[0]
        x1, y1 = next((x, y) for x, y in zip(xs, values) if x != x0)
        if (y1 - y0) % (x1 - x0):
            continue
        a = (y1 - y0) // (x1 - x0)
        b = y0 - a * x0
        if a and all(y == a * x + b for x, y in zip(xs, values)):
            term = s.name if a == 1 else f"{a}*{s.name}"
            return term if b == 0 else f"{term}{'+' if b > 0 else '-'}{abs(b)}"
    return None


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
    if len(progs) != len(shapes) or (len(progs) != 1 and not sizes):
        raise CuvilError(f"internal error: {len(progs)} compiled graphs for {len(shapes)} signatures")
    blob = Blob()
    sig_inputs, sig_outputs, layouts = [], [], []
    for prog, sig in zip(progs, shapes):
        inputs = [TensorSpec(v.name, v.dtype or "float32", tuple(sig[v.name])) for v in feeds]
        outputs = [TensorSpec(n, e.dtype.name, tuple(e.shape)) if isinstance(e, np.ndarray) else
                   TensorSpec(n, e.dtype, tuple(e.shape)) for n, e in prog.outputs]
        for spec in (*inputs, *outputs):
            if spec.dtype not in C_TYPES:
                raise ArgumentError(f"tensor {spec.name!r} has dtype {spec.dtype}, which has no C type here")
        sig_inputs.append(inputs)
        sig_outputs.append(outputs)
        layouts.append(plan_layout(prog, inputs, outputs, blob))
    mod, entries = _linked_modules(progs, tgt, renamed=bool(sizes))
    uses_threads = any(f.name == "GOMP_parallel" for f in mod.functions)
    inputs, outputs = sig_inputs[0], sig_outputs[0]
    meta: dict[str, Any] = {
        "abi": SIZES_ABI if sizes else MODEL_ABI, "kind": "model", "prefix": prefix, "name": name,
        "target": tgt.canonical, "inputs": [t.to_json() for t in inputs], "outputs": [t.to_json() for t in outputs],
        "workspace_bytes": max(lay.workspace_bytes for lay in layouts), "constant_bytes": blob.nbytes,
        "threads": "libgomp" if uses_threads else "none",
        "status": {str(k): v.replace("<prefix>", prefix) for k, v in STATUS.items() if sizes or k != 3}}
    values = [size_values(sizes, [sig[v.name] for v in feeds]) for sig in shapes]
    if sizes:
        c_names = c_identifiers([s.name for s in sizes], set())
        meta["sizes"] = [{"name": s.name, "c_name": c, "dims": [list(d) for d in s.dims]}
                         for s, c in zip(sizes, c_names)]
        for i, v in enumerate(feeds):
            meta["inputs"][i]["shape"] = list(inputs[i].shape) if v.shape is None else list(v.shape)
        declared = dict(declared_outputs or {})
        for j, t in enumerate(meta["outputs"]):
            per_sig = [outs[j].shape for outs in sig_outputs]
            if len({len(sh) for sh in per_sig}) != 1:
                t["shape"] = None
                continue
            want = declared.get(t["name"]) or ()
            t["shape"] = [_symbolic_dim([sh[d] for sh in per_sig], sizes, values,
                                        want[d] if d < len(want) else None) for d in range(len(per_sig[0]))]
        meta["signatures"] = [{"sizes": list(vals), "inputs": [list(t.shape) for t in ins],
                               "outputs": [list(t.shape) for t in outs], "workspace_bytes": lay.workspace_bytes}
                              for vals, ins, outs, lay in zip(values, sig_inputs, sig_outputs, layouts)]
    code = [SignatureCode(vals, entry, len(prog.slots), lay, _bounds_messages(prog))
            for vals, entry, prog, lay in zip(values, entries, progs, layouts)]
    text = api_ir(prefix, tgt, code, len(inputs), len(outputs), blob.nbytes, len(sizes))
    text = cg.add_string_constant(text, f"{prefix}_meta", json.dumps(meta, separators=(",", ":")))
    text = cg.add_string_constant(text, "cuvil_module_meta", json.dumps(
        {"abi": meta["abi"], "kind": "model", "prefix": prefix}))
    mod.link_in(cg.optimize(text, tgt, reloc="pic"))
    _internalize(mod, {f"{prefix}_{x}" for x in ("run", "run_array", "workspace_size", "set_num_threads", "meta",
                                                 "last_error")}
                 | {"cuvil_module_meta"})
    imports = sorted(f.name for f in mod.functions if f.is_declaration and not f.name.startswith("llvm."))
    obj = cg.object_code(mod, tgt)
    if tgt.triple.startswith("x86_64"):  # the thread's error message (<prefix>_last_error) is thread-local
        imports = sorted(set(imports) | {"__tls_get_addr"})
    meta["imports"] = imports
    header = model_header(meta, os.path.basename(path))
    # the library and its header are written under temporary names in the target folder and renamed
    # at the end: a failed export leaves neither a partial file nor a header without its library
    try:
        tmp_dir = tempfile.TemporaryDirectory(prefix=".cuvil-export-", dir=folder)
    except OSError as exc:
        raise ArgumentError(f"cannot write {path!r}: {exc}") from None
    with tmp_dir as tmp:
        files = [os.path.join(tmp, f"{prefix}.o")]
        with open(files[0], "wb") as f:
            f.write(obj)
        if blob.nbytes:
            files.append(_blob_object(cc, tmp, f"{prefix}.weights", blob))
        libs = ["-lm"] + (["-lgomp"] if uses_threads else [])
        lib = os.path.join(tmp, "lib.so")
        proc = subprocess.run([cc, "-shared", "-o", lib, *files, *libs], capture_output=True, text=True)
        if proc.returncode != 0:
            raise TargetError(f"linking {path} with {cc} failed:\n{proc.stderr.strip()}")
        with open(os.path.join(tmp, "lib.h"), "w") as f:
            f.write(header)
        os.replace(os.path.join(tmp, "lib.h"), os.path.splitext(path)[0] + ".h")
        os.replace(lib, path)
    return path


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


def _linked_module(prog: Any, target: Any) -> Any:
    """The graph's kernels and slot-table entry as an LLVM module, already optimised: the session's own
    (its kernels are not emitted or optimised a second time), or an empty entry for a graph with no call."""
    from cuvil.codegen import llvm as cg
    from cuvil.graph.link import link_ir

    if prog.module is not None:
        return prog.module.optimized()[0].clone()  # a copy: the API is linked into it
    return cg.optimize(link_ir([], [], target), target, reloc="pic")


def _linked_modules(progs: Sequence[Any], target: Any, renamed: bool) -> tuple[Any, list[str]]:
    """One LLVM module with every signature's kernels and slot-table entry, and each signature's entry.

    One signature without ``renamed`` is the session's module as it is (entry ``graph``).  Otherwise
    signature k's symbols get the prefix ``s<k>.`` (kernel ``k3`` -> ``s1.k3``, with its
    ``k3_set_num_threads``, ``k3.par0``, ``k3.num_threads``; entry ``s1.graph``), and a kernel equal
    to one of an earlier signature takes that one's name: both are ``linkonce_odr``, so the linker
    keeps the first and drops the copy with everything only it uses.  Not a kernel that O3 inlined
    into its signature's entry with its internal parts (a parallel body, the thread-count global):
    that inlined copy would keep its own thread count, which no setter reaches once the kernel's
    setter is the shared one.
    """
    if not renamed:
        mod = _linked_module(progs[0], target)
        return mod, [progs[0].module.entry if progs[0].module is not None else "graph"]
    import llvmlite.binding as llvm

    mods = [_linked_module(prog, target) for prog in progs]
    entries_of = [prog.module.entry if prog.module is not None else "graph" for prog in progs]
    inlined = [_inlined_kernels(mod, entry, prog) for mod, entry, prog in zip(mods, entries_of, progs)]
    merged = None
    entries = []
    for k, (mod, entry, names) in enumerate(zip(mods, entries_of, kernel_names(progs, inlined))):
        names = {entry: f"s{k}.{entry}", **names}
        for v in (*mod.functions, *mod.global_variables):
            if v.is_declaration:
                continue
            old = v.name
            base = next((n for n in names if old == n or old.startswith((f"{n}_", f"{n}."))), None)
            if base is None:
                continue
            v.name = names[base] + old[len(base):]
            if base != entry and v.linkage not in (llvm.Linkage.internal, llvm.Linkage.private):
                v.linkage = llvm.Linkage.linkonce_odr
        entries.append(names[entry])
        if merged is None:
            merged = mod
        else:
            merged.link_in(mod)
    return merged, entries


def _inlined_kernels(mod: Any, entry: str, prog: Any) -> set[str]:
    """The kernels whose internal symbols (``k3.par0``, ``k3.num_threads``) the entry or its thread
    setter uses directly: O3 inlined them there."""
    text = "".join(str(mod.get_function(n)) for n in (entry, f"{entry}_set_num_threads"))
    return {f.name for f in (prog.kernel_funcs if prog.module is not None else ())
            if re.search(rf'@"?{re.escape(f.name)}\.', text)}


def kernel_names(progs: Sequence[Any], inlined: Sequence[set[str]] = ()) -> list[dict[str, str]]:
    """Per signature, each kernel's name in the module linking them all: ``s<k>.<name>``, or the name
    of an equal kernel (the same loop IR) of an earlier signature, unless ``inlined[k]`` holds it."""
    import pickle

    earlier: dict[bytes, str] = {}  # a kernel's loop IR without its name -> its name in the linked module
    out = []
    for k, prog in enumerate(progs):
        names, mine = {}, {}
        for f in (prog.kernel_funcs if prog.module is not None else ()):
            key = pickle.dumps(dataclasses.replace(f, name=""), protocol=pickle.HIGHEST_PROTOCOL)
            shared = earlier.get(key) if k >= len(inlined) or f.name not in inlined[k] else None
            names[f.name] = shared or f"s{k}.{f.name}"
            mine.setdefault(key, names[f.name])
        for key, new in mine.items():
            earlier.setdefault(key, new)
        out.append(names)
    return out


def _internalize(mod: Any, api: set[str]) -> None:
    """Give every definition but the C API internal linkage (two models never clash; unused code goes)."""
    for v in (*mod.functions, *mod.global_variables):
        if not v.is_declaration and v.name not in api:
            v.linkage = "internal"
