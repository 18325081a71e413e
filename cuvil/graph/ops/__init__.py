"""The graph IR's operators: one te builder per op (ONNX's operator set, the com.microsoft operators that
onnxruntime's tools write, and the ``Cuvil*`` operators the graph passes introduce), registered with
``@op`` in :mod:`cuvil.graph.ops.base`.  Importers translate a model into nodes of these ops; the graph
compiler (:mod:`cuvil.graph.compile`) calls the builders.

Importing this package registers every family: ``base`` (the registry, :class:`~cuvil.graph.ops.base.NodeCtx`
and the helpers builders share) comes first and imports no family; then the families below, each of which
imports ``base`` and, downward, the few families it builds on.  No import cycle runs through these modules
(tests/unit/test_layering.py checks it).

Operators of any dtype (this folder):

- ``arith``: element-wise activations, arithmetic with broadcasting, comparisons, logic, Cast, Where;
- ``bitwise``: BitwiseAnd/Or/Xor/Not, BitShift;
- ``control``: CuvilEmbeddingBag (an embedding bag's Loop) and the control-flow operators it replaces;
- ``einsum``: Einsum;
- ``index``: GatherElements, GatherND, ScatterND, ScatterElements, OneHot;
- ``loss``: NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss;
- ``misc``: Trilu, CumSum/CumProd, Mod, DepthToSpace, SpaceToDepth, trigonometry, TopK, Swish, IsInf,
  Shrink, EyeLike, CenterCropPad;
- ``reduce``: the Reduce* operators, ArgMax/ArgMin;
- ``resize``: Resize, Upsample;
- ``rnn``: LSTM, GRU, RNN (unrolled by a graph pass; the builder says why a node was kept);
- ``shape``: data movement and shapes (Reshape, Transpose, Concat, Slice, Gather, Pad, Shape, Range...).

Float neural-network operators (:mod:`cuvil.graph.ops.nn`): ``conv`` (Conv; ``winograd``, and ``window``
for the attributes of every windowed operator), ``convt`` (ConvTranspose), ``nhwc`` (the channels-last
CuvilConvNHWC and CuvilGlobalAveragePoolNHWC), ``matmul`` (Gemm, MatMul), ``pool`` (MaxPool, AveragePool,
the global pools, LRN), ``norm`` (BatchNormalization, LayerNormalization, RMSNormalization, GroupNormalization,
InstanceNormalization, MeanVarianceNormalization, LpNormalization, Softmax, LogSoftmax, Hardmax),
``attention`` (Attention), ``rotary`` (RotaryEmbedding, ONNX's and com.microsoft's), ``llm`` (com.microsoft's
SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization, GroupQueryAttention); and ``bf16``, the
bfloat16 weight panels of their contractions (no operator of its own).

Quantised operators (:mod:`cuvil.graph.ops.quant`): ``linear`` (QuantizeLinear, DequantizeLinear,
DynamicQuantizeLinear), ``matmul`` (MatMulInteger, QLinearMatMul), ``conv`` (ConvInteger, QLinearConv,
the int8 max pool), ``ms`` (com.microsoft's QLinear* and QGemm), ``nbits`` (MatMulNBits, 4-bit weights);
and the integer contractions they share, ``kernels`` and ``conv_nhwc`` (no operators of their own).
"""

from cuvil.graph.ops import (  # noqa: F401  (each registers its builders when imported)
    arith,
    base,  # noqa: F401  (the registry, before any family registers in it)
    bitwise,
    control,
    einsum,
    index,
    loss,
    misc,
    nn,
    quant,
    reduce,
    resize,
    rnn,
    shape,
)
