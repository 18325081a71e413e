"""Exporting registry models to ONNX the way users do, and caching the files by a content key.

Two exporters, as ``torch.onnx.export`` offers them:

- ``"dynamo"``: ``torch.onnx.export(model, args, f, dynamo=True, opset_version=18)``, the default
  since PyTorch 2.9 (torch.export, then onnxscript's translation and optimizer).  It writes the
  weights to ``<file>.onnx.data`` beside the model (its default ``external_data=True``); the cache
  keeps that file beside the ``.onnx``.
- ``"torchscript"``: ``dynamo=False, opset_version=17``, the legacy tracer most published ONNX files
  still come from.

``dynamic=True`` leaves the entry's dynamic axes (batch, and sequence for text models) open: with
``dynamic_axes`` for TorchScript (dims named "batch", "sequence"), with ``dynamic_shapes`` of
``torch.export.Dim.DYNAMIC`` for dynamo (the exporter names the dims itself, "s77" and such).

Files live in ``$CUVIL_REGISTRY_DIR`` (default ``~/.cache/cuvil/registry``) under a key that hashes
the registry's own sources, the model, config, exporter, dynamic flag and the torch / transformers /
onnxscript versions.  They are written into a temporary folder and moved into place with
``os.replace`` (the ``.data`` file before the ``.onnx``), so test processes exporting the same model
at once never see half a file.  The example inputs are kept beside them as ``.npz``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import io
import logging
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from cuvil.errors import CuvilError

if TYPE_CHECKING:
    from cuvil.models.registry import Entry

EXPORTERS = ("dynamo", "torchscript")
CONFIGS = ("ci", "full")
_OPSET = {"dynamo": 18, "torchscript": 17}


class ExportError(CuvilError):
    """``torch.onnx.export`` failed on a registry model (the message names the model and exporter)."""


def cache_dir() -> str:
    """The folder of exported files: ``$CUVIL_REGISTRY_DIR``, else ``~/.cache/cuvil/registry``."""
    d = os.environ.get("CUVIL_REGISTRY_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "cuvil", "registry")
    os.makedirs(d, exist_ok=True)
    return d


_NOT_EXPORT_SOURCES = frozenset({"quantize.py"})


@lru_cache(maxsize=1)
def _sources_hash() -> str:
    """A hash of the source files of this package that shape an export: editing a model re-exports it.
    Not quantize.py's: the quantized files key on it themselves, and the float exports do not depend on it."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for f in sorted(os.listdir(root)):
        if f.endswith(".py") and f not in _NOT_EXPORT_SOURCES:
            with open(os.path.join(root, f), "rb") as fh:
                h.update(f.encode() + b"\0" + fh.read() + b"\0")
    return h.hexdigest()


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def cache_key(name: str, config: str, exporter: str, dynamic: bool) -> str:
    """The sha256 that names an exported file."""
    parts = [_sources_hash(), name, config, exporter, str(bool(dynamic))]
    parts += [f"{d}={_version(d)}" for d in ("torch", "transformers", "onnxscript", "onnx")]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _stem(name: str, config: str, tag: str, key: str) -> str:
    return f"{name}-{config}-{tag}-{key[:16]}"


