"""The ATen -> graph IR table, part 3: normalisation, linear algebra, convolution, attention, recurrent
layers and pooling (see :mod:`cuvil.frontend.torch_ops` for the translations' contract)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cuvil.errors import UnsupportedOpError
from cuvil.frontend.torch import Builder, node_meta
from cuvil.frontend.torch_ops import _axis, _dt, _rank, _shape, aten


@aten("_softmax.default", "softmax.int", "_log_softmax.default", "log_softmax.int")
def _softmax(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dt = _dt(n)
    op_type = "LogSoftmax" if "log_softmax" in str(n.target) else "Softmax"
    return b.one(op_type, [b.tensor(args[0], dt)], dt, axis=_axis(args[1], _rank(n.args[0])))


@aten("layer_norm.default")
def _layer_norm(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dt = _dt(n)
    shape = list(args[1])
    w = args[2] if len(args) > 2 else kw.get("weight")
    bias = args[3] if len(args) > 3 else kw.get("bias")
    eps = args[4] if len(args) > 4 else kw.get("eps", 1e-5)
    w = w if w is not None else b.const(np.ones(shape, dt))
    bias = bias if bias is not None else b.const(np.zeros(shape, dt))
    return b.one("LayerNormalization", [b.tensor(args[0], dt), w, bias], dt, axis=-len(shape), epsilon=float(eps))


@aten("native_layer_norm.default")
def _native_layer_norm(b: Builder, n: Any, args: tuple, kw: dict) -> tuple:
    """What aot_autograd leaves of ``layer_norm``: the normalised value (the mean and reciprocal standard
    deviation it also returns are for the backward pass, not computed)."""
    return _layer_norm(b, n, args, kw), None, None


@aten("_native_batch_norm_legit_no_training.default")
def _batch_norm(b: Builder, n: Any, args: tuple, kw: dict) -> tuple:
    """Inference: the running statistics.  Of the three results only the first is computed."""
    dt = _dt(n)
    x, w, bias, mean, var = args[:5]
    eps = args[6] if len(args) > 6 else kw.get("eps", 1e-5)
    c = _shape(n.args[0])[1]
    w = w if w is not None else b.const(np.ones(c, dt))
    bias = bias if bias is not None else b.const(np.zeros(c, dt))
    out = b.one("BatchNormalization", [x, w, bias, mean, var], dt, epsilon=float(eps))
    return (out, None, None)


@aten("_native_batch_norm_legit.no_stats")
def _batch_norm_no_stats(b: Builder, n: Any, args: tuple, kw: dict) -> tuple:
    """Normalised by the input's own statistics per channel (dimension 1), as InstanceNorm writes it
    (on the input reshaped to ``1 x N*C x ...``): ``(x - mean) / sqrt(var + eps) * w + bias``, with the
    biased variance.  Of the three results only the first is computed."""
    dt = _dt(n)
    x, w, bias = b.tensor(args[0], dt), args[1], args[2]
    eps = args[5] if len(args) > 5 else kw.get("eps", 1e-5)
    rank = _rank(n.args[0])
    out = _normalised(b, x, b.const([0] + list(range(2, rank)), "int64"), eps, dt)
    return (_per_channel_affine(b, out, w, bias, rank, dt), None, None)


def _normalised(b: Builder, x: str, axes: str, eps: float, dt: str) -> str:
    """``(x - mean) / sqrt(var + eps)`` over ``axes``, the variance biased (what the norms of training mode
    compute)."""
    d = b.one("Sub", [x, b.one("ReduceMean", [x, axes], dt, keepdims=1)], dt)
    var = b.one("ReduceMean", [b.one("Mul", [d, d], dt), axes], dt, keepdims=1)
    return b.one("Div", [d, b.one("Sqrt", [b.one("Add", [var, b.const(eps, dt)], dt)], dt)], dt)


def _per_channel_affine(b: Builder, out: str, w: Any, bias: Any, rank: int, dt: str) -> str:
    """``out * w + bias`` with ``w`` and ``bias`` (each optional) per channel, dimension 1 of ``rank``."""
    per_channel = b.const([-1] + [1] * (rank - 2), "int64")
    if w is not None:
        out = b.one("Mul", [out, b.one("Reshape", [b.tensor(w, dt), per_channel], dt)], dt)
    if bias is not None:
        out = b.one("Add", [out, b.one("Reshape", [b.tensor(bias, dt), per_channel], dt)], dt)
    return out


@aten("native_group_norm.default")
def _group_norm(b: Builder, n: Any, args: tuple, kw: dict) -> tuple:
    """``GroupNorm``: x (N, C, ...) seen as (N, groups, rest), each row normalised by its mean and biased
    variance, ``(x - mean) / sqrt(var + eps)``, reshaped back, then ``* w + bias`` per channel
    (dimension 1).  Of the three results (the mean and reciprocal standard deviation are for the
    backward pass) only the first is computed."""
    dt = _dt(n)
    x, w, bias = b.tensor(args[0], dt), args[1], args[2]
    groups, eps = int(args[6]), float(args[7])
    rank = _rank(n.args[0])
    rows = b.one("Reshape", [x, b.const([0, groups, -1], "int64")], dt)
    normed = _normalised(b, rows, b.const([2], "int64"), eps, dt)
    out = b.one("Reshape", [normed, b.one("Shape", [x], "int64")], dt)
    return (_per_channel_affine(b, out, w, bias, rank, dt), None, None)


# -- contractions and convolutions -----------------------------------------------------------


def _transposed(b: Builder, w: str) -> str:
    """``w.T`` of a 2-D weight: a constant when ``w`` is one (folded here, once per weight: an unrolled
    LSTM's steps share it, and so its packed copy), else a Transpose."""
    if ("T", w) not in b.memo:
        b.memo["T", w] = b.const(np.ascontiguousarray(b.inits[w].T)) if w in b.inits else \
            b.one("Transpose", [w], b.dtypes[w], perm=[1, 0])
    return b.memo["T", w]


@aten("linear.default")
def _linear(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dt = _dt(n)
    x, w = b.tensor(args[0], dt), args[1]
    bias = args[2] if len(args) > 2 else kw.get("bias")
    if _rank(n.args[0]) == 2:
        return b.one("Gemm", [x, w] + ([bias] if bias is not None else []), dt, transB=1)
    y = b.one("MatMul", [x, _transposed(b, w)], dt)
    return b.one("Add", [y, bias], dt) if bias is not None else y


@aten("addmm.default")
def _addmm(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    dt = _dt(n)
    beta, alpha = float(kw.get("beta", 1)), float(kw.get("alpha", 1))
    return b.one("Gemm", [args[1], args[2], args[0]], dt, alpha=alpha, beta=beta)


@aten("mm.default", "bmm.default", "matmul.default")
def _matmul(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    return b.one("MatMul", [args[0], args[1]], _dt(n))


@aten("convolution.default")
def _convolution(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = args
    dt = _dt(n)
    k = len(_shape(n.args[1])) - 2
    stride, padding, dilation = (list(v) * (k if len(v) == 1 else 1) for v in (stride, padding, dilation))
    attrs: dict[str, Any] = {"strides": stride, "pads": padding + padding, "dilations": dilation, "group": groups,
                             "kernel_shape": list(_shape(n.args[1])[2:])}
    ins = [x, w] + ([bias] if bias is not None else [])
    if transposed:
        attrs["output_padding"] = list(output_padding) * (k if len(output_padding) == 1 else 1)
        return b.one("ConvTranspose", ins, dt, **attrs)
    return b.one("Conv", ins, dt, **attrs)


@aten("scaled_dot_product_attention.default")
def _sdpa(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    """softmax(q @ k^T * scale + mask) @ v, as the ONNX exporters write it (the graph compiler's
    contraction, softmax and fusion passes apply)."""
    dt = _dt(n)
    q, k, v = args[:3]
    mask = args[3] if len(args) > 3 else kw.get("attn_mask")
    dropout = args[4] if len(args) > 4 else kw.get("dropout_p", 0.0)
    causal = args[5] if len(args) > 5 else kw.get("is_causal", False)
    scale = kw.get("scale", args[6] if len(args) > 6 else None)
    if kw.get("enable_gqa", False):
        raise UnsupportedOpError("enable_gqa=True (repeat the key/value heads before the call)")
    if dropout:
        raise UnsupportedOpError("dropout_p > 0 is random; cuvil compiles inference")
    qs, ks = _shape(n.args[0]), _shape(n.args[1])
    if scale is None:
        if not isinstance(qs[-1], int):
            raise UnsupportedOpError("a symbolic head size without an explicit scale")
        scale = 1.0 / math.sqrt(qs[-1])
    rank = len(ks)
    kt = b.one("Transpose", [k], dt, perm=list(range(rank - 2)) + [rank - 1, rank - 2])
    s = b.one("MatMul", [b.one("Mul", [q, b.const(scale, dt)], dt), kt], dt)
    if causal:
        lq, lk = qs[-2], ks[-2]
        if not (isinstance(lq, int) and isinstance(lk, int)):
            ones = b.one("Expand", [b.const(1, "bool"), b.ints([_sym(b, n.args[0], -2), _sym(b, n.args[1], -2)])],
                         "bool")
            keep = b.one("Trilu", [ones], "bool", upper=0)
        else:
            keep = b.const(np.tril(np.ones((lq, lk), bool)))
        mask = keep if mask is None else b.one("And", [keep, b.tensor(mask, "bool")], "bool")
    if mask is not None:
        if b.dtypes.get(mask) == "bool":
            s = b.one("Where", [mask, s, b.const(-np.inf, dt)], dt)
        else:
            s = b.one("Add", [s, b.tensor(mask, dt)], dt)
    p = b.one("Softmax", [s], dt, axis=-1)
    return b.one("MatMul", [p, v], dt)


@aten("_scaled_dot_product_flash_attention_for_cpu.default")
def _sdpa_cpu(b: Builder, n: Any, args: tuple, kw: dict) -> tuple:
    """The CPU attention kernel aot_autograd lowers ``scaled_dot_product_attention`` to: (query, key,
    value, dropout_p, is_causal; attn_mask, scale) -> (output, logsumexp), the second for the backward
    pass (not computed)."""
    q, k, v = args[:3]
    dropout = args[3] if len(args) > 3 else kw.get("dropout_p", 0.0)
    causal = args[4] if len(args) > 4 else kw.get("is_causal", False)
    return _sdpa(b, n, (q, k, v, kw.get("attn_mask"), dropout, causal), {"scale": kw.get("scale")}), None


@aten("mkldnn_rnn_layer.default")
def _rnn_layer(b: Builder, n: Any, args: tuple, kw: dict) -> tuple:
    """One LSTM layer as aot_autograd writes ``nn.LSTM`` on the CPU (under dynamo's ``allow_rnn``):
    (input [seq, batch, in], w_ih, w_hh, b_ih, b_hh, hx, cx, reverse, batch_sizes, mode, hidden_size,
    num_layers, has_biases, bidirectional, batch_first, train) -> (output, hy, cy, workspace), as one
    ONNX LSTM node (the graph compiler unrolls it as it does an imported LSTM).  torch's gates are
    (i, f, g, o), ONNX's (i, o, f, c): the constant weights are reordered here."""
    x, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse = args[:8]
    # one layer and direction per call (num_layers and bidirectional describe the whole module)
    mode, hidden, _layers, has_bias, _bidir, batch_first, train = args[9:16]
    if mode != 2 or batch_first or train or args[8]:
        raise UnsupportedOpError("only inference LSTM layers in time-major layout without packed sequences")
    weights = [w_ih, w_hh] + ([b_ih, b_hh] if has_bias else [])
    if any(w not in b.inits for w in weights):
        raise UnsupportedOpError("LSTM weights that are not constants (frozen parameters)")
    dt = _dt(n)

    def gates(w: str) -> np.ndarray:  # (i, f, g, o) -> (i, o, f, g) blocks of the rows
        i, f, g, o = np.split(b.inits[w], 4, axis=0)
        return np.concatenate([i, o, f, g], axis=0)

    bias = np.concatenate([gates(b_ih), gates(b_hh)]) if has_bias else np.zeros(8 * hidden, dt)
    axis0 = b.const([0], "int64")
    states = [b.one("Unsqueeze", [s, axis0], dt) if _rank(a) == 2 else s for s, a in ((hx, n.args[5]), (cx, n.args[6]))]
    ins = [x, b.const(gates(w_ih)[None]), b.const(gates(w_hh)[None]), b.const(bias[None]), "", *states]
    y, yh, yc = b.emit("LSTM", ins, dt, 3, hidden_size=int(hidden), direction="reverse" if reverse else "forward")
    y = b.one("Squeeze", [y, b.const([1], "int64")], dt)
    outs = [b.one("Squeeze", [s, axis0], dt) if len(m.shape) == 2 else s for s, m in zip((yh, yc), node_meta(n)[1:3])]
    return y, *outs, None


def _sym(b: Builder, a: Any, axis: int) -> Any:
    """Size ``axis`` of FX argument ``a``: an int, or a Sym read from the value's shape."""
    d = _shape(a)[axis]
    if isinstance(d, int):
        return d
    raise UnsupportedOpError(f"a symbolic size ({d}) here")


@aten("max_pool2d_with_indices.default", "max_pool2d.default", "max_pool1d.default", "max_pool3d_with_indices.default")
def _max_pool(b: Builder, n: Any, args: tuple, kw: dict) -> Any:
    x, kernel = args[0], list(args[1])
    k = len(kernel)
    stride = list(args[2]) if len(args) > 2 and args[2] else kernel
    padding = list(args[3]) if len(args) > 3 else [0]
    dilation = list(args[4]) if len(args) > 4 else [1]
    ceil = bool(args[5]) if len(args) > 5 else False
    stride, padding, dilation = (v * (k if len(v) == 1 else 1) for v in (stride, padding, dilation))
    out = b.one("MaxPool", [x], _dt(n), kernel_shape=kernel, strides=stride, pads=padding + padding,
                dilations=dilation, ceil_mode=int(ceil))
    return (out, None) if "with_indices" in str(n.target) else out


@aten("avg_pool2d.default", "avg_pool1d.default", "avg_pool3d.default")
def _avg_pool(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    x, kernel = args[0], list(args[1])
    k = len(kernel)
    stride = list(args[2]) if len(args) > 2 and args[2] else kernel
    padding = list(args[3]) if len(args) > 3 else [0]
    ceil = bool(args[4]) if len(args) > 4 else False
    include = bool(args[5]) if len(args) > 5 else True
    if len(args) > 6 and args[6] is not None:
        raise UnsupportedOpError("divisor_override")
    stride, padding = (v * (k if len(v) == 1 else 1) for v in (stride, padding))
    return b.one("AveragePool", [x], _dt(n), kernel_shape=kernel, strides=stride, pads=padding + padding,
                 ceil_mode=int(ceil), count_include_pad=int(include))


@aten("_adaptive_avg_pool2d.default", "adaptive_avg_pool2d.default")
def _adaptive_avg_pool(b: Builder, n: Any, args: tuple, kw: dict) -> str:
    out = list(args[1])
    h, w = _shape(n.args[0])[-2:]
    if out == [1, 1]:
        return b.one("GlobalAveragePool", [args[0]], _dt(n))
    if isinstance(h, int) and isinstance(w, int) and h % out[0] == 0 and w % out[1] == 0:
        kern = [h // out[0], w // out[1]]
        return b.one("AveragePool", [args[0]], _dt(n), kernel_shape=kern, strides=kern)
    raise UnsupportedOpError(f"adaptive pooling of {h}x{w} to {out[0]}x{out[1]} (not a whole window)")
