"""The graph compiler: one :class:`~cuvil.graph.ir.Graph` -> one :class:`CompiledGraph` (one native module).

Every importer (ONNX, PyTorch) hands its graph here; nothing else compiles whole models::

    prog = compile_model(graph, {"x": (1, 3, 224, 224)})
    outputs = prog.run({"x": x})                     # one native call

:func:`compile_model`, top to bottom:

1. **check**   every node's op has a builder (one ``UnsupportedOpError`` lists them all)
2. **passes**  :func:`cuvil.graph.passes.optimize`: identities, BatchNorm folded into convolutions,
               layout, duplicates, dead nodes (:func:`prepare` = 1 + 2; a session does it once)
3. **groups**  :func:`cuvil.graph.fuse.fusion_groups`: a node and the element-wise nodes after it
4. **kernels** each group's builders (:mod:`cuvil.graph.ops`) give te tensors, auto-scheduled (or
               replaying a tuning record) and lowered to loop IR; kernels are cached (in memory and on
               disk) by op, attributes, input shapes and the values the builders read; a group whose
               inputs are all known is run now and its outputs become constants (folding)
5. **link**    each kernel compiled into an object file of its own (in workers), and an entry point
               that makes the calls in order: one native module (:mod:`cuvil.graph.link`)
6. **memory**  temporaries share one arena, reused by lifetime (:mod:`cuvil.graph.memplan`)

A kernel whose automatic schedule isl cannot handle within its operation bound takes a plainer one
(the te order); a fused group that does not compile is compiled node by node.  Each such fallback is
one ``cuvil.schedule`` log line and one entry of ``prog.fallbacks``.  docs/graph.md tells the whole story.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from cuvil.cache import BoundedCache
from cuvil.errors import BoundsError, CuvilError, IslBudgetError, ModelError, UnsupportedOpError
from cuvil.graph import kernel_cache, parallel
from cuvil.graph.compiled import CompiledGraph, Slot, contiguous, link, temp_bytes
from cuvil.graph.concat_in_place import concat_parts, concats_in_place
from cuvil.graph.ir import Graph, Node
from cuvil.graph.ops.base import (
    Alias,
    Entry,
    Fused,
    NodeCtx,
    NotFusible,
    Runtime,
    Shaped,
    builder_for,
    inline_elementwise,
    t_shape,
)
from cuvil.graph.profile import contraction_flops
from cuvil.options import CompileOptions
from cuvil.schedule.fallback import first_line, scheduling

__all__ = ["CompiledGraph", "check_supported", "clear_kernels", "compile_graph", "compile_model", "kernel_programs",
           "prepare"]

log = logging.getLogger("cuvil.schedule")


# -- the pipeline -----------------------------------------------------------------------------


def compile_model(graph: Graph, shapes: Mapping[str, tuple[int, ...]], known: Mapping[str, np.ndarray] | None = None,
                  options: CompileOptions | Any = None, dump: Any = None, **given: Any) -> CompiledGraph:
    """Compile an imported ``graph`` for inputs of ``shapes`` (fed at run time) and inputs of ``known``
    values (specialised on): :func:`prepare` (the passes ``options`` name) then :func:`compile_graph`."""
    opts = CompileOptions.of(options, **{k: v for k, v in given.items() if k not in ("progress", "on_kernel")})
    return compile_graph(prepare(graph, dump=dump, passes=opts.passes), shapes, known or {}, opts,
                         progress=given.get("progress"), on_kernel=given.get("on_kernel"))


def prepare(graph: Graph, dump: Any = None, passes: Any = None) -> Graph:
    """Steps 1-2: check that every op is supported, then run the graph passes (all, or those named in
    ``passes``; ``dump(name, graph)`` is called after each pass)."""
    from cuvil.graph.passes import optimize

    check_supported(graph)
    return optimize(graph, dump=dump, names=passes)


def compile_graph(graph: Graph, shapes: Mapping[str, tuple[int, ...]], known: Mapping[str, np.ndarray],
                  options: CompileOptions | Any = None, progress: Any = None, on_kernel: Any = None,
                  **given: Any) -> CompiledGraph:
    """Steps 3-6 on a prepared graph, as ``options`` say (a :class:`cuvil.options.CompileOptions`, or a
    target string; keyword arguments named like its fields replace them: ``fuse=False``).  With ``fuse``,
    each fusion group is one kernel; otherwise each node is.  ``progress(done, total, node)`` is called per
    group; ``on_kernel(key, args, label)`` per kernel call.  ``bounds_checks=False`` leaves out the run-time
    bounds checks (of indices read from inputs: a Gather's).  ``precision="bf16"``: contractions with
    constant weights multiply in bfloat16 (cuvil/graph/ops/nn/bf16.py; float32 with a warning on a CPU without
    AVX512-BF16).  Raises ``NeedsValue`` when a builder needs a fed input's value."""
    from cuvil.graph.fuse import Group, fusion_groups
    from cuvil.graph.memplan import plan_with_views
    from cuvil.graph.ops.nn.bf16 import resolve_precision
    from cuvil.target import Target

    opts = CompileOptions.of(options, **given).resolved()
    check_supported(graph)
    target = Target(opts.target)
    precision = resolve_precision(opts.precision, target)
    c = _GraphCompiler(graph, shapes, known, opts.replace(precision=precision), on_kernel)
    if precision != opts.precision:
        c.fallbacks.append(f"precision {opts.precision} -> {precision}: the target lacks avx512bf16")
    groups = fusion_groups(graph) if opts.fuse else tuple(Group((k,)) for k in range(len(graph.nodes)))  # 3.
    clock = time.perf_counter()
    done = 0
    with c.workers:  # (forked when two kernels wait to be lowered; ended here)
        try:
            for grp in groups:  # 4.
                nodes = [graph.nodes[k] for k in grp.members]
                if progress is not None:
                    progress(done, len(graph.nodes), nodes[0])
                if len(nodes) == 1 or not c.group(nodes):
                    for node in nodes:
                        c.node(node)
                done += len(nodes)
            c.resolve()  # the kernels lowered in worker processes
        except _Serial as exc:  # a worker's kernel failed where this process would have taken another way
            log.debug("compiling in this process: %s", exc)
            return compile_graph(graph, shapes, known, opts.replace(jobs=1), progress=progress, on_kernel=on_kernel)
        outputs = c.outputs()
        views = concats_in_place(c, outputs) if opts.fuse else {}
        seconds = {"kernels": time.perf_counter() - clock}
        clock = time.perf_counter()
        kernels, calls, module = link(c.calls, c.target, c.workers, c.keys)  # 5.
        seconds["llvm"] = time.perf_counter() - clock
    memory = plan_with_views([args for _, args in c.calls], temp_bytes(c.slots, outputs), views)  # 6.
    prog = CompiledGraph(c.slots, kernels, calls, module, memory, outputs, c.target, c.labels, tuple(c.fallbacks),
                         c.call_nodes, c.call_flops)
    prog.seconds = seconds
    return prog


def check_supported(graph: Graph) -> None:
    """Raise one UnsupportedOpError naming every unsupported op type and its nodes."""
    missing: dict[str, list[str]] = {}
    for n in graph.nodes:
        if n.domain not in ("", "ai.onnx") or builder_for(n.op_type, graph.opset) is None:
            key = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}"
            missing.setdefault(key, []).append(n.name)
    if missing:
        parts = [f"{op} (node{'s' if len(ns) > 1 else ''} {', '.join(repr(x) for x in ns[:8])}"
                 f"{', ...' if len(ns) > 8 else ''})" for op, ns in sorted(missing.items())]
        raise UnsupportedOpError(f"the model uses {len(missing)} operator type(s) cuvil does not support at opset "
                                 f"{graph.opset}: {'; '.join(parts)}")


