"""The reference quantized results are checked against: the QDQ semantics, never a vendor's fused kernels.

onnxruntime's fused integer kernels (QLinearConv, QLinearMatMul, MatMulInteger, ConvInteger, com.microsoft
QGemm, and the QLinearConv / QLinearMatMul its graph optimizer makes of DQ -> Conv / MatMul -> Q) take
their u8 x s8 products through MLAS.  On x86 CPUs without VNNI (AVX2, or AVX-512 without VNNI: AMD Zen 3,
Skylake-X) MLAS multiplies with ``vpmaddubsw``, which adds each pair of products into a *saturating*
16-bit sum (255 * 127 * 2 = 64770 does not fit), so their results there lie a few output steps from the
semantics (3-11 steps measured on a Zen 3); with VNNI (``vpdpbusd``: four products summed in 32 bits)
they are exact.  cuvil computes exact int32 sums on every CPU, so a test takes as the truth:

- for a model in QDQ form (DequantizeLinear -> float op -> QuantizeLinear): onnxruntime with every graph
  optimization off (:func:`semantics_session`), so that no QDQ group becomes a fused integer kernel and
  the float ops run as written;
- for an integer operator built by hand: :func:`matmul_integer` / :func:`conv_integer` (exact int64
  sums in numpy) and :func:`requantize` (ONNX's requantization as onnxruntime and cuvil compute it:
  the multiplier ``x_scale * w_scale / y_scale`` in float32, ``float32(acc) * multiplier`` rounded half to
  even, plus the zero point, saturated): cuvil's integer results must equal them bit for bit;
- for a model with integer operators (a QOperator file, com.microsoft's QLinear operators, the
  MatMulInteger / ConvInteger of ``quantize_dynamic``): the same model with each of them written in the
  plain operators that define it (:func:`semantics_model`: DQ -> float operator -> Q, or exact integer
  arithmetic), run as a QDQ model is.

onnxruntime's fused result (its default session) may be checked too, as a second, labelled check
(:func:`check_fused`, :func:`fused_differs`): held to the same bound as cuvil on an x86 CPU with VNNI, where
its kernels are exact; elsewhere a difference is reported (a :class:`FusedKernelDifference` warning naming
the cause), not failed.
"""

from __future__ import annotations

import platform
import warnings
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

I8 = {"uint8": (0, 255), "int8": (-128, 127)}


