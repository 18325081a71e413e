"""ONNX models and the autotuner: the kernels a model runs (what `cuvil tune model.onnx` tunes) and
sessions that replay tuning records (`InferenceSession(..., tuning_db=db)`)."""

import logging

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import cuvil
from cuvil.autotune.database import Database, Record
from cuvil.autotune.workload import workload_of
from cuvil.frontend.onnx import kernel_programs
from cuvil.onnx import InferenceSession
from cuvil.runtime.threads import get_num_threads
from cuvil.schedule.trace import trace_to_json


def _mlp(batch=None):
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((64, 96)).astype(np.float32)
    w2 = rng.standard_normal((96, 96)).astype(np.float32)
    w3 = rng.standard_normal((96, 96)).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch if batch else "N", 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h1"]), helper.make_node("Relu", ["h1"], ["a1"]),
             helper.make_node("MatMul", ["a1", "w2"], ["h2"]), helper.make_node("Relu", ["h2"], ["a2"]),
             helper.make_node("MatMul", ["a2", "w3"], ["h3"]), helper.make_node("Relu", ["h3"], ["y"])]
    g = helper.make_graph(nodes, "mlp", [x], [y], [numpy_helper.from_array(w, n) for w, n in
                                                    ((w1, "w1"), (w2, "w2"), (w3, "w3"))])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_kernel_programs_lists_each_distinct_kernel_once_with_its_call_count():
    kernels = kernel_programs(_mlp(32))
    counts = sorted(n for _, n in kernels)
    assert counts == [1, 2]  # 64 -> 96 once, 96 -> 96 twice (same shapes: one kernel)
    for args, _ in kernels:  # each is a te program the tuner can schedule and build
        outs = [a for a in args if not isinstance(a.op, cuvil.te.tensor.PlaceholderOp)]
        assert outs and cuvil.build(cuvil.auto_schedule(args), args) is not None
    with pytest.raises(cuvil.ShapeError, match="symbolic"):
        kernel_programs(_mlp())
    assert len(kernel_programs(_mlp(), shapes={"x": (8, 64)})) == 2


def test_session_replays_the_best_record_of_each_kernel(tmp_path, caplog):
    model = _mlp(32)
    db_path = tmp_path / "tuned.db"
    (args, _), = [k for k in kernel_programs(model) if k[1] == 2]
    # a record for the 96 -> 96 kernel with a schedule auto_schedule would not pick on its own
    knobs = cuvil.schedule.auto.default_knobs(args)
    stage = next(iter(knobs))
    s = cuvil.auto_schedule(args, knobs={stage: {"mr": 3, "nr": 16}})
    wl = workload_of(args, "llvm")
    with Database(db_path) as db:
        db.add(Record(wl.key, wl.target, get_num_threads(), "test-config", {}, "ok", time_s=1e-4,
                      trace=trace_to_json(s.trace), names=wl.names))
    x = np.random.default_rng(1).standard_normal((32, 64)).astype(np.float32)
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    with caplog.at_level(logging.INFO, logger="cuvil.autotune"):
        sess = InferenceSession(model, tuning_db=str(db_path))
    assert "replaced" in caplog.text and "no record" in caplog.text  # one kernel tuned, one not
    got = sess.run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    plain = InferenceSession(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-5)
    with pytest.raises(cuvil.ArgumentError, match="tuning_db"):
        InferenceSession(model, tuning_db=42)


@pytest.mark.slow
def test_tune_model_tunes_the_kernels_a_session_then_replays(tmp_path):
    path = tmp_path / "mlp.onnx"
    path.write_bytes(_mlp(32))
    db = str(tmp_path / "t.db")
    results = cuvil.autotune.tune_model(path, trials=8, db=db, timeout_s=20.0, progress=False)
    assert sorted(r.count for r in results) == [1, 2] and sum(r.trials for r in results) >= 2
    with Database(db) as d:
        assert {r.workload for r in d.records()} == {r.key for r in results}
    x = np.random.default_rng(2).standard_normal((32, 64)).astype(np.float32)
    want = ort.InferenceSession(_mlp(32), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(InferenceSession(str(path), tuning_db=db).run(None, {"x": x})[0], want,
                               rtol=1e-4, atol=1e-4)
