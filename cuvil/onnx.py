"""An onnxruntime-compatible ``InferenceSession`` that runs ONNX models as cuvil-compiled native code.

    import cuvil.onnx
    sess = cuvil.onnx.InferenceSession("model.onnx")            # providers= accepted and ignored
    [y] = sess.run(None, {"x": x})                              # onnxruntime's calling convention
    sess.get_inputs()[0].name, .shape, .type                    # "x", [1, 3, 224, 224], "tensor(float)"
    sess.run(None, {"x": x}, outputs=[y])                       # into the caller's buffers
    opts = cuvil.onnx.SessionOptions(); opts.intra_op_num_threads = 2; opts.enable_profiling = True
    sess = cuvil.onnx.InferenceSession("model.onnx", opts)     # ... sess.end_profiling() -> "x.json"
    sess.get_modelmeta().producer_name, sess.get_providers()    # "pytorch", ["CPUExecutionProvider"]

The model is compiled for the input shapes it declares when they are all known; otherwise (a
symbolic batch, an input whose value decides a shape) on the first ``run`` with each new
signature (the fed shapes, and the values of inputs that decide shapes), then cached.  A run is one
native call.  ``onnx`` is imported here, never by ``import cuvil``.
"""

from __future__ import annotations

import enum
import json
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from cuvil.errors import (
    ArgumentError,
    CuvilError,
    DTypeError,
    IslBudgetError,
    ModelError,
    ScheduleError,
    ShapeError,
    TargetError,
    UnsupportedOpError,
)
from cuvil.options import CompileOptions
from cuvil.runtime.call import check_feed_names

if TYPE_CHECKING:
    from cuvil.graph.driver import ModelCompiler

__all__ = ["ArgumentError", "CompileOptions", "CuvilError", "DTypeError", "GraphOptimizationLevel", "InferenceSession",
           "IslBudgetError", "ModelError", "ModelMetadata", "NodeArg", "ScheduleError", "SessionOptions", "ShapeError",
           "TargetError", "UnsupportedOpError"]


@dataclass(frozen=True)
class NodeArg:
    """A model input or output as onnxruntime describes it."""

    name: str
    shape: list[int | str | None]
    type: str


@dataclass(frozen=True)
class ModelMetadata:
    """A model's metadata as onnxruntime's ``ModelMetadata`` gives it (``sess.get_modelmeta()``)."""

    producer_name: str = ""
    graph_name: str = ""
    domain: str = ""
    description: str = ""  # the model's doc_string
    graph_description: str = ""  # the graph's doc_string
    version: int = 0  # model_version
    custom_metadata_map: dict[str, str] = field(default_factory=dict)  # metadata_props


class GraphOptimizationLevel(enum.IntEnum):
    """onnxruntime's levels (its own enum values are accepted too), as cuvil reads them:
    ``ORT_DISABLE_ALL``: only the passes that lower the graph (Constant nodes as initializers,
    recurrent nodes unrolled, identities renamed), one kernel per node; ``ORT_ENABLE_BASIC``: and
    BatchNorm folding, common subexpressions, dead nodes, element-wise nodes moved before reshapes,
    one kernel per node; ``ORT_ENABLE_EXTENDED`` and above (the default): every graph pass,
    channels-last layouts, and fusion (a kernel per group of nodes).  Each kernel is auto-scheduled
    at every level."""

    ORT_DISABLE_ALL = 0
    ORT_ENABLE_BASIC = 1
    ORT_ENABLE_EXTENDED = 2
    ORT_ENABLE_LAYOUT = 3
    ORT_ENABLE_ALL = 99


# the graph passes (cuvil.graph.passes.PASSES, by name) each level runs; the default runs them all
_LEVEL_PASSES = {
    GraphOptimizationLevel.ORT_DISABLE_ALL: ("constants as initializers", "expand recurrent nodes",
                                             "remove identities"),
    GraphOptimizationLevel.ORT_ENABLE_BASIC: ("constants as initializers", "expand recurrent nodes",
                                              "remove identities", "element-wise before reshapes",
                                              "fold batch normalization", "common subexpressions", "dead nodes"),
}


