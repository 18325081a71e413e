"""Tensors and the operations that produce them.

A :class:`Tensor` is the output of an operation: a :class:`PlaceholderOp`
(an input) or a :class:`ComputeOp` (``te.compute``).  Indexing a tensor with
``A[i, k]`` gives a :class:`~cuvil.ir.expr.TensorRead` expression.
"""

from __future__ import annotations

from typing import Any

from cuvil import dtype as dt
from cuvil.errors import DTypeError, ShapeError
from cuvil.ir.expr import Expr, IterVar, Reduce, TensorRead, as_expr
from cuvil.ir.functor import walk


class Tensor:
    """An n-dimensional array value in a te program (immutable)."""

    __slots__ = ("op", "shape", "dtype", "name")

    def __init__(self, op: Operation, shape: tuple[Expr, ...], dtype: str, name: str):
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "name", name)

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("cuvil tensors are immutable")

    def __setstate__(self, state: Any) -> None:  # pickle (worker processes): restore without __setattr__
        slots = state[1] if isinstance(state, tuple) else state
        for key, value in (slots or {}).items():
            object.__setattr__(self, key, value)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, indices: Any) -> TensorRead:
        if not isinstance(indices, tuple):
            indices = (indices,)
        if len(indices) != len(self.shape):
            raise ShapeError(
                f"tensor {self.name} has {len(self.shape)} dimension(s) "
                f"(shape {_shape_str(self.shape)}) but was indexed with {len(indices)}"
            )
        idx = []
        for d, i in enumerate(indices):
            if isinstance(i, slice):
                raise ShapeError(f"tensor {self.name}, dimension {d}: slices are not indices; write a compute")
            if isinstance(i, (float, bool)):
                raise DTypeError(f"tensor {self.name}, dimension {d}: index {i!r} is not an integer")
            e = as_expr(i, "int64")
            if not dt.is_int(e.dtype):
                raise DTypeError(
                    f"tensor {self.name}, dimension {d}: index {e} has dtype {e.dtype}, not an integer type"
                )
            idx.append(e)
        return TensorRead(self.dtype, self, tuple(idx))

    def __call__(self, *indices: Any) -> TensorRead:
        return self[indices]

    def __bool__(self) -> bool:
        raise DTypeError(f"the truth value of tensor {self.name} is not defined")

    def __repr__(self) -> str:
        return f"Tensor({self.name}, shape={_shape_str(self.shape)}, dtype={self.dtype})"


