"""Load a library written by ``Module.export_library`` and call it like a Module.

Uses only ctypes, numpy and json (never llvmlite or islpy): the signature that
validates calls is the JSON the library embeds (``cuvil_meta_<name>()``).
"""

from __future__ import annotations

import ctypes
import json
import os
from typing import Any

from cuvil.errors import ArgumentError
from cuvil.runtime import threads
from cuvil.runtime.call import CFUNC, CallPlan, NativeFunction
from cuvil.runtime.meta import ABI_VERSION


class LoadedModule(NativeFunction):
    """A function from an exported cuvil library."""

    def __init__(self, path: str, name: str | None = None):
        self.path = path
        try:
            self._lib = ctypes.CDLL(os.path.abspath(path))
        except OSError as exc:
            raise ArgumentError(f"cannot load the library {path!r}: {exc}") from None
        names = _read_json(self._lib, "cuvil_module_meta", path)["functions"]
        if name is None:
            if len(names) != 1:
                raise ArgumentError(f"{path} defines {len(names)} functions ({', '.join(names)}); pass name=")
            name = names[0]
        if name not in names:
            raise ArgumentError(f"{path} has no cuvil function {name!r}; it defines {', '.join(names)}")
        self.meta = _read_json(self._lib, f"cuvil_meta_{name}", path)
        if self.meta.get("abi") != ABI_VERSION:
            raise ArgumentError(f"{path} uses cuvil ABI {self.meta.get('abi')}, this runtime reads {ABI_VERSION}")
        self.plan = CallPlan(self.meta)
        self._cfunc = CFUNC(ctypes.cast(getattr(self._lib, name), ctypes.c_void_p).value)
        setter = getattr(self._lib, f"{name}_set_num_threads", None)
        if setter is not None:
            threads.register(self, threads.SETTER(ctypes.cast(setter, ctypes.c_void_p).value))

    def __repr__(self) -> str:
        return f"<cuvil LoadedModule {self.plan.signature()} from {self.path}>"


def _read_json(lib: Any, symbol: str, path: str) -> Any:
    try:
        fn = getattr(lib, symbol)
    except AttributeError:
        raise ArgumentError(f"{path} is not a cuvil library: it has no symbol {symbol!r}") from None
    fn.restype = ctypes.c_char_p
    fn.argtypes = []
    return json.loads(fn().decode())


def load(path: str | os.PathLike[str], name: str | None = None) -> LoadedModule:
    """Load an exported cuvil library; ``name`` picks the function if it holds several."""
    return LoadedModule(os.fspath(path), name)
