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

import dataclasses
import hashlib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from cuvil.errors import CuvilError, DTypeError, UnsupportedOpError
from cuvil.frontend.onnx_ops import Alias, Entry, NodeCtx, Runtime, Shaped, builder_for, t_shape
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
    spec = tuple(None if e is None else (tuple(e.shape), e.dtype, False) if isinstance(e, Runtime) else (
        tuple(e.shape), e.dtype.name, True) for e in ctx.entries)
    values = tuple((i, _digest(np.asarray(ctx.entries[i]))) for i in sorted(ctx.value_reads))
    attrs = tuple(sorted((k, _attr_key(v)) for k, v in n.attrs.items()))
    return (target, n.op_type, ctx.opset, attrs, spec, values, len(n.outputs))


def _lower_kernel(ctx: NodeCtx, args: list[Any], target: Any) -> Any:
    import cuvil
    from cuvil import te
    from cuvil.errors import ScheduleError

    try:
        try:
            s = cuvil.auto_schedule(args, target)
        except ScheduleError:
            s = te.create_schedule([a for a in args if not any(a is p for _, p in ctx.placeholders)])
        return cuvil.lower(s, args, name="k")
    except CuvilError as exc:
        raise type(exc)(f"{ctx.node}: {exc}") from None
    except Exception as exc:
        raise CuvilError(f"{ctx.node}: internal error while compiling its kernel: {type(exc).__name__}: {exc}"
                         ) from exc


class CompiledGraph:
    """A graph compiled for fixed input shapes: ``run(feeds) -> {output name: array}``, one native call."""

    def __init__(self, slots: list[_Slot], calls: list[tuple[Any, tuple[int, ...]]],
                 outputs: list[tuple[str, Runtime | np.ndarray]], target: Any):
        from cuvil.graph.link import KernelCall, LinkedModule

        self.slots = slots
        self.outputs = outputs
        names: dict[int, str] = {}
        kernels = []
        linked_calls = []
        for func, args in calls:
            if id(func) not in names:
                names[id(func)] = f"k{len(names)}"
                kernels.append(dataclasses.replace(func, name=names[id(func)]))
            linked_calls.append(KernelCall(names[id(func)], args))
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

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        arrays: list[np.ndarray | None] = [None] * len(self.slots)
        for k, name in self._feeds:
            arrays[k] = _contiguous(feeds[name])
        for k, a in self._consts.items():
            arrays[k] = a
        arena = np.empty(max(self.memory.arena_bytes, 1), np.uint8)
        for k, s in enumerate(self.slots):
            if s.kind != "temp":
                continue
            if k in self.memory.offsets:
                off = self.memory.offsets[k]
                arrays[k] = arena[off:off + self._temp_bytes[k]].view(s.dtype)
            else:
                arrays[k] = np.empty(max(s.size, 1), s.dtype)  # returned to the caller
        if self.module is not None:
            rc = self.module([a.ctypes.data for a in arrays])  # type: ignore[union-attr]
            if rc:
                raise CuvilError("the compiled model failed to allocate its temporary memory (status "
                                 f"{rc})")
        out = {}
        for name, e in self.outputs:
            if isinstance(e, np.ndarray):
                out[name] = e.copy()
            else:
                out[name] = arrays[e.slot][:math.prod(e.shape)].reshape(e.shape)  # type: ignore[index]
        return out