def kernel_programs(graph: Graph, target: CompileOptions | Any = "llvm",
                    shapes: Mapping[str, tuple[int, ...]] | None = None, named: bool = False) -> list[Any]:
    """The distinct kernels one run of an imported ``graph`` calls, each as (its te arguments, how many
    calls of it a run makes), with ``named`` also its :func:`kernel_name`: what ``cuvil tune`` tunes.
    Symbolic input dimensions need ``shapes``; the graph is compiled once on the way (folding its constants)."""
    from cuvil.errors import ShapeError
    from cuvil.graph.ops.base import NeedsValue

    opts = CompileOptions.of(target)
    graph = prepare(graph, passes=opts.passes)
    static = {v.name: (tuple(shapes[v.name]) if shapes and v.name in shapes else v.shape) for v in graph.feeds}
    open_dims = [n for n, s in static.items() if s is None or not all(isinstance(d, int) for d in s)]
    if open_dims:
        raise ShapeError(f"inputs {', '.join(open_dims)} have symbolic dimensions: give their sizes, e.g. "
                         f"shapes={{{open_dims[0]!r}: (1, 3, 224, 224)}}")
    found: dict[tuple, list[Any]] = {}

    def on_kernel(key: tuple, args: list[Any], label: str) -> None:
        found.setdefault(key, [args, 0, kernel_name(key)])[1] += 1

    try:
        compile_graph(graph, static, {}, opts, on_kernel=on_kernel)  # type: ignore[arg-type]
    except NeedsValue as exc:
        raise ShapeError(f"a shape of this model depends on the value of an input ({exc}): its kernels are "
                         "only known for given values; tune them one by one with cuvil.autotune.tune") from None
    return [(args, n, name) if named else (args, n) for args, n, name in found.values()]


