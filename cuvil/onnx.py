"""An onnxruntime-compatible ``InferenceSession`` that runs ONNX models as cuvil-compiled native code.

    import cuvil.onnx
    sess = cuvil.onnx.InferenceSession("model.onnx")            # providers= accepted and ignored
    [y] = sess.run(None, {"x": x})                              # onnxruntime's calling convention
    sess.get_inputs()[0].name, .shape, .type                    # "x", [1, 3, 224, 224], "tensor(float)"

The model is compiled for the input shapes it declares when they are all known; otherwise (a
symbolic batch, an input whose value decides a shape) on the first ``run`` with each new
signature (the fed shapes, and the values of inputs that decide shapes), then cached.  A run is one
native call.  ``onnx`` is imported here, never by ``import cuvil``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cuvil.errors import ArgumentError, DTypeError, ModelError, ShapeError
from cuvil.runtime.call import check_feed_names

__all__ = ["InferenceSession", "ModelError", "NodeArg"]


@dataclass(frozen=True)
class NodeArg:
    """A model input or output as onnxruntime describes it."""

    name: str
    shape: list[int | str | None]
    type: str


class InferenceSession:
    """Compile an ONNX model (path, bytes or ModelProto) for ``target`` and run it like onnxruntime."""

    def __init__(self, path_or_bytes: Any, sess_options: Any = None, providers: Any = None, target: str = "llvm",
                 num_threads: int | None = None, tuning_db: Any = None, **kwargs: Any):
        from cuvil.frontend.onnx import import_model, load_model

        self._setup(import_model(load_model(path_or_bytes)), target, num_threads, tuning_db)

    @classmethod
    def from_graph(cls, graph: Any, target: str = "llvm", num_threads: int | None = None,
                   tuning_db: Any = None) -> InferenceSession:
        """A session over an imported :class:`cuvil.graph.ir.Graph` (what the PyTorch front end
        hands over): the same compilation per signature, runs and ``.so`` export."""
        self = cls.__new__(cls)
        self._setup(graph, target, num_threads, tuning_db)
        return self

    def _setup(self, graph: Any, target: str, num_threads: int | None, tuning_db: Any) -> None:
        from cuvil.graph.compile import prepare

        if tuning_db is not None and not isinstance(tuning_db, (str, os.PathLike)) and not hasattr(tuning_db, "best"):
            raise ArgumentError("tuning_db must be a path or a cuvil.autotune.Database, got "
                                f"{type(tuning_db).__name__}")
        self.tuning_db = tuning_db  # each kernel replays its best record (cuvil.autotune), if there is one
        if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                        or num_threads < 1):
            raise ArgumentError(f"num_threads must be a positive int or None, got {num_threads!r}")
        self.target = target
        self.num_threads = num_threads
        # every unsupported op at once, before compiling anything; then the graph passes (identities,
        # BatchNorm folded into convs, layout, duplicates, dead nodes): once, for every signature
        self._graph = prepare(graph)
        self._feeds = self._graph.feeds
        # each input's (name, dtype, static shape) for the quick check of a well-formed feed
        self._quick = [(v.name, np.dtype(v.dtype), tuple(v.shape)) for v in self._feeds
                       if v.shape is not None and all(isinstance(d, int) for d in v.shape)]
        if len(self._quick) != len(self._feeds):
            self._quick = []  # symbolic sizes: every run takes the full check
        self._specialised: set[str] = set()
        self._cache: dict[tuple, Any] = {}
        self._by_shapes: dict[tuple, Any] = {}  # input shapes -> program, while no input is specialised on
        self._lock = threading.Lock()
        static = {v.name: v.shape for v in self._feeds}
        if all(s is not None and all(isinstance(d, int) for d in s) for s in static.values()):
            self._compiled({n: tuple(s) for n, s in static.items()}, {}, allow_defer=True)  # type: ignore[arg-type]

    # -- onnxruntime's introspection -------------------------------------------------------
    def get_inputs(self) -> list[NodeArg]:
        return [NodeArg(v.name, list(v.shape or []), v.type_str) for v in self._feeds]

    def get_outputs(self) -> list[NodeArg]:
        return [NodeArg(v.name, list(v.shape or []), v.type_str) for v in self._graph.outputs]

    def get_providers(self) -> list[str]:
        return ["CuvilExecutionProvider"]

    @property
    def fallbacks(self) -> list[str]:
        """One line per kernel of the programs compiled so far that took a plainer schedule than planned
        (isl's operation bound, a strategy the scheduler could not apply); also logged on the
        ``cuvil.schedule`` logger when it happens."""
        return [f for prog in self._cache.values() if prog is not None for f in prog.fallbacks]

    # -- running ---------------------------------------------------------------------------
    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options: Any = None
            ) -> list[np.ndarray]:
        """The outputs named (all when ``None``), in order, for the fed inputs."""
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
        prog = fast.get(sig) if not self._specialised else None
        if prog is None:
            shapes = {n: a.shape for n, a in feeds.items()}
            while True:
                try:
                    prog = self._compiled(shapes, {n: feeds[n] for n in self._specialised})
                    break
                except _Retry:
                    continue  # an input decides a shape: specialise on its value too
            if not self._specialised:
                fast[sig] = prog
        results = prog.run(feeds)
        return [results[n] for n in output_names]

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

        ran_with = [dict(shapes) for (shapes, values), prog in self._cache.items() if prog is not None and not values]
        signatures, sizes = resolve_signatures(self._feeds, dict(input_shapes) if isinstance(input_shapes, Mapping)
                                               else input_shapes, ran_with)
        progs = []
        for shapes in signatures:
            try:
                prog = self._compiled(shapes, {}) if not self._specialised else None
            except _Retry:
                prog = None
            if prog is None:
                raise ShapeError(f"the value of input(s) {', '.join(sorted(repr(n) for n in self._specialised))} "
                                 "decides a shape in this model; a library is compiled for input shapes only, so "
                                 "this model cannot be exported")
            progs.append(prog)
        return export_graph(progs, self._feeds, signatures, path, self.target, sizes=sizes,
                            declared_outputs={v.name: v.shape for v in self._graph.outputs}, prefix=prefix, cc=cc,
                            name=self._graph.name)

    def _compiled(self, shapes: Mapping[str, tuple[int, ...]], known: Mapping[str, np.ndarray],
                  allow_defer: bool = False) -> Any:
        from cuvil.graph.compile import compile_graph
        from cuvil.graph.ops.base import NeedsValue

        with self._lock:
            while True:
                key = (tuple(sorted((n, tuple(s)) for n, s in shapes.items())),
                       tuple(sorted((n, np.asarray(v).tobytes()) for n, v in known.items())))
                if key in self._cache:
                    return self._cache[key]
                runtime_shapes = {n: s for n, s in shapes.items() if n not in known}
                try:
                    prog = compile_graph(self._graph, runtime_shapes, known, self.target, tuning_db=self.tuning_db)
                except NeedsValue as nv:
                    feeds_needed = set(nv.inputs) - set(known)
                    if not feeds_needed:
                        raise ShapeError(str(nv)) from None
                    self._specialised |= feeds_needed
                    if allow_defer:
                        return None  # compiled on the first run, with the values fed
                    raise _Retry(feeds_needed) from None
                if prog.module is not None:
                    prog.module.session_threads = self.num_threads
                    if self.num_threads is not None:
                        prog.module._set_threads(self.num_threads)
                self._cache[key] = prog
                return prog

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


class _Retry(Exception):
    pass