@contextlib.contextmanager
def quiet() -> Iterator[io.StringIO]:
    """Silence the exporters: Python warnings, torch / onnxscript / transformers loggers, and stdout /
    stderr written from Python (the dynamo exporter's progress lines, the TorchScript exporter's graph
    dumps).  Yields the captured text."""
    buf = io.StringIO()
    loggers = [logging.getLogger(n) for n in ("torch", "torch.onnx", "torch.export", "torch._dynamo", "onnxscript",
                                              "transformers", "root")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings(), contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        warnings.simplefilter("ignore")
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield buf
        finally:
            for lg, lv in zip(loggers, levels):
                lg.setLevel(lv)


def _dynamic_axes(entry: Entry, names: list[str]) -> dict[str, dict[int, str]]:
    axes = entry.dynamic_axes if entry.dynamic_axes is not None else {n: {0: "batch"} for n in names}
    return {n: dict(a) for n, a in axes.items() if n in names}


def _dynamic_shapes(model: Any, inputs: Mapping[str, Any], axes: Mapping[str, Mapping[int, str]]) -> dict:
    """``dynamic_shapes`` for torch.export: ``Dim.DYNAMIC`` on each dynamic axis, shaped like the
    arguments of ``model.forward`` (a ``*args`` parameter takes a tuple of specs)."""
    import inspect

    import torch

    specs = iter([{a: torch.export.Dim.DYNAMIC for a in axes.get(n, {})} or None for n in inputs])
    bound = inspect.signature(model.forward).bind(*inputs.values())
    out: dict[str, Any] = {}
    for pname, value in bound.arguments.items():
        out[pname] = tuple(next(specs) for _ in value) if isinstance(value, tuple) else next(specs)
    return out


def _export_file(entry: Entry, config: str, exporter: str, dynamic: bool, path: str) -> dict[str, np.ndarray]:
    """Build the model, export it to ``path``; the example inputs as numpy arrays."""
    import torch

    with quiet():
        try:
            model, inputs, output_names = entry.build(config)
        except Exception as exc:
            raise ExportError(f"building registry model {entry.name!r} ({config}) failed: "
                              f"{type(exc).__name__}: {exc}") from exc
        names = list(inputs)
        kwargs: dict[str, Any] = {}
        if dynamic and exporter == "dynamo":  # (its dynamic_axes conversion fails on a *args forward)
            kwargs["dynamic_shapes"] = _dynamic_shapes(model, inputs, _dynamic_axes(entry, names))
        elif dynamic:
            kwargs["dynamic_axes"] = _dynamic_axes(entry, names)
        try:
            with torch.no_grad():
                torch.onnx.export(model, tuple(inputs.values()), path, dynamo=exporter == "dynamo",
                                  opset_version=_OPSET[exporter], input_names=names, output_names=list(output_names),
                                  verbose=False, **kwargs)
        except Exception as exc:
            raise ExportError(f"torch.onnx.export ({exporter}, opset {_OPSET[exporter]}"
                              f"{', dynamic axes' if dynamic else ''}) failed on registry model {entry.name!r} "
                              f"({config}): {type(exc).__name__}: {_first_line(exc)}") from exc
    return {n: t.detach().numpy() for n, t in inputs.items()}


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines() if ln.strip()]
    return lines[0] if lines else "(no message)"


def _publish(tmp: str, final_dir: str) -> None:
    """Move every file of ``tmp`` into ``final_dir``, the ``.onnx`` files last (readers test for those)."""
    files = sorted(os.listdir(tmp), key=lambda f: f.endswith(".onnx"))
    for f in files:
        os.replace(os.path.join(tmp, f), os.path.join(final_dir, f))


def export_entry(entry: Entry, config: str, exporter: str, dynamic: bool) -> str:
    """The path of ``entry`` exported by ``exporter`` at ``config``, exporting it on a cache miss."""
    d = cache_dir()
    key = cache_key(entry.name, config, exporter, dynamic)
    stem = _stem(entry.name, config, exporter + ("-dynamic" if dynamic else ""), key)
    path = os.path.join(d, stem + ".onnx")
    if os.path.exists(path):
        return path
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=d)
    try:
        inputs = _export_file(entry, config, exporter, dynamic, os.path.join(tmp, stem + ".onnx"))
        _save_inputs(os.path.join(tmp, _inputs_stem(entry.name, config) + ".npz"), inputs)
        _publish(tmp, d)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _inputs_stem(name: str, config: str) -> str:
    return _stem(name, config, "inputs", cache_key(name, config, "-", False))


def _save_inputs(path: str, inputs: Mapping[str, np.ndarray]) -> None:
    with open(path, "wb") as fh:
        np.savez(fh, **{f"{i:03d}:{n}": a for i, (n, a) in enumerate(inputs.items())})


def example_inputs(entry: Entry, config: str) -> dict[str, np.ndarray]:
    """The entry's seeded example inputs at ``config`` (from the cache; built on a miss)."""
    d = cache_dir()
    path = os.path.join(d, _inputs_stem(entry.name, config) + ".npz")
    if not os.path.exists(path):
        with quiet():
            _, inputs, _ = entry.build(config)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=d)
        os.close(fd)
        try:
            _save_inputs(tmp, {n: t.detach().numpy() for n, t in inputs.items()})
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    with np.load(path) as z:
        return {k.split(":", 1)[1]: z[k] for k in sorted(z.files)}