def kernel_name(key: tuple) -> str:
    """A kernel's name for people, from its key: the first node's op and the shapes of its inputs computed at
    run time and of its first constant input of rank 2 or more (the weight; not a bias, a shape vector or the
    packed copy of the weight the layout pass adds), then the ops fused after it, e.g.
    ``Conv 1x64x56x56 * 64x64x3x3 (+Add+Relu)``."""
    members = [m for m in key[1:] if isinstance(m, tuple)] if key[0] == "fused" else [key]  # (not the build's
    # additions to a key: the options tag, a tuning database)
    first = members[0]  # (target, op type, opset, attrs, spec, values, outputs...): see kernel_cache.node_key
    dims, weight = [], False
    for e in first[4]:
        if e is None or e[0] == "fused" or (e[2] and (weight or len(e[0]) < 2)):
            continue
        dims.append(e[0])
        weight = weight or e[2]
    text = " * ".join("x".join(map(str, d)) or "scalar" for d in dims)
    fused = "+".join(m[1] for m in members[1:])
    return f"{first[1]} {text}".strip() + (f" (+{fused})" if fused else "")


# -- kernels ----------------------------------------------------------------------------------

# (target, node key) -> (LoweredFunc named "k", why it took a plainer schedule or None), shared by every
# session.  A model has tens of distinct kernels (ResNet-50: 44; docs/pipeline.md), a few hundred at most:
# 1024 keep several models' warm; an evicted one is read back from the on-disk cache (kernel_cache), or
# lowered again when that is off
_KERNELS: BoundedCache[tuple, tuple[Any, str | None]] = BoundedCache("cuvil.graph.compile._KERNELS", 1024)


def clear_kernels() -> None:
    """Forget the kernels lowered in this process (the next compile lowers them again, or reads them from
    the on-disk cache, :func:`cuvil.graph.kernel_cache.clear` empties that), and the modules that folded
    constants with them."""
    _KERNELS.clear()
    _FOLDERS.clear()


