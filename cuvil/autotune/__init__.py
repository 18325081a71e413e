"""The autotuner: search the auto-scheduler's knobs, measure candidates in isolated processes,
keep every result in a database that ``cuvil.build(..., tuning_db=...)`` reads.

    res = cuvil.autotune.tune([A, B, C], trials=64, db="cuvil-tuning.db")
    f = cuvil.build(s, [A, B, C], tuning_db="cuvil-tuning.db")

Modules: ``api`` (tune, TuneResult), ``space`` (knobs, features), ``model`` (boosted trees),
``search`` (evolutionary, random), ``measure`` (builders and runners), ``worker`` (what their
processes run).  The structural key, the database (SQLite, JSON lines) and what build does with a
record live below the graph compiler, in ``cuvil.schedule.workload``, ``.database`` and ``.records``;
``workload``, ``database`` and ``replay`` here re-export them.  See docs/autotune.md.
"""

from __future__ import annotations

from cuvil.lazy import lazy_attributes

_LAZY = {
    "tune": ("cuvil.autotune.api", "tune"),
    "TuneResult": ("cuvil.autotune.api", "TuneResult"),
    "random_inputs": ("cuvil.autotune.api", "random_inputs"),
    "tune_model": ("cuvil.autotune.whole_models", "tune_model"),
    "Database": ("cuvil.autotune.database", "Database"),
    "Record": ("cuvil.autotune.database", "Record"),
    "workload_key": ("cuvil.autotune.workload", "workload_key"),
    "workload_of": ("cuvil.autotune.workload", "workload_of"),
    "apply_best": ("cuvil.autotune.replay", "apply_best"),
    "LocalBuilder": ("cuvil.autotune.measure", "LocalBuilder"),
    "LocalRunner": ("cuvil.autotune.measure", "LocalRunner"),
    "DaskRunner": ("cuvil.autotune.dask_runner", "DaskRunner"),  # imports distributed: only when asked for
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
