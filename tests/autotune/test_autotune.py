"""The autotuner's parts without measuring: workload keys, the database, the space, the model, the search,
trace translation and errors.  (Measuring in worker processes: tests/autotune/test_autotune_measure.py.)"""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest

import cuvil
from cuvil import te
from cuvil.autotune.cost_model import BoostedTrees
from cuvil.autotune.database import Database, DatabaseError, Record
from cuvil.autotune.replay import translate
from cuvil.autotune.search import EvolutionarySearch, RandomSearch
from cuvil.autotune.space import Space, config_hash
from cuvil.autotune.workload import workload_of
from cuvil.schedule.auto import auto_schedule
from cuvil.schedule.trace import trace_from_json, trace_to_json


def matmul(n: int = 64, m: int = 48, k: int = 32, names: str = "ABCk", dtype: str = "float32") -> list:
    a, b, c, kk = names
    A = te.placeholder((n, k), dtype=dtype, name=a)
    B = te.placeholder((k, m), dtype=dtype, name=b)
    r = te.reduce_axis((0, k), name=kk)
    C = te.compute((n, m), lambda i, j: te.sum(A[i, r] * B[r, j], axis=r), name=c)
    return [A, B, C]


def test_workload_key_ignores_names_and_sees_structure() -> None:
    w1, w2 = workload_of(matmul()), workload_of(matmul(names="XWYr"))
    assert w1.key == w2.key and w1.names != w2.names
    assert w1.flops == 2 * 64 * 48 * 32
    others = [matmul(n=65), matmul(dtype="float64")]
    A, B, C = matmul()
    D = te.compute(C.shape, lambda i, j: C[i, j] + 1.0, name="D")
    others.append([A, B, D])
    keys = {workload_of(p).key for p in others}
    assert len(keys) == 3 and w1.key not in keys
    # argument order is part of the program (it is the calling convention)
    assert workload_of([B, A, C]).key != w1.key
    assert w1.key != workload_of(matmul(), "llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a76").key


def test_workload_bad_input() -> None:
    with pytest.raises(cuvil.ArgumentError, match="argument list"):
        workload_of("C")
    with pytest.raises(cuvil.ArgumentError, match="computed tensor"):
        workload_of(matmul()[:2])


def _rec(key: str, i: int, t: float | None, status: str = "ok") -> Record:
    cfg = {"C": {"mr": i}}
    return Record(key, "tgt", 1, config_hash(cfg), cfg, status, t, "[]", {"t0": "A"})


