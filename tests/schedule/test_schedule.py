"""Schedule primitives: the loops they produce (golden text), the requests isl refuses, traces,
and numeric checks of scheduled programs against numpy."""

import json
import textwrap

import numpy as np
import pytest

import cuvil
from cuvil import te
from cuvil.schedule.trace import replay, trace_from_json, trace_hash, trace_to_json
from cuvil.te import ops


def _mm(n=8, m=None):
    m = m or n
    A = te.placeholder((m, n), name="A")
    B = te.placeholder((n, n), name="B")
    k = te.reduce_axis((0, n), name="k")
    C = te.compute((m, n), lambda i, j: te.sum(A[i, k] * B[k, j], axis=k), name="C")
    return A, B, C


def _golden(text):
    return textwrap.dedent(text).strip()


def _run_mm(s, A, B, C, shape=(8, 8)):
    f = cuvil.build(s, [A, B, C])
    rng = np.random.default_rng(0)
    a = rng.standard_normal((shape[0], shape[1]), dtype=np.float32)
    b = rng.standard_normal((shape[1], shape[1]), dtype=np.float32)
    c = np.empty((shape[0], shape[1]), np.float32)
    f(a, b, c)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(c, ref, rtol=np.sqrt(shape[1]) * 1e-6, atol=1e-5)


# -- golden loop nests ----------------------------------------------------------------------


def test_split_with_a_tail():
    A, B, C = _mm(10)
    s = te.create_schedule(C)
    io, ii = s[C].split(s[C].op.axis[0], factor=4)
    assert (io.name, ii.name) == ("i.outer", "i.inner")
    text = str(cuvil.lower(s, [A, B, C]))
    assert "for (i.outer = 0; i.outer < 3; i.outer++)" in text
    assert "for (i.inner = 0; i.inner < min(4, i.outer * -4 + 10); i.inner++)" in text
    assert "C[i.outer * 4 + i.inner, j] = 0.0f;" in text
    _run_mm(s, A, B, C, (10, 10))


def test_split_nparts_and_fuse():
    A, B, C = _mm(8)
    s = te.create_schedule(C)
    i, j = s[C].op.axis
    io, ii = s[C].split(i, nparts=2)
    assert ii.extent.value == 4
    s2 = te.create_schedule(C)
    i2, j2 = s2[C].op.axis
    f = s2[C].fuse(i2, j2)
    assert f.name == "i.j.fused"
    assert str(cuvil.lower(s2, [A, B, C])) == _golden("""
        func main(A: float32[8, 8], B: float32[8, 8], C: float32[8, 8]) {
          for (i.j.fused = 0; i.j.fused < 64; i.j.fused++) {
            C[i.j.fused // 8, i.j.fused % 8] = 0.0f;
            for (k = 0; k < 8; k++) {
              C[i.j.fused // 8, i.j.fused % 8] = C[i.j.fused // 8, i.j.fused % 8] + A[i.j.fused // 8, k] * B[k, i.j.fused % 8];
            }
          }
        }
    """)
    _run_mm(s2, A, B, C)


def test_tile_reorder_vectorize_parallel():
    A, B, C = _mm(16)
    s = te.create_schedule(C)
    i, j = s[C].op.axis
    io, jo, ii, ji = s[C].tile(i, j, 4, 8)
    s[C].vectorize(ji)
    s[C].parallel(io)
    text = str(cuvil.lower(s, [A, B, C]))
    assert text.splitlines()[1] == "  parallel for (i.outer = 0; i.outer < 4; i.outer++) {"
    assert "vectorize for (j.inner = 0; j.inner < 8; j.inner++) {" in text
    assert [st.op for st in s.trace] == ["split", "split", "reorder", "vectorize", "parallel"]
    _run_mm(s, A, B, C, (16, 16))


