"""External tools some tests need (cross compiler, qemu, ptxas, NVRTC): found, or skipped with the reason.

Under ``CI=true`` a missing tool fails the test instead: CI installs every tool (.ci/run), so a skip
there would hide a broken install step.
"""

from __future__ import annotations

import importlib
import os
import shutil
from typing import Any

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"


def missing(reason: str) -> None:
    """Skip (locally) or fail (under CI=true) because a tool is missing."""
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: .ci/run must install it)")
    pytest.skip(reason)


def require(tool: str, install: str) -> str:
    """The path of ``tool`` on PATH, or skip/fail saying how to install it."""
    path = shutil.which(tool)
    if path is None:
        missing(f"{tool} is not on PATH ({install})")
    return path  # type: ignore[return-value]


def module(name: str, install: str = "pip install -e '.[test]'") -> Any:
    """The Python module ``name`` (onnx, onnxruntime, ...), or skip/fail saying how to install it: the
    CI-aware form of ``pytest.importorskip``."""
    try:
        return importlib.import_module(name)
    except ImportError:
        missing(f"{name} is not installed ({install})")
