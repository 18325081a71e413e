"""In-process caches stay bounded: cuvil.cache.BoundedCache forgets its least recently used entry, every
module-level cache is one (with the owner and limit cuvil/cache.py lists), and the graph compiler's
caches (kernels, folding modules, packed weights) keep the most recent entries past their limits."""

from __future__ import annotations

import ast
import gc
import pathlib
import re

import numpy as np
import pytest

from cuvil.cache import BoundedCache
from cuvil.errors import ArgumentError

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_a_bounded_cache_forgets_the_least_recently_used():
    c = BoundedCache("test", 3)
    for k in "abcde":
        c[k] = k.upper()
    assert len(c) == 3 and list(c) == ["c", "d", "e"]  # the two oldest went
    assert c["c"] == "C"  # a read is a use: "c" is now the most recent
    c["f"] = "F"
    assert list(c) == ["e", "c", "f"]
    assert "e" in c and list(c) == ["e", "c", "f"]  # a membership test is not a use
    assert c.get("e") == "E" and list(c) == ["c", "f", "e"]
    c["c"] = "C2"  # a write is a use
    assert list(c) == ["f", "e", "c"] and c["c"] == "C2"
    assert c.get("zz") is None and c.get("zz", 7) == 7 and c.pop("zz", None) is None
    assert c.pop("f") == "F" and len(c) == 2
    del c["e"]
    assert dict(c) == {"c": "C2"}
    c.clear()
    assert len(c) == 0 and repr(c) == "BoundedCache('test', 0/3 entries)"
    with pytest.raises(KeyError):
        c["nothing"]


@pytest.mark.parametrize("bad", [0, -1, 2.5, None])
def test_a_bounded_cache_needs_a_positive_limit(bad):
    with pytest.raises(ArgumentError, match="max_entries"):
        BoundedCache("test", bad)


# -- every module-level cache has an owner and a limit ------------------------------------------------


def _module_level_state():
    """(owner, limit or None) of each module-level name under cuvil/ bound to an empty mutable container or
    a BoundedCache (a dict filled as the process runs)."""
    found = []
    for path in sorted((ROOT / "cuvil").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            v = node.value
            call = v.func.attr if isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) else (
                v.func.id if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) else None)
            if call == "BoundedCache":
                assert isinstance(v.args[0], ast.Constant) and isinstance(v.args[1], ast.Constant), ast.dump(v)
                found += [(f"{module}.{n}", v.args[0].value, v.args[1].value) for n in names]
            elif (isinstance(v, (ast.Dict, ast.List, ast.Set)) and not getattr(v, "keys", getattr(v, "elts", None))
                  ) or (call in ("dict", "list", "set", "OrderedDict", "defaultdict") and not v.args):
                found += [(f"{module}.{n}", None, None) for n in names]
    return found


def test_every_module_level_cache_is_bounded_and_listed():
    import cuvil.cache

    doc = cuvil.cache.__doc__
    state = _module_level_state()
    assert any(owner == "cuvil.graph.compile._KERNELS" for owner, _, _ in state)
    bad = []
    for owner, name, limit in state:
        if limit is None:
            if f"``{owner}``" not in doc:
                bad.append(f"{owner}: module-level state that is neither a BoundedCache nor listed in cuvil/cache.py "
                           "as not a cache")
            continue
        if name != owner:
            bad.append(f"{owner}: its BoundedCache is named {name!r}")
        if not re.search(rf"``{re.escape(owner)}``\s+{limit}\s", doc):
            bad.append(f"{owner}: cuvil/cache.py does not list it with its limit {limit}")
    assert not bad, "\n".join(bad)


def test_the_caches_have_their_limits():
    from cuvil.codegen import llvm
    from cuvil.graph import compile as gc_
    from cuvil.graph.ops.nn import matmul as nn
    from cuvil.schedule import bounds

    for cache, limit in [(gc_._KERNELS, 1024), (gc_._FOLDERS, 16), (nn._PANELS, 1024), (bounds._PROVED, 256),
                         (llvm._MACHINES, 32)]:
        assert isinstance(cache, BoundedCache) and cache.max_entries == limit, cache


