"""te: expression building, dtype rules and user errors (no isl, no LLVM)."""

import pytest

import cuvil
from cuvil import te
from cuvil.ir import Binary, Cast, Const, Reduce, Select


def test_compute_names_axes_after_lambda_arguments():
    A = te.placeholder((3, 4), name="A")
    B = te.compute((3, 4), lambda row, col: A[row, col] + 1, name="B")
    assert [a.name for a in B.op.axis] == ["row", "col"]
    C = te.compute((3, 4), lambda *i: A[i] * 2, name="C")
    assert [a.name for a in C.op.axis] == ["i0", "i1"]
    assert B.op.input_tensors == [A]
    assert B.shape[0].value == 3 and B.dtype == "float32"


def test_python_scalar_takes_other_operand_dtype():
    A = te.placeholder((3,), dtype="float64", name="A")
    e = A[0] + 1
    assert isinstance(e.b, Const) and e.b.dtype == "float64" and e.dtype == "float64"
    Ix = te.placeholder((3,), dtype="int8", name="Ix")
    assert (Ix[0] * 3).dtype == "int8"
    with pytest.raises(cuvil.DTypeError, match="Python float"):
        Ix[0] * 0.5


def test_tensor_dtypes_never_mix():
    A = te.placeholder((3,), dtype="float32", name="A")
    B = te.placeholder((3,), dtype="float64", name="B")
    with pytest.raises(cuvil.DTypeError, match="float32.*float64.*te.cast"):
        A[0] + B[0]
    assert (A[0].astype("float64") + B[0]).dtype == "float64"
    assert (te.cast(B[0], "float32") + A[0]).dtype == "float32"


def test_index_expressions_widen_to_int64():
    idx = te.placeholder((3,), dtype="int32", name="idx")
    W = te.placeholder((10, 4), name="W")
    out = te.compute((3, 4), lambda t, d: W[idx[t], d], name="out")
    assert out.op.body.indices[0].dtype == "int32"
    i = te.var("i")
    e = i + idx[0]
    assert e.dtype == "int64" and isinstance(e.b, Cast)