class SessionOptions:
    """onnxruntime's ``SessionOptions``, the fields cuvil reads (an ``onnxruntime.SessionOptions``
    passed to ``InferenceSession`` is read the same way):

    - ``intra_op_num_threads``: the session's thread count (0: the default, ``num_threads=None``);
      ``InferenceSession(num_threads=)`` is the same setting;
    - ``graph_optimization_level``: a :class:`GraphOptimizationLevel` (what each level runs is
      there); default ``ORT_ENABLE_ALL``;
    - ``enable_profiling``: each ``run`` calls the kernels one by one and records each call's time;
      ``sess.end_profiling()`` writes them as a JSON trace (onnxruntime's format: events with
      ``cat`` "Session" / "Node", ``name``, ``ts`` and ``dur`` in microseconds) to
      ``<profile_file_prefix>_<date>_<time>.json`` and returns its path;
    - ``profile_file_prefix``: default ``"cuvil_profile"``;
    - ``inter_op_num_threads``, ``log_severity_level``, ``log_verbosity_level``, ``execution_mode``:
      accepted and ignored (a run is one native call, its kernels in order).

    Misspelt fields raise AttributeError instead of being ignored.
    """

    __slots__ = ("intra_op_num_threads", "inter_op_num_threads", "graph_optimization_level", "enable_profiling",
                 "profile_file_prefix", "log_severity_level", "log_verbosity_level", "execution_mode")

    def __init__(self) -> None:
        self.intra_op_num_threads = 0
        self.inter_op_num_threads = 0
        self.graph_optimization_level: Any = GraphOptimizationLevel.ORT_ENABLE_ALL
        self.enable_profiling = False
        self.profile_file_prefix = "cuvil_profile"
        self.log_severity_level = 2
        self.log_verbosity_level = 0
        self.execution_mode: Any = None

    def __repr__(self) -> str:
        return "SessionOptions(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"


def _read_options(opts: Any) -> tuple[int | None, GraphOptimizationLevel, bool, str]:
    """(threads or None, optimisation level, profiling, profile file prefix) of a SessionOptions
    (cuvil's or onnxruntime's) or None."""
    if opts is None:
        return None, GraphOptimizationLevel.ORT_ENABLE_ALL, False, "cuvil_profile"
    threads = getattr(opts, "intra_op_num_threads", 0)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ArgumentError(f"sess_options.intra_op_num_threads must be an int >= 0 (0: the default), got "
                            f"{threads!r}")
    level = getattr(opts, "graph_optimization_level", GraphOptimizationLevel.ORT_ENABLE_ALL)
    try:
        value = int(level)
    except (TypeError, ValueError):
        value = -1
    if value not in GraphOptimizationLevel._value2member_map_:
        raise ArgumentError(f"sess_options.graph_optimization_level {level!r} is not one of "
                            + ", ".join(f"{m.name} ({m.value})" for m in GraphOptimizationLevel))
    prefix = getattr(opts, "profile_file_prefix", None) or "cuvil_profile"
    if not isinstance(prefix, str):
        raise ArgumentError(f"sess_options.profile_file_prefix must be a str, got {prefix!r}")
    if prefix == "onnxruntime_profile_":  # onnxruntime's default
        prefix = "cuvil_profile"
    return threads or None, GraphOptimizationLevel(value), bool(getattr(opts, "enable_profiling", False)), prefix


