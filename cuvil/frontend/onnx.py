"""ONNX -> cuvil: load a model, import it into the graph IR, compile it into one native module.

    model = load_model("model.onnx")          # path, bytes or ModelProto; external data loads
    graph = import_model(model)               # shape inference, validation, graph IR
    check_supported(graph)                    # one UnsupportedOpError listing every missing op
    prog = compile_graph(graph, {"x": (1, 3, 224, 224)}, {}, "llvm")
    outputs = prog.run({"x": x})              # one native call

``compile_graph`` walks the nodes in order with concrete shapes.  Each node's builder
(``onnx_ops*.py``) returns te tensors; their program is auto-scheduled and lowered into one kernel
(kernels are cached by op, attributes, input shapes and the values the builder read, so equal
nodes share one).  A node whose inputs are all known at compile time is run once, right away, and
its outputs become constants (constant folding by cuvil's own kernels).  Reshape-like nodes alias
their input's buffer.  The kernels are then linked into one LLVM module whose entry point calls
them in order (``cuvil.graph.link``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import math
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from cuvil.errors import CuvilError, DTypeError, UnsupportedOpError
from cuvil.frontend.onnx_ops import (
    Alias,
    Entry,
    Fused,
    NodeCtx,
    NotFusible,
    Runtime,
    Shaped,
    builder_for,
    inline_elementwise,
    t_shape,
)
from cuvil.graph import kernel_cache
from cuvil.graph.ir import Graph, Node, ValueInfo

_TYPE_STR = {"float32": "float", "float64": "double", "float16": "float16", "bool": "bool", "int8": "int8",
             "int16": "int16", "int32": "int32", "int64": "int64", "uint8": "uint8", "uint16": "uint16",
             "uint32": "uint32", "uint64": "uint64"}


class ModelError(CuvilError, ValueError):
    """An invalid model: a dangling input, a failed shape inference, a malformed attribute."""


# -- loading and importing --------------------------------------------------------------------


def load_model(src: Any) -> Any:
    """An ``onnx.ModelProto`` from a path, bytes or a ModelProto (external data is loaded)."""
    import onnx

    if isinstance(src, onnx.ModelProto):
        return src
    try:
        if isinstance(src, (bytes, bytearray)):
            return onnx.load_from_string(bytes(src))
        if isinstance(src, (str, os.PathLike)):
            if not os.path.exists(src):
                raise ModelError(f"no ONNX model at {os.fspath(src)!r}")
            return onnx.load(os.fspath(src), load_external_data=True)
    except CuvilError:
        raise
    except Exception as exc:  # a protobuf decode error or a missing external data file
        raise ModelError(f"cannot load the ONNX model: {exc}") from None
    raise ModelError(f"an ONNX model is a path, bytes or onnx.ModelProto, not {type(src).__name__}")


def _value_info(vi: Any) -> ValueInfo:
    from cuvil.frontend.onnx_ops_math import onnx_dtype

    t = vi.type.tensor_type
    if not vi.type.HasField("tensor_type"):
        raise UnsupportedOpError(f"value {vi.name!r}: only tensors are supported (not sequences, maps or optionals)")
    try:
        dtype: str | None = onnx_dtype(t.elem_type, f"value {vi.name!r}") if t.elem_type else None
    except DTypeError:
        dtype = None
    shape = None
    if t.HasField("shape"):
        shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim)
    import onnx

    type_str = f"tensor({_TYPE_STR.get(dtype or '', onnx.TensorProto.DataType.Name(t.elem_type).lower())})"
    return ValueInfo(vi.name, dtype, shape, type_str)


def _attrs(node: Any) -> dict[str, Any]:
    import onnx
    from onnx import numpy_helper

    out: dict[str, Any] = {}
    for a in node.attribute:
        if a.type == onnx.AttributeProto.TENSOR:
            out[a.name] = numpy_helper.to_array(a.t)
        elif a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
            out[a.name] = a  # sub-graphs: no supported op takes one
        else:
            v = onnx.helper.get_attribute_value(a)
            out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


def import_model(model: Any) -> Graph:
    """The graph IR of a ModelProto, after ONNX shape inference and validation."""
    import onnx
    from onnx import numpy_helper

    from cuvil.frontend.onnx_ops_math import onnx_dtype

    model = load_model(model)
    opset = max([o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] or [1])
    _check_dangling(model.graph)
    try:
        model = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except Exception as exc:
        raise ModelError(f"invalid model (ONNX shape inference failed): {exc}") from None
    g = model.graph
    inits: dict[str, np.ndarray] = {}
    for t in g.initializer:
        onnx_dtype(t.data_type, f"initializer {t.name!r}")
        inits[t.name] = numpy_helper.to_array(t)
    inputs = [_value_info(v) for v in g.input]
    for v in inputs:
        if v.dtype is None and v.name not in inits:
            raise DTypeError(f"graph input {v.name!r} has type {v.type_str}, which cuvil does not support")
    nodes = []
    defined = {v.name for v in inputs} | set(inits)
    for k, n in enumerate(g.node):
        node = Node(n.op_type, n.name or f"{n.op_type}_{k}", tuple(n.input), tuple(n.output), _attrs(n), n.domain)
        for x in node.inputs:
            if x and x not in defined:
                raise ModelError(f"{node}: input {x!r} is not a graph input, an initializer or an earlier "
                                 "node's output")
        defined.update(o for o in node.outputs if o)
        nodes.append(node)
    outputs = [_value_info(v) for v in g.output]
    for v in outputs:
        if v.name not in defined:
            raise ModelError(f"graph output {v.name!r} is not produced by any node")
    vinfo = {v.name: _value_info(v) for v in g.value_info if v.type.HasField("tensor_type")}
    return Graph(g.name, inputs, outputs, inits, nodes, opset, vinfo)


def _check_dangling(g: Any) -> None:
    defined = {v.name for v in g.input} | {t.name for t in g.initializer}
    for k, n in enumerate(g.node):
        for x in n.input:
            if x and x not in defined:
                raise ModelError(f"{n.op_type} node {n.name or f'{n.op_type}_{k}'!r}: input {x!r} is not a graph "
                                 "input, an initializer or an earlier node's output")
        defined.update(o for o in n.output if o)


def check_supported(graph: Graph) -> None:
    """Raise one UnsupportedOpError naming every unsupported op type and its nodes."""
    missing: dict[str, list[str]] = {}
    for n in graph.nodes:
        if n.domain not in ("", "ai.onnx") or builder_for(n.op_type, graph.opset) is None:
            key = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}"
            missing.setdefault(key, []).append(n.name)
    if missing:
        parts = [f"{op} (node{'s' if len(ns) > 1 else ''} {', '.join(repr(x) for x in ns[:8])}"
                 f"{', ...' if len(ns) > 8 else ''})" for op, ns in sorted(missing.items())]
        raise UnsupportedOpError(f"the model uses {len(missing)} operator type(s) cuvil does not support at opset "
                                 f"{graph.opset}: {'; '.join(parts)}")


# -- compiling --------------------------------------------------------------------------------


@dataclass
class _Slot:
    kind: str  # "feed" | "const" | "temp"
    dtype: str
    size: int  # elements
    name: str = ""
    array: np.ndarray | None = None


_KERNELS: dict[tuple, Any] = {}  # (target, node key) -> LoweredFunc named "k", shared by every session


def _contiguous(a: Any) -> np.ndarray:
    """A C-contiguous array that keeps a 0-d array 0-d (np.ascontiguousarray makes it 1-d)."""
    if type(a) is np.ndarray and a.flags.c_contiguous:
        return a  # the common case, without np.require's microseconds
    return np.require(np.asarray(a), requirements="C")


def _digest(a: np.ndarray) -> str:
    return hashlib.sha1(_contiguous(a).tobytes() + str((a.dtype, a.shape)).encode()).hexdigest()


def _attr_key(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return ("array", _digest(v))
    if isinstance(v, (list, tuple)):
        return tuple(_attr_key(x) for x in v)
    return repr(v)


def _node_key(ctx: NodeCtx, target: str) -> tuple:
    n = ctx.node
    # shape, dtype and whether the value is known at compile time (builders may branch on that)
    # (an input computed by an earlier member of a fused kernel: which member, and its kernel shape)
    spec = tuple(None if e is None else (tuple(e.shape), e.dtype, False) if isinstance(e, Runtime) else (
        "fused", e.member, tuple(e.shape), e.dtype, e.kernel_shape) if isinstance(e, Fused) else (
        tuple(e.shape), e.dtype.name, True) for e in ctx.entries)
    values = tuple((i, _digest(np.asarray(ctx.entries[i]))) for i in sorted(ctx.value_reads))
    attrs = tuple(sorted((k, _attr_key(v)) for k, v in n.attrs.items()))
    return (target, n.op_type, ctx.opset, attrs, spec, values, len(n.outputs))


def _lower_kernel(what: str, args: list[Any], placeholders: list[Any], target: Any, tuning_db: Any = None) -> Any:
    """The loop IR of one kernel (``what`` names its node or fused nodes in errors); with ``tuning_db``,
    the best tuning record of the kernel's computation replaces the automatic schedule when there is one."""
    import cuvil
    from cuvil import te
    from cuvil.errors import ScheduleError

    try:
        try:
            s = cuvil.auto_schedule(args, target)
        except ScheduleError:
            s = te.create_schedule([a for a in args if not any(a is p for p in placeholders)])
        if tuning_db is not None:
            from cuvil.autotune.replay import apply_best

            s = apply_best(s, args, target, tuning_db)
        return cuvil.lower(s, args, name="k")
    except CuvilError as exc:
        raise type(exc)(f"{what}: {exc}") from None
    except Exception as exc:
        raise CuvilError(f"{what}: internal error while compiling its kernel: {type(exc).__name__}: {exc}"
                         ) from exc


