"""Proving a schedule legal with isl.

A schedule is legal when it computes the same values as the te order.  isl's
dataflow analysis decides it exactly, recomputation (halos of compute_at)
included:

1. Every execution of a statement (an *event*: an instance at one of its
   times) must read each element from the same writer instance as under the
   te order, and read uninitialised memory (an input) only where the te order
   does.
2. The last write of every element of the schedule's outputs must be the
   same instance as under the te order (a virtual ``END`` statement reads
   them all after everything else).
3. A parallel, vectorised or GPU-bound (``bind``) loop carries no dependence (flow, anti or
   output): no two events in different iterations of that loop, inside the
   same iteration of every enclosing loop, touch one element with a write.

A violation raises :class:`~cuvil.errors.ScheduleError` with the request, the
broken dependence in isl notation, and what would be legal.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import islpy as isl

from cuvil.errors import ScheduleError
from cuvil.ir.stmt import GPU_TAGS
from cuvil.schedule.model import PolyModel, build_model, isl_budget
from cuvil.schedule.storage import LocalStorage, plan_storage
from cuvil.schedule.timemap import TimeMaps, build_time_maps


def _union(maps: list[isl.UnionMap]) -> isl.UnionMap:
    out = maps[0]
    for m in maps[1:]:
        out = out.union(m)
    return out


def _end_reads(model: PolyModel, live_out: list[Any]) -> isl.UnionMap | None:
    """``{ END[] -> T[...] }`` for every element of every live-out tensor."""
    parts = []
    for st in live_out:
        for s in model.statements:
            if s.stage is st:
                parts.append(isl.UnionMap.from_domain_and_range(
                    isl.UnionSet(f"{model.param_str} -> {{ END[] }}"), s.writes.range()))
    return _union(parts) if parts else None


def _flow(sinks: isl.UnionMap, sources: isl.UnionMap, schedule: isl.UnionMap) -> isl.UnionFlow:
    info = isl.UnionAccessInfo.from_sink(sinks).set_must_source(sources).set_schedule_map(schedule)
    return info.compute_flow()


class Reference:
    """Dataflow of the program under the te order (for one version of the program)."""

    def __init__(self, model: PolyModel, live_out: list[Any]):
        sched = model.original_schedule
        reads = model.reads
        end = _end_reads(model, live_out)
        width = _width(sched)
        if end is not None:
            reads = reads.union(end)
            sched = sched.union(_end_time(model, width))
        flow = _flow(reads, model.writes, sched)
        self.full = flow.get_full_must_dependence().uncurry()  # { [src -> sink] -> element }
        self.no_source = flow.get_may_no_source()  # { sink -> element }


def _width(um: isl.UnionMap) -> int:
    maps: list[isl.Map] = []
    um.foreach_map(maps.append)
    return max((m.dim(isl.dim_type.out) for m in maps), default=1)


def _end_time(model: PolyModel, width: int) -> isl.UnionMap:
    big = 1 + len(model.schedule.stages)
    return isl.UnionMap(f"{model.param_str} -> {{ END[] -> [{', '.join([str(big)] + ['0'] * (width - 1))}] }}")


def check_schedule(sched: Any, step: Any = None, live_out: list[Any] | None = None) -> TimeMaps:
    """Prove the schedule legal (or raise ScheduleError); returns its time maps."""
    what = str(step) if step is not None else "this schedule"
    with isl_budget(f"checking {what}"):
        model = build_model(sched)
        tm = build_time_maps(model)
        outs = live_out if live_out is not None else [sched[o] for o in sched.outputs]
        ref = Reference(model, outs)
        ev = _events(model, tm)
        end = _end_reads(model, outs)
        ev_reads, ev_sched = ev.reads, ev.sched
        if end is not None:
            end_time = _end_time(model, tm.width)
            if ev.inst is None:
                ev_reads, ev_sched = ev_reads.union(end), ev_sched.union(end_time)
            else:
                end_time_map = isl.Map.from_union_map(end_time)
                end_dm = isl.UnionMap.from_map(end_time_map.domain_map())  # [END[] -> t] -> END[]
                ev_reads = ev_reads.union(end_dm.apply_range(end))
                ev_sched = ev_sched.union(isl.UnionMap.from_map(end_time_map.range_map()))
                ev = Events(ev.reads, ev.writes, ev.sched, ev.inst.union(end_dm), ev.tm)
        flow = _flow(ev_reads, ev.writes, ev_sched)
        full = flow.get_full_must_dependence().uncurry()
        if ev.inst is not None:
            full = full.apply_domain(ev.inst.product(ev.inst))
        wrong = full.subtract(ref.full)
        if not wrong.is_empty():
            raise ScheduleError(
                f"{what} would change the results: under it some values would be read from the wrong "
                f"write. Pairs [writer -> reader] -> element that the te order does not have:\n  "
                f"{_short(wrong)}\nThe te order's dependences are in s.dependences(). Keep each writer before "
                "its readers (compute producers before the loop that reads them), and keep the loops of one "
                "reduction in their order (changing it would reassociate the sum; rfactor makes that explicit)."
            )
        missing = flow.get_may_no_source()
        if ev.inst is not None:
            missing = missing.apply_domain(ev.inst)
        missing = missing.subtract(ref.no_source)
        if not missing.is_empty():
            raise ScheduleError(
                f"{what} would change the results: these reads would happen before the value is "
                f"computed (reader -> element):\n  {_short(missing)}\n"
                "Compute the producer before its readers (compute_at a loop that encloses the reads)."
            )
        inter = [st for st in sched.compute_stages if st.attach != "inline" and all(st is not o for o in outs)]
        _check_parallel(sched, model, tm, ev, what, plan_storage(model, tm, inter))
        return tm


@dataclass(frozen=True)
class Events:
    """What the checks order: the executions of statements at their times.

    A statement instance runs at every time its time map gives it (``compute_at`` recomputes halos:
    one instance, several times), so in general an *event* is a pair ``[S[i] -> t]`` (``inst`` maps
    events to instances).  When every time map is a function, an event is just its instance: the
    accesses and the schedule are the model's own (``inst`` is None), and isl's dataflow analysis works
    on half as many dimensions."""

    reads: isl.UnionMap
    writes: isl.UnionMap
    sched: isl.UnionMap
    inst: isl.UnionMap | None
    tm: TimeMaps

    def of(self, names: list[str]) -> isl.UnionSet:
        """The events of the statements ``names``."""
        if self.inst is None:
            return _union_set([self.tm.maps[n].domain() for n in names])
        return _union_set([self.tm.maps[n].wrap() for n in names])

    def instances(self, um: isl.UnionMap) -> isl.UnionMap:
        """A relation between events as one between statement instances."""
        return um if self.inst is None else um.apply_domain(self.inst).apply_range(self.inst)


def _union_set(sets: list[Any]) -> isl.UnionSet:
    out = isl.UnionSet.from_set(sets[0])
    for x in sets[1:]:
        out = out.union(isl.UnionSet.from_set(x))
    return out


def _events(model: PolyModel, tm: TimeMaps) -> Events:
    """Accesses, schedule and instance of each event (see :class:`Events`)."""
    if all(tm.maps[s.name].is_single_valued() for s in model.statements):
        return Events(model.reads, model.writes, tm.union(), None, tm)
    reads, writes, sched, inst = [], [], [], []
    for s in model.statements:
        m = tm.maps[s.name]
        dm = isl.UnionMap.from_map(m.domain_map())  # [S[i] -> t] -> S[i]
        inst.append(dm)
        reads.append(dm.apply_range(s.reads))
        writes.append(dm.apply_range(s.writes))
        sched.append(isl.UnionMap.from_map(m.range_map()))  # [S[i] -> t] -> t
    return Events(_union(reads), _union(writes), _union(sched), _union(inst), tm)


def _time_names(params: str) -> tuple[str, str]:
    """Two prefixes for time dimensions that no size in ``params`` starts with (a size named t0 must not
    be taken for time dimension t0)."""
    taken = set(re.findall(r"\w+", params))
    pt, pu = "t", "u"
    while any(n.startswith((pt, pu)) for n in taken):
        pt, pu = pt + "_", pu + "_"
    return pt, pu


def _carried(width: int, d: int, params: str) -> isl.Map:
    pt, pu = _time_names(params)
    t = [f"{pt}{k}" for k in range(width)]
    u = [f"{pu}{k}" for k in range(width)]
    same = [f"{a} = {b}" for a, b in zip(t[:d], u[:d])]
    cond = " and ".join(same + [f"{t[d]} != {u[d]}"])
    return isl.Map(f"{params} -> {{ [{', '.join(t)}] -> [{', '.join(u)}] : {cond} }}")


def _dependences(ev_reads: isl.UnionMap, ev_writes: isl.UnionMap, ev_sched: isl.UnionMap,
                 private: isl.UnionSet | None) -> dict[str, isl.UnionMap]:
    """Flow, anti and output dependences between events, leaving out the elements in ``private``."""
    if private is not None:
        ev_reads, ev_writes = ev_reads.subtract_range(private), ev_writes.subtract_range(private)
    flow = _flow(ev_reads, ev_writes, ev_sched)
    anti = isl.UnionAccessInfo.from_sink(ev_writes).set_may_source(ev_reads).set_schedule_map(ev_sched)
    output = isl.UnionAccessInfo.from_sink(ev_writes).set_must_source(ev_writes).set_schedule_map(ev_sched)
    return {
        "flow": flow.get_may_dependence(),
        "anti": anti.compute_flow().get_may_dependence(),
        "output": output.compute_flow().get_may_dependence(),
    }


def _private(model: PolyModel, tm: TimeMaps, storage: dict[int, LocalStorage], d: int) -> isl.UnionSet | None:
    """Elements of the stages stored per iteration of time dimension ``d`` or a loop inside it: each
    iteration of loop ``d`` has its own buffer for them, so they carry nothing between iterations.

    Only where isl generates the storage loop: a time dimension that earlier ones determine gets no
    loop of its own, and its stage keeps a whole buffer (shared by all iterations)."""
    parts = [s.writes.range() for ls in storage.values() if ls.dim >= d and _has_loop(model, tm, ls)
             for s in model.statements if s.stage is ls.stage]
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out = out.union(p)
    return out


def _has_loop(model: PolyModel, tm: TimeMaps, ls: LocalStorage) -> bool:
    """Time dimension ``ls.dim`` takes several values for some values of the dimensions before it, so
    isl generates a loop for it (where the storage is placed); a dimension with one value there (a
    constant, or an expression of the outer dimensions) may get no loop, and then no storage of its own."""
    n = ls.dim + 1
    prefix = None
    for s in model.statements:
        if s.stage is ls.stage:
            p = tm.maps[s.name].range()
            p = p.project_out(isl.dim_type.set, n, p.dim(isl.dim_type.set) - n)
            prefix = p if prefix is None else prefix.union(p)
    if prefix is None:
        return False
    fn = isl.Map.from_domain(prefix).move_dims(isl.dim_type.out, 0, isl.dim_type.in_, ls.dim, 1)
    return not fn.is_single_valued()


def _prefix_map(width: int, d: int, params: str) -> isl.UnionMap:
    """``{ [t_0 .. t_{W-1}] -> [t_0 .. t_d] }``: a time vector's prefix through dimension ``d``."""
    pt, _ = _time_names(params)
    t = [f"{pt}{k}" for k in range(width)]
    return isl.UnionMap(f"{params} -> {{ [{', '.join(t)}] -> [{', '.join(t[:d + 1])}] }}")


