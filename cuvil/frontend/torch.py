"""PyTorch (ATen FX graphs) -> cuvil's graph IR.  The importer only translates; :mod:`cuvil.graph.compile`
compiles.

    ep = torch.export.export(model, args, dynamic_shapes=...).run_decompositions(decompositions())
    imported = import_exported_program(ep)    # graph IR (ONNX's operators) + how to call it
    imported.graph                            # cuvil.graph.ir.Graph, symbolic sizes as dims

Each ATen overload maps onto nodes of the graph IR's operators (:mod:`cuvil.frontend.torch_ops`):
ONNX's operators as :mod:`cuvil.graph.ops` implements them, so fusion, layout, memory planning,
tuning records and ``.so`` export are the ONNX importer's.  Parameters, buffers and constant tensors
become initializers (so BatchNorm folds into convolutions and weights are packed once).  A SymInt
size becomes a symbolic dimension of the graph's inputs (named by its symbol, e.g. ``s0``, with its
range in ``graph.dims``); sizes computed from it are ``Shape``/``Gather`` and integer arithmetic nodes,
which the graph compiler folds for each concrete signature.

Every unsupported overload of a graph is listed in one :class:`~cuvil.errors.UnsupportedOpError`
before anything is translated.  ``torch`` is imported here, never by ``import cuvil``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cuvil.dtype import ONNX_CODES, ONNX_TYPE_NAMES
from cuvil.errors import ModelError, UnsupportedOpError
from cuvil.graph.ir import Graph, Node, ValueInfo

__all__ = ["Imported", "Sym", "decompositions", "import_exported_program", "import_graph_module",
           "unsupported_nodes"]

OPSET = 18  # the graph IR's operator semantics: those of ONNX opset 18 (the dynamo exporter's)
# kept whole by the decompositions: one node each in the graph IR, as the ONNX exporters write them
KEEP_WHOLE = ("aten::scaled_dot_product_attention", "aten::gelu", "aten::layer_norm", "aten::linear",
              "aten::hardswish", "aten::hardsigmoid", "aten::leaky_relu", "aten::elu")
# the torch dtypes the front end translates (their ONNX codes and type names: cuvil.dtype's tables)
_DTYPES = ("float32", "uint8", "int8", "int16", "int32", "int64", "bool", "float16", "float64")


def decompositions() -> dict[Any, Callable]:
    """torch.export's default decomposition table without the entries of :data:`KEEP_WHOLE`, which the
    importer maps whole (attention, GELU, LayerNorm, linear layers and the hard activations keep their
    fused forms)."""
    import torch

    table = torch.export.default_decompositions()
    for k in list(table):
        if k.name() in KEEP_WHOLE:
            table.pop(k)
    return table


@dataclass(frozen=True)
class Sym:
    """A symbolic integer (a SymInt's value): the name of a 0-d int64 value of the graph."""

    name: str


@dataclass(frozen=True)
class Imported:
    """An imported FX graph: the graph IR, and how the caller's values map onto it.

    ``inputs[k]`` is the graph input fed by placeholder ``k`` of the FX graph, or None for a
    placeholder that is a constant (a parameter, a buffer) or a size; ``outputs`` is per FX output
    either ``("tensor", name)`` (a graph output) or ``("value", python value)`` (a constant)."""

    graph: Graph
    inputs: tuple[str | None, ...]
    outputs: tuple[tuple[str, Any], ...]


# -- the value builder ------------------------------------------------------------------------


def torch_dtype_name(dt: Any) -> str:
    name = str(dt).replace("torch.", "")
    if name not in _DTYPES:
        from cuvil.errors import DTypeError

        raise DTypeError(f"dtype {dt} is not supported; cuvil supports {', '.join(sorted(_DTYPES))}")
    return name


def _dim(d: Any) -> int | str:
    """A size of a meta shape: an int, or the SymInt's expression as a name (``s0``)."""
    if isinstance(d, int):
        return d
    expr = d.node.expr
    if getattr(expr, "is_number", False):
        return int(expr)
    return str(expr)


@dataclass
class Builder:
    """The graph being written: nodes, initializers and each value's dtype."""

    nodes: list[Node] = field(default_factory=list)
    inits: dict[str, np.ndarray] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    _count: int = 0
    _consts: dict[tuple, str] = field(default_factory=dict)
    memo: dict[tuple, str] = field(default_factory=dict)  # values derived once per source (a weight's transpose)
    where: str = ""  # the FX node being translated (for node names)

    def fresh(self, base: str) -> str:
        self._count += 1
        return f"{base}_{self._count}"

    def emit(self, op_type: str, inputs: Sequence[str], dtype: str | Sequence[str], n_out: int = 1,
             **attrs: Any) -> list[str]:
        """Append ``op_type(inputs; attrs)``; returns its ``n_out`` output names (of ``dtype``)."""
        outs = [self.fresh(f"{self.where or op_type}") for _ in range(n_out)]
        dts = [dtype] * n_out if isinstance(dtype, str) else list(dtype)
        for o, dt in zip(outs, dts):
            self.dtypes[o] = dt
        self.nodes.append(Node(op_type, self.fresh(f"{op_type}:{self.where}"), tuple(inputs), tuple(outs), attrs))
        return outs

    def one(self, op_type: str, inputs: Sequence[str], dtype: str, **attrs: Any) -> str:
        return self.emit(op_type, inputs, dtype, 1, **attrs)[0]

    def const(self, value: Any, dtype: str | None = None) -> str:
        """An initializer holding ``value`` (small ones shared by value)."""
        a = np.asarray(value, dtype=dtype) if dtype is not None else np.asarray(value)
        key = (a.dtype.str, a.shape, a.tobytes()) if a.size <= 64 else None
        if key is not None and key in self._consts:
            return self._consts[key]
        name = self.fresh("const")
        self.inits[name] = a
        self.dtypes[name] = a.dtype.name
        if key is not None:
            self._consts[key] = name
        return name

    def tensor(self, v: Any, dtype: str) -> str:
        """``v`` (a value's name, a Sym, a Python number) as a graph value of ``dtype`` (cast if needed)."""
        if isinstance(v, Sym):
            v = v.name
        if isinstance(v, str):
            return self.cast(v, dtype)
        if isinstance(v, (bool, int, float, np.number)):
            return self.const(v, dtype)
        raise ModelError(f"{self.where}: expected a tensor or a number, got {type(v).__name__}")

    def cast(self, name: str, dtype: str) -> str:
        if self.dtypes.get(name) == dtype:
            return name
        return self.one("Cast", [name], dtype, to=ONNX_CODES[dtype])

    def ints(self, values: Sequence[Any]) -> str:
        """A 1-D int64 value of ``values`` (ints and Syms): a constant, or a Concat of the sizes."""
        if all(isinstance(v, (int, np.integer)) for v in values):
            return self.const(np.array([int(v) for v in values], np.int64))
        parts = []
        for v in values:
            if isinstance(v, Sym):
                parts.append(self.one("Unsqueeze", [self.cast(v.name, "int64"), self.const([0], "int64")], "int64"))
            else:
                parts.append(self.const([int(v)], "int64"))
        return self.one("Concat", parts, "int64", axis=0)

    def size(self, name: str, axis: int) -> Sym:
        """Size ``axis`` of value ``name`` at run time: Shape, then Gather."""
        shape = self.one("Shape", [name], "int64")
        return Sym(self.one("Gather", [shape, self.const(axis, "int64")], "int64", axis=0))

    def scalar_int(self, v: Any) -> Any:
        """``v`` as an int when it is one, else a Sym."""
        return int(v) if isinstance(v, (int, np.integer)) else v


# -- walking the FX graph -----------------------------------------------------------------------


def target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    overload = getattr(target, "_overloadname", None)  # an OpOverload: "aten::add.Tensor"
    if overload is not None:
        name = str(target).split(".")
        return f"{name[0]}::{'.'.join(name[1:])}"
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__name__', repr(target))}"


def _translation(target: Any) -> Callable | None:
    from cuvil.frontend.torch_ops import TABLE

    return TABLE.get(target_name(target))


def unsupported_nodes(fx_graph: Any) -> list[Any]:
    """The call nodes of ``fx_graph`` whose target the importer cannot translate."""
    return [n for n in fx_graph.nodes if n.op == "call_function" and _translation(n.target) is None]


def check_supported(fx_graph: Any, what: str = "the model") -> None:
    """Raise one UnsupportedOpError naming every unsupported ATen overload of ``fx_graph`` and its nodes."""
    missing: dict[str, list[str]] = {}
    for n in fx_graph.nodes:
        if n.op not in ("placeholder", "output", "call_function", "get_attr"):
            missing.setdefault(f"{n.op} {n.target}", []).append(n.name)
        elif n.op == "call_function" and _translation(n.target) is None:
            missing.setdefault(target_name(n.target), []).append(n.name)
    if missing:
        parts = [f"{op} (node{'s' if len(ns) > 1 else ''} {', '.join(repr(x) for x in ns[:6])}"
                 f"{', ...' if len(ns) > 6 else ''})" for op, ns in sorted(missing.items())]
        raise UnsupportedOpError(f"{what} uses {len(missing)} ATen operator(s) cuvil does not support: "
                                 f"{'; '.join(parts)}")


def node_meta(n: Any) -> Any:
    return n.meta.get("val", n.meta.get("example_value"))


class _Importer:
    def __init__(self, name: str):
        self.b = Builder()
        self.env: dict[Any, Any] = {}
        self.value_info: dict[str, ValueInfo] = {}
        self.name = name

    def resolve(self, a: Any) -> Any:
        import torch

        if isinstance(a, torch.fx.Node):
            return self.env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(self.resolve(x) for x in a)
        if isinstance(a, dict):
            return {k: self.resolve(v) for k, v in a.items()}
        return a

    def call(self, n: Any) -> Any:
        f = _translation(n.target)
        self.b.where = n.name
        try:
            return f(self.b, n, self.resolve(n.args), self.resolve(n.kwargs))
        except UnsupportedOpError as e:
            raise UnsupportedOpError(f"node {n.name!r} ({target_name(n.target)}): {e}") from None

    def sym_input(self, n: Any, tensors: list[tuple[str, Any]]) -> Sym | int:
        """A SymInt placeholder (dynamo's size arguments): the size of a tensor input that has it."""
        d = _dim(node_meta(n))
        if isinstance(d, int):
            return d
        for name, shape in tensors:
            for axis, s in enumerate(shape):
                if s == d:
                    return self.b.size(name, axis)
        raise UnsupportedOpError(f"size argument {n.name!r} ({d}) is not the size of any tensor input")

    def run(self, gm: Any, feeds: Sequence[Any]) -> Imported:
        """``feeds[k]`` for placeholder k: a numpy array (a constant) or a str (the graph input's name)."""
        import torch

        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(feeds):
            raise ModelError(f"{self.name}: {len(placeholders)} placeholders but {len(feeds)} values")
        inputs: list[ValueInfo] = []
        dims: dict[str, tuple[int, int | None]] = {}
        fed: list[str | None] = []
        tensors: list[tuple[str, Any]] = []
        later = []
        for n, v in zip(placeholders, feeds):
            m = node_meta(n)
            if isinstance(v, np.ndarray):
                self.env[n] = self.b.const(v)
                fed.append(None)
            elif isinstance(m, torch.Tensor):
                dt = torch_dtype_name(m.dtype)
                shape = tuple(_dim(d) for d in m.shape)
                for d in m.shape:
                    if not isinstance(_dim(d), int):
                        dims.setdefault(_dim(d), _range(d))
                inputs.append(ValueInfo(v, dt, shape, f"tensor({ONNX_TYPE_NAMES[dt]})"))
                self.b.dtypes[v] = dt
                self.env[n] = v
                tensors.append((v, shape))
                fed.append(v)
            else:
                later.append(n)
                fed.append(None)
        for n in later:  # sizes (dynamo passes a SymInt per symbolic size) and other scalars
            m = node_meta(n)
            self.env[n] = self.sym_input(n, tensors) if isinstance(m, torch.SymInt) else m
        for n in gm.graph.nodes:
            if n.op == "call_function":
                if not n.users:  # dead (a training output's getitem, an assertion): nothing to compute
                    continue
                self.env[n] = self.call(n)
                self.note_shapes(self.env[n], node_meta(n))
            elif n.op == "get_attr":
                self.env[n] = self.b.const(numpy_copy(getattr(gm, n.target)))
            elif n.op == "output":
                return Imported(self._graph(inputs, n.args[0], dims), tuple(fed), self._outputs)
        raise ModelError(f"{self.name}: the FX graph has no output node")

    def note_shapes(self, value: Any, meta: Any) -> None:
        """Record the shape and dtype torch gives a node's result(s) as the graph's value info (the graph
        passes read it, as they read ONNX shape inference's)."""
        import torch

        if isinstance(value, str) and isinstance(meta, torch.Tensor) and value not in self.b.inits:
            dt = self.b.dtypes.get(value)
            self.value_info[value] = ValueInfo(value, dt, tuple(_dim(d) for d in meta.shape),
                                               f"tensor({ONNX_TYPE_NAMES.get(dt or '', dt)})")
        elif isinstance(value, (tuple, list)) and isinstance(meta, (tuple, list)) and len(value) == len(meta):
            for v, m in zip(value, meta):
                self.note_shapes(v, m)

    def _graph(self, inputs: list[ValueInfo], result: Any, dims: dict) -> Graph:
        import torch

        flat = list(result) if isinstance(result, (list, tuple)) else [result]
        outs: list[ValueInfo] = []
        plan: list[tuple[str, Any]] = []
        seen: set[str] = {v.name for v in inputs}
        for k, r in enumerate(flat):
            v = self.env[r] if isinstance(r, torch.fx.Node) else r
            if isinstance(v, Sym):
                v = v.name
            if not isinstance(v, str):
                plan.append(("value", v))
                continue
            if v in seen or v in self.b.inits:  # a graph output needs a node of its own
                self.b.where = f"output_{k}"
                v = self.b.one("Identity", [v], self.b.dtypes[v])
            seen.add(v)
            dt = self.b.dtypes[v]
            m = node_meta(r) if isinstance(r, torch.fx.Node) else None
            shape = tuple(_dim(d) for d in m.shape) if isinstance(m, torch.Tensor) else None
            outs.append(ValueInfo(v, dt, shape, f"tensor({ONNX_TYPE_NAMES.get(dt, dt)})"))
            plan.append(("tensor", v))
        self._outputs = tuple(plan)
        inits = dict(self.b.inits)
        return Graph(self.name, inputs, outs, inits, self.b.nodes, OPSET, self.value_info, dims=dims)


def _range(d: Any) -> tuple[int, int | None]:
    """A SymInt's value range (from its shape environment)."""
    try:
        vr = d.node.shape_env.var_to_range[d.node.expr]
        lo, hi = int(vr.lower), vr.upper
        return lo, (None if not getattr(hi, "is_finite", True) or hi > 2**62 else int(hi))
    except (KeyError, AttributeError, TypeError, ValueError):
        return 0, None


def numpy_copy(t: Any) -> np.ndarray:
    """A tensor's values as a numpy array of its own (a copy: later changes to the module's weights do not
    reach a compiled program, as with Inductor's freezing)."""
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        from cuvil.errors import DTypeError

        raise DTypeError("bfloat16 constants are not supported yet")
    return np.array(t.cpu().contiguous().numpy(), copy=True)


# -- entry points -----------------------------------------------------------------------------


def import_exported_program(ep: Any, name: str = "torch_model") -> Imported:
    """The graph IR of a ``torch.export.ExportedProgram`` (after ``run_decompositions``): parameters,
    buffers and lifted constants become initializers; user inputs become graph inputs, named as their
    placeholders."""
    from torch.export.graph_signature import ConstantArgument, InputKind

    check_supported(ep.graph, name)
    sig = ep.graph_signature
    if getattr(sig, "buffers_to_mutate", None) or getattr(sig, "user_inputs_to_mutate", None):
        raise UnsupportedOpError(f"{name} mutates its buffers or inputs in place; cuvil compiles pure inference "
                                 "graphs")
    state = ep.state_dict
    constants = getattr(ep, "constants", {})
    feeds: list[Any] = []
    for spec in sig.input_specs:
        if spec.kind == InputKind.USER_INPUT:  # a tensor or a size by name; export fixes numbers' values
            number = isinstance(spec.arg, ConstantArgument) and isinstance(spec.arg.value, (bool, int, float))
            feeds.append(np.asarray(spec.arg.value) if number else spec.arg.name)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            src = state[spec.target] if spec.target in state else constants[spec.target]
            feeds.append(numpy_copy(src))
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            if spec.kind == InputKind.CUSTOM_OBJ:
                raise UnsupportedOpError(f"{name}: custom objects ({spec.target}) are not supported")
            feeds.append(numpy_copy(constants[spec.target]))
        else:
            raise UnsupportedOpError(f"{name}: input kind {spec.kind} is not supported")
    return _Importer(name).run(ep.graph_module, feeds)


def import_graph_module(gm: Any, feeds: Sequence[Any], name: str = "torch_graph") -> Imported:
    """The graph IR of an ATen FX ``GraphModule`` (what ``torch.compile`` backends get from
    aot_autograd): ``feeds[k]`` is, for placeholder ``k``, a numpy array (a constant: a frozen
    parameter) or the name its graph input takes; SymInt placeholders become sizes of tensor inputs."""
    check_supported(gm.graph, name)
    return _Importer(name).run(gm, feeds)