def lower_kernel(what: str, args: list[Any], placeholders: list[Any], options: CompileOptions
                 ) -> tuple[Any, str | None]:
    """The loop IR of one kernel (``what`` names its node or fused nodes in errors), and why it took a
    plainer schedule than the automatic one (None when it did not): the te order, or the strategies the
    automatic scheduler lost (its schedule's ``fallbacks``, already logged; alternatives it searched
    through are not counted).  With ``tuning_db``, the best tuning record of the kernel's computation
    replaces the automatic schedule when there is one."""
    import cuvil
    from cuvil import te
    from cuvil.errors import ScheduleError
    from cuvil.ir.workspace import hoist_workspace

    outputs = [a for a in args if not any(a is p for p in placeholders)]
    target, tuning_db, bounds_checks = options.target, options.tuning_db, options.bounds_checks
    try:
        try:
            with scheduling(what):  # its fallbacks' log lines name the node
                s = cuvil.auto_schedule(args, target, heuristics=options.heuristics,
                                        prove=True if options.check_schedules else None)
                if tuning_db is not None:
                    from cuvil.runtime.threads import get_num_threads
                    from cuvil.schedule.records import apply_best

                    # a replayed record: a fresh schedule
                    s = apply_best(s, args, target, tuning_db, threads=get_num_threads())
            func = hoist_workspace(cuvil.lower(s, args, name="k", bounds_checks=bounds_checks))
            lost = [str(f) for f in getattr(s, "fallbacks", ()) if f.loss]
            return func, (f"its automatic schedule fell back: {'; '.join(lost)}" if lost else None)
        except (ScheduleError, IslBudgetError) as exc:
            why = f"its automatic schedule failed ({first_line(exc)}); compiled in the te order"
            log.warning("%s: %s", what, why)
            return hoist_workspace(cuvil.lower(te.create_schedule(outputs), args, name="k",
                                               bounds_checks=bounds_checks)), why
    except CuvilError as exc:
        raise type(exc)(f"{what}: {exc}") from None
    except Exception as exc:
        raise CuvilError(f"{what}: internal error while compiling its kernel: {type(exc).__name__}: {exc}"
                         ) from exc


def _tensor_and_shape(o: Any) -> tuple[Any, tuple[int, ...] | None]:
    """A builder's output as (te tensor, the shape the graph sees), or (None, None) when not computed."""
    from cuvil.te.tensor import Tensor

    if isinstance(o, Shaped):
        return o.tensor, o.shape
    if isinstance(o, Tensor):
        return o, tuple(int(d.value) for d in o.shape)
    return None, None


