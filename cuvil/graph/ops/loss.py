"""ONNX training losses, as models exported with their loss compute them: NegativeLogLikelihoodLoss and
SoftmaxCrossEntropyLoss."""

from __future__ import annotations

import math
from typing import Any

from cuvil import dtype as dt
from cuvil import te
from cuvil.errors import DTypeError
from cuvil.graph.ops.base import NodeCtx, Shaped, op

_logaddexp = te.comm_reducer(lambda a, b: te.max(a, b) + te.log(te.exp(-te.abs(a - b)) + 1.0),
                             lambda t: -math.inf, name="logaddexp")


def _reduction(ctx: NodeCtx) -> str:
    r = ctx.attr("reduction", "mean")
    r = r.decode() if isinstance(r, bytes) else str(r)
    if r not in ("none", "sum", "mean"):
        raise ctx.error(f"reduction {r!r} is not none, sum or mean")
    return r


def _loss(ctx: NodeCtx, logp: Any, n: int, c: int, d: int) -> Any:
    """The loss of log-probabilities ``logp(i, class, j)`` (N, C, D) at the targets (input 1, (N, D) seen flat):
    ``-logp[n, t, d] * w[t]`` (``w`` = input 2, or 1), 0 where ``t == ignore_index``; reduced by ``reduction``
    (``mean``: divided by the sum of the weights of the targets not ignored)."""
    dtype = ctx.dtype(0)
    if ctx.dtype(1) not in ("int32", "int64"):
        raise DTypeError(f"{ctx.node}: target (input 1) is {ctx.dtype(1)}; ONNX wants int32 or int64")
    ts = ctx.shape(1)
    xs = ctx.shape(0)
    if ts != xs[:1] + xs[2:]:
        raise ctx.error(f"target {list(ts)} must have the input's shape {list(xs)} without the class axis")
    weighted = ctx.has(2)
    if weighted and (ctx.shape(2) != (c,) or ctx.dtype(2) != dtype):
        raise ctx.error(f"weight {list(ctx.shape(2))} ({ctx.dtype(2)}) must be a {dtype} vector of the {c} classes")
    ignore = ctx.attr("ignore_index")
    reduction = _reduction(ctx)
    t0 = ctx.tensor(1, (n, d))
    w = ctx.tensor(2) if weighted else None
    zero, one = te.const(0, dtype), te.const(1, dtype)

    def target(i: Any, j: Any) -> Any:
        return te.cast(t0[i, j], "int64")

    def keep(i: Any, j: Any) -> Any:
        return target(i, j) != int(ignore) if ignore is not None else None

    def weight(i: Any, j: Any) -> Any:  # the weight of the target at (i, j), 0 where it is ignored
        v = w[target(i, j)] if weighted else one
        k = keep(i, j)
        return v if k is None else te.if_then_else(k, v, zero)

    def loss(i: Any, j: Any) -> Any:
        v = -logp(i, target(i, j), j)
        if weighted:
            v = v * w[target(i, j)]
        k = keep(i, j)
        return v if k is None else te.if_then_else(k, v, zero)

    per = te.compute((n, d), loss, name="loss")
    if reduction == "none":
        return Shaped(per, ts)
    a, b = te.reduce_axis((0, n), name="a"), te.reduce_axis((0, d), name="b")
    total = te.compute((), lambda: te.sum(per[a, b], axis=[a, b]), name="loss_sum")
    if reduction == "sum":
        return total
    if not weighted and ignore is None:
        return te.compute((), lambda: total[()] * (1.0 / (n * d)), name="loss_mean")
    wa, wb = te.reduce_axis((0, n), name="wa"), te.reduce_axis((0, d), name="wb")
    wsum = te.compute((), lambda: te.sum(weight(wa, wb), axis=[wa, wb]), name="weight_sum")
    return te.compute((), lambda: total[()] / wsum[()], name="loss_mean")


def _layout(ctx: NodeCtx) -> tuple[int, int, int]:
    xs = ctx.shape(0)
    if not dt.is_float(ctx.dtype(0)):
        raise DTypeError(f"{ctx.node}: input 0 is {ctx.dtype(0)}; this loss needs a float tensor")
    if len(xs) < 2:
        raise ctx.error(f"the input {list(xs)} must have rank >= 2 (N, C, ...)")
    if math.prod(xs) == 0:
        raise ctx.error(f"the input {list(xs)} is empty")
    return xs[0], xs[1], math.prod(xs[2:])


@op("NegativeLogLikelihoodLoss")
def nll_loss(ctx: NodeCtx) -> list:
    """The negative log-likelihood of the targets, input 0 (N, C, d...) holding log-probabilities."""
    n, c, d = _layout(ctx)
    x = ctx.tensor(0, (n, c, d))
    return [_loss(ctx, lambda i, k, j: x[i, k, j], n, c, d)]


@op("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy_loss(ctx: NodeCtx) -> list:
    """NegativeLogLikelihoodLoss of the log-softmax of the scores over the classes (axis 1); the second
    output, when asked for, is that log-softmax."""
    n, c, d = _layout(ctx)
    x = ctx.tensor(0, (n, c, d))
    k = te.reduce_axis((0, c), name="k")
    # log(sum(exp(x))) over the classes in one pass: each step is log(exp(a) + exp(b)), computed as
    # max(a, b) + log(1 + exp(-|a - b|)) so that it cannot overflow.  (Two passes, a max then a sum of
    # exp(x - max), would be cheaper, but the auto-scheduler places the max inside the sum's loop while
    # the loss also reads it: "buffer 'cmax' is not allocated here".)
    lse = te.compute((n, d), lambda i, j: _logaddexp(x[i, k, j], axis=k), name="logsumexp")
    outs: list = [_loss(ctx, lambda i, k, j: x[i, k, j] - lse[i, j], n, c, d)]
    if len(ctx.node.outputs) > 1:
        logp = te.compute((n, c, d), lambda i, k, j: x[i, k, j] - lse[i, j], name="log_prob")
        outs.append(Shaped(logp, ctx.shape(0)))
    return outs
