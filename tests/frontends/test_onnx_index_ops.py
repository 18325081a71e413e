"""The index and mask operators real models need (GatherElements, GatherND, ScatterND, ScatterElements,
Trilu, CumSum), on small hand-made models against onnxruntime, with hypothesis-generated shapes and
indices; their constant folding; their errors.

Tolerances: gathers, ``reduction="none"`` scatters and Trilu move values and must be bit-exact.  Sums
(scatter ``add``, CumSum) on floats may add in another order than onnxruntime: rtol 1e-5 on inputs
of magnitude ~1 bounds a few ulp of float32 over the short sums here (at most ~10 terms).
"""

from __future__ import annotations

import numpy as np
import pytest
import toolchain
from hypothesis import given
from hypothesis import strategies as st

onnx = toolchain.module("onnx")
ort = toolchain.module("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from reference import budget  # noqa: E402

import cuvil  # noqa: E402
import cuvil.onnx as connx  # noqa: E402

_TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int64): TensorProto.INT64,
          np.dtype(np.int32): TensorProto.INT32}


def _model(op: str, feeds: dict[str, np.ndarray], consts: dict[str, np.ndarray] | None = None,
           opset: int = 18, **attrs: object) -> onnx.ModelProto:
    """One ``op`` node over ``feeds`` (graph inputs) and ``consts`` (initializers), inputs in that order."""
    consts = consts or {}
    names = list(feeds) + list(consts)
    first = next(iter({**feeds, **consts}.values()))  # the output has the first input's dtype
    node = helper.make_node(op, names, ["y"], name=f"{op.lower()}_node", **attrs)
    g = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(n, _TYPES[a.dtype], list(a.shape)) for n, a in feeds.items()],
        [helper.make_tensor_value_info("y", _TYPES[first.dtype], None)],
        initializer=[numpy_helper.from_array(a, n) for n, a in consts.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _check(model: onnx.ModelProto, feeds: dict[str, np.ndarray], rtol: float = 0.0) -> None:
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = connx.InferenceSession(model.SerializeToString()).run(None, feeds)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
        if rtol:
            np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-6)
        else:
            np.testing.assert_array_equal(g, w)


shapes = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)


@st.composite
def gather_elements_case(draw: st.DrawFn) -> tuple:
    shp = draw(shapes)
    axis = draw(st.integers(-len(shp), len(shp) - 1))
    ishp = tuple(draw(st.integers(1, n)) if d != axis % len(shp) else draw(st.integers(1, 5))
                 for d, n in enumerate(shp))
    seed = draw(st.integers(0, 2**16))
    return shp, ishp, axis, seed


@budget(0.5)
@given(gather_elements_case(), st.booleans())
def test_gather_elements(case: tuple, const_indices: bool) -> None:
    shp, ishp, axis, seed = case
    rng = np.random.default_rng(seed)
    n = shp[axis]
    data = rng.standard_normal(shp).astype(np.float32)
    idx = {"idx": rng.integers(-n, n, ishp).astype(np.int64)}
    feeds = {"data": data} if const_indices else {"data": data, **idx}
    _check(_model("GatherElements", feeds, idx if const_indices else {}, axis=axis), feeds)


@st.composite
def gather_nd_case(draw: st.DrawFn) -> tuple:
    b = draw(st.integers(0, 1))
    batch = tuple(draw(st.lists(st.integers(1, 3), min_size=b, max_size=b)))
    rest = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    k = draw(st.integers(1, len(rest)))
    mid = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    return batch + tuple(rest), batch + mid + (k,), b, draw(st.integers(0, 2**16))


@budget(0.5)
@given(gather_nd_case())
def test_gather_nd(case: tuple) -> None:
    shp, ishp, b, seed = case
    rng = np.random.default_rng(seed)
    data = rng.standard_normal(shp).astype(np.float32)
    dims = np.asarray(shp[b:b + ishp[-1]])
    idx = (rng.integers(0, 2**20, ishp) % (2 * dims) - dims).astype(np.int64)  # in -n .. n-1 per component
    feeds = {"data": data, "idx": idx}
    _check(_model("GatherND", feeds, batch_dims=b), feeds)


