"""A package's names imported on first use: ``import cuvil`` (and ``cuvil.autotune``, ``cuvil.llm``) stays
light, and each name loads its module only when a program asks for it.

    _LAZY = {"build": ("cuvil.pipeline", "build"), "te": ("cuvil.te", None)}   # None: the module itself
    __getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(package: str, table: Mapping[str, tuple[str, str | None]]
                    ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package`` for the names of ``table`` (name ->
    (module, attribute of it or None for the module itself)); a name once loaded is kept in the package."""
    namespace = vars(sys.modules[package])

    def __getattr__(name: str) -> Any:
        if name in table:
            mod, attr = table[name]
            m = importlib.import_module(mod)
            value = m if attr is None else getattr(m, attr)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(list(namespace) + list(table))

    return __getattr__, __dir__