class CompiledGraph:
    """A graph compiled for fixed input shapes: ``run(feeds) -> {output name: array}``, one native call."""

    def __init__(self, slots: list[_Slot], calls: list[tuple[Any, tuple[int, ...]]],
                 outputs: list[tuple[str, Runtime | np.ndarray]], target: Any, labels: list[str] | None = None):
        from cuvil.graph.link import KernelCall, LinkedModule

        self.slots = slots
        self.outputs = outputs
        self.target = target
        self.labels = list(labels) if labels is not None else [f"call {k}" for k in range(len(calls))]
        names: dict[int, str] = {}
        kernels = []
        linked_calls = []
        for func, args in calls:
            if id(func) not in names:
                names[id(func)] = f"k{len(names)}"
                kernels.append(dataclasses.replace(func, name=names[id(func)]))
            linked_calls.append(KernelCall(names[id(func)], args))
        self.kernel_calls = linked_calls  # per call: the kernel's name in the module and its slots
        self.kernel_funcs = kernels
        self.n_kernels = len(kernels)
        self.n_calls = len(linked_calls)
        self.module = LinkedModule(kernels, linked_calls, target) if linked_calls else None
        self._feeds = [(k, s.name) for k, s in enumerate(slots) if s.kind == "feed"]
        self._consts = {k: s.array for k, s in enumerate(slots) if s.kind == "const"}
        # temporaries that are not returned share one arena, reused by lifetime (cuvil.graph.memplan)
        from cuvil.graph.memplan import lifetimes, plan_memory

        returned = {e.slot for _, e in outputs if isinstance(e, Runtime)}
        self._temp_bytes = {k: max(s.size, 1) * np.dtype(s.dtype).itemsize for k, s in enumerate(slots)
                            if s.kind == "temp" and k not in returned}
        self.memory = plan_memory(lifetimes([((), args) for _, args in calls], self._temp_bytes))
        self._tls = threading.local()  # each thread's kept buffers (see _kept)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        arrays = self.buffers(feeds)
        self.run_buffers(arrays)
        out = {}
        for name, e in self.outputs:
            if isinstance(e, np.ndarray):
                out[name] = e.copy()
            else:
                out[name] = arrays[e.slot][:math.prod(e.shape)].reshape(e.shape)
        return out

    def profile(self, feeds: Mapping[str, np.ndarray], repeat: int = 10) -> Any:
        """Each kernel call timed on its own buffers (see :mod:`cuvil.graph.profile`)."""
        from cuvil.graph.profile import profile

        return profile(self, feeds, repeat)

    def run_buffers(self, arrays: list[np.ndarray]) -> None:
        """One run of every kernel on ``arrays`` (from :meth:`buffers`)."""
        if self.module is not None:
            rc = self.module.call_array(self._pointers(arrays))
            if rc:
                raise CuvilError("the compiled model failed to allocate its temporary memory (status "
                                 f"{rc})")

    def buffers(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """One array per slot: the feeds, the constants, temporaries in a fresh arena."""
        arrays: list[np.ndarray | None] = [None] * len(self.slots)
        for k, name in self._feeds:
            arrays[k] = _contiguous(feeds[name])
        for k, a in self._consts.items():
            arrays[k] = a
        kept = self._kept()
        arena = kept.get("arena")
        if arena is None:
            arena = kept["arena"] = np.empty(max(self.memory.arena_bytes, 1), np.uint8)
        for k, s in enumerate(self.slots):
            if s.kind != "temp":
                continue
            if k in self.memory.offsets:
                off = self.memory.offsets[k]
                arrays[k] = arena[off:off + self._temp_bytes[k]].view(s.dtype)
            else:  # returned to the caller: last run's array again once the caller has let go of it
                last = kept.get(k)
                if last is None or sys.getrefcount(last) > 3:  # kept's reference, `last`, the argument
                    last = kept[k] = np.empty(max(s.size, 1), s.dtype)
                arrays[k] = last
        return arrays  # type: ignore[return-value]

    def _pointers(self, arrays: list[np.ndarray]) -> Any:
        """The slots' data pointers as this thread's ctypes array: the constants' and the arena's set
        once per thread (a numpy array's pointer costs a microsecond to read; a model has a hundred
        buffers), the feeds' and outputs' each run."""
        kept = self._kept()
        arr = kept.get("pointers")
        arena = kept.get("arena")
        if arr is None or kept.get("pointers_of") is not arena:
            base = arena.ctypes.data if arena is not None else 0
            fixed = {k: a.ctypes.data for k, a in self._consts.items()}
            fixed.update({k: base + off for k, off in self.memory.offsets.items()})
            arr = (ctypes.c_void_p * max(1, len(arrays)))(*[fixed.get(k, 0) for k in range(len(arrays))])
            kept["pointers"], kept["pointers_of"] = arr, arena  # type: ignore[assignment]
            kept["varying"] = [k for k in range(len(arrays)) if k not in fixed]  # type: ignore[assignment]
        for k in kept["varying"]:  # type: ignore[attr-defined]
            arr[k] = arrays[k].ctypes.data
        return arr

    def _kept(self) -> dict[Any, np.ndarray]:
        """This thread's buffers from its last run: the arena, and the outputs (a thread runs one model
        at a time).  Fresh multi-megabyte arrays on every run cost page faults: a depthwise convolution
        at 112x112 ran 0.78 ms on kept buffers and 1.87 ms on fresh ones."""
        kept = getattr(self._tls, "kept", None)
        if kept is None:
            kept = self._tls.kept = {}
        return kept


def kernel_programs(model: Any, target: Any = "llvm", shapes: Mapping[str, tuple[int, ...]] | None = None
                    ) -> list[tuple[list[Any], int]]:
    """The distinct kernels one run of ``model`` (path, bytes or ModelProto) calls, each as (its te
    arguments, how many calls of it a run makes): what ``cuvil tune model.onnx`` tunes.  Symbolic input
    dimensions need ``shapes``; the model is compiled once on the way (folding its constants)."""
    from cuvil.errors import ShapeError
    from cuvil.frontend.onnx_ops import NeedsValue
    from cuvil.graph.passes import optimize

    graph = import_model(load_model(model))
    check_supported(graph)
    graph = optimize(graph)
    static = {v.name: (tuple(shapes[v.name]) if shapes and v.name in shapes else v.shape) for v in graph.feeds}
    open_dims = [n for n, s in static.items() if s is None or not all(isinstance(d, int) for d in s)]
    if open_dims:
        raise ShapeError(f"inputs {', '.join(open_dims)} have symbolic dimensions: give their sizes, e.g. "
                         f"shapes={{{open_dims[0]!r}: (1, 3, 224, 224)}}")
    found: dict[tuple, list[Any]] = {}

    def on_kernel(key: tuple, args: list[Any], label: str) -> None:
        found.setdefault(key, [args, 0])[1] += 1

    try:
        compile_graph(graph, static, {}, target, on_kernel=on_kernel)  # type: ignore[arg-type]
    except NeedsValue as exc:
        raise ShapeError(f"a shape of this model depends on the value of an input ({exc}): its kernels are "
                         "only known for given values; tune them one by one with cuvil.autotune.tune") from None
    return [(args, n) for args, n in found.values()]


def compile_graph(graph: Graph, shapes: Mapping[str, tuple[int, ...]], known: Mapping[str, np.ndarray],
                  target: Any = "llvm", progress: Any = None, fuse: bool = True, tuning_db: Any = None,
                  on_kernel: Any = None) -> CompiledGraph:
    """Compile ``graph`` for inputs of ``shapes`` (fed at run time) and inputs of ``known`` values
    (specialised on).  With ``fuse``, each group of :func:`cuvil.graph.fuse.fusion_groups` (a node and
    the element-wise nodes after it) is one kernel; otherwise each node is.  Raises ``NeedsValue``
    when a builder needs a fed input's value."""
    from cuvil.graph.fuse import Group, fusion_groups
    from cuvil.target import Target

    check_supported(graph)
    c = _GraphCompiler(graph, shapes, known, Target(target))
    c.tuning_db, c.on_kernel = tuning_db, on_kernel
    groups = fusion_groups(graph) if fuse else tuple(Group((k,)) for k in range(len(graph.nodes)))
    done = 0
    for grp in groups:
        nodes = [graph.nodes[k] for k in grp.members]
        if progress is not None:
            progress(done, len(graph.nodes), nodes[0])
        if len(nodes) == 1 or not c.group(nodes):
            for node in nodes:
                c.node(node)
        done += len(nodes)
    return c.finish()


def _tensor_and_shape(o: Any) -> tuple[Any, tuple[int, ...] | None]:
    """A builder's output as (te tensor, the shape the graph sees), or (None, None) when not computed."""
    from cuvil.te.tensor import Tensor

    if isinstance(o, Shaped):
        return o.tensor, o.shape
    if isinstance(o, Tensor):
        return o, tuple(int(d.value) for d in o.shape)
    return None, None


def _db_key(tuning_db: Any) -> tuple | None:
    """What a kernel cache key records of a tuning database: its file's identity and last change (a new
    record makes every kernel look again); None when it cannot be told (a database in memory)."""
    path = os.fspath(tuning_db) if isinstance(tuning_db, (str, os.PathLike)) else getattr(tuning_db, "path", None)
    if path is None or path == ":memory:":
        return None
    try:
        st = os.stat(path)
    except OSError:
        return ("tuning_db", os.path.abspath(path), "absent")
    return ("tuning_db", os.path.abspath(path), st.st_mtime_ns, st.st_size)


class _GraphCompiler:
    """The state of one ``compile_graph``: buffers (slots), the values of the graph's names (env) and
    the kernel calls, in run order."""

    tuning_db: Any = None  # kernels replay their best tuning records (cuvil.autotune)
    on_kernel: Any = None  # called as on_kernel(key, args, label) for each kernel call the graph runs

    def __init__(self, graph: Graph, shapes: Mapping[str, tuple[int, ...]], known: Mapping[str, np.ndarray],
                 target: Any):
        self.graph = graph
        self.target = target
        self.slots: list[_Slot] = []
        self.calls: list[tuple[Any, tuple[int, ...]]] = []
        self.labels: list[str] = []
        self._const_slot: dict[int, int] = {}
        self.env: dict[str, Entry] = dict(graph.initializers)
        for v in graph.inputs:
            if v.name in known:
                self.env[v.name] = np.asarray(known[v.name])
            elif v.name in shapes:
                self.slots.append(_Slot("feed", v.dtype or "float32", math.prod(shapes[v.name]), v.name))
                self.env[v.name] = Runtime(len(self.slots) - 1, tuple(shapes[v.name]), v.dtype or "float32",
                                           frozenset([v.name]))

    def slot_of(self, e: Runtime | np.ndarray) -> int:
        if isinstance(e, Runtime):
            return e.slot
        if id(e) not in self._const_slot:
            a = _contiguous(e)
            self.slots.append(_Slot("const", a.dtype.name, a.size, array=a))
            self._const_slot[id(e)] = len(self.slots) - 1
        return self._const_slot[id(e)]

    def build(self, node: Node, entries: list[Entry], prefix: str = "") -> tuple[NodeCtx, list]:
        """Run ``node``'s builder: its context and one output per node output."""
        ctx = NodeCtx(node, entries, self.graph.opset, prefix)
        ctx.target = self.target
        builder = builder_for(node.op_type, self.graph.opset)
        try:
            outs = list(builder(ctx))  # type: ignore[misc]
        except (CuvilError, NotFusible):
            raise
        except (IndexError, KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"{node}: malformed inputs or attributes ({type(exc).__name__}: {exc})") from None
        return ctx, outs + [None] * (len(node.outputs) - len(outs))

    def node(self, node: Node) -> None:
        """Compile one node as its own kernel (or fold it, or alias its input)."""
        entries = [self.env[x] if x else None for x in node.inputs]
        ctx, outs = self.build(node, entries)
        computed = []  # (output index, kernel tensor, shape the graph sees)
        for k, o in enumerate(outs):
            t, shape = _tensor_and_shape(o)
            if t is None:
                continue
            if math.prod(shape) == 0:  # type: ignore[arg-type]
                outs[k] = np.zeros(shape, t.dtype)
            else:
                computed.append((k, t, shape))
        if computed:
            results = self.kernel(_node_key(ctx, self.target.canonical), [ctx], [(t, s) for _, t, s in computed],
                                  f"{node.op_type} {node.name!r}")
            for (k, _, _), r in zip(computed, results):
                outs[k] = r
        for name, o in zip(node.outputs, outs):
            if isinstance(o, Alias):
                src = entries[o.index]
                o = src.reshape(o.shape) if isinstance(src, np.ndarray) else dataclasses.replace(src, shape=o.shape)
            if name:
                self.env[name] = o

    def group(self, nodes: list[Node]) -> bool:
        """Compile a fusion group as one kernel: each member's builder reads the te tensors of the
        members before it.  False (nothing compiled) when a member cannot be fused."""
        local: dict[str, Fused] = {}
        ctxs = []
        try:
            for m, node in enumerate(nodes):
                entries = [local[x] if x in local else self.env[x] if x else None for x in node.inputs]
                ctx, outs = self.build(node, entries, prefix=f"n{m}_")
                t, shape = _tensor_and_shape(outs[0])
                if t is None or any(o is not None for o in outs[1:]) or math.prod(shape) == 0:  # type: ignore[arg-type]
                    return False
                local[node.outputs[0]] = Fused(t, shape, t.dtype, m)  # type: ignore[arg-type]
                ctxs.append(ctx)
        except NotFusible:
            return False
        last = local[nodes[-1].outputs[0]]
        last = dataclasses.replace(last, tensor=inline_elementwise(last.tensor))  # one epilogue stage
        key = ("fused",) + tuple(_node_key(ctx, self.target.canonical) for ctx in ctxs)
        label = f"{'+'.join(n.op_type for n in nodes)} {nodes[0].name!r}"
        try:
            [self.env[nodes[-1].outputs[0]]] = self.kernel(key, ctxs, [(last.tensor, last.shape)], label)
        except CuvilError as exc:  # (raised before the kernel is added: nothing to undo)
            import warnings

            warnings.warn(f"{label}: the fused kernel does not compile ({exc}); its nodes are compiled one by one",
                          stacklevel=2)
            return False
        return True

    def kernel(self, key: tuple, ctxs: list[NodeCtx], outs: list[tuple[Any, tuple[int, ...]]], label: str
               ) -> list[Runtime | np.ndarray]:
        """The kernel computing ``outs`` (te tensor, graph shape) from the placeholders of ``ctxs``: called
        at run time, or run now when every input is known (its outputs become constants)."""
        placeholders = [(ctx, i, p) for ctx in ctxs for i, p in ctx.placeholders]
        args = [p for _, _, p in placeholders] + [t for t, _ in outs]
        cached = True
        if self.tuning_db is not None:
            db = _db_key(self.tuning_db)
            cached = db is not None
            key = key + (db,)
        func = _KERNELS.get(key) if cached else None
        if func is None:
            func = kernel_cache.load(key) if cached else None
            if func is None:
                func = _lower_kernel(label, args, [p for _, _, p in placeholders], self.target, self.tuning_db)
                if cached:
                    kernel_cache.store(key, func)
            if cached:
                _KERNELS[key] = func
        ins = [ctx.entries[i] for ctx, i, _ in placeholders]
        if all(isinstance(e, np.ndarray) for e in ins):
            results = _fold(func, [np.reshape(e, t_shape(p)) for e, (_, _, p) in zip(ins, placeholders)],
                            [(t_shape(t), t.dtype) for t, _ in outs], self.target)
            return [r.reshape(shape) for r, (_, shape) in zip(results, outs)]
        if self.on_kernel is not None:
            self.on_kernel(key, args, label)
        origin = frozenset().union(*(e.origin for e in ins if isinstance(e, Runtime)))
        arg_slots = [self.slot_of(e) for e in ins]  # type: ignore[arg-type]
        results: list[Runtime | np.ndarray] = []
        for t, shape in outs:
            self.slots.append(_Slot("temp", t.dtype, math.prod(shape)))
            results.append(Runtime(len(self.slots) - 1, shape, t.dtype, origin))
            arg_slots.append(len(self.slots) - 1)
        self.calls.append((func, tuple(arg_slots)))
        self.labels.append(label)
        return results

    def finish(self) -> CompiledGraph:
        outputs: list[tuple[str, Runtime | np.ndarray]] = []
        used: set[int] = set()
        for v in self.graph.outputs:
            e = self.env[v.name]
            if isinstance(e, Runtime) and (self.slots[e.slot].kind != "temp" or e.slot in used):
                e = _copy(e, self.slots, self.calls, self.target)
                self.labels.append(f"copy to output {v.name!r}")
            if isinstance(e, Runtime):
                used.add(e.slot)
            outputs.append((v.name, e))
        return CompiledGraph(self.slots, self.calls, outputs, self.target, self.labels)


def _copy(e: Runtime, slots: list[_Slot], calls: list, target: Any) -> Runtime:
    """A kernel that copies ``e`` into a new buffer (an output that is an input, a constant or another output)."""
    from cuvil import te

    key = (target.canonical, "copy", e.shape, e.dtype)
    func = _KERNELS.get(key) or kernel_cache.load(key)
    if func is None:
        import cuvil

        x = te.placeholder(e.shape, e.dtype, name="x")
        y = te.compute(e.shape, lambda *i: x[i], name="copy")
        func = cuvil.lower(cuvil.auto_schedule([x, y], target), [x, y], name="k")
        kernel_cache.store(key, func)
    _KERNELS[key] = func
    slots.append(_Slot("temp", e.dtype, math.prod(e.shape)))
    calls.append((func, (e.slot, len(slots) - 1)))
    return dataclasses.replace(e, slot=len(slots) - 1)


_FOLDERS: dict[tuple, Any] = {}


def _fold(func: Any, ins: list[np.ndarray], out_shapes: list[tuple[tuple[int, ...], str]], target: Any
          ) -> list[np.ndarray]:
    """Run a kernel on constant inputs now: its outputs become constants of the compiled graph."""
    from cuvil.runtime.module import Module

    key = (id(func), target.canonical)
    if key not in _FOLDERS:
        _FOLDERS[key] = (func, Module(func, target))
    mod = _FOLDERS[key][1]
    outs = [np.empty(shape, dtype) for shape, dtype in out_shapes]
    mod(*[_contiguous(a) for a in ins], *outs)
    return outs