# -- the host's CPU, as onnxruntime's MLAS sees it ----------------------------------------------------------------


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The flags of the host CPU (/proc/cpuinfo's, as Linux spells them: ``avx512_vnni``, ``avx_vnni``).

    MLAS picks its kernels from the real CPU (CPUID), not from cuvil's target, so this reads the CPU; where
    /proc/cpuinfo is missing, LLVM's host features (``cuvil.Target("llvm")``) stand in, renamed."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    import cuvil

    rename = {"avx512vnni": "avx512_vnni", "avxvnni": "avx_vnni"}
    return frozenset(rename.get(f, f) for f in cuvil.Target("llvm").enabled_features)


X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
# MLAS's u8 x s8 kernels sum exactly in 32 bits (vpdpbusd) only with AVX512-VNNI or AVX-VNNI; without, their
# vpmaddubsw saturates each 16-bit pair sum.  Off x86 their exactness is not established here: reported only.
FUSED_EXACT = X86 and bool(cpu_flags() & {"avx512_vnni", "avx_vnni"})
WHY_NOT_EXACT = ("onnxruntime's MLAS u8 x s8 kernels use vpmaddubsw, whose 16-bit pair sums saturate, on an x86 "
                 "CPU without VNNI" if X86 else f"onnxruntime's fused integer kernels on {platform.machine()} are "
                 "not known to be exact")


class FusedKernelDifference(UserWarning):
    """onnxruntime's fused kernels gave a result away from the semantics on a CPU where that is known."""


# -- onnxruntime sessions ---------------------------------------------------------------------------------------


def _ort() -> Any:
    import onnxruntime

    return onnxruntime


def semantics_session(model: str | bytes) -> Any:
    """onnxruntime with every graph optimization off: Q / DQ run as the element-wise operators ONNX defines
    around float Conv / MatMul / Gemm (no QDQ group fused into an integer kernel)."""
    ort = _ort()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def run_semantics(model: str | bytes, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    return semantics_session(model).run(None, dict(feeds))


def run_fused(model: str | bytes, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """onnxruntime's default session: its graph optimizer fuses QDQ groups into integer kernels."""
    ort = _ort()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, dict(feeds))


# -- integer operators in numpy -----------------------------------------------------------------------------------


def _i64(v: Any) -> np.ndarray:
    return np.asarray(v).astype(np.int64)


def multiplier(x_scale: Any, w_scale: Any, y_scale: Any) -> np.ndarray:
    """The requantization multiplier ``x_scale * w_scale / y_scale``, each operation in float32 (the order
    onnxruntime computes it in, and cuvil: ``cuvil.graph.ops.quant_mm.requant_multiplier``)."""
    f = np.float32
    return (f(x_scale) * np.asarray(w_scale, f) / f(y_scale)).astype(f)


def requantize(acc: np.ndarray, mult: Any, zero_point: Any, qtype: str) -> np.ndarray:
    """``saturate(round_half_even(float32(acc) * mult) + zero_point)`` as ``qtype``."""
    lo, hi = I8[qtype]
    v = np.rint(np.asarray(acc).astype(np.float32) * np.asarray(mult, np.float32))  # float32 product, ties to even
    return np.clip(v.astype(np.float64) + int(zero_point), lo, hi).astype(qtype)


def matmul_integer(a: np.ndarray, b: np.ndarray, a_zero: Any = 0, b_zero: Any = 0) -> np.ndarray:
    """MatMulInteger: ``(a - a_zero) @ (b - b_zero)`` summed exactly (int64), as int32; ``b_zero`` a scalar
    or one per column."""
    acc = np.matmul(_i64(a) - _i64(a_zero), _i64(b) - _i64(b_zero))
    assert np.abs(acc).max(initial=0) < 2**31, "the int32 sum overflows"
    return acc.astype(np.int32)


def conv_integer(x: np.ndarray, w: np.ndarray, x_zero: Any = 0, w_zero: Any = 0, pads: Sequence[int] | None = None,
                 strides: Sequence[int] | None = None, dilations: Sequence[int] | None = None,
                 group: int = 1) -> np.ndarray:
    """ConvInteger (2-D, NCHW): ``(x - x_zero) * (w - w_zero)`` over windows of ``x`` padded with ``x_zero``
    (a padded tap contributes 0), summed exactly (int64), as int32; ``w_zero`` a scalar or one per output
    channel.  ONNX's ``pads`` order: begins, then ends."""
    nd = w.ndim - 2
    pads = list(pads) if pads is not None else [0] * (2 * nd)
    strides, dil = list(strides or [1] * nd), list(dilations or [1] * nd)
    wz = _i64(w_zero).reshape((-1,) + (1,) * (w.ndim - 1)) if np.ndim(w_zero) else _i64(w_zero)
    xs = np.pad(_i64(x) - _i64(x_zero), [(0, 0), (0, 0)] + list(zip(pads[:nd], pads[nd:])))  # padded taps: 0
    ws = _i64(w) - wz
    out = [(xs.shape[2 + d] - dil[d] * (w.shape[2 + d] - 1) - 1) // strides[d] + 1 for d in range(nd)]
    m, cg = w.shape[:2]
    per = m // group
    acc = np.zeros((x.shape[0], m, *out), np.int64)
    for tap in np.ndindex(*w.shape[2:]):
        win = xs[(slice(None), slice(None)) + tuple(
            slice(tap[d] * dil[d], tap[d] * dil[d] + (out[d] - 1) * strides[d] + 1, strides[d]) for d in range(nd))]
        for g in range(group):
            taps = ws[(slice(g * per, (g + 1) * per), slice(None)) + tap]
            acc[:, g * per:(g + 1) * per] += np.einsum("mc,nc...->nm...", taps, win[:, g * cg:(g + 1) * cg])
    assert np.abs(acc).max(initial=0) < 2**31, "the int32 sum overflows"
    return acc.astype(np.int32)


def qlinear_matmul(a: np.ndarray, sa: Any, za: Any, b: np.ndarray, sb: Any, zb: Any, sy: Any, zy: Any) -> np.ndarray:
    """QLinearMatMul: the exact product requantized (:func:`requantize`) to ``zy``'s type."""
    zy = np.asarray(zy)
    return requantize(matmul_integer(a, b, za, zb), multiplier(sa, sb, sy), zy, zy.dtype.name)


def qlinear_conv(x: np.ndarray, sx: Any, zx: Any, w: np.ndarray, sw: Any, zw: Any, sy: Any, zy: Any,
                 bias: np.ndarray | None = None, **attrs: Any) -> np.ndarray:
    """QLinearConv: the exact convolution plus the int32 bias, requantized per output channel."""
    acc = conv_integer(x, w, zx, zw, **attrs).astype(np.int64)
    if bias is not None:
        acc = acc + _i64(bias).reshape(-1, 1, 1)
    m = multiplier(sx, sw, sy)
    zy = np.asarray(zy)
    return requantize(acc, m.reshape(-1, 1, 1) if m.size > 1 else m, zy, zy.dtype.name)


# -- whole models --------------------------------------------------------------------------------------------


class _Rewriter:
    """Builds the nodes that replace one integer operator, naming new values after it."""

    def __init__(self, k: int, ranks: dict[str, int]):
        from onnx import TensorProto, helper

        self.h, self.T, self.k, self.ranks, self.nodes, self.n = helper, TensorProto, k, ranks, [], 0

    def node(self, op: str, inputs: list[str], **attrs: Any) -> str:
        self.n += 1
        out = f"_sem{self.k}_{self.n}"
        self.nodes.append(self.h.make_node(op, inputs, [out], **attrs))
        return out

    def const(self, values: list, dtype: Any) -> str:
        self.n += 1
        out = f"_sem{self.k}_{self.n}"
        t = self.h.make_tensor(out, dtype, [len(values)] if len(values) != 1 else [], values)
        self.nodes.append(self.h.make_node("Constant", [], [out], value=t))
        return out

    def dq(self, x: str, scale: str, zero: str, axis: int = 1) -> str:
        """DequantizeLinear; ``axis`` is the one a scale with one value per slice runs along."""
        return self.node("DequantizeLinear", [x, scale] + ([zero] if zero else []), axis=axis)

    def q(self, y: str, scale: str, zero: str, out: str) -> None:
        self.nodes.append(self.h.make_node("QuantizeLinear", [y, scale] + ([zero] if zero else []), [out]))


def _arg(n: Any, i: int) -> str:
    return n.input[i] if len(n.input) > i else ""


def semantics_model(model: Any) -> bytes:
    """``model`` (an onnx ModelProto) with every operator onnxruntime runs through a fused integer kernel
    rewritten as the plain operators that define it, to run with :func:`semantics_session`:

    - QLinearConv, QLinearMatMul, com.microsoft QGemm / QLinearAdd / QLinearMul / QLinearSigmoid /
      QLinearLeakyRelu / QLinearSoftmax / QLinearGlobalAveragePool / QLinearAveragePool / QLinearConcat ->
      DequantizeLinear of each quantized input (an int32 bias with the scale ``x_scale * w_scale``, QGemm's
      times ``alpha``), the float operator, QuantizeLinear with the output's scale and zero point: the
      QDQ form onnxruntime's quantizer writes for the same quantization;
    - MatMulInteger -> Cast to int32, Sub the zero points, an int32 MatMul: exact (|acc| < 2**31 while
      K < 33000);
    - ConvInteger -> Cast to float, Sub the zero points, a float Conv, Cast to int32 (onnxruntime has no
      integer or double Conv): exact while the partial sums stay below 2**24, and past that within float32's
      relative rounding of the sum (an int32 sum that large is rounded to float32 by the Cast -> Mul that
      follows it in ``quantize_dynamic``'s files anyway).

    Every other node (MaxPool, Reshape, Transpose ... on 8-bit values: exact in any engine) is kept.  An
    integer operator this does not know raises NotImplementedError."""
    import onnx

    model = onnx.ModelProto.FromString(model.SerializeToString())
    g = model.graph
    ranks = {i.name: len(i.dims) for i in g.initializer}
    nodes = []
    for k, n in enumerate(g.node):
        r = _Rewriter(k, ranks)
        if not _rewrite(r, n):
            nodes.append(n)
            continue
        nodes.extend(r.nodes)
    del g.node[:]
    g.node.extend(nodes)
    return model.SerializeToString()


_UNARY = {"QLinearSigmoid": "Sigmoid", "QLinearLeakyRelu": "LeakyRelu", "QLinearSoftmax": "Softmax",
          "QLinearGlobalAveragePool": "GlobalAveragePool", "QLinearAveragePool": "AveragePool"}
_FUSED = {"QLinearConv", "QLinearMatMul", "QGemm", "QLinearAdd", "QLinearMul", "QLinearConcat", "MatMulInteger",
          "ConvInteger", *_UNARY}


def _rewrite(r: _Rewriter, n: Any) -> bool:
    """Append ``n``'s plain form to ``r``; False for a node kept as it is."""
    h, T, op = r.h, r.T, n.op_type
    if op not in _FUSED:
        if op.startswith(("QLinear", "QGemm", "QAttention", "QOrdered", "DynamicQuantizeMatMul")) or "Integer" in op:
            raise NotImplementedError(f"no plain form of the integer operator {op} ({n.name!r})")
        return False
    attrs = {a.name: h.get_attribute_value(a) for a in n.attribute}
    out = n.output[0]
    if op in ("MatMulInteger", "ConvInteger"):
        conv = op == "ConvInteger"
        to = T.FLOAT if conv else T.INT32
        ins = []
        for j in (0, 1):
            v = r.node("Cast", [n.input[j]], to=to)
            zero = _arg(n, j + 2)
            if zero:
                z = r.node("Cast", [zero], to=to)
                # a scalar, or one zero point per output channel (a ConvInteger's weights: [M] -> [M, 1, ...]),
                # per row (a MatMulInteger's a: [M] -> [M, 1]) or per column (its b: broadcasts as it is)
                shape = [-1] + [1] * (r.ranks.get(n.input[1], 4) - 1) if conv and j == 1 else \
                    [-1, 1] if not conv and j == 0 else None
                if shape is not None:
                    z = r.node("Reshape", [z, r.const(shape, T.INT64)])
                v = r.node("Sub", [v, z])
            ins.append(v)
        if conv:
            r.nodes.append(h.make_node("Cast", [r.node("Conv", ins, **attrs)], [out], to=T.INT32))
        else:
            r.nodes.append(h.make_node("MatMul", ins, [out]))
        return True
    if op == "QLinearConv":
        x, w = r.dq(*n.input[0:3]), r.dq(*n.input[3:6], axis=0)
        ins = [x, w]
        if _arg(n, 8):
            ins.append(r.dq(n.input[8], r.node("Mul", [n.input[1], n.input[4]]), "", axis=0))
        r.q(r.node("Conv", ins, **attrs), n.input[6], _arg(n, 7), out)
    elif op == "QLinearMatMul":
        a, b = r.dq(*n.input[0:3], axis=-2), r.dq(*n.input[3:6], axis=-1)
        r.q(r.node("MatMul", [a, b]), n.input[6], _arg(n, 7), out)
    elif op == "QGemm":
        alpha = float(attrs.get("alpha", 1.0))
        a = r.dq(*n.input[0:3])
        b = r.dq(*n.input[3:6], axis=0 if attrs.get("transB", 0) else 1)
        ins = [a, b]
        if _arg(n, 6):
            scale = r.node("Mul", [r.node("Mul", [n.input[1], n.input[4]]), r.const([alpha], T.FLOAT)])
            ins.append(r.dq(n.input[6], scale, "", axis=0))
        kw = {"alpha": alpha, "transA": int(attrs.get("transA", 0)), "transB": int(attrs.get("transB", 0))}
        y = r.node("Gemm", ins, **kw)
        if _arg(n, 7):
            r.q(y, n.input[7], _arg(n, 8), out)
        else:  # no y_scale: a float output
            r.nodes.append(h.make_node("Identity", [y], [out]))
    elif op in ("QLinearAdd", "QLinearMul"):
        a, b = r.dq(*n.input[0:3]), r.dq(n.input[3], n.input[4], _arg(n, 5))
        r.q(r.node(op[7:], [a, b]), n.input[6], _arg(n, 7), out)
    elif op == "QLinearConcat":
        parts = [r.dq(*n.input[i:i + 3]) for i in range(2, len(n.input), 3)]
        r.q(r.node("Concat", parts, axis=attrs["axis"]), n.input[0], _arg(n, 1), out)
    else:
        kw = dict(attrs)
        if op == "QLinearSoftmax":
            if int(kw.pop("opset", 13)) < 13 and int(kw.get("axis", -1)) != -1:
                raise NotImplementedError(f"{n.name!r}: Softmax before opset 13 over several axes")
        if kw.pop("channels_last", 0):
            raise NotImplementedError(f"{n.name!r}: {op} with channels_last=1")
        x = r.dq(n.input[0], n.input[1], _arg(n, 2))
        r.q(r.node(_UNARY[op], [x], **kw), n.input[3], _arg(n, 4), out)
    return True


def quantization_pairs(path: str | bytes) -> set[tuple[bytes, ...]]:
    """The (scale, zero point) pairs of 8-bit quantizations a quantized file carries, by value: each
    ``<name>_scale`` initializer with its ``<name>_zero_point`` (onnxruntime's quantizer names them so), a
    bias's int32 zero point left out (the QDQ form keeps the bias scale, the QOperator form folds it)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(path) if isinstance(path, str) else onnx.load_from_string(path)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    out = set()
    for name, scale in inits.items():
        if name.endswith("_scale") and name[:-6] + "_zero_point" in inits:
            zero = inits[name[:-6] + "_zero_point"]
            if zero.dtype in (np.uint8, np.int8):
                out.add((scale.astype(np.float32).tobytes(), str(scale.shape), zero.dtype.name, zero.tobytes()))
    return out


def same_quantization(qoperator: str | bytes, qdq: str | bytes) -> None:
    """Assert the QOperator and the QDQ file carry the same (scale, zero point) pairs: the QDQ file then
    quantizes the same tensors the same way, and run with optimizations off it is the QOperator file's
    semantics."""
    a, b = quantization_pairs(qoperator), quantization_pairs(qdq)
    assert a == b and a, (f"the QDQ file is no reference for the QOperator one: {len(a - b)} (scale, zero point) "
                          f"pairs only in the QOperator file, {len(b - a)} only in the QDQ file")


def registry_semantics(model: str, config: str, scheme: str) -> str | bytes:
    """The semantics of ``cuvil.registry.quantize.quantize(model, config, scheme)``, to run with
    :func:`semantics_session`: a static QDQ file itself; for the QOperator and the dynamic schemes the file
    rewritten by :func:`semantics_model`.  (Not the QDQ file onnxruntime's quantizer writes from the same
    float model: on BERT that one quantizes the last LayerNorm's weight and output and gives the CLS slice
    its input's scale, which the QOperator file does not.)"""
    import onnx

    from cuvil.registry import quantize

    path = quantize.quantize(model, config, scheme)
    sch = quantize.get_scheme(scheme)
    if sch.method == "static" and sch.fmt == "qdq":
        return path
    return semantics_model(onnx.load(path))


# -- comparing ----------------------------------------------------------------------------------------------------


def steps_apart(got: np.ndarray, ref: np.ndarray, step: float = 1.0) -> float:
    """The largest ``|got - ref|`` in steps (integers: codes)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, got.dtype, ref.shape, ref.dtype)
    if got.size == 0:
        return 0.0
    return float(np.abs(got.astype(np.float64) - ref.astype(np.float64)).max() / step)


def check_fused(what: str, fused: Iterable[np.ndarray], semantics: Iterable[np.ndarray], within: float = 0.0,
                steps: Iterable[float] | float = 1.0, u8s8: bool = True) -> float:
    """The second, labelled check: onnxruntime's fused result against the semantics, each output within
    ``within`` of its ``steps`` (one per output, or one for all); returns the largest difference in steps.

    ``u8s8``: the fused kernels include a u8 / s8 contraction, whose result is exact only on an x86 CPU
    with VNNI (:data:`FUSED_EXACT`); see :func:`fused_differs` for what happens to a difference."""
    fused, semantics = list(fused), list(semantics)
    per = list(steps) if isinstance(steps, Iterable) else [steps] * len(semantics)
    assert len(fused) == len(semantics) == len(per)
    worst = max((steps_apart(f, s, st) for f, s, st in zip(fused, semantics, per)), default=0.0)
    if worst > within * (1 + 1e-5):
        fused_differs(what, [f"onnxruntime's fused kernels lie {worst:g} steps from the semantics (bound {within:g})"],
                      u8s8)
    return worst


def fused_differs(what: str, problems: list[str], u8s8: bool = True) -> None:
    """What a difference between onnxruntime's fused result and the semantics (``problems``, one line
    each; none: nothing) means: with a u8 / s8 contraction among the fused kernels (``u8s8``) on a CPU
    whose kernels are not known to be exact, the known saturation (:data:`WHY_NOT_EXACT`), reported as a
    :class:`FusedKernelDifference` warning; anywhere else a failure."""
    if not problems:
        return
    msg = f"{what}: " + "; ".join(problems)
    if u8s8 and not FUSED_EXACT:
        warnings.warn(FusedKernelDifference(f"{msg} ({WHY_NOT_EXACT})"), stacklevel=3)
    elif u8s8:
        raise AssertionError(f"{msg} (on an x86 CPU with VNNI, where its u8 x s8 kernels are exact)")
    else:
        raise AssertionError(f"{msg} (none of them is a u8 x s8 contraction: no known cause)")
