"""The ONNX operator registry and what every te builder receives.

A builder is a function ``build(ctx: NodeCtx) -> list`` registered with ``@op("Relu")`` (or
``@op("Squeeze", since=13)`` when an opset changed the operator's inputs).  It returns, per node
output, a te tensor (computed by the node's kernel), a numpy array (a value known at compile
time: ``Shape`` of static shapes, a constant), an :class:`Alias` (the output is an input's buffer
seen with another shape: ``Reshape``, ``Squeeze``) or ``None`` (an optional output not produced).

``ctx.tensor(i)`` is input ``i`` as a te tensor (a placeholder of the kernel);
``ctx.value(i)`` is its value, which must be known when the kernel is compiled (a constant, or a
graph input the session specialises on): Reshape's shape, Slice's starts and the like.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cuvil import te
from cuvil.errors import DTypeError, ShapeError, UnsupportedOpError
from cuvil.graph.ir import Node
from cuvil.ir.expr import TensorRead
from cuvil.ir.functor import ExprMutator, substitute, walk
from cuvil.schedule.auto import pads_a_stencil
from cuvil.schedule.heuristics import Heuristics, heuristics_of
from cuvil.te.tensor import ComputeOp, Tensor

Builder = Callable[["NodeCtx"], list]
_REGISTRY: dict[str, list[tuple[int, Builder]]] = {}


def op(*names: str, since: int = 1) -> Callable[[Builder], Builder]:
    """Register a builder for ONNX ops ``names`` from opset ``since`` on."""

    def deco(f: Builder) -> Builder:
        for n in names:
            _REGISTRY.setdefault(n, []).append((since, f))
            _REGISTRY[n].sort(key=lambda t: t[0])
        return f

    return deco


def builder_for(op_type: str, opset: int) -> Builder | None:
    """The builder for ``op_type`` at ``opset`` (the newest one registered at or before it)."""
    found = None
    for since, f in _REGISTRY.get(op_type, []):
        if since <= opset:
            found = f
    return found


def supported_ops() -> list[str]:
    """Every op type with a builder (the families register theirs when :mod:`cuvil.graph.ops` is imported,
    which importing this module does first)."""
    return sorted(_REGISTRY)


@dataclass(frozen=True)
class Runtime:
    """A tensor computed at run time: the buffer ``slot`` seen with ``shape``; ``origin`` names the graph
    inputs it depends on (those a session must specialise on if a builder needs its value)."""

    slot: int
    shape: tuple[int, ...]
    dtype: str
    origin: frozenset[str]


@dataclass(frozen=True)
class Shaped:
    """A kernel output computed with a collapsed shape, seen by the graph with ``shape`` (same size)."""

    tensor: Tensor
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Alias:
    """A node output that is input ``index`` with another ``shape`` (same buffer, same elements)."""

    index: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Fused:
    """An input computed by an earlier node of the same fused kernel (``cuvil.graph.fuse``): its te
    ``tensor`` (of the kernel's shape, e.g. a 1x1 convolution's ``(m, pixels)``), seen by the graph
    with ``shape``; ``member`` is the producing node's position in its group."""

    tensor: Tensor
    shape: tuple[int, ...]
    dtype: str
    member: int

    @property
    def kernel_shape(self) -> tuple[int, ...]:
        return t_shape(self.tensor)


class NotFusible(Exception):
    """A builder of a fused group needs what fusion cannot give (the value of a fused input, an output
    that is not computed by a kernel): the group's nodes are compiled one by one instead."""


class NeedsValue(Exception):
    """A builder needs the value of a run-time tensor; the session specialises on ``inputs``."""

    def __init__(self, inputs: frozenset[str], what: str):
        super().__init__(what)
        self.inputs = inputs


Entry = Runtime | Fused | np.ndarray | None


INDEX_TAG = 64  # a checked index's tag: member of the fused kernel * INDEX_TAG + the input it comes from


