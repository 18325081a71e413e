"""Fallbacks: a strategy of the automatic scheduler that isl refused, and what was taken instead.

No fallback is silent.  Each one is a line on the ``cuvil.schedule`` logger and an entry of the
schedule's ``fallbacks`` list::

    s = cuvil.auto_schedule([A, B, C])
    for f in s.fallbacks:
        print(f)        # C: register-tiled contraction refused (...); the plain reduction strategy instead

A *loss* (logged at WARNING) is a planned strategy the kernel runs without: the graph compiler counts
it in ``CompiledGraph.fallbacks`` and ``cuvil bench`` shows the count.  An *alternative* (logged at
DEBUG, ``loss=False``) is the normal course of a search: the next of several strategies tried in order,
or a knob combination the autotuner proposed that isl refused; it is recorded, not counted.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from cuvil.errors import IslBudgetError, ScheduleError

log = logging.getLogger("cuvil.schedule")

_WHERE: contextvars.ContextVar[str | None] = contextvars.ContextVar("cuvil_schedule_where", default=None)

# what a strategy may raise when isl says no: an illegal step, or isl's operation bound spent
REFUSED = (ScheduleError, IslBudgetError)


@dataclass(frozen=True, slots=True)
class Fallback:
    """``stage``'s ``strategy`` was refused for ``why`` (the error's first line); ``instead`` was taken."""

    stage: str
    strategy: str
    why: str
    instead: str
    loss: bool = True

    def __str__(self) -> str:
        return f"{self.stage}: {self.strategy} refused ({self.why}); {self.instead}"


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of ``exc``'s message (its type's name when it has none), at most ``limit`` characters."""
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:limit]


def fall_back(s: Any, stage: Any, strategy: str, exc: BaseException, instead: str, loss: bool = True) -> Fallback:
    """Record on schedule ``s`` that ``strategy`` of ``stage`` (a Stage or a name) was refused with ``exc``
    and ``instead`` taken; log it at WARNING for a loss, at DEBUG for an alternative of a search."""
    name = stage if isinstance(stage, str) else stage.name
    f = Fallback(name, strategy, first_line(exc), instead, loss)
    s.fallbacks.append(f)
    where = _WHERE.get()
    log.log(logging.WARNING if loss else logging.DEBUG, "%s%s", f"{where}: " if where else "", f)
    return f


@contextlib.contextmanager
def scheduling(where: str) -> Iterator[None]:
    """Inside, fallback log lines start with ``where`` (the graph compiler names the node a kernel computes)."""
    token = _WHERE.set(where)
    try:
        yield
    finally:
        _WHERE.reset(token)