@st.composite
def scatter_nd_case(draw: st.DrawFn) -> tuple:
    shp = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple))
    k = draw(st.integers(1, len(shp)))
    n_upd = draw(st.integers(1, 6))
    reduction = draw(st.sampled_from(["none", "add", "mul", "max", "min"]))
    return shp, k, n_upd, reduction, draw(st.booleans()), draw(st.integers(0, 2**16))


@budget(0.5)
@given(scatter_nd_case())
def test_scatter_nd(case: tuple) -> None:
    """Duplicate indices included (reduction "none": the last update wins, as onnxruntime writes them
    in order); indices fed at run time or known when compiling (a table of the update per position)."""
    shp, k, n_upd, reduction, const_indices, seed = case
    rng = np.random.default_rng(seed)
    data = rng.standard_normal(shp).astype(np.float32)
    dims = np.asarray(shp[:k])
    idx = (rng.integers(0, 2**20, (n_upd, k)) % (2 * dims) - dims).astype(np.int64)
    upd = rng.standard_normal((n_upd,) + shp[k:]).astype(np.float32)
    if const_indices:
        m = _model("ScatterND", {"data": data}, {"idx": idx, "upd": upd}, reduction=reduction)
        _check(m, {"data": data}, rtol=1e-5)
    else:
        feeds = {"data": data, "idx": idx, "upd": upd}
        _check(_model("ScatterND", feeds, reduction=reduction), feeds, rtol=1e-5)


@budget(0.5)
@given(gather_elements_case(), st.sampled_from(["none", "add", "mul", "max", "min"]))
def test_scatter_elements(case: tuple, reduction: str) -> None:
    """Indices smaller than data in the other dimensions too; duplicates as in test_scatter_nd."""
    shp, ishp, axis, seed = case
    rng = np.random.default_rng(seed)
    n = shp[axis]
    data = rng.standard_normal(shp).astype(np.float32)
    feeds = {"data": data, "idx": rng.integers(-n, n, ishp).astype(np.int32),
             "upd": rng.standard_normal(ishp).astype(np.float32)}
    _check(_model("ScatterElements", feeds, axis=axis, reduction=reduction), feeds, rtol=1e-5)


@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [-2, 0, 1, 7])
def test_trilu_causal_mask(upper: int, k: int) -> None:
    """As exporters write causal masks: a constant k, a (batch, heads, seq, seq) float input."""
    x = np.random.default_rng(k + 2).standard_normal((1, 2, 5, 6)).astype(np.float32)
    _check(_model("Trilu", {"x": x}, {"k": np.array(k, np.int64)}, upper=upper), {"x": x})


