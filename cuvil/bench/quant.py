"""``cuvil bench --registry --quant``: registry models quantized by onnxruntime's tool
(:mod:`cuvil.models.registry.quantize`), cuvil beside onnxruntime on the same int8 file and beside cuvil's own fp32.

    cuvil bench --registry resnet18 --quant qdq-u8s8 --threads 1,2
    cuvil bench --registry resnet18,resnet50,bert-base --quant qdq-u8s8,qdq-s8s8,dynamic --threads 1 --no-cold

Per model and scheme, three engines: ``cuvil`` and ``ort`` (onnxruntime) on the quantized file, and
``cuvil fp32`` on the fp32 export the file was quantized from (``registry.export(model, config)``).  The
protocol is :mod:`cuvil.bench.registry`'s: at 1 thread the three in this process, called in turn call by
call on fresh inputs (floats redrawn; ids and masks kept), after warm-up calls, median **process CPU time**
per call and beside it the median wall; at 2 threads and more each engine in a process of its own, blocks
after a pause, alternated ``--rounds`` times (at least 5), median wall and CPU time.  Columns:

- ``int8``, ``ort``: cuvil's and onnxruntime's ms per call on the int8 file (CPU time at 1 thread with
  the wall beside it, wall above); ``/ort``: their ratio (> 1: cuvil slower);
- ``fp32``: cuvil on the fp32 file; ``x fp32``: cuvil fp32 / cuvil int8, the speedup quantizing buys;
- ``cold``: the int8 file's compile in a fresh process with an empty kernel cache (``--no-cold``: skipped);
- ``fp``: quantized contractions cuvil still runs as float contractions (:func:`float_contractions`; 0 is
  the aim);
- ``sem``, ``ort-sem``: the largest distance of cuvil's and of onnxruntime's (fused kernels) outputs from the
  file's semantics (:mod:`cuvil.models.registry.semantics`: the QDQ form run with graph optimisations off), in steps
  of the last quantization's scale;
- ``check``: cuvil against the semantics, within 2 steps and the same argmax where the top-2 margin exceeds 2
  steps (:func:`cuvil.models.registry.quantize.compare_quantized`; at full size two exact engines can differ by
  more: the float reference rounds its sums differently, and a flipped rounding grows through the layers).

An engine that fails prints ``failed: <its error>``; the others still run.  The last lines give, per
thread count, the geometric means of /ort and x fp32, and the load average.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cuvil.bench import registry as br

ENGINES = ("cuvil", "ort", "cuvil fp32")
FLOAT_CONTRACTIONS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


@dataclass
class QuantRow:
    """What the benchmark measured for one (model, scheme): per thread count and engine (cpu, wall) seconds."""

    model: str
    scheme: str
    compile_s: float | None = None
    fp32_left: int | None = None  # quantized contractions cuvil runs in float
    latency: dict[int, dict[str, tuple[float, float]]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    checked: bool = False
    worst_steps: float = 0.0  # the largest |cuvil - semantics| over the outputs, in steps of their scales
    ort_steps: float | None = None  # the same for onnxruntime's fused kernels (its default session)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems and not self.errors

    def seconds(self, t: int, engine: str) -> float | None:
        """``engine``'s median at ``t`` threads: CPU time at 1 thread, wall above; None if it did not run."""
        got = self.latency.get(t, {}).get(engine)
        return None if got is None else got[0] if t == 1 else got[1]

    def ratio(self, t: int) -> float | None:
        """cuvil int8 / onnxruntime int8."""
        a, b = self.seconds(t, "cuvil"), self.seconds(t, "ort")
        return None if a is None or b is None else a / b

    def speedup(self, t: int) -> float | None:
        """cuvil fp32 / cuvil int8."""
        a, b = self.seconds(t, "cuvil fp32"), self.seconds(t, "cuvil")
        return None if a is None or b is None else a / b


# -- which contractions run in float ---------------------------------------------------------------------------


def float_left_by_quantizer(path: str) -> list[str]:
    """The contractions of the quantized file that the quantizer left in float: Conv / Gemm / MatMul nodes
    whose data inputs are not all DequantizeLinear outputs (integer ops such as QLinearConv or
    MatMulInteger, and contractions of two dequantized tensors, are the quantized ones)."""
    import onnx

    graph = onnx.load(path, load_external_data=False).graph
    producer = {o: n.op_type for n in graph.node for o in n.output}
    return [n.name for n in graph.node if n.op_type in FLOAT_CONTRACTIONS
            and not all(producer.get(i) == "DequantizeLinear" for i in n.input[:2])]


