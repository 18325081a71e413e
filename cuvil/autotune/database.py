"""The tuning database, where the tuner has always imported it from: it lives in :mod:`cuvil.schedule.database`
(the tuning-record lookup below the graph compiler reads it, and must not import the tuner)."""

from cuvil.schedule.database import FINAL_MARGIN, STATUSES, Database, DatabaseError, Record, read_jsonl

__all__ = ["FINAL_MARGIN", "STATUSES", "Database", "DatabaseError", "Record", "read_jsonl"]
