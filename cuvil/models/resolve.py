"""A model name, as the command line takes one, -> an ONNX file and inputs to run it on.

Every command that names a model (``cuvil bench``, ``cuvil tune``, ``cuvil compile``'s default) resolves it
here, in this order:

1. a registry name (:mod:`cuvil.models.registry`), where the command takes them (``registry=``) and either
   asks for the registry (``--registry``) or the name is neither a zoo model nor a file: exported at the
   registry's ``config`` with its ``exporter`` (cached);
2. a zoo name (:mod:`cuvil.models.zoo`): the model written to ``workdir``, with the zoo's own inputs;
3. ``light_<name>``: a light model of the onnx wheel (weights as ConstantOfShape nodes);
4. a path to an ``.onnx`` file.

Inputs, where a command needs them, are the zoo model's own or random (:func:`cuvil.graph.feeds.random_feeds`)
of the shapes ``--shapes`` gives (:func:`input_shapes` checks them against the model).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cuvil.errors import ArgumentError, ShapeError

__all__ = ["ALL_LIGHT", "LIGHT", "FromRegistry", "Resolved", "default_model", "default_models", "input_shapes",
           "inputs_str", "light_path", "resolve", "resolve_inputs"]

LIGHT = ("bvlc_alexnet", "zfnet512", "squeezenet", "shufflenet", "resnet50", "vgg19")  # minutes, not tens of
ALL_LIGHT = LIGHT + ("densenet121", "inception_v1", "inception_v2")


@dataclass(frozen=True)
class FromRegistry:
    """How a command takes registry names: the export's ``config`` and ``exporter``; ``force`` (``--registry``)
    takes the registry's model where the zoo has one of the same name."""

    config: str = "full"
    exporter: str = "dynamo"
    force: bool = False


@dataclass(frozen=True)
class Resolved:
    """A resolved name: ``name`` to show, the ``.onnx`` file, and the zoo's model (None for the others)."""

    name: str
    path: str
    zoo: Any = None


def light_path(name: str) -> str:
    """The path of the onnx wheel's light model ``name`` (e.g. ``resnet50``)."""
    import onnx

    return os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light", f"light_{name}.onnx")


def default_model() -> str:
    """The light ResNet-50 that ships in the onnx wheel (``cuvil compile`` without a model)."""
    return light_path("resnet50")


def default_models() -> list[str]:
    """The model names ``cuvil bench`` runs without arguments: :data:`LIGHT`, then the zoo's."""
    from cuvil.models.zoo import MODELS

    return [f"light_{n}" for n in LIGHT] + list(MODELS)


def resolve(name: str, workdir: str, registry: FromRegistry | None = None) -> Resolved:
    """The ONNX file of model ``name`` (see the module docstring; a zoo model is written to ``workdir``)."""
    from cuvil.models import zoo

    if registry is not None and (registry.force or (not os.path.exists(name) and name not in zoo.MODELS
                                                    and name in _registry().MODELS)):
        return Resolved(name, _export(name, registry))
    if name in zoo.MODELS:
        import onnx

        path = os.path.join(workdir, f"{name}.onnx")
        onnx.save(zoo.MODELS[name].build(), path)
        return Resolved(name, path, zoo.MODELS[name])
    also = f"; or a registry model (cuvil.models.registry): {', '.join(_registry().names())}" if registry else ""
    if name.startswith("light_") and not os.path.exists(name):
        path = light_path(name[len("light_"):])
        if not os.path.exists(path):
            raise ArgumentError(f"no light model {name!r} in the onnx wheel; there are: "
                                f"{', '.join('light_' + n for n in ALL_LIGHT)}{also}")
        return Resolved(os.path.splitext(os.path.basename(name))[0], path)
    if not os.path.exists(name):
        raise ArgumentError(f"{name!r} is neither a model file nor one of the models cuvil bench knows: "
                            f"{', '.join(default_models())}{also}")
    return Resolved(os.path.splitext(os.path.basename(name))[0], name)


def _registry() -> Any:
    from cuvil.models import registry

    return registry


def _export(name: str, how: FromRegistry) -> str:
    try:
        return _registry().export(name, config=how.config, exporter=how.exporter)
    except ModuleNotFoundError as exc:
        raise ArgumentError(f"registry model {name!r}: the registry builds its models with {exc.name}, which "
                            f"is not installed (pip install torch)") from None


