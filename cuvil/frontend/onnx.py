"""ONNX -> cuvil's graph IR.  The importer only translates; :mod:`cuvil.graph.compile` compiles.

    model = load_model("model.onnx")          # path, bytes or ModelProto; external data loads
    graph = import_model(model)               # shape inference, validation, graph IR
    prog = compile_model(graph, {"x": (1, 3, 224, 224)})   # cuvil.graph.compile
    outputs = prog.run({"x": x})              # one native call

The graph IR's nodes are ONNX's operators (their builders live in :mod:`cuvil.graph.ops`); ONNX
attributes become Python values, initializers numpy arrays.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from cuvil.dtype import ONNX_TYPE_NAMES
from cuvil.errors import CuvilError, DTypeError, ModelError, UnsupportedOpError
from cuvil.graph.ir import Graph, Node, ValueInfo

__all__ = ["ModelError", "check_model", "import_model", "kernel_programs", "load_model", "check_tensor", "tensor_array"]

log = logging.getLogger("cuvil.onnx")

# TensorProto element types whose data tensor_array checks against the dims (one value per element,
# two for complex): FLOAT ... UINT64 but STRING, COMPLEX64/128, BFLOAT16
_PLAIN_TYPES = frozenset([1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 16])

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
    from cuvil.dtype import from_onnx_code

    t = vi.type.tensor_type
    if not vi.type.HasField("tensor_type"):
        raise UnsupportedOpError(f"value {vi.name!r}: only tensors are supported (not sequences, maps or optionals)")
    try:
        dtype: str | None = from_onnx_code(t.elem_type, f"value {vi.name!r}") if t.elem_type else None
    except DTypeError:
        dtype = None
    shape = None
    if t.HasField("shape"):
        shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim)
    import onnx

    code = (onnx.TensorProto.DataType.Name(t.elem_type).lower()
            if t.elem_type in onnx.TensorProto.DataType.values() else str(t.elem_type))
    type_str = f"tensor({ONNX_TYPE_NAMES.get(dtype or '', code)})"
    return ValueInfo(vi.name, dtype, shape, type_str)


def _attrs(node: Any, where: str) -> dict[str, Any]:
    import onnx

    out: dict[str, Any] = {}
    for a in node.attribute:
        if a.type == onnx.AttributeProto.TENSOR:
            out[a.name] = tensor_array(a.t, f"{where}: attribute {a.name!r}")
        elif a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
            out[a.name] = a  # sub-graphs: a Loop's body, read by cuvil.graph.loops
        else:
            v = onnx.helper.get_attribute_value(a)
            out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


def tensor_array(t: Any, what: str) -> np.ndarray:
    """The numpy array of a TensorProto (an initializer, a TENSOR attribute) after checking that its
    element type, dims and data agree; ``what`` names it in the ModelError otherwise."""
    from onnx import numpy_helper

    check_tensor(t, what)
    try:
        return numpy_helper.to_array(t)
    except (ValueError, TypeError) as exc:  # a case check_tensor does not know; onnx says what
        import onnx

        raise ModelError(f"{what}: cannot decode the {onnx.TensorProto.DataType.Name(t.data_type)} tensor: "
                         f"{exc}") from None


def check_tensor(t: Any, what: str) -> None:
    """A TensorProto's element type, dims and data agree (ModelError naming ``what`` otherwise)."""
    import onnx
    from onnx import helper

    if t.data_type == onnx.TensorProto.UNDEFINED or t.data_type not in onnx.TensorProto.DataType.values():
        raise ModelError(f"{what}: data_type {t.data_type} is not an ONNX element type")
    dims = list(t.dims)
    if any(d < 0 for d in dims):
        raise ModelError(f"{what}: dims {dims} has a negative dimension")
    if t.data_location == onnx.TensorProto.EXTERNAL and not t.HasField("raw_data"):
        where = {e.key: e.value for e in t.external_data}.get("location", "?")
        raise ModelError(f"{what}: its data is external ({where!r}) and was not loaded; load the model from its "
                         "path (the data file beside it)")
    count = int(np.prod(dims, dtype=np.int64)) if dims else 1
    type_name = onnx.TensorProto.DataType.Name(t.data_type)
    if t.data_type in _PLAIN_TYPES:
        if t.HasField("raw_data"):
            want = count * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
            if len(t.raw_data) != want:
                raise ModelError(f"{what}: raw_data holds {len(t.raw_data)} bytes, but dims {dims} of {type_name} "
                                 f"need {want}")
        else:
            field = helper.tensor_dtype_to_field(t.data_type)
            want = count * (2 if t.data_type in (onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128) else 1)
            have = len(getattr(t, field))
            if have != want:
                raise ModelError(f"{what}: {field} holds {have} values, but dims {dims} of {type_name} need {want}")
    elif t.data_type == onnx.TensorProto.STRING and len(t.string_data) != count:
        raise ModelError(f"{what}: string_data holds {len(t.string_data)} strings, but dims {dims} need {count}")


