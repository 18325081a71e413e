"""Code generators: loop IR -> native code.

``cuvil.codegen.llvm`` (CPU, through llvmlite) is imported on first use, so
``import cuvil.codegen`` stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["codegen_llvm", "optimize"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from cuvil.codegen import llvm

        return getattr(llvm, name)
    raise AttributeError(f"module 'cuvil.codegen' has no attribute {name!r}")
