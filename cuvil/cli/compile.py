"""``cuvil compile``: an ONNX model into one native module (``cuvil run``: :mod:`cuvil.cli.run`).

    cuvil compile [model.onnx] [-o model.so | -o model.ll] [--shapes x=1,3,224,224 mask=1,128] [--dump [loops]]

``compile`` runs what an InferenceSession runs: import, the graph passes (cuvil.graph.passes), then
one kernel per group of nodes, linked into one module.  ``--dump`` prints the graph as imported and
after each pass, then every kernel call of the module (kernel, the nodes it computes, its buffers);
``--dump loops`` adds each distinct kernel's loop nest.  ``--shapes`` sets input shapes (symbolic
dimensions); each ``--shapes`` of ``compile -o model.so`` is one signature of the library.
A failed command writes nothing: files are written under temporary names and renamed at the end.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from cuvil.cli.common import check_writable, compile_options, parse_shapes, write_atomic


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
    from cuvil.errors import ShapeError
    from cuvil.frontend.onnx import import_model
    from cuvil.graph.compile import check_supported
    from cuvil.graph.driver import ModelCompiler
    from cuvil.models.resolve import default_model, input_shapes

    path = args.model or default_model()
    signatures = parse_shapes(args.shapes)
    so = bool(args.output) and args.output.endswith(".so")
    if args.output:
        check_writable(args.output)
    options = compile_options(args)
    print(f"compiling {path}")
    t0 = time.perf_counter()
    graph = import_model(path)
    stages = {"import": time.perf_counter() - t0}
    check_supported(graph)
    # the shapes of every signature, checked before compiling anything: a .so needs every symbolic
    # dimension from --shapes; otherwise what --shapes leaves open is 1
    shapes_per_sig = [input_shapes(graph.feeds, sig, symbolic_default=None if so else 1)
                      for sig in (signatures or [{}])]
    n_imported = len(graph.nodes)
    dump = _dumper(graph, options) if args.dump else None
    clock = time.perf_counter()
    compiler = ModelCompiler(graph, options, dump=dump)
    stages["graph passes"] = time.perf_counter() - clock
    graph = compiler.graph
    if args.dump:
        from cuvil.graph.fuse import fusion_groups, groups_str

        print(f"== fusion groups (one kernel each)\n{groups_str(graph, fusion_groups(graph))}")
    shapes, notes = shapes_per_sig[0]
    for note in notes:
        print(f"  {note}")
    bar = _Progress() if not args.dump and sys.stderr.isatty() else None
    try:
        prog = compiler.program(shapes, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    if prog is None:
        raise ShapeError(f"the value of input(s) {', '.join(sorted(compiler.specialised))} decides a shape in "
                         "this model: it compiles for given values only (cuvil run --input)")
    dt = time.perf_counter() - t0
    if args.dump:
        print(dump_calls(prog, loops=args.dump == "loops"))
    print(f"{n_imported} nodes ({len(graph.nodes)} after the graph passes) -> {prog.n_calls} kernel calls "
          f"({prog.n_kernels} distinct kernels) in one native module; compiled in {dt:.1f} s"
          + (f"; {len(prog.fallbacks)} fallback(s) (--dump lists them)" if prog.fallbacks else ""))
    print(f"  {prog.memory}")
    stages.update(getattr(prog, "seconds", {}))
    t0 = time.perf_counter()
    _write(args, compiler, prog, [s for s, _ in shapes_per_sig])
    if args.time:
        if args.output:
            stages["export"] = time.perf_counter() - t0
        from cuvil.graph import parallel

        jobs = parallel.workers_for(options)
        print("wall time per stage (s): " + ", ".join(f"{k} {v:.2f}" for k, v in stages.items())
              + f"; total {sum(stages.values()):.2f}; kernels and LLVM "
              + (f"in {jobs} worker processes" if jobs > 1 else "in this process"))
    return 0


def _dumper(graph: Any, options: Any) -> Any:
    """``--dump``: print the options and the imported graph now, and return the callback that prints the
    graph after each pass (or says it is unchanged)."""
    from cuvil.graph.passes import graph_str

    print(f"== options\n{options}")
    print(f"== imported\n{graph_str(graph)}")
    last = [graph_str(graph)]

    def dump(name: str, g: Any) -> None:
        text = graph_str(g)
        print(f"== after {name}" + (" (unchanged)" if text == last[0] else f"\n{text}"))
        last[0] = text

    return dump


def _write(args: argparse.Namespace, compiler: Any, prog: Any, sigs: list[dict[str, tuple[int, ...]]]) -> None:
    """``-o model.so``: the library (the signature compiled above is not compiled again); ``-o`` any other
    name: the module's LLVM IR; without ``-o`` nothing."""
    if args.output and args.output.endswith(".so"):
        from cuvil.onnx import InferenceSession

        t0 = time.perf_counter()
        sess = InferenceSession.from_compiler(compiler)
        written = sess.export_library(args.output, input_shapes=sigs[0] if len(sigs) == 1 else sigs)
        print(f"wrote {written} and {written[:-3]}.h in {time.perf_counter() - t0:.1f} s")
    elif args.output:
        write_atomic(args.output, (prog.module.get_source("llvm") if prog.module is not None else "").encode())
        print(f"wrote {args.output}")
    else:
        print("compiled only: nothing written (-o model.so writes a shared library with a C entry point and "
              "model.h; -o model.ll the module's LLVM IR)")


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