def import_model(model: Any) -> Graph:
    """The graph IR of a ModelProto, after validation (:func:`check_model`) and ONNX shape inference."""
    from cuvil.dtype import from_onnx_code

    model = _topologically_sorted(load_model(model))
    opset = check_model(model)
    try:
        model = _infer_shapes(model)
    except Exception as exc:
        if "existing shape differ" not in str(exc):
            _explain_inference_failure(model, opset)
            raise ModelError(f"invalid model (ONNX shape inference failed): {exc}") from None
        # a stale declared shape (an output or value_info the exporter did not update): onnxruntime trusts
        # its own inference, and so does cuvil, with a warning
        log.warning("cuvil.onnx: %s; the declared shapes of outputs and intermediate values are ignored",
                    str(exc).strip().splitlines()[-1][:200])
        model = _without_declared_shapes(model)
        try:
            model = _infer_shapes(model)
        except Exception as exc2:
            _explain_inference_failure(model, opset)
            raise ModelError(f"invalid model (ONNX shape inference failed): {exc2}") from None
    g = model.graph
    inits: dict[str, np.ndarray] = {}
    for t in g.initializer:
        from_onnx_code(t.data_type, f"initializer {t.name!r}")
        inits[t.name] = tensor_array(t, f"initializer {t.name!r}")
    inputs = [_value_info(v) for v in g.input]
    for v in inputs:
        if v.dtype is None and v.name not in inits:
            raise DTypeError(f"graph input {v.name!r} has type {v.type_str}, which cuvil does not support")
    nodes = []
    defined = {v.name for v in inputs} | set(inits)
    for k, n in enumerate(g.node):
        name = (n.name if isinstance(n.name, str) else n.name.decode("utf-8", "replace")) or f"{n.op_type}_{k}"
        node = Node(n.op_type, name, tuple(n.input), tuple(n.output), _attrs(n, f"{n.op_type} node {name!r}"),
                    _domain(n))
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


# initializers of more elements than this go to ONNX shape inference without their data (a shape or an
# index vector, whose values inference may read, is far smaller; ResNet-50's weights are ~100 MB that
# inference would copy twice through protobuf for nothing)
_INFER_DATA_ELEMENTS = 4096


def _infer_shapes(model: Any) -> Any:
    """``model`` with the types and shapes ONNX shape inference gives its values (strict: an error
    where inference fails), inferred on a light copy that leaves the large initializers' data out."""
    import onnx

    light = onnx.ModelProto()
    if any(_big(t) for t in model.graph.initializer):
        _light_copy(model, light)
    else:
        light.CopyFrom(model)
    inferred = onnx.shape_inference.infer_shapes(light, check_type=True, strict_mode=True)
    g, ig = model.graph, inferred.graph
    del g.value_info[:]
    g.value_info.extend(ig.value_info)
    for dst, src in zip(g.output, ig.output):
        dst.CopyFrom(src)
    for dst, src in zip(g.node, ig.node):
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in src.attribute):
            dst.CopyFrom(src)  # a Loop's or an If's body, with its own inferred values
    return model