class NodeCtx:
    """One node's inputs, attributes and opset, as its builder sees them."""

    def __init__(self, node: Node, entries: Sequence[Entry], opset: int, prefix: str = ""):
        self.node = node
        self.prefix = prefix  # of placeholder names: the nodes of one fused kernel each get their own
        self.entries = list(entries)
        self.opset = opset
        self.placeholders: list[tuple[int, Tensor]] = []
        self.value_reads: set[int] = set()
        self.target: Any = None  # the compile target (set by compile_graph): builders may pick layouts for it
        self.options: Any = None  # the compilation's resolved cuvil.options.CompileOptions (set by compile_graph)
        self.precision = "fp32"  # or "bf16": contractions with constant weights in bfloat16 (set by compile_graph)
        self.variant = ""  # the lowering a builder chose beyond shapes and attributes (a Conv's "winograd"): keys it
        self._tensors: dict[tuple[int, tuple[int, ...]], Tensor] = {}

    @property
    def heuristics(self) -> Heuristics:
        """The thresholds builders decide by: the compilation's (``options``), else the target's."""
        return heuristics_of(self.options if self.options is not None else self.target)

    # -- inputs -------------------------------------------------------------------
    @property
    def n_inputs(self) -> int:
        return len(self.entries)

    def has(self, i: int) -> bool:
        return i < len(self.entries) and self.entries[i] is not None

    def _entry(self, i: int) -> Runtime | Fused | np.ndarray:
        if not self.has(i):
            raise self.error(f"input {i} is required but missing")
        return self.entries[i]  # type: ignore[return-value]

    def shape(self, i: int) -> tuple[int, ...]:
        e = self._entry(i)
        return tuple(int(d) for d in e.shape)

    def dtype(self, i: int) -> str:
        e = self._entry(i)
        return e.dtype if isinstance(e, (Runtime, Fused)) else e.dtype.name

    def known(self, i: int) -> bool:
        return self.has(i) and isinstance(self.entries[i], np.ndarray)

    def value(self, i: int) -> np.ndarray:
        """The value of input ``i``, which decides shapes: it must be known when compiling."""
        e = self._entry(i)
        if isinstance(e, Fused):
            raise NotFusible(f"{self.node}: input {i} decides shapes")
        if isinstance(e, Runtime):
            raise NeedsValue(e.origin, f"{self.node}: input {i} ({self.node.inputs[i]!r}) decides shapes; its "
                                       "value must be a constant or come from graph inputs the session specialises on")
        self.value_reads.add(i)
        return e

    def ints(self, i: int) -> list[int]:
        return [int(x) for x in np.asarray(self.value(i)).reshape(-1)]

    def tensor(self, i: int, shape: Sequence[int] | None = None) -> Tensor:
        """Input ``i`` as a te tensor: a placeholder of the kernel (a known scalar becomes a constant).

        ``shape`` views the input with another shape of the same size (buffers are dense and row-major):
        kernels over fewer, longer dimensions give isl and the scheduler less to do."""
        shp = tuple(int(d) for d in shape) if shape is not None else self.shape(i)
        if (i, shp) in self._tensors:
            return self._tensors[(i, shp)]
        e = self._entry(i)
        if int(np.prod(shp)) != int(np.prod(self.shape(i))):
            raise self.error(f"internal error: input {i} of shape {list(self.shape(i))} viewed as {list(shp)}")
        if isinstance(e, Fused):
            t = view(e.tensor, shp, f"{self.prefix}view{i}")
        elif isinstance(e, np.ndarray) and e.size == 1 and e.dtype.name != "float16":
            self.value_reads.add(i)
            v = e.reshape(-1)[0].item()
            t = te.compute(shp, lambda *_: te.const(v, e.dtype.name), name=f"{self.prefix}c{i}")
        else:
            t = te.placeholder(shp, dtype=self.dtype(i), name=f"{self.prefix}in{i}")
            self.placeholders.append((i, t))
        self._tensors[(i, shp)] = t
        return t

    def index(self, value: Any, n: int, i: int) -> Any:
        """An index read from input ``i`` (any integer expression), checked when the kernel runs: it must
        lie in ``-n .. n-1`` (ONNX: a negative index counts from the end); the result is in ``0 .. n-1``.
        Out of range, the run stops with a ``BoundsError`` naming this node, input ``i`` and the index."""
        from cuvil.ir.expr import index_check

        member = int(self.prefix[1:-1]) if self.prefix else 0
        return index_check(value, n, wrap=True, tag=member * INDEX_TAG + i)

    def constant(self, array: np.ndarray, keyed: bool = True) -> Tensor:
        """A compile-time array as a tensor of the kernel: a table whose values key the kernel (index
        maps), or with ``keyed=False`` data the kernel only reads (weights in another layout)."""
        self.entries.append(np.require(array, requirements="C"))
        i = len(self.entries) - 1
        if keyed:
            self.value_reads.add(i)
        t = te.placeholder(array.shape, dtype=array.dtype.name, name=f"{self.prefix}in{i}")
        self.placeholders.append((i, t))
        self._tensors[(i, t_shape(t))] = t
        return t

    # -- attributes and errors ------------------------------------------------------
    def attr(self, name: str, default: Any = None) -> Any:
        return self.node.attrs.get(name, default)

    def error(self, msg: str) -> ShapeError:
        return ShapeError(f"{self.node}: {msg}")

    def unsupported(self, msg: str) -> UnsupportedOpError:
        return UnsupportedOpError(f"{self.node}: {msg}")


# -- helpers shared by the op families ------------------------------------------------


