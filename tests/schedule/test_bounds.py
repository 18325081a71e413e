"""Bounds, proved or checked (issue 17): no access outside a tensor, ever.

- te programs: isl proves every quasi-affine access inside its tensor at build time; one that leaves it
  for every size is a ShapeError naming the tensor, the dimension, the statement and an iteration; one
  that leaves it for some sizes is checked once per call (a BoundsError naming the access and the sizes).
- indices read from data (te gathers, ONNX Gather, GatherElements, GatherND, ScatterND,
  ScatterElements) are checked where they are read: out of range is a BoundsError naming the node,
  the input and the index, in a session, in an exported library (status 4 and ``<prefix>_last_error()``
  from C) and in a loaded one; never a segfault, garbage, clamping or wrapping.  ONNX's negative
  indices (-n .. -1) stay legal.  ``bounds_checks=False`` leaves the run-time checks out.
- hypothesis draws in- and out-of-range indices for the ONNX index operators: cuvil raises exactly
  when onnxruntime does, and otherwise gives its outputs bit for bit.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
import toolchain
from hypothesis import given
from hypothesis import strategies as st

onnx = toolchain.module("onnx")
ort = toolchain.module("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402

import cuvil  # noqa: E402
import cuvil.onnx as connx  # noqa: E402
import cuvil.runtime  # noqa: E402
from cuvil import te  # noqa: E402

_BAD = (50, -11, 2**40)  # for a table of 10 rows: past the end, past the start, and far away


# -- te programs: proved at build time ----------------------------------------------------------------


def _one_read(index, n=10, m=10):
    A = te.placeholder((m,), "float32", "A")
    B = te.compute((n,), lambda i: index(A, i), name="B")
    return A, B


@pytest.mark.parametrize("offset", [1, 100000000])
def test_te_read_past_the_end_is_a_shape_error(offset):
    A, B = _one_read(lambda A, i: A[i + offset])
    with pytest.raises(cuvil.ShapeError) as info:
        cuvil.build(te.create_schedule(B), [A, B])
    msg = str(info.value)
    # the tensor, the dimension, the statement, an iteration and the index there
    assert "reads A[i + " in msg and "dimension 0" in msg and "compute B" in msg and "statement S" in msg
    first_bad = 10 - offset if offset < 10 else 0
    assert f"at i = {first_bad}" in msg or "at i = " in msg
    assert "the index is" in msg


def test_te_read_before_the_start_and_writes_are_proved():
    A, B = _one_read(lambda A, i: A[i - 1])
    with pytest.raises(cuvil.ShapeError, match=r"at i = 0 the index is -1"):
        cuvil.lower(te.create_schedule(B), [A, B])


def test_te_in_bounds_programs_build_and_keep_no_checks():
    A, B = _one_read(lambda A, i: A[9 - i] + A[i // 2 + 5] + A[te.min(i + 3, 9)])
    f = cuvil.build(te.create_schedule(B), [A, B])
    assert not f.func.checks and "checked" not in str(f.func)
    a = np.arange(10, dtype=np.float32)
    b = np.empty(10, np.float32)
    f(a, b)
    np.testing.assert_array_equal(b, a[::-1] + a[np.arange(10) // 2 + 5] + a[np.minimum(np.arange(10) + 3, 9)])


def test_te_guarded_reads_are_judged_where_their_guard_holds():
    A, B = _one_read(lambda A, i: te.if_then_else(te.all(i > 0, i < 9), A[i - 1] + A[i + 1], A[i]))
    f = cuvil.build(te.create_schedule(B), [A, B])
    a = np.arange(10, dtype=np.float32)
    b = np.empty(10, np.float32)
    f(a, b)
    want = a.copy()
    want[1:9] = a[:8] + a[2:]
    np.testing.assert_array_equal(b, want)
    # the guard does not cover the read: refused
    A, B = _one_read(lambda A, i: te.if_then_else(i > 0, A[i + 1], 0.0))
    with pytest.raises(cuvil.ShapeError, match="dimension 0"):
        cuvil.build(te.create_schedule(B), [A, B])


def test_te_guard_that_reads_data_is_not_a_false_alarm():
    A = te.placeholder((10,), "float32", "A")
    mask = te.placeholder((10,), "int32", "mask")
    B = te.compute((10,), lambda i: te.if_then_else(mask[i] > 0, A[i + 1], 0.0), name="B")
    cuvil.build(te.create_schedule(B), [A, mask, B])  # the data may keep i + 1 in bounds: no error


def test_te_reduction_where_guards_its_reads():
    A = te.placeholder((10,), "float32", "A")
    k = te.reduce_axis((0, 10), name="k")
    B = te.compute((1,), lambda _: te.sum(A[k + 1], axis=k, where=k < 9), name="B")
    f = cuvil.build(te.create_schedule(B), [A, B])
    a = np.arange(10, dtype=np.float32)
    b = np.empty(1, np.float32)
    f(a, b)
    assert b[0] == a[1:].sum()


def test_te_sizes_that_hold_for_some_values_are_checked_per_call():
    n, m = te.var("n"), te.var("m")
    A = te.placeholder((m,), "float32", "A")
    B = te.compute((n,), lambda i: A[i + 1], name="B")
    f = cuvil.build(te.create_schedule(B), [A, B])
    assert f.func.entry_checks  # one condition on n and m, checked before the loops
    a = np.arange(8, dtype=np.float32)
    b = np.empty(7, np.float32)
    f(a, b)
    np.testing.assert_array_equal(b, a[1:])
    with pytest.raises(cuvil.BoundsError, match=r"A\[i \+ 1\].*dimension 0.*n = 8") as info:
        f(a, np.empty(8, np.float32))
    assert "m = 8" in str(info.value)
    f(a, np.empty(0, np.float32))  # no iteration, nothing read
    # the same with the checks off: the proof's condition is not checked
    g = cuvil.build(te.create_schedule(B), [A, B], bounds_checks=False)
    assert not g.func.entry_checks


def test_te_sizes_for_which_it_never_holds_are_refused():
    n = te.var("n")
    A = te.placeholder((n,), "float32", "A")
    B = te.compute((n,), lambda i: A[i + 1], name="B")
    with pytest.raises(cuvil.ShapeError, match=r"at i = 0 with n = 1 the index is 1"):
        cuvil.build(te.create_schedule(B), [A, B])


def test_te_scheduled_program_is_proved_as_written():
    M = 64
    A = te.placeholder((M + 2,), "float32", "A")
    B = te.compute((M,), lambda i: A[i] + A[i + 1] + A[i + 2], name="B")
    s = te.create_schedule(B)
    io, ii = s[B].split(s[B].op.axis[0], 8)
    s[B].vectorize(ii)
    f = cuvil.build(s, [A, B])
    a = np.random.rand(M + 2).astype(np.float32)
    b = np.empty(M, np.float32)
    f(a, b)
    np.testing.assert_allclose(b, a[:-2] + a[1:-1] + a[2:], rtol=1e-6)


# -- te programs: indices read from data, checked at run time -------------------------------------------


def _te_gather(rows=10, count=6, **build):
    W = te.placeholder((rows, 4), "float32", "W")
    idx = te.placeholder((count,), "int64", "idx")
    out = te.compute((count, 4), lambda t, d: W[idx[t], d], name="out")
    s = te.create_schedule(out)
    return cuvil.build(s, [W, idx, out], **build)


@pytest.mark.parametrize("bad", [10, -1, 2**40, -(2**63), 2**63 - 1])
def test_te_gather_index_out_of_range_raises(bad):
    f = _te_gather()
    w = np.random.rand(10, 4).astype(np.float32)
    out = np.empty((6, 4), np.float32)
    f(w, np.array([0, 1, 2, 3, 9, 5]), out)
    np.testing.assert_array_equal(out, w[[0, 1, 2, 3, 9, 5]])
    with pytest.raises(cuvil.BoundsError, match=rf"index {bad} is out of range for dimension 0 of W \(size 10"):
        f(w, np.array([0, 1, 2, bad, 9, 5]), out)
    assert isinstance(pytest.raises(IndexError, f, w, np.array([bad] * 6), out).value, cuvil.ShapeError)


def test_te_gather_checks_off():
    f = _te_gather(bounds_checks=False)
    assert "checked" not in f.get_source("loops") and not f.func.checks


def test_te_gather_in_a_parallel_loop_raises_and_frees():
    rows, count = 100, 4096
    W = te.placeholder((rows, 64), "float32", "W")
    idx = te.placeholder((count,), "int32", "idx")
    out = te.compute((count, 64), lambda t, d: W[idx[t], d] * 2.0, name="out")
    s = cuvil.auto_schedule([W, idx, out], "llvm")
    f = cuvil.build(s, [W, idx, out])
    w = np.random.rand(rows, 64).astype(np.float32)
    ids = np.random.randint(0, rows, count).astype(np.int32)
    res = np.empty((count, 64), np.float32)
    f(w, ids, res)
    np.testing.assert_array_equal(res, w[ids] * 2)
    ids[3000] = rows
    for _ in range(3):  # a failed call returns cleanly every time
        with pytest.raises(cuvil.BoundsError, match=f"index {rows} is out of range"):
            f(w, ids, res)


def test_te_exported_kernel_reports_its_check(tmp_path):
    f = _te_gather()
    path = f.export_library(str(tmp_path / "gather.so"))
    g = cuvil.runtime.load(path)
    w = np.random.rand(10, 4).astype(np.float32)
    out = np.empty((6, 4), np.float32)
    with pytest.raises(cuvil.BoundsError, match="index 50 is out of range for dimension 0 of W"):
        g(w, np.array([0, 1, 2, 50, 9, 5]), out)
    assert "main_checked" in open(path[:-3] + ".h").read()


# -- ONNX: a session, an exported library, a loaded library, C ------------------------------------------


def _gather_model(rows=10, count=3, axis=0):
    data = helper.make_tensor_value_info("data", TensorProto.FLOAT, [rows, 4] if axis == 0 else [4, rows])
    idx = helper.make_tensor_value_info("idx", TensorProto.INT64, [count])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    node = helper.make_node("Gather", ["data", "idx"], ["y"], axis=axis, name="lookup")
    return helper.make_model(helper.make_graph([node], "g", [data, idx], [y]),
                             opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.fixture(scope="module")
def gather_session():
    return connx.InferenceSession(_gather_model())


@pytest.mark.parametrize("bad", _BAD)
def test_onnx_gather_out_of_range_raises_like_onnxruntime(gather_session, bad):
    data = np.random.rand(10, 4).astype(np.float32)
    feeds = {"data": data, "idx": np.array([1, bad, 2])}
    with pytest.raises(Exception, match="out of data bounds"):
        ort.InferenceSession(_gather_model(), providers=["CPUExecutionProvider"]).run(None, feeds)
    with pytest.raises(cuvil.BoundsError) as info:
        gather_session.run(None, feeds)
    msg = str(info.value)
    assert f"Gather node 'lookup': index {bad} in input 1 ('idx')" in msg and "-10 .. 9" in msg


def test_onnx_gather_negative_indices_stay_legal(gather_session):
    data = np.random.rand(10, 4).astype(np.float32)
    ids = np.array([-10, -1, 9])
    np.testing.assert_array_equal(gather_session.run(None, {"data": data, "idx": ids})[0], data[ids])


def test_onnx_gather_along_an_inner_axis():
    sess = connx.InferenceSession(_gather_model(axis=1))
    data = np.random.rand(4, 10).astype(np.float32)
    np.testing.assert_array_equal(sess.run(None, {"data": data, "idx": np.array([0, -3, 9])})[0],
                                  data[:, [0, -3, 9]])
    with pytest.raises(cuvil.BoundsError, match="index 10 in input 1"):
        sess.run(None, {"data": data, "idx": np.array([0, 10, 9])})


def test_onnx_constant_indices_out_of_range_are_refused_at_compile_time():
    data = helper.make_tensor_value_info("data", TensorProto.FLOAT, [10, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    idx = helper.make_tensor("idx", TensorProto.INT64, [2], [1, 12])
    node = helper.make_node("Gather", ["data", "idx"], ["y"], axis=0, name="lookup")
    model = helper.make_model(helper.make_graph([node], "g", [data], [y], initializer=[idx]),
                              opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(cuvil.ShapeError, match="lookup.*index 12"):
        connx.InferenceSession(model.SerializeToString())


def test_onnx_bounds_checks_off(gather_session):
    sess = connx.InferenceSession(_gather_model(), bounds_checks=False)
    prog = sess.programs()[0]
    assert not any(k.checks for k in prog.kernel_funcs)
    checked = gather_session.programs()[0]
    assert any(k.checks for k in checked.kernel_funcs)
    data = np.random.rand(10, 4).astype(np.float32)
    ids = np.array([-10, -1, 9])
    np.testing.assert_array_equal(sess.run(None, {"data": data, "idx": ids})[0], data[ids])


def test_onnx_exported_library_reports_the_node(gather_session, tmp_path):
    path = gather_session.export_library(str(tmp_path / "lookup.so"))
    header = open(str(tmp_path / "lookup.h")).read()
    assert "LOOKUP_ERR_BOUNDS 4" in header and "const char *lookup_last_error(void);" in header
    data = np.random.rand(10, 4).astype(np.float32)
    lib = cuvil.runtime.load(path)
    np.testing.assert_array_equal(lib.run(None, {"data": data, "idx": np.array([-1, 0, 3])})[0], data[[-1, 0, 3]])
    for bad in _BAD:
        with pytest.raises(cuvil.BoundsError, match=f"Gather node 'lookup': index {bad} in input 1"):
            lib.run(None, {"data": data, "idx": np.array([0, bad, 1])})
    # from C: status 4, then the calling thread's message; an empty one after a good run
    c = ctypes.CDLL(path)
    c.lookup_run.argtypes = [ctypes.c_void_p] * 3
    c.lookup_last_error.restype = ctypes.c_char_p
    y = np.empty((3, 4), np.float32)
    for bad in _BAD:
        ids = np.array([0, 1, bad])
        assert c.lookup_run(data.ctypes.data, ids.ctypes.data, y.ctypes.data) == 4
        assert f"index {bad} in input 1".encode() in c.lookup_last_error()
    ok = np.array([0, 1, 2])
    assert c.lookup_run(data.ctypes.data, ok.ctypes.data, y.ctypes.data) == 0
    assert c.lookup_last_error() == b""
    np.testing.assert_array_equal(y, data[:3])


def test_onnx_exported_library_from_a_c_program(gather_session, tmp_path):
    import shutil
    import subprocess

    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    gather_session.export_library(str(tmp_path / "lookup.so"))
    src = tmp_path / "main.c"
    src.write_text(r'''
#include <stdio.h>
#include "lookup.h"
int main(void) {
    float data[40] = {0}, y[12];
    int64_t idx[3] = {0, 1099511627776LL, 2};
    int rc = lookup_run(data, idx, y);
    printf("%d %s\n", rc, lookup_last_error());
    return rc == LOOKUP_ERR_BOUNDS ? 0 : 1;
}
''')
    exe = tmp_path / "main"
    subprocess.run(["cc", str(src), "-o", str(exe), f"-I{tmp_path}", f"-L{tmp_path}", "-l:lookup.so",
                    f"-Wl,-rpath,{tmp_path}"], check=True, capture_output=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("4 Gather node 'lookup': index 1099511627776")


# -- hypothesis: cuvil refuses exactly what onnxruntime refuses -------------------------------------------


def _ops():
    """(model, data, index feed name, index shape, the dimension sizes the index ranges over) per op."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64

    def model(op, inputs, **attrs):
        vis = [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs]
        node = helper.make_node(op, [n for n, _, _ in inputs], ["y"], name=f"{op.lower()}_node", **attrs)
        g = helper.make_graph([node], "g", vis, [helper.make_tensor_value_info("y", f, None)])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()

    return {
        "Gather": (model("Gather", [("x", f, [5, 3]), ("i", i64, [4])], axis=0), (5, 3), (4,), 5),
        "GatherElements": (model("GatherElements", [("x", f, [3, 5]), ("i", i64, [3, 2])], axis=1), (3, 5),
                           (3, 2), 5),
        "GatherND": (model("GatherND", [("x", f, [4, 5, 2]), ("i", i64, [3, 2])]), (4, 5, 2), (3, 2), (4, 5)),
        "ScatterND": (model("ScatterND", [("x", f, [6, 2]), ("i", i64, [3, 1]), ("u", f, [3, 2])]), (6, 2),
                      (3, 1), 6),
        "ScatterElements": (model("ScatterElements", [("x", f, [3, 5]), ("i", i64, [3, 2]), ("u", f, [3, 2])],
                                  axis=1), (3, 5), (3, 2), 5),
    }


