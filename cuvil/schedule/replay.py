"""Replaying a recorded step on a schedule of the same computation (stages and axes by name)."""

from __future__ import annotations

from typing import Any

from cuvil.errors import ScheduleError
from cuvil.schedule.trace import Step, expr_from_json


def _stage(sched: Any, name: str, step: Step) -> Any:
    matches = [st for st in sched.all_stages if st.name == name]
    if len(matches) != 1:
        raise ScheduleError(f"replaying {step}: {'no' if not matches else 'more than one'} stage named {name!r}")
    return matches[0]


def apply_step(sched: Any, step: Step) -> None:
    st = _stage(sched, step.stage, step)
    a = step.args
    op = step.op
    if op == "split":
        st.split(st.axis_by_name(a[0]), factor=a[1])
    elif op == "reorder":
        st.reorder(*[st.axis_by_name(x) for x in a])
    elif op == "fuse":
        st.fuse(st.axis_by_name(a[0]), st.axis_by_name(a[1]))
    elif op in ("vectorize", "parallel", "unroll"):
        getattr(st, op)(st.axis_by_name(a[0]))
    elif op == "bind":
        st.bind(st.axis_by_name(a[0]), a[1])
    elif op == "compute_at":
        parent = _stage(sched, a[0], step)
        st.compute_at(parent, parent.axis_by_name(a[1]))
    elif op in ("compute_inline", "compute_root"):
        getattr(st, op)()
    elif op == "cache_write":
        sched.cache_write(st.op.output(0), a[0])
    elif op == "cache_read":
        readers = [_stage(sched, r, step).op.output(0) for r in a[1]]
        layout = None
        if len(a) > 2:
            exprs = a[2]

            def layout(*idx: Any) -> tuple[Any, ...]:
                env = {f"ax{d}": x for d, x in enumerate(idx)}
                return tuple(expr_from_json(e, env) for e in exprs)

        sched.cache_read(st.op.output(0), a[0], readers, layout=layout)
    elif op == "rfactor":
        sched.rfactor(st.op.output(0), st.axis_by_name(a[0]), a[1])
    else:
        raise ScheduleError(f"replaying {step}: unknown primitive {op!r}")