def _big(t: Any) -> bool:
    return math.prod(t.dims) > _INFER_DATA_ELEMENTS


def _light_copy(model: Any, light: Any) -> None:
    """Fill ``light`` with ``model`` less the data of its large initializers (their dims and types kept)."""
    import onnx

    light.ir_version = model.ir_version
    light.opset_import.extend(model.opset_import)
    light.domain, light.model_version = model.domain, model.model_version
    light.functions.extend(model.functions)
    g = light.graph
    src = model.graph
    g.name = src.name
    g.node.extend(src.node)
    g.input.extend(src.input)
    g.output.extend(src.output)
    g.value_info.extend(src.value_info)
    g.sparse_initializer.extend(src.sparse_initializer)
    for t in src.initializer:
        if not _big(t):
            g.initializer.append(t)
            continue
        e = onnx.TensorProto()
        e.name, e.data_type = t.name, t.data_type
        e.dims.extend(t.dims)
        g.initializer.append(e)


def _domain(n: Any) -> str:
    """A node's domain in the graph IR: the com.microsoft operators cuvil implements (onnxruntime's
    quantizer writes them; :data:`cuvil.graph.ops.quant.ms.MS_OPS`) join the default domain."""
    from cuvil.graph.ops.quant.ms import MS_OPS

    return "" if n.domain == "com.microsoft" and n.op_type in MS_OPS else n.domain


def check_model(model: Any) -> int:
    """Refuse what onnxruntime refuses as invalid, each with a ModelError naming the field, tensor or
    node: no graph, an IR version or opset newer than this onnx knows (or no ai.onnx opset), a graph
    without outputs, negative dimensions, initializers whose data does not match their dims,
    attributes that are not in the op's schema (or required ones missing, or of the wrong type),
    TENSOR attributes without a tensor, dangling inputs and values defined twice.  Returns the
    model's ai.onnx opset."""
    import onnx

    if not model.HasField("graph"):
        raise ModelError("the model has no graph (an empty or truncated ModelProto?)")
    if model.ir_version > onnx.IR_VERSION or model.ir_version < 3:  # 3: the first with opset imports
        raise ModelError(f"ir_version {model.ir_version} is not supported: this onnx ({onnx.__version__}) reads IR "
                         f"versions 3 to {onnx.IR_VERSION}")
    newest = onnx.defs.onnx_opset_version()
    versions = {}
    for o in model.opset_import:
        versions.setdefault(o.domain or "ai.onnx", o.version)
    if not versions:
        raise ModelError(f"the model's opset_import is empty; cuvil supports ai.onnx opsets 1 to {newest}")
    g = model.graph
    if "ai.onnx" not in versions:
        for k, n in enumerate(g.node):
            if n.domain in ("", "ai.onnx"):
                raise ModelError(f"{n.op_type} node {n.name or f'{n.op_type}_{k}'!r} is an ai.onnx operator, but "
                                 f"the model imports no ai.onnx opset (only {', '.join(sorted(versions))})")
    opset = versions.setdefault("ai.onnx", 1)
    if not 1 <= opset <= newest:
        raise ModelError(f"ai.onnx opset {opset} is not supported: cuvil supports opsets 1 to {newest} (the "
                         f"operator schemas of onnx {onnx.__version__})")
    if not g.output:
        raise ModelError(f"graph {g.name!r} has no outputs: a model must compute at least one")
    for kind, values in (("graph input", g.input), ("graph output", g.output)):
        for v in values:
            if not v.name:
                raise ModelError(f"a {kind} has no name")
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type not in \
                    onnx.TensorProto.DataType.values():
                raise ModelError(f"{kind} {v.name!r}: element type {v.type.tensor_type.elem_type} is not an ONNX "
                                 "element type")
            if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape"):
                dims = v.type.tensor_type.shape.dim
                for d, dim in enumerate(dims):
                    if dim.HasField("dim_value") and dim.dim_value < 0:
                        shape = [x.dim_value if x.HasField("dim_value") else (x.dim_param or "?") for x in dims]
                        raise ModelError(f"{kind} {v.name!r}: dimension {d} is {dim.dim_value} (shape {shape})")
    for t in g.initializer:
        if not t.name:
            raise ModelError("an initializer has no name")
        check_tensor(t, f"initializer {t.name!r}")
    for k, n in enumerate(g.node):
        for field in ("op_type", "domain"):  # a name is only a label (onnxruntime runs a node named in bytes)
            if not isinstance(getattr(n, field), str):  # protobuf hands back bytes that are not UTF-8
                raise ModelError(f"node {k}: its {field} {getattr(n, field)!r} is not UTF-8 text")
        _check_attributes(n, f"{n.op_type} node {n.name or f'{n.op_type}_{k}'!r}", opset)
    _check_dangling(g)
    return opset


