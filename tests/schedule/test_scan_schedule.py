"""Scheduling a scan's init and update (TVM's scan tutorial): ``s[init]`` and ``s[update]`` are the
loops inside one time step; the time axis stays sequential and outermost."""

import numpy as np
import pytest

import cuvil
from cuvil import te


def _cumsum(m, n, names=True):
    """The tutorial's program: out[0] = X[0], out[t] = out[t - 1] + X[t]."""
    X = te.placeholder((m, n), name="X")
    state = te.placeholder((m, n), name="state") if names else te.placeholder((m, n))
    init = te.compute((1, n), lambda _, i: X[0, i], name="init") if names else \
        te.compute((1, n), lambda _, i: X[0, i])
    update = te.compute((m, n), lambda t, i: state[t - 1, i] + X[t, i], name="update") if names else \
        te.compute((m, n), lambda t, i: state[t - 1, i] + X[t, i])
    scan = te.scan(init, update, state, inputs=[X], name="cumsum") if names else \
        te.scan(init, update, state, inputs=[X])
    return X, init, update, scan


def _check(f, shapes):
    rng = np.random.default_rng(0)
    for m, n in shapes:
        x = rng.standard_normal((m, n)).astype(np.float32)
        out = np.full_like(x, np.nan)
        f(x, out)
        np.testing.assert_allclose(out, np.cumsum(x, axis=0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("symbolic", [False, True])
def test_tutorial_split_and_vectorize(symbolic):
    """The tutorial, on a CPU: split both parts' inner axis by 16, vectorise the update's."""
    m, n = (te.var("m"), te.var("n")) if symbolic else (7, 37)
    X, s_init, s_update, s_scan = _cumsum(m, n, names=False)
    s = te.create_schedule(s_scan.op)
    xo, xi = s[s_init].split(s_init.op.axis[1], factor=16)
    xo, xi = s[s_update].split(s_update.op.axis[1], factor=16)
    s[s_update].vectorize(xi)
    text = str(cuvil.lower(s, [X, s_scan]))
    assert "vectorize for (i.inner_1 = 0; i.inner_1 < 16; i.inner_1++)" in text
    assert "for (i.inner = 0;" in text  # the init's split
    f = cuvil.build(s, [X, s_scan])
    _check(f, [(1, 5), (4, 16), (9, 37), (3, 64)] if symbolic else [(7, 37)])


def test_part_stages_are_named_and_replayed():
    X, init, update, scan = _cumsum(te.var("m"), 48)
    s = te.create_schedule(scan)
    assert s[init].name == "cumsum.init" and s[update].name == "cumsum.update"
    t, i = update.op.axis
    io, ii = s[update].split(i, factor=8)
    s[update].unroll(ii)
    s[update].parallel(io)
    s[init].vectorize(s[init].split(init.op.axis[1], factor=16)[1])
    assert [str(step) for step in s.trace][0].startswith("cumsum.update.split(")
    text = str(cuvil.lower(s, [X, scan]))
    assert "parallel for (i.outer" in text
    _check(cuvil.build(s, [X, scan]), [(1, 48), (6, 48)])
    # the trace replays on a fresh schedule of the same program
    X2, init2, update2, scan2 = _cumsum(te.var("m"), 48)
    s2 = te.create_schedule(scan2)
    for step in s.trace:
        s2.apply_step(step)
    assert str(cuvil.lower(s2, [X2, scan2])) == text


def test_reorder_and_fuse_inside_a_time_step():
    m, n, k = te.var("m"), 6, 8
    X = te.placeholder((m, n, k), name="X")
    state = te.placeholder((m, n, k), name="state")
    init = te.compute((1, n, k), lambda _, i, j: X[0, i, j], name="init")
    update = te.compute((m, n, k), lambda t, i, j: state[t - 1, i, j] * 0.5 + X[t, i, j], name="update")
    scan = te.scan(init, update, state, inputs=[X], name="ema")
    s = te.create_schedule(scan)
    _, i, j = update.op.axis
    s[update].reorder(j, i)
    _, i0, j0 = init.op.axis
    fused = s[init].fuse(i0, j0)
    s[init].vectorize(s[init].split(fused, factor=16)[1])
    f = cuvil.build(s, [X, scan])
    x = np.random.default_rng(1).standard_normal((5, n, k)).astype(np.float32)
    out = np.empty_like(x)
    f(x, out)
    ref = np.empty_like(x)
    ref[0] = x[0]
    for t in range(1, 5):
        ref[t] = ref[t - 1] * 0.5 + x[t]
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_parallel_time_axis_is_refused_by_isl():
    X, init, update, scan = _cumsum(te.var("m"), 16)
    s = te.create_schedule(scan)
    with pytest.raises(cuvil.ScheduleError, match=r"cumsum.update.parallel\('t'\).*loop t of cumsum.update cannot "
                                                  r"be parallel: it carries a flow"):
        s[update].parallel(update.op.axis[0])
    assert not s.trace  # nothing changed


@pytest.mark.parametrize("request_", ["reorder", "split", "fuse", "vectorize"])
def test_time_axis_stays_outermost(request_):
    X, init, update, scan = _cumsum(te.var("m"), 16)
    s = te.create_schedule(scan)
    t, i = update.op.axis
    call = {
        "reorder": lambda: s[update].reorder(i, t),
        "split": lambda: s[update].split(t, factor=4),
        "fuse": lambda: s[update].fuse(t, i),
        "vectorize": lambda: s[update].vectorize(t),
    }[request_]
    with pytest.raises(cuvil.ScheduleError, match=rf"cumsum.update.{request_}\(.*t is the time axis of scan "
                                                  r"cumsum.*outermost"):
        call()
    assert not s.trace


def test_a_carried_inner_loop_is_refused():
    """An update that reads its own time step (a prefix sum along i too) carries a dependence along i."""
    m, n = te.var("m"), 16
    X = te.placeholder((m, n), name="X")
    state = te.placeholder((m, n), name="state")
    init = te.compute((1, n), lambda _, i: X[0, i], name="init")
    update = te.compute((m, n), lambda t, i: state[t - 1, i] + te.if_then_else(
        i > 0, state[t, i - 1], te.const(0.0)), name="update")
    scan = te.scan(init, update, state, inputs=[X], name="scan2d")
    s = te.create_schedule(scan)
    with pytest.raises(cuvil.ScheduleError, match="loop i of scan2d.update cannot be vectorized: it carries a flow"):
        s[update].vectorize(update.op.axis[1])


def test_scan_is_scheduled_one_way():
    X, init, update, scan = _cumsum(te.var("m"), 16)
    s = te.create_schedule(scan)
    s[update].split(update.op.axis[1], factor=4)
    with pytest.raises(cuvil.ScheduleError, match=r"cumsum.parallel: the loops of scan cumsum are already "
                                                  r"scheduled through s\[cumsum.update\]"):
        s[scan].parallel(scan.op.axis[1])
    with pytest.raises(cuvil.ScheduleError, match="cumsum.init.compute_root: cumsum.init runs inside scan cumsum"):
        s[init].compute_root()
    s2 = te.create_schedule(scan)
    s2[scan].parallel(scan.op.axis[1])
    with pytest.raises(cuvil.ScheduleError, match=r"already scheduled through s\[cumsum\]"):
        s2[update].split(update.op.axis[1], factor=4)


def test_lower_prints_the_scheduled_scan():
    X, init, update, scan = _cumsum(8, 32)
    s = te.create_schedule(scan)
    s[init].split(init.op.axis[1], factor=16)
    _, xi = s[update].split(update.op.axis[1], factor=16)
    s[update].vectorize(xi)
    text = str(cuvil.lower(s, [X, scan]))
    assert "for (t = 0; t < 7; t++)" in text
    assert "vectorize for (i.inner_1 = 0; i.inner_1 < 16; i.inner_1++)" in text
    _check(cuvil.build(s, [X, scan]), [(8, 32)])


def test_gpu_binding_of_the_parts_lowers():
    """The tutorial's GPU schedule: each part's inner axis split and bound to blocks and threads, inside
    the sequential time loop (lowering only: the CUDA code generator does not launch a kernel per time
    step yet)."""
    X, init, update, scan = _cumsum(te.var("m"), te.var("n"))
    s = te.create_schedule(scan)
    for part in (init, update):
        xo, xi = s[part].split(part.op.axis[1], factor=16)
        s[part].bind(xo, "blockIdx.x")
        s[part].bind(xi, "threadIdx.x")
    text = str(cuvil.lower(s, [X, scan]))
    assert "for (t = 0; t < m - 1; t++) {\n    blockIdx.x for (i.outer_1" in text


def test_scan_computed_at_its_readers_time_loop():
    """A scan computed inside its reader's loop over time keeps a whole buffer: each step reads the
    step before it, which an earlier iteration of the reader's loop computed."""
    X, init, update, scan = _cumsum(te.var("m"), 16)
    Y = te.compute(scan.shape, lambda t, i: scan[t, i] * 2, name="Y")
    s = te.create_schedule(Y)
    s[update].split(update.op.axis[1], factor=4)
    s[scan].compute_at(s[Y], Y.op.axis[0])
    assert "local" not in str(cuvil.lower(s, [X, Y]))
    f = cuvil.build(s, [X, Y])
    x = np.random.default_rng(2).standard_normal((6, 16)).astype(np.float32)
    y = np.empty_like(x)
    f(x, y)
    np.testing.assert_allclose(y, 2 * np.cumsum(x, axis=0), rtol=1e-5, atol=1e-5)
