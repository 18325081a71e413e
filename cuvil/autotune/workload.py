"""The workload key, where the tuner has always imported it from: it lives in :mod:`cuvil.schedule.workload`
(the tuning-record lookup below the graph compiler needs it, and must not import the tuner)."""

from cuvil.schedule.workload import SCHEMA_VERSION, Workload, rename_map, workload_key, workload_of

__all__ = ["SCHEMA_VERSION", "Workload", "rename_map", "workload_key", "workload_of"]