def float_contractions(sess: Any) -> list[str]:
    """The float contractions cuvil's compiled programs of session ``sess`` run: the Conv / ConvTranspose /
    Gemm / MatMul graph nodes among the nodes of each kernel call (ONNX defines these on float tensors;
    integer contractions are other ops).  Reads the session's compiled programs."""
    return [f"{op} {name!r}" for prog in sess.programs()
            for nodes in prog.call_nodes for op, name, *_ in nodes if op in FLOAT_CONTRACTIONS]


def quantized_in_float(sess: Any, path: str) -> list[str]:
    """The float contractions of ``sess`` beyond those the quantizer left in float in ``path`` (the
    quantized contractions cuvil has not turned into integer ones), or [] when there are none."""
    ours, left = float_contractions(sess), float_left_by_quantizer(path)
    return ours if len(ours) > len(left) else []


# -- measuring ----------------------------------------------------------------------------------------------------


@dataclass
class SessionRunner(br.Runner):
    """A cuvil engine that keeps its session (whose compiled programs :func:`float_contractions` reads)."""

    session: Any = None


def cuvil_engine(path: str, threads: int) -> Callable[[], br.Runner]:
    """:class:`cuvil.onnx.InferenceSession` on ``path`` at ``threads`` (process-wide), as
    :func:`cuvil.bench.registry.onnx_engine` builds it, keeping the session."""

    def build() -> br.Runner:
        import cuvil
        from cuvil.onnx import InferenceSession

        sess = InferenceSession(path)
        cuvil.set_num_threads(threads)
        return SessionRunner(lambda feeds: sess.run(None, feeds), session=sess)

    return build


def _specs(qpath: str, fpath: str) -> dict[str, br.Spec]:
    return {"cuvil": ("cuvil.bench.quant:cuvil_engine", {"path": qpath}),
            "ort": ("cuvil.bench.registry:onnx_engine", {"engine": "ort", "path": qpath}),
            "cuvil fp32": ("cuvil.bench.registry:onnx_engine", {"engine": "cuvil", "path": fpath})}


def _together(specs: dict[str, br.Spec], example: dict[str, np.ndarray], rounds: int, budget_s: float
              ) -> tuple[dict[str, br.Measured], Any]:
    """Every engine of ``specs`` in this process at 1 thread, called in turn call by call
    (:func:`cuvil.bench.registry.time_together`); also the cuvil int8 session (for its kernel list)."""
    import cuvil

    try:
        res, runners = br.engines_together(specs, example, rounds, budget_s)
        sess = getattr(runners.get("cuvil"), "session", None)
        runners.clear()
    finally:
        cuvil.set_num_threads(None)
    return res, sess


def bench_one(model: str, scheme: str, config: str, threads: list[int], rounds: int, budget_s: float,
              cold: bool = True) -> QuantRow:
    """Measure registry ``model`` quantized as ``scheme`` at ``config`` (see the module docstring)."""
    from cuvil.models import registry
    from cuvil.models.registry import quantize, semantics

    r = QuantRow(model, scheme)
    qpath = quantize.quantize(model, config, scheme)
    fpath = registry.export(model, config=config)
    example = registry.example_inputs(model, config=config)
    specs = _specs(qpath, fpath)
    if cold:
        try:
            r.compile_s, _ = br.cold_compile(qpath, example)
        except Exception as exc:  # noqa: BLE001
            r.errors["cuvil"] = br.failed_line(exc)
    steps = quantize.output_steps(qpath, example)
    ref = None  # the file's semantics on the example (cuvil.models.registry.semantics), computed once
    for t in threads:
        live = {e: s for e, s in specs.items() if e not in r.errors}
        if t == 1:
            got, sess = _together(live, example, rounds, budget_s * len(live))
            if sess is not None:
                r.fp32_left = len(quantized_in_float(sess, qpath))
        else:
            got = dict(zip(live, br.engines_apart(list(live.values()), example, t, rounds, budget_s * len(live),
                                                  keep_going=True)))
        for e, m in got.items():
            if m.error:
                r.errors[e] = m.error
            else:
                r.latency.setdefault(t, {})[e] = (m.cpu, m.wall)
        if "cuvil" in got and not got["cuvil"].error:
            names = _output_names(qpath)
            if ref is None:
                ref = semantics.run_semantics(semantics.registry_semantics(model, config, scheme), example)
            r.problems += [f"{t}T: {p}" for p in
                           quantize.compare_quantized(got["cuvil"].outputs, ref, names, steps)]
            r.worst_steps = max(r.worst_steps, steps_apart(got["cuvil"].outputs, ref, names, steps))
            if "ort" in got and not got["ort"].error:
                r.ort_steps = max(r.ort_steps or 0.0, steps_apart(got["ort"].outputs, ref, names, steps))
            r.checked = True
    return r


