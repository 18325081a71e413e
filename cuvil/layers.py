"""cuvil's layers, lowest first: a module may import from its own layer and the layers below it, never
from a layer above.  This table is the one place the layers are written down: ``tests/unit/test_layering.py``
checks every import under ``cuvil/`` against it (module level and inside functions), and
docs/architecture.md shows it (``python -m cuvil.layers`` prints the rows).

A module belongs to the layer of the longest prefix in the table that names it (``cuvil.te.tensor`` is
listed apart from the rest of ``cuvil.te``); a new module that no prefix names fails the check until it is
placed.

The rules the check applies besides "down only":

- no import of a private name (``_x``) from another package (folder);
- ``import cuvil`` costs only the ground layer (``cuvil/__init__.py`` imports :mod:`cuvil.errors`);
  its ``_LAZY`` table is the package's front door for users, so inside the package each use of
  ``cuvil.X`` counts as an import of the module ``X`` resolves to (``cuvil.build`` in graph/ is an
  import of ``cuvil.pipeline``; ``cuvil.autotune`` there would be a violation).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LAYERS", "Layer", "layer_of", "markdown_table"]


@dataclass(frozen=True)
class Layer:
    name: str
    modules: tuple[str, ...]  # dotted prefixes: "cuvil.graph" is the package and everything under it
    what: str


LAYERS: tuple[Layer, ...] = (
    Layer("ground", ("cuvil", "cuvil.errors", "cuvil.dtype", "cuvil.target", "cuvil.cache", "cuvil.layers",
                     "cuvil.lazy"),
          "errors, dtypes, the target model, bounded caches, the package's front door"),
    Layer("loop IR", ("cuvil.ir",), "expressions and statements, printer, simplifier, passes"),
    Layer("tensor graph", ("cuvil.te.tensor",), "te's Tensor and Operation classes, which the scheduler reads"),
    Layer("schedule", ("cuvil.schedule",),
          "polyhedral model, dependences, primitives, auto-scheduler, isl AST -> loops, tuning-record lookup"),
    Layer("te API", ("cuvil.te",), "placeholder, compute, reduce, the operator library; create_schedule"),
    Layer("codegen", ("cuvil.codegen",), "LLVM IR and CUDA C from the loop IR; NVRTC"),
    Layer("runtime", ("cuvil.runtime",), "callable modules, threads, .so loading, CUDA launch"),
    Layer("one kernel", ("cuvil.pipeline", "cuvil.options"), "lower and build one kernel; CompileOptions"),
    Layer("whole models", ("cuvil.graph",), "graph IR, passes, fusion, op builders, memory plan, link, export"),
    Layer("importers", ("cuvil.frontend",), "ONNX and PyTorch models -> graph IR"),
    Layer("tuner", ("cuvil.autotune",), "search, cost model, measurement, boards (writes the tuning records)"),
    Layer("sessions", ("cuvil.onnx", "cuvil.torch", "cuvil.decorator", "cuvil.llm"),
          "InferenceSession, cuvil.torch, @cuvil.compile, LLM loaders and generation (cuvil.llm)"),
    Layer("models", ("cuvil.models",),
          "models to compile, outside the compiler: the zoo, the torch.nn registry, a model name -> an ONNX file"),
    Layer("tools", ("cuvil.cli", "cuvil.bench"), "the command line (one parser) and the benchmarks"),
)


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of dotted ``module`` (the longest prefix that names it), or None."""
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for k, layer in enumerate(LAYERS):
        for prefix in layer.modules:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), k)
    return None if best is None else best[1]


def markdown_table() -> str:
    """The table as docs/architecture.md shows it (highest layer first, as in a diagram)."""
    rows = ["| layer | modules | what |", "| --- | --- | --- |"]
    for layer in reversed(LAYERS):
        mods = ", ".join(f"`{m}`" for m in layer.modules)
        rows.append(f"| {layer.name} | {mods} | {layer.what} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
