"""The mutation campaign's models, mutations, verdicts and worker processes (tests/frontends/test_fuzz_mutation.py).

A *mutant* is (model, kind, seed): one of the small ONNX models below, serialised, then corrupted by
``kind`` (random byte flips, a truncation, or a structured corruption of the ModelProto) with a
random generator seeded by ``seed``; the same triple always gives the same bytes.  A worker process
loads each mutant with onnxruntime and with ``cuvil.onnx.InferenceSession``, runs both on the same
inputs, and answers a verdict:

- ``ok``: cuvil raised a :class:`cuvil.errors.CuvilError` where onnxruntime refused the model too,
  or raised :class:`UnsupportedOpError` where onnxruntime ran it, or ran it with outputs matching
  onnxruntime's (:func:`compare`);
- ``fail``: anything else (a non-cuvil exception, a wrong answer, a model onnxruntime refuses that cuvil
  runs, a model onnxruntime runs that cuvil refuses other than as unsupported).

The parent (:class:`WorkerPool`) keeps long-lived workers, restarts one that dies, and reports a
death (a segfault, an abort) or a hang past the per-mutant timeout as a failure of that mutant.

Reproduce one mutant by hand::

    python tests/support/fuzz_worker.py --one embed flip 17        # prints the verdict
    python tests/support/fuzz_worker.py --save embed flip 17 m.onnx
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

import numpy as np

# -- the models ---------------------------------------------------------------------------------
# Small and quick to compile; between them they hold convs, pools, a Gemm/MatMul MLP, a Gather of an
# embedding table with LayerNormalization and a Constant node (a TENSOR attribute), and shape ops.


def _model(nodes, inputs, outputs, inits, opset=17):
    from onnx import TensorProto, helper, numpy_helper

    def vi(name, shape, elem=TensorProto.FLOAT):
        return helper.make_tensor_value_info(name, elem, shape)

    g = helper.make_graph(nodes, "fuzz", [vi(*i) for i in inputs], [vi(*o) for o in outputs],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _weights(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def conv_model():
    from onnx import helper as h

    rng = np.random.default_rng(1)
    return _model([
        h.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv1"),
        h.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        h.make_node("Conv", ["r1", "w2"], ["c2"], kernel_shape=[3, 3], strides=[2, 2], group=1, name="conv2"),
        h.make_node("Add", ["c2", "b2"], ["y"], name="add"),
    ], [("x", [1, 2, 6, 6])], [("y", [1, 3, 2, 2])],
        {"w1": _weights(rng, 4, 2, 3, 3), "b1": _weights(rng, 4), "w2": _weights(rng, 3, 4, 3, 3),
         "b2": _weights(rng, 3, 1, 1)})


def mlp_model():
    from onnx import helper as h

    rng = np.random.default_rng(2)
    return _model([
        h.make_node("Gemm", ["x", "w1", "b1"], ["g1"], transB=1, alpha=0.5, name="gemm"),
        h.make_node("Relu", ["g1"], ["r1"], name="relu"),
        h.make_node("MatMul", ["r1", "w2"], ["m2"], name="matmul"),
        h.make_node("Add", ["m2", "b2"], ["a2"], name="add"),
        h.make_node("Sigmoid", ["a2"], ["y"], name="sigmoid"),
    ], [("x", [2, 4])], [("y", [2, 3])],
        {"w1": _weights(rng, 5, 4), "b1": _weights(rng, 5), "w2": _weights(rng, 5, 3), "b2": _weights(rng, 3)})


def embed_model():
    from onnx import TensorProto, numpy_helper
    from onnx import helper as h

    rng = np.random.default_rng(3)
    shift = numpy_helper.from_array(_weights(rng, 4), "shift")
    nodes = [
        h.make_node("Gather", ["table", "ids"], ["e"], axis=0, name="gather"),
        h.make_node("Constant", [], ["k"], value=shift, name="const"),
        h.make_node("Add", ["e", "k"], ["s"], name="add"),
        h.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5, name="ln"),
    ]
    return _model(nodes, [("ids", [2, 3], TensorProto.INT64)], [("y", [2, 3, 4])],
                  {"table": _weights(rng, 10, 4), "gamma": _weights(rng, 4), "beta": _weights(rng, 4)})


def shape_model():
    from onnx import helper as h

    rng = np.random.default_rng(4)
    return _model([
        h.make_node("Reshape", ["x", "shape"], ["r"], name="reshape"),
        h.make_node("Transpose", ["r"], ["t"], perm=[1, 0], name="transpose"),
        h.make_node("Concat", ["t", "z"], ["c"], axis=1, name="concat"),
        h.make_node("Unsqueeze", ["c", "axes"], ["u"], name="unsqueeze"),
        h.make_node("Slice", ["u", "starts", "ends", "slice_axes"], ["y"], name="slice"),
    ], [("x", [2, 3, 4]), ("z", [12, 2])], [("y", [1, 12, 3])],
        {"shape": np.array([2, 12], np.int64), "axes": np.array([0], np.int64),
         "starts": np.array([1], np.int64), "ends": np.array([4], np.int64), "slice_axes": np.array([2], np.int64),
         "unused": _weights(rng, 2)})


def pool_model():
    from onnx import helper as h

    return _model([
        h.make_node("MaxPool", ["x"], ["m"], kernel_shape=[2, 2], strides=[1, 1], name="maxpool"),
        h.make_node("AveragePool", ["m"], ["a"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=0,
                    name="avgpool"),
        h.make_node("GlobalAveragePool", ["a"], ["g"], name="gap"),
        h.make_node("Mul", ["a", "g"], ["y"], name="mul"),
    ], [("x", [1, 2, 5, 5])], [("y", [1, 2, 4, 4])], {})


MODELS: dict[str, Callable] = {"conv": conv_model, "mlp": mlp_model, "embed": embed_model, "shape": shape_model,
                               "pool": pool_model}

_CACHE: dict[str, bytes] = {}


def model_bytes(name: str) -> bytes:
    if name not in _CACHE:
        _CACHE[name] = MODELS[name]().SerializeToString()
    return _CACHE[name]


# -- the mutations ------------------------------------------------------------------------------
# Each takes the parsed model and a numpy Generator and returns the mutant's bytes, or None when the
# kind does not apply to this model (no attribute to corrupt, no Constant node ...).


def _parse(data: bytes):
    import onnx

    m = onnx.ModelProto()
    m.ParseFromString(data)
    return m


class NotApplicable(Exception):
    """The model holds nothing this mutation corrupts."""


def _pick(rng, seq):
    seq = list(seq)
    if not seq:
        raise NotApplicable
    return seq[int(rng.integers(len(seq)))]


def _flip(data: bytes, rng) -> bytes:
    b = bytearray(data)
    for _ in range(int(rng.integers(1, 9))):
        b[int(rng.integers(len(b)))] ^= int(rng.integers(1, 256))
    return bytes(b)


def _truncate(data: bytes, rng) -> bytes:
    return data[:int(rng.integers(len(data)))]


def _inits(m, with_data=True):
    return [t for t in m.graph.initializer if not with_data or t.raw_data or t.float_data or t.int64_data]


def _init_dims(m, rng):
    """An initializer's dims changed so that they no longer match its data."""
    t = _pick(rng, _inits(m))
    dims = list(t.dims) or [1]
    d = int(rng.integers(len(dims)))
    dims[d] += int(rng.choice([-1, 1, 3])) if dims[d] > 1 else 2
    del t.dims[:]
    t.dims.extend(dims)
    return m


