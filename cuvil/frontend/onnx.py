"""ONNX -> cuvil's graph IR.  The importer only translates; :mod:`cuvil.graph.compile` compiles.

    model = load_model("model.onnx")          # path, bytes or ModelProto; external data loads
    graph = import_model(model)               # shape inference, validation, graph IR
    prog = compile_model(graph, {"x": (1, 3, 224, 224)})   # cuvil.graph.compile
    outputs = prog.run({"x": x})              # one native call

The graph IR's nodes are ONNX's operators (their builders live in :mod:`cuvil.graph.ops`); ONNX
attributes become Python values, initializers numpy arrays.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from cuvil.errors import CuvilError, DTypeError, ModelError, UnsupportedOpError
from cuvil.graph.ir import Graph, Node, ValueInfo

__all__ = ["ModelError", "import_model", "kernel_programs", "load_model"]

_TYPE_STR = {"float32": "float", "float64": "double", "float16": "float16", "bool": "bool", "int8": "int8",
             "int16": "int16", "int32": "int32", "int64": "int64", "uint8": "uint8", "uint16": "uint16",
             "uint32": "uint32", "uint64": "uint64"}


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
    from cuvil.graph.ops.arith import onnx_dtype

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

    from cuvil.graph.ops.arith import onnx_dtype

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


def kernel_programs(model: Any, target: Any = "llvm", shapes: Mapping[str, tuple[int, ...]] | None = None
                    ) -> list[tuple[list[Any], int]]:
    """The distinct kernels one run of ``model`` (path, bytes or ModelProto) calls, each as (its te
    arguments, how many calls of it a run makes): :func:`cuvil.graph.compile.kernel_programs` of the
    imported graph."""
    from cuvil.graph.compile import kernel_programs as graph_kernels

    return graph_kernels(import_model(load_model(model)), target, shapes)