def test_database_best_count_resume_and_jsonl(tmp_path) -> None:
    path = tmp_path / "t.db"
    with Database(path) as db:
        assert db.add(_rec("k", 1, 2e-3)) and db.add(_rec("k", 2, 1e-3)) and db.add(_rec("k", 3, None, "run_crash"))
        assert not db.add(_rec("k", 1, 5e-3))  # the same configuration is measured once
        db.add(_rec("other", 1, 1e-6))
        assert db.count("k", "tgt", 1) == 3 and db.count("k", "tgt", 2) == 0
        assert db.best("k", "tgt", 1).config == {"C": {"mr": 2}}
        assert db.best("k", "tgt", 2) is None and db.best("k", "tgt").time_s == 1e-3
        assert db.export_jsonl(tmp_path / "log.jsonl") == 4
    with Database(path) as db:  # committed: a new connection (a rerun) sees every record
        assert [r.status for r in db.records("k")] == ["ok", "ok", "run_crash"]
    with Database(tmp_path / "copy.db") as db2:
        assert db2.import_jsonl(tmp_path / "log.jsonl") == 4
        assert db2.import_jsonl(tmp_path / "log.jsonl") == 0
        assert db2.best("k", "tgt", 1).time_s == 1e-3
    with Database(":memory:") as db:  # by time relative to the untuned schedule timed in the same batch
        quiet, busy = _rec("r", 1, 1.5e-3), _rec("r", 2, 2e-3)
        quiet.ref_time_s, busy.ref_time_s = 1.5e-3, 4e-3  # busy: the machine was loaded, yet 2x the untuned
        db.add(quiet)
        db.add(busy)
        assert db.best("r", "tgt", 1).config == {"C": {"mr": 2}} and busy.relative == 0.5
    with Database(":memory:") as db:  # a final round's winner is the best, whatever the in-run times said
        for r in (_rec("f", 1, 1e-3), _rec("f", 2, 0.5e-3), _rec("f", 3, 0.9e-3)):
            r.ref_time_s = 1e-3
            db.add(r)
        h = [config_hash({"C": {"mr": i}}) for i in (1, 2, 3)]
        assert db.final_stale("f", "tgt", 1) and db.best("f", "tgt", 1).config == {"C": {"mr": 2}}
        now = time.time()
        db.set_final("f", "tgt", 1, [(h[0], 2e-3, 2e-3), (h[1], 2.4e-3, 2e-3)], when=now + 1)
        assert db.best("f", "tgt", 1).config == {"C": {"mr": 1}}  # the untuned one (mr 1) won the round
        assert not db.final_stale("f", "tgt", 1)
        db.set_final("f", "tgt", 1, [(h[0], 2e-3, 2e-3), (h[2], 1.8e-3, 2e-3)], when=now + 2)
        best = db.best("f", "tgt", 1)  # the latest round counts
        assert best.config == {"C": {"mr": 3}} and best.final_relative == pytest.approx(0.9)
        db.export_jsonl(tmp_path / "final.jsonl")
        late = _rec("f", 4, 0.4e-3)  # measured after the round: in-run times decide until the next round
        late.ref_time_s, late.created = 1e-3, now + 3
        db.add(late)
        assert db.final_stale("f", "tgt", 1) and db.best("f", "tgt", 1).config == {"C": {"mr": 4}}
    with Database(":memory:") as db:  # a winner within FINAL_MARGIN of the untuned schedule does not replace it
        for r in (_rec("m", 1, 1e-3), _rec("m", 2, 0.5e-3)):
            r.ref_time_s = 1e-3
            db.add(r)
        h = [config_hash({"C": {"mr": i}}) for i in (1, 2)]
        db.set_final("m", "tgt", 1, [(h[0], 2e-3, 2e-3), (h[1], 1.98e-3, 2e-3)], when=time.time() + 1)
        assert db.best("m", "tgt", 1).config == {"C": {"mr": 1}}
    with Database(":memory:") as db:
        db.import_jsonl(tmp_path / "final.jsonl")
        assert db.best("f", "tgt", 1).final_round == now + 2
    import sqlite3

    old = sqlite3.connect(tmp_path / "old.db")  # a file written before final rounds existed gets the columns
    old.executescript(_OLD_SCHEMA)
    old.close()
    with Database(tmp_path / "old.db") as db:
        assert db.add(_rec("o", 1, 1e-3)) and db.best("o", "tgt", 1).final_round is None
    (tmp_path / "bad.jsonl").write_text('{"workload": "k"}\n')
    with pytest.raises(DatabaseError, match="bad.jsonl:1"):
        Database(":memory:").import_jsonl(tmp_path / "bad.jsonl")
    (tmp_path / "junk.db").write_bytes(b"not a database" * 100)
    with pytest.raises(DatabaseError, match="cannot open"):
        Database(tmp_path / "junk.db")


_OLD_SCHEMA = """
CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta VALUES ('schema', '1');
CREATE TABLE records (id INTEGER PRIMARY KEY AUTOINCREMENT, workload TEXT NOT NULL, target TEXT NOT NULL,
    threads INTEGER NOT NULL, config_hash TEXT NOT NULL, config TEXT NOT NULL, status TEXT NOT NULL, time_s REAL,
    ref_time_s REAL, trace TEXT NOT NULL DEFAULT '[]', names TEXT NOT NULL DEFAULT '{}',
    features TEXT NOT NULL DEFAULT '{}', error TEXT NOT NULL DEFAULT '', flops REAL NOT NULL DEFAULT 0,
    created REAL NOT NULL, UNIQUE (workload, target, threads, config_hash));
"""


