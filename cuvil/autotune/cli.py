"""``cuvil tune``: the command line of the autotuner (the subcommand parser and its runner).

    cuvil tune model.onnx --trials 200 --db cuvil-tuning.db [--plot curve.svg]

``cuvil/cli.py`` adds the subcommand with :func:`add_parser` and runs it with :func:`run`.
``--plot`` draws the model's estimated latency (sum over kernels of runs x best time) against
trials spent: with matplotlib when it is installed (any format it writes), else as SVG.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("tune", help="autotune the kernels of an ONNX model; results go to a tuning database")
    p.add_argument("model", help="model.onnx")
    p.add_argument("--trials", type=int, default=64, help="candidates to measure in all (default 64)")
    p.add_argument("--db", default="cuvil-tuning.db", help="the tuning database (SQLite; default cuvil-tuning.db)")
    p.add_argument("--target", default="llvm")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds one candidate may run (default 10)")
    p.add_argument("--threads", type=int, default=None, help="threads the kernels run with (default: all cores)")
    p.add_argument("--plot", default=None, metavar="FILE", help="draw estimated latency against trials (.svg, or "
                   "any format with matplotlib)")


def run(args: argparse.Namespace) -> int:
    """Run ``cuvil tune``; prints each kernel's result, returns the exit status."""
    from cuvil.autotune.models import tune_model
    from cuvil.errors import CuvilError

    try:
        history: list[tuple[int, float]] = []
        results = tune_model(args.model, args.trials, args.db, args.target, args.timeout, args.threads,
                             progress=True, history=history)
    except (CuvilError, OSError) as exc:
        print(f"cuvil tune: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    for r in results:
        best = f"{r.best_time_s * 1e3:.3f} ms" if r.best_time_s else "no correct candidate"
        base = f" (untuned {r.untuned_time_s * 1e3:.3f} ms)" if r.untuned_time_s else ""
        print(f"kernel {r.key} x{r.count}: {r.trials} trials, best {best}{base}")
    if args.plot:
        plot_curve(history, args.plot)
        print(f"wrote {args.plot}")
    return 0


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
