"""The C header of an exported model (``model.h`` beside ``model.so``) and the C spelling of its names.

The header documents each input and output (name, C type, shape, ONNX type), the entry points,
the status codes, the symbolic sizes and the sizes compiled (a library of several signatures),
and what the library needs at run time.  See docs/export.md.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from cuvil.graph.export.api import STATUS

C_TYPES = {"float16": "uint16_t", "float32": "float", "float64": "double", "bool": "uint8_t", "int8": "int8_t",
           "int16": "int16_t", "int32": "int32_t", "int64": "int64_t", "uint8": "uint8_t", "uint16": "uint16_t",
           "uint32": "uint32_t", "uint64": "uint64_t"}
_C_KEYWORDS = frozenset(
    "auto break case char const continue default do double else enum extern float for goto if inline int long "
    "register restrict return short signed sizeof static struct switch typedef union unsigned void volatile while "
    "bool true false".split())


def c_identifiers(names: Sequence[str], taken: set[str]) -> list[str]:
    """Distinct C identifiers for tensor or size names (parameters of the typed entry point; upper-cased
    in macro names, so they are distinct ignoring case too).  ``taken`` holds the upper-cased ones used."""
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


def c_string(s: str) -> str:
    """A C string literal of ``s`` (UTF-8, anything but printable ASCII as octal escapes)."""
    return '"' + "".join(chr(c) if 32 <= c < 127 and c not in (34, 92) else f"\\{c:03o}"
                         for c in s.encode()) + '"'


def _comment(s: str) -> str:
    """``s`` made safe inside a C block comment."""
    return s.replace("*/", "* /").replace("\n", " ")


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


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def _shape_str(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _c_dims(shape: Sequence[Any] | None) -> str:
    """``[N][3][16][16]``: a shape with symbolic sizes as C array dimensions (``?`` for one with no name;
    ``[...]`` for a rank that differs between signatures)."""
    if shape is None:
        return "[...]"
    return "".join(f"[{'?' if d is None else d}]" for d in shape)


def _elements_expr(shape: Sequence[Any] | None) -> str:
    """``N*768``: the element count of a shape with symbolic sizes."""
    if shape is None:
        return "(see the shapes per signature)"
    const = math.prod(d for d in shape if isinstance(d, int))
    syms = ["?" if d is None else (d if re.fullmatch(r"\w+", d) else f"({d})") for d in shape
            if not isinstance(d, int)]
    return "*".join(syms + ([str(const)] if const != 1 or not syms else []))


def _c_init(rows: Sequence[Sequence[int]]) -> str:
    return "{" + ", ".join("{" + ", ".join(str(v) for v in r) + "}" for r in rows) + "}"


class _Names:
    """What every part of a model's header names: the prefix, the tensors and sizes and their C identifiers."""

    def __init__(self, meta: dict[str, Any]):
        self.p = meta["prefix"]
        self.P = self.p.upper()
        self.ins, self.outs = meta["inputs"], meta["outputs"]
        self.sizes = meta.get("sizes", [])
        self.sigs = meta.get("signatures", [])
        taken: set[str] = set()
        self.size_ids = [s["c_name"] for s in self.sizes]
        taken |= {s.upper() for s in self.size_ids}
        self.in_ids = c_identifiers([t["name"] for t in self.ins], taken)
        self.out_ids = c_identifiers([t["name"] for t in self.outs], taken)
        self.size_params = [f"int64_t {s}" for s in self.size_ids]
        self.size_list = ", ".join(self.size_ids)
        self.compiled = "; ".join(", ".join(f"{n}={v}" for n, v in zip(self.size_ids, sig["sizes"]))
                                  for sig in self.sigs)
        self.gomp = meta["threads"] == "libgomp"


def model_header(meta: dict[str, Any], lib_name: str) -> str:
    """The C header of an exported model: the entry points, each tensor, status codes, run-time needs."""
    h = _Names(meta)
    return "\n".join([*_comment_lines(meta, lib_name, h), *_macro_lines(meta, h), *_prototype_lines(lib_name, h)])


