"""DQ -> float chain -> Q tabulated over the 256 codes (cuvil/graph/qdq_table.py), against the QDQ
semantics: the chain run by onnxruntime with its graph optimizations off (tests/support/quant_reference.py), so
its float operators run as written, not as a kernel onnxruntime's optimizer might fuse them into.

Every code of the input type is fed, so the table is checked entry by entry: equal to onnxruntime's
float chain except where its float32 Erf / Tanh (an ulp from the exact value at most) lands the value
across a rounding boundary that the correctly rounded one does not: one step there, at most."""

from __future__ import annotations

import numpy as np
import pytest
import quant_reference
import toolchain

onnx = toolchain.module("onnx")
toolchain.module("onnxruntime")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper as h  # noqa: E402
from onnx import numpy_helper as nh  # noqa: E402

import cuvil.onnx  # noqa: E402
from cuvil.errors import CuvilError  # noqa: E402

_ELEM = {"float32": T.FLOAT, "uint8": T.UINT8, "int8": T.INT8}


def _model(nodes: list, x: np.ndarray, out: str, inits: dict[str, np.ndarray]) -> bytes:
    g = h.make_graph(nodes, "t", [h.make_tensor_value_info("x", _ELEM[x.dtype.name], x.shape)],
                     [h.make_tensor_value_info("y", _ELEM[out], None)],
                     [nh.from_array(np.asarray(v), k) for k, v in inits.items()])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 21)], ir_version=10).SerializeToString()


def _codes(qtype: str) -> np.ndarray:
    lo = -128 if qtype == "int8" else 0
    return np.arange(lo, lo + 256).astype(qtype).reshape(16, 16)


def _ops(model: bytes) -> list[str]:
    sess = cuvil.onnx.InferenceSession(model)
    return [n.op_type for n in sess._graph.nodes]


