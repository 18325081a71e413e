"""ONNX's own backend node conformance cases, generated from the installed onnx package, run through cuvil.

Every case whose operator (the single node of its non-expanded model) is one the importer registers
(``cuvil.graph.ops.base.supported_ops()``, less cuvil's internal ``Cuvil*`` operators) runs with the
onnx runner's comparison (the case's rtol/atol, default 1e-3/1e-7) and must match the reference outputs
exactly in shape and dtype.  The cases cuvil cannot pass are listed in ``tests/frontends/onnx_node_failures.txt``,
each with the exception it raises and the reason; they are strict xfails that must raise that exception
(``AssertionError`` for a wrong result), so a fix shows up as an XPASS to remove from the list, and a
case that starts failing another way shows up as a failure.
"""

from __future__ import annotations

import builtins
import os
import warnings

import numpy as np
import pytest
import toolchain

onnx = toolchain.module("onnx")
toolchain.module("onnxruntime")
from onnx import numpy_helper  # noqa: E402

import cuvil.errors  # noqa: E402
from cuvil.graph.ops.base import supported_ops  # noqa: E402

# every operator the importer registers, less the internal ones the graph passes introduce
TESTED = {name for name in supported_ops() if not name.startswith("Cuvil")}
FAILURES_FILE = os.path.join(os.path.dirname(__file__), "onnx_node_failures.txt")


def _collect() -> dict:
    from onnx.backend.test.case import node

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = {c.name: c for c in node.collect_testcases()}
    out = {}
    for name, c in cases.items():
        base = cases.get(name.split("_expanded")[0])
        if base is not None and len(base.model.graph.node) == 1 and base.model.graph.node[0].op_type in TESTED:
            out[name] = c
    return out


def _exception(name: str) -> type[BaseException]:
    """The exception class a failures-file line names: one of cuvil's errors or a builtin one."""
    cls = getattr(cuvil.errors, name, None) or getattr(builtins, name, None)
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        raise ValueError(f"{FAILURES_FILE}: {name!r} is not an exception class of cuvil.errors or builtins")
    return cls


def _failures() -> dict[str, tuple[bool, type[BaseException], str]]:
    """name -> (onnxruntime passes it, the exception cuvil raises, the reason)."""
    out = {}
    with open(FAILURES_FILE) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                name, ort_ok, exc, reason = (x.strip() for x in line.split("|", 3))
                if ort_ok not in ("ort-pass", "ort-fail"):
                    raise ValueError(f"{FAILURES_FILE}: {name}: {ort_ok!r} is not ort-pass or ort-fail")
                out[name] = (ort_ok == "ort-pass", _exception(exc), reason)
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
    """Every case; the fast lane (``-m "not slow"``) runs the first passing case of each operator."""
    out, seen = [], set()
    for name in sorted(CASES):
        marks = []
        if name in FAILURES:
            _, exc, reason = FAILURES[name]
            marks = [pytest.mark.xfail(strict=True, raises=exc, reason=reason)]
        op = CASES[name].model.graph.node[0].op_type if len(CASES[name].model.graph.node) == 1 else None
        if marks or op is None or op in seen:
            marks.append(pytest.mark.slow)
        else:
            seen.add(op)
        out.append(pytest.param(name, marks=marks, id=name))
    return out


@pytest.mark.parametrize("name", _params())
def test_node_case(name: str) -> None:
    import cuvil.onnx

    _run(cuvil.onnx.InferenceSession, CASES[name])


def test_failure_list_names_real_cases():
    assert set(FAILURES) <= set(CASES), sorted(set(FAILURES) - set(CASES))


@pytest.mark.slow
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
    for name, (ort_ok, _, _) in FAILURES.items():
        assert (name in ort_pass) == ort_ok, f"{name}: onnxruntime {'passes' if name in ort_pass else 'fails'} it"
    cuvil_fails = {n for n, (ok, _, _) in FAILURES.items() if ok}
    passed = len(ort_pass - cuvil_fails)
    assert passed >= 0.9 * len(ort_pass), f"{passed} of the {len(ort_pass)} cases onnxruntime passes"