def _tensor_rows(h: _Names, ts: list[dict[str, Any]], kind: str) -> list[str]:
    """One comment line per tensor: its name, C type and shape, elements, ONNX type."""
    width = max([len(t["name"]) for t in (*h.ins, *h.outs)] + [4])
    types = max(len(C_TYPES[t["dtype"]] + _c_dims(t["shape"])) for t in (*h.ins, *h.outs))
    if h.sizes:
        return [f" *   {kind}[{i}] {_comment(t['name']):<{width}} "
                f"{C_TYPES[t['dtype']] + _c_dims(t['shape']):<{types}}  {_elements_expr(t['shape'])} elements, "
                f"{t['type']}" for i, t in enumerate(ts)]
    return [f" *   {kind}[{i}] {_comment(t['name']):<{width}} {C_TYPES[t['dtype']]}{_shape_str(t['shape'])}  "
            f"{math.prod(t['shape'])} elements, {t['type']}" for i, t in enumerate(ts)]


def _comment_lines(meta: dict[str, Any], lib_name: str, h: _Names) -> list[str]:
    """The header's opening comment: target, tensors, sizes, memory, run-time needs."""
    p, P, ins, outs, sizes, sigs = h.p, h.P, h.ins, h.outs, h.sizes, h.sigs
    size_ids, size_list, compiled, gomp = h.size_ids, h.size_list, h.compiled, h.gomp
    libc = {"malloc", "aligned_alloc", "free", "memcpy", "memset", "memmove", "abort"}
    libm = [f for f in meta["imports"] if f not in libc and not f.startswith(("GOMP_", "omp_"))]
    libs = ", ".join(["libc"] + (["libm"] if libm else []) +
                     (["libgomp (GCC's OpenMP runtime, libgomp.so.1)"] if gomp else []))
    if sizes:
        shapes_line = (f" * Model {_comment(repr(meta['name']))}, compiled for {len(sigs)} "
                       f"signature{'s' if len(sigs) > 1 else ''} of its symbolic sizes (dense, row-major, C-contiguous "
                       "tensors):")
        where = {}
        for s in sizes:
            i, d = s["dims"][0]
            where[s["c_name"]] = f"input {_comment(ins[i]['name'])!r}, dimension {d}" + (
                "" if s["c_name"] == s["name"] else f", {_comment(s['name'])!r} in the model")
        sizes_lines = [
            " *", " * Symbolic sizes: the first arguments of every run function, in this order:",
            *[f" *   int64_t {n:<{max(map(len, size_ids))}}  ({where[n]})" for n in size_ids],
            f" * Compiled for: {_comment(compiled)}.",
            f" * Other sizes: status {P}_ERR_NO_SIGNATURE (3), and {p}_workspace_size returns -1.",
        ]
        work = ", ".join(f"{c}: {sig['workspace_bytes']}" for c, sig in zip(compiled.split("; "), sigs))
        ws_lines = [f" * Constants: {meta['constant_bytes']} bytes inside {lib_name} (read-only, shared by the "
                    "signatures).",
                    f" * Workspace for temporaries: {p}_workspace_size({size_list}) bytes per call ({_comment(work)}),",
                    f" * allocated with malloc by {p}_run (or passed to {p}_run_array)."]
    else:
        shapes_line = (f" * Model {_comment(repr(meta['name']))}, compiled for these fixed shapes (dense, row-major, "
                       "C-contiguous):")
        sizes_lines = []
        ws_lines = [f" * Constants: {meta['constant_bytes']} bytes inside {lib_name} (read-only). Workspace for",
                    f" * temporaries: {meta['workspace_bytes']} bytes per call, allocated with malloc by {p}_run",
                    f" * (or passed to {p}_run_array)."]
    lines = [
        f"/* {os.path.splitext(lib_name)[0]}.h: the C interface of {lib_name}, generated by cuvil.",
        f" * Target: {_target_lines(meta['target'])}",
        shapes_line, " *", *_tensor_rows(h, ins, "input "), *_tensor_rows(h, outs, "output"), *sizes_lines, " *",
        " * float16 tensors hold IEEE half bits (uint16_t); bool tensors one byte each (0 or 1).",
        *ws_lines,
        " *",
        f" * Needs at run time: {libs}.",
        f" * Symbols it imports: {', '.join(meta['imports']) or 'none'}",
        " *   (and memcpy/memset where LLVM lowers copies to calls).",
        f" * Link: cc main.c -L. -l:{lib_name} -Wl,-rpath,'$ORIGIN'   (or dlopen it).",
        " *",
        f" * Every exported symbol starts with {p}_ (besides cuvil_module_meta, which every cuvil",
        " * library defines for cuvil.runtime.load): several models can live in one process.",
        " */",
    ]
    return lines


