"""Search strategies: which configurations to measure next.

- :class:`RandomSearch`: uniform samples never measured before (the baseline).
- :class:`EvolutionarySearch`: a population bred from the fastest measured configurations
  (mutations of one or two knobs, crossovers) and fresh random ones, ranked by the cost
  model, which is refitted on every measurement after each batch: the space's prior score
  (:meth:`Space.prior`, register-tile reasoning in log-speed units) plus boosted trees
  (:class:`cuvil.autotune.cost_model.BoostedTrees` on :meth:`Space.features`) fitted to what the prior
  gets wrong, so where nothing was measured the ranking falls back on the prior instead of on
  whatever the trees' last split says (a model fitted to the scores themselves ranked 1-row tiles
  first after 24 trials of an A^T B^T matmul: six trials at 0.3-0.7x); a quarter of each batch (at least one)
  is random, so the model also learns where it is wrong (random, but not where the model
  expects a failure: builds that time out cost a whole batch's wait).  Before the model has four correct
  measurements, candidates are ranked by the space's prior score (:meth:`Space.prior`), one per register-tile
  shape (:meth:`Space.shape_key`) not measured yet; later batches take at most two per shape.
  As the budget (``budget``: the trials the tuner will spend) runs out, the search exploits
  more: fewer random candidates, and a growing share of each batch (up to half) goes to the
  best-ranked neighbours (one knob away) of the three fastest configurations measured, where
  the model's global ranking is least sure and a small step still pays.

Both see every earlier record of the workload (:meth:`Search.observe`), so a resumed
run neither repeats a configuration nor forgets what it learnt.
"""

from __future__ import annotations

import math
import random

import numpy as np

from cuvil.autotune.cost_model import BoostedTrees
from cuvil.autotune.space import Config, Space, config_hash


class Search:
    """Base class: remembers what was measured (score = -log relative seconds; None = failed)."""

    def __init__(self, space: Space, seed: int = 0):
        self.space = space
        self.rng = random.Random(seed)
        self.seen: set[str] = set()
        self.history: list[tuple[Config, float | None]] = []
        self.budget: int | None = None  # the trials the tuner will spend in all (set by tune), if known

    def observe(self, cfg: Config, time_s: float | None, ref_s: float | None = None) -> None:
        """A measured configuration; with ``ref_s`` (the untuned time in the same batch) its score is relative,
        so batches measured while the machine was busy compare fairly with quiet ones."""
        self.seen.add(config_hash(cfg))
        self.history.append((cfg, -math.log(time_s / (ref_s or 1.0)) if time_s else None))

    def propose(self, n: int) -> list[Config]:
        raise NotImplementedError

    def _fresh(self, cfg: Config, taken: set[str]) -> bool:
        h = config_hash(cfg)
        if h in self.seen or h in taken:
            return False
        taken.add(h)
        return True

    def _random(self, n: int, taken: set[str]) -> list[Config]:
        out: list[Config] = []
        for _ in range(50 * n + 50):
            if len(out) == n:
                break
            c = self.space.sample(self.rng)
            if self._fresh(c, taken):
                out.append(c)
        return out


class RandomSearch(Search):
    """Uniform random configurations, each measured once."""

    def propose(self, n: int) -> list[Config]:
        return self._random(n, set())