def test_compute_at_stores_the_region_per_iteration():
    A = te.placeholder((12,), name="A")
    B = te.compute((11,), lambda i: A[i] * 2, name="B")
    C = te.compute((10,), lambda i: B[i] + B[i + 1], name="C")
    s = te.create_schedule(C)
    s[B].compute_at(s[C], s[C].op.axis[0])
    assert str(cuvil.lower(s, [A, C])) == _golden("""
        func main(A: float32[12], C: float32[10]) {
          for (i = 0; i < 10; i++) {
            local float32 B[2];
            for (i_1 = 0; i_1 < 2; i_1++) {
              B[i_1] = A[i + i_1] * 2.0f;
            }
            C[i] = B[0] + B[1];
          }
        }
    """)
    f = cuvil.build(s, [A, C])
    a = np.arange(12, dtype=np.float32)
    c = np.empty(10, np.float32)
    f(a, c)
    np.testing.assert_array_equal(c, a[:10] * 2 + a[1:11] * 2)


def test_compute_inline_and_root():
    A = te.placeholder((6,), name="A")
    B = te.compute((6,), lambda i: A[i] * 2, name="B")
    C = te.compute((6,), lambda i: B[i] + 1, name="C")
    s = te.create_schedule(C)
    s[B].compute_inline()
    assert str(cuvil.lower(s, [A, C])) == _golden("""
        func main(A: float32[6], C: float32[6]) {
          for (i = 0; i < 6; i++) {
            C[i] = A[i] * 2.0f + 1.0f;
          }
        }
    """)
    s[B].compute_root()
    assert "global float32 B[6];" in str(cuvil.lower(s, [A, C]))
    s[B].compute_inline()
    with pytest.raises(cuvil.ArgumentError, match="inlined"):
        cuvil.lower(s, [A, B, C])


def test_cache_write_register_tile():
    A, B, C = _mm(16)
    s = te.create_schedule(C)
    CC = s.cache_write(C, "local")
    assert CC.name == "C.local"
    i, j = s[C].op.axis
    io, jo, ii, ji = s[C].tile(i, j, 4, 8)
    s[CC].compute_at(s[C], jo)
    ci, cj = s[CC].op.axis
    (ck,) = s[CC].op.reduce_axis
    s[CC].reorder(ck, ci, cj)
    s[CC].unroll(ci)
    s[CC].vectorize(cj)
    text = str(cuvil.lower(s, [A, B, C]))
    assert "local float32 C.local[4, 8];" in text
    # unrolled: the rows of the register tile are constants
    assert "C.local[3, j_1] = C.local[3, j_1] + A[i.outer * 4 + 3, k] * B[k, j.outer * 8 + j_1];" in text
    _run_mm(s, A, B, C, (16, 16))


