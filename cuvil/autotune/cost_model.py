"""The cost model: gradient-boosted regression trees in numpy, refitted as measurements arrive.

It predicts a score (higher = faster: minus the log of the time) from the features of
:meth:`cuvil.autotune.space.Space.features`.  The search only needs the order of
candidates, so the model is small: ``rounds`` trees of depth ``depth``, each fitted to
the residuals of the ones before, each split the best of all cuts between distinct values.  Fitting a few
hundred points takes milliseconds.
"""

from __future__ import annotations

import numpy as np


class _Tree:
    """A regression tree stored as nested tuples: ``(feature, threshold, left, right)`` or a leaf value."""

    def __init__(self, depth: int, min_leaf: int):
        self.depth, self.min_leaf = depth, min_leaf
        self.root: object = 0.0

    def fit(self, x: np.ndarray, r: np.ndarray) -> _Tree:
        self.root = self._grow(x, r, self.depth)
        return self

    def _grow(self, x: np.ndarray, r: np.ndarray, depth: int) -> object:
        if depth == 0 or len(r) < 2 * self.min_leaf:
            return float(r.mean()) if len(r) else 0.0
        best = None
        base = ((r - r.mean()) ** 2).sum()
        n = len(r)
        k = np.arange(1, n)  # left sizes
        for f in range(x.shape[1]):
            order = np.argsort(x[:, f], kind="stable")
            col, rs = x[order, f], r[order]
            cs, cs2 = np.cumsum(rs), np.cumsum(rs * rs)
            tot, tot2 = cs[-1], cs2[-1]
            left_s, left_s2 = cs[:-1], cs2[:-1]
            sse = (left_s2 - left_s ** 2 / k) + ((tot2 - left_s2) - (tot - left_s) ** 2 / (n - k))
            ok = (col[:-1] < col[1:]) & (k >= self.min_leaf) & (n - k >= self.min_leaf)
            if not ok.any():
                continue
            sse = np.where(ok, sse, np.inf)
            j = int(np.argmin(sse))
            if best is None or sse[j] < best[0]:
                best = (float(sse[j]), f, float((col[j] + col[j + 1]) / 2))
        if best is None or best[0] >= base - 1e-12:
            return float(r.mean())
        _, f, t = best
        left = x[:, f] <= t
        return (f, t, self._grow(x[left], r[left], depth - 1), self._grow(x[~left], r[~left], depth - 1))

    def predict(self, x: np.ndarray) -> np.ndarray:
        out = np.empty(len(x))
        for n in range(len(x)):
            node = self.root
            while isinstance(node, tuple):
                f, t, lo, hi = node
                node = lo if x[n, f] <= t else hi
            out[n] = node  # type: ignore[assignment]
        return out


class BoostedTrees:
    """Least-squares gradient boosting of small trees."""

    def __init__(self, rounds: int = 40, depth: int = 3, rate: float = 0.2, min_leaf: int = 2):
        self.rounds, self.depth, self.rate, self.min_leaf = rounds, depth, rate, min_leaf
        self.trees: list[_Tree] = []
        self.base = 0.0

    def fit(self, x: np.ndarray, y: np.ndarray) -> BoostedTrees:
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        self.base = float(y.mean()) if len(y) else 0.0
        self.trees = []
        pred = np.full(len(y), self.base)
        for _ in range(self.rounds if len(y) >= 2 * self.min_leaf else 0):
            tree = _Tree(self.depth, self.min_leaf).fit(x, y - pred)
            step = tree.predict(x)
            if not np.any(step):
                break
            self.trees.append(tree)
            pred += self.rate * step
        return self

    def predict(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        out = np.full(len(x), self.base)
        for t in self.trees:
            out += self.rate * t.predict(x)
        return out