def _check_attributes(n: Any, where: str, opset: int) -> None:
    """A node's attributes against its op's schema (ai.onnx ops only; an unknown op is left to the
    unsupported-op check, which lists them all)."""
    import onnx

    for a in n.attribute:
        if not a.name:
            raise ModelError(f"{where}: an attribute has no name")
        if a.ref_attr_name:
            raise ModelError(f"{where}: attribute {a.name!r} refers to a function attribute "
                             f"({a.ref_attr_name!r}) outside a function")
        if a.type == onnx.AttributeProto.UNDEFINED or a.type not in onnx.AttributeProto.AttributeType.values():
            raise ModelError(f"{where}: attribute {a.name!r} has no valid type ({a.type})")
        if a.type == onnx.AttributeProto.TENSOR:
            if not a.HasField("t"):
                raise ModelError(f"{where}: attribute {a.name!r} is typed TENSOR but holds no tensor")
            check_tensor(a.t, f"{where}: attribute {a.name!r}")
    if n.domain not in ("", "ai.onnx"):
        return
    try:
        schema = onnx.defs.get_schema(n.op_type, opset, "")
    except (onnx.defs.SchemaError, TypeError, ValueError):  # no such op (an op_type onnx cannot even take)
        return
    allowed = schema.attributes
    for a in n.attribute:
        spec = allowed.get(a.name)
        if spec is None:
            names = ", ".join(sorted(allowed)) or "none"
            raise ModelError(f"{where}: {a.name!r} is not an attribute of {n.op_type} (opset {opset}, schema "
                             f"version {schema.since_version}); its attributes: {names}")
        if int(spec.type.value) != a.type:
            raise ModelError(f"{where}: attribute {a.name!r} must be {spec.type.name}, not "
                             f"{onnx.AttributeProto.AttributeType.Name(a.type)}")
    given = {a.name for a in n.attribute}
    missing = [name for name, spec in allowed.items() if spec.required and name not in given]
    if missing:
        raise ModelError(f"{where}: required attribute(s) {', '.join(repr(m) for m in missing)} of {n.op_type} "
                         "missing")


_WINDOW_OPS = ("Conv", "ConvInteger", "MaxPool", "AveragePool", "LpPool")


