"""What one compilation is asked to do: a frozen :class:`CompileOptions` that every entry point builds
(``cuvil.onnx.InferenceSession``, ``cuvil.torch.compile``, ``torch.compile(backend="cuvil")``, the CLI,
``cuvil bench``, ``cuvil tune``) and hands down to the graph compiler, the op builders and the scheduler::

    opts = CompileOptions(target="llvm -mcpu=x86-64-v3", precision="fp32", winograd=False)
    sess = cuvil.onnx.InferenceSession("model.onnx", options=opts)
    opts.key()      # what the kernel caches are keyed by (the thresholds included)
    print(opts)     # every field, the thresholds as the target derives them

The scheduler's thresholds (:class:`cuvil.schedule.heuristics.Heuristics`) are derived from the
target's facts unless ``heuristics`` gives them; tests and experiments change a threshold with
``opts.with_heuristics(winograd_min_tiles=1)``, never by setting a module global.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from cuvil.errors import ArgumentError

PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class CompileOptions:
    """One compilation's settings.

    - ``target``: a target string (``"llvm"``: this host; see :class:`cuvil.target.Target`);
    - ``precision``: ``"fp32"`` or ``"bf16"`` (contractions with constant weights in bfloat16, docs/precision.md);
    - ``bounds_checks``: run-time checks of indices read from inputs (a Gather's), docs/onnx.md;
    - ``winograd``: 3x3 convolutions that pay as Winograd F(2x2, 3x3); False: every convolution direct;
    - ``fuse``: one kernel per fusion group (False: one per node);
    - ``passes``: the graph passes to run, by name (``cuvil.graph.passes.PASSES``); None: all of them;
    - ``tuning_db``: a tuning database (path or ``cuvil.autotune.Database``) whose best records replace the
      automatic schedules;
    - ``heuristics``: the scheduler's thresholds; None: derived from the target (:meth:`resolved` fills it);
    - ``check_schedules``: isl proves the automatic scheduler's strategies legal although they are legal by
      construction (a debug mode, slower: ``auto_schedule(..., prove=True)``);
    - ``jobs``: worker processes that lower kernels and make their machine code (cuvil/graph/parallel.py);
      None: one per core; 1: all in this process.  The kernels are the same either way (not in :meth:`key`).
    """

    target: str = "llvm"
    precision: str = "fp32"
    bounds_checks: bool = True
    winograd: bool = True
    fuse: bool = True
    passes: tuple[str, ...] | None = None
    tuning_db: Any = None
    heuristics: Any = None  # cuvil.schedule.heuristics.Heuristics | None
    check_schedules: bool = False
    jobs: int | None = None

    def __post_init__(self) -> None:
        from cuvil.target import Target

        t = self.target
        if not isinstance(t, (str, Target)):
            raise ArgumentError(f"CompileOptions.target must be a target string, got {type(t).__name__}")
        object.__setattr__(self, "target", t.canonical if isinstance(t, Target) else t)
        if self.precision not in PRECISIONS:
            raise ArgumentError(f"CompileOptions.precision must be one of {', '.join(map(repr, PRECISIONS))}, got "
                                f"{self.precision!r}")
        for name in ("bounds_checks", "winograd", "fuse", "check_schedules"):
            if not isinstance(getattr(self, name), bool):
                raise ArgumentError(f"CompileOptions.{name} must be a bool, got {getattr(self, name)!r}")
        if self.passes is not None:
            object.__setattr__(self, "passes", tuple(self.passes))
        if self.jobs is not None and (not isinstance(self.jobs, int) or isinstance(self.jobs, bool) or self.jobs < 1):
            raise ArgumentError(f"CompileOptions.jobs must be a positive int or None, got {self.jobs!r}")
        db = self.tuning_db
        if db is not None and not isinstance(db, (str, os.PathLike)) and not hasattr(db, "best"):
            raise ArgumentError(f"tuning_db must be a path or a cuvil.autotune.Database, got {type(db).__name__}")
        if self.heuristics is not None:
            from cuvil.schedule.heuristics import Heuristics

            if not isinstance(self.heuristics, Heuristics):
                raise ArgumentError("CompileOptions.heuristics must be a cuvil.schedule.heuristics.Heuristics, got "
                                    f"{type(self.heuristics).__name__}")

    @classmethod
    def of(cls, options: CompileOptions | str | Any = None, **given: Any) -> CompileOptions:
        """``options`` (a CompileOptions, a target string or Target, or None) with the fields in ``given``
        that are not None replacing its own: how entry points with their own keyword arguments build one."""
        if options is None:
            base = cls()
        elif isinstance(options, CompileOptions):
            base = options
        else:
            base = cls(target=options)
        given = {k: v for k, v in given.items() if v is not None}
        unknown = set(given) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ArgumentError(f"unknown compile option(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(base, **given) if given else base

    def replace(self, **changes: Any) -> CompileOptions:
        return dataclasses.replace(self, **changes)

    def resolved(self) -> CompileOptions:
        """These options with the thresholds filled in from the target (when not given)."""
        if self.heuristics is not None:
            return self
        from cuvil.schedule.heuristics import Heuristics

        return dataclasses.replace(self, heuristics=Heuristics.for_target(self.target))

    def with_heuristics(self, **changes: Any) -> CompileOptions:
        """These options with some thresholds changed (the others as the target derives them)."""
        h = self.resolved().heuristics
        return dataclasses.replace(self, heuristics=h.replace(**changes))

    def key(self) -> tuple:
        """What the kernel caches are keyed by: the target, the settings that change generated code and
        every threshold (a different threshold may make a different kernel).  The tuning database is
        keyed where it is read (its file's identity and last change)."""
        from cuvil.target import Target

        h = self.resolved().heuristics
        proofs = ("proved",) if self.check_schedules else ()  # (a strategy isl refused would change a kernel)
        return (Target(self.target).canonical, self.precision, self.bounds_checks, self.winograd) + proofs + h.key()

    def __str__(self) -> str:
        h = self.resolved().heuristics
        fields = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.name != "heuristics"]
        return "CompileOptions(" + ", ".join(fields) + f",\n  heuristics={h})"
