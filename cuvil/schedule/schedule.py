"""Schedules: the stages of a te program in producer order.

``te.create_schedule(outputs)`` walks the operation graph from the outputs
and makes one :class:`Stage` per operation, producers first.  The default
schedule computes every stage at the root, in that order, with its loops in
te order.  ``s[T]`` (a tensor or its op) gives the stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cuvil.errors import ScheduleError
from cuvil.te.tensor import ComputeOp, Operation, PlaceholderOp, Tensor


class Stage:
    """One operation of a schedule."""

    def __init__(self, op: Operation, index: int):
        self.op = op
        self.origin_op = op
        self.index = index

    @property
    def is_placeholder(self) -> bool:
        return isinstance(self.op, PlaceholderOp)

    def __repr__(self) -> str:
        return f"Stage({self.op.name})"


def _as_op(x: Any, what: str) -> Operation:
    if isinstance(x, Tensor):
        return x.op
    if isinstance(x, Operation):
        return x
    raise ScheduleError(f"{what}: expected a te.Tensor or its op, got {type(x).__name__} ({x!r})")


class Schedule:
    """The stages of the program that computes ``outputs``."""

    def __init__(self, outputs: Tensor | Operation | Sequence[Tensor | Operation]):
        if not isinstance(outputs, (list, tuple)):
            outputs = [outputs]
        if not outputs:
            raise ScheduleError("create_schedule needs at least one output tensor")
        self.outputs: tuple[Operation, ...] = tuple(_as_op(o, "create_schedule") for o in outputs)
        for o in self.outputs:
            if not isinstance(o, ComputeOp):
                raise ScheduleError(f"create_schedule: output {o.name} is a placeholder, not a computed tensor")
        self.stages: list[Stage] = []
        self._by_op: dict[int, Stage] = {}
        for op in _post_order(self.outputs):
            st = Stage(op, len(self.stages))
            self.stages.append(st)
            self._by_op[id(op)] = st

    def __getitem__(self, x: Tensor | Operation) -> Stage:
        op = _as_op(x, "schedule[...]")
        st = self._by_op.get(id(op))
        if st is None:
            raise ScheduleError(f"{op.name} is not part of this schedule (it does not feed its outputs)")
        return st

    def __contains__(self, x: Tensor | Operation) -> bool:
        return id(_as_op(x, "in schedule")) in self._by_op

    @property
    def compute_stages(self) -> list[Stage]:
        return [s for s in self.stages if not s.is_placeholder]

    def __repr__(self) -> str:
        return "Schedule(" + ", ".join(s.op.name for s in self.stages) + ")"


def _post_order(outputs: Sequence[Operation]) -> list[Operation]:
    order: list[Operation] = []
    done: set[int] = set()
    active: set[int] = set()
    for root in outputs:
        stack: list[tuple[Operation, bool]] = [(root, False)]
        while stack:
            op, expanded = stack.pop()
            if id(op) in done:
                continue
            if expanded:
                active.discard(id(op))
                done.add(id(op))
                order.append(op)
                continue
            if id(op) in active:
                raise ScheduleError(f"the operation graph has a cycle through {op.name}")
            active.add(id(op))
            stack.append((op, True))
            for t in reversed(op.input_tensors):
                if id(t.op) not in done:
                    stack.append((t.op, False))
    return order