def test_cache_read_packing_layout():
    A, B, C = _mm(32)
    s = te.create_schedule(C)
    BP = s.cache_read(B, "global", [C], layout=lambda k, j: (j // 16, k, j % 16))
    assert [int(d.value) for d in BP.shape] == [2, 32, 16]
    text = str(cuvil.lower(s, [A, B, C]))
    assert "B.global[ax1 // 16, ax0, ax1 % 16] = B[ax0, ax1];" in text
    assert "B.global[j // 16, k, j % 16]" in text
    _run_mm(s, A, B, C, (32, 32))


def test_rfactor_vectorizes_a_reduction():
    X = te.placeholder((1000,), name="X")
    r = te.reduce_axis((0, 1000), name="r")
    S = te.compute((1,), lambda _: te.sum(X[r], axis=r), name="S")
    s = te.create_schedule(S)
    with pytest.raises(cuvil.ScheduleError, match="carries a flow dependence"):
        s[S].vectorize(s[S].split(r, factor=16)[1])
    s = te.create_schedule(S)
    ro, ri = s[S].split(r, factor=16)
    SF = s.rfactor(S, ri)
    assert SF.name == "S.rf" and SF.ndim == 2
    s[SF].vectorize(s[SF].op.axis[0])
    text = str(cuvil.lower(s, [X, S]))
    assert "vectorize for (r_inner_v = 0; r_inner_v < 16; r_inner_v++)" in text
    f = cuvil.build(s, [X, S])
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    out = np.empty(1, np.float32)
    f(x, out)
    np.testing.assert_allclose(out[0], x.astype(np.float64).sum(), rtol=np.sqrt(1000) * 1e-6, atol=1e-4)


def test_scan_recurrence():
    T, n = te.var("T"), 3
    X = te.placeholder((T, n), name="X")
    state = te.placeholder((T, n), name="state")
    init = te.compute((1, n), lambda _, i: X[0, i], name="init")
    upd = te.compute((T, n), lambda t, i: state[t - 1, i] + X[t, i], name="upd")
    cum = te.scan(init, upd, state, inputs=[X], name="cumsum")
    s = te.create_schedule(cum)
    with pytest.raises(cuvil.ScheduleError, match="loop t of cumsum cannot be parallel: it carries a flow"):
        s[cum].parallel(s[cum].op.axis[0])
    s[cum].parallel(s[cum].op.axis[1])
    f = cuvil.build(s, [X, cum])
    for steps in (1, 5):
        x = np.arange(steps * n, dtype=np.float32).reshape(steps, n)
        out = np.empty_like(x)
        f(x, out)
        np.testing.assert_array_equal(out, np.cumsum(x, axis=0))


# -- refused requests ----------------------------------------------------------------------------


def test_reordering_a_reduction_chain_is_refused_and_changes_nothing():
    X = te.placeholder((4, 3, 5), name="X")
    r1 = te.reduce_axis((0, 3), name="r1")
    r2 = te.reduce_axis((0, 5), name="r2")
    Z = te.compute((4,), lambda i: te.sum(X[i, r1, r2], axis=[r1, r2]), name="Z")
    s = te.create_schedule(Z)
    s[Z].split(s[Z].op.axis[0], factor=2)
    before = str(cuvil.lower(s, [X, Z]))
    trace = list(s.trace)
    # summing over r2 before r1 would reassociate the float sum: isl finds the broken chain
    pattern = r"(?s)would change the results.*\[S1_Z_update\[i, r1, r2\] ->.*rfactor"
    with pytest.raises(cuvil.ScheduleError, match=pattern):
        s[Z].reorder(r2, r1)
    assert str(cuvil.lower(s, [X, Z])) == before and s.trace == trace


@pytest.mark.parametrize("case, pattern", [
    ("zero_factor", "positive int"),
    ("both", "exactly one of"),
    ("other_stage", "belongs to stage"),
    ("stale_axis", "already split or fused"),
    ("fuse_not_adjacent", "must be adjacent"),
    ("vectorize_symbolic", "constant extent"),
    ("nested_parallel", "already parallel"),
    ("inline_reduction", "is a reduction and cannot be inlined"),
    ("compute_at_non_reader", "does not read"),
    ("vectorize_reduction", "carries a flow dependence"),
    ("parallel_reduction", "carries a flow dependence"),
    ("unknown_scope", "unknown scope"),
    ("cache_write_after_split", "before scheduling"),
    ("rfactor_data_axis", "not a reduction loop"),
])
def test_refused_requests(case, pattern):
    A, B, C = _mm(8)
    D = te.compute((8, 8), lambda i, j: C[i, j] * 2, name="D")
    s = te.create_schedule(D)
    i, j = s[C].op.axis
    (k,) = s[C].op.reduce_axis
    n = te.var("n")
    V = te.placeholder((n,), name="V")
    W = te.compute((n,), lambda x: V[x] + 1, name="W")
    sv = te.create_schedule(W)
    with pytest.raises(cuvil.ScheduleError, match=pattern):
        if case == "zero_factor":
            s[C].split(i, factor=0)
        elif case == "both":
            s[C].split(i, factor=2, nparts=2)
        elif case == "other_stage":
            s[D].split(i, factor=2)
        elif case == "stale_axis":
            s[C].split(i, factor=2)
            s[C].split(i, factor=2)
        elif case == "fuse_not_adjacent":
            s[C].fuse(i, k)
        elif case == "vectorize_symbolic":
            sv[W].vectorize(sv[W].op.axis[0])
        elif case == "nested_parallel":
            s[C].parallel(i)
            s[C].parallel(j)
        elif case == "inline_reduction":
            s[C].compute_inline()
        elif case == "compute_at_non_reader":
            s[D].compute_at(s[C], i)
        elif case == "vectorize_reduction":
            s[C].vectorize(k)
        elif case == "parallel_reduction":
            s[C].reorder(k, i)
            s[C].parallel(k)
        elif case == "unknown_scope":
            s.cache_write(C, "shared")
        elif case == "cache_write_after_split":
            s[C].split(i, factor=2)
            s.cache_write(C, "local")
        elif case == "rfactor_data_axis":
            s.rfactor(C, i)


def test_parallel_inside_parallel_across_stages_is_refused_at_lowering():
    A = te.placeholder((8, 8), name="A")
    B = te.compute((8, 8), lambda i, j: A[i, j] * 2, name="B")
    C = te.compute((8, 8), lambda i, j: B[i, j] + 1, name="C")
    s = te.create_schedule(C)
    s[B].compute_at(s[C], s[C].op.axis[0])
    s[C].parallel(s[C].op.axis[0])
    s[B].parallel(s[B].op.axis[1])
    with pytest.raises(cuvil.ScheduleError, match="inside the parallel loop"):
        cuvil.lower(s, [A, C])


# -- the schedule as data ------------------------------------------------------------------------


def _floor_schedule(n=64):
    A, B, C = _mm(n)
    s = te.create_schedule(C)
    CC = s.cache_write(C, "local")
    i, j = s[C].op.axis
    io, jo, ii, ji = s[C].tile(i, j, 4, 16)
    f = s[C].fuse(io, jo)
    s[C].parallel(f)
    s[C].vectorize(ji)
    s[CC].compute_at(s[C], f)
    ci, cj = s[CC].op.axis
    (ck,) = s[CC].op.reduce_axis
    s[CC].reorder(ck, ci, cj)
    s[CC].unroll(ci)
    s[CC].vectorize(cj)
    return s, (A, B, C)


def test_trace_round_trips_and_replays():
    s, (A, B, C) = _floor_schedule()
    text = trace_to_json(s.trace)
    data = json.loads(text)
    assert data[0] == {"args": ["local"], "op": "cache_write", "stage": "C"}
    assert trace_from_json(text) == tuple(s.trace)
    A2, B2, C2 = _mm(64)
    s2 = replay(te.create_schedule(C2), trace_from_json(text))
    assert str(cuvil.lower(s2, [A2, B2, C2])) == str(cuvil.lower(s, [A, B, C]))
    assert trace_hash(s.trace) == trace_hash(s2.trace)
    with pytest.raises(cuvil.ScheduleError, match="not a cuvil schedule trace"):
        trace_from_json("{not json")


def test_floor_schedule_runs_parallel_and_matches_numpy():
    s, (A, B, C) = _floor_schedule(64)
    for threads in (1, 2):
        cuvil.set_num_threads(threads)
        try:
            _run_mm(s, A, B, C, (64, 64))
        finally:
            cuvil.set_num_threads(None)


def test_dependences_are_printable():
    A, B, C = _mm(4)
    text = te.create_schedule(C).dependences()
    assert "flow" in text and "S2_C_update[i, j, k] -> S2_C_update[i' = i, j' = j, k' = 1 + k]" in text


def test_conv2d_with_inlined_padding_and_vectorized_output():
    X = te.placeholder((1, 3, 9, 9), name="X")
    W = te.placeholder((4, 3, 3, 3), name="W")
    Y = ops.conv2d_nchw(X, W, stride=1, padding=1)
    s = te.create_schedule(Y)
    pad = s.stages[[st.name for st in s.stages].index("conv_pad")]
    pad.compute_inline()
    n, f, y, x = s[Y].op.axis
    xo, xi = s[Y].split(x, factor=4)
    s[Y].vectorize(xi)
    m = cuvil.build(s, [X, W, Y])
    rng = np.random.default_rng(2)
    xv = rng.standard_normal((1, 3, 9, 9), dtype=np.float32)
    wv = rng.standard_normal((4, 3, 3, 3), dtype=np.float32)
    out = np.empty((1, 4, 9, 9), np.float32)
    m(xv, wv, out)
    xp = np.pad(xv.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    ref = np.zeros((1, 4, 9, 9))
    for dy in range(3):
        for dx in range(3):
            ref += np.einsum("fc,nchw->nfhw", wv[:, :, dy, dx], xp[:, :, dy:dy + 9, dx:dx + 9])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_deferred_checks_prove_the_result_once_and_undo_a_refusal():
    A, B, C = _mm(8)
    s = te.create_schedule(C)
    i, j = s[C].op.axis
    (k,) = s[C].op.reduce_axis
    before = str(cuvil.lower(s, [A, B, C]))
    with pytest.raises(cuvil.ScheduleError, match="carries a flow dependence"):
        with s.deferred_checks([s[C]]):
            s[C].split(i, factor=2)
            s[C].vectorize(k)  # accepted for now: checked when the block ends
    assert s.trace == [] and str(cuvil.lower(s, [A, B, C])) == before
    with s.deferred_checks([s[C]]):
        s[C].reorder(k, j)
        s[C].vectorize(j)
    _run_mm(s, A, B, C)


def test_parallel_loop_over_a_per_iteration_buffer():
    """B is recomputed in every iteration of C's parallel loop i, into a buffer of that iteration:
    the writes of B[k] in different iterations are to different buffers, so i carries nothing."""
    X = te.placeholder((32,), name="X")
    Y = te.placeholder((64, 32), name="Y")
    B = te.compute((32,), lambda k: X[k] * 2, name="B")
    k = te.reduce_axis((0, 32), "k")
    C = te.compute((64,), lambda i: te.sum(B[k] * Y[i, k], axis=k), name="C")
    s = te.create_schedule(C)
    s[B].compute_at(s[C], s[C].op.axis[0])
    s[C].parallel(s[C].op.axis[0])
    text = str(cuvil.lower(s, [X, Y, C]))
    assert "parallel for (i" in text and "local float32 B[32]" in text
    m = cuvil.build(s, [X, Y, C])
    x, y = np.random.rand(32).astype(np.float32), np.random.rand(64, 32).astype(np.float32)
    c = np.zeros(64, np.float32)
    m(x, y, c)
    np.testing.assert_allclose(c, y @ (2 * x), rtol=1e-5)


def test_time_maps_have_no_empty_slot_dimensions():
    """A time dimension that is no statement's loop and one constant everywhere orders nothing: it is
    left out (isl's AST and dataflow work on fewer dimensions); the root position (dimension 0) stays."""
    import islpy as isl

    from cuvil.schedule.model import build_model
    from cuvil.schedule.timemap import build_time_maps

    A, B, C = _mm(64)
    s = cuvil.auto_schedule([A, B, C])  # a register tile (init, update) computed at the tile loop
    tm = build_time_maps(build_model(s))
    assert len(tm.maps) == 3
    for d in range(1, tm.width):
        loops = any(dims[d] is not None for dims in tm.dim_leaf.values())
        values = [m.plain_get_val_if_fixed(isl.dim_type.out, d) for m in tm.maps.values()]
        fixed = {v.to_python() for v in values if v.is_int()}
        assert loops or len(fixed) > 1 or len(fixed) < len(values), f"time dimension {d} orders nothing"
    _run_mm(s, A, B, C, (64, 64))

