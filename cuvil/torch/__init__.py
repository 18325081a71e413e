"""The PyTorch front end: three ways in, one importer (:mod:`cuvil.frontend.torch`), one graph compiler.

    import torch, cuvil.torch
    cm = cuvil.torch.compile(model, (x,), dynamic_shapes=None, target="llvm")   # ahead of time
    y = cm(x)                                  # called like the model, returns what it returns
    cm.export_library("model.so")              # the same .so + header as an ONNX session's

    fast = torch.compile(model, backend="cuvil")            # inside PyTorch (cuvil.torch.backend)

    @cuvil.compile(target="llvm")                           # a function of torch tensors
    def matmul_relu(x, w): return torch.relu(torch.matmul(x, w))

Ahead of time, ``torch.export`` traces the model (with ``dynamic_shapes`` as torch.export takes them);
the ATen graph after :func:`~cuvil.frontend.torch.decompositions` is imported into the graph IR and
compiled for each input signature on first use (once: a signature seen before never compiles again).
``import cuvil`` does not import this module or torch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cuvil.errors import ArgumentError, DTypeError, ModelError

__all__ = ["CompiledModule", "compile", "export"]

log = logging.getLogger("cuvil.torch")


def export(model: Any, example_args: Sequence[Any], example_kwargs: Mapping[str, Any] | None = None,
           dynamic_shapes: Any = None) -> Any:
    """``torch.export.export`` of ``model`` (a module or a function) under ``no_grad``, then the
    decompositions the importer takes (:func:`cuvil.frontend.torch.decompositions`)."""
    import torch

    from cuvil.frontend.torch import decompositions

    what = getattr(model, "__name__", None) or type(model).__name__
    if not isinstance(model, torch.nn.Module):
        model = _FunctionModule(model)
    if model.training:
        log.warning("cuvil.torch: %s is in training mode; compiling its inference graph (call .eval() first to "
                    "silence this)", type(model).__name__)
    with torch.no_grad():
        try:
            ep = torch.export.export(model, tuple(example_args), kwargs=dict(example_kwargs or {}),
                                     dynamic_shapes=dynamic_shapes, strict=False)
        except Exception as exc:  # torch's own errors: data-dependent control flow, a bad dynamic_shapes spec
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelError(f"torch.export could not trace {what}: {type(exc).__name__}: "
                             f"{first}") from exc
        return ep.run_decompositions(decompositions())


def compile(model: Any, example_args: Sequence[Any] = (), example_kwargs: Mapping[str, Any] | None = None,
            dynamic_shapes: Any = None, target: str | None = None, num_threads: int | None = None,
            tuning_db: Any = None, options: Any = None) -> CompiledModule:
    """Compile ``model`` (a ``torch.nn.Module`` or a function of tensors) ahead of time for ``target``
    (default: this host), with ``options`` (a :class:`cuvil.options.CompileOptions`; ``target`` and
    ``tuning_db``, when given, replace its own).

    ``example_args`` / ``example_kwargs`` are what the model is called with; ``dynamic_shapes`` is
    torch.export's (e.g. ``{"x": {1: torch.export.Dim("seq", max=512)}}``): those sizes stay symbolic
    and each new size compiles once.  Returns a :class:`CompiledModule`.  Every ATen operator cuvil
    lacks is listed in one ``UnsupportedOpError`` before anything compiles."""
    from cuvil.frontend.torch import import_exported_program
    from cuvil.onnx import InferenceSession

    if isinstance(example_args, Mapping) or not isinstance(example_args, (list, tuple)):
        example_args = (example_args,)
    ep = export(model, example_args, example_kwargs, dynamic_shapes)
    name = getattr(model, "__name__", None) or type(model).__name__  # a function's name, or a module's class
    imported = import_exported_program(ep, name)
    session = InferenceSession.from_graph(imported.graph, target=target, num_threads=num_threads,
                                          tuning_db=tuning_db, options=options)
    return CompiledModule(session, imported, ep)


class CompiledModule:
    """A model compiled by cuvil, called like the model: the same positional and keyword arguments
    (CPU tensors; non-contiguous ones are copied, contiguous ones are read in place), and the same
    result structure (a tensor, a tuple, a ``transformers`` ModelOutput) of CPU tensors that own the
    compiled program's output buffers."""

    def __init__(self, session: Any, imported: Any, ep: Any):
        from torch.export.graph_signature import InputKind, TensorArgument

        self.session = session
        self.imported = imported
        self._in_spec = ep.call_spec.in_spec
        self._out_spec = ep.call_spec.out_spec
        # per flattened user argument: the graph input it feeds, or the constant export fixed
        self._leaves: list[tuple[str | None, Any]] = []
        for spec in ep.graph_signature.input_specs:
            if spec.kind != InputKind.USER_INPUT:
                continue
            if isinstance(spec.arg, TensorArgument):
                self._leaves.append((spec.arg.name, None))
            else:
                self._leaves.append((None, getattr(spec.arg, "value", None)))
        self._dtypes = {v.name: v.dtype for v in imported.graph.inputs}
        # the common call, positional tensors only and a tensor or a flat tuple of them back, skips pytree
        plain_in = self._in_spec == _spec_of((tuple(range(len(self._leaves))), {}))
        self._fast_in = plain_in and all(name is not None for name, _ in self._leaves)
        n_out = len(imported.outputs)
        self._fast_out = all(kind == "tensor" for kind, _ in imported.outputs) and (
            (n_out == 1 and self._out_spec.is_leaf()) or self._out_spec == _spec_of(tuple(range(n_out))))
        self._single = n_out == 1 and self._out_spec.is_leaf()

    @property
    def graph(self) -> Any:
        """The imported graph IR (before the graph passes)."""
        return self.imported.graph

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch
        from torch.utils import _pytree as pytree

        if self._fast_in and not kwargs and len(args) == len(self._leaves):
            feeds = {name: _as_numpy(t, name, self._dtypes[name], torch) for (name, _), t in zip(self._leaves, args)}
            results = self.session.run(None, feeds)
            if self._fast_out:
                return torch.from_numpy(results[0]) if self._single else tuple(torch.from_numpy(r) for r in results)
            return self._structured(results, torch, pytree)
        kw_spec = self._in_spec.child(1) if self._in_spec.num_children == 2 else None
        if kwargs and kw_spec is not None and kw_spec.context:  # keyword arguments in the exported order
            kwargs = {k: kwargs[k] for k in kw_spec.context if k in kwargs} | kwargs
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._in_spec:
            raise ArgumentError(f"the model was compiled for arguments structured as {self._in_spec}; got "
                                f"{spec} (positional and keyword arguments must be those of the example)")
        feeds: dict[str, np.ndarray] = {}
        for k, (leaf, (name, const)) in enumerate(zip(flat, self._leaves)):
            if name is None:
                if leaf != const and not (leaf is None and const is None):
                    raise ArgumentError(f"argument {k}: the model was compiled for the value {const!r} (export "
                                        f"fixes non-tensor arguments), got {leaf!r}")
                continue
            feeds[name] = _as_numpy(leaf, name, self._dtypes.get(name), torch)
        return self._structured(self.session.run(None, feeds), torch, pytree)

    def _structured(self, results: list[np.ndarray], torch: Any, pytree: Any) -> Any:
        """The model's result structure around the outputs (tensors) and the constants export fixed."""
        it = iter(results)
        values = [torch.from_numpy(next(it)) if kind == "tensor" else v for kind, v in self.imported.outputs]
        return pytree.tree_unflatten(values, self._out_spec)

    def export_library(self, path: str | os.PathLike[str], input_shapes: Any = None, **kwargs: Any) -> str:
        """The model as one shared library and a C header beside it, as
        :meth:`cuvil.onnx.InferenceSession.export_library` writes them (its arguments are the same)."""
        return self.session.export_library(path, input_shapes, **kwargs)

    @property
    def fallbacks(self) -> list[str]:
        return self.session.fallbacks

    def __repr__(self) -> str:
        ins = ", ".join(f"{v.name}: {v.dtype}{list(v.shape or [])}" for v in self.session._feeds)
        return f"<cuvil.torch.CompiledModule {self.imported.graph.name}({ins}) for {self.session.target!r}>"


