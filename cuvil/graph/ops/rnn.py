"""ONNX's recurrent operators LSTM, GRU and RNN.

They have no kernel of their own: the graph pass :func:`cuvil.graph.expand_rnn.expand_rnn` (run by
:func:`cuvil.graph.passes.optimize`) unrolls each into MatMul and element-wise nodes.  This builder
is reached only by a node that pass kept, and says why it was kept.
"""

from __future__ import annotations

from cuvil.graph.expand_rnn import UNEXPANDED
from cuvil.graph.ops.base import NodeCtx, op


@op("LSTM", "GRU", "RNN", since=7)
def recurrent(ctx: NodeCtx) -> list:
    why = ctx.attr(UNEXPANDED)
    if why is None:
        raise ctx.unsupported("recurrent nodes are unrolled by the graph passes (cuvil.graph.passes.optimize); "
                              "this graph was compiled without them")
    raise ctx.unsupported(f"cannot unroll it: {why}")