def norm_axis(ctx: NodeCtx, axis: int, rank: int, what: str = "axis") -> int:
    if not -rank <= axis < max(rank, 1):
        raise ctx.error(f"{what} {axis} is out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


def float32_inputs(ctx: NodeCtx, inputs: Sequence[int]) -> None:
    """A DTypeError unless each of ``inputs`` that is present is float32 (builders that take no other type)."""
    for i in inputs:
        if ctx.has(i) and ctx.dtype(i) != "float32":
            raise DTypeError(f"{ctx.node}: input {i} is {ctx.dtype(i)}; cuvil's {ctx.node.op_type} takes float32")


def broadcast_shapes(ctx: NodeCtx, *shapes: tuple[int, ...]) -> tuple[int, ...]:
    """numpy/ONNX multidirectional broadcasting."""
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for d in range(rank):
        dims = {s[d - rank + len(s)] for s in shapes if d - rank + len(s) >= 0}
        dims.discard(1)
        if len(dims) > 1:
            raise ctx.error(f"shapes {' and '.join(str(list(s)) for s in shapes)} do not broadcast")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def bcast_read(t: Tensor, out_shape: Sequence[int], idx: Sequence[Any]) -> Any:
    """``t`` read at output index ``idx`` under broadcasting (size-1 dimensions read index 0)."""
    off = len(out_shape) - t.ndim
    shape = [int(d.value) for d in t.shape]
    return t[tuple(0 if shape[d] == 1 and out_shape[off + d] != 1 else idx[off + d] for d in range(t.ndim))]


def coalesce(out: Sequence[int], shapes: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """Merge adjacent dimensions that every input either broadcasts or reads whole, and drop size-1 output
    dimensions: ``(2, 3, 4) + (4,)`` becomes ``(6, 4) + (1, 4)``; equal shapes become one dimension."""
    r = len(out)
    ins = [(1,) * (r - len(s)) + tuple(s) for s in shapes]
    groups: list[tuple[list[int], tuple[bool, ...]]] = []
    for d in range(r):
        if out[d] == 1:
            continue
        pattern = tuple(s[d] == 1 for s in ins)
        if groups and groups[-1][1] == pattern:
            groups[-1][0].append(d)
        else:
            groups.append(([d], pattern))
    new_out = tuple(int(np.prod([out[d] for d in g])) for g, _ in groups)
    new_ins = [tuple(1 if pat[k] else n for (_, pat), n in zip(groups, new_out)) for k in range(len(ins))]
    return new_out, new_ins


def elementwise(ctx: NodeCtx, inputs: Sequence[int], f: Callable[..., Any], name: str = "out") -> Shaped:
    """An element-wise kernel over broadcast inputs: ``out[i] = f(x0[i], x1[i], ...)`` (computed over
    coalesced dimensions; in a fused kernel, over the dimensions of the fused input it reads whole, so
    that it reads that input at its own indices: an epilogue the auto-scheduler recognises)."""
    shape = broadcast_shapes(ctx, *(ctx.shape(i) for i in inputs))
    layout = _fused_layout(ctx, inputs, shape)
    flat, in_shapes = layout if layout is not None else coalesce(shape, [ctx.shape(i) for i in inputs])
    ts = [ctx.tensor(i, s) for i, s in zip(inputs, in_shapes)]
    return Shaped(te.compute(flat, lambda *idx: f(*(bcast_read(t, flat, idx) for t in ts)), name=name), shape)


def _dim_groups(out: Sequence[int], kernel: Sequence[int]) -> list[list[int]] | None:
    """The dimensions of ``out`` that each dimension of ``kernel`` merges (``kernel`` is ``out`` with
    runs of adjacent dimensions merged, or one dimension split into several, e.g. a Winograd output
    ``[n, k, y / 2, 2, x / 2, 2]``; size-1 dimensions dropped or kept), or None."""
    big = [d for d, n in enumerate(out) if n != 1]
    groups: list[list[int]] = []
    k = 0
    left = 1  # what the next kernel dimensions must still cover of a split dimension of out
    for n in kernel:
        if left > 1 and n > 1:
            if left % n:
                return None
            left //= n
            groups.append([big[k - 1]])
            continue
        g: list[int] = []
        size = 1
        while size < n and k < len(big):
            g.append(big[k])
            size *= out[big[k]]
            k += 1
        if size != n:
            if len(g) != 1 or size % n:
                return None
            left = size // n  # the first piece of a split dimension
        groups.append(g)
    return groups if k == len(big) and left == 1 else None


def _fused_layout(ctx: NodeCtx, inputs: Sequence[int], shape: tuple[int, ...]
                  ) -> tuple[tuple[int, ...], list[tuple[int, ...]]] | None:
    """The kernel shape of a fused input read whole (not broadcast) and every input's shape in it
    (each kernel dimension read whole or broadcast), or None."""
    for i in inputs:
        e = ctx.entries[i]
        if not isinstance(e, Fused) or math.prod(e.shape) != math.prod(shape):
            continue
        groups = _dim_groups(shape, e.kernel_shape)
        if groups is None:
            continue
        in_shapes = []
        for j in inputs:
            s = ctx.shape(j)
            s = (1,) * (len(shape) - len(s)) + s
            dims = []
            for g, n in zip(groups, e.kernel_shape):
                if all(s[d] == 1 for d in g):
                    dims.append(1)
                elif all(s[d] == shape[d] for d in g):
                    dims.append(n)
                else:
                    break
            if len(dims) != len(groups):
                break
            in_shapes.append(tuple(dims))
        else:
            return e.kernel_shape, in_shapes
    return None


def view(t: Tensor, shape: Sequence[int], name: str) -> Tensor:
    """``t`` (dense, row-major) seen with another ``shape`` of the same size: ``t`` itself when the
    shapes agree, a stage that renumbers size-1 dimensions, or one that flattens and unravels."""
    src, shp = t_shape(t), tuple(int(d) for d in shape)
    if src == shp:
        return t
    if [n for n in src if n != 1] == [n for n in shp if n != 1]:
        def body(*i: Any) -> Any:
            big = iter(x for x, n in zip(i, shp) if n != 1)
            return t[tuple(0 if n == 1 else next(big) for n in src)]

        return te.compute(shp, body, name=name)

    def flat_body(*i: Any) -> Any:
        flat: Any = None
        for x, n in zip(i, shp):
            flat = x if flat is None else flat * n + x
        idx = []
        for n in reversed(src):
            idx.append(flat % n)
            flat = flat // n
        return t[tuple(reversed(idx))]

    return te.compute(shp, flat_body, name=name)


def _inlinable(op: Any, n_idx: int) -> bool:
    return (isinstance(op, ComputeOp) and not op.reduce_axis and len(op.axis) == n_idx
            and all(a is b for a, b in zip(op.store_indices, op.axis)))


def _padded_under_taps(body: Any, taps: int) -> set[int]:
    """The ids of the padded stages that one body among ``body`` and the element-wise bodies it reads
    reads as a stencil's ``taps`` (:func:`cuvil.schedule.auto.pads_a_stencil`): they stay stages."""
    keep: set[int] = set()
    seen: set[int] = set()
    todo = [body]
    while todo:
        b = todo.pop()
        read = {id(n.tensor.op): n.tensor.op for n in walk(b)
                if isinstance(n, TensorRead) and _inlinable(n.tensor.op, len(n.indices))}
        for k, op in read.items():
            if pads_a_stencil(op, b, taps):
                keep.add(k)
            if k not in seen:
                seen.add(k)
                todo.append(op.body)
    return keep


class _Inline(ExprMutator):
    """Reads of element-wise stages replaced by their bodies (reductions, packed copies and the padded
    input of a stencil's taps stay reads)."""

    def __init__(self, keep: set[int] | None = None):
        super().__init__()
        self.keep = keep or set()

    def visit_TensorRead(self, e: TensorRead) -> Any:
        idx = tuple(self.visit(x) for x in e.indices)
        op = e.tensor.op
        if _inlinable(op, len(idx)) and id(op) not in self.keep:
            return self.visit(substitute(op.body, dict(zip(op.axis, idx))))
        return e if all(a is b for a, b in zip(idx, e.indices)) else TensorRead(e.dtype, e.tensor, idx)


def inline_elementwise(t: Tensor, heuristics: Heuristics | None = None) -> Tensor:
    """``t`` with every element-wise stage it reads substituted into its body: a fused group's result
    reads its contraction directly (``relu(conv[i] + b[i] + r[i])``), one epilogue stage.  ``heuristics``:
    the compilation's thresholds (``NodeCtx.heuristics``; None: the host's), whose ``stencil_taps`` keeps
    a padded stage under a stencil's taps."""
    op = t.op
    if not isinstance(op, ComputeOp) or op.reduce_axis or any(a is not b for a, b in zip(op.store_indices, op.axis)):
        return t
    body = _Inline(_padded_under_taps(op.body, heuristics_of(heuristics).stencil_taps)).visit(op.body)
    if body is op.body:
        return t
    return te.compute(t_shape(t), lambda *i: substitute(body, dict(zip(op.axis, i))), name=op.name)


def t_shape(t: Tensor) -> tuple[int, ...]:
    return tuple(int(d.value) for d in t.shape)


def shape_of(t: Tensor) -> tuple[int, ...]:
    return tuple(int(d.value) for d in t.shape)


def const(v: Any, dtype: str) -> Any:
    return te.const(v, dtype)
