"""The search space: the auto-scheduler's knobs (``knob_space``), configurations and their features.

A *configuration* sets every knob of every tunable stage::

    {"C": {"candidate": 0, "mr": 8, "nr": 32, "pack": True, "panels_outer": True, "parallel": True}}

and :func:`cuvil.schedule.auto.auto_schedule` turns it into a schedule (isl checks it; a
combination it refuses leaves that stage to the plain strategy, so every point is a legal
schedule).  :meth:`Space.default` is the configuration the untuned auto-scheduler picks
itself (:func:`cuvil.schedule.auto.default_knobs`), so the first trial of every tuning run is
the untuned schedule.

:meth:`Space.features` describes the loop nest a configuration produces, without
building it (a build costs as much as a measurement): register-tile shape and register
pressure, work per load, wasted tail iterations and vector lanes, how evenly the
parallel tiles split over the threads, the bytes a packed panel and a row block keep in
L2 and L1, the knob bits, and a prior score (:meth:`Space.prior`: work per load, the useful share of
the tile, the untuned scheduler's preferences) that ranks candidates before anything is measured.  The
cost model learns from these.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from cuvil.schedule.heuristics import Heuristics

Config = dict[str, dict[str, Any]]


def config_hash(cfg: Config) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]


class Space:
    """The knobs of one program for one target, with the facts its features need (``heuristics``: the
    automatic scheduler's thresholds; None: the target's)."""

    def __init__(self, args: Sequence[Any], target: Any = "llvm", threads: int = 1,
                 heuristics: Heuristics | None = None):
        from cuvil.schedule.auto import AutoScheduler, default_knobs, knob_space
        from cuvil.schedule.axes import const_int
        from cuvil.schedule.schedule import Schedule
        from cuvil.target import Target
        from cuvil.te.tensor import ComputeOp, PlaceholderOp, Tensor

        self.target = target if isinstance(target, Target) else Target(target)
        self.threads = max(1, int(threads))
        self.knobs = knob_space(args, self.target, heuristics)
        if self.threads == 1:  # one thread: a parallel loop runs as a serial one, so that knob only doubles the
            # space (two configurations, one schedule); the scheduler's own choice stands
            self.knobs = {st: {k: v for k, v in kn.items() if k != "parallel"} for st, kn in self.knobs.items()}
            self.knobs = {st: kn for st, kn in self.knobs.items() if kn}
        outs = [a for a in args if isinstance(a, Tensor) and not isinstance(a.op, PlaceholderOp)]
        s = Schedule(outs)
        sch = AutoScheduler(s, [s[o] for o in outs], self.target, heuristics=heuristics)
        chosen = default_knobs(args, self.target, heuristics)  # the untuned scheduler's own choices: trial 0
        self.facts: dict[str, dict[str, Any]] = {}
        self._default: Config = {}
        for st in s.compute_stages:
            if st.name not in self.knobs:
                continue
            op = st.op
            facts: dict[str, Any] = {"work": sch._work(st), "dtype_bytes": max(1, _bytes(op.dtype))}
            default = chosen.get(st.name, {})
            if isinstance(op, ComputeOp) and op.reduce_axis and "candidate" in self.knobs[st.name]:
                red = math.prod(const_int(a.extent) or 1024 for a in op.reduce_axis)
                facts.update(lanes=sch.lanes(op.dtype), regs=32 if sch.bits >= 512 else 16, reduce=red,
                             red_inner=const_int(op.reduce_axis[-1].extent) or 0,  # the loop "ku" unrolls
                             cands=[{"i": const_int(c.i.extent) or 1024, "j": const_int(c.j.extent) or 1024,
                                     "must_pack": c.pack_dim is not None,
                                     # whether auto_schedule packs with each nr when the "pack" knob asks
                                     "packs": {nr: c.panel is None and sch._packable(c, nr, op) is not None
                                               for nr in self.knobs[st.name].get("nr", [])}}
                                    for c in sch.candidates(op)],
                             default_candidate=int(default.get("candidate", 0)))
            self.facts[st.name] = facts
            self._default[st.name] = {k: v for k, v in default.items() if k in self.knobs[st.name]}
        self._default = self.canonical(self._default)
        self.size = math.prod(len(vals) for kn in self.knobs.values() for vals in kn.values())  # with duplicates

    # -- points ---------------------------------------------------------------------------
    def default(self) -> Config:
        """The untuned auto-scheduler's own choices, as a configuration."""
        return json.loads(json.dumps(self._default))

    def canonical(self, cfg: Config) -> Config:
        """``cfg`` with the knobs that do not change its schedule set to one value, so configurations that
        give one schedule are one point (one hash, measured once): "pack" says whether the operand is packed
        (False where auto_schedule cannot or will not pack it with that candidate and nr; True where the
        candidate must be packed), and "ku" is the smallest value that unrolls the tile's innermost
        reduction loop the same way (a 3-tap window: 4 and 8 both unroll it whole; 2 leaves it alone, as 1
        does)."""
        out = json.loads(json.dumps(cfg))
        for st, kn in self.knobs.items():
            k, f = out.get(st), self.facts.get(st, {})
            if k is None or "cands" not in f:
                continue
            if "pack" in kn and "nr" in k and f["cands"]:
                c = f["cands"][int(k.get("candidate", 0)) % len(f["cands"])]
                k["pack"] = bool(c["packs"].get(k["nr"], False) and (k.get("pack", True) or c["must_pack"]))
            if "ku" in kn and "ku" in k:
                inner = int(f.get("red_inner") or 0)
                steps = _unrolled_steps(int(k["ku"]), inner)
                k["ku"] = min(v for v in kn["ku"] if _unrolled_steps(v, inner) == steps)
        return out

    def shape_key(self, cfg: Config) -> tuple:
        """What a configuration's loops look like in the large: each contraction stage's candidate pair and
        register tile (``mr`` x ``nr``), every knob of the other stages; ``ku``, packing and the panel order
        refine a shape."""
        out = []
        for st, kn in self.knobs.items():
            k = cfg.get(st, {})
            names = ("candidate", "mr", "nr") if "candidate" in kn else tuple(sorted(kn))
            out.append((st, *(k.get(name) for name in names)))
        return tuple(out)

    def sample(self, rng: random.Random) -> Config:
        return self.canonical({st: {k: rng.choice(vals) for k, vals in kn.items()} for st, kn in self.knobs.items()})

    def mutate(self, cfg: Config, rng: random.Random, n: int = 1) -> Config:
        """``cfg`` with ``n`` knobs changed (a tile size moves to a neighbouring value more often than far);
        never ``cfg`` itself when another point exists."""
        for _ in range(10):
            out = self.canonical(self._mutate(cfg, rng, n))
            if config_hash(out) != config_hash(cfg):
                break
        return out

    def _mutate(self, cfg: Config, rng: random.Random, n: int) -> Config:
        out = json.loads(json.dumps(cfg))
        slots = [(st, k) for st, kn in self.knobs.items() for k, vals in kn.items() if len(vals) > 1]
        for _ in range(n):
            if not slots:
                break
            st, k = rng.choice(slots)
            vals = self.knobs[st][k]
            cur = out.setdefault(st, {}).get(k, vals[0])
            if cur in vals and isinstance(cur, int) and not isinstance(cur, bool) and rng.random() < 0.7:
                pos = vals.index(cur) + rng.choice((-2, -1, 1, 2))
                out[st][k] = vals[min(max(pos, 0), len(vals) - 1)]
            else:
                out[st][k] = rng.choice([v for v in vals if v != cur] or vals)
        return out

    def neighbours(self, cfg: Config) -> list[Config]:
        """Every configuration one knob away from ``cfg``: a tile size (an ordered int knob) moved one or two
        places along its values, any other knob set to each of its other values (as canonical points: each
        once, ``cfg`` itself left out)."""
        out = []
        seen = {config_hash(cfg)}
        for st, kn in self.knobs.items():
            for k, vals in kn.items():
                cur = cfg.get(st, {}).get(k, vals[0])
                if cur in vals and isinstance(cur, int) and not isinstance(cur, bool):
                    pos = vals.index(cur)
                    near = [vals[p] for p in (pos - 2, pos - 1, pos + 1, pos + 2) if 0 <= p < len(vals)]
                else:
                    near = [v for v in vals if v != cur]
                for v in near:
                    c = json.loads(json.dumps(cfg))
                    c.setdefault(st, {})[k] = v
                    c = self.canonical(c)
                    h = config_hash(c)
                    if h not in seen:
                        seen.add(h)
                        out.append(c)
        return out

    def crossover(self, a: Config, b: Config, rng: random.Random) -> Config:
        return self.canonical({st: {k: (a if rng.random() < 0.5 else b).get(st, {}).get(k, vals[0])
                                    for k, vals in kn.items()} for st, kn in self.knobs.items()})

    def enumerate(self, limit: int) -> list[Config] | None:
        """Every distinct (canonical) configuration, when the knobs make at most ``limit`` combinations;
        else None."""
        if self.size > limit:
            return None
        import itertools

        slots = [(st, k, vals) for st, kn in self.knobs.items() for k, vals in kn.items()]
        out: dict[str, Config] = {}
        for combo in itertools.product(*[vals for _, _, vals in slots]):
            cfg: Config = {st: {} for st in self.knobs}
            for (st, k, _), v in zip(slots, combo):
                cfg[st][k] = v
            cfg = self.canonical(cfg)
            out.setdefault(config_hash(cfg), cfg)
        return list(out.values())

    # -- features ---------------------------------------------------------------------------
    def features(self, cfg: Config) -> np.ndarray:
        """A fixed-length vector describing the loop nest ``cfg`` gives (see the module docstring)."""
        out: list[float] = []
        for st, kn in self.knobs.items():
            k = self.canonical({st: {**self._default.get(st, {}), **cfg.get(st, {})}})[st]
            f = self.facts[st]
            if "candidate" in kn:
                out += self._contraction_features(f, k)
            else:
                out += [float(bool(k.get("parallel"))), float(bool(k.get("lanes", False))), math.log2(f["work"] + 1)]
            # knobs these features do not describe (added to knob_space later): their values as they are
            out += [_value(k.get(name), vals) for name, vals in kn.items() if name not in _DESCRIBED]
        return np.asarray(out, dtype=np.float64)

    def _contraction_features(self, f: dict[str, Any], k: dict[str, Any]) -> list[float]:
        cands = f["cands"]
        ci = int(k.get("candidate", 0)) % max(1, len(cands))
        c = cands[ci] if cands else {"i": 1, "j": 1, "must_pack": False}
        v, regs = f["lanes"], f["regs"]
        mr, nr = int(k["mr"]), int(k["nr"])
        nv = -(-nr // v)
        acc = mr * nv
        pressure = acc + nv + 1
        ext_i, ext_j = c["i"], c["j"]
        mr_e, nr_e = min(mr, ext_i), min(nr, ext_j)
        waste_i = -(-ext_i // mr_e) * mr_e / ext_i - 1.0
        waste_j = -(-ext_j // nr_e) * nr_e / ext_j - 1.0
        lane_use = ext_j / (-(-ext_j // v) * v)
        packed = bool(k.get("pack"))  # canonical: whether the operand is packed
        parallel = bool(k.get("parallel"))
        tiles = -(-ext_i // mr_e) * -(-ext_j // nr_e)
        th = self.threads if parallel else 1
        balance = tiles / (-(-tiles // th) * th)
        b = f["dtype_bytes"]
        kc = int(k.get("kc") or 0)  # a reduction block (when knob_space has one): the panel and rows it keeps
        kc = kc if 0 < kc < f["reduce"] else f["reduce"]
        panel = nr * kc * b
        rows = mr * kc * b
        l1, l2 = self.target.l1_size, self.target.l2_size
        onehot = [float(ci == n) for n in range(4)]
        # the prior: log of multiply-adds per register load, times the useful share of the tile, with
        # bonuses for what the untuned scheduler's reasoning favours (its own operand pair, packing with
        # panels outermost) and a penalty for spilling registers
        prior = math.log(acc / (mr + nv) * lane_use / ((1 + waste_i) * (1 + waste_j)))
        prior += math.log(1.5) * (ci == f["default_candidate"]) + math.log(1.3) * packed
        prior += math.log(1.1) * (bool(k.get("panels_outer")) == packed) - math.log(2.0) * (pressure > regs)
        ku = _unrolled_steps(int(k.get("ku") or 1), int(f.get("red_inner") or 0))  # reduction steps per branch
        prior += math.log(1.05) * (ku > 1)
        group = max(1, int(k.get("group") or 1))  # column panels run per row tile: the rows are read once for all
        return [
            mr, nv, acc, pressure / regs, max(0.0, pressure - regs), acc / (mr + nv), waste_i, waste_j, lane_use,
            float(packed), float(bool(k.get("panels_outer"))), float(parallel), balance * th, math.log2(tiles),
            math.log2(panel / l2), math.log2(rows / l1), float(mr % 2 == 0), math.log2(f["work"] + 1), *onehot,
            math.log2(max(1.0, ext_j / (nr_e * group))), math.log2(group * panel / l2),  # row passes, panels kept
            math.log2(ku), math.log2(ku * (acc + mr + nv)),  # reduction steps and instructions per loop branch
            prior,  # last (Space.prior reads it there)
        ]

    def prior(self, cfg: Config) -> float:
        """A score before any measurement (higher = expected faster), in the units of the search's scores
        (the log of a speed-up): the contraction stages' priors (the last feature), averaged with their
        work's log as weights."""
        return self.prior_of(self.features(cfg))

    def prior_of(self, x: np.ndarray) -> float:
        """:meth:`prior` from the configuration's features."""
        total = weights = 0.0
        pos = 0
        for st, kn in self.knobs.items():
            if "candidate" in kn:
                w = math.log2(self.facts[st]["work"] + 1)
                total += float(x[pos + _N_CONTRACTION - 1]) * w
                weights += w
            pos += (_N_CONTRACTION if "candidate" in kn else 3) + sum(name not in _DESCRIBED for name in kn)
        return total / weights if weights else 0.0


_DESCRIBED = {"candidate", "mr", "nr", "pack", "panels_outer", "parallel", "lanes", "ku"}
_N_CONTRACTION = 27  # features of a contraction stage (Space._contraction_features), the prior last


def _unrolled_steps(ku: int, inner: int) -> int:
    """The reduction steps one iteration of the tile's innermost reduction loop runs with the knob ``ku``
    (as :func:`cuvil.schedule.auto._unroll_reduction` applies it to a loop of ``inner`` steps, 0 = unknown)."""
    if ku <= 1 or inner <= 1:
        return 1
    if inner <= ku:
        return inner
    return ku if inner % ku == 0 else 1


def _value(v: Any, vals: Sequence[Any]) -> float:
    """A knob value as a number: a bool as 0/1, an int as log2(1 + v), anything else by its position."""
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return math.log2(1.0 + max(0.0, float(v)))
    return float(vals.index(v)) if v in vals else -1.0


def _bytes(dtype: str) -> int:
    from cuvil import dtype as dt

    return max(1, dt.bits(dtype) // 8)
