"""``cuvil compile`` and ``cuvil run``: ONNX models from the command line.

    cuvil compile [model.onnx] [-o model.ll]      # compile (default: the onnx wheel's light ResNet-50)
    cuvil run model.onnx --input x=x.npy [-o out.npz]
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
    p.add_argument("-o", "--output", default=None, help="write the module's LLVM IR here (.ll)")
    p.add_argument("--target", default="llvm")
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
    from cuvil.frontend.onnx import check_supported, compile_graph, import_model

    path = args.model or default_model()
    print(f"compiling {path}")
    t0 = time.perf_counter()
    graph = import_model(path)
    check_supported(graph)
    shapes = {}
    for v in graph.feeds:
        dims = [d if isinstance(d, int) else 1 for d in (v.shape or [])]
        if v.shape is not None and any(not isinstance(d, int) for d in v.shape):
            print(f"  input {v.name}: symbolic dimensions set to 1 for this compile: {list(v.shape)} -> {dims}")
        shapes[v.name] = tuple(dims)
    bar = _Progress()
    try:
        prog = compile_graph(graph, shapes, {}, args.target, progress=bar)
    finally:
        bar.close()
    dt = time.perf_counter() - t0
    print(f"{len(graph.nodes)} nodes -> {prog.n_calls} kernel calls ({prog.n_kernels} distinct kernels) in one "
          f"native module; compiled in {dt:.1f} s")
    if args.output:
        with open(args.output, "w") as f:
            f.write(prog.module.get_source("llvm") if prog.module is not None else "")
        print(f"wrote {args.output}")
    return 0


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
