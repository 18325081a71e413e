"""``cuvil run``: an ONNX model on .npy inputs or random ones; prints each output's shape, dtype, range and
first values.

    cuvil run model.onnx --input x=x.npy [--input ...] [-o out.npz]
    cuvil run model.onnx --random [--shapes x=1,3,224,224] [--seed 0]

A failed command writes nothing: the ``.npz`` is written under a temporary name and renamed at the end.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from cuvil.cli.common import check_writable, compile_options, parse_shapes, write_atomic
from cuvil.errors import ArgumentError

__all__ = ["run_cmd", "summary"]


def run_cmd(args: argparse.Namespace) -> int:
    import io

    import cuvil.onnx
    from cuvil.frontend.onnx import import_model
    from cuvil.graph.feeds import describe_random, random_feeds
    from cuvil.models.resolve import input_shapes, inputs_str

    given = parse_shapes(args.shapes, one=True)
    if args.output:
        check_writable(args.output)
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
                                f"{inputs_str(graph.feeds)}")
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