def test_space_default_is_the_untuned_schedule() -> None:
    args = matmul(128, 128, 128)
    space = Space(args, "llvm", 2)
    default = space.default()
    assert set(default["C"]) >= {"candidate", "mr", "nr", "pack", "panels_outer", "parallel"}
    assert set(default["C"]) <= set(space.knobs["C"])  # a knob without a stated default: the scheduler's own
    plain = auto_schedule(args)
    knobbed = auto_schedule(args, knobs=default)
    assert trace_to_json(plain.trace) == trace_to_json(knobbed.trace)
    rng = random.Random(0)
    for _ in range(20):
        c = space.sample(rng)
        assert all(c["C"][k] in v for k, v in space.knobs["C"].items())
        m = space.mutate(c, rng, 2)
        assert all(m["C"][k] in v for k, v in space.knobs["C"].items())
        assert space.features(c).shape == space.features(default).shape
    every = space.enumerate(10**6)
    assert len(every) <= space.size and len({config_hash(c) for c in every}) == len(every)
    assert space.enumerate(1) is None


@pytest.mark.parametrize("which", ["matmul", "conv3x3"])
@pytest.mark.slow
def test_canonical_configurations_give_the_same_schedule(which: str) -> None:
    """Configurations the space treats as one point (one hash after ``canonical``) schedule the same
    loops: "pack" where the operand cannot be packed (or must be), "ku" values that unroll a 3-tap window
    alike.  Drawn from the raw knob values, not through ``sample`` (which returns canonical points)."""
    from cuvil.te import ops

    if which == "matmul":
        args = matmul(256, 256, 256)  # B of 64K elements: optional packing applies for some nr only
    else:
        X, W = te.placeholder((1, 16, 12, 12), name="X"), te.placeholder((32, 16, 3, 3), name="W")
        args = [X, W, ops.conv2d_nchw(X, W, padding=1)]
    space = Space(args, "llvm", 1)
    rng = random.Random(3)
    merged = 0
    for _ in range(12):
        raw = {st: {k: rng.choice(vals) for k, vals in kn.items()} for st, kn in space.knobs.items()}
        canon = space.canonical(raw)
        merged += config_hash(canon) != config_hash(raw)
        assert trace_to_json(auto_schedule(args, knobs=raw).trace) == \
            trace_to_json(auto_schedule(args, knobs=canon).trace), (raw, canon)
    assert merged > 0  # the rules did something on these programs


def test_model_learns_an_order() -> None:
    rng = np.random.default_rng(0)
    x = rng.random((120, 6))
    y = 3 * x[:, 0] - 2 * (x[:, 1] > 0.5) + x[:, 2] * x[:, 3]
    m = BoostedTrees().fit(x[:80], y[:80])
    assert np.corrcoef(m.predict(x[80:]), y[80:])[0, 1] > 0.9
    assert BoostedTrees().fit(x[:1], y[:1]).predict(x[:3]).shape == (3,)