def _macro_lines(meta: dict[str, Any], h: _Names) -> list[str]:
    """The header's macros: status codes, counts, names, bytes, dtypes and shapes."""
    p, P, ins, outs, sizes, sigs = h.p, h.P, h.ins, h.outs, h.sizes, h.sigs
    size_ids, compiled = h.size_ids, h.compiled
    in_ids, out_ids = h.in_ids, h.out_ids
    lines = [
        f"#ifndef {P}_H", f"#define {P}_H", "#include <stdint.h>", "", "#ifdef __cplusplus", 'extern "C" {',
        "#endif", "",
        "/* Status codes of the run functions. */",
        f"#define {P}_OK 0", f"#define {P}_ERR_NO_MEMORY 1   /* {STATUS[1]} */",
        f"#define {P}_ERR_NULL_POINTER 2  /* {STATUS[2]} */",
        *([f"#define {P}_ERR_NO_SIGNATURE 3  /* {STATUS[3]} ({_comment(compiled)}) */"] if sizes else []),
        f"#define {P}_ERR_BOUNDS 4  /* an index read from an input is out of range: {p}_last_error() */", "",
        f"#define {P}_NUM_INPUTS {len(ins)}", f"#define {P}_NUM_OUTPUTS {len(outs)}",
    ]
    if sizes:
        lines += [
            f"#define {P}_NUM_SIZES {len(sizes)}",
            f"#define {P}_SIZE_NAMES {{{', '.join(c_string(n) for n in size_ids)}}}",
            f"#define {P}_NUM_SIGNATURES {len(sigs)}",
            "/* Per signature (rows in this order): its sizes, the bytes of each input and output, workspace",
            f" * bytes; {P}_MAX_WORKSPACE_BYTES is the largest. */",
            f"#define {P}_SIGNATURE_SIZES {_c_init([s['sizes'] for s in sigs])}",
            f"#define {P}_SIGNATURE_INPUT_BYTES "
            f"{_c_init([[_nbytes(t['dtype'], sh) for t, sh in zip(ins, s['inputs'])] for s in sigs])}",
            f"#define {P}_SIGNATURE_OUTPUT_BYTES "
            f"{_c_init([[_nbytes(t['dtype'], sh) for t, sh in zip(outs, s['outputs'])] for s in sigs])}",
            f"#define {P}_SIGNATURE_WORKSPACE_BYTES {{{', '.join(str(s['workspace_bytes']) for s in sigs)}}}",
            f"#define {P}_MAX_WORKSPACE_BYTES {meta['workspace_bytes']}",
            "/* Per tensor, in entry-point order: names and dtypes; then each one's rank, the largest",
            " * element count of the signatures and its shape in each signature. */",
        ]
    else:
        lines += [
            f"#define {P}_WORKSPACE_BYTES {meta['workspace_bytes']}",
            "/* Per tensor, in entry-point order: names, bytes, dtypes; then each one's elements, rank, shape. */",
        ]
    lines += [
        f"#define {P}_INPUT_NAMES {{{', '.join(c_string(t['name']) for t in ins)}}}",
        f"#define {P}_OUTPUT_NAMES {{{', '.join(c_string(t['name']) for t in outs)}}}",
    ]
    if not sizes:
        lines += [f"#define {P}_INPUT_BYTES {{{', '.join(str(_nbytes(t['dtype'], t['shape'])) for t in ins)}}}",
                  f"#define {P}_OUTPUT_BYTES {{{', '.join(str(_nbytes(t['dtype'], t['shape'])) for t in outs)}}}"]
    lines += [
        f"#define {P}_INPUT_DTYPES {{{', '.join(json.dumps(t['dtype']) for t in ins)}}}",
        f"#define {P}_OUTPUT_DTYPES {{{', '.join(json.dumps(t['dtype']) for t in outs)}}}",
    ]
    for kind, ts, ids in (("INPUT", ins, in_ids), ("OUTPUT", outs, out_ids)):
        for j, (t, ident) in enumerate(zip(ts, ids)):
            m = f"{P}_{kind}_{ident.upper()}"
            if sizes:
                shapes = [s["inputs" if kind == "INPUT" else "outputs"][j] for s in sigs]
                lines += [f"#define {m}_RANK {len(t['shape'])}"] if t["shape"] is not None else []
                lines += [f"#define {m}_MAX_ELEMENTS {max(math.prod(sh) for sh in shapes)}",
                          f"#define {m}_SHAPES {_c_init(shapes)}"]
            else:
                lines += [f"#define {m}_ELEMENTS {math.prod(t['shape'])}", f"#define {m}_RANK {len(t['shape'])}",
                          f"#define {m}_SHAPE {{{', '.join(str(d) for d in t['shape'])}}}"]
    return lines