def _shape_str(shape: tuple[Expr, ...]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


class Operation:
    """Base class of te operations; ``output(0)`` is the tensor it produces."""

    name: str
    _out: Tensor

    def output(self, index: int = 0) -> Tensor:
        if index != 0:
            raise ShapeError(f"operation {self.name} has one output")
        return self._out

    @property
    def input_tensors(self) -> list[Tensor]:
        return []

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class PlaceholderOp(Operation):
    """An input tensor of the program."""

    def __init__(self, name: str, shape: tuple[Expr, ...], dtype: str):
        self.name = name
        self.shape = shape
        self.dtype = dtype
        self._out = Tensor(self, shape, dtype, name)


class ComputeOp(Operation):
    """``out[axis] = body``; when ``body`` is a Reduce, ``reduce_axis`` are its axes.

    A packing stage (``cache_read(..., layout=f)``) stores element ``axis`` at
    ``store_indices`` of an output of a different ``shape``.
    """

    def __init__(self, name: str, axis: tuple[IterVar, ...], body: Expr, tag: str = "", attrs: dict | None = None,
                 shape: tuple[Expr, ...] | None = None, store_indices: tuple[Expr, ...] | None = None):
        self.name = name
        self.axis = axis
        self.body = body
        self.tag = tag
        self.attrs = dict(attrs or {})
        self.reduce_axis: tuple[IterVar, ...] = body.axis if isinstance(body, Reduce) else ()
        self.shape = shape if shape is not None else tuple(a.extent for a in axis)
        self.store_indices: tuple[Expr, ...] = store_indices if store_indices is not None else tuple(axis)
        self.dtype = body.dtype
        self._out = Tensor(self, self.shape, body.dtype, name)

    @property
    def input_tensors(self) -> list[Tensor]:
        seen: dict[int, Tensor] = {}
        for n in walk(self.body):
            if isinstance(n, TensorRead) and id(n.tensor) not in seen:
                seen[id(n.tensor)] = n.tensor
        return list(seen.values())


class ScanOp(Operation):
    """A recurrence over the first axis (``te.scan``): ``out[t] = init[t]`` for ``t < len(init)``,
    else ``update[t]``, where ``update`` reads the state (earlier steps of ``out``).

    ``parts`` are the ``init`` and ``update`` compute ops the user passed to ``te.scan``: the schedule
    gives each a stage of its own (``s[init]``, ``s[update]``) whose loops run inside the time steps.
    """

    def __init__(self, name: str, axis: tuple[IterVar, ...], init_extent: Expr, init_body: Expr,
                 update_body: Expr, tag: str = "", parts: tuple[ComputeOp, ComputeOp] | tuple[()] = ()):
        self.name = name
        self.parts = parts
        self.axis = axis
        self.reduce_axis: tuple[IterVar, ...] = ()
        self.init_extent = init_extent
        self.init_body = init_body
        self.update_body = update_body
        self.tag = tag
        self.shape = tuple(a.extent for a in axis)
        self.store_indices = tuple(axis)
        self.dtype = update_body.dtype
        self._out = Tensor(self, self.shape, self.dtype, name)

    @property
    def body(self) -> Expr:
        return self.update_body

    @property
    def input_tensors(self) -> list[Tensor]:
        seen: dict[int, Tensor] = {}
        for root in (self.init_body, self.update_body):
            for n in walk(root):
                if isinstance(n, TensorRead) and n.tensor is not self._out and id(n.tensor) not in seen:
                    seen[id(n.tensor)] = n.tensor
        return list(seen.values())


class ScatterOp(Operation):
    """Stores at data-dependent positions (``te.scatter``): a copy, then one store per update::

        for (p0, p1, ...)                               # axis: the output's (statement "copy")
          out[p0, p1, ...] = init                       # init reads data[p0, p1, ...]
        for (u0, u1, ...)                               # update_axis, in row-major order ("update")
          out[indices] = value                          # value may read out[indices]: old (op) new

    An update runs once per update, so the work is linear in the updates whatever the output's size.
    The stage's loops are both nests (``axis + update_axis``); a loop runs one statement or the other.
    ``indices`` are data-dependent (read from memory): the polyhedral model lets each update write, and
    read, any element of the dimensions they index, so the updates stay in order unless isl proves two
    of them touch different elements (different rows ``r`` of ``out[idx[u], r]``).
    """

    def __init__(self, name: str, axis: tuple[IterVar, ...], init: Expr, update_axis: tuple[IterVar, ...],
                 indices: tuple[Expr, ...], tag: str = ""):
        self.name = name
        self.axis = axis
        self.reduce_axis: tuple[IterVar, ...] = ()
        self.update_axis = update_axis
        self.init = init
        self.indices = indices
        self.value: Expr = init  # set by te.scatter once the output exists (it may read it)
        self.tag = tag
        self.shape = tuple(a.extent for a in axis)
        self.store_indices = tuple(axis)  # the copy's
        self.dtype = init.dtype
        self._out = Tensor(self, self.shape, self.dtype, name)

    @property
    def body(self) -> Expr:
        return self.value

    @property
    def input_tensors(self) -> list[Tensor]:
        seen: dict[int, Tensor] = {}
        for root in (self.init, self.value, *self.indices):
            for n in walk(root):
                if isinstance(n, TensorRead) and n.tensor is not self._out and id(n.tensor) not in seen:
                    seen[id(n.tensor)] = n.tensor
        return list(seen.values())
