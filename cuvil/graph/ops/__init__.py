"""The graph IR's operators: one te builder per op (ONNX's operator set, plus ``Cuvil*`` ops the graph
passes introduce), registered with ``@op`` in :mod:`cuvil.graph.ops.base`.  Importers translate a
model into nodes of these ops; the graph compiler (:mod:`cuvil.graph.compile`) calls the builders.

Families: ``arith`` (element-wise math, casts), ``nn`` (convolution, matmul, pooling,
normalisation), ``layout`` (the NHWC convolution path), ``reduce``, ``resize``, ``shape`` (data
movement and shape computation).
"""
