"""The polyhedral model, dependences and lowering to loops (isl, no LLVM)."""

import textwrap

import pytest

import cuvil
from cuvil import te
from cuvil.schedule.deps import compute_dependences
from cuvil.schedule.model import build_model


def _matmul(M=64, N=32, K=16):
    A = te.placeholder((M, K), name="A")
    B = te.placeholder((K, N), name="B")
    k = te.reduce_axis((0, K), name="k")
    C = te.compute((M, N), lambda i, j: te.sum(A[i, k] * B[k, j], axis=k), name="C")
    return A, B, C


def _golden(text):
    return textwrap.dedent(text).strip()


def test_matmul_lowers_to_te_order():
    A, B, C = _matmul()
    f = cuvil.lower(te.create_schedule(C), [A, B, C])
    assert str(f) == _golden("""
        func main(A: float32[64, 16], B: float32[16, 32], C: float32[64, 32]) {
          for (i = 0; i < 64; i++) {
            for (j = 0; j < 32; j++) {
              C[i, j] = 0.0f;
              for (k = 0; k < 16; k++) {
                C[i, j] = C[i, j] + A[i, k] * B[k, j];
              }
            }
          }
        }
    """)


def test_symbolic_sizes_are_parameters():
    M, N = te.var("M"), te.var("N")
    A = te.placeholder((M, N), name="A")
    B = te.compute((M, N - 2), lambda i, j: A[i, j] + A[i, j + 2], name="B")
    f = cuvil.lower(te.create_schedule(B), [A, B])
    assert [v.name for v in f.size_vars] == ["M", "N"]
    text = str(f)
    assert "for (i = 0; i < M; i++)" in text
    assert "for (j = 0; j < N - 2; j++)" in text
    m = build_model(te.create_schedule(B))
    (s,) = m.statements
    assert str(s.domain) == "[M, N] -> { S1_B[i, j] : 0 <= i < M and 0 <= j <= -3 + N }"


def test_reduction_statements_and_accesses():
    A, B, C = _matmul(8, 8, 8)
    m = build_model(te.create_schedule(C))
    init, upd = m.statements
    assert (init.kind, upd.kind) == ("init", "update")
    assert init.iter_names == ("i", "j") and upd.iter_names == ("i", "j", "k")
    assert "S2_C_init[i, j] -> C[o0 = i, o1 = j]" in str(init.writes)
    reads = str(upd.reads)
    assert "-> A[o0 = i, o1 = k]" in reads and "-> B[o0 = k, o1 = j]" in reads and "-> C[o0 = i, o1 = j]" in reads