def test_search_never_repeats_and_the_model_steers() -> None:
    args = matmul(128, 128, 128)
    space = Space(args, "llvm", 1)

    # a made-up machine: mr 6 and nr 32 are best, no packing; mr 4 where 6 is the untuned tile's own rows
    # (AVX2's 16 registers: 6 x 2 vectors), so the search has somewhere to go from it
    best_mr = 6 if space.default()["C"]["mr"] != 6 else 4

    def fake_time(cfg: dict) -> float:
        c = cfg["C"]
        return 1e-3 * (1 + abs(c["mr"] - best_mr) + abs(c["nr"] - 32) / 16 + c["pack"])

    bests = {}
    for name, cls in (("random", RandomSearch), ("evolutionary", EvolutionarySearch)):
        found = []
        for seed in range(3):
            s = cls(space, seed=seed)
            s.observe(space.default(), fake_time(space.default()))
            for _ in range(3):
                batch = s.propose(8)
                assert len({config_hash(c) for c in batch}) == len(batch) == 8
                assert not {config_hash(c) for c in batch} & s.seen
                for c in batch:
                    s.observe(c, fake_time(c))
            found.append(min(fake_time(c) for c, _ in [(c, 0) for c, _ in s.history]))
        bests[name] = float(np.mean(found))
    assert bests["evolutionary"] <= bests["random"]


def test_late_search_exploits_the_neighbours_of_the_best() -> None:
    args = matmul(128, 128, 128)
    space = Space(args, "llvm", 1)
    d = space.default()
    near = space.neighbours(d)
    # one knob changed (and what canonical() derives from it: packing follows nr and the candidate)
    assert near and all(sum(c["C"][k] != d["C"][k] for k in d["C"] if k != "pack") == 1 or
                        [k for k in d["C"] if c["C"][k] != d["C"][k]] == ["pack"] for c in near)
    assert {c["C"]["mr"] for c in near} >= {d["C"]["mr"] - 1, d["C"]["mr"] + 1}
    rng = random.Random(0)
    s = EvolutionarySearch(space, seed=0)
    s.budget = 40
    for _ in range(32):  # three quarters of the budget spent: half of the next batch goes to neighbours
        c = space.sample(rng)
        s.observe(c, 1e-3 * (1 + abs(c["C"]["mr"] - 5) + c["C"]["nr"] / 64))
    tops = {config_hash(c) for b in s._best_measured(3) for c in space.neighbours(b)}
    batch = s.propose(8)
    assert sum(config_hash(c) in tops for c in batch) >= 3 and len(batch) == 8


def test_exploration_avoids_what_the_model_expects_to_fail() -> None:
    args = matmul(128, 128, 128)
    space = Space(args, "llvm", 1)
    rng = random.Random(1)
    s = EvolutionarySearch(space, seed=1)
    for _ in range(40):  # tiles of 9 rows or more fail (as builds that isl chokes on would)
        c = space.sample(rng)
        s.observe(c, None if c["C"]["mr"] >= 9 else 1e-3 * (1 + c["C"]["nr"] / 64))
    assert s._fit()
    picked = s._explore(12, set())
    assert len(picked) == 12 and sum(c["C"]["mr"] >= 9 for c in picked) <= 2  # drawn at random: about 5


def test_translate_renames_stages_and_axes() -> None:
    args = matmul(128, 128, 128)
    w = workload_of(args)
    steps = auto_schedule(args).trace
    w2 = workload_of(matmul(128, 128, 128, names="XWYr"))
    moved = translate(steps, w.names, w2.names)
    text = trace_to_json(moved)
    assert '"Y.local"' in text and '"C"' not in text and '"r"' in text and '"k"' not in text
    assert translate(steps, w.names, w.names) == tuple(steps)
    assert trace_from_json(text) == moved


def test_tune_rejects_bad_input(tmp_path) -> None:
    args = matmul()
    db = str(tmp_path / "t.db")
    with pytest.raises(cuvil.ArgumentError, match="trials"):
        cuvil.autotune.tune(args, trials=0, db=db)
    with pytest.raises(cuvil.ArgumentError, match="timeout_s"):
        cuvil.autotune.tune(args, trials=2, db=db, timeout_s=-1)
    with pytest.raises(cuvil.ArgumentError, match="unknown search"):
        cuvil.autotune.tune(args, trials=2, db=db, search="grid")
    with pytest.raises(cuvil.ArgumentError, match="remote runner"):
        cuvil.autotune.tune(args, "llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a76", trials=2, db=db)
    N = te.var("N")
    A = te.placeholder((N, 4), name="A")
    B = te.compute((N, 4), lambda i, j: A[i, j] * 2.0, name="B")
    with pytest.raises(cuvil.ArgumentError, match="symbolic shape"):
        cuvil.autotune.tune([A, B], trials=2, db=db)
    with pytest.raises(cuvil.ArgumentError, match="tuning_db"):
        cuvil.build(te.create_schedule(args[2]), args, tuning_db=42)


