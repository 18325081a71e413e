"""The runtime: callable compiled modules, exported-library loading, timers.

``Module`` (compile in this process, needs llvmlite) and ``load`` (run an
exported ``.so``, needs only ctypes and numpy) are imported on first use, so
``import cuvil.runtime`` imports nothing heavy.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LoadedModel", "LoadedModule", "Module", "load"]


def __getattr__(name: str) -> Any:
    if name == "Module":
        from cuvil.runtime.module import Module

        return Module
    if name in ("load", "LoadedModule", "LoadedModel"):
        from cuvil.runtime import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'cuvil.runtime' has no attribute {name!r}")