class InferenceSession:
    """Compile an ONNX model (path, bytes or ModelProto) for ``target`` and run it like onnxruntime."""

    def __init__(self, path_or_bytes: Any, sess_options: Any = None, providers: Any = None, target: str | None = None,
                 num_threads: int | None = None, tuning_db: Any = None, bounds_checks: bool | None = None,
                 precision: str | None = None, options: CompileOptions | None = None, **kwargs: Any):
        from cuvil.frontend.onnx import import_model, load_model
        from cuvil.graph import images
        from cuvil.graph.driver import ModelCompiler

        num_threads, opts = self._options(num_threads, sess_options, options, target=target, tuning_db=tuning_db,
                                          bounds_checks=bounds_checks, precision=precision)
        # the image of a session of this file compiled before (cuvil/graph/images.py): no import, no compile
        from cuvil.graph.passes import PASSES

        # (the passes that run: those named, else every pass of the table as it is now)
        passes = opts.passes if opts.passes is not None else tuple(name for name, _ in PASSES)
        key = images.image_key(path_or_bytes, (opts.key(), passes, opts.fuse)) if opts.tuning_db is None else None
        state = images.load(key)
        if state is not None:
            self._meta = state["meta"]
            self._start(ModelCompiler.restore(state["compiler"], opts), num_threads, sess_options)
            return
        model = load_model(path_or_bytes)
        graph = import_model(model)
        self._meta = ModelMetadata(model.producer_name, model.graph.name, model.domain, model.doc_string,
                                   model.graph.doc_string, model.model_version,
                                   {p.key: p.value for p in model.metadata_props})
        self._start(ModelCompiler(graph, opts), num_threads, sess_options)
        if key is not None and self._compiler.programs():
            images.save(key, {"meta": self._meta, "compiler": self._compiler.state()})

    @classmethod
    def from_graph(cls, graph: Any, target: str | None = None, num_threads: int | None = None,
                   tuning_db: Any = None, sess_options: Any = None, bounds_checks: bool | None = None,
                   precision: str | None = None, options: CompileOptions | None = None) -> InferenceSession:
        """A session over an imported :class:`cuvil.graph.ir.Graph` (what the PyTorch front end
        hands over): the same compilation per signature, runs and ``.so`` export."""
        self = cls.__new__(cls)
        self._meta = ModelMetadata(graph_name=graph.name)
        self._setup(graph, num_threads, sess_options, options, target=target, tuning_db=tuning_db,
                    bounds_checks=bounds_checks, precision=precision)
        return self

    @classmethod
    def from_compiler(cls, compiler: ModelCompiler, num_threads: int | None = None) -> InferenceSession:
        """A session over a :class:`cuvil.graph.driver.ModelCompiler` and the programs it holds (``cuvil
        compile -o model.so`` exports what it compiled, without compiling it again)."""
        self = cls.__new__(cls)
        self._meta = ModelMetadata(graph_name=compiler.graph.name)
        self._start(compiler, num_threads, None)
        return self

    def _setup(self, graph: Any, num_threads: int | None, sess_options: Any, options: CompileOptions | None,
               **given: Any) -> None:
        from cuvil.graph.driver import ModelCompiler

        num_threads, opts = self._options(num_threads, sess_options, options, **given)
        self._start(ModelCompiler(graph, opts), num_threads, sess_options)

    def _options(self, num_threads: int | None, sess_options: Any, options: CompileOptions | None,
                 **given: Any) -> tuple[int | None, CompileOptions]:
        """The session's thread count and compile options, from its arguments and ``sess_options``."""
        from cuvil.graph.ops.nn.bf16 import resolve_precision
        from cuvil.target import Target

        threads, level, self._profiling, self._profile_prefix = _read_options(sess_options)
        if threads is not None and num_threads is not None and threads != num_threads:
            raise ArgumentError(f"num_threads={num_threads} and sess_options.intra_op_num_threads={threads} "
                                "disagree; give one")
        num_threads = num_threads if num_threads is not None else threads
        if options is not None and not isinstance(options, CompileOptions):
            raise ArgumentError(f"options must be a cuvil.options.CompileOptions, got {type(options).__name__}")
        opts = CompileOptions.of(options, **given)
        if level in _LEVEL_PASSES:  # below ORT_ENABLE_EXTENDED: some passes, one kernel per node
            opts = opts.replace(passes=_LEVEL_PASSES[level], fuse=False)
        # fp32, with a warning, on a target without the feature
        opts = opts.replace(precision=resolve_precision(opts.precision, Target(opts.target)))
        self._level = level
        return num_threads, opts

    def _start(self, compiler: ModelCompiler, num_threads: int | None, sess_options: Any) -> None:
        if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                        or num_threads < 1):
            raise ArgumentError(f"num_threads must be a positive int or None, got {num_threads!r}")
        if not hasattr(self, "_profiling"):
            self._profiling, self._profile_prefix = False, "cuvil_profile"
            self._level = GraphOptimizationLevel.ORT_ENABLE_ALL
        self._sess_options = sess_options
        self._events: list[dict[str, Any]] = []
        self._profile_start_ns = time.time_ns()
        self._profile_t0 = time.perf_counter()
        self.num_threads = num_threads
        self._compiler = compiler
        compiler.on_compiled = self._adopt
        for _, _, prog in compiler.programs():
            self._adopt(prog)
        self._graph = compiler.graph
        self._feeds = self._graph.feeds
        # each input's (name, dtype, static shape) for the quick check of a well-formed feed
        self._quick = [(v.name, np.dtype(v.dtype), tuple(v.shape)) for v in self._feeds
                       if v.shape is not None and all(isinstance(d, int) for d in v.shape)]
        if len(self._quick) != len(self._feeds):
            self._quick = []  # symbolic sizes: every run takes the full check
        self._by_shapes: dict[tuple, Any] = {}  # input shapes -> program, while no input is specialised on
        self._lock = threading.Lock()
        static = {v.name: v.shape for v in self._feeds}
        if all(s is not None and all(isinstance(d, int) for d in s) for s in static.values()):
            compiler.program({n: tuple(s) for n, s in static.items()})  # type: ignore[arg-type]  (None: deferred)

    def _adopt(self, prog: Any) -> None:
        """A newly compiled program runs on the session's threads."""
        if prog.module is not None:
            prog.module.session_threads = self.num_threads
            if self.num_threads is not None:
                prog.module._set_threads(self.num_threads)

    def programs(self) -> list[Any]:
        """The programs (:class:`cuvil.graph.compiled.CompiledGraph`) compiled so far, one per signature."""
        return [prog for _, _, prog in self._compiler.programs()]

    @property
    def options(self) -> CompileOptions:
        """The compile options (target, precision, thresholds, ...) every signature is compiled with."""
        return self._compiler.options

    @property
    def target(self) -> str:
        return self._compiler.options.target

    @property
    def precision(self) -> str:
        """"fp32" or "bf16" (contractions with constant weights in bfloat16, docs/precision.md; fp32 with a
        warning on a target without the feature)."""
        return self._compiler.options.precision

    @property
    def bounds_checks(self) -> bool:
        return self._compiler.options.bounds_checks

    @property
    def tuning_db(self) -> Any:
        return self._compiler.options.tuning_db

    # -- onnxruntime's introspection -------------------------------------------------------
    def get_inputs(self) -> list[NodeArg]:
        return [NodeArg(v.name, list(v.shape or []), v.type_str) for v in self._feeds]

    def get_outputs(self) -> list[NodeArg]:
        return [NodeArg(v.name, list(v.shape or []), v.type_str) for v in self._graph.outputs]

    def get_providers(self) -> list[str]:
        """Where the session runs, in onnxruntime's names: ``["CPUExecutionProvider"]`` for a CPU
        (``llvm``) target, ``["CUDAExecutionProvider"]`` for a ``cuda`` one (cuvil's own code either
        way; :meth:`get_provider_options` gives the target)."""
        return ["CUDAExecutionProvider" if self._target_kind() == "cuda" else "CPUExecutionProvider"]

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        """``{provider: {"target": the canonical target string}}``."""
        from cuvil.target import Target

        return {self.get_providers()[0]: {"target": Target(self.target).canonical}}

    def _target_kind(self) -> str:
        from cuvil.target import Target

        return Target(self.target).kind

    def get_modelmeta(self) -> ModelMetadata:
        """The model's producer, graph name, domain, descriptions, version and metadata_props."""
        return self._meta

    def get_session_options(self) -> Any:
        """The ``sess_options`` the session was made with (a default :class:`SessionOptions` if none)."""
        if self._sess_options is None:
            opts = SessionOptions()
            opts.intra_op_num_threads = self.num_threads or 0
            return opts
        return self._sess_options

    # -- profiling -------------------------------------------------------------------------
    def end_profiling(self) -> str:
        """With ``enable_profiling``: write the runs' events (each run and each kernel call, in
        onnxruntime's JSON trace format) to ``<profile_file_prefix>_<date>_<time>.json`` in the
        working directory, stop profiling and return the file's path; without it, ``""``."""
        if not self._profiling:
            return ""
        self._profiling = False
        path = f"{self._profile_prefix}_{time.strftime('%Y-%m-%d_%H-%M-%S')}.json"
        with open(path, "w") as f:
            json.dump(self._events, f, indent=0)
        self._events = []
        return path

    def get_profiling_start_time_ns(self) -> int:
        return self._profile_start_ns

    def _record(self, events: Sequence[Any], start: float, seconds: float) -> None:
        pid, tid = os.getpid(), threading.get_ident() % (1 << 31)

        def us(t: float) -> int:
            return int(round((t - self._profile_t0) * 1e6))

        with self._lock:
            self._events.append({"cat": "Session", "pid": pid, "tid": tid, "dur": int(round(seconds * 1e6)),
                                 "ts": us(start), "ph": "X", "name": "model_run", "args": {}})
            for e in events:  # a label is "Conv+Relu 'conv1'": the ops of the kernel and its first node
                ops, _, node = e.label.partition(" ")
                self._events.append({"cat": "Node", "pid": pid, "tid": tid, "dur": int(round(e.seconds * 1e6)),
                                     "ts": us(e.start), "ph": "X", "name": f"{node.strip(chr(39)) or ops}_kernel_time",
                                     "args": {"op_name": ops, "label": e.label, "kernel": e.kernel,
                                              "call_index": e.index}})

    @property
    def fallbacks(self) -> list[str]:
        """One line per kernel of the programs compiled so far that took a plainer schedule than planned
        (isl's operation bound, a strategy the scheduler could not apply); also logged on the
        ``cuvil.schedule`` logger when it happens."""
        return [f for _, _, prog in self._compiler.programs() for f in prog.fallbacks]

    # -- running ---------------------------------------------------------------------------
    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options: Any = None,
            outputs: Sequence[np.ndarray] | Mapping[str, np.ndarray] | None = None) -> list[np.ndarray]:
        """The outputs named (all when ``None``), in order, for the fed inputs.

        ``outputs``: the caller's buffers, one per output named (a list in that order, or a dict by
        name for some of them): numpy arrays of the output's exact shape and dtype, C-contiguous and
        writeable, sharing no memory with an input.  The run writes into them (a kernel directly
        where it can) and returns them in the list; a buffer that does not fit raises before the
        run.  The output shape for the fed shapes: ``sess.get_outputs()``, or one run without it."""
        feeds = self._quick_feeds(input_feed)
        if feeds is None:
            feeds = self._check_feeds(input_feed)
        names = [v.name for v in self._graph.outputs]
        if output_names is None:
            output_names = names
        for n in output_names if output_names is not names else ():
            if n not in names:
                raise ArgumentError(f"{n!r} is not an output of the model; outputs: {', '.join(names)}")
        fast = self._by_shapes
        sig = tuple(a.shape for a in feeds.values())
        prog = fast.get(sig) if not self._compiler.specialised else None
        if prog is None:
            prog = self._compiler.for_feeds(feeds)  # an input that decides a shape: specialised on its value
            if not self._compiler.specialised:
                fast[sig] = prog
        out = None if outputs is None else self._check_outputs(prog, output_names, outputs, feeds)
        if self._profiling:
            results = self._profiled_run(prog, feeds, out)
        else:
            results = prog.run(feeds, out) if out else prog.run(feeds)
        return [results[n] for n in output_names]

    def _profiled_run(self, prog: Any, feeds: Mapping[str, np.ndarray], out: Mapping[str, np.ndarray] | None
                      ) -> dict[str, np.ndarray]:
        from cuvil.graph.profile import timed_run

        t0 = time.perf_counter()
        results, events = timed_run(prog, feeds)
        for n, buf in (out or {}).items():
            np.copyto(buf, results[n].reshape(buf.shape))
            results[n] = buf
        self._record(events, t0, time.perf_counter() - t0)
        return results

    @staticmethod
    def _check_outputs(prog: Any, output_names: Sequence[str], outputs: Any, feeds: Mapping[str, np.ndarray]
                       ) -> dict[str, np.ndarray]:
        """``run(outputs=)`` as ``{name: array}``, each checked against the compiled output."""
        if isinstance(outputs, Mapping):
            given = dict(outputs)
            unknown = [n for n in given if n not in output_names]
            if unknown:
                raise ArgumentError(f"outputs= names {', '.join(repr(n) for n in unknown)}, which this run does not "
                                    f"return; it returns {', '.join(output_names)}")
        elif isinstance(outputs, (list, tuple)):
            if len(outputs) != len(output_names):
                raise ArgumentError(f"outputs= has {len(outputs)} buffer(s) for {len(output_names)} output(s) "
                                    f"({', '.join(output_names)}); give one per output, or a dict by name")
            given = dict(zip(output_names, outputs))
        else:
            raise ArgumentError(f"outputs= must be a list of numpy arrays (one per output) or a dict by name, got "
                                f"{type(outputs).__name__}")
        compiled = dict(prog.outputs)
        for n, buf in given.items():
            e = compiled[n]
            shape, dtype = tuple(e.shape), np.dtype(e.dtype)
            if not isinstance(buf, np.ndarray):
                raise ArgumentError(f"outputs[{n!r}]: expected a numpy array, got {type(buf).__name__}")
            if buf.dtype != dtype:
                raise DTypeError(f"outputs[{n!r}]: output {n!r} is {dtype.name}, the buffer is {buf.dtype.name}")
            if buf.shape != shape:
                raise ShapeError(f"outputs[{n!r}]: output {n!r} has shape {list(shape)} for these inputs, the buffer "
                                 f"{list(buf.shape)}")
            if not buf.flags.c_contiguous or not buf.flags.writeable:
                raise ArgumentError(f"outputs[{n!r}]: the buffer must be C-contiguous and writeable (np.empty("
                                    f"{shape}, {dtype.name!r}))")
            for m, a in feeds.items():
                if np.may_share_memory(buf, a):
                    raise ArgumentError(f"outputs[{n!r}] shares memory with input {m!r}")
            for m, other in given.items():
                if m != n and np.may_share_memory(buf, other):
                    raise ArgumentError(f"outputs[{n!r}] shares memory with outputs[{m!r}]")
        return given

    # -- exporting -------------------------------------------------------------------------
    def export_library(self, path: str | os.PathLike[str],
                       input_shapes: Mapping[str, Sequence[int]] | Sequence[Mapping[str, Sequence[int]]] | None = None,
                       *, prefix: str | None = None, cc: str | None = None) -> str:
        """Write the model as one shared library at ``path`` and a C header beside it (``.h``).

        The library is compiled for fixed input shapes: the model's own, or ``input_shapes``
        ({name: shape}) where it has symbolic dimensions, or else the one signature this session has
        compiled (by a run or an export), if it has exactly one.  A list of such dicts compiles one
        signature each into the same library: the model's symbolic sizes (e.g. a batch ``N``) are
        then the first arguments of its C functions (``model_run(N, x, y)``), which pick the
        signature (status 3 for sizes not compiled).  Its C symbols start with ``prefix`` (default:
        the file name, ``model.so`` -> ``model_run``); ``cc`` links it (a cross compiler for
        another target).  ``cuvil.runtime.load(path)`` runs it from Python without islpy or
        llvmlite; docs/export.md shows it from C.  Returns the library's path.
        """
        from cuvil.graph.export import export_graph, resolve_signatures

        ran_with = [shapes for shapes, values, _ in self._compiler.programs() if not values]
        signatures, sizes = resolve_signatures(self._feeds, dict(input_shapes) if isinstance(input_shapes, Mapping)
                                               else input_shapes, ran_with)
        progs = []
        for shapes in signatures:
            prog = self._compiler.program(shapes)
            if prog is None:
                names = ", ".join(sorted(repr(n) for n in self._compiler.specialised))
                raise ShapeError(f"the value of input(s) {names} "
                                 "decides a shape in this model; a library is compiled for input shapes only, so "
                                 "this model cannot be exported")
            progs.append(prog)
        return export_graph(progs, self._feeds, signatures, path, self.target, sizes=sizes,
                            declared_outputs={v.name: v.shape for v in self._graph.outputs}, prefix=prefix, cc=cc,
                            name=self._graph.name)

    def _quick_feeds(self, input_feed: Any) -> dict[str, np.ndarray] | None:
        """``input_feed`` as it is when it is a dict of exactly the inputs, each a numpy array of its
        static shape and dtype (a few microseconds less per run than :meth:`_check_feeds`, which
        explains what is wrong otherwise); None when it is not."""
        quick = self._quick
        if not quick or type(input_feed) is not dict or len(input_feed) != len(quick):
            return None
        for name, dtype, shape in quick:
            a = input_feed.get(name)
            if type(a) is not np.ndarray or a.dtype != dtype or a.shape != shape:
                return None
        return {name: input_feed[name] for name, _, _ in quick}  # in the model's order

    def _check_feeds(self, input_feed: Mapping[str, Any]) -> dict[str, np.ndarray]:
        expected = {v.name: v for v in self._feeds}
        check_feed_names(input_feed, list(expected))
        feeds: dict[str, np.ndarray] = {}
        symbols: dict[str, tuple[int, str]] = {}
        for n, v in expected.items():
            a = input_feed[n]
            if not isinstance(a, np.ndarray):
                if isinstance(a, np.generic):
                    a = np.asarray(a)
                else:
                    raise ArgumentError(f"input {n!r}: expected a numpy array, got {type(a).__name__}")
            if a.dtype.name != v.dtype:
                raise DTypeError(f"input {n!r}: expected {v.type_str} ({v.dtype}), got {a.dtype.name}; cuvil "
                                 "does not cast inputs")
            if v.shape is not None:
                if a.ndim != len(v.shape):
                    raise ShapeError(f"input {n!r}: expected rank {len(v.shape)} {list(v.shape)}, got shape "
                                     f"{list(a.shape)}")
                for d, (want, got) in enumerate(zip(v.shape, a.shape)):
                    if isinstance(want, int) and want != got:
                        raise ShapeError(f"input {n!r}: dimension {d} must be {want}, got {got} "
                                         f"(shape {list(a.shape)})")
                    if isinstance(want, str):
                        lo, hi = self._graph.dims.get(want, (0, None))
                        if got < lo or (hi is not None and got > hi):
                            raise ShapeError(f"input {n!r}: dimension {d} ({want}) is {got}, outside the range "
                                             f"{lo}..{hi if hi is not None else 'inf'} the model was exported for")
                        if want in symbols and symbols[want][0] != got:
                            raise ShapeError(f"input {n!r}: dimension {d} ({want}) is {got}, but {want} is "
                                             f"{symbols[want][0]} in input {symbols[want][1]!r}")
                        symbols.setdefault(want, (got, n))
            feeds[n] = a
        return feeds