def _conflicts(ev_reads: isl.UnionMap, ev_writes: isl.UnionMap, ev_sched: isl.UnionMap, inside: isl.UnionSet,
               private: isl.UnionSet | None, width: int, d: int, params: str) -> bool:
    """Whether two events inside the loop at time dimension ``d``, in different iterations of it (and
    the same iteration of every loop around it), touch one element and at least one of them writes it.

    Memory-based, so it needs no last-writer (lexicographic maximum) computation: every carried flow,
    anti or output dependence is such a pair, and such a pair always implies a carried dependence (the
    accesses of that element between the two iterations, in time order, change iteration somewhere:
    that consecutive pair is one).  Times are cut to dimensions ``0 .. d`` before the pairs are formed."""
    if private is not None:
        ev_reads, ev_writes = ev_reads.subtract_range(private), ev_writes.subtract_range(private)
    ev_reads, ev_writes = ev_reads.intersect_domain(inside), ev_writes.intersect_domain(inside)
    when = ev_sched.intersect_domain(inside).apply_range(_prefix_map(width, d, params))  # event -> [t_0..t_d]
    w = ev_writes.reverse().apply_range(when)  # element -> prefix of a write
    a = w.union(ev_reads.reverse().apply_range(when))  # element -> prefix of any access
    pairs = w.reverse().apply_range(a)  # [write prefix] -> [access prefix] of one element
    return not pairs.intersect(isl.UnionMap.from_map(_carried(d + 1, d, params))).is_empty()


