"""Schedules: stages in producer order, and the primitives that reorder their loops.

``te.create_schedule(outputs)`` walks the operation graph from the outputs
and makes one :class:`Stage` per operation, producers first.  By default
every stage is computed at the root, in that order, with its loops in te
order.  ``s[T]`` (a tensor or its op) gives the stage; its primitives
(``split``, ``tile``, ``reorder``, ``fuse``, ``vectorize``, ``parallel``,
``unroll``, ``bind``, ``compute_at``, ``compute_inline``, ``compute_root``, ``rfactor``)
and the schedule's (``cache_read``, ``cache_write``) are each checked by isl
before they are accepted (see :mod:`cuvil.schedule.legality`), and each one
appends a step to ``s.trace``.

A scan (``te.scan(init, update, state)``) is one stage, ``s[scan]``, whose
loops run both parts; ``s[init]`` and ``s[update]`` are *part stages*
(``scan.init``, ``scan.update``) whose loops are those of one part inside a
time step.  A scan is scheduled through one or the other, not both; the
first loop of a part is the time axis, which stays one loop, the outermost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from cuvil.errors import ScheduleError
from cuvil.ir.expr import IterVar
from cuvil.schedule.stage import Stage
from cuvil.schedule.trace import Step
from cuvil.te.tensor import Operation, PlaceholderOp, Tensor

# what a primitive may change on a stage (saved before it, restored if isl refuses it)
_STAGE_STATE = ("op", "aliases", "scope", "attach", "attach_stage", "attach_axis", "roots", "leaves", "relations",
                "kinds")


def _as_op(x: Any, what: str) -> Operation:
    if isinstance(x, Tensor):
        return x.op
    if isinstance(x, Operation):
        return x
    raise ScheduleError(f"{what}: expected a te.Tensor or its op, got {type(x).__name__} ({x!r})")


class Schedule:
    """The stages of the program that computes ``outputs``, and the trace of primitives applied."""

    def __init__(self, outputs: Tensor | Operation | Sequence[Tensor | Operation]):
        if not isinstance(outputs, (list, tuple)):
            outputs = [outputs]
        if not outputs:
            raise ScheduleError("create_schedule needs at least one output tensor")
        self.outputs: tuple[Operation, ...] = tuple(_as_op(o, "create_schedule") for o in outputs)
        for o in self.outputs:
            if isinstance(o, PlaceholderOp):
                raise ScheduleError(f"create_schedule: output {o.name} is a placeholder, not a computed tensor")
        self.stages: list[Stage] = [Stage(self, op) for op in _post_order(self.outputs)]
        taken = {st.label for st in self.stages}
        seen: set[str] = set()
        for st in self.stages:  # two ops named C (two ops.matmul): stages C and C_1, so steps name one stage
            if st.label in seen:
                k = 1
                while f"{st.label}_{k}" in taken:
                    k += 1
                st.label = f"{st.label}_{k}"
                taken.add(st.label)
            seen.add(st.label)
        for st in self.stages:  # a scan's init and update: the part stages scan.init, scan.update
            for part, op in zip(("init", "update"), getattr(st.op, "parts", ())):
                p = Stage(self, op, scan=st, part=part)
                p.label = self.fresh_name(f"{st.label}.{part}")
                st.parts += (p,)
        self.trace: list[Step] = []
        # strategies of the automatic scheduler that isl refused, and what was taken instead (in the order
        # they happened; kept when a group of steps is undone): see cuvil.schedule.fallback
        self.fallbacks: list[Any] = []
        self._deferred = False  # see deferred_checks()
        # False: deferred_checks() trusts its strategies (legal by construction) and proves nothing; a schedule
        # whose trace is exactly ``trusted_steps`` long was built that way (the automatic scheduler's), and
        # cuvil.lower does not prove it again either.  A step applied after it makes the build prove it all
        self.prove_deferred = True
        self.trusted_steps = -1

    # -- lookup -------------------------------------------------------------------------
    @property
    def all_stages(self) -> list[Stage]:
        """The stages, each scan's part stages after it."""
        return [x for st in self.stages for x in (st, *st.parts)]

    def stage_of(self, x: Tensor | Operation | str) -> Stage | None:
        if isinstance(x, str):
            for st in self.stages:
                if st.name == x:
                    return st
            return None
        op = _as_op(x, "schedule[...]")
        for st in self.stages:
            if any(op is a for a in st.aliases):
                return st
        return None

    def __getitem__(self, x: Tensor | Operation) -> Stage:
        st = self.stage_of(x)
        if st is None:  # the init or update a scan was made of
            op = _as_op(x, "schedule[...]")
            st = next((p for s in self.stages for p in s.parts if p.op is op), None)
        if st is None:
            raise ScheduleError(f"{op.name} is not part of this schedule (it does not feed its outputs)")
        return st

    def __contains__(self, x: Tensor | Operation) -> bool:
        return self.stage_of(x) is not None

    @property
    def compute_stages(self) -> list[Stage]:
        return [s for s in self.stages if not s.is_placeholder]

    def reads(self, reader: Stage, producer: Stage) -> bool:
        return not reader.is_placeholder and any(self.stage_of(t) is producer for t in reader.op.input_tensors)

    def fresh_name(self, base: str) -> str:
        """``base``, or ``base`` with a number, so that no two stages share a name."""
        names = {st.name for st in self.all_stages}
        n, i = base, 1
        while n in names:
            n = f"{base}{i}"
            i += 1
        return n

    def new_stage(self, op: Operation, before: Stage | None = None, after: Stage | None = None) -> Stage:
        """Insert a stage for ``op`` (from cache_read / cache_write / rfactor)."""
        st = Stage(self, op)
        pos = self.stages.index(before) if before is not None else self.stages.index(after) + 1  # type: ignore[arg-type]
        self.stages.insert(pos, st)
        return st

    def __repr__(self) -> str:
        return "Schedule(" + ", ".join(s.name for s in self.stages) + ")"

    # -- applying primitives ---------------------------------------------------------------
    def _snapshot(self) -> Any:
        def keep(v: Any) -> Any:
            return list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v

        return list(self.stages), [(st, {k: keep(getattr(st, k)) for k in _STAGE_STATE}) for st in self.all_stages]

    def _restore(self, snap: Any) -> None:
        stages, states = snap
        self.stages = stages
        for st, state in states:
            for k, v in state.items():
                setattr(st, k, v)

    def apply(self, step: Step, mutate: Callable[[], None], check: bool = True) -> None:
        """Mutate the schedule, prove the result legal with isl, and record ``step``; undo on failure.

        ``check=False`` is for primitives that keep the execution order and add no parallelism
        (split, fuse, unroll, and the stage-adding rewrites): the build checks the whole schedule again.
        """
        from cuvil.schedule.legality import check_schedule

        snap = self._snapshot()
        try:
            mutate()
            if check and not self._deferred:
                check_schedule(self, step)
        except BaseException:
            self._restore(snap)
            raise
        self.trace.append(step)

    @contextlib.contextmanager
    def deferred_checks(self, live_out: list[Stage]) -> Iterator[None]:
        """Apply several primitives, then prove the result legal once (for ``live_out``); on a refusal
        everything applied inside is undone.  For strategies that are legal by construction: with
        ``prove_deferred`` False (the automatic scheduler's default, ``auto_schedule(..., prove=False)``)
        the proof is skipped; ``CompileOptions(check_schedules=True)`` makes it again (a debug mode)."""
        from cuvil.schedule.legality import check_program

        snap, steps = self._snapshot(), len(self.trace)
        self._deferred = True
        try:
            yield
            self._deferred = False
            if self.prove_deferred:
                check_program(self, live_out)
        except BaseException:
            self._restore(snap)
            del self.trace[steps:]
            raise
        finally:
            self._deferred = False

    def apply_step(self, step: Step) -> None:
        """Replay one recorded step (axes and stages looked up by name)."""
        from cuvil.schedule.replay import apply_step

        apply_step(self, step)

    def dependences(self) -> str:
        """The flow, anti and output dependences of the program, in isl notation."""
        from cuvil.schedule.deps import compute_dependences
        from cuvil.schedule.model import build_model, isl_budget

        with isl_budget("dependences"):
            return str(compute_dependences(build_model(self)))

    # -- program transformations --------------------------------------------------------------
    def cache_write(self, tensor: Tensor, scope: str) -> Tensor:
        """Compute ``tensor`` into a new cache stage, then copy it out; see cuvil.schedule.cache."""
        from cuvil.schedule.cache import cache_write

        return cache_write(self, tensor, scope)

    def cache_read(self, tensor: Tensor, scope: str, readers: Sequence[Any],
                   layout: Callable[..., Any] | None = None) -> Tensor:
        """Copy ``tensor`` (optionally into a new ``layout``) for ``readers``; see cuvil.schedule.cache."""
        from cuvil.schedule.cache import cache_read

        return cache_read(self, tensor, scope, readers, layout)

    def rfactor(self, tensor: Tensor, axis: IterVar, factor_axis: int = 0) -> Tensor:
        """Factor a reduction over ``axis`` into its own stage; see cuvil.schedule.cache."""
        from cuvil.schedule.cache import rfactor

        return rfactor(self, tensor, axis, factor_axis)


def _post_order(outputs: Sequence[Operation]) -> list[Operation]:
    order: list[Operation] = []
    done: set[int] = set()
    for root in outputs:
        stack: list[tuple[Operation, bool]] = [(root, False)]
        while stack:
            op, expanded = stack.pop()
            if id(op) in done:
                continue
            if expanded:
                done.add(id(op))
                order.append(op)
                continue
            stack.append((op, True))
            for t in reversed(op.input_tensors):
                if id(t.op) not in done:
                    stack.append((t.op, False))
    return order
