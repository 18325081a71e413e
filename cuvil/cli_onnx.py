"""``cuvil compile`` and ``cuvil run``: ONNX models from the command line.

    cuvil compile [model.onnx] [-o model.ll] [--dump [loops]]   # default: the onnx wheel's light ResNet-50
    cuvil run model.onnx --input x=x.npy [-o out.npz]

``compile`` runs what an InferenceSession runs: import, the graph passes (cuvil.graph.passes), then
one kernel per group of nodes, linked into one module.  ``--dump`` prints the graph as imported and
after each pass, then every kernel call of the module (kernel, the nodes it computes, its buffers);
``--dump loops`` adds each distinct kernel's loop nest.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np


def default_model() -> str:
    """The light ResNet-50 that ships in the onnx wheel (its weights are ConstantOfShape nodes)."""
    import onnx

    return os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light", "light_resnet50.onnx")


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("compile", help="compile an ONNX model into one native module")
    p.add_argument("model", nargs="?", default=None, help="model.onnx (default: the onnx wheel's light ResNet-50)")
    p.add_argument("-o", "--output", default=None,
                   help="model.so: a shared library with a C entry point and model.h (docs/export.md); "
                        "any other name: the module's LLVM IR")
    p.add_argument("--shapes", action="append", default=[], metavar="NAME=D0,D1,..[;NAME=..]",
                   help="input shapes (symbolic dimensions); repeat for several signatures in one .so")
    p.add_argument("--target", default="llvm")
    p.add_argument("--dump", nargs="?", const="graph", choices=["graph", "loops"], default=None,
                   help="print the graph after each pass and the kernel calls (loops: and each kernel's loop nest)")
    p = sub.add_parser("run", help="run an ONNX model on .npy inputs")
    p.add_argument("model", help="model.onnx")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy", help="one per model input")
    p.add_argument("-o", "--output", default=None, help="write the outputs to this .npz")
    p.add_argument("--target", default="llvm")


class _Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, width: int = 30):
        self.width = width
        self.start = time.perf_counter()

    def __call__(self, step: int, total: int, node: Any) -> None:
        done = int(self.width * (step + 1) / max(total, 1))
        label = str(node)[:50]
        sys.stderr.write(f"\r[{'#' * done}{'.' * (self.width - done)}] {step + 1}/{total} {label:<50}")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")


def compile_cmd(args: argparse.Namespace) -> int:
    from cuvil.frontend.onnx import import_model
    from cuvil.graph.compile import check_supported, compile_graph, prepare
    from cuvil.graph.passes import graph_str

    path = args.model or default_model()
    print(f"compiling {path}")
    t0 = time.perf_counter()
    graph = import_model(path)
    check_supported(graph)
    n_imported = len(graph.nodes)
    dump = None
    if args.dump:
        print(f"== imported\n{graph_str(graph)}")

        last = [graph_str(graph)]

        def dump(name: str, g: Any) -> None:
            text = graph_str(g)
            print(f"== after {name}" + (" (unchanged)" if text == last[0] else f"\n{text}"))
            last[0] = text

    graph = prepare(graph, dump=dump)
    if args.dump:
        from cuvil.graph.fuse import fusion_groups, groups_str

        print(f"== fusion groups (one kernel each)\n{groups_str(graph, fusion_groups(graph))}")
    signatures = [_parse_shapes(text) for text in args.shapes]
    shapes = {}
    for v in graph.feeds:
        if signatures and v.name in signatures[0]:
            shapes[v.name] = signatures[0][v.name]
            continue
        dims = [d if isinstance(d, int) else 1 for d in (v.shape or [])]
        if v.shape is not None and any(not isinstance(d, int) for d in v.shape):
            print(f"  input {v.name}: symbolic dimensions set to 1 for this compile: {list(v.shape)} -> {dims}")
        shapes[v.name] = tuple(dims)
    bar = _Progress() if not args.dump and sys.stderr.isatty() else None
    try:
        prog = compile_graph(graph, shapes, {}, args.target, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    dt = time.perf_counter() - t0
    if args.dump:
        print(dump_calls(prog, loops=args.dump == "loops"))
    print(f"{n_imported} nodes ({len(graph.nodes)} after the graph passes) -> {prog.n_calls} kernel calls "
          f"({prog.n_kernels} distinct kernels) in one native module; compiled in {dt:.1f} s"
          + (f"; {len(prog.fallbacks)} fallback(s) (--dump lists them)" if prog.fallbacks else ""))
    print(f"  {prog.memory}")
    if args.output and args.output.endswith(".so"):
        from cuvil.onnx import InferenceSession

        t0 = time.perf_counter()
        sess = InferenceSession(path, target=args.target)
        written = sess.export_library(args.output, input_shapes=(signatures[0] if len(signatures) == 1 else
                                                                 signatures or None))
        print(f"wrote {written} and {written[:-3]}.h in {time.perf_counter() - t0:.1f} s")
    elif args.output:
        with open(args.output, "w") as f:
            f.write(prog.module.get_source("llvm") if prog.module is not None else "")
        print(f"wrote {args.output}")
    return 0


def _parse_shapes(text: str) -> dict[str, tuple[int, ...]]:
    """``"x=1,3,224,224;mask=1,128"`` -> ``{"x": (1, 3, 224, 224), "mask": (1, 128)}``."""
    from cuvil.errors import ArgumentError

    out: dict[str, tuple[int, ...]] = {}
    for part in text.replace(" ", ";").split(";"):
        if not part:
            continue
        name, eq, dims = part.partition("=")
        try:
            out[name] = tuple(int(d) for d in dims.split(",") if d)
        except ValueError:
            out[name] = ()
        if not eq or not name or not out[name] or any(d < 1 for d in out[name]):
            raise ArgumentError(f"--shapes {text!r}: write NAME=D0,D1,... with positive sizes, e.g. x=1,3,224,224")
    return out


def _slot_str(prog: Any, k: int) -> str:
    s = prog.slots[k]
    what = {"feed": f"input {s.name!r}", "const": "constant", "temp": "temporary"}.get(s.kind, s.kind)
    return f"%{k}:{s.dtype}[{s.size}] {what}"


def dump_calls(prog: Any, loops: bool = False) -> str:
    """The compiled graph's kernel calls in order (kernel, what it computes, its buffers: slot, dtype,
    elements, kind), the memory plan's arena offsets of temporaries, the fallbacks (kernels whose
    automatic schedule isl refused in part or whole: ``prog.fallbacks``), and optionally every
    kernel's loops."""
    lines = [f"== kernel calls ({prog.n_calls} calls of {prog.n_kernels} kernels)"]
    offsets = prog.memory.offsets
    for call, label in zip(prog.kernel_calls, prog.labels):
        lines.append(f"  {call.kernel}: {label}")
        for k in call.args:
            at = f" at arena+{offsets[k]}" if k in offsets else ""
            lines.append(f"      {_slot_str(prog, k)}{at}")
    outs = ", ".join(f"{n} = %{e.slot}" if hasattr(e, "slot") else f"{n} = constant" for n, e in prog.outputs)
    lines.append(f"  outputs: {outs}")
    fallbacks = list(getattr(prog, "fallbacks", ()))
    lines.append(f"== fallbacks ({len(fallbacks)}: kernels that took a plainer schedule than planned)")
    lines += [f"  {f}" for f in fallbacks]
    if loops:
        for f in prog.kernel_funcs:
            lines.append(f"== kernel {f.name}\n{f}")
    return "\n".join(lines)