class _GraphCompiler:
    """The state of one :func:`compile_graph`: buffers (slots), the values of the graph's names (env),
    the kernel calls in run order, and the fallbacks taken."""

    def __init__(self, graph: Graph, shapes: Mapping[str, tuple[int, ...]], known: Mapping[str, np.ndarray],
                 options: CompileOptions, on_kernel: Any = None):
        from cuvil.target import Target

        self.graph = graph
        self.options = options  # resolved: the thresholds filled in
        self.options_tag = "options " + hashlib.sha1(repr(options.key()).encode()).hexdigest()[:16]  # in every key
        self.bounds_checks = options.bounds_checks
        self.target = Target(options.target)
        self.tuning_db = options.tuning_db  # kernels replay their best tuning records (cuvil.autotune)
        self.on_kernel = on_kernel  # called as on_kernel(key, args, label) for each kernel call the graph runs
        self.slots: list[Slot] = []
        self.calls: list[tuple[Any, tuple[int, ...]]] = []
        self.labels: list[str] = []
        self.call_nodes: list[tuple[Any, ...]] = []  # per call: (op type, name, inputs) of each member node
        self.call_flops: list[tuple[float, str]] = []  # per call: its contractions' work (profile.contraction_flops)
        self.fallbacks: list[str] = []
        self.precision = options.precision  # "fp32" or "bf16" (resolved for the target by compile_graph)
        # worker processes that lower kernels (1: none); a database object in memory stays in this process
        picklable_db = options.tuning_db is None or isinstance(options.tuning_db, (str, os.PathLike))
        self.workers = parallel.Workers(parallel.workers_for(options) if picklable_db else 1)
        self._pending: dict[tuple, _Kernel] = {}  # key -> a kernel to lower in a worker (resolve())
        self._queued: list[_Kernel] = []  # not yet submitted: the workers are forked when two wait
        self.keys: dict[int, tuple] = {}  # id(kernel) -> its cache key, which names its machine code (link)
        self._const_slot: dict[int, int] = {}
        # Concat calls whose inputs could be written in place: (call index, output slot, (slot, offset)...)
        self.concats: list[tuple[int, int, tuple[tuple[int, int], ...]]] = []
        self.env: dict[str, Entry] = dict(graph.initializers)
        for v in graph.inputs:
            if v.name in known:
                self.env[v.name] = np.asarray(known[v.name])
            elif v.name in shapes:
                self.slots.append(Slot("feed", v.dtype or "float32", math.prod(shapes[v.name]), v.name))
                self.env[v.name] = Runtime(len(self.slots) - 1, tuple(shapes[v.name]), v.dtype or "float32",
                                           frozenset([v.name]))

    def slot_of(self, e: Runtime | np.ndarray) -> int:
        if isinstance(e, Runtime):
            return e.slot
        if id(e) not in self._const_slot:
            a = contiguous(e)
            self.slots.append(Slot("const", a.dtype.name, a.size, array=a))
            self._const_slot[id(e)] = len(self.slots) - 1
        return self._const_slot[id(e)]

    def build(self, node: Node, entries: list[Entry], prefix: str = "") -> tuple[NodeCtx, list]:
        """Run ``node``'s builder: its context and one output per node output."""
        ctx = NodeCtx(node, entries, self.graph.opset, prefix)
        ctx.target = self.target
        ctx.options = self.options
        ctx.precision = self.precision
        builder = builder_for(node.op_type, self.graph.opset)
        try:
            outs = list(builder(ctx))  # type: ignore[misc]
        except (CuvilError, NotFusible):
            raise
        except (IndexError, KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"{node}: malformed inputs or attributes ({type(exc).__name__}: {exc})") from None
        return ctx, outs + [None] * (len(node.outputs) - len(outs))

    def node(self, node: Node) -> None:
        """Compile one node as its own kernel (or fold it, or alias its input)."""
        entries = [self.env[x] if x else None for x in node.inputs]
        ctx, outs = self.build(node, entries)
        computed = []  # (output index, kernel tensor, shape the graph sees)
        for k, o in enumerate(outs):
            t, shape = _tensor_and_shape(o)
            if t is None:
                continue
            if math.prod(shape) == 0:  # type: ignore[arg-type]
                outs[k] = np.zeros(shape, t.dtype)
            else:
                computed.append((k, t, shape))
        if computed:
            key = kernel_cache.node_key(ctx, self.target.canonical)
            results = self.kernel(key, [ctx], [(t, s) for _, t, s in computed], f"{node.op_type} {node.name!r}")
            for (k, _, _), r in zip(computed, results):
                outs[k] = r
        for name, o in zip(node.outputs, outs):
            if isinstance(o, Alias):
                src = entries[o.index]
                o = src.reshape(o.shape) if isinstance(src, np.ndarray) else dataclasses.replace(src, shape=o.shape)
            if name:
                self.env[name] = o

    def group(self, nodes: list[Node]) -> bool:
        """Compile a fusion group as one kernel: each member's builder reads the te tensors of the
        members before it.  False (nothing compiled) when a member cannot be fused."""
        local: dict[str, Fused] = {}
        ctxs = []
        try:
            for m, node in enumerate(nodes):
                entries = [local[x] if x in local else self.env[x] if x else None for x in node.inputs]
                ctx, outs = self.build(node, entries, prefix=f"n{m}_")
                t, shape = _tensor_and_shape(outs[0])
                if t is None or any(o is not None for o in outs[1:]) or math.prod(shape) == 0:  # type: ignore[arg-type]
                    return False
                local[node.outputs[0]] = Fused(t, shape, t.dtype, m)  # type: ignore[arg-type]
                ctxs.append(ctx)
        except NotFusible:
            return False
        last = local[nodes[-1].outputs[0]]
        last = dataclasses.replace(last, tensor=inline_elementwise(last.tensor, self.options.heuristics))  # one stage
        key = ("fused",) + tuple(kernel_cache.node_key(ctx, self.target.canonical) for ctx in ctxs)
        label = f"{'+'.join(n.op_type for n in nodes)} {nodes[0].name!r}"
        try:
            [self.env[nodes[-1].outputs[0]]] = self.kernel(key, ctxs, [(last.tensor, last.shape)], label)
        except CuvilError as exc:  # (raised before the kernel is added: nothing to undo)
            why = f"the fused kernel does not compile ({first_line(exc)}); its nodes are compiled one by one"
            log.warning("%s: %s", label, why)
            self.fallbacks.append(f"{label}: {why}")
            return False
        return True

    def kernel(self, key: tuple, ctxs: list[NodeCtx], outs: list[tuple[Any, tuple[int, ...]]], label: str
               ) -> list[Runtime | np.ndarray]:
        """The kernel computing ``outs`` (te tensor, graph shape) from the placeholders of ``ctxs``: called
        at run time, or run now when every input is known (its outputs become constants)."""
        placeholders = [(ctx, i, p) for ctx in ctxs for i, p in ctx.placeholders]
        args = [p for _, _, p in placeholders] + [t for t, _ in outs]
        key = key + (self.options_tag,)  # target, precision, bounds checks, Winograd, thresholds
        cached = True
        if self.tuning_db is not None:
            db = kernel_cache.db_key(self.tuning_db)
            cached = db is not None
            key = key + (db,)
        ins = [ctx.entries[i] for ctx, i, _ in placeholders]
        folded = all(isinstance(e, np.ndarray) for e in ins)
        kernel = self.lookup(key, label, (args, [p for _, _, p in placeholders], self.options), cached, folded)
        if folded:  # its values are needed now
            func, _ = self.wait(kernel)
            try:
                results = _fold(func, [np.reshape(e, t_shape(p)) for e, (_, _, p) in zip(ins, placeholders)],
                                [(t_shape(t), t.dtype) for t, _ in outs], self.target)
            except BoundsError as exc:  # an index out of range among constants: refused while compiling
                raise BoundsError(f"{label}: {exc}") from None
            return [r.reshape(shape) for r, (_, shape) in zip(results, outs)]
        if kernel.done is None:
            kernel.labels.append(label)  # (its fallback, if any, is recorded by resolve())
        else:
            func, why = kernel.done
            if cached:
                self.keys[id(func)] = key
            if why is not None:
                self.fallbacks.append(f"{label}: {why}")
        if self.on_kernel is not None:
            self.on_kernel(key, args, label)
        origin = frozenset().union(*(e.origin for e in ins if isinstance(e, Runtime)))
        arg_slots = [self.slot_of(e) for e in ins]  # type: ignore[arg-type]
        results: list[Runtime | np.ndarray] = []
        for t, shape in outs:
            self.slots.append(Slot("temp", t.dtype, math.prod(shape)))
            results.append(Runtime(len(self.slots) - 1, shape, t.dtype, origin))
            arg_slots.append(len(self.slots) - 1)
        if len(ctxs) == 1 and ctxs[0].node.op_type == "Concat" and len(results) == 1:
            self.concats += concat_parts(ctxs[0], results[0], len(self.calls))  # type: ignore[arg-type]
        self.calls.append((kernel, tuple(arg_slots)))
        self.labels.append(label)
        self.call_flops.append(contraction_flops(args))
        self.call_nodes.append(tuple((ctx.node.op_type, ctx.node.name, tuple(ctx.node.inputs)) for ctx in ctxs))
        return results

    def lookup(self, key: tuple, label: str, task: tuple[Any, ...], cached: bool, folded: bool) -> _Kernel:
        """The kernel of ``key`` (``task``: :func:`lower_kernel`'s arguments after the label): from the
        kernel caches (in memory, this model's kernels in workers, on disk), else queued for a worker
        (not one to fold: its values are needed now), else lowered here (and cached when ``cached``)."""
        if cached:
            done = _KERNELS.get(key)
            if done is None and key in self._pending:  # (the same kernel earlier in this model: lowered once)
                return self._pending[key]
            func = kernel_cache.load(key) if done is None else None
            if func is not None:
                done = _KERNELS[key] = (func, kernel_cache.load(("fallback",) + key))
            if done is not None:
                return _Kernel(key, label, task, done)
            if not folded and self.workers.jobs > 1:
                kernel = self._pending[key] = _Kernel(key, label, task)
                self._queue(kernel)
                return kernel
        kernel = _Kernel(key, label, task)
        kernel.wait(keep=cached)
        return kernel

    def _queue(self, p: _Kernel) -> None:
        """Submit ``p`` to the workers, with the kernel queued before it, once there are two (a graph of one
        kernel to lower forks no process: it is lowered here)."""
        self._queued.append(p)
        if (len(self._queued) < 2 and not self.workers.started) or self.workers.jobs == 1:
            return  # (wait() lowers what was not submitted, here)
        try:
            for q in self._queued:
                q.future = self.workers.submit(parallel.lower_task, q.label, *q.task)
        except parallel.WorkersLost:
            self.workers.jobs = 1  # the rest here
        self._queued = []

    @staticmethod
    def wait(kernel: _Kernel, resolving: bool = False) -> tuple[Any, str | None]:
        """``kernel`` lowered; :class:`_Serial` when the workers were lost or, ``resolving``, when it failed (a
        fused group that does not compile: this process would have compiled its nodes one by one)."""
        try:
            return kernel.wait()
        except parallel.WorkersLost as exc:
            raise _Serial(f"the worker processes were lost ({exc})") from None
        except CuvilError as exc:
            if not resolving:
                raise
            raise _Serial(f"{kernel.label}: {first_line(exc)}") from None

    def resolve(self) -> None:
        """Wait for the kernels lowered in workers and put every kernel in the calls (each kept in the kernel
        caches, its fallback recorded)."""
        for p in self._pending.values():
            func, why = self.wait(p, resolving=True)
            if why is not None:
                self.fallbacks.extend(f"{label}: {why}" for label in p.labels)
            self.keys[id(func)] = p.key
        self.calls = [(kernel.done[0], a) for kernel, a in self.calls]
        self._pending.clear()
        for k, (func, a) in enumerate(self.calls):  # its workspace: temporaries live during the call only
            for buf in func.workspace:
                self.slots.append(Slot("temp", buf.dtype, math.prod(int(d.value) for d in buf.shape)))
                a += (len(self.slots) - 1,)
            self.calls[k] = (func, a)

    def outputs(self) -> list[tuple[str, Runtime | np.ndarray]]:
        """The graph's outputs, each in a buffer of its own (copied when it is an input, a constant or
        another output)."""
        outputs: list[tuple[str, Runtime | np.ndarray]] = []
        used: set[int] = set()
        for v in self.graph.outputs:
            e = self.env[v.name]
            if isinstance(e, Runtime) and (self.slots[e.slot].kind != "temp" or e.slot in used):
                e = _copy(e, self.slots, self.calls, self.target, self.keys)
                self.labels.append(f"copy to output {v.name!r}")
                self.call_flops.append((0.0, ""))
                self.call_nodes.append(())
            if isinstance(e, Runtime):
                used.add(e.slot)
            outputs.append((v.name, e))
        return outputs