def _check_parallel(sched: Any, model: PolyModel, tm: TimeMaps, ev: Events, what: str,
                    storage: dict[int, LocalStorage] | None = None) -> None:
    loops = []
    for st in sched.all_stages:  # a scan's part stages too
        for leaf in st.leaves:
            kind = st.kinds.get(id(leaf))
            if kind in ("parallel", "vectorize") or kind in GPU_TAGS:  # GPU_TAGS: bind()
                loops.append((st, leaf, kind))
    if not loops:
        return
    cache: dict[int, dict[str, isl.UnionMap]] = {}
    for st, leaf, kind in loops:
        dims = [tm.leaf_dim(s.name, leaf) for s in model.statements if s.stage.loops_of(s.kind) is st]
        d = next((x for x in dims if x is not None), None)
        if d is None:
            continue
        private = _private(model, tm, storage or {}, d)
        # the events inside this loop: statements whose time dimension d is this loop
        inside = ev.of([s.name for s in model.statements if tm.dim_leaf[s.name][d] is leaf])
        if not _conflicts(ev.reads, ev.writes, ev.sched, inside, private, tm.width, d, model.param_str):
            continue
        # refused: name the dependence (dataflow analysis, only on this path)
        key = sum(1 for ls in (storage or {}).values() if ls.dim >= d)
        if key not in cache:
            cache[key] = _dependences(ev.reads, ev.writes, ev.sched, private)
        carried = _carried(tm.width, d, model.param_str)
        for name, dep in cache[key].items():
            dep = dep.intersect_domain(inside).intersect_range(inside)
            in_time = dep.apply_domain(ev.sched).apply_range(ev.sched)
            hit = in_time.intersect(isl.UnionMap.from_map(carried))
            if not hit.is_empty():
                pairs = dep.intersect(hit.apply_domain(ev.sched.reverse()).apply_range(ev.sched.reverse()))
                pairs = ev.instances(pairs)
                raise ScheduleError(
                    f"{what}: loop {leaf.name} of {st.name} cannot be {_verb(kind)}"
                    f": it carries a {name} dependence (an iteration touches an element that another iteration "
                    f"writes):\n  {_short(pairs)}\nParallelise or vectorise a loop that carries none "
                    "(an output axis); a reduction axis needs rfactor first."
                )
        raise ScheduleError(
            f"{what}: loop {leaf.name} of {st.name} cannot be {_verb(kind)}: two of its iterations touch one "
            "element and one of them writes it. Parallelise or vectorise a loop that carries none (an output "
            "axis); a reduction axis needs rfactor first."
        )


def _verb(kind: str) -> str:
    return "vectorized" if kind == "vectorize" else f"bound to {kind}" if kind in GPU_TAGS else kind


def _short(um: isl.UnionMap, limit: int = 600) -> str:
    text = str(um.coalesce())
    return text if len(text) <= limit else text[:limit] + " ..."


def check_program(sched: Any, live_out: list[Any]) -> TimeMaps:
    """The check for a build: ``live_out`` are the stages whose tensors are build outputs.

    The result is remembered on the schedule for its current trace (every change appends a step), so
    building a schedule that was just checked for the same outputs costs nothing more.
    """
    key = (len(sched.trace), tuple(sorted(id(st) for st in live_out)))
    cached = getattr(sched, "_checked", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    tm = check_schedule(sched, None, live_out)
    sched._checked = (key, tm)
    return tm


__all__ = ["check_schedule", "check_program"]
