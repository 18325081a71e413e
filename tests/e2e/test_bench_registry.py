"""``cuvil bench --registry``'s timing protocol on a small model: above 1 thread each engine runs in a
process of its own (cuvil.bench.registry.time_apart), alternated in blocks."""

import math

import numpy as np
import pytest
import toolchain

toolchain.module("onnx")
toolchain.module("onnxruntime")

from onnx import helper  # noqa: E402
from onnx_models import float_model  # noqa: E402

from cuvil.bench import registry as bench_registry  # noqa: E402


@pytest.mark.slow
def test_two_threads_time_each_engine_in_its_own_process(tmp_path):
    rng = np.random.default_rng(0)
    inits = {"W": rng.standard_normal((64, 32)) * 0.1, "B": rng.standard_normal(64)}
    model = float_model([helper.make_node("Gemm", ["x", "W", "B"], ["g"], transB=1),
                         helper.make_node("Relu", ["g"], ["y"])], [("x", [16, 32])], ["y"], inits)
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    example = {"x": rng.standard_normal((16, 32)).astype(np.float32)}
    c_cpu, c_wall, o_cpu, o_wall = bench_registry.time_apart(str(path), example, 2, rounds=5, budget_s=0.2)
    for v in (c_cpu, c_wall, o_cpu, o_wall):
        assert math.isfinite(v) and 0 < v < 1.0
    r = bench_registry.Result("m", "onnx", latency={2: (c_cpu, c_wall, o_cpu, o_wall)})
    assert r.ratio(2) == pytest.approx(c_wall / o_wall)  # wall time above 1 thread


def test_a_child_that_cannot_load_the_model_is_a_cuvil_error(tmp_path):
    from cuvil.errors import CuvilError

    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(CuvilError, match="process of its own"):
        bench_registry.time_apart(str(bad), {"x": np.zeros((2,), np.float32)}, 2, rounds=5, budget_s=0.1)


def test_the_handoff_probe_reads_the_other_threads_rows():
    from cuvil.bench import probe

    h = probe.handoff_scaling(2, repeat=2, kib=4)
    assert math.isfinite(h) and 0.01 < h < 4
    g, (a, b) = probe._HANDOFF[2]
    a[:] = np.arange(a.size, dtype=np.float32).reshape(a.shape)
    want_b = a[::-1] * 0.5 + 1
    g(a, b)
    np.testing.assert_array_equal(b, want_b)
    np.testing.assert_array_equal(a, want_b[::-1] * 0.5 + 1)


def test_a_low_probe_is_taken_again_and_marked(monkeypatch):
    # probes taken earlier in the run: typically 0.4 (one outlier at 0.9); then before and after each try:
    # the first two tries' hand-off falls to a quarter of the typical one: LOW; the third is good
    history = [0.4, 0.41, 0.9, 0.39, 0.4]
    seen = iter([0.4, 0.1, 0.1, 0.12, 0.42, 0.45])

    def fake_probe(t):
        history.append(next(seen))
        return history[-1]

    timings = iter([(1.0, 1.0, 1.0, 1.0), (2.0, 2.0, 2.0, 2.0), (3.0, 3.0, 3.0, 3.0)])
    monkeypatch.setattr(bench_registry, "probe", fake_probe)
    monkeypatch.setattr(bench_registry, "time_apart", lambda *a: next(timings))
    monkeypatch.setattr(bench_registry, "_HANDOFFS", {2: history})
    timing, got = bench_registry.time_probed("m.onnx", {}, 2, 5, 1.0)
    assert timing == (3.0, 3.0, 3.0, 3.0) and got == 0.42
    low = bench_registry.Result("a", "dynamo", latency={2: (1, 1.2, 1, 1.0)}, probe={2: 0.1})
    good = bench_registry.Result("b", "dynamo", latency={2: (1, 1.0, 1, 1.0)}, probe={2: 0.39})
    assert bench_registry.row(low, [2]).endswith("probe 0.10x LOW")
    assert "LOW" not in bench_registry.row(good, [2])  # the 0.9 outlier does not make 0.39 low
    (line,) = bench_registry.summary([low, good], [2])
    assert "hand-off probe 0.10-0.39x (typical 0.40x)" in line and line.endswith("LOW during a/dynamo")
