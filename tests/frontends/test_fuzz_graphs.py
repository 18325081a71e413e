"""Differential fuzzing: random small ONNX graphs give onnxruntime's answers, NaN positions included.

hypothesis draws graphs of up to 6 nodes over ~45 op types (element-wise unary and binary ops with
numpy broadcasting, comparisons and logic, Where, Cast, Clip, reductions, Softmax, MatMul, Transpose,
Reshape, Concat, Unsqueeze, pooling), tiny shapes with zero-size dimensions now and then, and input
values drawn from classes: ordinary numbers, signed zeros, denormals, huge magnitudes (near float32's
limit), NaN, infinities, and a mix of all.  Each graph runs in cuvil and in onnxruntime (graph
optimisations off, so it computes node by node) on the same inputs.

Outputs are compared with :func:`fuzz_worker.compare` (NaN where onnxruntime has NaN, the same
infinities, finite values within 1e-4 relative).  When they differ, the graph is localised: cuvil
runs it again with every node's output exposed, and each node is checked alone against onnxruntime
on cuvil's own inputs to it, with that op's own tolerance (exact ops exactly, transcendental ops to a
few ULP, sums to the forward error bound ``(n + 1) * eps * sum|terms|``).  A node that differs is a
failure naming the op, its attributes, the element, its inputs and both results, unless the
difference is one of :data:`DOCUMENTED` (the semantics cuvil documents where onnxruntime's differ);
``test_documented_difference`` pins each of those to exactly the results listed, so the list
changes when the behaviour does.  A graph whose every node matches alone but whose output differs
(rounding amplified by a later node, e.g. ``log(a - b)`` with ``a ~ b``) passes; one where the fused
graph differs from the unfused one beyond rounding does not.

Budget: the hypothesis profile's examples times 15 (300 graphs under the default "ci" profile, the
issue's floor; about 20 s); ``CUVIL_FUZZ=full`` runs at least 500.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import cuvil.onnx  # noqa: E402
from cuvil.errors import CuvilError  # noqa: E402

FULL = os.environ.get("CUVIL_FUZZ") == "full"
EXAMPLES = max(500, settings.default.max_examples) if FULL else 15 * settings.default.max_examples
OPSET = 17
F32_EPS = 2.0 ** -23

# -- input values by class ---------------------------------------------------------------------------

CLASSES = ("ordinary", "zeros", "denormal", "huge", "nan", "inf", "mixed")


def _class_values(cls: str, rng: np.random.Generator, n: int) -> np.ndarray:
    sign = rng.choice([-1.0, 1.0], n)
    if cls == "ordinary":  # halves and integers too (Floor, Round, Ceil ties; exact Pow)
        v = np.where(rng.random(n) < 0.3, np.round(rng.uniform(-4, 4, n) * 2) / 2, rng.uniform(-4, 4, n))
    elif cls == "zeros":
        v = sign * 0.0
    elif cls == "denormal":
        v = sign * rng.uniform(1.4e-45, 1.17e-38, n)
    elif cls == "huge":
        v = sign * 10.0 ** rng.uniform(30, 38.5, n)
    elif cls == "nan":
        v = np.where(rng.random(n) < 0.5, np.nan, rng.uniform(-4, 4, n))
    elif cls == "inf":
        v = np.where(rng.random(n) < 0.5, sign * np.inf, rng.uniform(-4, 4, n))
    else:
        picks = rng.integers(0, len(CLASSES) - 1, n)
        v = np.array([_class_values(CLASSES[p], rng, 1)[0] for p in picks]) if n else np.zeros(0)
    return np.asarray(v, np.float64).astype(np.float32)


def input_values(cls: str, shape: tuple[int, ...], dtype: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape, dtype=np.int64))
    if dtype == "bool":
        return (rng.random(n) < 0.5).reshape(shape)
    if dtype == "int32":
        return rng.integers(-5, 6, n).astype(np.int32).reshape(shape)
    return _class_values(cls, rng, n).reshape(shape)


# -- the graphs ----------------------------------------------------------------------------------------

_ONNX_TYPE = {"float32": TensorProto.FLOAT, "bool": TensorProto.BOOL, "int32": TensorProto.INT32,
              "float64": TensorProto.DOUBLE, "int64": TensorProto.INT64}

FLOAT_UNARY = ("Abs", "Neg", "Exp", "Log", "Sqrt", "Relu", "Sigmoid", "Tanh", "Erf", "Floor", "Ceil",
               "Reciprocal", "Sign", "Sin", "Cos", "Round", "Softplus", "LeakyRelu", "Elu", "HardSigmoid")
FLOAT_BINARY = ("Add", "Sub", "Mul", "Div", "Max", "Min", "Pow")
INT_UNARY = ("Abs", "Neg", "Sign")
INT_BINARY = ("Add", "Sub", "Mul", "Max", "Min")
COMPARE = ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual")
LOGIC = ("And", "Or", "Xor")
FLOAT_TO_BOOL = ("IsNaN", "IsInf")
REDUCE = ("ReduceSum", "ReduceMax", "ReduceMin", "ReduceMean")
OTHER = ("Not", "Where", "Cast", "Clip", "Softmax", "LogSoftmax", "MatMul", "Transpose", "Reshape", "Concat",
         "Unsqueeze", "MaxPool", "AveragePool")
_KINDS = [("float_unary", FLOAT_UNARY), ("float_binary", FLOAT_BINARY), ("compare", COMPARE), ("logic", LOGIC),
          ("float_to_bool", FLOAT_TO_BOOL), ("reduce", REDUCE), ("not", ("Not",)), ("where", ("Where",)),
          ("cast", ("Cast",)), ("clip", ("Clip",)), ("softmax", ("Softmax", "LogSoftmax")), ("matmul", ("MatMul",)),
          ("transpose", ("Transpose",)), ("reshape", ("Reshape",)), ("concat", ("Concat",)),
          ("unsqueeze", ("Unsqueeze",)), ("pool", ("MaxPool", "AveragePool"))]
OP_TYPES = sorted(set(FLOAT_UNARY + FLOAT_BINARY + INT_UNARY + INT_BINARY + COMPARE + LOGIC + FLOAT_TO_BOOL
                      + REDUCE + OTHER))


@dataclass
class Value:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass
class Input:
    value: Value
    cls: str
    seed: int


@dataclass
class GraphCase:
    inputs: list[Input] = field(default_factory=list)
    nodes: list[Any] = field(default_factory=list)  # onnx NodeProtos
    inits: dict[str, np.ndarray] = field(default_factory=dict)
    values: list[Value] = field(default_factory=list)
    consumed: set[str] = field(default_factory=set)

    def sinks(self) -> list[Value]:
        produced = [o for n in self.nodes for o in n.output]
        return [v for v in self.values if v.name in produced and v.name not in self.consumed]

    def model(self, outputs: list[Value] | None = None) -> Any:
        outs = outputs if outputs is not None else self.sinks()
        g = helper.make_graph(
            self.nodes, "fuzz",
            [helper.make_tensor_value_info(i.value.name, _ONNX_TYPE[i.value.dtype], list(i.value.shape))
             for i in self.inputs],
            [helper.make_tensor_value_info(v.name, _ONNX_TYPE[v.dtype], list(v.shape)) for v in outs],
            [numpy_helper.from_array(a, k) for k, a in self.inits.items()])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8)

    def feeds(self) -> dict[str, np.ndarray]:
        return {i.value.name: input_values(i.cls, i.value.shape, i.value.dtype, i.seed) for i in self.inputs}

    def describe(self) -> str:
        lines = [f"input {i.value.name}: {i.value.dtype}{list(i.value.shape)} class {i.cls} seed {i.seed}"
                 for i in self.inputs]
        lines += [f"init {k} = {a.tolist()}" for k, a in self.inits.items()]
        lines += [f"{n.op_type}({', '.join(n.input)}) -> {n.output[0]} "
                  f"{ {a.name: helper.get_attribute_value(a) for a in n.attribute} }" for n in self.nodes]
        return "\n".join(lines)


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    try:
        return tuple(np.broadcast_shapes(a, b))
    except ValueError:
        return None


@st.composite
def graph_cases(draw) -> GraphCase:
    g = GraphCase()
    counter = iter(range(1000))
    zero = draw(st.integers(0, 3)) == 0  # one graph in four has a zero-size dimension somewhere
    base = draw(st.lists(st.integers(1, 4), min_size=0, max_size=4))
    if zero and base:
        base[draw(st.integers(0, len(base) - 1))] = 0

    def new_input(shape, dtype="float32") -> Value:
        v = Value(f"in{next(counter)}", tuple(shape), dtype)
        g.inputs.append(Input(v, draw(st.sampled_from(CLASSES)), draw(st.integers(0, 2 ** 16))))
        g.values.append(v)
        return v

    def variant(shape) -> tuple[int, ...]:
        """A shape that broadcasts with ``shape``: a suffix of it, some dims set to 1."""
        shape = list(shape[draw(st.integers(0, len(shape))):]) if shape else []
        return tuple(1 if draw(st.integers(0, 3)) == 0 else d for d in shape)

    def const(arr, dtype) -> str:
        name = f"c{next(counter)}"
        g.inits[name] = np.asarray(arr, dtype)
        return name

    def out(shape, dtype) -> Value:
        v = Value(f"v{next(counter)}", tuple(shape), dtype)
        g.values.append(v)
        return v

    def pick(pred=lambda v: True) -> Value | None:
        cands = [v for v in g.values if pred(v)]
        return draw(st.sampled_from(cands)) if cands else None

    def partner(a: Value, dtype: str) -> Value:
        """A value of ``dtype`` that broadcasts with ``a``, or a new input of a variant of a's shape."""
        b = pick(lambda v: v.dtype == dtype and _broadcast(v.shape, a.shape) is not None)
        if b is None or draw(st.integers(0, 2)) == 0:
            b = new_input(variant(a.shape), dtype)
        return b

    def node(op, inputs, shape, dtype, **attrs) -> Value:
        v = out(shape, dtype)
        g.nodes.append(helper.make_node(op, inputs, [v.name], **attrs))
        g.consumed.update(i for i in inputs if i)
        return v

    new_input(base)
    for _ in range(draw(st.sampled_from([4, 5, 6, 3, 2, 1]))):
        if len(g.nodes) >= 6:
            break
        has = {v.dtype for v in g.values}
        ops = [o for o in OP_TYPES if (o not in LOGIC + ("Not",) or "bool" in has)]
        op = draw(st.sampled_from(ops))
        if op in INT_UNARY + INT_BINARY and "int32" in has and draw(st.booleans()):
            kind = "int_unary" if op in INT_UNARY else "int_binary"
        else:
            kind = next(k for k, group in _KINDS if op in group)
        a = draw(st.sampled_from([v for v in g.values if v.dtype == "float32"]))
        if kind == "float_unary":
            node(op, [a.name], a.shape, "float32")
        elif kind == "float_binary":
            b = partner(a, "float32")
            x, y = (a, b) if draw(st.booleans()) else (b, a)
            node(op, [x.name, y.name], _broadcast(x.shape, y.shape), "float32")
        elif kind in ("int_unary", "int_binary"):
            a = pick(lambda v: v.dtype == "int32")
            if kind == "int_unary":
                node(op, [a.name], a.shape, "int32")
            else:
                b = partner(a, "int32")
                node(op, [a.name, b.name], _broadcast(a.shape, b.shape), "int32")
        elif kind == "compare":
            b = partner(a, "float32")
            node(op, [a.name, b.name], _broadcast(a.shape, b.shape), "bool")
        elif kind == "logic":
            a = pick(lambda v: v.dtype == "bool")
            b = partner(a, "bool")
            node(op, [a.name, b.name], _broadcast(a.shape, b.shape), "bool")
        elif kind == "not":
            a = pick(lambda v: v.dtype == "bool")
            node("Not", [a.name], a.shape, "bool")
        elif kind == "float_to_bool":
            node(op, [a.name], a.shape, "bool")
        elif kind == "where":
            c = partner(a, "bool")
            b = partner(a, "float32")
            shape = _broadcast(_broadcast(c.shape, a.shape), b.shape)
            if shape is None:
                b = a
                shape = _broadcast(c.shape, a.shape)
            node("Where", [c.name, a.name, b.name], shape, "float32")
        elif kind == "reduce":
            rank = len(a.shape)
            axes = sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1))) if rank else []
            keep = draw(st.sampled_from([0, 1]))
            if rank and draw(st.booleans()):
                axes = [ax - rank if draw(st.booleans()) else ax for ax in axes]  # negative axes
            norm = {ax % rank for ax in axes} if rank and axes else set(range(rank))
            shape = tuple(1 if i in norm else d for i, d in enumerate(a.shape) if keep or i not in norm)
            if op == "ReduceSum":
                node(op, [a.name, const(axes, np.int64)] if axes else [a.name], shape, "float32", keepdims=keep)
            elif axes:
                node(op, [a.name], shape, "float32", keepdims=keep, axes=axes)
            else:
                node(op, [a.name], shape, "float32", keepdims=keep)
        elif kind == "softmax":
            if not a.shape:
                a = node("Unsqueeze", [a.name, const([0], np.int64)], (1,), "float32")
            axis = draw(st.integers(-len(a.shape), len(a.shape) - 1))
            node(op, [a.name], a.shape, "float32", axis=axis)
        elif kind == "matmul":
            if not a.shape:
                a = node("Unsqueeze", [a.name, const([0], np.int64)], (1,), "float32")
            k, n = a.shape[-1], draw(st.integers(1, 3))
            b = new_input((k, n) if len(a.shape) > 1 or draw(st.booleans()) else (k,))
            shape = a.shape[:-1] + b.shape[1:]
            x, y = (a, b)
            node("MatMul", [x.name, y.name], shape, "float32")
        elif kind == "transpose":
            perm = draw(st.permutations(range(len(a.shape))))
            attrs = {"perm": list(perm)} if perm else {}
            node("Transpose", [a.name], tuple(a.shape[p] for p in perm), "float32", **attrs)
        elif kind == "reshape":
            size = int(np.prod(a.shape, dtype=np.int64))
            target = draw(st.sampled_from([[size], [1, size], [size, 1]] + ([list(reversed(a.shape))]
                                                                          if size else [])))
            if size and len(target) > 1 and draw(st.booleans()):
                target[draw(st.integers(0, len(target) - 1))] = -1
            known = int(np.prod([t for t in target if t != -1], dtype=np.int64))
            shape = tuple(size // known if t == -1 else t for t in target)
            # a 0 in the target copies the input's dim unless allowzero (needed for zero-size tensors)
            node("Reshape", [a.name, const(target, np.int64)], shape, "float32", **({} if size else {"allowzero": 1}))
        elif kind == "concat":
            if not a.shape:
                a = node("Unsqueeze", [a.name, const([0], np.int64)], (1,), "float32")
            axis = draw(st.integers(0, len(a.shape) - 1))
            b = pick(lambda v, a=a, axis=axis: v.dtype == "float32" and len(v.shape) == len(a.shape)
                     and all(x == y for i, (x, y) in enumerate(zip(v.shape, a.shape)) if i != axis))
            if b is None or draw(st.booleans()):
                shape = list(a.shape)
                shape[axis] = draw(st.integers(0, 3))
                b = new_input(shape)
            shape = list(a.shape)
            shape[axis] += b.shape[axis]
            node("Concat", [a.name, b.name], shape, "float32", axis=axis)
        elif kind == "unsqueeze":
            ax = draw(st.integers(-len(a.shape) - 1, len(a.shape)))
            shape = list(a.shape)
            shape.insert(ax % (len(a.shape) + 1), 1)
            node("Unsqueeze", [a.name, const([ax], np.int64)], shape, "float32")
        elif kind == "clip":
            lo, hi = sorted(draw(st.lists(st.sampled_from([-2.0, -0.5, 0.0, 1.0, 3.0]), min_size=2, max_size=2)))
            which = draw(st.sampled_from(["both", "min", "max"]))
            ins = [a.name, const(lo, np.float32) if which != "max" else "", const(hi, np.float32)
                   if which != "min" else ""]
            node("Clip", ins[:2] if which == "min" else ins, a.shape, "float32")
        elif kind == "cast":
            to = draw(st.sampled_from(["bool", "int32", "float64"]))
            v = node("Cast", [a.name], a.shape, to, to=_ONNX_TYPE[to])
            if to == "float64":  # back to float32, so the rest of the graph can use it
                node("Cast", [v.name], a.shape, "float32", to=TensorProto.FLOAT)
        elif kind == "pool":
            # onnxruntime refuses to pool a zero-size tensor
            a = pick(lambda v: v.dtype == "float32" and len(v.shape) == 3 and v.shape[2] >= 2 and 0 not in v.shape)
            if a is None:
                a = new_input((draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(2, 4))))
            length = a.shape[2] - 1
            node(op, [a.name], (a.shape[0], a.shape[1], length), "float32", kernel_shape=[2], strides=[1])
    return g