def _prototype_lines(lib_name: str, h: _Names) -> list[str]:
    """The header's function declarations, each with its comment."""
    p, P, ins, outs, sizes = h.p, h.P, h.ins, h.outs, h.sizes
    size_params, size_list, gomp = h.size_params, h.size_list, h.gomp
    in_ids, out_ids = h.in_ids, h.out_ids
    lines: list[str] = []
    params = [f"const {C_TYPES[t['dtype']]} *{i}" for t, i in zip(ins, in_ids)] + \
             [f"{C_TYPES[t['dtype']]} *{i}" for t, i in zip(outs, out_ids)]
    sizes_first = (f" * The sizes ({size_list}) choose the signature (status {P}_ERR_NO_SIGNATURE for sizes not "
                   "compiled);\n * each tensor has the shape above with these sizes.") if sizes else ""
    lines += [
        "",
        "/* Run the model once: reads the inputs, writes every output (outputs must not overlap any",
        " * input or each other). Returns 0, or a status code above. Calls from several threads at",
        " * once are safe (each call allocates its own workspace)." + ("\n" + sizes_first if sizes else "") + " */",
        f"int32_t {p}_run({', '.join(size_params + params) or 'void'});", "",
        f"/* The same with pointer arrays: {f'sizes[{len(sizes)}] ({size_list}), ' if sizes else ''}"
        f"inputs[{len(ins)}], outputs[{len(outs)}] in the order above.",
        f" * workspace: NULL (allocated per call) or at least {p}_workspace_size({size_list}) bytes that no",
        " * other call uses at the same time (64-byte alignment is best). */",
        f"int32_t {p}_run_array({'const int64_t *sizes, ' if sizes else ''}const void *const *inputs, "
        "void *const *outputs, void *workspace);", "",
    ]
    if sizes:
        lines += ["/* Bytes of workspace a call with these sizes needs; -1 if they have no signature. */",
                  f"int64_t {p}_workspace_size({', '.join(size_params)});", ""]
    else:
        lines += [f"/* Bytes of workspace a call needs ({P}_WORKSPACE_BYTES). */",
                  f"int64_t {p}_workspace_size(void);", ""]
    lines += [
        "/* Threads for the parallel loops of later calls; n <= 0 (the default) lets "
        + ("libgomp choose" if gomp else "the runtime choose"),
        " * (OMP_NUM_THREADS, else all cores). Set it before starting calls from several threads."
        + (" Run with\n * GOMP_SPINCOUNT=3000 (cuvil's Python loader sets it): libgomp's default spins for tens of"
           "\n * ms, taking the cores a team member needs on a shared machine." if gomp else
           f"\n * ({lib_name} has no parallel loop: this only records n.)") + " */",
        f"void {p}_set_num_threads(int32_t n);", "",
        f"/* After a run returned {P}_ERR_BOUNDS: which node, input and index (an index out of range",
        " * for the data it indexes, such as a Gather's; the run stopped before touching memory outside",
        " * any tensor). The calling thread's own message; \"\" after a successful run. */",
        f"const char *{p}_last_error(void);", "",
        "/* The interface above as JSON: inputs and outputs (name, dtype, shape), workspace, target"
        + (", sizes\n * and signatures." if sizes else ".") + " */",
        f"const char *{p}_meta(void);", "",
        "#ifdef __cplusplus", "}", "#endif", f"#endif /* {P}_H */", "",
    ]
    return lines
