"""Float neural-network operators: convolutions, matrix products, pooling, normalisations, attention and
the LLM operators (the list: :mod:`cuvil.graph.ops`).  Importing this package registers their builders."""

from cuvil.graph.ops.nn import (  # noqa: F401  (each registers its builders when imported)
    attention,
    conv,
    convt,
    llm,
    matmul,
    nhwc,
    norm,
    pool,
    rotary,
)
