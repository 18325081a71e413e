"""Faulty build and call functions for tests/autotune/test_autotune_measure.py (module level: the tuner's
worker processes import them by name)."""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

from cuvil.autotune.worker import build_library, call_module

SEGFAULT, HANG, EXIT_IN_BUILD = 1, 2, 3  # trial numbers (trial 0 is the untuned reference)


def faulty_build(args: Any, target: str, config: Any, path: str, trial: int) -> Any:
    if trial == EXIT_IN_BUILD:
        os._exit(7)
    return build_library(args, target, config, path, trial)


def faulty_call(module: Any, arrays: Any, trial: int) -> None:
    if trial == SEGFAULT:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    if trial == HANG:
        while True:
            time.sleep(0.01)
    call_module(module, arrays, trial)


def wrong_call(module: Any, arrays: Any, trial: int) -> None:
    call_module(module, arrays, trial)
    if trial >= 1:
        arrays[-1][0, 0] += 1.0  # a candidate whose output is wrong
