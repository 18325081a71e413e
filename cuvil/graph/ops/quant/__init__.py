"""Quantised operators: int8 (and 4-bit weight) QuantizeLinear and friends, integer matrix products and
convolutions, com.microsoft's QLinear* operators, and the integer contractions they share (the list:
:mod:`cuvil.graph.ops`).  Importing this package registers their builders."""

from cuvil.graph.ops.quant import (  # noqa: F401  (each registers its builders when imported)
    conv,
    linear,
    matmul,
    ms,
    nbits,
)
