"""Fit the polynomial coefficients of ``cuvil/codegen/vecmath.py`` (development-time tool).

    python tools/fit_vecmath.py

For each approximation it fits a polynomial ``P`` (in the variable and on the
interval given below) that minimises the maximum *relative* error of the full
approximated function, by Lawson's algorithm: iteratively reweighted least
squares on a dense Chebyshev grid, which converges to the minimax (equioscillating)
solution.  The reference functions are numpy/math in float64.  The coefficients
are then rounded to float32, the low-order ones are re-fitted with the rounded
high-order ones held fixed (so the rounding of one does not go uncorrected), and
the script prints them, with the achieved weighted error in float64 arithmetic,
in the form pasted into vecmath.py.
"""

from __future__ import annotations

import math

import numpy as np


def lawson(basis: np.ndarray, target: np.ndarray, weight: np.ndarray, iters: int = 200) -> np.ndarray:
    """Coefficients c minimising max |weight * (basis @ c - target)| (Lawson's IRLS)."""
    a, y = basis * weight[:, None], target * weight
    w = np.ones(len(y)) / len(y)
    c = np.linalg.lstsq(a, y, rcond=None)[0]
    for _ in range(iters):
        sw = np.sqrt(w)
        c = np.linalg.lstsq(a * sw[:, None], y * sw, rcond=None)[0]
        err = np.abs(a @ c - y)
        w = w * err
        s = w.sum()
        if s == 0:
            break
        w /= s
    return c


def fit(name: str, lo: float, hi: float, powers: list[int], func, n: int = 4000) -> np.ndarray:
    """Fit ``P(t) = sum_k c_k * t**powers[k]`` to ``target`` on [lo, hi], minimising the maximum of
    ``weight * |P - target|`` where ``func(t)`` returns ``(target, weight)``: the weight turns an
    error of P into the relative (or, for erfc_q, absolute) error of the approximated function.
    Prints the float32-rounded coefficients; returns the unrounded float64 fit."""
    t = (lo + hi) / 2 + (hi - lo) / 2 * np.cos(np.linspace(0, np.pi, n))
    target, weight = func(t)
    basis = np.stack([t**p for p in powers], axis=1)
    c = lawson(basis, target, weight)
    # round to float32 from the highest power down, re-fitting the rest each time
    out = np.zeros(len(powers))
    rest = target.copy()
    for k in range(len(powers) - 1, -1, -1):
        out[k] = np.float32(lawson(basis[:, : k + 1], rest, weight)[k])
        rest = rest - out[k] * basis[:, k]
    err = np.max(np.abs(rest * weight))
    print(f"# {name}: powers {powers} on [{lo:.6g}, {hi:.6g}], max weighted error {err:.3g} "
          f"(float64 arithmetic; {err / 2**-24:.3f} ulp of float32)")
    print(f"{name.upper()} = ({', '.join(f'{float(x)!r}' for x in out)})")
    return c


def main() -> None:
    ln2 = math.log(2)
    # exp: e^r = 1 + r + r^2 * P(r), |r| <= ln2/2 (1% margin); relative error of e^r
    fit("exp_p", -ln2 / 2 * 1.01, ln2 / 2 * 1.01, list(range(5)),
        lambda r: ((np.exp(r) - 1 - r) / r**2, r**2 / np.exp(r)))
    # log: log(1+f) = f + f^2 * P(f), f in [sqrt(1/2)-1, sqrt(2)-1]; relative error of log1p
    fit("log_p", math.sqrt(0.5) - 1, math.sqrt(2) - 1, list(range(9)),
        lambda f: ((np.log1p(f) - f) / f**2, f**2 / np.abs(np.log1p(f))))
    # tanh: tanh(x) = x + x^3 * P(u), u = x^2 < 0.9^2; relative error of tanh
    fit("tanh_p", 1e-4, 0.9**2, list(range(7)),
        lambda u: ((np.tanh(np.sqrt(u)) - np.sqrt(u)) / u**1.5, u**1.5 / np.tanh(np.sqrt(u))))
    # erf: erf(x) = x + x * P(u), u = x^2 < 1; relative error of erf
    erf, erfc = np.vectorize(math.erf), np.vectorize(math.erfc)
    fit("erf_p", 1e-6, 1.0, list(range(7)),
        lambda u: ((erf(np.sqrt(u)) - np.sqrt(u)) / np.sqrt(u), np.sqrt(u) / erf(np.sqrt(u))))
    # erf, 1 <= x <= 4: erfc(x) = exp(-x^2) * Q(x); absolute error of erf = 1 - erfc (ulp: 2^-24 there)
    fit("erfc_q", 1.0, 4.0, list(range(10)), lambda x: (erfc(x) * np.exp(x**2), np.exp(-(x**2))))
    # ln 2 in two parts: LN2_HI has 15 significant bits, so n * LN2_HI is exact for |n| < 2^9
    hi = float((np.array(ln2, np.float32).view(np.uint32) & np.uint32(0xFFFFFE00)).view(np.float32))
    print(f"LN2_HI = {hi!r}\nLN2_LO = {ln2 - hi!r}")


if __name__ == "__main__":
    main()
