"""``cuvil compile`` and ``cuvil run``: ONNX models from the command line.

    cuvil compile [model.onnx] [-o model.so | -o model.ll] [--shapes x=1,3,224,224 mask=1,128] [--dump [loops]]
    cuvil run model.onnx --input x=x.npy [--input ...] [-o out.npz]
    cuvil run model.onnx --random [--shapes x=1,3,224,224] [--seed 0]

``compile`` runs what an InferenceSession runs: import, the graph passes (cuvil.graph.passes), then
one kernel per group of nodes, linked into one module.  ``--dump`` prints the graph as imported and
after each pass, then every kernel call of the module (kernel, the nodes it computes, its buffers);
``--dump loops`` adds each distinct kernel's loop nest.  ``--shapes`` sets input shapes (symbolic
dimensions); each ``--shapes`` of ``compile -o model.so`` is one signature of the library.
``run`` prints each output's shape, dtype, range and first values.  A failed command writes nothing:
files are written under temporary names and renamed at the end.
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
    shapes_help = ("input shapes, e.g. --shapes x=1,3,224,224 mask=1,128 (symbolic dimensions); "
                   "{}")
    p = sub.add_parser("compile", help="compile an ONNX model into one native module")
    p.add_argument("model", nargs="?", default=None, help="model.onnx (default: the onnx wheel's light ResNet-50)")
    p.add_argument("-o", "--output", default=None,
                   help="model.so: a shared library with a C entry point and model.h (docs/export.md); "
                        "any other name: the module's LLVM IR; without -o nothing is written")
    p.add_argument("--shapes", action="append", nargs="+", default=[], metavar="NAME=D0,D1,...",
                   help=shapes_help.format("repeat --shapes for several signatures in one .so"))
    p.add_argument("--target", default="llvm")
    p.add_argument("--dump", nargs="?", const="graph", choices=["graph", "loops"], default=None,
                   help="print the graph after each pass and the kernel calls (loops: and each kernel's loop nest)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: contractions with constant weights (MatMul, Gemm, Conv) multiply in bfloat16 with "
                        "float32 accumulation on AVX512-BF16 (docs/precision.md); fp32 elsewhere")
    p.add_argument("--time", action="store_true",
                   help="print the wall time of each stage (import, graph passes, kernels, LLVM, export)")
    add_option_flags(p)
    p = sub.add_parser("run", help="run an ONNX model on .npy inputs or random ones; print its outputs")
    p.add_argument("model", help="model.onnx")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy", help="one per model input")
    p.add_argument("--random", action="store_true", help="random inputs for those not given by --input (floats "
                   "standard normal, token ids within their embedding's rows, other integers 0 or 1)")
    p.add_argument("--seed", type=int, default=0, help="--random: the seed")
    p.add_argument("--shapes", action="append", nargs="+", default=[], metavar="NAME=D0,D1,...",
                   help=shapes_help.format("--random makes inputs of these shapes (default: 1 for symbolic "
                                           "dimensions)"))
    p.add_argument("-o", "--output", default=None, help="write the outputs to this .npz")
    p.add_argument("--target", default="llvm")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: contractions with constant weights (MatMul, Gemm, Conv) multiply in bfloat16 with "
                        "float32 accumulation on AVX512-BF16 (docs/precision.md); fp32 elsewhere")
    add_option_flags(p)


def add_option_flags(p: Any) -> None:
    """The compile options beyond --target and --precision (cuvil.options.CompileOptions)."""
    p.add_argument("--no-winograd", action="store_true", help="every 3x3 convolution direct")
    p.add_argument("--no-bounds-checks", action="store_true", help="no run-time checks of indices read from inputs")
    p.add_argument("--no-fuse", action="store_true", help="one kernel per node")
    p.add_argument("--jobs", "-j", type=int, default=None,
                   help="worker processes that compile kernels (default: one per core; 1: none)")
    p.add_argument("--check-schedules", action="store_true",
                   help="isl proves the automatic schedules legal although they are legal by construction "
                        "(a debug mode, slower)")
    p.add_argument("--threshold", action="append", default=[], metavar="NAME=VALUE",
                   help="one of the scheduler's thresholds (cuvil.schedule.heuristics.Heuristics; default: derived "
                        "from the target), e.g. --threshold winograd_min_tiles=1")


def compile_options(args: argparse.Namespace) -> Any:
    """The CompileOptions the command line asks for."""
    from cuvil.errors import ArgumentError
    from cuvil.options import CompileOptions

    opts = CompileOptions(target=args.target, precision=args.precision, winograd=not args.no_winograd,
                          bounds_checks=not args.no_bounds_checks, fuse=not args.no_fuse, jobs=args.jobs,
                          check_schedules=args.check_schedules)
    changes: dict[str, Any] = {}
    for item in args.threshold:
        name, sep, value = item.partition("=")
        if not sep:
            raise ArgumentError(f"--threshold {item!r}: expected NAME=VALUE")
        try:
            changes[name] = float(value) if "." in value else int(value)
        except ValueError:
            raise ArgumentError(f"--threshold {item!r}: {value!r} is not a number") from None
    return opts.with_heuristics(**changes) if changes else opts


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
    from cuvil.graph.passes import graph_str

    path = args.model or default_model()
    signatures = parse_shapes(args.shapes)
    so = bool(args.output) and args.output.endswith(".so")
    if args.output:
        _check_writable(args.output)
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
    dump = None
    if args.dump:
        print(f"== options\n{options}")
        print(f"== imported\n{graph_str(graph)}")

        last = [graph_str(graph)]

        def dump(name: str, g: Any) -> None:
            text = graph_str(g)
            print(f"== after {name}" + (" (unchanged)" if text == last[0] else f"\n{text}"))
            last[0] = text

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
    if so:
        from cuvil.onnx import InferenceSession

        t0 = time.perf_counter()
        sess = InferenceSession.from_compiler(compiler)  # the signature compiled above is not compiled again
        sigs = [s for s, _ in shapes_per_sig]
        written = sess.export_library(args.output, input_shapes=sigs[0] if len(sigs) == 1 else sigs)
        print(f"wrote {written} and {written[:-3]}.h in {time.perf_counter() - t0:.1f} s")
    elif args.output:
        t0 = time.perf_counter()
        write_atomic(args.output, (prog.module.get_source("llvm") if prog.module is not None else "").encode())
        print(f"wrote {args.output}")
    else:
        print("compiled only: nothing written (-o model.so writes a shared library with a C entry point and "
              "model.h; -o model.ll the module's LLVM IR)")
    if args.time:
        if so or args.output:
            stages["export"] = time.perf_counter() - t0
        from cuvil.graph import parallel

        jobs = parallel.workers_for(options)
        print("wall time per stage (s): " + ", ".join(f"{k} {v:.2f}" for k, v in stages.items())
              + f"; total {sum(stages.values()):.2f}; kernels and LLVM "
              + (f"in {jobs} worker processes" if jobs > 1 else "in this process"))
    return 0


def parse_shapes(groups: list[list[str]] | list[str], one: bool = False) -> Any:
    """``--shapes`` as argparse collects them (one list of ``NAME=D0,D1,...`` items per ``--shapes``;
    ``;`` also separates items) -> one ``{name: shape}`` per signature; with ``one``, at most one
    signature, returned as a dict ({} when none)."""
    from cuvil.errors import ArgumentError

    signatures = []
    for group in groups:
        items = [group] if isinstance(group, str) else group
        sig: dict[str, tuple[int, ...]] = {}
        for text in items:
            for part in text.replace(" ", ";").split(";"):
                if not part:
                    continue
                name, eq, dims = part.partition("=")
                try:
                    shape = tuple(int(d) for d in dims.split(",") if d)
                except ValueError:
                    shape = ()
                if not eq or not name or not shape or any(d < 1 for d in shape):
                    raise ArgumentError(f"--shapes {part!r}: write NAME=D0,D1,... with positive sizes, e.g. "
                                        "--shapes x=1,3,224,224 mask=1,128 (the model goes before --shapes)")
                if name in sig:
                    raise ArgumentError(f"--shapes gives input {name!r} twice in one signature")
                sig[name] = shape
        signatures.append(sig)
    if one:
        if len(signatures) > 1:
            raise ArgumentError("this command takes one --shapes (a list of NAME=D0,D1,... items); several are "
                                "for `cuvil compile -o model.so`")
        return signatures[0] if signatures else {}
    return signatures


def input_shapes(feeds: Any, given: dict[str, tuple[int, ...]], symbolic_default: int | None = 1
                 ) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """Every input's shape from ``--shapes`` (``given``), checked against the model's declared shapes,
    or the declared shape; a symbolic dimension left open is ``symbolic_default`` (with a note), or,
    when that is None, an error that says which ``--shapes`` to pass.  Returns (shapes, notes)."""
    from cuvil.errors import ArgumentError, ShapeError
    from cuvil.graph.export import check_given_shape

    declared = {v.name: v.shape for v in feeds}
    unknown = [n for n in given if n not in declared]
    if unknown:
        raise ArgumentError(f"--shapes names {', '.join(repr(n) for n in unknown)}, not an input of the model; its "
                            f"inputs: {_inputs_str(feeds)}")
    shapes: dict[str, tuple[int, ...]] = {}
    notes: list[str] = []
    symbols: dict[str, tuple[int, str]] = {}
    open_inputs = []
    for v in feeds:
        want = v.shape
        if v.name in given:
            got = given[v.name]
            check_given_shape(f"--shapes {v.name}={','.join(map(str, got))}", v.name, want, tuple(got), symbols)
            shapes[v.name] = tuple(got)
        elif want is not None and all(isinstance(d, int) for d in want):
            shapes[v.name] = tuple(want)  # type: ignore[arg-type]
        else:
            open_inputs.append(v)
    if open_inputs and symbolic_default is None:
        example = " ".join(f"{v.name}=" + ",".join(str(d) if isinstance(d, int) else "1" for d in (v.shape or ["1"]))
                           for v in open_inputs)
        raise ShapeError(f"input(s) {', '.join(f'{v.name!r} {list(v.shape or [])}' for v in open_inputs)} have "
                         "symbolic dimensions, and a library is compiled for fixed shapes: pass --shapes "
                         f"name=d0,d1,... (here e.g. --shapes {example}); repeat --shapes to compile several "
                         "sizes into one library (its C functions then take the sizes)")
    for v in open_inputs:
        if v.shape is None:
            raise ShapeError(f"input {v.name!r} declares no shape: give it with --shapes {v.name}=d0,d1,...")
        dims = tuple(d if isinstance(d, int) else symbols.get(d, (symbolic_default,))[0] for d in v.shape)
        shapes[v.name] = dims  # type: ignore[assignment]
        if all(isinstance(d, int) or d in symbols for d in v.shape):
            notes.append(f"input {v.name}: symbolic dimensions from the other inputs: {list(v.shape)} -> {list(dims)}")
        else:
            notes.append(f"input {v.name}: symbolic dimensions set to {symbolic_default} (--shapes sets them): "
                         f"{list(v.shape)} -> {list(dims)}")
    return shapes, notes


def _inputs_str(feeds: Any) -> str:
    return ", ".join(f"{v.name} {list(v.shape) if v.shape is not None else '(no shape)'}" for v in feeds) or "none"


def _check_writable(path: str) -> None:
    from cuvil.errors import ArgumentError

    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ArgumentError(f"cannot write {path!r}: the folder {folder!r} does not exist")
    if os.path.isdir(path):
        raise ArgumentError(f"cannot write {path!r}: it is a folder")


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` at ``path`` through a temporary file in the same folder, renamed at the end."""
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=".cuvil-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


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
    import io

    import cuvil.onnx
    from cuvil.errors import ArgumentError
    from cuvil.frontend.onnx import import_model
    from cuvil.graph.feeds import describe_random, random_feeds

    given = parse_shapes(args.shapes, one=True)
    if args.output:
        _check_writable(args.output)
    graph = import_model(args.model)
    names = [v.name for v in graph.feeds]
    input_shapes(graph.feeds, given, symbolic_default=1)  # --shapes names inputs and fits their declared shapes
    feeds: dict[str, np.ndarray] = {}
    for item in args.input:
        name, eq, file = item.partition("=")
        if not eq or not name or not file:
            raise ArgumentError(f"--input {item!r}: write NAME=FILE.npy")
        if name not in names:
            raise ArgumentError(f"--input {item!r}: {name!r} is not an input of the model; its inputs: "
                                f"{_inputs_str(graph.feeds)}")
        try:
            feeds[name] = np.load(file, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise ArgumentError(f"--input {item!r}: cannot read {file!r} as a .npy array: {exc}") from None
        if not isinstance(feeds[name], np.ndarray):
            raise ArgumentError(f"--input {item!r}: {file!r} holds several arrays (an .npz); give one .npy per input")
        if name in given and tuple(feeds[name].shape) != given[name]:
            raise ArgumentError(f"--input {item!r} has shape {list(feeds[name].shape)}, but --shapes gives "
                                f"{name}={','.join(map(str, given[name]))}")
    missing = [v for v in graph.feeds if v.name not in feeds]
    if missing and not args.random:
        raise ArgumentError(f"missing input(s) {', '.join(repr(v.name) for v in missing)} ("
                            + ", ".join(f"{v.name}: {v.dtype} {list(v.shape or [])}" for v in missing)
                            + "): give --input NAME=FILE.npy for each, or --random")
    if missing:
        # the given inputs' sizes decide the symbols they share with the random ones
        known = {**given, **{n: tuple(a.shape) for n, a in feeds.items() if n not in given}}
        shapes, notes = input_shapes(graph.feeds, known, symbolic_default=1)
        for note in notes:
            print(note)
        feeds.update(random_feeds(graph, shapes, seed=args.seed, names=[v.name for v in missing]))
        for v in missing:
            print(f"input {v.name}: random {feeds[v.name].dtype}{list(feeds[v.name].shape)}, "
                  f"{describe_random(graph, v.name)}")
    sess = cuvil.onnx.InferenceSession.from_graph(graph, options=compile_options(args))
    t0 = time.perf_counter()
    outs = sess.run(None, feeds)
    dt = time.perf_counter() - t0
    out_names = [o.name for o in sess.get_outputs()]
    for n, y in zip(out_names, outs):
        print(summary(n, y))
    print(f"ran in {dt * 1e3:.1f} ms (including compilation for new input shapes)")
    if args.output:
        buf = io.BytesIO()
        np.savez(buf, **dict(zip(out_names, outs)))
        write_atomic(args.output, buf.getvalue())
        print(f"wrote {args.output}")
    return 0


def summary(name: str, y: np.ndarray, count: int = 6) -> str:
    """One line about an output: ``y: float32[5, 3]  min -0.93  max 0.98  values [0.5, 0.73, ...]``."""
    head = f"{name}: {y.dtype}{list(y.shape)}"
    if y.size == 0:
        return f"{head}  (empty)"
    flat = y.reshape(-1)
    values = ", ".join(_fmt(x) for x in flat[:count]) + (", ..." if flat.size > count else "")
    if y.dtype.kind == "b":
        return f"{head}  true {int(np.count_nonzero(flat))} of {flat.size}  values [{values}]"
    stats = ""
    if y.dtype.kind == "f":
        finite = flat[np.isfinite(flat)]
        nan, inf = int(np.isnan(flat).sum()), int(np.isinf(flat).sum())
        if finite.size:
            stats = f"  min {_fmt(finite.min())}  max {_fmt(finite.max())}  mean {_fmt(finite.mean())}"
        stats += (f"  nan {nan}" if nan else "") + (f"  inf {inf}" if inf else "")
    else:
        stats = f"  min {flat.min()}  max {flat.max()}"
    return f"{head}{stats}  values [{values}]"


def _fmt(x: Any) -> str:
    return f"{float(x):.5g}" if isinstance(x, (float, np.floating)) else str(x)


def dispatch(args: argparse.Namespace) -> int | None:
    """Run the ONNX subcommand ``args.cmd``; None if it is not one of them (errors propagate to
    :func:`cuvil.cli.main`, which prints them as ``cuvil: error: ...``)."""
    cmds = {"compile": compile_cmd, "run": run_cmd}
    if args.cmd not in cmds:
        return None
    return cmds[args.cmd](args)