def steps_apart(got: list[np.ndarray], ref: list[np.ndarray], names: list[str], steps: dict[str, float]) -> float:
    """The largest ``|got - ref|`` over the outputs that have a step, in steps (0.0 when none has one)."""
    worst = 0.0
    for name, y, r in zip(names, got, ref):
        if name in steps and y.shape == r.shape and r.size and r.dtype.kind == "f":
            worst = max(worst, float(np.max(np.abs(y.astype(np.float64) - r))) / steps[name])
    return worst


def _output_names(path: str) -> list[str]:
    import onnx

    return [o.name for o in onnx.load(path, load_external_data=False).graph.output]


# -- the table ----------------------------------------------------------------------------------------------------


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def header(threads: list[int]) -> str:
    cols = "".join(f"{f'{t}T int8':>10}{'wall' if t == 1 else '':>8}{'ort':>8}{'/ort':>6}{'fp32':>9}{'x fp32':>7}"
                   for t in threads)
    return f"{'model':<14}{'scheme':<13}{'cold':>7}{'fp':>4}{cols}{'sem':>6}{'ort-sem':>8}  check"


def row(r: QuantRow, threads: list[int]) -> str:
    if r.error:
        return f"{r.model:<14}{r.scheme:<13}  failed: {r.error}"
    cols = ""
    for t in threads:
        wall = r.latency.get(t, {}).get("cuvil")
        cols += (f"{_ms(r.seconds(t, 'cuvil')):>10}{(_ms(wall[1]) if wall else '-') if t == 1 else '':>8}"
                 f"{_ms(r.seconds(t, 'ort')):>8}{_x(r.ratio(t)):>6}{_ms(r.seconds(t, 'cuvil fp32')):>9}"
                 f"{_x(r.speedup(t)):>7}")
    cold = "-" if r.compile_s is None else f"{r.compile_s:.1f}s"
    fp = "-" if r.fp32_left is None else str(r.fp32_left)
    check = "-" if not r.checked else "ok" if not r.problems else "MISMATCH: " + "; ".join(r.problems)[:200]
    fails = "".join(f"; {e} failed: {msg}" for e, msg in r.errors.items())
    sem = _x(r.worst_steps if r.checked else None)
    return f"{r.model:<14}{r.scheme:<13}{cold:>7}{fp:>4}{cols}{sem:>6}{_x(r.ort_steps):>8}  {check}{fails}"


def _geo(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def summary(rows: list[QuantRow], threads: list[int]) -> list[str]:
    """Per thread count: geometric means of cuvil int8 / onnxruntime int8 and of cuvil fp32 / cuvil int8."""
    lines = []
    for t in threads:
        q = [x for r in rows if (x := r.ratio(t)) is not None]
        s = [x for r in rows if (x := r.speedup(t)) is not None]
        if q or s:
            lines.append(f"{t} thread(s): geometric mean cuvil int8 / ort int8 {_x(_geo(q) if q else None)} over "
                         f"{len(q)}; cuvil fp32 / cuvil int8 {_x(_geo(s) if s else None)} over {len(s)}")
    return lines


def run(models: list[str], schemes: list[str], config: str, threads: list[int], rounds: int = 5,
        budget_s: float = 1.0, cold: bool = True, json_path: str | None = None) -> int:
    """Benchmark ``models`` (default: ResNet-18, ResNet-50, MobileNetV2, BERT-base) quantized as each of
    ``schemes`` and print the table; 1 if an engine failed or cuvil's outputs mismatched onnxruntime's."""
    from cuvil.models.registry import quantize

    for s in schemes:
        quantize.get_scheme(s)  # an unknown scheme stops the run before it starts
    models = models or ["resnet18", "resnet50", "mobilenetv2", "bert-base"]
    br.banner(config, "int8 / ort: cuvil / onnxruntime on the quantized file; fp32: cuvil on the fp32 export; "
              "1T: median process CPU time (wall beside cuvil's), engines in turn call by call in one process; 2T+: "
              "median wall, each engine in its own process, blocks after a pause; /ort > 1: cuvil slower; x fp32 = "
              "cuvil fp32 / cuvil int8; fp = quantized contractions still in float; cold = int8 compile in a fresh "
              "process, empty kernel cache; sem / ort-sem: steps from the file's QDQ semantics")
    print(header(threads), flush=True)
    rows = []
    for model in models:
        for scheme in schemes:
            try:
                r = bench_one(model, scheme, config, threads, rounds, budget_s, cold)
            except Exception as exc:  # noqa: BLE001 -- a model that cannot be quantized or timed is its row
                r = QuantRow(model, scheme, error=br.failed_line(exc))
            rows.append(r)
            print(row(r, threads), flush=True)
    return br.finish(rows, summary(rows, threads), json_path)
