"""``cuvil tune``: the command line of the autotuner (its runner; the flags are in :mod:`cuvil.cli.parser`).

    cuvil tune model.onnx --trials 200 --db cuvil-tuning.db [--plot curve.svg]
    cuvil tune resnet18 --trials 32                        # a cuvil.models.zoo model
    cuvil tune bert-base --config ci --trials 16           # a registry model (cuvil.models.registry; needs torch)
    cuvil tune model.onnx --shapes x=8,3,224,224           # sizes for the model's symbolic dimensions

A model is named as every command names one (:func:`cuvil.models.resolve.resolve`: a file, a
cuvil.models.zoo name, ``light_<name>``, or a registry name, exported as ``cuvil bench --registry`` does, at
``--config``; ``--registry`` picks the registry's where cuvil.models.zoo has a model of the same name).  Kernels
are named by their op and shapes, e.g. ``Conv 1x64x56x56 * 64x64x3x3 (+Relu) [3fa9c2d1]`` (the workload
key's start after it).  The parser (:mod:`cuvil.cli.parser`) names :func:`tune_cmd` as the command's runner.
``--plot`` draws the model's estimated latency (sum over kernels of runs x best time)
against trials spent: with matplotlib when it is installed (any format it writes), else as SVG.

The measurements are made by the runner :func:`make_runner` builds from the arguments: by default none, so
each kernel's :func:`~cuvil.autotune.tune` call starts local workers; with ``--cluster URL --board NAME``
the boards of that kind in a Dask cluster (:class:`cuvil.autotune.DaskRunner`, docs/boards.md).
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cuvil.cli.common import error, parse_shapes
from cuvil.errors import CuvilError

__all__ = ["fixed_shapes", "make_runner", "plot_curve", "resolve_model", "results_table", "svg_curve", "tune_cmd"]


def tune_cmd(args: argparse.Namespace) -> int:
    """Run ``cuvil tune``: resolve the model, build the runner, tune, print a table of the kernels; returns the
    exit status (errors are one line on stderr)."""
    from cuvil.autotune.whole_models import tune_model

    history: list[tuple[int, float]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="cuvil-tune-") as workdir:
            graph, shapes = resolve_model(args, workdir)
            runner = make_runner(args)
            try:
                results = tune_model(graph, args.trials, args.db, args.target, args.timeout, args.threads,
                                     progress=True, history=history, shapes=shapes, runner=runner)
            finally:
                if runner is not None:
                    runner.close()
    except CuvilError as exc:
        return error(str(exc))
    except OSError as exc:
        return error(f"{exc.strerror or exc}" + (f": {exc.filename!r}" if exc.filename else ""))
    print(results_table(results))
    if args.plot:
        plot_curve(history, args.plot)
        print(f"wrote {args.plot}")
    return 0


def make_runner(args: argparse.Namespace) -> Any:
    """The runner that measures every kernel's candidates (the :class:`~cuvil.autotune.measure.Runner`
    protocol), or None: each kernel's tune() call then starts local workers of its own.  ``tune_cmd`` closes
    it.
    ``--cluster URL --board NAME``: a :class:`~cuvil.autotune.dask_runner.DaskRunner` on that scheduler's boards
    of kind NAME (TLS from the --tls-* files; plain tcp:// only on loopback unless --insecure)."""
    from cuvil.errors import ArgumentError

    if not args.cluster:
        if args.board:
            raise ArgumentError("--board names a kind of board on a cluster: give --cluster URL too")
        return None
    if not args.board:
        raise ArgumentError("--cluster needs --board NAME: the kind of board to measure on (cuvil cluster status "
                            f"{args.cluster} lists them)")
    from cuvil.autotune.cluster import connect_address, security
    from cuvil.autotune.dask_runner import DaskRunner

    sec = security(args, "client")
    address = connect_address(argparse.Namespace(address=args.cluster, insecure=args.insecure), sec)
    return DaskRunner(address, board=args.board, security=sec, timeout_s=args.timeout)


def resolve_model(args: argparse.Namespace, workdir: str) -> tuple[Any, dict[str, tuple[int, ...]]]:
    """The imported graph of ``args.model`` and the input shapes to tune at: ``--shapes``, else a zoo
    model's own inputs, else the declared shapes (a symbolic one is an error that says which --shapes to pass).
    Names resolve as every command resolves them (:func:`cuvil.models.resolve.resolve`: a file, a zoo name,
    written to ``workdir``, ``light_<name>``, or a registry name exported at ``--config`` by ``--exporter``)."""
    from cuvil.frontend.onnx import import_model
    from cuvil.models.resolve import FromRegistry, resolve

    given = parse_shapes(args.shapes, one=True)
    model = resolve(args.model, workdir, FromRegistry(args.config, args.exporter, force=args.registry))
    own: dict[str, tuple[int, ...]] = {}
    if model.zoo is not None and not given:
        own = {k: tuple(v.shape) for k, v in model.zoo.feeds(np.random.default_rng(0)).items()}
    graph = import_model(model.path)
    return graph, fixed_shapes(graph.feeds, given or own)


def fixed_shapes(feeds: Sequence[Any], given: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Every input's shape for tuning: ``given`` (checked against the model, as ``cuvil compile`` checks
    ``--shapes``) or the declared one; a symbolic dimension that neither fixes is an error naming the input
    and the dimension: the tuner measures kernels at fixed sizes, and the sizes it tunes for are the user's."""
    from cuvil.errors import ShapeError
    from cuvil.models.resolve import input_shapes

    shapes, _ = input_shapes(feeds, dict(given), symbolic_default=1)
    named = {w for v in feeds if v.name in given for w in (v.shape or ()) if isinstance(w, str) and w}
    for v in feeds:
        if v.name in given:
            continue
        for k, d in enumerate(v.shape or ()):
            if not isinstance(d, int) and not (d and d in named):
                example = ",".join(str(x) if isinstance(x, int) else "1" for x in v.shape)
                raise ShapeError(f"input {v.name!r} {list(v.shape)}: dimension {k} ({d or 'unnamed'}) is symbolic, "
                                 f"and kernels are tuned at fixed sizes: pass --shapes {v.name}={example} with the "
                                 "sizes the model will run at")
    return shapes


def results_table(results: Sequence[Any]) -> str:
    """One row per kernel (run count, trials, best and untuned time, speed-up, name [key]; why, for a kernel
    that could not be tuned) and the model's estimated time per run (sum of count x time over the kernels),
    tuned against untuned."""
    rows = [f"{'calls':>5} {'trials':>6} {'best ms':>9} {'untuned ms':>10} {'speedup':>7}  kernel"]
    tuned = untuned = 0.0
    for r in results:
        best = f"{r.best_time_s * 1e3:9.3f}" if r.best_time_s else f"{'-':>9}"
        base = f"{r.untuned_time_s * 1e3:10.3f}" if r.untuned_time_s else f"{'-':>10}"
        gain = f"{r.untuned_time_s / r.best_time_s:6.2f}x" if r.best_time_s and r.untuned_time_s else f"{'-':>7}"
        rows.append(f"{r.count:>5} {r.trials:>6} {best} {base} {gain}  {r.title}")
        if r.error:
            rows.append(f"{'':>5} not tuned: {r.error}")
        if r.best_time_s and r.untuned_time_s:
            tuned += r.count * r.best_time_s
            untuned += r.count * r.untuned_time_s
    if tuned:
        rows.append(f"estimated time per run (kernels with both times): {tuned * 1e3:.3f} ms tuned, "
                    f"{untuned * 1e3:.3f} ms untuned ({untuned / tuned:.2f}x)")
    return "\n".join(rows)


def plot_curve(points: Sequence[tuple[int, float]], path: str, title: str = "estimated latency") -> None:
    """Best-so-far seconds against trials, as ``path`` (matplotlib when installed, else SVG only)."""
    from cuvil.errors import ArgumentError

    try:
        import matplotlib  # type: ignore[import-not-found]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found]
    except ImportError:
        if not path.lower().endswith(".svg"):
            raise ArgumentError(f"--plot {path}: without matplotlib cuvil writes SVG only (name it .svg, or "
                                "pip install matplotlib)") from None
        with open(path, "w") as f:
            f.write(svg_curve(points, title))
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.step([p[0] for p in points], [p[1] * 1e3 for p in points], where="post")
    ax.set_xlabel("trials")
    ax.set_ylabel("ms")
    ax.set_title(title)
    fig.savefig(path)
    plt.close(fig)


def svg_curve(points: Sequence[tuple[int, float]], title: str = "") -> str:
    """A small SVG step plot of (trials, seconds)."""
    w, h, m = 480, 300, 48
    pts = [(float(x), float(y) * 1e3) for x, y in points] or [(0.0, 0.0)]
    x0, x1 = 0.0, max(p[0] for p in pts) or 1.0
    y0, y1 = 0.0, max(p[1] for p in pts) or 1.0

    def sx(x: float) -> float:
        return m + (x - x0) / (x1 - x0) * (w - 2 * m)

    def sy(y: float) -> float:
        return h - m - (y - y0) / (y1 - y0) * (h - 2 * m)

    path, prev = [], None
    for x, y in pts:
        if prev is not None:
            path.append(f"L{sx(x):.1f},{sy(prev):.1f}")
        path.append(f"{'M' if prev is None else 'L'}{sx(x):.1f},{sy(y):.1f}")
        prev = y
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
            f'font-size="12">\n<rect width="{w}" height="{h}" fill="white"/>\n'
            f'<line x1="{m}" y1="{h - m}" x2="{w - m}" y2="{h - m}" stroke="black"/>\n'
            f'<line x1="{m}" y1="{m}" x2="{m}" y2="{h - m}" stroke="black"/>\n'
            f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle">trials (0 - {x1:g})</text>\n'
            f'<text x="12" y="{m - 12}">ms (0 - {y1:.3g})</text>\n'
            f'<text x="{w / 2}" y="20" text-anchor="middle">{title}</text>\n'
            f'<path d="{" ".join(path)}" fill="none" stroke="steelblue" stroke-width="2"/>\n</svg>\n')
