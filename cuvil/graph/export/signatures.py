"""The signatures of an exported library: the input shapes each is compiled for, and the model's
symbolic sizes (an ONNX ``dim_param`` such as a batch ``N``) that become arguments of its C API.

The Python API (``export_library(input_shapes=...)``) and the command line (``--shapes``) check the
shapes they are given the same way, here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cuvil.errors import ArgumentError, ShapeError

__all__ = ["SymbolicSize", "check_given_shape", "default_prefix", "resolve_shapes", "resolve_signatures",
           "size_values", "symbolic_dim", "symbolic_sizes"]


@dataclass(frozen=True)
class SymbolicSize:
    """A symbolic size of the model's inputs, an argument of the exported C API: the model's name
    for it (the ONNX ``dim_param``, or ``<input>_dim<k>`` for a dimension without a name) and where
    it appears ((input index, dimension), in input order)."""

    name: str
    dims: tuple[tuple[int, int], ...]


def resolve_shapes(feeds: Sequence[Any], input_shapes: Any = None,
                   ran_with: Sequence[dict[str, tuple[int, ...]]] = ()) -> dict[str, tuple[int, ...]]:
    """The static shape of every fed input (``feeds``: graph ValueInfos) for an exported library.

    ``input_shapes`` ({name: shape}) fixes symbolic dimensions; without it, the model's own shapes
    when they are all known, else the shapes of ``ran_with`` if it holds exactly one signature
    (the session ran with those).  Each given shape must agree with the declared rank, the
    declared sizes and itself (a symbol has one value across inputs).
    """
    declared = {v.name: v.shape for v in feeds}
    if input_shapes is None:
        symbolic = {n: s for n, s in declared.items() if s is None or not all(isinstance(d, int) for d in s)}
        if not symbolic:
            return {n: tuple(s) for n, s in declared.items()}  # type: ignore[arg-type]
        if len(ran_with) == 1:
            input_shapes = dict(ran_with[0])
        else:
            n, s = next(iter(symbolic.items()))
            dims = "unknown rank" if s is None else ", ".join(
                f"dimension {k} ({d or '?'})" for k, d in enumerate(s) if not isinstance(d, int))
            example = ", ".join(f"{name!r}: {tuple(d if isinstance(d, int) else 1 for d in (sh or ()))}"
                                for name, sh in declared.items())
            ran = (f"; the session ran with {len(ran_with)} signatures "
                   f"({'; '.join(str(dict(r)) for r in ran_with[:4])}{' ...' if len(ran_with) > 4 else ''}), "
                   "so none is the current one" if ran_with else "")
            raise ShapeError(f"input {n!r} has a symbolic shape {list(s or [])} ({dims}){ran}; a library is "
                             f"compiled for fixed shapes: pass export_library(path, input_shapes={{{example}}}), "
                             "or a list of such dicts to compile several sizes into it (passed from C as integers)")
    if not isinstance(input_shapes, dict):
        raise ArgumentError(f"input_shapes must be a dict {{input name: shape}} (or a list of them, one per "
                            f"signature), got {type(input_shapes).__name__}")
    unknown = [n for n in input_shapes if n not in declared]
    if unknown:
        raise ArgumentError(f"input_shapes names unknown input(s) {', '.join(repr(n) for n in unknown)}; the "
                            f"model's inputs are {', '.join(declared)}")
    shapes: dict[str, tuple[int, ...]] = {}
    symbols: dict[str, tuple[int, str]] = {}
    for n, want in declared.items():
        if n not in input_shapes:
            if want is None or not all(isinstance(d, int) for d in want):
                raise ShapeError(f"input {n!r} has a symbolic shape {list(want or [])}: give it in input_shapes")
            shapes[n] = tuple(want)
            continue
        got = input_shapes[n]
        if not isinstance(got, (tuple, list)) or not all(
                isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 1 for d in got):
            raise ShapeError(f"input_shapes[{n!r}] must be a tuple of positive ints, got {got!r}")
        got = tuple(int(d) for d in got)
        check_given_shape(f"input_shapes[{n!r}]", n, want, got, symbols)
        shapes[n] = got
    return shapes


def check_given_shape(where: str, name: str, want: Sequence[Any] | None, got: tuple[int, ...],
                      symbols: dict[str, tuple[int, str]]) -> None:
    """Check the shape ``got`` given for input ``name`` against the one the model declares (``want``: ints and
    symbol names; None, nothing declared): its rank, its fixed sizes, and one value per symbol across the inputs
    (``symbols``: symbol -> (value, input) of the inputs checked before; this input's are added).  ``where``
    names the given shape in errors (``input_shapes['x']``, ``--shapes x=1,3,224,224``): the Python API and
    the command line check the same way."""
    if want is None:
        return
    if len(got) != len(want):
        raise ShapeError(f"{where} has rank {len(got)}; the model declares {list(want)} (rank {len(want)})")
    for k, (w, g) in enumerate(zip(want, got)):
        if isinstance(w, int) and w != g:
            raise ShapeError(f"{where}: dimension {k} must be {w} (the model declares {list(want)}), got {g}")
        if isinstance(w, str) and w:
            if w in symbols and symbols[w][0] != g:
                raise ShapeError(f"{where}: dimension {k} ({w}) is {g}, but {w} is {symbols[w][0]} in input "
                                 f"{symbols[w][1]!r}")
            symbols.setdefault(w, (g, name))


def default_prefix(path: str) -> str:
    """The C prefix of a library's symbols from its file name: ``out/resnet-18.so`` -> ``resnet_18``."""
    stem = os.path.basename(path).split(".")[0]
    stem = re.sub(r"[^A-Za-z0-9_]", "_", stem) or "model"
    return f"m_{stem}" if stem[0].isdigit() else stem


def resolve_signatures(feeds: Sequence[Any], input_shapes: Any = None,
                       ran_with: Sequence[dict[str, tuple[int, ...]]] = ()
                       ) -> tuple[list[dict[str, tuple[int, ...]]], tuple[SymbolicSize, ...]]:
    """The input shapes of each signature of an exported library, and its symbolic sizes.

    ``input_shapes`` is a dict (one signature, fixed shapes: see :func:`resolve_shapes`) or a list
    of dicts (one signature each; the model's symbolic sizes become arguments of the C API, even
    for a list of one).  Without symbolic dimensions, or with a dict, there are no sizes.
    """
    if not isinstance(input_shapes, (list, tuple)):
        return [resolve_shapes(feeds, input_shapes, ran_with)], ()
    if not input_shapes:
        raise ArgumentError("input_shapes is an empty list; give one dict {input name: shape} per signature")
    signatures = []
    for i, d in enumerate(input_shapes):
        if not isinstance(d, Mapping):
            raise ArgumentError(f"input_shapes[{i}] must be a dict {{input name: shape}}, got {type(d).__name__}")
        try:
            signatures.append(resolve_shapes(feeds, dict(d)))
        except (ShapeError, ArgumentError) as e:
            raise type(e)(f"input_shapes[{i}]: {e}") from None
    sizes = symbolic_sizes(feeds)
    if not sizes:
        if len(signatures) > 1:
            raise ShapeError(f"the model has no symbolic dimension, so it has one signature; input_shapes gives "
                             f"{len(signatures)}")
        return signatures, ()
    names = [v.name for v in feeds]
    seen: dict[tuple[int, ...], int] = {}
    for i, shapes in enumerate(signatures):
        values = size_values(sizes, [shapes[n] for n in names])
        if values in seen:
            raise ShapeError(f"input_shapes[{i}] repeats the sizes of input_shapes[{seen[values]}] ("
                             + ", ".join(f"{s.name}={v}" for s, v in zip(sizes, values)) + ")")
        seen[values] = i
    for v in feeds:
        if v.shape is None and any(s[v.name] != signatures[0][v.name] for s in signatures):
            raise ShapeError(f"input {v.name!r} declares no shape, so its dimensions have no names to pass from C; "
                             f"give it the same shape in every signature (input_shapes[0] has "
                             f"{signatures[0][v.name]})")
    return signatures, sizes


def symbolic_sizes(feeds: Sequence[Any]) -> tuple[SymbolicSize, ...]:
    """The symbolic sizes of the inputs ``feeds`` (graph ValueInfos), in order of first appearance."""
    found: dict[str, list[tuple[int, int]]] = {}
    for i, v in enumerate(feeds):
        for k, d in enumerate(v.shape or ()):
            if not isinstance(d, int):
                found.setdefault(d if d else f"{v.name}_dim{k}", []).append((i, k))
    return tuple(SymbolicSize(n, tuple(dims)) for n, dims in found.items())


def size_values(sizes: Sequence[SymbolicSize], shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The value of each symbolic size in the input ``shapes`` (input order)."""
    return tuple(int(shapes[s.dims[0][0]][s.dims[0][1]]) for s in sizes)


def symbolic_dim(values: Sequence[int], sizes: Sequence[SymbolicSize], per_signature: Sequence[Sequence[int]],
                  declared: Any) -> int | str | None:
    """How an output dimension with ``values`` (per signature; ``per_signature``: the sizes' values) reads
    in the sizes: the declared name when it matches, a constant, ``a*N+b`` for a size N it follows,
    else ``None``."""
    for k, s in enumerate(sizes):
        if declared == s.name and all(v == sv[k] for v, sv in zip(values, per_signature)):
            return s.name
    if len(set(values)) == 1:
        return int(values[0])
    for k, s in enumerate(sizes):
        xs = [sv[k] for sv in per_signature]
        if len(set(xs)) < 2:
            continue
        x0, y0 = xs[0], values[0]
        x1, y1 = next((x, y) for x, y in zip(xs, values) if x != x0)
        if (y1 - y0) % (x1 - x0):
            continue
        a = (y1 - y0) // (x1 - x0)
        b = y0 - a * x0
        if a and all(y == a * x + b for x, y in zip(xs, values)):
            term = s.name if a == 1 else f"{a}*{s.name}"
            return term if b == 0 else f"{term}{'+' if b > 0 else '-'}{abs(b)}"
    return None