@pytest.mark.parametrize("dtype", [np.float32, np.int64])
@pytest.mark.parametrize("exclusive, reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumsum(dtype: type, exclusive: int, reverse: int) -> None:
    """As position ids are made (CumSum of an int64 mask along the sequence), and on floats."""
    rng = np.random.default_rng(exclusive + 2 * reverse)
    x = (rng.standard_normal((2, 7, 3)) * 4).astype(dtype)
    for axis in (1, -1, 0):
        _check(_model("CumSum", {"x": x}, {"axis": np.array(axis, np.int64)}, exclusive=exclusive,
                      reverse=reverse), {"x": x}, rtol=1e-5 if dtype == np.float32 else 0.0)


def test_constant_gather_folds_at_compile_time() -> None:
    """A GatherElements of two constants (and a ScatterND of constants) is computed when compiling: the
    compiled program runs one kernel, the Add."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((4, 5)).astype(np.float32)
    idx = rng.integers(-4, 4, (4, 5)).astype(np.int64)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    nodes = [helper.make_node("GatherElements", ["t", "i"], ["g"], axis=0),
             helper.make_node("ScatterND", ["g", "si", "su"], ["s"]),
             helper.make_node("Add", ["x", "s"], ["y"])]
    inits = [numpy_helper.from_array(table, "t"), numpy_helper.from_array(idx, "i"),
             numpy_helper.from_array(np.array([[1], [3]], np.int64), "si"),
             numpy_helper.from_array(np.ones((2, 5), np.float32), "su")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 5])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 5])], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    _check(m, {"x": x})
    s = connx.InferenceSession(m.SerializeToString())
    s.run(None, {"x": x})
    (prog,) = s.programs()
    assert prog.n_calls == 1


@pytest.mark.parametrize("op, feeds, attrs, text", [
    ("GatherElements", {"data": np.zeros((3, 4), np.float32), "i": np.array([[0, 4]], np.int64)}, {"axis": 1},
     "index 4 at [0, 1] of input 1 is out of range for a dimension of size 4"),
    ("GatherND", {"data": np.zeros((3, 4), np.float32), "i": np.array([[0, -5]], np.int64)}, {},
     "index -5 at [0, 1] of input 1 is out of range for a dimension of size 4"),
    ("GatherElements", {"data": np.zeros((3, 4), np.float32), "i": np.zeros((3,), np.int64)}, {},
     "indices of rank 1 for data of rank 2"),
    ("ScatterND", {"data": np.zeros((3, 4), np.float32), "i": np.zeros((2, 1), np.int64),
                   "u": np.zeros((2, 3), np.float32)}, {}, "updates [2, 3] must have shape [2, 4]"),
    ("ScatterElements", {"data": np.zeros((3, 4), np.float32), "i": np.zeros((3, 4), np.int64),
                         "u": np.zeros((3, 4), np.float32)}, {"reduction": "avg"}, "reduction 'avg' is not one of"),
    ("ScatterElements", {"data": np.zeros((3, 4), np.float32), "i": np.full((1, 4), 3, np.int64),
                         "u": np.zeros((1, 4), np.float32)}, {}, "index 3 at [0, 0] of input 1 is out of range"),
])
def test_bad_input_names_the_node(op: str, feeds: dict, attrs: dict, text: str) -> None:
    """Indices known when compiling are checked; bad shapes, attributes and dtypes name the node."""
    data = {"data": feeds["data"]}
    m = _model(op, data, {k: v for k, v in feeds.items() if k != "data"}, **attrs)
    with pytest.raises(cuvil.CuvilError) as e:
        connx.InferenceSession(m.SerializeToString()).run(None, data)
    assert f"{op.lower()}_node" in str(e.value) and text in str(e.value), str(e.value)


@pytest.mark.parametrize("equation, shapes", [
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("bhqd,bhkd->bhqk", [(1, 2, 3, 4), (1, 2, 5, 4)]),  # attention scores, as T5/Whisper exports write them
    ("...ii->...i", [(2, 3, 3)]),
    ("ij,j", [(3, 4), (4,)]),
    ("i,j->ij", [(3,), (4,)]),
])
def test_einsum(equation: str, shapes: list) -> None:
    """Einsum against onnxruntime; sums of at most 5 products of standard normal floats: rtol 1e-5."""
    rng = np.random.default_rng(len(equation))
    feeds = {f"x{k}": rng.standard_normal(s).astype(np.float32) for k, s in enumerate(shapes)}
    _check(_model("Einsum", feeds, opset=12, equation=equation), feeds, rtol=1e-5)


def test_einsum_of_constants_folds() -> None:
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal((4, 5)).astype(np.float32)
    x = rng.standard_normal((3, 5)).astype(np.float32)
    nodes = [helper.make_node("Einsum", ["a", "b"], ["e"], equation="ik,kj->ij"),
             helper.make_node("Add", ["x", "e"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])],
                          initializer=[numpy_helper.from_array(a, "a"), numpy_helper.from_array(b, "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 12)])
    _check(m, {"x": x}, rtol=1e-5)
    s = connx.InferenceSession(m.SerializeToString())
    s.run(None, {"x": x})
    (prog,) = s.programs()
    assert prog.n_calls == 1


@pytest.mark.parametrize("largest", [0, 1])
def test_top_k_ties_take_the_lower_index(largest: int) -> None:
    """Values from a small set, so that ties are common: values and indices as onnxruntime's."""
    x = np.random.default_rng(largest).integers(0, 4, (3, 9)).astype(np.float32)
    for axis, k in ((1, 4), (0, 2), (-1, 9)):
        m = _model("TopK", {"x": x}, {"k": np.array([k], np.int64)}, opset=11, axis=axis, largest=largest)
        m.graph.output.append(helper.make_tensor_value_info("i", TensorProto.INT64, None))
        m.graph.node[0].output.append("i")
        _check(m, {"x": x})