def _init_reshape(m, rng):
    """An initializer's dims permuted or regrouped with the same element count (its data fits)."""
    t = _pick(rng, [t for t in _inits(m) if np.prod(t.dims) > 1])
    n = int(np.prod(t.dims))
    divisors = [k for k in range(1, n + 1) if n % k == 0]
    a = _pick(rng, divisors)
    new = _pick(rng, [[n], [a, n // a], [n // a, a], [1, n], list(reversed(t.dims))])
    del t.dims[:]
    t.dims.extend(new)
    return m


def _raw_len(m, rng):
    """An initializer's raw_data one element (or a few bytes) too short or too long."""
    t = _pick(rng, [t for t in m.graph.initializer if t.raw_data])
    cut = int(rng.choice([-4, -3, -1, 1, 4, 8]))
    t.raw_data = t.raw_data[:cut] if cut < 0 else t.raw_data + bytes(cut)
    return m


def _init_values(m, rng):
    """An initializer's values replaced by special floats (NaN, +-Inf, -0, denormals, huge) or, for an
    integer one, by other small integers (a reshape target, axes, slice bounds)."""
    from onnx import numpy_helper

    t = _pick(rng, _inits(m))
    a = numpy_helper.to_array(t).copy()
    if a.dtype.kind == "f":
        specials = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-40, 3e38, -3e38], np.float32)
        mask = rng.random(a.shape) < 0.4
        a[mask] = rng.choice(specials, size=a.shape)[mask]
    else:
        a = rng.integers(-3, 13, size=a.shape).astype(a.dtype)
    t.CopyFrom(numpy_helper.from_array(a, t.name))
    return m


def _node_attrs(m):
    return [(n, a) for n in m.graph.node for a in n.attribute]


def _attr_type(m, rng):
    """An attribute's declared type changed without its payload (an INTS attribute typed FLOAT ...)."""
    from onnx import AttributeProto as A

    n, a = _pick(rng, _node_attrs(m))
    a.type = int(_pick(rng, [t for t in (A.FLOAT, A.INT, A.STRING, A.INTS, A.FLOATS, A.TENSOR, A.GRAPH)
                             if t != a.type]))
    return m


def _attr_missing(m, rng):
    pairs = [(n, k) for n in m.graph.node for k in range(len(n.attribute))]
    n, k = _pick(rng, pairs)
    del n.attribute[k]
    return m


def _attr_value(m, rng):
    """An INT or INTS attribute given a value out of its range (an axis of 7, a kernel of 0, a
    permutation that repeats, an empty list)."""
    from onnx import AttributeProto as A

    pairs = [(n, a) for n, a in _node_attrs(m) if a.type in (A.INT, A.INTS)]
    n, a = _pick(rng, pairs)
    if a.type == A.INT:
        a.i = int(rng.choice([-9, -1, 0, 2, 7, 1 << 40]))
    else:
        vals = _pick(rng, [[], [0], [0, 0], [-1, 5], [7, 7, 7, 7], list(a.ints) + [1], [1 << 33] * len(a.ints)])
        del a.ints[:]
        a.ints.extend(vals)
    return m


def _unknown_attr(m, rng):
    from onnx import helper

    n = _pick(rng, m.graph.node)
    n.attribute.append(helper.make_attribute("bogus_" + str(int(rng.integers(100))), int(rng.integers(5))))
    return m


def _bad_utf8(m, rng):
    """A node's op_type spelled with bytes that are not UTF-8 (protobuf's Python API then hands out
    bytes, not str; a node name or value name so spelled is caught by byte flips)."""
    k = _pick(rng, range(len(m.graph.node)))
    marker = "Zq" * 4
    m.graph.node[k].op_type = marker
    if len(m.graph.node) > 1 and rng.random() < 0.5:  # and another unsupported op, spelled in UTF-8
        m.graph.node[(k + 1) % len(m.graph.node)].op_type = "Frobnicate"
    return m.SerializeToString().replace(marker.encode(), b"\xdaZ\xff\xfeZqZq")


def _tensor_attr_none(m, rng):
    """A Constant's TENSOR attribute with its tensor cleared."""
    for n in m.graph.node:
        for a in n.attribute:
            if a.type == a.TENSOR:
                a.ClearField("t")
                return m
    return None


def _unknown_op(m, rng):
    n = _pick(rng, m.graph.node)
    n.op_type = _pick(rng, ["Frobnicate", "conv", "Relu2", ""])
    return m


def _unknown_domain(m, rng):
    n = _pick(rng, m.graph.node)
    n.domain = "com.example.fuzz"
    return m


def _dangling_input(m, rng):
    n = _pick(rng, [n for n in m.graph.node if n.input])
    n.input[int(rng.integers(len(n.input)))] = "nowhere"
    return m


def _dup_output(m, rng):
    """The graph output listed twice, or two nodes writing the same value."""
    if rng.random() < 0.5 or len(m.graph.node) < 2:
        m.graph.output.append(m.graph.output[0])
    else:
        i = int(rng.integers(1, len(m.graph.node)))
        m.graph.node[i].output[0] = m.graph.node[i - 1].output[0]
    return m


def _rename_output(m, rng):
    m.graph.output[0].name = "not_computed"
    return m


def _drop_init(m, rng):
    del m.graph.initializer[_pick(rng, range(len(m.graph.initializer)))]
    return m


def _shuffle_nodes(m, rng):
    nodes = list(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend(reversed(nodes))
    return m


def _opset(version):
    def mutate(m, rng):
        m.opset_import[0].version = int(version(rng))
        return m
    return mutate


def _ir_version(version):
    def mutate(m, rng):
        m.ir_version = int(version(rng))
        return m
    return mutate


def _no_nodes(m, rng):
    del m.graph.node[:]
    return m


def _no_outputs(m, rng):
    del m.graph.output[:]
    return m


def _neg_dim(m, rng):
    """A negative dimension on an initializer or on the graph input."""
    if _inits(m) and rng.random() < 0.5:
        t = _pick(rng, _inits(m))
        t.dims[int(rng.integers(len(t.dims)))] = -int(rng.integers(1, 4))
    else:
        dims = m.graph.input[0].type.tensor_type.shape.dim
        dims[int(rng.integers(len(dims)))].dim_value = -int(rng.integers(1, 4))
    return m


def _input_dtype(m, rng):
    from onnx import TensorProto as T

    v = _pick(rng, m.graph.input)
    v.type.tensor_type.elem_type = int(_pick(rng, [T.DOUBLE, T.INT32, T.FLOAT16, T.BOOL, T.STRING, 0, 99]))
    return m


def _input_shape(m, rng):
    """The graph input's declared shape changed (a dim resized, made symbolic, or the rank changed)."""
    dims = m.graph.input[0].type.tensor_type.shape.dim
    choice = int(rng.integers(4))
    d = int(rng.integers(len(dims)))
    if choice == 0:
        dims[d].dim_value = int(rng.choice([0, 1, 2, 7]))
    elif choice == 1:
        dims[d].dim_param = "N"
    elif choice == 2:
        dims.add().dim_value = 1
    else:
        del dims[d]
    return m


def _big_kernel(m, rng):
    """A window (conv weight or pool kernel) larger than its padded input."""
    for n in m.graph.node:
        if n.op_type in ("Conv", "MaxPool", "AveragePool"):
            for a in n.attribute:
                if a.name == "kernel_shape":
                    del a.ints[:]
                    a.ints.extend([9, 9])
            if n.op_type == "Conv":
                w = next(t for t in m.graph.initializer if t.name == n.input[1])
                from onnx import numpy_helper
                shape = list(w.dims[:2]) + [9, 9]
                w.CopyFrom(numpy_helper.from_array(np.ones(shape, np.float32), w.name))
            return m
    return None


def _gather_oob(m, rng):
    """Gather's indices made a constant with an index outside the table (onnxruntime refuses at run time)."""
    from onnx import helper, numpy_helper

    gathers = [n for n in m.graph.node if n.op_type == "Gather"]
    if not gathers:
        return None
    n = gathers[0]
    bad = int(rng.choice([10, 50, -11, 1 << 40]))
    m.graph.initializer.append(numpy_helper.from_array(np.array([[0, bad, 1]], np.int64), "bad_ids"))
    n.input[1] = "bad_ids"
    del m.graph.input[:]
    m.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", 1, None))
    return m


STRUCTURED: dict[str, Callable] = {
    "init_dims": _init_dims, "init_reshape": _init_reshape, "raw_len": _raw_len, "init_values": _init_values,
    "attr_type": _attr_type, "attr_missing": _attr_missing, "attr_value": _attr_value,
    "unknown_attr": _unknown_attr, "bad_utf8": _bad_utf8, "tensor_attr_none": _tensor_attr_none, "unknown_op": _unknown_op,
    "unknown_domain": _unknown_domain, "dangling_input": _dangling_input, "dup_output": _dup_output,
    "rename_output": _rename_output, "drop_init": _drop_init, "shuffle_nodes": _shuffle_nodes,
    "opset_old": _opset(lambda rng: rng.integers(7, 17)), "opset_ancient": _opset(lambda rng: rng.integers(1, 7)),
    "opset_future": _opset(lambda rng: rng.choice([30, 999])),
    "ir_version_low": _ir_version(lambda rng: rng.integers(0, 3)), "ir_version_99": _ir_version(lambda rng: 99),
    "no_nodes": _no_nodes, "no_outputs": _no_outputs, "neg_dim": _neg_dim, "input_dtype": _input_dtype,
    "input_shape": _input_shape, "big_kernel": _big_kernel, "gather_oob": _gather_oob,
}
RANDOM = ("flip", "truncate")
# Kinds whose mutants break a MUST of the ONNX spec that onnxruntime does not enforce: a CuvilError is
# right for them even where onnxruntime runs the model.
SPEC_INVALID = {
    "neg_dim": "a dimension is >= 0 (onnxruntime takes a negative graph-input dim as unknown)",
    "ir_version_low": "IR versions 0-2 cannot have an opset_import (onnx.checker) and predate initializers "
                      "without a graph input",
    "unknown_attr": "an attribute is in its op's schema (onnxruntime lets LayerNormalization, a function op, "
                    "take any)",
    "init_dims": "an initializer's data fits its dims (onnxruntime drops an unused initializer unread)",
    "raw_len": "an initializer's data fits its dims (onnxruntime drops an unused initializer unread)",
}
KINDS = RANDOM + tuple(STRUCTURED) + ("empty_model",)


def mutant(model: str, kind: str, seed: int) -> bytes | None:
    """The bytes of mutant (model, kind, seed), or None when ``kind`` does not apply to ``model``."""
    rng = np.random.default_rng([seed, KINDS.index(kind), list(MODELS).index(model)])
    data = model_bytes(model)
    if kind == "flip":
        return _flip(data, rng)
    if kind == "truncate":
        return _truncate(data, rng)
    if kind == "empty_model":
        return b""
    m = _parse(data)
    try:
        m = STRUCTURED[kind](m, rng)
    except NotApplicable:
        return None
    return m if m is None or isinstance(m, bytes) else m.SerializeToString()


def applies(model: str, kind: str) -> bool:
    return mutant(model, kind, 0) is not None


# -- comparing outputs ------------------------------------------------------------------------------


def compare(ref: np.ndarray, got: np.ndarray, rtol: float = 1e-4, atol: float = 1e-5) -> str | None:
    """None when ``got`` matches onnxruntime's ``ref``: same shape and dtype, NaN where ref is NaN, the
    same infinities, and finite values within ``atol * scale + rtol * |ref|`` (``scale``: the largest
    finite |ref|, at least 1, since an error of a sum is relative to its terms, not its result);
    otherwise a line naming the first element that differs."""
    ref, got = np.asarray(ref), np.asarray(got)
    if ref.shape != got.shape or ref.dtype != got.dtype:
        return f"shape/dtype {got.shape} {got.dtype} != onnxruntime's {ref.shape} {ref.dtype}"
    if ref.dtype.kind != "f":
        bad = ref != got
    else:
        r, g = ref.astype(np.float64), got.astype(np.float64)
        finite = np.isfinite(r)
        scale = max(1.0, float(np.max(np.abs(r[finite]), initial=0.0)))
        with np.errstate(invalid="ignore"):
            close = np.abs(r - g) <= atol * scale + rtol * np.abs(r)
        bad = np.where(finite, ~(close & np.isfinite(g)), ~((r == g) | (np.isnan(r) & np.isnan(g))))
    if not bad.any():
        return None
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    return (f"{int(bad.sum())} of {bad.size} elements differ; first at {list(idx)}: cuvil {got[idx]!r}, "
            f"onnxruntime {ref[idx]!r}")


# -- judging one mutant (in the worker) --------------------------------------------------------------

_NP = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
       "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8, "tensor(uint8)": np.uint8,
       "tensor(bool)": np.bool_}
_MAX_ELEMENTS = 1 << 20


def _feeds(inputs, seed: int) -> dict[str, np.ndarray] | str:
    """Inputs for ``inputs`` (NodeArgs): symbolic dims are 2; integers in [0, 3) (rows of every table);
    a string when none can be made (a negative dim, a type without a numpy dtype, too many elements)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for v in inputs:
        shape = [d if isinstance(d, int) else 2 for d in (v.shape or [])]
        if any(d < 0 for d in shape) or v.type not in _NP or int(np.prod(shape)) > _MAX_ELEMENTS:
            return f"no input for {v.name!r} {v.type} {v.shape}"
        dt = np.dtype(_NP[v.type])
        if dt.kind == "f":
            feeds[v.name] = rng.standard_normal(shape).astype(dt)
        elif dt.kind == "b":
            feeds[v.name] = rng.random(shape) < 0.5
        else:
            feeds[v.name] = rng.integers(0, 3, size=shape).astype(dt)
    return feeds


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 400 else text[:400] + "..."


def judge(data: bytes, seed: int = 0, kind: str = "") -> dict:
    """The verdict on one mutant of ``kind``: {"ok": bool, "outcome": str, "detail": str}."""
    import traceback

    import onnxruntime as ort

    import cuvil.onnx
    from cuvil.errors import CuvilError, UnsupportedOpError

    def verdict(ok, outcome, detail=""):
        return {"ok": ok, "outcome": outcome, "detail": detail}

    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.log_severity_level = 4
    ref_sess = ref_out = ref_err = feeds = None
    try:
        ref_sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    except Exception as exc:
        ref_err = "onnxruntime refuses to load: " + _short(exc)
    if ref_sess is not None:
        feeds = _feeds(ref_sess.get_inputs(), seed)
        if not isinstance(feeds, str):
            try:
                ref_out = ref_sess.run(None, feeds)
            except Exception as exc:
                ref_err = "onnxruntime refuses to run: " + _short(exc)
    ran = "onnxruntime runs it" if ref_out is not None else ref_err or "onnxruntime loads it"
    # what onnxruntime refuses only for want of a kernel (opsets before 7) says nothing about validity
    unjudged = ref_err is not None and "NOT_IMPLEMENTED" in ref_err
    must_run = ref_out is not None and kind not in SPEC_INVALID
    try:
        sess = cuvil.onnx.InferenceSession(data, num_threads=1)
    except UnsupportedOpError as exc:
        return verdict(True, "unsupported", _short(exc))
    except CuvilError as exc:
        if must_run:
            return verdict(False, "cuvil refuses a model onnxruntime runs", _short(exc))
        return verdict(True, "cuvil refuses", f"{_short(exc)} ({ran})")
    except Exception as exc:
        return verdict(False, "cuvil raised a non-cuvil error while loading",
                       _short(exc) + "\n" + "".join(traceback.format_exc(limit=-4)))
    if feeds is None:
        feeds = _feeds(sess.get_inputs(), seed)
    if isinstance(feeds, str):
        if ref_err is not None and not unjudged:
            return verdict(False, "cuvil loads a model onnxruntime refuses", ref_err)
        return verdict(True, "loaded, not run", feeds)
    try:
        out = sess.run(None, feeds)
    except UnsupportedOpError as exc:
        return verdict(True, "unsupported", _short(exc))
    except CuvilError as exc:
        if must_run:
            return verdict(False, "cuvil refuses to run a model onnxruntime runs", _short(exc))
        return verdict(True, "cuvil refuses", f"{_short(exc)} ({ran})")
    except Exception as exc:
        return verdict(False, "cuvil raised a non-cuvil error while running",
                       _short(exc) + "\n" + "".join(traceback.format_exc(limit=-4)))
    if unjudged:
        return verdict(True, "onnxruntime has no kernel", ref_err)
    if ref_err is not None:
        return verdict(False, "cuvil runs a model onnxruntime refuses", ref_err)
    if len(out) != len(ref_out):
        return verdict(False, "wrong number of outputs", f"cuvil {len(out)}, onnxruntime {len(ref_out)}")
    for k, (r, g) in enumerate(zip(ref_out, out)):
        diff = compare(r, np.asarray(g))
        if diff:
            return verdict(False, "wrong result", f"output {k}: {diff}")
    return verdict(True, "match")


# -- the worker process and the pool that drives it ----------------------------------------------


def worker_main() -> None:
    """Answer one JSON line per request line ({"model", "kind", "seed"}) on the original stdout; whatever
    cuvil, LLVM or onnxruntime print goes to stderr."""
    import resource

    limit = 6 << 30  # a mutant that makes something allocate without bound fails instead of swapping
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    for line in sys.stdin:
        req = json.loads(line)
        data = mutant(req["model"], req["kind"], req["seed"])
        if data is None:
            v = {"ok": True, "outcome": "not applicable", "detail": ""}
        else:
            v = judge(data, req["seed"], req["kind"])
        out.write(json.dumps(v) + "\n")


class _Worker:
    def __init__(self, env: dict[str, str], log_dir: str, k: int):
        self.log = os.path.join(log_dir, f"worker{k}.log")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=open(self.log, "ab"), env=env)
        self.buf = b""
        self.job = None
        self.started = 0.0

    def send(self, job):
        self.job, self.started = job, time.monotonic()
        model, kind, seed = job
        self.proc.stdin.write((json.dumps({"model": model, "kind": kind, "seed": seed}) + "\n").encode())
        self.proc.stdin.flush()

    def stderr_tail(self, n: int = 1500) -> str:
        with open(self.log, "rb") as f:
            f.seek(max(0, os.path.getsize(self.log) - n))
            return f.read().decode(errors="replace")

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class WorkerPool:
    """Long-lived worker processes that judge mutants, ``size`` at a time; a worker that dies or runs
    past ``timeout`` seconds on a mutant is replaced and the mutant reported as failed."""

    def __init__(self, size: int, log_dir: str, timeout: float = 120.0, env: dict[str, str] | None = None):
        self.size, self.log_dir, self.timeout = size, log_dir, timeout
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("CUVIL_NUM_THREADS", "1")
        self.env["PYTHONPATH"] = os.pathsep.join(
            [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), self.env.get("PYTHONPATH", "")])
        self.workers: list[_Worker] = []
        self.spawned = 0

    def _spawn(self) -> _Worker:
        self.spawned += 1
        return _Worker(self.env, self.log_dir, self.spawned)

    def judge(self, jobs: Iterable[tuple[str, str, int]]) -> list[tuple[tuple[str, str, int], dict]]:
        """Each job (model, kind, seed) with its verdict, in the order they finish."""
        todo = list(jobs)[::-1]
        results = []
        while len(self.workers) < self.size:
            self.workers.append(self._spawn())
        busy = []
        while todo or busy:
            for w in self.workers:
                if w.job is None and todo:
                    w.send(todo.pop())
                    busy.append(w)
            ready, _, _ = select.select([w.proc.stdout for w in busy], [], [], 1.0)
            for w in list(busy):
                if w.proc.stdout in ready:
                    chunk = os.read(w.proc.stdout.fileno(), 1 << 16)
                    w.buf += chunk
                    if b"\n" in w.buf:
                        line, w.buf = w.buf.split(b"\n", 1)
                        results.append((w.job, json.loads(line)))
                        w.job = None
                        busy.remove(w)
                        continue
                    if chunk:
                        continue
                    w.proc.wait()
                    verdict = {"ok": False, "outcome": "the worker died",
                               "detail": f"exit status {w.proc.returncode}; its stderr ends:\n{w.stderr_tail()}"}
                elif time.monotonic() - w.started > self.timeout:
                    w.kill()
                    verdict = {"ok": False, "outcome": f"hang (over {self.timeout:.0f} s)", "detail": ""}
                else:
                    continue
                results.append((w.job, verdict))
                busy.remove(w)
                self.workers[self.workers.index(w)] = self._spawn()
        return results

    def close(self):
        for w in self.workers:
            w.proc.stdin.close()
            try:
                w.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                w.kill()
        self.workers = []


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker_main()
    elif sys.argv[1:2] == ["--one"]:
        name, kind, seed = sys.argv[2], sys.argv[3], int(sys.argv[4])
        data = mutant(name, kind, seed)
        print("not applicable" if data is None else json.dumps(judge(data, seed, kind), indent=1))
    elif sys.argv[1:2] == ["--save"]:
        with open(sys.argv[5], "wb") as f:
            f.write(mutant(sys.argv[2], sys.argv[3], int(sys.argv[4])) or b"")
    else:
        sys.exit("usage: fuzz_worker.py --worker | --one MODEL KIND SEED | --save MODEL KIND SEED PATH")
