"""One model, compiled per signature: what a session, ``cuvil bench`` and ``cuvil compile`` share.

    mc = ModelCompiler(graph, CompileOptions(target="llvm -mcpu=x86-64-v3"))   # the graph passes, once
    prog = mc.program({"x": (1, 3, 224, 224)})             # a CompiledGraph, cached by signature
    prog = mc.program(shapes, values=feeds)                # inputs whose value decides a shape: specialised
    mc.for_feeds(feeds)                                    # the same, shapes taken from the arrays

A signature is the runtime inputs' shapes and the values of the inputs the model is specialised on.  When
a builder needs the value of a fed input (a Reshape's shape computed from it), the driver adds that input
to the specialised set and compiles again with its value; without values at hand :meth:`program` returns
None (a session then compiles on its first run).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from cuvil.errors import ShapeError
from cuvil.graph.ir import Graph
from cuvil.options import CompileOptions

__all__ = ["ModelCompiler"]


# signatures whose programs a compiler keeps: a session fed ever new shapes (a dynamic sequence length) compiles
# one program per shape; the least recently used beyond these are dropped (compiled again if they come back)
MAX_PROGRAMS = 64


def _programs() -> Any:
    from cuvil.cache import BoundedCache

    return BoundedCache("cuvil.graph.driver.ModelCompiler._cache", MAX_PROGRAMS)


class ModelCompiler:
    """The graph passes of ``options`` run once over ``graph``; then one :class:`CompiledGraph` per signature.

    ``dump(name, graph)`` sees the graph after each pass; ``on_compiled(prog)`` is called once per new
    program (a session sets its thread count there).  Thread-safe: one compilation at a time."""

    def __init__(self, graph: Graph, options: CompileOptions | Any = None, dump: Any = None,
                 on_compiled: Callable[[Any], None] | None = None):
        from cuvil.graph.compile import prepare

        self.options = CompileOptions.of(options).resolved()
        self.graph = prepare(graph, dump=dump, passes=self.options.passes)
        self.specialised: set[str] = set()  # inputs whose values the programs are specialised on
        self.on_compiled = on_compiled
        self._cache = _programs()
        self._lock = threading.Lock()

    def state(self) -> dict[str, Any]:
        """What :meth:`restore` needs: the prepared graph, the specialised inputs and the programs (a session
        image, cuvil/graph/images.py)."""
        return {"graph": self.graph, "specialised": set(self.specialised), "programs": dict(self._cache)}

    @classmethod
    def restore(cls, state: dict[str, Any], options: CompileOptions) -> ModelCompiler:
        """A compiler over the prepared graph and programs of :meth:`state` (compiled with ``options``)."""
        self = cls.__new__(cls)
        self.options = CompileOptions.of(options).resolved()
        self.graph = state["graph"]
        self.specialised = set(state["specialised"])
        self.on_compiled = None
        self._cache = _programs()
        self._cache.update(state["programs"])
        self._lock = threading.Lock()
        return self

    def program(self, shapes: Mapping[str, tuple[int, ...]], values: Mapping[str, np.ndarray] | None = None,
                progress: Any = None) -> Any:
        """The program for inputs of ``shapes``; ``values`` (the fed arrays, where there are some) give the
        values of the inputs that decide a shape.  None when such a value is needed and not given."""
        from cuvil.graph.compile import compile_graph
        from cuvil.graph.ops.base import NeedsValue

        with self._lock:
            while True:
                if self.specialised and values is None:
                    return None
                known = {n: np.asarray(values[n]) for n in sorted(self.specialised)} if values is not None else {}
                key = (tuple(sorted((n, tuple(s)) for n, s in shapes.items())),
                       tuple((n, v.dtype.str, v.shape, v.tobytes()) for n, v in known.items()))
                if key in self._cache:
                    return self._cache[key]
                runtime = {n: tuple(s) for n, s in shapes.items() if n not in known}
                try:
                    prog = compile_graph(self.graph, runtime, known, self.options, progress=progress)
                except NeedsValue as nv:
                    more = set(nv.inputs) - set(known)
                    if not more or (values is not None and not more <= set(values)):
                        raise ShapeError(str(nv)) from None
                    self.specialised |= more
                    continue  # with the values (or None without them)
                if self.on_compiled is not None:
                    self.on_compiled(prog)
                self._cache[key] = prog
                return prog

    def for_feeds(self, feeds: Mapping[str, np.ndarray], progress: Any = None) -> Any:
        """The program for these fed arrays (their shapes, and the values of the inputs that decide shapes)."""
        return self.program({n: np.shape(a) for n, a in feeds.items()}, feeds, progress=progress)

    def programs(self) -> list[tuple[dict[str, tuple[int, ...]], bool, Any]]:
        """Each program compiled so far: (its input shapes, whether it is specialised on values, it)."""
        return [(dict(shapes), bool(values), prog) for (shapes, values), prog in self._cache.items()]