def test_build_without_a_record_builds_the_given_schedule(tmp_path, caplog) -> None:
    args = matmul(16, 16, 16)
    s = te.create_schedule(args[2])
    db = tmp_path / "empty.db"
    Database(db).close()
    with caplog.at_level("INFO", logger="cuvil.autotune"):
        f = cuvil.build(s, args, tuning_db=str(db))
    assert "no record" in caplog.text
    a, b = np.ones((16, 16), "float32"), np.ones((16, 16), "float32")
    c = np.empty((16, 16), "float32")
    f(a, b, c)
    assert np.all(c == 16)
    assert json.loads(trace_to_json(s.trace)) == []


def test_tune_kernels_spends_trials_where_the_time_is() -> None:
    from cuvil.autotune.api import TuneResult
    from cuvil.autotune.whole_models import tune_kernels

    spent: dict[int, int] = {}
    base = {0: 1e-3, 1: 1e-2}  # kernel 1 runs 10x longer per call

    def fake_tune(args, target, trials, **kw):  # records: the time halves over the first 16 trials
        k = args
        measured = trials - spent.get(k, 0)
        spent[k] = trials
        t = base[k] * (0.5 + 0.5 * max(0, 16 - trials) / 16)
        return TuneResult(t, None, "[]", {}, str(k), "t", 1, measured, trials, untuned_time_s=base[k])

    history: list = []
    res = tune_kernels([(0, 2), (1, 1)], trials=40, tune_fn=fake_tune, warmup=4, chunk=4, history=history)
    assert sum(r.trials for r in res) == 40
    assert history[-1][0] == 40 and history[-1][1] < history[0][1]
    assert res[1].trials > res[0].trials >= 4  # 1 x 10 ms outweighs 2 x 1 ms
    with pytest.raises(cuvil.ArgumentError, match="no kernels"):
        tune_kernels([], trials=4)


def test_tune_subcommand(tmp_path, capsys) -> None:
    from cuvil.cli import tune as cli
    from cuvil.cli.parser import build_parser

    args = build_parser().parse_args(["tune", str(tmp_path / "m.onnx"), "--trials", "3", "--db", str(tmp_path / "t.db")])
    assert args.trials == 3 and args.plot is None
    from cuvil.frontend import onnx as importer

    if not hasattr(importer, "kernel_programs"):
        assert cli.tune_cmd(args) == 1
        assert "kernel_programs" in capsys.readouterr().err
    cli.plot_curve([(0, 3e-3), (8, 2e-3)], str(tmp_path / "c.svg"))
    assert (tmp_path / "c.svg").read_text().startswith("<svg")


class _FakeBuilder:
    """Schedules in-process (no compiling): the trace is the real one, the library an empty file."""

    def __init__(self, args: list):
        self.args = args

    def build(self, jobs):
        from cuvil.autotune.measure import BuildResult

        out = []
        for j in jobs:
            open(j.path, "w").close()
            trace = trace_to_json(auto_schedule(self.args, knobs=j.config).trace)
            out.append(BuildResult(j.trial, j.config, "ok", j.path, trace))
        return out

    def close(self) -> None:
        pass