# -- the graph compiler's caches past their limits ----------------------------------------------------


def test_kernels_stay_bounded_and_clear_kernels_empties_them():
    from cuvil.graph import compile as gc_

    saved = list(gc_._KERNELS.items())
    try:
        limit = gc_._KERNELS.max_entries
        for k in range(limit + 10):
            gc_._KERNELS[("test", k)] = (f"func{k}", None)
        assert len(gc_._KERNELS) == limit
        assert ("test", 9) not in gc_._KERNELS and ("test", 10) in gc_._KERNELS  # the oldest ten went
        assert gc_._KERNELS[("test", limit + 9)] == (f"func{limit + 9}", None)
        gc_.clear_kernels()
        assert len(gc_._KERNELS) == 0 and len(gc_._FOLDERS) == 0
    finally:
        gc_.clear_kernels()
        for k, v in saved:
            gc_._KERNELS[k] = v


class _Kernel(int):
    """Stands in for a kernel's loop IR: a number, and no workspace."""

    workspace = ()


class _FakeModule:
    """Stands in for a JIT module (no LLVM): fills its outputs with the kernel's number."""

    built: list[int] = []

    def __init__(self, func, target):
        self.func = func
        _FakeModule.built.append(func)

    def __call__(self, *arrays):
        arrays[-1][...] = self.func


def test_folding_keeps_few_modules(monkeypatch):
    from cuvil.graph import compile as gc_
    from cuvil.runtime import module
    from cuvil.target import Target

    monkeypatch.setattr(module, "Module", _FakeModule)
    monkeypatch.setattr(gc_, "_FOLDERS", BoundedCache("cuvil.graph.compile._FOLDERS", gc_._FOLDERS.max_entries))
    _FakeModule.built = []
    limit = gc_._FOLDERS.max_entries
    funcs = [_Kernel(k) for k in range(limit + 4)]  # stand-ins for kernels: distinct objects, distinct ids
    host = Target("llvm")
    for f in funcs:
        out = gc_._fold(f, [np.zeros(2, np.float32)], [((2,), "float32")], host)
        assert (out[0] == f).all()
    assert len(gc_._FOLDERS) == limit and len(_FakeModule.built) == limit + 4
    gc_._fold(funcs[-1], [], [((1,), "float32")], host)  # a recent kernel: its module is reused
    assert len(_FakeModule.built) == limit + 4
    gc_._fold(funcs[0], [], [((1,), "float32")], host)  # the oldest was forgotten: built again
    assert len(_FakeModule.built) == limit + 5 and len(gc_._FOLDERS) == limit


class _Ctx:
    def __init__(self):
        from cuvil.target import Target

        self.target = Target("llvm")

    def constant(self, a, keyed=True):
        return a


def test_packed_weights_are_shared_bounded_and_leave_with_their_array(monkeypatch):
    from cuvil.graph.ops.nn import matmul as nn

    monkeypatch.setattr(nn, "_PANELS", BoundedCache("cuvil.graph.ops.nn.matmul._PANELS", 2))
    ctx = _Ctx()
    ws = [np.random.default_rng(k).standard_normal((8, 64)).astype(np.float32) for k in range(3)]
    assert nn._weight_panels(ctx, ws[0], ws[0], "w") is not None
    first = next(iter(nn._PANELS.values()))[1]
    nn._weight_panels(ctx, ws[0], ws[0], "w")
    assert len(nn._PANELS) == 1 and next(iter(nn._PANELS.values()))[1] is first  # packed once, shared
    for w in ws[1:]:
        nn._weight_panels(ctx, w, w, "w")
    assert len(nn._PANELS) == 2  # the oldest went
    assert all(ref() is w for (ref, _), w in zip(nn._PANELS.values(), ws[1:]))
    del w, ws[1:]
    gc.collect()
    assert len(nn._PANELS) == 0  # each entry left with its array
