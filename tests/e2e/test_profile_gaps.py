"""``cuvil bench --registry --profile N`` lists the kernels below half of the machine's limit: float32
contractions against the measured FMA peak, the rest against the measured streaming bandwidth (issue 29)."""

from __future__ import annotations

import numpy as np
import toolchain
from onnx import TensorProto, helper, numpy_helper

from cuvil.graph.profile import CallTime, Profile, stream_bandwidth

ort = toolchain.module("onnxruntime")


def test_gaps_compare_contractions_with_the_peak_and_the_rest_with_the_bandwidth() -> None:
    calls = (CallTime(0, "MatMul a", "", 1e-3, flops=60e6, kind="fp32", bytes=1e6),  # 60 GF/s: 60% of 100
             CallTime(1, "Conv b", "", 2e-3, flops=40e6, kind="fp32", bytes=1e6),  # 20 GF/s: 20%
             CallTime(2, "Add c", "", 4e-3, bytes=40e6),  # 10 GB/s: 50% of 20
             CallTime(3, "Gather d", "", 3e-3, bytes=3e6),  # 1 GB/s: 5%
             CallTime(4, "MatMul e", "", 1e-3, flops=1e6, kind="int8", bytes=2e6))  # int8: bytes, 10%
    prof = Profile(calls, 0.011, peak=100e9, bandwidth=20e9)
    assert prof.efficiency(calls[0]) == (0.6, "peak") and prof.efficiency(calls[2]) == (0.5, "bandwidth")
    gaps = prof.gaps()
    assert [(c.index, round(e, 3), what) for c, e, what in gaps] == [(3, 0.05, "bandwidth"), (1, 0.2, "peak"),
                                                                      (4, 0.1, "bandwidth")]
    text = prof.gaps_table(2)
    assert "3 calls, 55% of the calls' time" in text and "#3 Gather d" in text and "#4" not in text
    assert Profile(calls, 0.011).gaps() == []  # no limits known: nothing claimed


def test_a_profiled_model_knows_its_bytes_and_the_bandwidth() -> None:
    from cuvil.onnx import InferenceSession

    w = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 256])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 256])],
                          [numpy_helper.from_array(w, "w")])
    sess = InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    prof = sess.programs()[0].profile({"x": np.ones((64, 256), np.float32)})
    assert prof.bandwidth == stream_bandwidth("llvm") > 1e8  # (any machine moves more than 100 MB/s)
    (c,) = prof.calls
    assert c.bytes >= 4 * (64 * 256 + 256 * 256 + 64 * 256)  # x, the weights (perhaps packed), y
    assert prof.efficiency(c)[1] == "peak"
