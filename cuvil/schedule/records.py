"""Tuning-record lookup: what ``cuvil.build(s, args, target, tuning_db=db)`` and the graph compiler do with the
tuning database (:mod:`cuvil.schedule.database`, written by :mod:`cuvil.autotune`).  It lives below both, so
that neither imports the tuner; ``cuvil.autotune.replay`` re-exports it.

:func:`apply_best` looks the program up by its workload key (name-independent), takes the
fastest correct record for the canonical target (the current thread count's when there is
one; records of an older knob space when the current one has none), and replays that record's
trace on a fresh schedule of the computation: ``s``'s own steps are replaced, and the log says
so (logger ``cuvil.autotune``); a record that no longer replays is a fallback of the given schedule
(``s.fallbacks``, logger ``cuvil.schedule``).  Names in the trace are translated when this program spells
its tensors or axes differently from the tuned one.
With no record, ``s`` is returned unchanged and the build is what it would have been.

Which board's records (:func:`scope`): ``board=NAME`` (or a database scoped with
``Database.on(NAME)``) takes the records that boards of kind NAME measured.  Without it, this
host's own records first, then those of any board whose compile target is the one asked for (the target is
part of the key: a board with this host's CPU tunes for ``"llvm"`` itself; an AArch64 board's records
serve ``target="llvm -mtriple=aarch64-linux-gnu ..."``).  Records of databases written before boards
existed are host records.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from cuvil.errors import ArgumentError

log = logging.getLogger("cuvil.autotune")


def _rename(name: str, mapping: dict[str, str]) -> str:
    if not mapping:
        return name
    if name in mapping:
        return mapping[name]
    return ".".join(mapping.get(tok, tok) for tok in name.split("."))


def _rename_arg(a: Any, mapping: dict[str, str]) -> Any:
    if isinstance(a, str):
        return _rename(a, mapping)
    if isinstance(a, tuple):
        return tuple(_rename_arg(x, mapping) for x in a)
    return a


def translate(steps: Sequence[Any], recorded: dict[str, str], here: dict[str, str]) -> tuple[Any, ...]:
    """``steps`` recorded on a program with canonical names ``recorded`` (canonical -> name), renamed for a
    program with names ``here``.  Axis names are translated per stage (two stages may both have an ``i``)."""
    from cuvil.schedule.trace import Step

    tensors = {old: here[c] for c, old in recorded.items() if "." not in c and c in here}
    axes: dict[str, dict[str, str]] = {}
    for c, old in recorded.items():
        if "." in c and c in here:
            axes.setdefault(recorded.get(c.split(".")[0], ""), {})[old] = here[c]
    if all(k == v for k, v in tensors.items()) and all(k == v for m in axes.values() for k, v in m.items()):
        return tuple(steps)
    out = []
    for st in steps:
        base = st.stage.split(".")[0]
        stage_axes = axes.get(base, {})
        args: Any = st.args
        if st.op == "compute_at":
            parent_axes = axes.get(str(args[0]).split(".")[0], {})
            args = (_rename(args[0], tensors), _rename(args[1], parent_axes))
        elif st.op == "cache_read":
            args = (args[0], tuple(_rename(r, tensors) for r in args[1]), *args[2:])
        elif st.op == "bind":
            args = (_rename(args[0], stage_axes), *args[1:])
        elif st.op == "cache_write":
            pass  # (scope,)
        else:
            args = _rename_arg(args, stage_axes)
        out.append(Step(st.op, _rename(st.stage, tensors), args))
    return tuple(out)


def scope(db: Any, board: str | None) -> list[Any]:
    """The views of ``db`` to look in, in order: the board kind asked for (``board``, else the one ``db`` is
    scoped to), or, when neither names one, this host's records and then every board's."""
    if board is not None:
        return [db.on(board)]
    if db.board is not None:
        return [db]
    return [db.on(""), db.on(None)]


def _best(db: Any, wl: Any, threads: int) -> Any:
    """The best record of ``wl`` in ``db`` (one board scope): the current thread count's, else any count's;
    the current knob space's, else an older one's."""
    for n, key in enumerate((wl.key, *wl.older_keys)):  # the current knob space's records first
        rec = db.best(key, wl.target, threads)
        if rec is None:
            rec = db.best(key, wl.target)
            if rec is not None:
                log.info("tuning_db: no record of %s at %d threads; using the best at %d threads",
                         wl.describe(), threads, rec.threads)
        if rec is not None:
            if n:
                log.info("tuning_db: %s has records of an older knob space only (key %s); replaying its best",
                         wl.describe(), key)
            return rec
    return None


def apply_best(s: Any, args: Sequence[Any], target: Any, tuning_db: Any, board: str | None = None, *,
               threads: int) -> Any:
    """The schedule ``build`` should compile: the best record's trace replayed on a fresh schedule, or ``s``.
    ``board`` names the board kind whose records count (see the module doc); ``threads`` is the thread count
    the kernel will run with (``cuvil.get_num_threads()``: records of that count are preferred)."""
    from cuvil.schedule.database import Database
    from cuvil.schedule.fallback import REFUSED, fall_back
    from cuvil.schedule.schedule import Schedule
    from cuvil.schedule.trace import replay, trace_from_json
    from cuvil.schedule.workload import workload_of
    from cuvil.te.tensor import PlaceholderOp, Tensor

    if isinstance(tuning_db, Database):
        db, owned = tuning_db, False
    elif isinstance(tuning_db, (str, os.PathLike)):
        if not os.path.exists(tuning_db):
            log.info("tuning_db %s does not exist: building the given schedule", os.fspath(tuning_db))
            return s
        db, owned = Database(tuning_db), True
    elif hasattr(tuning_db, "best") and hasattr(tuning_db, "on"):  # a Database scoped to a board
        db, owned = tuning_db, False
    else:
        raise ArgumentError(f"tuning_db must be a path or a cuvil.autotune.Database, got {type(tuning_db).__name__}")
    if board is not None and not isinstance(board, str):
        raise ArgumentError(f"board must be a board kind's name (str), got {type(board).__name__}")
    try:
        wl = workload_of(args, target)
        rec = None
        for view in scope(db, board):
            rec = _best(view, wl, threads)
            if rec is not None:
                break
        if rec is not None and rec.board:
            log.info("tuning_db: %s: replaying a record measured on board %r", wl.describe(), rec.board)
        if rec is None:
            log.info("tuning_db: no record of %s: building the given schedule", wl.describe())
            return s
        steps = translate(trace_from_json(rec.trace), rec.names, wl.names)
        outs = [a for a in args if isinstance(a, Tensor) and not isinstance(a.op, PlaceholderOp)]
        fresh = Schedule(outs)
        try:
            replay(fresh, steps)
        except REFUSED as exc:  # a tuned schedule lost: a loss (WARNING, logger cuvil.schedule)
            if isinstance(s, Schedule):
                fall_back(s, wl.describe(), "tuning_db: replaying the best record", exc,
                          "building the given schedule instead")
            else:
                log.warning("tuning_db: the best record of %s does not replay (%s); building the given schedule",
                            wl.describe(), exc)
            return s
        log.info("tuning_db: replaced the %d steps of the given schedule with the %d steps of the best record "
                 "of %s (%.3f ms at %d threads)", len(getattr(s, "trace", [])), len(steps), wl.describe(),
                 (rec.time_s or 0) * 1e3, rec.threads)
        return fresh
    finally:
        if owned:
            db.close()