def _run(model: bytes, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ref = quant_reference.run_semantics(model, {"x": x})[0]
    return cuvil.onnx.InferenceSession(model).run(None, {"x": x})[0], ref


def test_quantize_static_gelu_head_is_one_lookup() -> None:
    """``DQ -> Div -> Erf -> Q -> DQ -> Add(DQ(1)) -> Q`` (quantize_static's GELU up to the product with
    x): the Q -> DQ pair inside rounds as the model does, the constant 1 is a DQ of one code."""
    x = _codes("uint8")
    nodes = [h.make_node("DequantizeLinear", ["x", "s", "z"], ["d"]),
             h.make_node("Div", ["d", "c"], ["v"]),
             h.make_node("Erf", ["v"], ["e"]),
             h.make_node("QuantizeLinear", ["e", "se", "ze"], ["eq"]),
             h.make_node("DequantizeLinear", ["eq", "se", "ze"], ["ed"]),
             h.make_node("DequantizeLinear", ["one", "s1", "z1"], ["oned"]),
             h.make_node("Add", ["ed", "oned"], ["a"]),
             h.make_node("QuantizeLinear", ["a", "so", "zo"], ["y"])]
    inits = {"s": np.float32(0.051), "z": np.uint8(120), "c": np.float32(1.4142135), "se": np.float32(1 / 127),
             "ze": np.uint8(127), "one": np.uint8(255), "s1": np.float32(1 / 255), "z1": np.uint8(0),
             "so": np.float32(2 / 255), "zo": np.uint8(0)}
    model = _model(nodes, x, "uint8", inits)
    ops = [o for o in _ops(model) if o != "DequantizeLinear"]
    assert ops == ["CuvilQLinearLookup"], ops
    got, ref = _run(model, x)
    assert np.abs(got.astype(int) - ref.astype(int)).max() <= 1


@pytest.mark.parametrize("qin, qout", [("uint8", "uint8"), ("int8", "int8"), ("uint8", "int8")])
def test_gelu_erf_chain_is_one_lookup(qin: str, qout: str) -> None:
    """BERT's ``DQ -> Div(sqrt 2) -> Erf -> Q`` (as quantize_static writes it) becomes one table lookup."""
    x = _codes(qin)
    zin = np.array(3 if qin == "uint8" else -2, qin)
    zout = np.array(128 if qout == "uint8" else 0, qout)
    nodes = [h.make_node("DequantizeLinear", ["x", "s", "z"], ["d"]),
             h.make_node("Div", ["d", "c"], ["v"]),
             h.make_node("Erf", ["v"], ["e"]),
             h.make_node("QuantizeLinear", ["e", "so", "zo"], ["y"])]
    inits = {"s": np.float32(0.043), "z": zin, "c": np.float32(1.4142135), "so": np.float32(1 / 127),
             "zo": zout}
    model = _model(nodes, x, qout, inits)
    ops = _ops(model)
    assert "CuvilQLinearLookup" in ops and "Erf" not in ops and "QuantizeLinear" not in ops, ops
    got, ref = _run(model, x)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    diff = np.abs(got.astype(int) - ref.astype(int))
    assert diff.max() <= 1 and (diff == 0).mean() >= 0.98, diff.max()


def test_constants_on_either_side_and_saturation() -> None:
    """``2 - x``, ``x * 3``, Tanh, Relu in a chain (the constant first or second), the output saturating."""
    x = _codes("uint8")
    nodes = [h.make_node("DequantizeLinear", ["x", "s", "z"], ["d"]),
             h.make_node("Sub", ["two", "d"], ["a"]),
             h.make_node("Mul", ["a", "three"], ["b"]),
             h.make_node("Tanh", ["b"], ["c"]),
             h.make_node("Relu", ["c"], ["r"]),
             h.make_node("QuantizeLinear", ["r", "so", "zo"], ["y"])]
    inits = {"s": np.float32(0.02), "z": np.uint8(100), "two": np.float32(2.0), "three": np.float32(3.0),
             "so": np.float32(1 / 300), "zo": np.uint8(10)}
    model = _model(nodes, x, "uint8", inits)
    assert [o for o in _ops(model) if o not in ("DequantizeLinear",)] == ["CuvilQLinearLookup"]
    got, ref = _run(model, x)
    assert got.max() == 255 and got.min() == 10  # saturated at the top, Relu's floor at the zero point
    assert np.abs(got.astype(int) - ref.astype(int)).max() <= 1


def test_chains_that_do_not_fit_stay_element_wise() -> None:
    """A tensor (not scalar) constant, and an intermediate value read twice, keep the float ops."""
    x = _codes("uint8")
    col = np.linspace(-1, 1, 16).astype(np.float32)
    nodes = [h.make_node("DequantizeLinear", ["x", "s", "z"], ["d"]),
             h.make_node("Add", ["d", "col"], ["a"]),
             h.make_node("Erf", ["a"], ["e"]),
             h.make_node("QuantizeLinear", ["e", "so", "zo"], ["y"])]
    inits = {"s": np.float32(0.05), "z": np.uint8(128), "col": col, "so": np.float32(1 / 127), "zo": np.uint8(128)}
    model = _model(nodes, x, "uint8", inits)
    assert "CuvilQLinearLookup" not in _ops(model)
    got, ref = _run(model, x)
    assert np.abs(got.astype(int) - ref.astype(int)).max() <= 1

    twice = [h.make_node("DequantizeLinear", ["x", "s", "z"], ["d"]),
             h.make_node("Mul", ["d", "k"], ["m"]),
             h.make_node("Erf", ["m"], ["e"]),
             h.make_node("Add", ["e", "m"], ["t"]),
             h.make_node("QuantizeLinear", ["t", "so", "zo"], ["y"])]
    inits2 = {"s": np.float32(0.05), "z": np.uint8(128), "k": np.float32(0.5), "so": np.float32(1 / 64),
              "zo": np.uint8(128)}
    model2 = _model(twice, x, "uint8", inits2)
    assert "CuvilQLinearLookup" not in _ops(model2)
    got, ref = _run(model2, x)
    assert np.abs(got.astype(int) - ref.astype(int)).max() <= 1


def test_lookup_refuses_a_bad_table() -> None:
    x = _codes("uint8")
    node = h.make_node("CuvilQLinearLookup", ["x", "t"], ["y"], name="lut")
    model = _model([node], x, "uint8", {"t": np.zeros(10, np.uint8)})
    with pytest.raises(CuvilError, match="lut.*256 uint8 or int8 values"):
        cuvil.onnx.InferenceSession(model).run(None, {"x": x})