def compile_graph(graph: Graph, shapes: Mapping[str, tuple[int, ...]], known: Mapping[str, np.ndarray],
                  target: Any = "llvm", progress: Any = None) -> CompiledGraph:
    """Compile ``graph`` for inputs of ``shapes`` (fed at run time) and inputs of ``known`` values
    (specialised on).  Raises ``NeedsValue`` when a builder needs a fed input's value."""
    from cuvil.target import Target
    from cuvil.te.tensor import Tensor

    tgt = Target(target)
    check_supported(graph)
    slots: list[_Slot] = []
    const_slot: dict[int, int] = {}
    env: dict[str, Entry] = dict(graph.initializers)
    for v in graph.inputs:
        if v.name in known:
            env[v.name] = np.asarray(known[v.name])
        elif v.name in shapes:
            slots.append(_Slot("feed", v.dtype or "float32", math.prod(shapes[v.name]), v.name))
            env[v.name] = Runtime(len(slots) - 1, tuple(shapes[v.name]), v.dtype or "float32", frozenset([v.name]))
    calls: list[tuple[Any, tuple[int, ...]]] = []

    def slot_of(e: Runtime | np.ndarray) -> int:
        if isinstance(e, Runtime):
            return e.slot
        if id(e) not in const_slot:
            a = _contiguous(e)
            slots.append(_Slot("const", a.dtype.name, a.size, array=a))
            const_slot[id(e)] = len(slots) - 1
        return const_slot[id(e)]

    for step, node in enumerate(graph.nodes):
        if progress is not None:
            progress(step, len(graph.nodes), node)
        entries = [env[x] if x else None for x in node.inputs]
        ctx = NodeCtx(node, entries, graph.opset)
        ctx.target = tgt
        builder = builder_for(node.op_type, graph.opset)
        try:
            outs = list(builder(ctx))  # type: ignore[misc]
        except CuvilError:
            raise
        except (IndexError, KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"{node}: malformed inputs or attributes ({type(exc).__name__}: {exc})") from None
        outs += [None] * (len(node.outputs) - len(outs))
        computed = []  # (output index, kernel tensor, shape the graph sees)
        for k, o in enumerate(outs):
            t, shape = (o.tensor, o.shape) if isinstance(o, Shaped) else (o, None) if isinstance(o, Tensor) else (
                None, None)
            if t is None:
                continue
            shape = shape if shape is not None else tuple(int(d.value) for d in t.shape)
            if math.prod(shape) == 0:
                outs[k] = np.zeros(shape, t.dtype)
            else:
                computed.append((k, t, shape))
        if computed:
            key = _node_key(ctx, tgt.canonical)
            args = [p for _, p in ctx.placeholders] + [t for _, t, _ in computed]
            func = _KERNELS.get(key)
            if func is None:
                func = kernel_cache.load(key)
                if func is None:
                    func = _lower_kernel(ctx, args, tgt)
                    kernel_cache.store(key, func)
                _KERNELS[key] = func
            ins = [ctx.entries[i] for i, _ in ctx.placeholders]
            if all(isinstance(e, np.ndarray) for e in ins):
                results = _fold(func, [np.reshape(e, t_shape(p)) for e, (_, p) in zip(ins, ctx.placeholders)],
                                [(t_shape(t), t.dtype) for _, t, _ in computed], tgt)
                for (k, _, shape), r in zip(computed, results):
                    outs[k] = r.reshape(shape)
            else:
                origin = frozenset().union(*(e.origin for e in ins if isinstance(e, Runtime)))
                arg_slots = [slot_of(e) for e in ins]  # type: ignore[arg-type]
                for k, t, shape in computed:
                    slots.append(_Slot("temp", t.dtype, math.prod(shape)))
                    outs[k] = Runtime(len(slots) - 1, shape, t.dtype, origin)
                    arg_slots.append(len(slots) - 1)
                calls.append((func, tuple(arg_slots)))
        for name, o in zip(node.outputs, outs):
            if isinstance(o, Alias):
                src = entries[o.index]
                o = src.reshape(o.shape) if isinstance(src, np.ndarray) else dataclasses.replace(src, shape=o.shape)
            if name:
                env[name] = o
    outputs: list[tuple[str, Runtime | np.ndarray]] = []
    used: set[int] = set()
    for v in graph.outputs:
        e = env[v.name]
        if isinstance(e, Runtime) and (slots[e.slot].kind != "temp" or e.slot in used):
            e = _copy(e, slots, calls, tgt)
        if isinstance(e, Runtime):
            used.add(e.slot)
        outputs.append((v.name, e))
    return CompiledGraph(slots, calls, outputs, tgt)


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