_OPS = _ops()
_SESSIONS: dict[str, tuple] = {}


def _sessions(op):
    if op not in _SESSIONS:
        m = _OPS[op][0]
        _SESSIONS[op] = (connx.InferenceSession(m), ort.InferenceSession(m, providers=["CPUExecutionProvider"]))
    return _SESSIONS[op]


@st.composite
def index_case(draw):
    op = draw(st.sampled_from(sorted(_OPS)))
    _, shp, ishp, dims = _OPS[op]
    count = int(np.prod(ishp))
    n = dims if isinstance(dims, int) else None
    sizes = [n] * count if n is not None else [dims[k % len(dims)] for k in range(count)]

    def one(size):
        near = st.integers(-2 * size - 1, 2 * size)
        return draw(st.one_of(near, near, near, st.sampled_from([2**40, -(2**40), 2**63 - 1, -(2**63)])))

    values = [one(s) for s in sizes]
    if op == "ScatterND":  # in-range updates on distinct rows (onnxruntime leaves duplicates' order open)
        seen: set[int] = set()
        for k, v in enumerate(values):
            if -6 <= v < 6:
                if v % 6 in seen:
                    values[k] = 2**40
                seen.add(v % 6)
    if op == "ScatterElements":  # the same per row of indices
        for r in range(ishp[0]):
            row = values[r * ishp[1]:(r + 1) * ishp[1]]
            if len({v % 5 for v in row if -5 <= v < 5}) < len([v for v in row if -5 <= v < 5]):
                values[r * ishp[1]] = 2**40
    return op, np.array(values, np.int64).reshape(ishp), draw(st.integers(0, 2**16))


