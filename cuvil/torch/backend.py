"""``torch.compile(model, backend="cuvil")``: cuvil as a TorchDynamo backend.

    import torch
    fast = torch.compile(model, backend="cuvil")                 # registered by pyproject's entry point
    with torch.no_grad():                                         # (or torch.inference_mode())
        y = fast(x)
    torch.compile(model, backend="cuvil", options={"strict": True, "target": "llvm", "num_threads": 2})

Dynamo hands each captured graph to :func:`cuvil_backend`; aot_autograd lowers it to ATen with the
importer's :func:`~cuvil.frontend.torch.decompositions`, and the inference graph is imported into the
graph IR and compiled by :class:`cuvil.onnx.InferenceSession` (one native program per input-shape
signature, compiled on first use and cached: with ``dynamic=True`` a sequence length seen before never
compiles again).  Without ``dynamic=``, dynamo's automatic dynamic shapes give the first shape a static
graph and later ones a symbolic graph, which dynamo then tries first: the first shape compiles once more.

- **Frozen weights.**  The module's parameters and buffers (which dynamo passes to the graph as inputs)
  are copied into the compiled program as constants, as Inductor's freezing does, so BatchNorm folds
  into convolutions and weights are packed once.  Later in-place changes to them (an optimizer step,
  ``load_state_dict``) are **not** seen by the compiled model; compile again (``torch._dynamo.reset()``)
  after changing weights.  A graph that dynamo reuses for another module instance (the same code with
  other weight tensors) compiles once more for those weights.
- **Gradients.**  A graph that needs them (grad mode on and an input, e.g. a parameter, requiring grad)
  runs in eager torch, with one warning per process on the ``cuvil.torch`` logger: call the model
  under ``torch.no_grad()`` or ``torch.inference_mode()``.
- **Unsupported operators** split the graph: the parts cuvil supports are compiled by cuvil, the rest
  runs in eager torch, with one log line naming the operators.  ``options={"strict": True}`` raises the
  importer's :class:`~cuvil.errors.UnsupportedOpError` instead (dynamo reports what a backend raises as
  ``torch._dynamo.exc.BackendCompilerFailed``, the UnsupportedOpError as its ``inner_exception``).

Options (``torch.compile(..., options={...})``): ``strict`` (False), ``target`` (None: this host),
``num_threads`` (None), ``tuning_db`` (None), ``compile_options`` (a :class:`cuvil.options.CompileOptions`:
precision, Winograd, thresholds, ...; ``target`` and ``tuning_db`` replace its own), as
:func:`cuvil.torch.compile` takes them.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

from cuvil.errors import ArgumentError, DTypeError, UnsupportedOpError

__all__ = ["OPTIONS", "cuvil_backend", "register", "skip_weight_guards"]

log = logging.getLogger("cuvil.torch")
OPTIONS: Mapping[str, Any] = MappingProxyType({"strict": False, "target": None, "num_threads": None,
                                                "tuning_db": None, "compile_options": None})  # the defaults
# (target None: the compile options' target, "llvm" by default; compile_options: a cuvil.options.CompileOptions)
_warned_grad = False
_count = 0


def cuvil_backend(gm: Any, example_inputs: Sequence[Any], options: Mapping[str, Any] | None = None,
                  **kwargs: Any) -> Callable:
    """The TorchDynamo backend: ``gm`` (dynamo's FX graph) and its example inputs -> a callable of the
    same inputs.  ``options`` (or keyword arguments) are those of :data:`OPTIONS`; ``mode`` is ignored."""
    import torch
    from torch._dynamo.backends.common import aot_autograd

    kwargs.pop("mode", None)
    opts = _options({**(options or {}), **kwargs})
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        _warn_grad()
        return gm
    devices = sorted({str(t.device) for t in tensors if t.device.type != "cpu"})
    if devices:
        if opts["strict"]:
            raise ArgumentError(f"cuvil's torch.compile backend takes CPU tensors, got tensors on {devices}")
        log.warning("cuvil.torch: a graph of tensors on %s runs in eager torch (cuvil takes CPU tensors)", devices)
        return gm
    global _count
    _count += 1
    name = f"torch_compile_{_count}"
    lifted, frozen = _weights(gm, example_inputs)
    n_inputs = len(lifted) + len(example_inputs)

    def inference(aten: Any, fakes: Sequence[Any]) -> Callable:
        return _Compiled(aten, n_inputs, frozen, opts, name)

    return aot_autograd(fw_compiler=_eager, inference_compiler=inference, decompositions=_decompositions)(
        gm, example_inputs)


def skip_weight_guards(entries: Sequence[Any]) -> list[bool]:
    """A ``guard_filter_fn`` for ``torch.compile(model, backend="cuvil", options={"guard_filter_fn":
    cuvil.torch.backend.skip_weight_guards})``: drops dynamo's per-call checks of the module's parameter
    and buffer tensors (``TENSOR_MATCH`` on ``._parameters[...]`` / ``._buffers[...]``), keeps every
    other guard (the inputs, the modules' structure, hooks, ``training``, global state).

    Safe with this backend, which compiles the weights in as constants (frozen) and checks itself, by
    identity, that a call passes the tensors it froze (a replaced parameter, another module instance:
    compiled again for them); on a model of ~300 weight tensors it saves ~0.3-0.5 ms of dynamo's work
    per call (docs/torch.md).  A weight's dtype or device changed in place is not seen, as its values
    are not: compile again after changing the model."""
    return [not (e.guard_type == "TENSOR_MATCH" and ("._parameters[" in e.name or "._buffers[" in e.name))
            for e in entries]


def register() -> None:
    """Register ``"cuvil"`` with ``torch._dynamo`` unless its entry point (pyproject's
    ``torch_dynamo_backends`` group, installed by ``pip install``) already names it."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        if any(ep.group == "torch_dynamo_backends" and ep.name == "cuvil" for ep in distribution("cuvil").entry_points):
            return
    except PackageNotFoundError:  # cuvil imported from a checkout, not installed
        pass
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if "cuvil" not in _COMPILER_FNS:
        register_backend(cuvil_backend, name="cuvil")


def _options(opts: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(opts) - set(OPTIONS))
    if unknown:
        raise ArgumentError(f"unknown cuvil backend option(s) {', '.join(unknown)}; options: {', '.join(OPTIONS)}")
    return {**OPTIONS, **opts}


def _warn_grad() -> None:
    global _warned_grad
    if not _warned_grad:
        _warned_grad = True
        log.warning("cuvil.torch: a graph needs gradients (grad mode is on and an input requires grad), so it "
                    "runs in eager torch; call the model under torch.no_grad() or torch.inference_mode() to "
                    "compile it with cuvil (this warning is shown once)")


def _eager(aten: Any, fakes: Sequence[Any]) -> Callable:
    return aten  # a training graph (not reached: cuvil_backend keeps those in eager torch)


def _decompositions() -> dict:
    """The importer's decompositions, keeping the CPU attention kernel that ``scaled_dot_product_attention``
    becomes under aot_autograd whole (its decomposition is a softmax written out with ``any``)."""
    import torch

    from cuvil.frontend.torch import decompositions

    table = decompositions()
    table.pop(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, None)
    return table


def _weights(gm: Any, example_inputs: Sequence[Any]) -> tuple[list[Any], dict[int, Any]]:
    """aot_autograd's inputs are the graph module's own parameters and buffers (``lifted``, when dynamo
    kept any as attributes), then ``example_inputs``; returns ``lifted`` and, by input position, the
    tensors to freeze: those, and the inputs dynamo marked static that come from an ``nn.Module``
    (its parameters, buffers and tensor attributes)."""
    import torch

    lifted = [*dict(gm.named_parameters(remove_duplicate=False)).values(),
              *dict(gm.named_buffers(remove_duplicate=False)).values()]
    frozen: dict[int, Any] = dict(enumerate(lifted))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for k, (n, t) in enumerate(zip(placeholders, example_inputs)):
        if not isinstance(t, torch.Tensor):
            continue
        static = n.meta.get("tensor_dict", {}).get("_dynamo_static_input_type") or \
            getattr(t, "_dynamo_static_input_type", None)
        source = getattr(n, "_dynamo_source", None)
        if source is None and "grapharg" in n.meta:
            source = getattr(n.meta["grapharg"], "source", None)
        where = getattr(source, "guard_source", None)
        from_module = isinstance(t, torch.nn.Parameter) or (where is not None and (
            where.is_unspecialized_nn_module() or where.is_specialized_nn_module()))
        if static and from_module:
            frozen[len(lifted) + k] = t
    return lifted, frozen


class _Compiled:
    """The inference compiler's result: called with aot_autograd's flat inputs, returns the outputs.

    Holds one runner per set of frozen weight tensors (by identity): dynamo reuses a graph for every
    module instance whose code it is, passing that instance's weights."""

    def __init__(self, aten: Any, n_inputs: int, frozen: dict[int, Any], opts: dict[str, Any], name: str):
        import torch

        placeholders = [n for n in aten.graph.nodes if n.op == "placeholder"]
        ctx = torch._guards.TracingContext.try_get()
        meta = getattr(ctx, "fw_metadata", None)
        info = getattr(meta, "input_info", None) or []
        mutated = {k for k, i in enumerate(info) if i.mutates_data or i.mutates_metadata}
        if len(placeholders) != n_inputs:
            log.info("cuvil.torch: %s: cannot match the ATen graph's inputs with dynamo's; weights are not "
                     "frozen", name)
            frozen = {}
        self.frozen = sorted(k for k in frozen if k not in mutated)
        self.aten, self.opts, self.name = aten, opts, name
        self.variants: list[_Variant] = []
        self._current = self._build([frozen[k] for k in self.frozen])

    def _build(self, weights: list[Any]) -> _Variant:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        from cuvil.frontend.torch import numpy_copy

        with unset_fake_temporarily():  # aot_autograd calls the compiler under its fake mode
            try:
                consts = {k: numpy_copy(t) for k, t in zip(self.frozen, weights)}
            except DTypeError as e:  # bfloat16 weights
                if self.opts["strict"]:
                    raise
                log.warning("cuvil.torch: %s runs in eager torch: %s", self.name, e)
                runner = self.aten
            else:
                runner = _split_and_compile(self.aten, consts, self.opts, self.name)
        variant = _Variant(weights, runner)
        self.variants.append(variant)
        return variant

    def _ids(self, args: Sequence[Any]) -> tuple[int, ...]:
        return tuple(map(id, map(args.__getitem__, self.frozen)))

    def __call__(self, *args: Any) -> Any:
        v = self._current
        if not (v.alive and self._ids(args) == v.ids):
            v = self._current = self._variant(args)
        return v.runner(*args)

    def _variant(self, args: Sequence[Any]) -> _Variant:
        self.variants = [v for v in self.variants if v.alive]
        ids = self._ids(args)
        for v in self.variants:
            if v.ids == ids:
                return v
        log.info("cuvil.torch: %s runs with other weight tensors (another module instance); compiling it for "
                 "them", self.name)
        return self._build([args[k] for k in self.frozen])


class _Variant:
    """A runner for one set of weight tensors, known by their ids while they are alive."""

    def __init__(self, weights: list[Any], runner: Callable):
        self.ids = tuple(map(id, weights))
        self.runner = runner
        self.alive = True
        self._refs = [weakref.ref(t, self._died) for t in weights]

    def _died(self, ref: Any) -> None:
        self.alive = False


# -- splitting at unsupported operators ------------------------------------------------------------


def _split_and_compile(aten: Any, consts: dict[int, np.ndarray], opts: dict[str, Any], name: str) -> Callable:
    """``aten`` as one cuvil program or, when some of its nodes cuvil cannot translate, as the graph
    split into cuvil programs and eager torch."""
    from cuvil.frontend.torch import check_supported, unsupported_nodes

    if opts["strict"]:
        check_supported(aten.graph, name)
        return _Program(aten, consts, opts, name)
    eager = {n.name for n in aten.graph.nodes if n.op not in ("placeholder", "output", "call_function", "get_attr")}
    eager |= {n.name for n in unsupported_nodes(aten.graph)}
    if not eager:
        try:
            return _Program(aten, consts, opts, name)
        except _REFUSED as e:  # a supported operator refused its arguments, or a dtype
            eager = _named_node(e)
            if not eager:
                log.warning("cuvil.torch: %s runs in eager torch: %s", name, e)
                return aten
    return _partitioned(aten, consts, opts, name, eager)


_REFUSED = (UnsupportedOpError, DTypeError)


def _named_node(e: Exception) -> set[str]:
    """The node an importer error names (``node 'x' (aten::...): ...``)."""
    m = re.match(r"node '([^']+)'", str(e))
    return {m.group(1)} if m else set()


def _partitioned(aten: Any, consts: dict[int, np.ndarray], opts: dict[str, Any], name: str,
                 eager: set[str]) -> Callable:
    """``aten`` split by torch's CapabilityBasedPartitioner into cuvil programs around the nodes named in
    ``eager`` (and any node a part's import refuses), which eager torch runs."""
    import torch
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import OperatorSupportBase

    from cuvil.frontend.torch import target_name

    class Support(OperatorSupportBase):
        def is_node_supported(self, submodules: Any, node: Any) -> bool:
            return node.op == "call_function" and node.name not in eager

    nodes = {n.name: n for n in aten.graph.nodes}
    placeholders = {n.name: k for k, n in enumerate(n for n in aten.graph.nodes if n.op == "placeholder")}
    for _attempt in range(16):
        graph = torch.fx.Graph()  # the partitioner rewrites the graph it is given: a copy (meta shared)
        graph.output(graph.graph_copy(aten.graph, {}))
        split = CapabilityBasedPartitioner(torch.fx.GraphModule(aten, graph), Support()).partition_and_fuse(
            prefix="cuvil_")
        refused: set[str] = set()
        pieces = 0
        for node in list(split.graph.nodes):
            if node.op != "call_module":
                continue
            outer = [placeholders.get(a.name) if a.op == "placeholder" else None for a in node.args]
            try:
                program = _Program(getattr(split, node.target), {j: consts[k] for j, k in enumerate(outer)
                                                                  if k in consts}, opts, f"{name}_{node.target}")
            except _REFUSED as e:
                named = _named_node(e) & set(nodes)
                refused |= named
                if not named:
                    log.warning("cuvil.torch: %s: part %s runs in eager torch: %s", name, node.target, e)
                continue
            delattr(split, node.target)  # the submodule, replaced by a plain callable attribute
            setattr(split, node.target, program)
            pieces += 1
        if not refused:
            break
        eager |= refused
    ops = sorted({target_name(nodes[n].target) if nodes[n].op == "call_function" else f"{nodes[n].op} "
                  f"{nodes[n].target}" for n in eager})
    log.warning("cuvil.torch: %s: %d ATen operator(s) run in eager torch, the graph split around them into %d "
                "cuvil part(s): %s", name, len(ops), pieces, ", ".join(ops))
    return split


class _Program:
    """One FX graph compiled by cuvil, called with its placeholders' values (torch tensors, sizes) and
    returning what the graph returns (a tuple for several results), as CPU tensors."""

    def __init__(self, gm: Any, consts: dict[int, np.ndarray], opts: dict[str, Any], name: str):
        import torch

        from cuvil.frontend.torch import import_graph_module, node_meta
        from cuvil.onnx import InferenceSession

        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        feeds = [consts[k] if k in consts else n.name for k, n in enumerate(placeholders)]
        self.imported = import_graph_module(gm, feeds, name)
        self.session = InferenceSession.from_graph(self.imported.graph, target=opts["target"],
                                                   num_threads=opts["num_threads"], tuning_db=opts["tuning_db"],
                                                   options=opts["compile_options"])
        self.fed = [(k, v) for k, v in enumerate(self.imported.inputs) if v is not None]
        result = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        self.several = isinstance(result, (list, tuple))
        flat = result if self.several else [result]
        self.ints = [isinstance(node_meta(r) if isinstance(r, torch.fx.Node) else r, (int, torch.SymInt)) for r in flat]
        self.plan = [(kind, v, as_int) for (kind, v), as_int in zip(self.imported.outputs, self.ints)]

        # the common case, tensor results only: the outputs straight from the native program's results
        self.tensors_out = all(kind == "tensor" and not as_int for kind, _, as_int in self.plan)
        self._torch = torch

    def __call__(self, *args: Any) -> Any:
        torch = self._torch
        results = self.session.run(None, {name: _numpy(args[k]) for k, name in self.fed})
        if self.tensors_out:
            return tuple(map(torch.from_numpy, results)) if self.several else torch.from_numpy(results[0])
        results = iter(results)
        out = []
        for kind, v, as_int in self.plan:
            if kind != "tensor":
                out.append(v)
            else:
                a = next(results)
                out.append(int(a) if as_int else torch.from_numpy(a))
        return tuple(out) if self.several else out[0]


def _numpy(t: Any) -> np.ndarray:
    """A feed: a tensor as cuvil.torch reads one (in place when contiguous), a size as a 0-d array."""
    import torch

    from cuvil.torch import _as_numpy

    return _as_numpy(t, "input", None, torch) if isinstance(t, torch.Tensor) else np.asarray(t)


register()
