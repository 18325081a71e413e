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

from cuvil.models.registry.semantics import (  # noqa: F401  (the tests read them from here)
    registry_semantics,
    run_semantics,
    semantics_model,
    semantics_session,
)

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


# -- onnxruntime sessions (the semantics: cuvil.models.registry.semantics) ------------------------------------------


def _ort() -> Any:
    import onnxruntime

    return onnxruntime


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
    onnxruntime computes it in, and cuvil: ``cuvil.graph.ops.quant.matmul.requant_multiplier``)."""
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
