"""Scatters in time linear in the updates (``te.scatter``; ONNX ScatterElements and ScatterND).

A scatter copies its data, then applies every update in order: ``out[index(u)] = old (op) new``.
Against onnxruntime on one-node models: every reduction, duplicate and negative indices, each axis,
index tuples of several lengths, a hypothesis draw of all of these, and an index out of range (a
BoundsError naming the node).  At the te level: the loop nest (a copy and one loop over the updates,
no loop over the output per update), and isl refusing what would race or reorder the updates.

Tolerances: none.  onnxruntime applies the updates one after another in row-major order, one rounding
each, and so does cuvil (a vectorised row runs different elements in its lanes, never two updates of
one element), so even ``add`` and ``mul`` over duplicate indices agree bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import toolchain
from hypothesis import given
from hypothesis import strategies as st

onnx = toolchain.module("onnx")
ort = toolchain.module("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402
from reference import budget  # noqa: E402

import cuvil  # noqa: E402
import cuvil.onnx as connx  # noqa: E402
from cuvil import te  # noqa: E402

REDUCTIONS = ("none", "add", "mul", "max", "min")


def _model(op: str, shp: tuple, ishp: tuple, ushp: tuple, **attrs: object) -> bytes:
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    node = helper.make_node(op, ["x", "i", "u"], ["y"], name=f"{op.lower()}_node", **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", f, list(shp)),
                                        helper.make_tensor_value_info("i", i64, list(ishp)),
                                        helper.make_tensor_value_info("u", f, list(ushp))],
                          [helper.make_tensor_value_info("y", f, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def _check(model: bytes, feeds: dict[str, np.ndarray]) -> None:
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = connx.InferenceSession(model).run(None, feeds)[0]
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def _feeds(rng: np.random.Generator, shp: tuple, ids: np.ndarray, ushp: tuple) -> dict[str, np.ndarray]:
    # updates near 1 keep a product of duplicates finite; data of both signs exercises max and min
    return {"x": rng.standard_normal(shp).astype(np.float32), "i": ids.astype(np.int64),
            "u": np.asarray(rng.uniform(0.5, 1.5, ushp) * rng.choice([-1, 1], ushp), np.float32)}


def _elements(shp: tuple, ishp: tuple, axis: int, reduction: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = shp[axis]
    ids = rng.integers(-n, n, ishp)  # negative indices count from the end; duplicates are likely
    _check(_model("ScatterElements", shp, ishp, ishp, axis=axis, reduction=reduction),
           _feeds(rng, shp, ids, ishp))


def _nd(shp: tuple, ishp: tuple, reduction: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    k = ishp[-1]
    ids = np.stack([rng.integers(-shp[c], shp[c], ishp[:-1]) for c in range(k)], axis=-1)
    ushp = ishp[:-1] + shp[k:]
    _check(_model("ScatterND", shp, ishp, ushp, reduction=reduction), _feeds(rng, shp, ids, ushp))


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shp, ishp, axis", [
    ((6, 5), (9, 5), 0),        # index_add along rows: each update is a row of the output (vectorised)
    ((6, 5), (9, 3), 0),        # updates narrower than the data
    ((4, 7), (3, 10), 1),       # along the last axis: more updates than the axis is long
    ((4, 7), (3, 10), -1),
    ((3, 4, 5), (2, 6, 5), 1),  # the middle axis of three
    ((2, 3, 4), (2, 3, 8), 2),
])
def test_scatter_elements(shp: tuple, ishp: tuple, axis: int, reduction: str) -> None:
    _elements(shp, ishp, axis, reduction, seed=len(reduction) + axis)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shp, ishp", [
    ((8, 4), (12, 1)),          # rows of 4, duplicates certain (12 updates, 8 rows)
    ((5, 3, 4), (7, 2)),        # index pairs, slices of 4
    ((4, 5), (3, 3, 2)),        # single elements, indices of rank 3
    ((10,), (15, 1)),           # scalars
])
def test_scatter_nd(shp: tuple, ishp: tuple, reduction: str) -> None:
    _nd(shp, ishp, reduction, seed=len(reduction))


def test_duplicates_apply_in_order() -> None:
    """Every update lands on one element: ``none`` keeps the last, ``add`` sums in order (0.1 + 1e8 - 1e8:
    the order shows in float32), the others fold left to right."""
    x = np.zeros((1, 1), np.float32)
    ids = np.zeros((4, 1), np.int64)
    u = np.array([[0.1], [1e8], [-1e8], [3.0]], np.float32)
    for reduction in REDUCTIONS:
        m = _model("ScatterElements", (1, 1), (4, 1), (4, 1), axis=0, reduction=reduction)
        _check(m, {"x": x, "i": ids, "u": u})
    got = connx.InferenceSession(_model("ScatterElements", (1, 1), (4, 1), (4, 1), axis=0, reduction="none")).run(
        None, {"x": x, "i": ids, "u": u})[0]
    assert got[0, 0] == 3.0


@st.composite
def scatter_case(draw: st.DrawFn) -> tuple:
    reduction = draw(st.sampled_from(REDUCTIONS))
    shp = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    seed = draw(st.integers(0, 2**16))
    if draw(st.booleans()):
        axis = draw(st.integers(-len(shp), len(shp) - 1))
        ishp = tuple(draw(st.integers(1, 7)) if d == axis % len(shp) else draw(st.integers(1, n))
                     for d, n in enumerate(shp))
        return "ScatterElements", shp, ishp, axis, reduction, seed
    k = draw(st.integers(1, len(shp)))
    ishp = tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=2))) + (k,)
    return "ScatterND", shp, ishp, None, reduction, seed


@budget(0.5)
@given(scatter_case())
def test_scatter_drawn(case: tuple) -> None:
    op, shp, ishp, axis, reduction, seed = case
    if op == "ScatterElements":
        _elements(shp, ishp, axis, reduction, seed)
    else:
        _nd(shp, ishp, reduction, seed)


@pytest.mark.parametrize("op", ["ScatterElements", "ScatterND"])
def test_index_out_of_range_names_the_node(op: str) -> None:
    shp, ishp = (6, 4), ((3, 4) if op == "ScatterElements" else (3, 1))
    ushp = ishp if op == "ScatterElements" else (3, 4)
    sess = connx.InferenceSession(_model(op, shp, ishp, ushp, reduction="add"))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 6, ishp)
    ids.flat[2] = 6  # one past the end
    with pytest.raises(cuvil.BoundsError, match=f"{op} node '{op.lower()}_node': index 6 in input 1"):
        sess.run(None, _feeds(rng, shp, ids, ushp))
    ids.flat[2] = -7
    with pytest.raises(cuvil.BoundsError, match=f"{op} node '{op.lower()}_node': index -7 in input 1"):
        sess.run(None, _feeds(rng, shp, ids, ushp))


# -- te ---------------------------------------------------------------------------------------


def _index_add(n: int = 50, f: int = 16, e: int = 300) -> tuple:
    X = te.placeholder((n, f), name="X")
    idx = te.placeholder((e,), "int64", "idx")
    U = te.placeholder((e, f), name="U")
    out = te.scatter(X, (e, f), lambda u, r: (idx[u], r), lambda u, r: U[u, r], lambda a, b: a + b, name="out")
    return X, idx, U, out


def _run(f, X, idx, U, seed: int = 0):
    rng = np.random.default_rng(seed)
    n, w = (int(d.value) for d in X.shape)
    e = int(idx.shape[0].value)
    x = rng.standard_normal((n, w)).astype(np.float32)
    i = rng.integers(0, n, e)
    u = rng.standard_normal((e, w)).astype(np.float32)
    out = np.empty_like(x)
    f(x, i, u, out)
    ref = x.copy()
    np.add.at(ref, i, u)  # numpy applies the updates in order, as the scatter does
    np.testing.assert_array_equal(out, ref)


def test_te_scatter_is_a_copy_and_one_pass_over_the_updates() -> None:
    X, idx, U, out = _index_add()
    s = te.create_schedule(out)
    text = str(cuvil.lower(s, [X, idx, U, out]))
    assert "out[i0, i1] = X[i0, i1]" in text
    assert "out[checked(idx[u], 50 #1), r] = out[checked(idx[u], 50 #2), r] + U[u, r]" in text
    assert text.count("for (") == 4  # (i0, i1) then (u, r): no loop over the output per update
    _run(cuvil.build(s, [X, idx, U, out]), X, idx, U)


def test_te_scatter_auto_schedule() -> None:
    X, idx, U, out = _index_add()
    s = cuvil.auto_schedule([X, idx, U, out])
    kinds = {st.op: st.args for st in s.trace if st.op in ("vectorize", "parallel")}
    assert "vectorize" in kinds and not s.fallbacks
    assert all(a not in ("u", "u.outer") for st in s.trace if st.op == "parallel" for a in st.args)
    _run(cuvil.build(s, [X, idx, U, out]), X, idx, U)


def test_te_scatter_rows_may_run_in_parallel_not_updates() -> None:
    X, idx, U, out = _index_add()
    s = te.create_schedule(out)
    i0, i1, u, r = s[out].op.axis + s[out].op.update_axis
    with pytest.raises(cuvil.ScheduleError, match="loop u of out cannot be parallel"):
        s[out].parallel(u)
    s[out].reorder(i0, i1, r, u)  # each row of the output on its own: legal, and parallel
    s[out].parallel(r)
    _run(cuvil.build(s, [X, idx, U, out]), X, idx, U)


def test_te_scatter_store_keeps_the_last_update() -> None:
    X = te.placeholder((5,), name="X")
    idx = te.placeholder((8,), "int64", "idx")
    U = te.placeholder((8,), name="U")
    out = te.scatter(X, (8,), lambda u: (idx[u],), lambda u: U[u], name="out")
    s = te.create_schedule(out)
    with pytest.raises(cuvil.ScheduleError, match="cannot be parallel"):  # the order decides who wins
        s[out].parallel(s[out].op.update_axis[0])
    with pytest.raises(cuvil.ScheduleError, match="scatter"):
        s[out].fuse(s[out].op.axis[0], s[out].op.update_axis[0])
        cuvil.lower(s, [X, idx, U, out])
    f = cuvil.build(te.create_schedule(out), [X, idx, U, out])
    x, i, u, y = np.zeros(5, np.float32), np.array([1, 3, 1, 1, 0, 3, 4, 1]), np.arange(8, dtype=np.float32), \
        np.empty(5, np.float32)
    f(x, i, u, y)
    np.testing.assert_array_equal(y, [4, 7, 0, 5, 6])


def test_te_scatter_errors() -> None:
    X = te.placeholder((5,), name="X")
    idx = te.placeholder((8,), "int64", "idx")
    U = te.placeholder((8,), "int32", "U")
    with pytest.raises(cuvil.DTypeError, match="updates are int32 but data is float32"):
        te.scatter(X, (8,), lambda u: (idx[u],), lambda u: U[u])
    with pytest.raises(cuvil.ShapeError, match="1 indices for data of rank 2"):
        te.scatter(te.placeholder((5, 2)), (8,), lambda u: idx[u], lambda u: U[u])
    out = te.scatter(X, (8,), lambda u: (idx[u],), lambda u: te.cast(U[u], "float32"), name="out")
    r = te.compute((5,), lambda i: out[i] * 2, name="r")
    with pytest.raises(cuvil.ScheduleError, match="is a scatter"):
        te.create_schedule(r)[out].compute_inline()
