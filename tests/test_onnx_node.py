"""ONNX's own backend node conformance cases, generated from the installed onnx package, run through cuvil.

Every case whose operator (the single node of its non-expanded model) is one cuvil lists as supported
runs with the onnx runner's comparison (the case's rtol/atol, default 1e-3/1e-7) and must match the
reference outputs exactly in shape and dtype.  The cases cuvil cannot pass are listed, each with its
reason, in ``tests/onnx_node_failures.txt``; they are strict xfails, so a fix shows up as an XPASS
to remove from the list.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import numpy_helper  # noqa: E402

# the operators issue #5 lists
LISTED = set("""Conv Gemm MatMul BatchNormalization Relu LeakyRelu PRelu Clip Sigmoid HardSigmoid HardSwish Tanh Erf
Gelu Softmax LogSoftmax Add Sub Mul Div Pow Sqrt Exp Log Neg Abs Reciprocal Min Max Sum Mean MaxPool AveragePool
GlobalAveragePool GlobalMaxPool Flatten Reshape Transpose Squeeze Unsqueeze Concat Split Slice Gather Shape Constant
ConstantOfShape Cast Identity Dropout LayerNormalization ReduceMean ReduceSum ReduceMax ReduceMin ReduceL2 Pad Where
Equal Less Greater Not And Or Expand Tile Resize LRN Floor Ceil Softplus Elu Selu ArgMax Range""".split())
FAILURES_FILE = os.path.join(os.path.dirname(__file__), "onnx_node_failures.txt")


def _collect() -> dict:
    from onnx.backend.test.case import node

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = {c.name: c for c in node.collect_testcases()}
    out = {}
    for name, c in cases.items():
        base = cases.get(name.split("_expanded")[0])
        if base is not None and len(base.model.graph.node) == 1 and base.model.graph.node[0].op_type in LISTED:
            out[name] = c
    return out


def _failures() -> dict[str, tuple[bool, str]]:
    """name -> (onnxruntime passes it, reason cuvil does not)."""
    out = {}
    with open(FAILURES_FILE) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                name, ort_ok, reason = (x.strip() for x in line.split("|", 2))
                out[name] = (ort_ok == "ort-pass", reason)
    return out


CASES = _collect()
FAILURES = _failures()


def _array(v: object) -> np.ndarray:
    return numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else np.asarray(v)


def _run(session_type: type, case: object) -> None:
    kwargs = {"providers": ["CPUExecutionProvider"]} if session_type.__module__.startswith("onnxruntime") else {}
    s = session_type(case.model.SerializeToString(), **kwargs)
    for inputs, outputs in case.data_sets:
        feeds = {i.name: _array(v) for i, v in zip(case.model.graph.input, inputs)}
        got = s.run(None, feeds)
        assert len(got) == len(outputs)
        for g, r in zip(got, outputs):
            r = _array(r)
            g = np.asarray(g)
            assert g.dtype == r.dtype and g.shape == r.shape, (g.dtype, g.shape, r.dtype, r.shape)
            np.testing.assert_allclose(g, r, rtol=case.rtol, atol=case.atol)


def _params() -> list:
    out = []
    for name in sorted(CASES):
        marks = [pytest.mark.xfail(strict=True, reason=FAILURES[name][1])] if name in FAILURES else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


@pytest.mark.parametrize("name", _params())
def test_node_case(name: str) -> None:
    import cuvil.onnx

    _run(cuvil.onnx.InferenceSession, CASES[name])


def test_failure_list_names_real_cases():
    assert set(FAILURES) <= set(CASES), sorted(set(FAILURES) - set(CASES))


def test_floor_against_onnxruntime():
    """At least 90% of the cases onnxruntime passes pass in cuvil; the list's ort column is right."""
    import onnxruntime

    ort_pass = set()
    for name, case in CASES.items():
        try:
            _run(onnxruntime.InferenceSession, case)
            ort_pass.add(name)
        except Exception:  # noqa: BLE001 - onnxruntime refusing a case is what we count here
            pass
    for name, (ort_ok, _) in FAILURES.items():
        assert (name in ort_pass) == ort_ok, f"{name}: onnxruntime {'passes' if name in ort_pass else 'fails'} it"
    cuvil_fails = {n for n, (ok, _) in FAILURES.items() if ok}
    passed = len(ort_pass - cuvil_fails)
    assert passed >= 0.9 * len(ort_pass), f"{passed} of the {len(ort_pass)} cases onnxruntime passes"