class EvolutionarySearch(Search):
    """Model-guided evolution (see the module docstring)."""

    def __init__(self, space: Space, seed: int = 0, population: int = 96, generations: int = 4,
                 explore: float = 0.25):
        super().__init__(space, seed)
        self.population, self.generations, self.explore = population, generations, explore
        self.model = BoostedTrees()
        self._cache: dict[str, tuple[np.ndarray, float]] = {}

    def _feat(self, cfg: Config) -> np.ndarray:
        return self._entry(cfg)[0]

    def _prior(self, cfg: Config) -> float:
        return self._entry(cfg)[1]

    def _entry(self, cfg: Config) -> tuple[np.ndarray, float]:
        h = config_hash(cfg)
        if h not in self._cache:
            x = self.space.features(cfg)
            self._cache[h] = (x, self.space.prior_of(x))
        return self._cache[h]

    def _fit(self) -> bool:
        ok = [y for _, y in self.history if y is not None]
        if len(ok) < 4:
            return False
        floor = min(ok) - 0.5  # a failed candidate scores below the slowest correct one
        x = np.stack([self._feat(c) for c, _ in self.history])
        y = np.array([floor if s is None else s for _, s in self.history])
        self.model.fit(x, y - np.array([self._prior(c) for c, _ in self.history]))  # what the prior misses
        return True

    def _score(self, cfgs: list[Config]) -> np.ndarray:
        if not cfgs:
            return np.zeros(0)
        return self.model.predict(np.stack([self._feat(c) for c in cfgs])) + np.array([self._prior(c) for c in cfgs])

    def _best_measured(self, k: int) -> list[Config]:
        ok = sorted(((s, n) for n, (_, s) in enumerate(self.history) if s is not None), reverse=True)
        return [self.history[n][0] for _, n in ok[:k]] or [self.space.default()]

    def _progress(self) -> float:
        return min(1.0, len(self.history) / self.budget) if self.budget else 0.0

    def propose(self, n: int) -> list[Config]:
        taken: set[str] = set()
        late = self._progress()
        n_explore = max(1, int(round(n * self.explore * (1.0 - late)))) if n > 1 else 0
        if not self._fit():
            # no model yet: the best configurations by the prior score (and random ones)
            pool = self.space.enumerate(4096) or [self.space.sample(self.rng) for _ in range(self.population * 4)]
            pool += [self.space.mutate(c, self.rng) for c in self._best_measured(4) for _ in range(8)]
            ranked = sorted(pool, key=self.space.prior, reverse=True)
            out: list[Config] = []
            # one configuration per tile shape not measured yet: the shapes differ most; ku, packing and loop
            # order refine a shape later (variants of the untuned 6x64 tile filled half the first batch)
            shapes = {self.space.shape_key(c) for c, _ in self.history}
            for c in ranked:
                if len(out) >= n - n_explore:
                    break
                key = self.space.shape_key(c)
                if key not in shapes and self._fresh(c, taken):
                    shapes.add(key)
                    out.append(c)
            return out + self._random(n - len(out), taken)
        pool: dict[str, Config] = {}
        every = self.space.enumerate(4096)
        if every is not None:
            pool = {config_hash(c): c for c in every}
        else:
            for c in self._best_measured(8) + [self.space.sample(self.rng) for _ in range(self.population)]:
                pool[config_hash(c)] = c
            for _ in range(self.generations):
                members = list(pool.values())
                scores = self._score(members)
                elite = [members[k] for k in np.argsort(-scores)[: max(8, self.population // 4)]]
                for _ in range(self.population):
                    if self.rng.random() < 0.7:
                        child = self.space.mutate(self.rng.choice(elite), self.rng, self.rng.choice((1, 1, 2)))
                    else:
                        child = self.space.crossover(self.rng.choice(elite), self.rng.choice(elite), self.rng)
                    pool.setdefault(config_hash(child), child)
                members = list(pool.values())
                keep = np.argsort(-self._score(members))[: self.population * 2]
                pool = {config_hash(members[k]): members[k] for k in keep}
        out = self._local(int(round(n * 0.5 * late)), taken)
        cands = [c for h, c in pool.items() if h not in self.seen]
        order = np.argsort(-self._score(cands))
        per_shape: dict[tuple, int] = {}
        for c in out:
            per_shape[self.space.shape_key(c)] = per_shape.get(self.space.shape_key(c), 0) + 1
        for k in order:  # the model's best, at most two per tile shape in a batch (its variants are close)
            if len(out) >= n - n_explore:
                break
            key = self.space.shape_key(cands[k])
            if per_shape.get(key, 0) < 2 and self._fresh(cands[k], taken):
                per_shape[key] = per_shape.get(key, 0) + 1
                out.append(cands[k])
        return out + self._explore(n - len(out), taken)

    def _explore(self, n: int, taken: set[str]) -> list[Config]:
        """``n`` random configurations, leaving out those the model expects to fail (scored below every correct
        measurement: the model scores failures there), unless too few others are left."""
        if n <= 0:
            return []
        ok = [y for _, y in self.history if y is not None]
        pool = [self.space.sample(self.rng) for _ in range(20 * n + 20)]
        scores = self._score(pool)
        out: list[Config] = []
        for c, sc in zip(pool, scores):
            if len(out) < n and sc >= min(ok) and self._fresh(c, taken):
                out.append(c)
        return out + self._random(n - len(out), taken)

    def _local(self, n: int, taken: set[str]) -> list[Config]:
        """The ``n`` neighbours of the three fastest measured configurations the model ranks highest."""
        if n <= 0:
            return []
        near = {config_hash(c): c for b in self._best_measured(3) for c in self.space.neighbours(b)}
        cands = [c for h, c in near.items() if h not in self.seen and h not in taken]
        out: list[Config] = []
        for k in np.argsort(-self._score(cands)) if cands else []:
            if len(out) < n and self._fresh(cands[k], taken):
                out.append(cands[k])
        return out


STRATEGIES = {"evolutionary": EvolutionarySearch, "random": RandomSearch}