# -- running and comparing ---------------------------------------------------------------------------


def run_ort(model: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def run_cuvil(model: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return [np.asarray(r) for r in cuvil.onnx.InferenceSession(model.SerializeToString(), num_threads=1)
            .run(None, feeds)]


def compare(ref: np.ndarray, got: np.ndarray) -> str | None:
    from fuzz_worker import compare as _compare

    return _compare(ref, got)


_TRANSCENDENTAL = {"Exp", "Log", "Sigmoid", "Tanh", "Erf", "Sin", "Cos", "Softplus", "Elu", "Softmax",
                   "LogSoftmax", "Pow", "HardSigmoid"}
_SUMS = {"ReduceSum", "ReduceMean", "MatMul", "AveragePool"}


def node_mismatches(op: str, attrs: dict, ins: list[np.ndarray], ref: np.ndarray, got: np.ndarray
                    ) -> np.ndarray | None:
    """Boolean mask of the elements where cuvil's ``got`` of one node differs from onnxruntime's ``ref``
    on the same inputs ``ins`` by more than ``op`` allows: exact ops must agree exactly (the sign of a
    zero included), transcendental ones to ~100 float32 ULP, sums to their forward error bound; None
    when the shapes or dtypes differ."""
    if ref.shape != got.shape or ref.dtype != got.dtype:
        return None
    if ref.dtype.kind != "f":
        return ref != got
    r, g = ref.astype(np.float64), got.astype(np.float64)
    both_nan = np.isnan(r) & np.isnan(g)
    same = (r == g) & (np.signbit(r) == np.signbit(g)) | both_nan
    if op not in _TRANSCENDENTAL | _SUMS:
        return ~same
    with np.errstate(all="ignore"):
        tol = 1e-5 * np.abs(r) + 1e-37
        if op == "Pow":  # pow(x, y) = exp(y log x): the error grows with |y log x|
            x, y = np.broadcast_arrays(*(a.astype(np.float64) for a in ins))
            tol *= 1 + np.nan_to_num(np.abs(y * np.log(np.abs(x))), posinf=1e30).reshape(r.shape)
        if op in ("Softmax", "LogSoftmax"):
            tol += 1e-6
        if op in _SUMS:
            mag, n = _sum_magnitude(op, attrs, ins, r.shape)
            tol += (n + 2) * F32_EPS * mag
        close = np.abs(r - g) <= tol
    return ~(same | (np.isfinite(r) & np.isfinite(g) & close))


def _sum_magnitude(op, attrs, ins, shape=None) -> tuple[np.ndarray, int]:
    """sum|terms| in float64 for each element of a sum-like node's result (in ``shape``, if given), and
    the number of terms."""
    x = np.abs(ins[0].astype(np.float64))
    if op == "MatMul":
        s, n = np.matmul(x, np.abs(ins[1].astype(np.float64))), x.shape[-1]
    elif op == "AveragePool":
        s, n = np.maximum(x[..., :-1], x[..., 1:]), 2
    else:
        axes = ins[1].tolist() if len(ins) > 1 else attrs.get("axes")
        axes = tuple(range(x.ndim)) if not axes else tuple(a % x.ndim for a in axes)
        s = np.sum(x, axis=axes, keepdims=bool(attrs.get("keepdims", 1)))
        n = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
        s = s / max(n, 1) if op == "ReduceMean" else s
    return np.asarray(s).reshape(shape if shape is not None else np.shape(s)), n


# -- the differences cuvil documents -------------------------------------------------------------------


@dataclass(frozen=True)
class Difference:
    """A documented semantic difference: ``op`` on ``inputs`` (the class of input it takes) gives
    ``ort`` in onnxruntime and ``cuvil`` in cuvil; ``example`` reproduces it (op, attrs, inputs)."""

    op: str
    inputs: str
    ort: str
    cuvil: str
    why: str
    example: tuple
    explains: Any  # (op, attrs, ins, ref_element, got_element, index) -> bool


FLT_MAX = float(np.finfo(np.float32).max)


def _sum_overflows(op, attrs, ins, ref, got, index) -> bool:
    """The element's terms in float64 sum to more than float32 holds (a product or a partial sum
    overflows, or not, by the order and contraction the kernel uses)."""
    mag, _ = _sum_magnitude(op, attrs, ins)
    return bool(mag[index] > FLT_MAX)


def _empty_mean(op, attrs, ins, ref, got, index) -> bool:
    return _sum_magnitude(op, attrs, ins)[1] == 0


def _maxpool_nan(op, attrs, ins, ref, got, index) -> bool:
    n, c, pos = index  # the generator's MaxPool: 1-d, kernel 2, stride 1
    return bool(np.isnan(ins[0][n, c, pos:pos + 2]).any() and np.isnan(got) and not np.isnan(ref))


def _maxpool_neg_inf(op, attrs, ins, ref, got, index) -> bool:
    n, c, pos = index
    return bool(np.all(ins[0][n, c, pos:pos + 2] == -np.inf) and got == -np.inf and ref == -FLT_MAX)


def _reduce_nan(op, attrs, ins, ref, got, index) -> bool:
    x = ins[0]
    axes = ins[1].tolist() if len(ins) > 1 else attrs.get("axes")
    axes = tuple(range(x.ndim)) if not axes else tuple(a % x.ndim for a in axes)
    has_nan = np.any(np.isnan(x), axis=axes, keepdims=bool(attrs.get("keepdims", 1)))
    return bool(has_nan[index] and np.isnan(got) and not np.isnan(ref))


def _one_ulp(op, attrs, ins, ref, got, index) -> bool:
    r = np.float32(ref)
    return bool(np.isfinite(r) and np.isfinite(got) and abs(float(got) - float(r)) <= float(np.spacing(abs(r))))


def _denormal_divisor(op, attrs, ins, ref, got, index) -> bool:
    y = np.broadcast_to(np.asarray(ins[1], np.float32), np.shape(ref) if np.ndim(ref) else ())
    y = y[index] if y.ndim else y
    return bool(y != 0 and abs(float(y)) < float(np.finfo(np.float32).tiny) and np.isinf(got)
                and np.isfinite(ref))


def _where_neg_zero(op, attrs, ins, ref, got, index) -> bool:
    return bool(got == 0 and ref == 0 and np.signbit(got) and not np.signbit(ref))


def _zero_sign_order(op, attrs, ins, ref, got, index) -> bool:
    x = np.asarray(ins[0], np.float32)
    both = bool(((x == 0) & np.signbit(x)).any() and ((x == 0) & ~np.signbit(x)).any())
    return bool(got == 0 and ref == 0 and np.signbit(got) != np.signbit(ref) and both)


def _clip_absent_bound(op, attrs, ins, ref, got, index) -> bool:
    x = np.broadcast_to(ins[0], np.shape(ins[0]))[index] if np.ndim(ins[0]) else ins[0]
    return bool(np.isinf(x) and np.isinf(got) and abs(float(ref)) == FLT_MAX and np.sign(ref) == np.sign(got))


DOCUMENTED: list[Difference] = [
    Difference("Div", "a loop-invariant divisor", repr([[-0.4240959584712982] * 16]),
               repr([[-0.4240959882736206] * 16]),
               "docs/auto.md: a vector division by a loop-invariant divisor is a multiplication by its hoisted "
               "reciprocal (arcp; within 1 ulp)",
               ("Div", {}, ([[1.4843359] * 16], -3.5)),  # a vector loop: 16 lanes
               _one_ulp),
    Difference("Div", "a loop-invariant denormal divisor", repr([[9.999998032339912e+35] * 16]),
               repr([[float("inf")] * 16]),
               "found by this campaign (issue 17): the hoisted reciprocal of a divisor below float32's smallest "
               "normal (1.18e-38) overflows to inf, so x / y is inf where it is finite (docs/auto.md)",
               ("Div", {}, ([[1e-3] * 16], 1e-39)),
               _denormal_divisor),
    Difference("MatMul", "huge", "[[nan, nan]]", "[[-inf, -inf]]",
               "float32 overflow order: cuvil contracts a*b+acc into an FMA, which does not round the product "
               "to infinity; onnxruntime's -inf + inf is NaN",
               ("MatMul", {}, ([[-5.127070e36, -1.0455236e38, 2.6546775e34]],
                               [[4.1107095e36, 4.97e31], [2.5435983e38, -3.56e33], [2.9193452e33, -8.36e33]])),
               _sum_overflows),
    Difference("MaxPool", "NaN in the window", "[[[1.0, 2.0]]]", "[[[nan, 2.0]]]",
               "te.max propagates NaN like np.maximum and torch.nn.MaxPool2d; onnxruntime's vectorised MaxPool "
               "is order-dependent (a NaN wins some windows and loses others, and a window can give less than "
               "its largest number), so there is no semantics of its to follow",
               ("MaxPool", {"kernel_shape": [2], "strides": [1]}, ([[[np.nan, 1.0, 2.0]]],)),
               _maxpool_nan),
    Difference("MaxPool", "a window of -inf", "[[[-3.4028234663852886e+38]]]", "[[[-inf]]]",
               "found by this campaign (issue 17): onnxruntime's MaxPool starts from float32's lowest, so a "
               "window of -inf gives -FLT_MAX; cuvil's max is -inf",
               ("MaxPool", {"kernel_shape": [2], "strides": [1]}, ([[[-np.inf, -np.inf]]],)),
               _maxpool_neg_inf),
    Difference("ReduceMax", "NaN, not first", "[2.0, nan]", "[nan, nan]",
               "found by this campaign (issue 17): onnxruntime's ReduceMax ignores a NaN unless it comes first "
               "in the reduced set (Eigen's running max); cuvil's max propagates NaN like np.max",
               ("ReduceMax", {"axes": [1], "keepdims": 0}, ([[1.0, np.nan, 2.0], [np.nan, 1.0, 2.0]],)),
               _reduce_nan),
    Difference("ReduceMin", "NaN, not first", "[1.0, nan]", "[nan, nan]",
               "as ReduceMax", ("ReduceMin", {"axes": [1], "keepdims": 0}, ([[1.0, 2.0, np.nan], [np.nan, 1.0, 2.0]],)),
               _reduce_nan),
    Difference("ReduceMin", "+0.0 and -0.0", "[-0.0, -0.0]", "[-0.0, 0.0]",
               "found by this campaign (2026-12-05): IEEE 754 leaves min(+0, -0) to the implementation; "
               "onnxruntime's and cuvil's vectorised reductions meet the zeros in different orders, so which "
               "zero a row of both gives differs (the value does not)",
               ("ReduceMin", {"axes": [1], "keepdims": 0},
                ([[-0.0, 0.0, -0.0, 1.0, -0.0, 1.0, -0.0, 1.0, 0.0, -0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0],
                  [0.0, -0.0, -0.0, -0.0, -0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, -0.0, -0.0, 0.0, 1.0, 1.0]],)),
               _zero_sign_order),
    Difference("ReduceMax", "+0.0 and -0.0", "[-0.0]", "[0.0]", "as ReduceMin",
               ("ReduceMax", {"axes": [1], "keepdims": 0},
                ([[-1.0, -1.0, -1.0, 0.0, -0.0, -1.0, -0.0, 0.0, -0.0, 0.0, 0.0, -1.0, -1.0, -1.0, -1.0, -1.0, 0.0]],)),
               _zero_sign_order),
    Difference("ReduceMean", "zero-size axis", "[0.0]", "[nan]",
               "the ONNX spec leaves a reduction over an empty set undefined; cuvil's mean is 0/0 = NaN "
               "(numpy's), onnxruntime's 0",
               ("ReduceMean", {"axes": [1], "keepdims": 0}, (np.zeros((1, 0)),)),
               _empty_mean),
    Difference("Where", "-0.0 selected", "[0.0, 5.0, 0.0]", "[-0.0, 5.0, -0.0]",
               "found by this campaign: onnxruntime's Where returns +0.0 where it selects a -0.0 (it adds the "
               "masked branches); cuvil selects, keeping the sign of zero as numpy's where does",
               ("Where", {}, ([True, False, True], [-0.0, -0.0, -0.0], [5.0, 5.0, 5.0])),
               _where_neg_zero),
    Difference("Clip", "inf, a bound absent", "[3.4028234663852886e+38, -3.4028234663852886e+38]", "[inf, -inf]",
               "found by this campaign (issue 17): onnxruntime takes an absent min/max as float32's lowest/max "
               "(the ONNX spec's numeric_limits default) and clamps +-inf to +-FLT_MAX; cuvil leaves the side "
               "unbounded",
               ("Clip", {}, ([np.inf, -np.inf],)),
               _clip_absent_bound),
]


def explained(op, attrs, ins, ref, got, index) -> Difference | None:
    for d in DOCUMENTED:
        if d.op == op and d.explains(op, attrs, ins, ref, got, index):
            return d
    return None


def single_node_model(op: str, attrs: dict, ins: list[np.ndarray], out_dtype: str) -> tuple[Any, dict]:
    names = [f"x{k}" for k in range(len(ins))]
    n = helper.make_node(op, names, ["y"], **attrs)
    g = helper.make_graph([n], "one", [helper.make_tensor_value_info(nm, _ONNX_TYPE[str(a.dtype)], list(a.shape))
                                       for nm, a in zip(names, ins)],
                         [helper.make_tensor_value_info("y", _ONNX_TYPE[out_dtype], None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8), dict(zip(names, ins))


def localise(case: GraphCase, feeds: dict[str, np.ndarray]) -> tuple[list[str], dict[str, np.ndarray]]:
    """Each node checked alone against onnxruntime on cuvil's own inputs to it: a line per unexplained
    difference (none when every node matches or is documented), and every value as cuvil computes it
    with all node outputs exposed (which fuses less)."""
    produced = [v for v in case.values if any(v.name in n.output for n in case.nodes)]
    env = dict(feeds)
    env.update(zip([v.name for v in produced], run_cuvil(case.model(produced), feeds)))
    env.update(case.inits)
    problems = []
    for n in case.nodes:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        ins = [env[i] for i in n.input if i]
        present = [k for k, i in enumerate(n.input) if i]
        one = helper.make_node(n.op_type, [f"x{k}" if i else "" for k, i in enumerate(n.input)], ["y"], **attrs)
        g = helper.make_graph([one], "one", [helper.make_tensor_value_info(f"x{k}", _ONNX_TYPE[str(env[n.input[k]]
                                             .dtype)], list(env[n.input[k]].shape)) for k in present],
                              [helper.make_tensor_value_info("y", _ONNX_TYPE[str(env[n.output[0]].dtype)], None)])
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8)
        [ref] = run_ort(model, {f"x{k}": env[n.input[k]] for k in present})
        got = env[n.output[0]]
        bad = node_mismatches(n.op_type, attrs, ins, ref, got)
        if bad is None:
            problems.append(f"{n.op_type} {attrs}: cuvil gives {got.dtype}{list(got.shape)}, onnxruntime "
                            f"{ref.dtype}{list(ref.shape)}")
            continue
        for idx in (tuple(int(i) for i in at) for at in np.argwhere(bad)):
            if explained(n.op_type, attrs, ins, ref[idx], got[idx], idx) is None:
                ins_at = [a[tuple(i if s > 1 else 0 for i, s in zip(idx[len(idx) - a.ndim:], a.shape))]
                          if a.ndim and a.shape == ref.shape else a for a in ins]
                problems.append(f"{n.op_type} {attrs} at {list(idx)}: inputs {[np.asarray(a).tolist() for a in ins_at]}"
                                f": cuvil {got[idx]!r}, onnxruntime {ref[idx]!r} "
                                f"({int(bad.sum())} of {bad.size} elements differ)")
                break
    return problems, env


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(graph_cases())
@pytest.mark.slow
def test_random_graph_matches_onnxruntime(case):
    note(case.describe())
    feeds = case.feeds()
    model = case.model()
    ref = run_ort(model, feeds)
    try:
        got = run_cuvil(model, feeds)
    except CuvilError as exc:
        raise AssertionError(f"cuvil refuses a graph onnxruntime runs: {type(exc).__name__}: {exc}") from None
    diffs = [d for r, g in zip(ref, got) if (d := compare(r, g))]
    if not diffs:
        return
    problems, env = localise(case, feeds)
    assert not problems, "nodes that differ from onnxruntime:\n" + "\n".join(problems)
    # every node matches alone: the output differs by rounding a later node amplified, unless fusing
    # the graph changed it; the less fused graph's outputs must then match the fused ones
    note(f"outputs differ by amplified rounding only: {diffs}")
    for v, a in zip(case.sinks(), got):
        assert compare(env[v.name], a) is None, f"{v.name}: fused and unfused cuvil differ: {compare(env[v.name], a)}"


@pytest.mark.parametrize("diff", DOCUMENTED, ids=lambda d: f"{d.op}-{d.inputs}")
def test_documented_difference(diff):
    """Each documented difference holds exactly as listed (when a fix changes it, the list changes)."""
    op, attrs, ins = diff.example
    ins = [np.asarray(a, bool if k == 0 and op == "Where" else np.float32) for k, a in enumerate(ins)]
    model, feeds = single_node_model(op, attrs, ins, "float32")
    [ref] = run_ort(model, feeds)
    [got] = run_cuvil(model, feeds)
    assert (repr(ref.tolist()), repr(got.tolist())) == (diff.ort, diff.cuvil)


def test_generator_covers_the_op_set():
    """The generator's op list is the one the module docstring promises (20+ op types)."""
    assert len(OP_TYPES) >= 40


def test_harness_catches_a_wrong_answer(monkeypatch):
    """A cuvil answer off by one element, or NaN where onnxruntime has a number, is caught and put on
    the node that computes it (the campaign would pass vacuously otherwise)."""
    case = GraphCase()
    x = Value("x", (2, 3), "float32")
    case.inputs.append(Input(x, "ordinary", 1))
    case.values.append(x)
    for name, op, src in (("a", "Exp", "x"), ("b", "Neg", "a")):
        case.nodes.append(helper.make_node(op, [src], [name]))
        case.values.append(Value(name, (2, 3), "float32"))
        case.consumed.add(src)
    feeds = case.feeds()
    honest = run_cuvil

    def corrupt(model, feeds):
        outs = honest(model, feeds)
        names = [o.name for o in model.graph.output]
        if "a" in names:
            outs[names.index("a")][1, 2] = np.nan  # Exp's output, which Neg reads
        return outs

    monkeypatch.setattr(sys.modules[__name__], "run_cuvil", corrupt)
    problems, _ = localise(case, feeds)
    assert problems[0].startswith("Exp {} at [1, 2]: inputs ["), problems
    assert "cuvil np.float32(nan)" in problems[0], problems