@given(index_case())
def test_index_ops_refuse_what_onnxruntime_refuses(case):
    op, ids, seed = case
    _, shp, ishp, _ = _OPS[op]
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal(shp).astype(np.float32), "i": ids}
    if op.startswith("Scatter"):
        feeds["u"] = rng.standard_normal(ishp[:-1] + shp[1:] if op == "ScatterND" else ishp).astype(np.float32)
    mine, theirs = _sessions(op)
    try:
        want = theirs.run(None, feeds)
    except Exception as exc:  # onnxruntime refuses an index out of range
        assert "INVALID_ARGUMENT" in str(exc) or "out of" in str(exc).lower(), exc
        with pytest.raises(cuvil.BoundsError, match=f"{op} node '{op.lower()}_node': index -?\\d+ in input 1"):
            mine.run(None, feeds)
        return
    got = mine.run(None, feeds)
    np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.slow
def test_no_error_program_segfaults_in_a_subprocess(tmp_path):
    """The issue's crashing case, in a child process: index 2**40 used to be a SIGSEGV."""
    import subprocess
    import sys

    script = tmp_path / "crash.py"
    script.write_text(
        "import numpy as np, cuvil, cuvil.onnx, sys\n"
        f"sys.path[:0] = {[os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), '..', 'support')]!r}\n"
        "from test_bounds import _gather_model\n"
        "s = cuvil.onnx.InferenceSession(_gather_model())\n"
        "try:\n"
        "    s.run(None, {'data': np.zeros((10, 4), np.float32), 'idx': np.array([0, 2**40, 1])})\n"
        "except cuvil.BoundsError as e:\n"
        "    print('refused')\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "refused" in out.stdout, out.stderr[-2000:]


def test_a_proof_isl_gives_up_on_does_not_stop_the_build(monkeypatch, caplog) -> None:
    import logging

    from cuvil.errors import IslBudgetError
    from cuvil.schedule import bounds

    def give_up(self):
        raise IslBudgetError("isl gave up (simulated)")

    monkeypatch.setattr(bounds._Prover, "run", give_up)
    monkeypatch.setattr(bounds, "_PROVED", {})
    A = te.placeholder((12,), name="A_budget")
    B = te.compute((12,), lambda i: A[i] * 2.0, name="B_budget")
    with caplog.at_level(logging.WARNING, logger="cuvil.schedule"):
        mod = cuvil.build(te.create_schedule([B]), [A, B])
    assert any("not proved in bounds" in r.getMessage() for r in caplog.records)
    a, b = np.arange(12, dtype=np.float32), np.zeros(12, np.float32)
    mod(a, b)
    np.testing.assert_array_equal(b, a * 2)
