"""What ``cuvil.build(s, args, target, tuning_db=db)`` does with the database: :func:`apply_best` and
:func:`translate` of :mod:`cuvil.schedule.records` (the lookup lives below the graph compiler, which must not
import the tuner), with the thread count of this process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cuvil.runtime.threads import get_num_threads
from cuvil.schedule import records
from cuvil.schedule.records import scope, translate

__all__ = ["apply_best", "scope", "translate"]


def apply_best(s: Any, args: Sequence[Any], target: Any, tuning_db: Any, board: str | None = None) -> Any:
    """The schedule ``build`` should compile: the best record's trace replayed on a fresh schedule, or ``s``
    (:func:`cuvil.schedule.records.apply_best` for the current thread count)."""
    return records.apply_best(s, args, target, tuning_db, board, threads=get_num_threads())