def _explain_inference_failure(model: Any, opset: int) -> None:
    """When strict shape inference fails, name the cause where cuvil can: a window (kernel) larger
    than its padded input, found on the shapes the lenient inference gives.  Returns when it finds
    nothing (the caller then reports onnx's message)."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
    except Exception:
        return
    g = inferred.graph
    shapes: dict[str, list[int | None]] = {}
    for v in [*g.input, *g.value_info, *g.output]:
        t = v.type.tensor_type
        if v.type.HasField("tensor_type") and t.HasField("shape"):
            shapes.setdefault(v.name, [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim])
    for t in g.initializer:
        shapes[t.name] = list(t.dims)
    for k, n in enumerate(g.node):
        if n.op_type not in _WINDOW_OPS or n.domain not in ("", "ai.onnx") or not n.input:
            continue
        x = shapes.get(n.input[0])
        if not x or len(x) < 3:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        kernel = list(attrs.get("kernel_shape") or [])
        if not kernel and n.op_type.startswith("Conv") and len(n.input) > 1:
            kernel = list((shapes.get(n.input[1]) or [])[2:])
        spatial = x[2:]
        if len(kernel) != len(spatial) or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            continue
        pads = list(attrs.get("pads") or [0] * (2 * len(spatial)))
        dil = list(attrs.get("dilations") or [1] * len(spatial))
        for d, (size, kk) in enumerate(zip(spatial, kernel)):
            if size is None or kk is None or d >= len(dil) or d + len(spatial) >= len(pads):
                continue
            window = (kk - 1) * dil[d] + 1
            padded = size + pads[d] + pads[d + len(spatial)]
            if window > padded:
                from cuvil.errors import ShapeError

                raise ShapeError(f"{n.op_type} node {n.name or f'{n.op_type}_{k}'!r}: the window ({window}) is "
                                 f"larger than the padded input ({padded}) in spatial dimension {d} (input "
                                 f"{n.input[0]!r} of shape {x})")


def _without_declared_shapes(model: Any) -> Any:
    """A copy of ``model`` whose graph outputs keep their element types but not their shapes, and whose
    value_info is gone (shape inference fills both in again)."""
    out = type(model)()
    out.CopyFrom(model)
    del out.graph.value_info[:]
    for v in out.graph.output:
        if v.type.HasField("tensor_type"):
            v.type.tensor_type.ClearField("shape")
    return out


def _topologically_sorted(model: Any) -> Any:
    """``model`` (or, when its nodes are out of order, a copy with them sorted, each node after the
    producers of its inputs and otherwise in file order, as onnxruntime accepts them); a cycle or an
    input no node produces stays where it is, for :func:`check_model` to name."""
    import heapq

    g = model.graph
    producer = {o: k for k, n in enumerate(g.node) for o in n.output if o}
    needs = [{producer[x] for x in n.input if x in producer and producer[x] != k} for k, n in enumerate(g.node)]
    if all(all(p < k for p in ps) for k, ps in enumerate(needs)):
        return model
    users: dict[int, list[int]] = {}
    for k, ps in enumerate(needs):
        for p in ps:
            users.setdefault(p, []).append(k)
    waiting = [len(ps) for ps in needs]
    ready = [k for k, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        k = heapq.heappop(ready)
        order.append(k)
        for u in users.get(k, ()):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    order += [k for k in range(len(g.node)) if waiting[k] > 0]  # a cycle: left for check_model to refuse
    out = type(model)()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(g.node[k] for k in order)
    return out


def _check_dangling(g: Any) -> None:
    """Every node input defined before it (a graph input, an initializer, an earlier node's output);
    no value defined twice."""
    defined = {v.name for v in g.input} | {t.name for t in g.initializer}
    for k, n in enumerate(g.node):
        where = f"{n.op_type} node {n.name or f'{n.op_type}_{k}'!r}"
        for x in n.input:
            if x and x not in defined:
                raise ModelError(f"{where}: input {x!r} is not a graph input, an initializer or an earlier "
                                 "node's output")
        for o in n.output:
            if o and o in defined:
                raise ModelError(f"{where}: output {o!r} is already defined (by a graph input, an initializer or "
                                 "an earlier node); each value has one definition")
        defined.update(o for o in n.output if o)


def kernel_programs(model: Any, target: Any = "llvm", shapes: Mapping[str, tuple[int, ...]] | None = None
                    ) -> list[tuple[list[Any], int]]:
    """The distinct kernels one run of ``model`` (path, bytes or ModelProto) calls, each as (its te
    arguments, how many calls of it a run makes): :func:`cuvil.graph.compile.kernel_programs` of the
    imported graph."""
    from cuvil.graph.compile import kernel_programs as graph_kernels

    return graph_kernels(import_model(load_model(model)), target, shapes)