class _OptimisticRunner:
    """A made-up machine whose in-run measurements flatter the candidates (0.7 ms: each looks faster than the
    untuned schedule's 1 ms) and whose final round tells the truth: ``true(config)`` seconds."""

    def __init__(self, true, default: dict):
        self.true, self.default, self.finals = true, default, 0

    def set_inputs(self, inputs, outputs) -> None:
        pass

    def reference(self, build):
        from cuvil.autotune.measure import RunResult

        return RunResult("ok")

    def run(self, builds, best_rel=None):
        from cuvil.autotune.measure import RunResult

        return [RunResult("ok", 1e-3 if b.config == self.default else 0.7e-3, "", 1e-3) for b in builds]

    def final(self, builds, rounds=7):
        from cuvil.autotune.measure import RunResult

        self.finals += 1
        return [RunResult("ok", self.true(b.config), "", 1e-3) for b in builds]

    def close(self) -> None:
        pass


@pytest.mark.parametrize("faster", [False, True])
def test_final_round_decides_and_includes_the_untuned_schedule(tmp_path, faster: bool) -> None:
    args = matmul(128, 128, 128)
    space = Space(args, "llvm", 1)
    default = space.default()
    # a register tile other than the untuned one, whatever the target's lanes and registers make that
    special = {"C": {**default["C"], "mr": 4 if default["C"]["mr"] != 4 else 6}}
    assert special != default

    def true(cfg: dict) -> float:  # every candidate is slower than the untuned schedule, or one is faster
        if cfg == default:
            return 1e-3
        return 0.8e-3 if faster and cfg == special else 1.2e-3

    db = str(tmp_path / "final.db")
    with Database(db) as d:  # an earlier run measured `special` (optimistically): it is a finalist too
        d.add(Record(workload_of(args).key, cuvil.Target("llvm").canonical, 1, config_hash(special), special, "ok",
                     0.6e-3, trace_to_json(auto_schedule(args, knobs=special).trace), workload_of(args).names,
                     ref_time_s=1e-3))
    runner = _OptimisticRunner(true, default)
    first = cuvil.autotune.tune(args, trials=9, db=db, num_threads=1, batch_size=4, builder=_FakeBuilder(args),
                                runner=runner, progress=False, final_top=0)  # no final round (killed in it, say)
    assert runner.finals == 0 and first.measured == 8 and first.speedup == pytest.approx(1 / 0.6)
    res = cuvil.autotune.tune(args, trials=9, db=db, num_threads=1, batch_size=4, builder=_FakeBuilder(args),
                              runner=runner, progress=False, final_top=3)  # the rerun holds the final round
    assert runner.finals == 1 and res.measured == 0 and len(res.final) == 4  # the best 3 + the untuned
    want = special if faster else default
    assert res.config == want and res.final[0][0] == want
    assert res.speedup == pytest.approx(1.25 if faster else 1.0) and res.best_time_s == true(want)
    assert any(c == default and rel == 1.0 for c, rel in res.final)
    with Database(db) as d:  # what build(tuning_db=) replays: the final round's winner, the untuned included
        best = d.best(res.workload_key, res.target, 1)
        assert best.config == want and best.final_relative == pytest.approx(1 / res.speedup)
    cuvil.set_num_threads(1)
    try:
        from cuvil.autotune.replay import apply_best

        s = apply_best(te.create_schedule(args[2]), args, "llvm", db)
    finally:
        cuvil.set_num_threads(None)
    assert trace_to_json(s.trace) == trace_to_json(auto_schedule(args, knobs=want).trace)
    again = cuvil.autotune.tune(args, trials=9, db=db, num_threads=1, builder=_FakeBuilder(args), runner=runner,
                                progress=False)
    assert again.measured == 0 and runner.finals == 1 and again.config == want  # a rerun measures nothing
    more = cuvil.autotune.tune(args, trials=10, db=db, num_threads=1, builder=_FakeBuilder(args), runner=runner,
                               progress=False, final_top=0)  # a trial after the round: in-run times decide again
    assert more.measured == 1 and more.final == [] and more.speedup == pytest.approx(1 / 0.6)