class _Serial(Exception):
    """A kernel lowered in a worker failed: the graph is compiled again in this process."""


class _Kernel:
    """A kernel as the cache lookup returns it (:meth:`_GraphCompiler.lookup`): lowered (``done``: the
    loop IR and why it fell back), or being lowered in a worker process until :meth:`wait`."""

    def __init__(self, key: tuple, label: str, task: tuple[Any, ...], done: tuple[Any, str | None] | None = None):
        self.key = key
        self.label = label
        self.task = task  # lower_kernel's arguments after the label
        self.future: Any = None  # submitted to a worker (else lowered here by wait())
        self.labels: list[str] = []  # the calls of it (their fallbacks name them)
        self.done = done

    def wait(self, keep: bool = True) -> tuple[Any, str | None]:
        """The lowered kernel and why it fell back (with ``keep``, kept in the caches the first time)."""
        if self.done is None:
            if self.future is not None:
                func, why = parallel.lowered(self.future)
            else:
                func, why = lower_kernel(self.label, *self.task)
            if keep:
                kernel_cache.store(self.key, func)
                if why is not None:
                    kernel_cache.store(("fallback",) + self.key, why)
                _KERNELS[self.key] = (func, why)
            self.done = (func, why)
        return self.done


def _copy(e: Runtime, slots: list[Slot], calls: list, target: Any, keys: dict[int, tuple]) -> Runtime:
    """A kernel that copies ``e`` into a new buffer (an output that is an input, a constant or another output)."""
    from cuvil import te

    key = (target.canonical, "copy", e.shape, e.dtype)
    hit = _KERNELS.get(key)
    func = hit[0] if hit is not None else kernel_cache.load(key)
    if func is None:
        import cuvil

        x = te.placeholder(e.shape, e.dtype, name="x")
        y = te.compute(e.shape, lambda *i: x[i], name="copy")
        func = cuvil.lower(cuvil.auto_schedule([x, y], target), [x, y], name="k")
        kernel_cache.store(key, func)
    _KERNELS[key] = (func, None)
    keys[id(func)] = key
    slots.append(Slot("temp", e.dtype, math.prod(e.shape)))
    calls.append((func, (e.slot, len(slots) - 1)))
    return dataclasses.replace(e, slot=len(slots) - 1)


