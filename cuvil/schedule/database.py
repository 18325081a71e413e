"""The tuning database: every measured candidate, in SQLite (one file, stdlib ``sqlite3``).

One row per candidate, committed in its own transaction as soon as it is measured,
so a run killed with ``kill -9`` loses only the candidates in flight, and a rerun
counts what is there and goes on.  Rows are filed under the workload key
(:mod:`cuvil.schedule.workload`), the canonical target and the thread count::

    db = Database("cuvil-tuning.db")
    db.best(key, target, threads)           # the fastest correct record, or None
    db.count(key, target, threads)          # trials spent so far (failures count)
    db.export_jsonl("log.jsonl"); db.import_jsonl("log.jsonl")   # share logs between machines
    db.on("rpi5").best(key, target, threads)   # the records measured on boards of kind rpi5

Each record names the board kind that measured it (``board``; "" for this host, the local runner's, and
for every record of a database written before boards existed).  A database object reads and writes
one board kind's records when it is scoped with :meth:`Database.on` (the tuner scopes it to its runner's
board); unscoped, it reads every board's and writes host records.

A record's ``config`` is the knob setting (JSON), ``trace`` the schedule's steps
(:func:`cuvil.schedule.trace.trace_to_json`) and ``names`` the canonical -> actual
names of the program that was tuned (to replay the trace on a renamed copy).
"""

from __future__ import annotations

import copy
import json
import os
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from cuvil.errors import ArgumentError, CuvilError
from cuvil.schedule.workload import SCHEMA_VERSION

