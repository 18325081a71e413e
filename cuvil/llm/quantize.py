"""Round-to-nearest weight quantization into cuvil's :class:`Q4` / :class:`Q8` formats.

Each group is ``group`` consecutive inputs of one output row (``w[n, g*group:(g+1)*group]``).

- **int4 symmetric** (llama.cpp's Q4_0 rule): ``m`` is the group's value of largest magnitude (its sign
  kept), ``scale = -m / 8``, ``q = clamp(rint(w / scale) + 8, 0, 15)``, ``w' = (q - 8) * scale``.  ``m``
  itself maps to ``q - 8 = -8`` exactly, so all 16 levels are used.  Error: ``|w - w'| <= |scale| / 2``
  for every weight except those of the sign opposite to ``m`` with ``|w| > 7.5 |scale|`` (the clamped
  end, ``q - 8 = +7``), where ``|w - w'| <= |scale|``.
- **int4 with zero points** (asymmetric, as Q4_1): ``scale = (max - min) / 15``, ``offset = min``,
  ``q = clamp(rint((w - min) / scale), 0, 15)``, ``w' = q * scale + min``.  Error: ``|w - w'| <= scale / 2``
  for every weight (no clamping; the bounds are met up to float32 rounding).
- **int8** (symmetric, weight-only): ``scale = absmax / 127``, ``q = rint(w / scale)`` in -127..127,
  ``w' = q * scale``; error ``|w - w'| <= scale / 2`` for every weight.

(All bounds up to float32 rounding of ``w'``: a few ulp of ``|w|``.)  A group of zeros gets scale 0 and
dequantises to 0 exactly.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from cuvil.errors import ArgumentError, ModelError
from cuvil.llm.weights import Q4, Q8, DecoderWeights, Dense, Weight

__all__ = ["quantize", "quantize_weight"]


def quantize_weight(w: np.ndarray | Weight, bits: int = 4, group: int | None = None, symmetric: bool = True,
                    name: str = "weight") -> Q4 | Q8:
    """Quantize one ``[N, K]`` weight (an array or a :class:`Weight`, dequantized first) by round to nearest.

    ``bits``: 4 (:class:`Q4`) or 8 (:class:`Q8`, symmetric only).  ``group``: inputs per scale; ``None``
    means 32 for 4 bits and the whole row (``K``) for 8 bits.  ``symmetric``: for 4 bits, ``False`` gives
    a per-group offset (min/max).  See the module docstring for the rules and their error bounds."""
    if not isinstance(w, np.ndarray):
        w = w.dequantize()
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ModelError(f"{name}: a weight to quantize is [N, K]; got {list(w.shape)}")
    if bits not in (4, 8):
        raise ArgumentError(f"quantize: bits={bits}; cuvil quantizes to 4 or 8 bits")
    n, k = w.shape
    g = group if group is not None else (32 if bits == 4 else k)
    if g < 1 or k % g or (bits == 4 and g % 2):
        raise ModelError(f"{name}: group {g} does not divide its {k} inputs" +
                         (" (4-bit groups are even)" if bits == 4 else ""))
    if bits == 8 and not symmetric:
        raise ArgumentError("quantize: 8-bit weights are symmetric (Q8 has no offsets); pass symmetric=True")
    # rows a block at a time (about 4M values): the temporaries stay small for a 14336 x 4096 weight
    step = max(1, (1 << 22) // k)
    if bits == 8:
        q8 = np.empty((n, k), np.int8)
        scale = np.empty((n, k // g), np.float32)
        for r in range(0, n, step):
            x = w[r:r + step].reshape(-1, k // g, g)
            s = np.abs(x).max(axis=-1) / np.float32(127)
            q8[r:r + step] = np.clip(np.rint(_div(x, s)), -127, 127).astype(np.int8).reshape(-1, k)
            scale[r:r + step] = s
        return Q8(q=q8, scale=scale, group=g)
    packed = np.empty((n, k // 2), np.uint8)
    scale = np.empty((n, k // g), np.float32)
    offset = np.empty((n, k // g), np.float32)
    for r in range(0, n, step):
        x = w[r:r + step].reshape(-1, k // g, g)
        if symmetric:
            idx = np.abs(x).argmax(axis=-1)[..., None]
            s = (np.take_along_axis(x, idx, axis=-1)[..., 0] / np.float32(-8)).astype(np.float32)
            v = np.clip(np.rint(_div(x, s)) + 8, 0, 15)
            off = (np.float32(-8) * s).astype(np.float32)
        else:
            lo, hi = x.min(axis=-1), x.max(axis=-1)
            s = ((hi - lo) / np.float32(15)).astype(np.float32)
            v = np.clip(np.rint(_div(x - lo[..., None], s)), 0, 15)
            off = lo.astype(np.float32)
        packed[r:r + step] = pack_nibbles(v.reshape(-1, k).astype(np.uint8))
        scale[r:r + step], offset[r:r + step] = s, off
    return Q4(q=packed, scale=scale, offset=offset, group=g, symmetric=symmetric)


def _div(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``x / scale`` per group, 0 where the scale is 0."""
    s = scale[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(s == 0, np.float32(0), x / np.where(s == 0, np.float32(1), s))


def pack_nibbles(v: np.ndarray) -> np.ndarray:
    """uint8 values 0..15 ``[N, K]`` -> ``[N, K / 2]``, element ``2i`` in the low nibble of byte ``i``."""
    return (v[:, 0::2] | (v[:, 1::2] << 4)).astype(np.uint8)


_CHOICES = {"embed": ("fp32", "int8", "same"), "head": ("same", "int8", "fp32")}


def quantize(weights: DecoderWeights, bits: int = 4, group: int | None = None, symmetric: bool = True,
             embed: str = "fp32", head: str = "same") -> DecoderWeights:
    """The model with every projection quantized by :func:`quantize_weight` (``bits``, ``group``,
    ``symmetric``); norms and biases stay float32.  Weights that are already quantized are dequantized and
    quantized again.

    ``embed``: "fp32" (a float32 table), "int8" (per row) or "same" (as the projections).  ``head``:
    "same" (as the projections), "int8" (per row) or "fp32".  A tied head is quantized on its own; the
    embedding follows ``embed``."""
    for what, value in (("embed", embed), ("head", head)):
        if value not in _CHOICES[what]:
            raise ArgumentError(f"quantize: {what}={value!r}; choose one of {', '.join(_CHOICES[what])}")

    def project(name: str, w: Weight) -> Weight:
        return quantize_weight(w, bits, group, symmetric, name=name)

    def choose(name: str, w: Weight, how: str) -> Weight:
        if how == "fp32":
            return w if isinstance(w, Dense) else Dense(w.dequantize().astype(np.float32))
        if how == "int8":
            return quantize_weight(w, 8, None, True, name=name)
        return project(name, w)

    out = weights.with_linears(lambda name, w: w if name == "head" else project(name, w))
    return replace(out, embed=choose("embed", weights.embed, embed), head=choose("head", weights.head, head))