def _as_numpy(t: Any, name: str, dtype: str | None, torch: Any) -> np.ndarray:
    """A CPU tensor's values for a feed: in place when contiguous, else a contiguous copy."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentError(f"input {name!r}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ArgumentError(f"input {name!r}: a tensor on {t.device}; cuvil's compiled models take CPU tensors")
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    a = t.numpy()
    if dtype is not None and a.dtype.name != dtype:
        raise DTypeError(f"input {name!r}: expected {dtype}, got {a.dtype.name}; cuvil does not cast inputs")
    return a


def _spec_of(value: Any) -> Any:
    from torch.utils import _pytree as pytree

    return pytree.tree_flatten(value)[1]


class _FunctionModule:
    """A function as a ``torch.nn.Module`` (``torch.export`` takes modules) whose ``forward`` has the
    function's signature, so ``dynamic_shapes`` may name its parameters (``{"x": {0: batch}}``)."""

    def __new__(cls, fn: Any) -> Any:
        import inspect

        import torch

        class FunctionModule(torch.nn.Module):
            def __init__(self, f: Any):
                super().__init__()
                self.f = f

            def forward(self, *args: Any, **kwargs: Any) -> Any:
                return self.f(*args, **kwargs)

        try:
            sig = inspect.signature(fn)
            self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
            FunctionModule.forward.__signature__ = sig.replace(  # type: ignore[attr-defined]
                parameters=[self_param, *sig.parameters.values()])
        except (TypeError, ValueError):  # a builtin without a signature: positional dynamic_shapes only
            pass
        m = FunctionModule(fn)
        m.eval()
        return m


from cuvil.torch import backend as _backend  # noqa: E402, F401  (registers "cuvil" with torch.compile if no entry point does)
