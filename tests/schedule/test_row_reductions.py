"""Row reductions under auto_schedule: four vectors of partial results (independent chains), folded
into one vector and then into the scalar in halves (the codegen's lane fold); max keeps NaN, sums
match numpy within the reduction tolerance."""

import re

import isa
import numpy as np
import pytest

import cuvil
from cuvil import te


def _rows(op: str, n: int, k: int):
    X = te.placeholder((n, k), name="X")
    r = te.reduce_axis((0, k), name="r")
    if op == "sum":
        S = te.compute((n,), lambda i: te.sum(X[i, r], axis=r), name="S")
    else:
        S = te.compute((n,), lambda i: te.max(X[i, r], axis=r), name="S")
    return X, S


@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.parametrize("k", [768, 256, 80, 1500, 77])
def test_row_reduction_matches_numpy(op, k):
    X, S = _rows(op, 37, k)
    s = cuvil.auto_schedule([X, S])
    mod = cuvil.build(s, [X, S])
    rng = np.random.default_rng(k)
    x = rng.standard_normal((37, k)).astype(np.float32)
    x[3, 5] = np.nan  # max keeps NaN; so does the sum
    x[4, :] = -np.inf
    y = np.empty(37, np.float32)
    mod(x, y)
    with np.errstate(invalid="ignore"):
        want = x.astype(np.float64).sum(axis=1) if op == "sum" else x.max(axis=1)
    tol = np.sqrt(k) * 1e-7 * np.abs(x[np.isfinite(x)]).max() * 4
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=tol)
    widths = isa.row_lane_widths(k)
    text = str(cuvil.lower(s, [X, S])).replace("global float32 ", "")
    if widths:  # vector lanes of partial results (past the row's end masked: 77 and 1500), not k dependent steps
        assert f"S.rf[37, {widths[0]}]" in text, text
    if len(widths) == 2:  # 4 vectors of partial results, folded in halves (shuffles), not dependent steps
        assert f"S.rf1[37, {widths[1]}]" in text, text
        ir_text = mod.get_source("llvm-unopt")
        assert re.search(r"shufflevector <16 x float> .*<8 x i32> <i32 8, i32 9", ir_text) or \
            re.search(r"shufflevector <8 x float> .*<4 x i32> <i32 4, i32 5", ir_text), "no lane fold"
