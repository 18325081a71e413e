"""The schedule as data: a trace of frozen steps.

Every primitive appends a :class:`Step` to ``s.trace``.  Axes are named by
their stage and loop name (``"C"``, ``"i.outer"``), so a trace serialises to
JSON, hashes the same in every process, and replays on a fresh schedule of
the same computation::

    steps = s.trace                       # (Step("split", "C", ("i", 32), ...), ...)
    text = trace_to_json(steps)
    s2 = te.create_schedule(C); replay(s2, trace_from_json(text))
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from cuvil.errors import ScheduleError


@dataclass(frozen=True)
class Step:
    """One primitive: ``op`` applied to ``stage`` with JSON-able ``args`` (axis names as strings)."""

    op: str
    stage: str
    args: tuple[Any, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "stage": self.stage, "args": _jsonable(self.args)}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Step:
        return Step(d["op"], d["stage"], _tuple(d.get("args", [])))

    def __str__(self) -> str:
        return f"{self.stage}.{self.op}({', '.join(map(repr, self.args))})"


def _jsonable(x: Any) -> Any:
    if isinstance(x, (tuple, list)):
        return [_jsonable(v) for v in x]
    return x


def _tuple(x: Any) -> Any:
    if isinstance(x, list):
        return tuple(_tuple(v) for v in x)
    return x


def trace_to_json(steps: tuple[Step, ...] | list[Step]) -> str:
    return json.dumps([s.to_json() for s in steps], sort_keys=True, separators=(",", ":"))


def trace_from_json(text: str) -> tuple[Step, ...]:
    try:
        data = json.loads(text)
        return tuple(Step.from_json(d) for d in data)
    except (ValueError, KeyError, TypeError) as exc:
        raise ScheduleError(f"not a cuvil schedule trace: {exc}") from exc


def trace_hash(steps: tuple[Step, ...] | list[Step]) -> str:
    return hashlib.sha256(trace_to_json(steps).encode()).hexdigest()[:16]


def replay(sched: Any, steps: tuple[Step, ...] | list[Step]) -> Any:
    """Apply ``steps`` to the schedule ``sched`` (of the same computation); returns it."""
    for st in steps:
        sched.apply_step(st)
    return sched


def expr_to_json(e: Any, names: dict[int, str]) -> Any:
    """An index expression (ints, named variables, + - * // %) as nested lists."""
    from cuvil.ir.expr import Binary, Cast, Const, Unary, Var

    if isinstance(e, Const):
        return int(e.value)
    if isinstance(e, Var):
        if id(e) not in names:
            raise ScheduleError(f"cannot record the expression {e}: unknown variable {e.name}")
        return names[id(e)]
    if isinstance(e, Cast):
        return expr_to_json(e.value, names)
    if isinstance(e, Unary) and e.op == "neg":
        return ["neg", expr_to_json(e.a, names)]
    if isinstance(e, Binary) and e.op in ("add", "sub", "mul", "floordiv", "floormod", "min", "max"):
        return [e.op, expr_to_json(e.a, names), expr_to_json(e.b, names)]
    raise ScheduleError(f"cannot record the expression {e} in a trace")


def expr_from_json(data: Any, env: dict[str, Any]) -> Any:
    from cuvil.ir import expr as E

    if isinstance(data, int):
        return E.const(data, "int64")
    if isinstance(data, str):
        return env[data]
    op, *args = data
    vals = [expr_from_json(a, env) for a in args]
    if op == "neg":
        return -vals[0]
    return E.binary(op, vals[0], vals[1])