def resolve_inputs(name: str, workdir: str, shapes: dict[str, tuple[int, ...]] | None = None
                   ) -> tuple[str, str, dict[str, np.ndarray]]:
    """(display name, path of the .onnx file, inputs) for a zoo name, ``light_<name>`` or a path.  The
    inputs are the zoo model's own, or random (:func:`cuvil.graph.feeds.random_feeds`) of ``shapes``,
    the declared shapes and 1 for a symbolic dimension left open."""
    from cuvil.frontend.onnx import import_model
    from cuvil.graph.feeds import random_feeds

    model = resolve(name, workdir)
    if model.zoo is not None and not shapes:
        return model.name, model.path, model.zoo.feeds(np.random.default_rng(0))
    graph = import_model(model.path)
    full, _ = input_shapes(graph.feeds, dict(shapes or {}), symbolic_default=1)
    return model.name, model.path, random_feeds(graph, full)


def input_shapes(feeds: Sequence[Any], given: dict[str, tuple[int, ...]], symbolic_default: int | None = 1
                 ) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """Every input's shape from ``--shapes`` (``given``), checked against the model's declared shapes,
    or the declared shape; a symbolic dimension left open is ``symbolic_default`` (with a note), or,
    when that is None, an error that says which ``--shapes`` to pass.  Returns (shapes, notes)."""
    from cuvil.graph.export import check_given_shape

    declared = {v.name: v.shape for v in feeds}
    unknown = [n for n in given if n not in declared]
    if unknown:
        raise ArgumentError(f"--shapes names {', '.join(repr(n) for n in unknown)}, not an input of the model; its "
                            f"inputs: {inputs_str(feeds)}")
    shapes: dict[str, tuple[int, ...]] = {}
    symbols: dict[str, tuple[int, str]] = {}
    open_inputs = []
    for v in feeds:
        want = v.shape
        if v.name in given:
            got = given[v.name]
            check_given_shape(f"--shapes {v.name}={','.join(map(str, got))}", v.name, want, tuple(got), symbols)
            shapes[v.name] = tuple(got)
        elif want is not None and all(isinstance(d, int) for d in want):
            shapes[v.name] = tuple(want)  # type: ignore[arg-type]
        else:
            open_inputs.append(v)
    if open_inputs and symbolic_default is None:
        example = " ".join(f"{v.name}=" + ",".join(str(d) if isinstance(d, int) else "1" for d in (v.shape or ["1"]))
                           for v in open_inputs)
        raise ShapeError(f"input(s) {', '.join(f'{v.name!r} {list(v.shape or [])}' for v in open_inputs)} have "
                         "symbolic dimensions, and a library is compiled for fixed shapes: pass --shapes "
                         f"name=d0,d1,... (here e.g. --shapes {example}); repeat --shapes to compile several "
                         "sizes into one library (its C functions then take the sizes)")
    return shapes, _fill_open(open_inputs, shapes, symbols, symbolic_default)


def _fill_open(open_inputs: list[Any], shapes: dict[str, tuple[int, ...]], symbols: dict[str, tuple[int, str]],
               symbolic_default: int | None) -> list[str]:
    """Give the inputs with open symbolic dimensions a shape in ``shapes``; returns a note for each."""
    notes: list[str] = []
    for v in open_inputs:
        if v.shape is None:
            raise ShapeError(f"input {v.name!r} declares no shape: give it with --shapes {v.name}=d0,d1,...")
        dims = tuple(d if isinstance(d, int) else symbols.get(d, (symbolic_default,))[0] for d in v.shape)
        shapes[v.name] = dims  # type: ignore[assignment]
        if all(isinstance(d, int) or d in symbols for d in v.shape):
            notes.append(f"input {v.name}: symbolic dimensions from the other inputs: {list(v.shape)} -> {list(dims)}")
        else:
            notes.append(f"input {v.name}: symbolic dimensions set to {symbolic_default} (--shapes sets them): "
                         f"{list(v.shape)} -> {list(dims)}")
    return notes


def inputs_str(feeds: Sequence[Any]) -> str:
    """``x [1, 3, 224, 224], mask ['batch', 128]``: a model's inputs for an error message."""
    return ", ".join(f"{v.name} {list(v.shape) if v.shape is not None else '(no shape)'}" for v in feeds) or "none"
