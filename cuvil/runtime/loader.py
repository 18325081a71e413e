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
        _check_machine(path)
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


_ELF_MACHINES = {3: "x86 (32-bit)", 40: "arm (32-bit)", 62: "x86_64", 183: "aarch64", 243: "riscv"}


def _check_machine(path: str) -> None:
    """Refuse a library built for another CPU (dlopen would say only 'cannot open shared object file')."""
    import platform

    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError as exc:
        raise ArgumentError(f"cannot load the library {path!r}: {exc}") from None
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return  # not ELF (e.g. macOS): let the loader say what it thinks
    machine = int.from_bytes(head[18:20], "little" if head[5] == 1 else "big")
    host = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183}.get(platform.machine().lower())
    if host is not None and machine != host:
        from cuvil.errors import TargetError

        raise TargetError(f"{path} is a library for {_ELF_MACHINES.get(machine, f'ELF machine {machine}')}, "
                          f"not for this {platform.machine()} machine: run it on its target (or under qemu)")


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
