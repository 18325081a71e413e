"""Exact dataflow dependences from isl.

Three kinds, each an isl union map from source instance to sink instance
under the original (te-order) schedule:

* flow (read after write): the write that produced each value read;
* anti (write after read): a later write that overwrites a value read;
* output (write after write): two writes of the same element.

A new schedule is legal when it keeps every source before its sink.
"""

from __future__ import annotations

from dataclasses import dataclass

import islpy as isl

from cuvil.schedule.model import PolyModel


@dataclass(frozen=True, eq=False)
class Dependences:
    flow: isl.UnionMap
    anti: isl.UnionMap
    output: isl.UnionMap

    @property
    def all(self) -> isl.UnionMap:
        return self.flow.union(self.anti).union(self.output)

    def __str__(self) -> str:
        lines = []
        for kind in ("flow", "anti", "output"):
            m = getattr(self, kind)
            maps: list[isl.Map] = []
            m.foreach_map(maps.append)
            lines.append(f"{kind} ({len(maps)}):")
            lines.extend(f"  {x}" for x in sorted(str(x) for x in maps))
        return "\n".join(lines)


def compute_dependences(model: PolyModel, schedule: isl.UnionMap | None = None) -> Dependences:
    """Flow, anti and output dependences of ``model`` under ``schedule`` (default: te order)."""
    sched = schedule if schedule is not None else model.original_schedule
    reads, writes = model.reads, model.writes

    def flow_of(sink: isl.UnionMap, must: isl.UnionMap | None, may: isl.UnionMap | None) -> isl.UnionMap:
        info = isl.UnionAccessInfo.from_sink(sink)
        if must is not None:
            info = info.set_must_source(must)
        if may is not None:
            info = info.set_may_source(may)
        return info.set_schedule_map(sched).compute_flow().get_may_dependence().coalesce()

    flow = flow_of(reads, writes, None)
    anti = flow_of(writes, None, reads)
    output = flow_of(writes, writes, None)
    return Dependences(flow, anti, output)