# (id(kernel), target) -> (the kernel, kept alive so that its id stays its own; its JIT module).  Folding
# runs while a model compiles, and its layers repeat a few folded kernels: the registry's bert-base QDQ file
# folds with 8 distinct ones, GPT-2's with 7.  16 keep such repeats hits; older modules' machine code is freed
_FOLDERS: BoundedCache[tuple, tuple[Any, Any]] = BoundedCache("cuvil.graph.compile._FOLDERS", 16)


def _fold(func: Any, ins: list[np.ndarray], out_shapes: list[tuple[tuple[int, ...], str]], target: Any
          ) -> list[np.ndarray]:
    """Run a kernel on constant inputs now: its outputs become constants of the compiled graph.  A graph
    compiled for another machine (an Arm board) folds with its loops compiled for this one: the values
    are the same, and the other machine's code cannot run here."""
    from cuvil.runtime.module import Module
    from cuvil.target import Target

    if not target.is_host:
        target = Target("llvm")
    key = (id(func), target.canonical)
    hit = _FOLDERS.get(key)
    if hit is None:
        hit = _FOLDERS[key] = (func, Module(func, target))
    mod = hit[1]
    outs = [np.empty(shape, dtype) for shape, dtype in out_shapes]
    scratch = [np.empty(tuple(int(d.value) for d in b.shape), b.dtype) for b in func.workspace]
    mod(*[contiguous(a) for a in ins], *outs, *scratch)
    return outs