def test_workload_key_carries_the_knob_space_version(tmp_path, caplog, monkeypatch) -> None:
    # records of an older knob space are filed under another key (a tuning run neither counts nor learns from
    # them), and build(tuning_db=) still replays the best of them when the current space has none
    import cuvil.schedule.auto as auto
    from cuvil.schedule.workload import _key

    args = matmul(24, 40, 16)
    wl = workload_of(args)
    assert wl.older_keys and wl.key not in wl.older_keys and len(set(wl.older_keys)) == len(wl.older_keys)
    assert wl.older_keys[-1] == _key(wl.program_hash, wl.target, 1)  # version 1: the key from before versions
    monkeypatch.setattr(auto, "KNOB_SPACE_VERSION", auto.KNOB_SPACE_VERSION + 1)
    newer = workload_of(args)
    assert newer.key != wl.key and newer.older_keys[0] == wl.key
    monkeypatch.undo()
    old_cfg = {"C": {"mr": 3, "nr": 16, "ku": 1}}
    trace = trace_to_json(auto_schedule(args, knobs=old_cfg).trace)
    db = tmp_path / "old.db"
    with Database(db) as d:
        d.add(Record(wl.older_keys[-1], wl.target, cuvil.get_num_threads(), config_hash(old_cfg), old_cfg, "ok",
                     1e-3, trace, wl.names))
        assert d.count(wl.key, wl.target, cuvil.get_num_threads()) == 0
    with caplog.at_level("INFO", logger="cuvil.autotune"):
        f = cuvil.build(te.create_schedule(args[2]), args, tuning_db=str(db))
    assert "older knob space" in caplog.text
    from cuvil.autotune.replay import apply_best

    replayed = apply_best(te.create_schedule(args[2]), args, "llvm", str(db))
    assert json.loads(trace_to_json(replayed.trace)) == json.loads(trace)
    a = np.arange(24 * 16, dtype="float32").reshape(24, 16) / 100
    b = np.arange(16 * 40, dtype="float32").reshape(16, 40) / 100
    c = np.empty((24, 40), "float32")
    f(a, b, c)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-5)


def test_contenders_are_measured_twice_and_averaged() -> None:
    """A candidate that looks as fast as the best so far is timed again after its batch; the record keeps the
    geometric mean (a lucky first measurement is halved in log terms), and a failure the second time counts."""
    from cuvil.autotune.api import _confirm
    from cuvil.autotune.measure import BuildResult, RunResult

    builds = [BuildResult(k, {"C": {"mr": k}}, "ok", f"c{k}.so") for k in range(4)]
    first = [RunResult("ok", 1.0, "", 1.0), RunResult("ok", 0.5, "", 1.0), RunResult("ok", 2.0, "", 1.0),
             RunResult("run_crash", None, "boom")]
    calls = []

    class Second:
        def run(self, bs, best_rel=None):
            calls.append([b.trial for b in bs])
            return [RunResult("ok", 0.98, "", 1.0) if b.trial == 1 else RunResult("wrong", None, "bad") for b in bs]

    out = _confirm(Second(), builds, first, best_rel=0.9)
    assert calls == [[1]]  # only the contender (0.5 <= 0.9 * 1.03 and the batch's best); 1.0 and 2.0 are not
    assert out[1].status == "ok" and abs(out[1].time_s / out[1].ref_time_s - (0.5 * 0.98) ** 0.5) < 1e-12
    assert out[0] is first[0] and out[2] is first[2] and out[3] is first[3]
    calls.clear()
    out = _confirm(Second(), builds, first, best_rel=None)  # first batch: within 3% of the batch's best
    assert calls == [[1]]
    out = _confirm(Second(), builds, [RunResult("ok", 1.0, "", 1.0)] * 2, best_rel=1.2)
    assert calls[-1] == [0, 1] and out[0].status == "wrong" and out[1].status == "ok"  # failing twice-measured: failed