def test_division_rules():
    A = te.placeholder((3,), name="A")
    Ix = te.placeholder((3,), dtype="int32", name="Ix")
    assert (A[0] / 2).dtype == "float32"
    with pytest.raises(cuvil.DTypeError, match="true division"):
        Ix[0] / 2
    assert isinstance(Ix[0] // 2, Binary) and (Ix[0] // 2).op == "floordiv"
    assert (Ix[0] % 3).op == "floormod"


def test_comparisons_build_expressions_and_bool_raises():
    A = te.placeholder((3,), name="A")
    c = A[0] == A[1]
    assert isinstance(c, Binary) and c.op == "eq" and c.dtype == "bool"
    with pytest.raises(cuvil.DTypeError, match="if_then_else"):
        bool(A[0] < 1)
    with pytest.raises(cuvil.DTypeError):
        if A[0] > 0:
            pass
    assert te.structural_equal(A[0] + 1, A[0] + 1)
    assert not te.structural_equal(A[0] + 1, A[1] + 1)


def test_max_min_two_forms():
    A = te.placeholder((4, 5), name="A")
    k = te.reduce_axis((0, 5), name="k")
    r = te.compute((4,), lambda i: te.max(A[i, k], axis=k), name="r")
    assert isinstance(r.op.body, Reduce) and r.op.body.name == "max"
    assert r.op.reduce_axis == (k,)
    k2 = te.reduce_axis((0, 5), name="k2")
    r2 = te.compute((4,), lambda i: te.min(A[i, k2], k2), name="r2")
    assert r2.op.body.name == "min"
    e = te.compute((4, 5), lambda i, j: te.max(A[i, j], 0.0), name="relu")
    assert isinstance(e.op.body, Binary) and e.op.body.op == "max"


def test_comm_reducer_and_multi_axis():
    A = te.placeholder((4, 5, 6), name="A")
    prod = te.comm_reducer(lambda x, y: x * y, lambda t: 1, name="prod")
    j = te.reduce_axis((0, 5), name="j")
    k = te.reduce_axis((0, 6), name="k")
    P = te.compute((4,), lambda i: prod(A[i, j, k], axis=[j, k]), name="P")
    body = P.op.body
    assert body.name == "prod" and body.axis == (j, k) and body.identity.value == 1.0


def test_math_function_dtypes():
    A = te.placeholder((3,), name="A")
    Ix = te.placeholder((3,), dtype="int32", name="Ix")
    for f in (te.exp, te.log, te.sqrt, te.rsqrt, te.tanh, te.sigmoid, te.erf, te.floor, te.ceil, te.round):
        assert f(A[0]).dtype == "float32"
    assert te.isnan(A[0]).dtype == "bool"
    with pytest.raises(cuvil.DTypeError, match="float operand"):
        te.exp(Ix[0])
    assert te.abs(Ix[0]).dtype == "int32" and isinstance(te.abs(Ix[0]), Select)
    assert te.floor(Ix[0]) is not None
    assert (A[0] ** 2).dtype == "float32"
    cube = Ix[0] ** 3
    assert cube.dtype == "int32" and isinstance(cube, Binary)


def test_logic_helpers():
    A = te.placeholder((3,), name="A")
    c = te.all(A[0] > 0, A[1] > 0, A[2] > 0)
    assert c.dtype == "bool" and c.op == "and"
    d = te.any(A[0] > 0, ~(A[1] > 0))
    assert d.op == "or"
    with pytest.raises(cuvil.DTypeError, match="bool"):
        te.if_then_else(A[0], 1.0, 2.0)
    with pytest.raises(cuvil.DTypeError, match="needs bool or integer"):
        A[0] & A[1]


def test_const_defaults():
    assert te.const(1).dtype == "int32"
    assert te.const(1.5).dtype == "float32"
    assert te.const(True).dtype == "bool"
    assert te.const(300, "uint8").value == 44  # integers wrap like numpy
    with pytest.raises(cuvil.DTypeError):
        te.const(1.5, "int32")


@pytest.mark.parametrize(
    "make, error, pattern",
    [
        (lambda A: A[0], cuvil.ShapeError, "has 2 dimension"),
        (lambda A: A[0, 1, 2], cuvil.ShapeError, "has 2 dimension"),
        (lambda A: A[0.5, 1], cuvil.DTypeError, "not an integer"),
        (lambda A: A[0:2, 1], cuvil.ShapeError, "slices"),
    ],
)
def test_indexing_errors(make, error, pattern):
    A = te.placeholder((3, 4), name="A")
    with pytest.raises(error, match=pattern):
        make(A)


def test_compute_errors():
    A = te.placeholder((3, 4), name="A")
    k = te.reduce_axis((0, 4), name="k")
    with pytest.raises(cuvil.ShapeError, match="whole body"):
        te.compute((3,), lambda i: te.sum(A[i, k], axis=k) * 2, name="bad")
    with pytest.raises(cuvil.ShapeError, match="2 dimension.*takes 1"):
        te.compute((3, 4), lambda i: A[i, 0], name="bad")
    with pytest.raises(cuvil.ShapeError, match="not reduced over"):
        te.compute((3,), lambda i: A[i, k], name="bad")
    with pytest.raises(cuvil.ShapeError, match="not a reduction axis"):
        te.compute((3,), lambda i: te.sum(A[i, 0], axis=i), name="bad")
    with pytest.raises(cuvil.ShapeError, match="negative"):
        te.placeholder((3, -1), name="neg")
    with pytest.raises(cuvil.DTypeError, match="unsupported dtype|unknown dtype"):
        te.placeholder((3,), dtype="complex64", name="c")
    with pytest.raises(cuvil.DTypeError, match="index it"):
        te.compute((3, 4), lambda i, j: A, name="bad")
    B = te.compute((3, 4), lambda i, j: A[i, j], name="B")
    with pytest.raises(cuvil.ShapeError, match="axis of another compute"):
        te.compute((3, 4), lambda i, j: A[B.op.axis[0], j], name="bad")


def test_reduce_axis_range_and_printing():
    A = te.placeholder((10,), name="A")
    k = te.reduce_axis((2, 7), name="k")
    assert k.min.value == 2 and k.extent.value == 5
    S = te.compute((1,), lambda i: te.sum(A[k], axis=k), name="S")
    assert str(S.op.body) == "sum(A[k], axis=[k])"


def test_programs_survive_pickle():
    # worker processes (the autotuner) receive te programs by pickle
    import pickle

    import numpy as np

    import cuvil

    A = te.placeholder((4,), name="A")
    B = te.compute((4,), lambda i: A[i] * 2.0, name="B")
    A2, B2 = pickle.loads(pickle.dumps((A, B)))
    assert B2.op.input_tensors[0] is A2 and A2.shape[0].value == 4
    a, b = np.arange(4, dtype=np.float32), np.empty(4, np.float32)
    cuvil.build(te.create_schedule(B2), [A2, B2])(a, b)
    np.testing.assert_array_equal(b, a * 2)