def run_cmd(args: argparse.Namespace) -> int:
    import cuvil.onnx
    from cuvil.errors import ArgumentError

    feeds = {}
    for item in args.input:
        if "=" not in item:
            raise ArgumentError(f"--input {item!r}: write NAME=FILE.npy")
        name, file = item.split("=", 1)
        feeds[name] = np.load(file)
    sess = cuvil.onnx.InferenceSession(args.model, target=args.target)
    t0 = time.perf_counter()
    outs = sess.run(None, feeds)
    dt = time.perf_counter() - t0
    names = [o.name for o in sess.get_outputs()]
    for n, y in zip(names, outs):
        print(f"{n}: {y.dtype}{list(y.shape)}")
    print(f"ran in {dt * 1e3:.1f} ms (including compilation for new input shapes)")
    if args.output:
        np.savez(args.output, **dict(zip(names, outs)))
        print(f"wrote {args.output}")
    return 0


def dispatch(args: argparse.Namespace) -> int | None:
    """Run the ONNX subcommand ``args.cmd``; None if it is not one of them."""
    from cuvil.errors import CuvilError

    cmds = {"compile": compile_cmd, "run": run_cmd}
    if args.cmd not in cmds:
        return None
    try:
        return cmds[args.cmd](args)
    except (CuvilError, OSError, ValueError) as exc:
        print(f"cuvil {args.cmd}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
