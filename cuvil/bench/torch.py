"""``cuvil bench --registry --torch``: the registry's models (:mod:`cuvil.models.registry`) through PyTorch's engines,
cuvil's PyTorch front end and cuvil's ONNX path, beside onnxruntime.

    cuvil bench --registry --torch                          # every model, full size, 1 and 2 threads
    cuvil bench --registry --torch resnet18,bert-base --config ci --threads 1 --no-cold

The engines, one row each per model (:data:`ENGINES`):

- ``eager``: the ``torch.nn.Module`` itself, called under ``torch.inference_mode()``;
- ``inductor-freezing``: ``torch.compile(model, options={"freezing": True})`` (Inductor with
  ``torch._inductor.config.freezing = True``, its recommended setting for CPU inference), compiled and
  called under ``torch.inference_mode()``; ``inductor``: Inductor's default (no freezing), the same way;
- ``cuvil.torch``: ``cuvil.torch.compile(model, example_args)`` called as ``cm(*args)``;
- ``compile(cuvil)``: ``torch.compile(model, backend="cuvil")`` called under ``torch.no_grad()``;
  (both torch.compile engines with ``torch._dynamo.config.allow_rnn = True``, so that dynamo captures
  the RNN models' ``nn.LSTM`` / ``nn.GRU`` instead of leaving them to eager torch);
- ``cuvil-onnx``: :class:`cuvil.onnx.InferenceSession` on ``registry.export(name, config, exporter="dynamo")``;
- ``onnxruntime``: onnxruntime on the same file (default SessionOptions but the thread counts).

The protocol is :mod:`cuvil.bench.registry`'s: at 1 thread every engine in this process, called in turn
call by call (a rotating order), each call on fresh random inputs (floats redrawn; ids and masks kept),
after warm-up calls, the median **process CPU time** per call and beside it the median wall time; at 2
threads and more each engine in a process of its own (only that engine imported), timed in blocks after a
pause, the processes taken in turn ``--rounds`` times (at least 5), median wall and CPU time.  The ratio
is engine / onnxruntime of the medians (CPU time at 1 thread, wall time above; > 1: slower than
onnxruntime).  **compile** is the wall time of building the engine and its first call (the model built
and torch imported before): with cold compiles (the default) in a fresh process with empty caches (cuvil's
kernel cache and Inductor's, ``TORCHINDUCTOR_CACHE_DIR``), at the first thread count; with ``--no-cold``
as measured in the timing run, the caches as they are.  **check**: every output of every engine against
eager torch's on the example inputs, ``numpy.allclose(rtol=1e-3, atol=1e-4)``, at every thread count.

An engine that fails (``cuvil.torch`` missing, a compile error, a child that does not start) prints
``failed: <the first line of the error>`` in its row; the other engines still run.  The last lines give,
per thread count and engine, the geometric mean of the ratios over the models, and the load average.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cuvil.bench import registry as br

ENGINES: dict[str, str] = {
    "eager": "torch eager under torch.inference_mode()",
    "inductor-freezing": "torch.compile, Inductor with freezing, under torch.inference_mode()",
    "inductor": "torch.compile, Inductor's default (no freezing), under torch.inference_mode()",
    "cuvil.torch": "cuvil.torch.compile(model, example args), cm(*args)",
    "compile(cuvil)": 'torch.compile(model, backend="cuvil") under torch.no_grad()',
    "cuvil-onnx": "cuvil.onnx.InferenceSession on the dynamo export",
    "onnxruntime": "onnxruntime on the same file",
}
REFERENCE, BASELINE = "eager", "onnxruntime"  # what the outputs are checked against; what the ratios divide by
_ONNX = {"cuvil-onnx": "cuvil", "onnxruntime": "ort"}


@dataclass
class Row:
    """What the benchmark measured of one engine on one model."""

    model: str
    engine: str
    compile_s: float | None = None
    latency: dict[int, tuple[float, float]] = field(default_factory=dict)  # threads -> (cpu, wall) medians
    ok: bool = True
    max_err: float = 0.0
    checked: bool = False
    error: str = ""


# -- the torch engines ------------------------------------------------------------------------


def _tensors(feeds: dict[str, np.ndarray]) -> tuple[Any, ...]:
    import torch

    return tuple(torch.from_numpy(a) for a in feeds.values())


def _leaves(out: Any) -> list[np.ndarray]:
    import torch
    from torch.utils import _pytree

    return [t.detach().numpy() for t in _pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _own_code(module: Any, engine: str) -> Any:
    """``module`` behind a ``forward`` whose code object is the engine's own.  Dynamo keeps its compiled
    graphs per code object, with at most ``cache_size_limit`` (8) of them: the torch.compile engines of
    one process would otherwise share (and check the guards of) each other's entries, and every
    model's (the registry's models share their wrapper's ``forward``) until dynamo gives up and runs
    eagerly."""
    import re
    import types

    import torch

    def forward(self: Any, *args: Any) -> Any:
        return self.inner(*args)

    tag = re.sub(r"\W", "_", engine)
    code = forward.__code__.replace(co_name=f"forward_{tag}")
    cls = type(f"Timed_{tag}", (torch.nn.Module,), {"forward": types.FunctionType(code, forward.__globals__)})
    wrapper = cls()
    wrapper.inner = module
    return wrapper.eval()


def torch_engine(engine: str, model: str, config: str, threads: int) -> Callable[[], br.Runner]:
    """Load registry ``model`` at ``config`` for ``engine`` (a torch engine of :data:`ENGINES`) at ``threads``
    (``torch.set_num_threads``; cuvil's too for the cuvil engines); the step that compiles it."""
    import torch

    from cuvil.models import registry
    from cuvil.models.registry.export import quiet

    torch.set_num_threads(threads)  # before Inductor compiles: its kernels are specialised on the count
    torch._dynamo.config.allow_rnn = True  # dynamo captures nn.LSTM / nn.GRU (for Inductor and cuvil alike)
    with quiet():
        module, inputs, _ = registry.MODELS[model].build(config)
    example = tuple(inputs.values())

    def build() -> br.Runner:
        ctx: Callable[[], Any] = torch.inference_mode
        if engine == "eager":
            fn = module
        elif engine in ("inductor-freezing", "inductor"):
            fn = torch.compile(_own_code(module, engine), options={"freezing": engine == "inductor-freezing"})
        elif engine in ("cuvil.torch", "compile(cuvil)"):
            import cuvil
            import cuvil.torch  # type: ignore[import-not-found]  # also registers the "cuvil" backend

            cuvil.set_num_threads(threads)
            if engine == "cuvil.torch":
                fn, ctx = cuvil.torch.compile(module, example), contextlib.nullcontext
            else:
                fn, ctx = torch.compile(_own_code(module, engine), backend="cuvil"), torch.no_grad
        else:
            raise ValueError(f"no torch engine {engine!r}; engines: {', '.join(ENGINES)}")

        def call(args: tuple[Any, ...]) -> Any:
            with ctx():
                return fn(*args)

        return br.Runner(call, _tensors, _leaves)

    return build


def specs(model: str, config: str, path: str) -> dict[str, br.Spec]:
    """Every engine of :data:`ENGINES` as a child process builds it; ``path``: the model's ONNX file."""
    return {e: ("cuvil.bench.registry:onnx_engine", {"engine": _ONNX[e], "path": path}) if e in _ONNX
            else ("cuvil.bench.torch:torch_engine", {"engine": e, "model": model, "config": config}) for e in ENGINES}


# -- measuring --------------------------------------------------------------------------------


def _cold(spec: br.Spec, example: dict[str, np.ndarray], threads: int) -> float:
    """The compile time of ``spec`` in a fresh process with empty kernel caches (cuvil's and Inductor's)."""
    with tempfile.TemporaryDirectory(prefix="cuvil-bench-cold-") as work:
        env = dict(os.environ, CUVIL_CACHE_DIR=os.path.join(work, "kernels"),
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(work, "inductor"))
        return br.compile_apart(spec, example, threads, env)


def _together(engines: dict[str, br.Spec], example: dict[str, np.ndarray], rounds: int, budget_s: float
              ) -> dict[str, br.Measured]:
    """Every engine in this process at 1 thread, called in turn call by call
    (:func:`cuvil.bench.registry.time_together`)."""
    import torch

    import cuvil

    saved = torch.get_num_threads()
    try:
        res, runners = br.engines_together(engines, example, rounds, budget_s)
        runners.clear()
    finally:
        torch.set_num_threads(saved)
        cuvil.set_num_threads(None)
    return res


def bench_one(model: str, config: str, threads: list[int], rounds: int, budget_s: float, cold: bool = True,
              engines: list[str] | None = None) -> list[Row]:
    """Measure registry ``model`` at ``config`` with ``engines`` (all of :data:`ENGINES` when None; eager
    torch and onnxruntime always) at each thread count (see the module docstring), ``budget_s`` seconds of
    timing per engine: one row per engine."""
    import sys

    from cuvil.models import registry

    if "torch" in sys.modules:  # the models before this one: their compiled graphs are not needed again
        sys.modules["torch"]._dynamo.reset()
    names = [e for e in ENGINES if e in (engines or ENGINES) or e in (REFERENCE, BASELINE)]
    rows = {e: Row(model, e) for e in names}
    try:
        path = registry.export(model, config=config, exporter="dynamo")
    except Exception as exc:  # noqa: BLE001 -- the torch engines run without the ONNX file
        path = ""
        for e in _ONNX:
            if e in rows:
                rows[e].error = br.failed_line(exc)
    example = registry.example_inputs(model, config=config)
    all_specs = specs(model, config, path)
    if cold:
        for e in names:
            if not rows[e].error:
                try:
                    rows[e].compile_s = _cold(all_specs[e], example, threads[0])
                except Exception as exc:  # noqa: BLE001
                    rows[e].error = br.failed_line(exc)
    for t in threads:
        live = {e: all_specs[e] for e in names if not rows[e].error}
        budget = budget_s * len(live)
        if t == 1:
            got = _together(live, example, rounds, budget)
        else:
            got = dict(zip(live, br.engines_apart(list(live.values()), example, t, rounds, budget, keep_going=True)))
        for e, m in got.items():
            if m.error:
                rows[e].error = m.error
                continue
            rows[e].latency[t] = (m.cpu, m.wall)
            if rows[e].compile_s is None:
                rows[e].compile_s = m.compile_s
        ref = got.get(REFERENCE)
        for e, m in got.items():
            if not m.error and ref is not None and not ref.error:
                ok, err = br._check(m.outputs, ref.outputs)
                r = rows[e]
                r.ok, r.max_err, r.checked = r.ok and ok, max(r.max_err, err), True
    return list(rows.values())


# -- the table --------------------------------------------------------------------------------


def ratio(rows: list[Row], r: Row, t: int) -> float | None:
    """``r``'s median / onnxruntime's on the same model at ``t`` threads: CPU time at 1 thread, wall time
    above; None when either is missing."""
    base = next((b for b in rows if b.model == r.model and b.engine == BASELINE), None)
    if base is None or t not in base.latency or t not in r.latency or r.error or base.error:
        return None
    k = 0 if t == 1 else 1
    return r.latency[t][k] / base.latency[t][k]


def header(threads: list[int]) -> str:
    cols = "".join(f"{f'{t}T cpu ms':>11}{'wall':>8}{'/ort':>6}" for t in threads)
    return f"{'model':<22}{'engine':<19}{'compile':>8}{cols}  check"


def row(rows: list[Row], r: Row, threads: list[int]) -> str:
    if r.error:
        return f"{r.model:<22}{r.engine:<19}  failed: {r.error}"
    cols = ""
    for t in threads:
        cpu, wall = r.latency[t]
        q = ratio(rows, r, t)
        cols += f"{cpu * 1e3:>11.2f}{wall * 1e3:>8.2f}{'-' if q is None else f'{q:.2f}':>6}"
    comp = "-" if r.compile_s is None else f"{r.compile_s:.1f}s"
    check = "-" if not r.checked else f"ok ({r.max_err:.1e})" if r.ok else f"MISMATCH ({r.max_err:.1e})"
    return f"{r.model:<22}{r.engine:<19}{comp:>8}{cols}  {check}"


def summary(rows: list[Row], threads: list[int]) -> list[str]:
    """Per thread count: each engine's geometric mean of engine / onnxruntime over the models."""
    lines = []
    for t in threads:
        parts = []
        for e in ENGINES:
            qs = [q for r in rows if r.engine == e and (q := ratio(rows, r, t)) is not None]
            if qs:
                parts.append(f"{e} {math.exp(sum(math.log(q) for q in qs) / len(qs)):.3f}")
        if parts:
            lines.append(f"{t} thread(s), geometric mean / onnxruntime: " + ", ".join(parts))
    return lines


def run(models: list[str], config: str, threads: list[int], rounds: int = 5, budget_s: float = 1.0,
        cold: bool = True, json_path: str | None = None, engines: list[str] | None = None) -> int:
    """Benchmark the registry's ``models`` (all when empty) and print the table; ``budget_s``: the timing
    budget per engine and thread count.  1 if an engine failed or an output mismatched."""
    from cuvil.models import registry

    models = models or [n for n in registry.names() if n != "gpt2-decode"]
    br.banner(config, f"compile = building the engine and its first call (wall), "
              f"{'in a fresh process, empty caches' if cold else 'caches as they are'}; 1T: median process CPU time "
              "and wall per call, engines in turn call by call in one process; 2T+: each engine in its own process, "
              "blocks after a pause; /ort = engine / onnxruntime (CPU time at 1T, wall above; > 1: slower); "
              "check: against eager torch")
    print(header(threads), flush=True)
    rows: list[Row] = []
    for model in models:
        try:
            got = bench_one(model, config, threads, rounds, budget_s, cold, engines)
        except Exception as exc:  # noqa: BLE001 -- a model that cannot be built or timed is its row
            got = [Row(model, "-", error=br.failed_line(exc))]
        rows += got
        for r in got:
            print(row(got, r, threads), flush=True)
    return br.finish(rows, summary(rows, threads), json_path)