def test_quasi_affine_and_data_dependent_accesses():
    X = te.placeholder((16,), name="X")
    idx = te.placeholder((4,), dtype="int32", name="idx")
    W = te.placeholder((10, 3), name="W")
    Y = te.compute((8,), lambda i: X[i // 2] + X[i % 4 + 8], name="Y")
    E = te.compute((4, 3), lambda t, d: W[idx[t], d], name="E")
    m = build_model(te.create_schedule([Y, E]))
    sy, se = m.statements
    ry = str(sy.reads)
    assert "mod 4" in ry or "o0" in ry  # exact quasi-affine relation
    # reading X[i // 2] touches X[0..3] for i in 0..7: exactly 4 elements
    import islpy as isl

    rng = sy.reads.range()
    xs = []
    rng.foreach_set(xs.append)
    x_elems = [s for s in xs if s.get_tuple_name() == "X"][0]
    assert x_elems.is_equal(isl.Set("{ X[o] : 0 <= o <= 3 or 8 <= o <= 11 }"))
    # a gather reads the whole first dimension of W, and exactly column d
    assert "W[o0, o1 = d] : 0 <= t <= 3 and 0 <= d <= 2 and 0 <= o0 <= 9" in str(se.reads)


def test_dependences_of_a_reduction_chain():
    A, B, C = _matmul(4, 4, 4)
    D = te.compute((4, 4), lambda i, j: C[i, j] * 2, name="D")
    m = build_model(te.create_schedule(D))
    deps = compute_dependences(m)
    flow = str(deps.flow)
    assert "S2_C_init[i, j] -> S2_C_update[i' = i, j' = j, k = 0]" in flow
    assert "S2_C_update[i, j, k] -> S2_C_update[i' = i, j' = j, k' = 1 + k]" in flow
    assert "S2_C_update[i, j, k = 3] -> S3_D[i' = i, j' = j]" in flow
    assert "output" in str(deps) and not deps.output.is_empty()


def test_multi_stage_allocates_intermediates_and_keeps_stage_order():
    X = te.placeholder((12,), name="X")
    P = te.compute((14,), lambda i: te.if_then_else(te.all(i >= 1, i < 13), X[i - 1], 0.0), name="P")
    Y = te.compute((12,), lambda i: P[i] + P[i + 1] + P[i + 2], name="Y")
    f = cuvil.lower(te.create_schedule(Y), [X, Y])
    assert str(f) == _golden("""
        func main(X: float32[12], Y: float32[12]) {
          global float32 P[14];
          for (i = 0; i < 14; i++) {
            P[i] = select(i >= 1 & i < 13, X[i - 1], 0.0f);
          }
          for (i_1 = 0; i_1 < 12; i_1++) {
            Y[i_1] = P[i_1] + P[i_1 + 1] + P[i_1 + 2];
          }
        }
    """)


def test_several_outputs():
    A = te.placeholder((4,), name="A")
    B = te.compute((4,), lambda i: A[i] + 1, name="B")
    C = te.compute((4,), lambda i: B[i] * 2, name="C")
    f = cuvil.lower(te.create_schedule([B, C]), [A, B, C])
    assert [b.name for b in f.outputs] == ["B", "C"]
    assert "global" not in str(f)


def test_reduction_with_offset_axis_and_where():
    A = te.placeholder((10,), name="A")
    k = te.reduce_axis((2, 7), name="k")
    S = te.compute((1,), lambda i: te.sum(A[k], axis=k, where=A[k] > 0), name="S")
    text = str(cuvil.lower(te.create_schedule(S), [A, S]))
    assert "for (k = 0; k < 5; k++)" in text  # loops count from 0
    assert "if (A[k + 2] > 0.0f)" in text


@pytest.mark.parametrize("case", ["missing_input", "no_output", "duplicate", "bad_type", "unbound_size", "foreign"])
def test_argument_errors(case):
    A, B, C = _matmul(4, 4, 4)
    s = te.create_schedule(C)
    if case == "missing_input":
        with pytest.raises(cuvil.CuvilError, match="placeholder B is read by C but is not in the arguments"):
            cuvil.lower(s, [A, C])
    elif case == "no_output":
        with pytest.raises(cuvil.CuvilError, match="none of the arguments is a computed tensor"):
            cuvil.lower(s, [A, B])
    elif case == "duplicate":
        with pytest.raises(cuvil.CuvilError, match="appears twice"):
            cuvil.lower(s, [A, B, C, A])
    elif case == "bad_type":
        with pytest.raises(cuvil.CuvilError, match="argument 1 is a int"):
            cuvil.lower(s, [A, 3, C])
    elif case == "unbound_size":
        n = te.var("n")
        X = te.placeholder((n * 2,), name="X")
        Y = te.compute((n * 2,), lambda i: X[i] + 1, name="Y")
        with pytest.raises(cuvil.ShapeError, match="size n cannot be found"):
            cuvil.lower(te.create_schedule(Y), [X, Y])
        assert "for (i = 0; i < n * 2; i++)" in str(cuvil.lower(te.create_schedule(Y), [X, Y, n]))
    elif case == "foreign":
        D = te.compute((4,), lambda i: A[i, 0], name="D")
        with pytest.raises(cuvil.CuvilError, match="not part of this schedule"):
            cuvil.lower(s, [A, B, C, D])


def test_schedule_lookup_errors():
    A, B, C = _matmul(4, 4, 4)
    s = te.create_schedule(C)
    assert s[C].op is C.op and s[C.op] is s[C]
    other = te.compute((4,), lambda i: A[i, 0], name="other")
    with pytest.raises(cuvil.ScheduleError, match="not part of this schedule"):
        s[other]
    with pytest.raises(cuvil.ScheduleError, match="placeholder"):
        te.create_schedule(A)


@pytest.mark.slow
def test_isl_operation_bound_gives_a_clear_error(monkeypatch):
    import cuvil.schedule.model as model

    A, B, C = _matmul(8, 8, 8)
    monkeypatch.setattr(model, "MAX_ISL_OPERATIONS", 50)
    with pytest.raises(cuvil.CuvilError, match="isl gave up after 50 operations"):
        cuvil.lower(te.create_schedule(C), [A, B, C])
    monkeypatch.undo()
    # the bound is per lowering: many lowerings in one process keep working
    for _ in range(300):
        cuvil.lower(te.create_schedule(C), [A, B, C])


def test_local_buffer_of_a_stage_computed_inside_an_attached_stage_is_indexed_from_zero():
    """A.local is computed at a loop of C.local, which is computed at a loop of C: its batch
    dimension equals C's, which isl's AST has no iterator for; the buffer is still indexed from 0."""
    import numpy as np

    A = te.placeholder((3, 4, 5), name="A")
    B = te.placeholder((3, 5, 6), name="B")
    k = te.reduce_axis((0, 5), "k")
    C = te.compute((3, 4, 6), lambda b, i, j: te.sum(A[b, i, k] * B[b, k, j], axis=k), name="C")
    s = te.create_schedule(C)
    CL = s.cache_write(C, "local")
    AL = s.cache_read(A, "local", [CL])
    s[CL].compute_at(s[C], s[C].op.axis[2])
    s[AL].compute_at(s[CL], s[CL].op.reduce_axis[0])
    text = str(cuvil.lower(s, [A, B, C]))
    assert "A.local[0, 0, 0] = A[b, i, k];" in text
    m = cuvil.build(s, [A, B, C])
    a, b = np.random.rand(3, 4, 5).astype(np.float32), np.random.rand(3, 5, 6).astype(np.float32)
    c = np.zeros((3, 4, 6), np.float32)
    m(a, b, c)
    np.testing.assert_allclose(c, a @ b, rtol=1e-5)


def test_axis_and_size_names_that_isl_maps_use_internally():
    # te names o0/o1 (access maps), t0 (time dimensions) and u0 (legality) must not be taken for
    # the maps' own dimensions: a conv over axes o0, o1 and a size t0, auto-scheduled, gives numpy's result
    import numpy as np

    t0 = te.var("t0")
    X = te.placeholder((1, 1, t0, 5), name="X")
    W = te.placeholder((1, 1, 3, 3), name="W")
    ry = te.reduce_axis((0, 3), name="u0")
    rx = te.reduce_axis((0, 3), name="rx")
    Y = te.compute((1, 1, t0 - 2, 3), lambda n, m, o0, o1: te.sum(X[n, 0, o0 + ry, o1 + rx] * W[m, 0, ry, rx],
                                                                    axis=[ry, rx]), name="conv")
    x = np.arange(30, dtype=np.float32).reshape(1, 1, 6, 5)
    w = np.ones((1, 1, 3, 3), np.float32)
    y = np.zeros((1, 1, 4, 3), np.float32)
    cuvil.build(cuvil.auto_schedule([X, W, Y]), [X, W, Y])(x, w, y)
    want = np.array([[x[0, 0, i:i + 3, j:j + 3].sum() for j in range(3)] for i in range(4)])
    np.testing.assert_array_equal(y[0, 0], want)
