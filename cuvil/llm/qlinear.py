"""The weight contractions of an LLM decoder: ``out = residual + x @ W^T + bias`` for a :class:`Dense`,
:class:`Q4` or :class:`Q8` weight ``W [N, K]``, compiled once for ``rows`` rows of ``x`` (1: a decode
step, a matrix-vector product bound by the weights' bytes; more: a prefill, bound by the arithmetic).

Every kernel is a te program scheduled by hand (:mod:`cuvil.llm.qlinear_kernels`) and compiled by cuvil
(no templates, no BLAS).  The weights are laid out again when compiling, in panels of ``PT`` output
columns (a few vectors of lanes), so that a vector load takes ``PT`` columns' data for the same inputs::

    Q4: W[n // PT, u, n % PT]  int32 word u of column n: byte b holds k = 8u + b (low nibble) and
        k = 8u + 4 + b (high nibble)
    Q8: W[n // PT, a, n % PT]  int32 word a of column n: byte b holds k = 4a + b, XOR 0x80 (unsigned;
        left signed where the target's byte dot product is signed x signed: AArch64 sdot)
    scales (and offsets) [n // PT, g, n % PT], float16 when every one of them is exactly a float16
    (GGUF's are; the kernel then streams 10% fewer bytes), else float32

**int8 activations** (``activations="int8"``, the default for Q4 and Q8): a small kernel quantizes each
group of ``group`` inputs of a row to int8 (``q = round(x * 127 / amax)``, ties to even; the group's
scale ``amax / 127``; the int32 sum of its ``q``: :func:`quantize_rows` is the same in numpy), stored as
int8 ``[rows, K]`` and read by the contraction as int32 words ``XA[m, a]`` (k = 4a + b in byte b).  The
contraction sums exact integer dot products per group and applies the scales once per group::

    isum[m, n, g] = sum(u in g, h < 2) dot4(W[.., u, ..] >> 4h & 0x0F0F0F0F, XA[m, 2u + h])   (Q4)
    y[m, n] = sum(g) xs[m, g] * (ws[n, g] * float(isum - c * asum[m, g]) + wo'[n, g] * float(asum[m, g]))

with ``c`` = 8 for Q4 (``w = (q - 8) * s + (offset + 8 s)``; ``wo' = offset + 8 s`` is zero for symmetric
weights, whose offsets are never read) and 128 for Q8 (the bytes stored XOR 0x80; 0 when left signed).
``dot4`` is ``vpdpbusd`` with VNNI, ``vpmaddubsw`` + ``vpmaddwd`` on AVX2 without it (the 4-bit bytes
are below 128, so the 16-bit pair sums cannot saturate), ``usdot`` / ``sdot`` on AArch64.  The register
tile keeps ``isum`` in vector registers (computed at ``y``'s group loop), ``y`` beside it.  The result
equals, up to float32 rounding, the product of the dequantized weights with the *quantized* activations.

**float32 activations** (``activations="float32"``; Dense weights always): the 4-bit values are decoded in
registers and multiplied by the exact activations, per group ``fsum = sum x * float(q)``, then ``y = sum(g)
ws * (fsum - 8 xsum)`` (symmetric) or ``ws * fsum + offset * xsum``: the product with the dequantized
weights up to float32 rounding (a group that is not a multiple of 8: the weights dequantized per element).

Threads: the column panels are split across the session's threads (``cuvil.set_num_threads``); the
activations' quantization runs on one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from cuvil.cache import BoundedCache
from cuvil.errors import ArgumentError, DTypeError, ShapeError
from cuvil.llm import qlinear_kernels as qk
from cuvil.llm.weights import Q4, Q8, Dense, Weight
from cuvil.options import CompileOptions
from cuvil.pipeline import build as _build

__all__ = ["Linear", "linear", "quantize_rows"]



def quantize_rows(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The int8 activations the kernels compute, in numpy (for references): ``(q int8 [rows, K], scale
    float32 [rows, K / group], sum int32 [rows, K / group])``; ``x ~ q * scale`` per group."""
    rows, k = x.shape
    xg = x.reshape(rows, k // group, group).astype(np.float32)
    amax = np.abs(xg).max(axis=2)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.round(xg * inv[:, :, None]).astype(np.int32)
    return (q.reshape(rows, k).astype(np.int8), (amax * np.float32(1.0 / 127.0)).astype(np.float32),
            q.sum(axis=2).astype(np.int32))


def _target(target: Any) -> Any:
    from cuvil.target import Target

    t = target if isinstance(target, Target) else Target(target or "llvm")
    if t.kind != "llvm":
        raise ArgumentError(f"cuvil.llm.qlinear compiles for CPUs (target 'llvm ...'); got {t}")
    return t


class Linear:
    """``out = residual + x @ W^T + bias`` compiled for ``rows`` rows (see the module's docstring).

    ``rows``, ``K``, ``N``; ``nbytes``: the weight bytes a call streams (packed values, scales, offsets
    when read); ``activations``: "int8" (activations quantized per group, :func:`quantize_rows`) or
    "float32"; ``module``: the compiled contraction (``quantizer``: the activations' kernel, or None)."""

    def __init__(self, weight: Weight, rows: int, target: Any, residual: bool, bias: np.ndarray | None,
                 activations: str | None, options: CompileOptions | None = None):
        if not isinstance(weight, (Dense, Q4, Q8)):
            raise DTypeError(f"linear takes a Dense, Q4 or Q8 weight; got {type(weight).__name__}")
        if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 1:
            raise ArgumentError(f"linear: rows must be a positive int, got {rows!r}")
        self.rows = int(rows)
        self.N, self.K = weight.shape
        self.weight = weight
        self.target = _target(target)
        self.residual = bool(residual)
        if bias is not None:
            bias = np.asarray(bias)
            if bias.dtype != np.float32 or bias.shape != (self.N,):
                raise ShapeError(f"linear: bias is {bias.dtype} {list(bias.shape)}; expected float32 [{self.N}]")
            bias = np.ascontiguousarray(bias)
        self.bias = bias
        self.activations = activations or ("float32" if isinstance(weight, Dense) else "int8")
        if self.activations not in ("int8", "float32"):
            raise ArgumentError(f"linear: activations are 'int8' or 'float32', got {self.activations!r}")
        if isinstance(weight, Dense) and self.activations != "float32":
            raise ArgumentError("linear: a Dense weight takes float32 activations")
        if isinstance(weight, Q8) and self.activations != "int8":
            raise ArgumentError("linear: a Q8 weight takes int8 activations")
        group = getattr(weight, "group", 0)
        if self.activations == "int8" and group % (8 if isinstance(weight, Q4) else 4):
            raise ShapeError(f"linear: int8 activations need a group that is a multiple of "
                             f"{8 if isinstance(weight, Q4) else 4}; this weight's is {group} "
                             f"(use activations='float32' for a Q4 weight)")
        self.tile = qk.choose_tile(self.target, self.rows, self.N)
        build = (qk.dense_program if isinstance(weight, Dense) else
                 qk.int8_program if self.activations == "int8" else qk.q4_float_program)
        # every layer's projection of a shape is the same program: compiled once, each Linear lays out its
        # own weights (a repeated shape costs only the layout)
        lay = build(weight, self.rows, self.tile, self.target, self.residual, bias is not None,  # type: ignore[arg-type]
                    layout_only=True)
        prove = options is not None and options.check_schedules  # isl proves the tile schedules (a debug mode)
        key = ("linear", build.__name__, type(weight).__name__, self.activations, self.tile, self.rows, self.N,
               self.K, getattr(weight, "group", 0), getattr(weight, "symmetric", False), self.residual,
               bias is not None, str(self.target), tuple((c.shape, c.dtype.str) for c in lay.consts), prove)
        if key not in _MODULES:
            prog = build(weight, self.rows, self.tile, self.target, self.residual, bias is not None,  # type: ignore[arg-type]
                         prove=prove)
            _MODULES[key] = _build(prog.schedule, prog.args, self.target, name="linear")
        self.module = _MODULES[key]
        self._weights = list(lay.consts)
        self.nbytes = lay.nbytes
        self.quantizer: Any = None
        self._xq: tuple[np.ndarray, ...] = ()
        self._scratch: tuple[np.ndarray, ...] = ()
        if not lay.takes_x:  # the activations' quantization: its own small kernel, scratch buffers held here
            K, G = self.K, weight.group  # type: ignore[union-attr]
            qkey = ("quantize_rows", self.rows, K, G, str(self.target))
            if qkey not in _MODULES:
                s, args = qk.quantizer(self.rows, K, G, self.target)
                _MODULES[qkey] = _build(s, args, self.target, name="quantize_rows")
            self.quantizer = _MODULES[qkey]
            q8 = np.zeros((self.rows, K), np.int8)
            self._xq = (q8, np.zeros((self.rows, K // G), np.float32), np.zeros((self.rows, K // G), np.int32))
            self._scratch = (q8.view(np.int32), *self._xq[1:])  # (the int8 values as int32 words of four)

    def bind(self, x: np.ndarray, out: np.ndarray, residual: np.ndarray | None = None) -> Callable[[], None]:
        """A zero-argument callable that computes ``out = residual + x @ W^T + bias`` on these buffers
        (``x`` float32 [rows, K], ``out`` float32 [rows, N]; ``residual`` as ``out``, given exactly when
        the Linear was compiled with ``residual=True``); ``x`` may change in place between calls."""
        from cuvil.llm.call import Bound

        self._check(x, "x", (self.rows, self.K))
        self._check(out, "out", (self.rows, self.N))
        if self.residual != (residual is not None):
            raise ArgumentError("linear: this Linear was compiled " + ("with" if self.residual else "without") +
                                " a residual; pass residual= " + ("an array" if self.residual else "None"))
        if residual is not None:
            self._check(residual, "residual", (self.rows, self.N))
        tail = [a for a in (residual, self.bias) if a is not None]
        if self.quantizer is None:
            return Bound(self.module, *self._weights, x, *tail, out)
        quant = Bound(self.quantizer, x, *self._xq)
        main = Bound(self.module, *self._weights, *self._scratch, *tail, out)

        def run() -> None:
            quant()
            main()

        return run

    def __call__(self, x: np.ndarray, out: np.ndarray, residual: np.ndarray | None = None) -> None:
        self.bind(x, out, residual)()

    @staticmethod
    def _check(a: Any, what: str, shape: tuple[int, int]) -> None:
        if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != shape or not a.flags.c_contiguous:
            got = f"{a.dtype} {list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
            raise ShapeError(f"linear: {what} must be a C-contiguous float32 array {list(shape)}; got {got}")

    def __repr__(self) -> str:
        return (f"Linear({type(self.weight).__name__} N={self.N} K={self.K}, rows={self.rows}, "
                f"activations={self.activations}, {self.nbytes} bytes)")


# compiled programs by what tells them apart (the Linear's kind, shapes, tile, target and its constants'
# shapes and dtypes): a model's repeated projections share one
_MODULES: BoundedCache = BoundedCache("cuvil.llm.qlinear._MODULES", 256)


def linear(weight: Weight, rows: int, target: Any = None, *, residual: bool = False,
           bias: np.ndarray | None = None, activations: str | None = None,
           options: CompileOptions | None = None) -> Linear:
    """Compile ``out = residual + x @ weight^T + bias`` for ``rows`` rows of ``x`` (see the module's
    docstring); ``activations``: "int8" (default for Q4 and Q8) or "float32" (Q4; always for Dense).
    ``options``: of :class:`~cuvil.options.CompileOptions`, ``check_schedules`` (isl proves the kernel's
    schedule, legal by construction and otherwise trusted: a debug mode)."""
    return Linear(weight, rows, target, residual, bias, activations, options)