FINAL_MARGIN = 0.03  # a final round's winner must beat the untuned schedule by this much to replace it (timing
# the same kernels in the runner and in the user's process differs by a few percent on this machine)
STATUSES = ("ok", "build_error", "build_timeout", "build_crash", "run_error", "run_timeout", "run_crash", "wrong",
            "run_lost")  # run_lost: the board measuring it died, and so did the one it was rerouted to

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS records (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    workload TEXT NOT NULL,
    target TEXT NOT NULL,
    threads INTEGER NOT NULL,
    config_hash TEXT NOT NULL,
    config TEXT NOT NULL,
    status TEXT NOT NULL,
    time_s REAL,
    ref_time_s REAL,
    trace TEXT NOT NULL DEFAULT '[]',
    names TEXT NOT NULL DEFAULT '{}',
    features TEXT NOT NULL DEFAULT '{}',
    error TEXT NOT NULL DEFAULT '',
    flops REAL NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    final_time_s REAL,
    final_ref_s REAL,
    final_round REAL,
    board TEXT NOT NULL DEFAULT '',
    UNIQUE (workload, target, threads, board, config_hash)
);
CREATE INDEX IF NOT EXISTS records_by_key ON records (workload, target, threads, status, time_s);
"""


@dataclass
class Record:
    """One measured candidate."""

    workload: str
    target: str
    threads: int
    config_hash: str
    config: dict[str, Any]
    status: str
    time_s: float | None = None
    trace: str = "[]"
    names: dict[str, str] = field(default_factory=dict)
    features: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    flops: float = 0.0
    created: float = 0.0
    ref_time_s: float | None = None  # the untuned schedule's time, measured beside this candidate
    # the final round of a tuning run (finalists and the untuned schedule timed against each other):
    final_time_s: float | None = None  # median seconds in that round
    final_ref_s: float | None = None  # the untuned schedule's seconds implied by the median ratio in that round
    final_round: float | None = None  # when that round was (it identifies the round)
    board: str = ""  # the board kind that measured it ("": this host, the local runner)

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.time_s is not None

    @property
    def relative(self) -> float | None:
        """Seconds relative to the untuned schedule timed in the same batch (the machine's load cancels)."""
        if not self.ok:
            return None
        return self.time_s / self.ref_time_s if self.ref_time_s else None  # type: ignore[operator]

    @property
    def final_relative(self) -> float | None:
        """Seconds relative to the untuned schedule in the final round of a tuning run (None: not a finalist)."""
        if self.final_round is None or not self.final_time_s or not self.final_ref_s:
            return None
        return self.final_time_s / self.final_ref_s

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["schema"] = SCHEMA_VERSION
        return d


class DatabaseError(CuvilError):
    """The tuning database cannot be opened, read or written."""


class Database:
    """Tuning records in an SQLite file (``":memory:"`` for a throw-away one)."""

    board: str | None = None  # the board kind read and written (None: every kind read, host records written)

    def __init__(self, path: str | os.PathLike[str] = "cuvil-tuning.db"):
        if not isinstance(path, (str, os.PathLike)):
            raise ArgumentError(f"the tuning database is a file path, got {type(path).__name__}")
        self.path = os.fspath(path)
        try:
            self.conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            if self.path != ":memory:":
                self.conn.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode: a committed record survives kill -9 of the tuner (only a power loss may
            # take the last commits); FULL would fsync every record
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self.conn.executescript(_SCHEMA)
            have = {row[1] for row in self.conn.execute("PRAGMA table_info(records)")}
            for col in ("ref_time_s", "final_time_s", "final_ref_s", "final_round"):  # files of older cuvils
                if col not in have:
                    self.conn.execute(f"ALTER TABLE records ADD COLUMN {col} REAL")
            if "board" not in have:
                _add_board_column(self.conn)
            row = self.conn.execute("SELECT value FROM meta WHERE name='schema'").fetchone()
            if row is None:
                self.conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) != SCHEMA_VERSION:
                raise DatabaseError(f"{self.path} holds tuning records of schema {row[0]}, this cuvil writes "
                                    f"schema {SCHEMA_VERSION}: use another file (or export and re-tune)")
        except sqlite3.DatabaseError as exc:
            raise DatabaseError(f"cannot open the tuning database {self.path!r}: {exc}") from None

    def on(self, board: str | None) -> Database:
        """This database scoped to the records of board kind ``board`` ("" for this host's, None for every
        kind's when reading); it shares the connection (closing either closes both)."""
        if board is not None and not isinstance(board, str):
            raise ArgumentError(f"a board kind is a name (str), got {type(board).__name__}")
        view = copy.copy(self)
        view.board = board
        return view

    def close(self) -> None:
        """Close the connection (every record is committed already)."""
        self.conn.close()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- writing --------------------------------------------------------------------------
    def add(self, r: Record) -> bool:
        """Store ``r`` (one transaction); False if that configuration was already there."""
        if r.status not in STATUSES:
            raise ArgumentError(f"unknown record status {r.status!r}; one of {', '.join(STATUSES)}")
        try:
            with self._transaction():
                cur = self.conn.execute(
                    "INSERT OR IGNORE INTO records (workload, target, threads, config_hash, config, status, time_s,"
                    " trace, names, features, error, flops, created, ref_time_s, final_time_s, final_ref_s,"
                    " final_round, board) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (r.workload, r.target, int(r.threads), r.config_hash, json.dumps(r.config, sort_keys=True),
                     r.status, r.time_s, r.trace, json.dumps(r.names, sort_keys=True),
                     json.dumps(r.features, sort_keys=True), r.error[:4000], float(r.flops),
                     r.created or time.time(), r.ref_time_s, r.final_time_s, r.final_ref_s, r.final_round,
                     r.board or self.board or ""))
            return cur.rowcount == 1
        except sqlite3.DatabaseError as exc:
            raise DatabaseError(f"cannot write to the tuning database {self.path!r}: {exc}") from None

    def set_final(self, workload: str, target: str, threads: int, results: list[tuple[str, float, float]],
                  when: float | None = None) -> float:
        """Record a final round (one transaction): ``results`` are (config hash, median seconds, the untuned
        schedule's seconds by the median ratio) of records already stored.  Returns the round's stamp."""
        stamp = when or time.time()
        try:
            with self._transaction():
                for h, t, ref in results:
                    self.conn.execute("UPDATE records SET final_time_s=?, final_ref_s=?, final_round=? WHERE "
                                      "workload=? AND target=? AND threads=? AND board=? AND config_hash=?",
                                      (t, ref, stamp, workload, target, int(threads), self.board or "", h))
        except sqlite3.DatabaseError as exc:
            raise DatabaseError(f"cannot write to the tuning database {self.path!r}: {exc}") from None
        return stamp

    class _Tx:
        def __init__(self, conn: sqlite3.Connection):
            self.conn = conn

        def __enter__(self) -> None:
            self.conn.execute("BEGIN IMMEDIATE")

        def __exit__(self, et: Any, *rest: Any) -> None:
            self.conn.execute("COMMIT" if et is None else "ROLLBACK")

    def _transaction(self) -> Database._Tx:
        return Database._Tx(self.conn)

    # -- reading --------------------------------------------------------------------------
    _COLS = "workload, target, threads, config_hash, config, status, time_s, trace, names, features, error, " \
            "flops, created, ref_time_s, final_time_s, final_ref_s, final_round, board"

    def _record(self, row: tuple[Any, ...]) -> Record:
        w, t, th, h, cfg, st, ts, tr, nm, ft, err, fl, cr, ref, fts, frs, frd, bd = row
        return Record(w, t, th, h, json.loads(cfg), st, ts, tr, json.loads(nm), json.loads(ft), err, fl, cr, ref,
                      fts, frs, frd, bd)

    def records(self, workload: str | None = None, target: str | None = None,
                threads: int | None = None) -> list[Record]:
        """Records in the order they were measured, filtered by key, target and thread count."""
        where, params = self._where(workload, target, threads)
        rows = self.conn.execute(f"SELECT {self._COLS} FROM records{where} ORDER BY id", params).fetchall()
        return [self._record(r) for r in rows]

    def count(self, workload: str, target: str, threads: int) -> int:
        """Trials recorded for the workload, target and thread count (failed ones included)."""
        where, params = self._where(workload, target, threads)
        return int(self.conn.execute(f"SELECT COUNT(*) FROM records{where}", params).fetchone()[0])

    def best(self, workload: str, target: str, threads: int | None = None) -> Record | None:
        """The fastest correct record (any thread count when ``threads`` is None).

        When a tuning run ended with a final round (its best candidates and the untuned schedule timed
        against each other) and nothing was measured after it, the winner of that round (the untuned schedule
        unless the winner is at least :data:`FINAL_MARGIN` faster).  Otherwise
        (:meth:`final_stale`) records are compared by their
        time relative to the untuned schedule timed beside them, so a candidate that happened to run while
        the machine was quiet does not win on luck; records without that reference time compare by their
        own time, scaled by the median reference."""
        where, params = self._where(workload, target, threads)
        rows = self.conn.execute(f"SELECT {self._COLS} FROM records{where} AND status='ok' AND time_s IS NOT NULL",
                                 params).fetchall()
        recs = [self._record(r) for r in rows]
        if not recs:
            return None
        finals = [r for r in recs if r.final_relative is not None]
        last = max((r.final_round for r in finals), default=None)  # type: ignore[type-var]
        if last is not None and last >= max(r.created for r in recs):  # nothing measured since that round
            round_ = [r for r in finals if r.final_round == last]
            win = min(round_, key=lambda r: r.final_relative)  # type: ignore[arg-type,return-value]
            untuned = [r for r in round_ if r.final_time_s == r.final_ref_s]  # its ratio to itself: exactly 1
            if untuned and win.final_relative > 1.0 - FINAL_MARGIN:  # type: ignore[operator]
                return untuned[0]  # not clearly faster than the untuned schedule: keep that
            return win
        refs = sorted(r.ref_time_s for r in recs if r.ref_time_s)
        mid = refs[len(refs) // 2] if refs else 1.0
        return min(recs, key=lambda r: (r.time_s / r.ref_time_s) if r.ref_time_s else r.time_s / mid)  # type: ignore

    def final_stale(self, workload: str, target: str, threads: int) -> bool:
        """Whether the workload has two or more correct records and some were measured after its latest final
        round (or it never had one): then :meth:`best` falls back to in-run times and a final round is due."""
        where, params = self._where(workload, target, threads)
        n, newest, last = self.conn.execute(
            f"SELECT COUNT(*), MAX(created), MAX(final_round) FROM records{where} AND status='ok' "
            "AND time_s IS NOT NULL", params).fetchone()
        return int(n) >= 2 and (last is None or newest > last)

    def thread_counts(self, workload: str, target: str) -> list[int]:
        """The thread counts with a correct record of the workload for the target."""
        where, params = self._where(workload, target, None)
        rows = self.conn.execute(f"SELECT DISTINCT threads FROM records{where} AND status='ok'", params).fetchall()
        return sorted(int(r[0]) for r in rows)

    def boards(self, workload: str, target: str) -> list[str]:
        """The board kinds with a correct record of the workload for the target ("" is this host)."""
        rows = self.conn.execute("SELECT DISTINCT board FROM records WHERE workload=? AND target=? AND status='ok'",
                                 (workload, target)).fetchall()
        return sorted(str(r[0]) for r in rows)

    def _where(self, workload: str | None, target: str | None, threads: int | None) -> tuple[str, list[Any]]:
        conds, params = ["1=1"], []
        for col, val in (("workload", workload), ("target", target), ("threads", threads), ("board", self.board)):
            if val is not None:
                conds.append(f"{col}=?")
                params.append(val)
        return " WHERE " + " AND ".join(conds), params

    # -- sharing ----------------------------------------------------------------------------
    def export_jsonl(self, path: str | os.PathLike[str], workload: str | None = None) -> int:
        """Write the records (of one workload, or all) as JSON lines; returns how many."""
        rs = self.records(workload)
        with open(path, "w") as f:
            for r in rs:
                f.write(json.dumps(r.to_json(), sort_keys=True) + "\n")
        return len(rs)

    def import_jsonl(self, path: str | os.PathLike[str]) -> int:
        """Add the records of a JSON-lines log (those already here are skipped); returns how many were new."""
        new = 0
        for r in read_jsonl(path):
            new += self.add(r)
        return new


def _add_board_column(conn: sqlite3.Connection) -> None:
    """Migrate a database of an older cuvil: records gain the board kind that measured them ("": this host,
    which measured every one of them), and the board joins the key a configuration is unique under (SQLite
    cannot change a constraint in place: the table is copied, in one transaction)."""
    old = "workload, target, threads, config_hash, config, status, time_s, ref_time_s, trace, names, features, " \
          "error, flops, created, final_time_s, final_ref_s, final_round"
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("ALTER TABLE records RENAME TO records_old")
        conn.execute("DROP INDEX IF EXISTS records_by_key")
        for stmt in _SCHEMA.split(";"):
            if "records" in stmt and stmt.strip():
                conn.execute(stmt)
        conn.execute(f"INSERT INTO records (id, {old}, board) SELECT id, {old}, '' FROM records_old")
        conn.execute("DROP TABLE records_old")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[Record]:
    """The records of a JSON-lines tuning log; a malformed line is a :class:`DatabaseError` naming it."""
    names = {f for f in Record.__dataclass_fields__}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                if d.get("schema", SCHEMA_VERSION) != SCHEMA_VERSION:
                    raise DatabaseError(f"{path}:{n}: a record of schema {d.get('schema')}, this cuvil reads "
                                        f"{SCHEMA_VERSION}")
                yield Record(**{k: v for k, v in d.items() if k in names})
            except (ValueError, TypeError) as exc:
                raise DatabaseError(f"{path}:{n}: not a cuvil tuning record: {exc}") from None
