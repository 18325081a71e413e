"""``@cuvil.compile``: a Python function over te tensors, called with numpy arrays.

    @cuvil.compile(target="llvm", opt_level=2)
    def gelu(x):
        return te.compute(x.shape, lambda *i: 0.5 * x[i] * (1 + te.erf(x[i] * 0.7071067811865476)))

    y = gelu(np.random.rand(128, 768).astype("float32"))

Each call with a new signature (shapes, dtypes) traces placeholders of those
shapes and dtypes, schedules the result (``auto_schedule``, or the te order at
``opt_level=0``), builds it once and caches the module; later calls with that
signature only run it.  The function returns one output tensor or a tuple, and
the call returns new numpy arrays the same way.

Called with torch tensors, the same decorator compiles a function written with
torch operations through the PyTorch front end (:func:`cuvil.torch.compile`),
once per signature, and returns what the function returns, as torch tensors::

    @cuvil.compile(target="llvm", opt_level=2)
    def matmul_relu(x, w):
        return torch.relu(torch.matmul(x, w))
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from cuvil.errors import ArgumentError


class CompiledFunction:
    """The callable that ``@cuvil.compile`` returns."""

    def __init__(self, fn: Callable[..., Any], target: str, opt_level: int):
        if opt_level not in (0, 1, 2, 3):
            raise ArgumentError(f"cuvil.compile: opt_level must be 0..3, got {opt_level!r}")
        self.fn = fn
        self.target = target
        self.opt_level = opt_level
        self.cache: dict[tuple, tuple[Any, list[tuple[tuple[int, ...], str]], bool]] = {}
        try:
            self.names = [p.name for p in inspect.signature(fn).parameters.values()]
        except (TypeError, ValueError):  # pragma: no cover - builtins
            self.names = []
        functools.update_wrapper(self, fn)

    def _signature(self, arrays: tuple[Any, ...]) -> tuple:
        from cuvil.runtime.threads import get_num_threads
        from cuvil.target import Target

        for k, a in enumerate(arrays):
            if not isinstance(a, np.ndarray):
                raise ArgumentError(
                    f"{self.fn.__name__}: argument {k} is a {type(a).__name__}; call it with numpy arrays"
                )
        return (tuple((a.shape, a.dtype.name) for a in arrays), Target(self.target).canonical, get_num_threads(),
                self.opt_level)

    def _compile(self, arrays: tuple[np.ndarray, ...]) -> tuple[Any, list[tuple[tuple[int, ...], str]], bool]:
        import cuvil
        from cuvil import te
        from cuvil.schedule.axes import const_int

        names = self.names if len(self.names) == len(arrays) else [f"arg{k}" for k in range(len(arrays))]
        phs = [te.placeholder(a.shape, dtype=a.dtype.name, name=n) for a, n in zip(arrays, names)]
        result = self.fn(*phs)
        single = not isinstance(result, (tuple, list))
        outs = [result] if single else list(result)
        for k, o in enumerate(outs):
            if not isinstance(o, te.Tensor) or isinstance(o.op, te.PlaceholderOp):
                raise ArgumentError(f"{self.fn.__name__} must return computed te tensors; result {k} is {o!r}")
        args = phs + outs
        s = cuvil.auto_schedule(args, self.target) if self.opt_level > 0 else te.create_schedule(outs)
        module = cuvil.build(s, args, target=self.target, name=_c_name(self.fn.__name__))
        shapes = [(tuple(const_int(d) for d in o.shape), o.dtype) for o in outs]
        return module, shapes, single  # type: ignore[return-value]

    def __call__(self, *arrays: Any, **kwargs: Any) -> Any:
        if kwargs or any(_is_torch_tensor(a) for a in arrays):
            return self._torch_call(arrays, kwargs)
        key = self._signature(arrays)
        if key not in self.cache:
            self.cache[key] = self._compile(arrays)
        module, shapes, single = self.cache[key]
        outs = [np.empty(shape, dtype) for shape, dtype in shapes]
        module(*arrays, *outs)
        return outs[0] if single else tuple(outs)

    def _torch_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Compile (once per signature) and run the function through the PyTorch front end."""
        import cuvil.torch
        from cuvil.runtime.threads import get_num_threads
        from cuvil.target import Target

        def sig(v: Any) -> Any:
            return (tuple(v.shape), str(v.dtype)) if _is_torch_tensor(v) else (type(v).__name__, repr(v))

        key = ("torch", tuple(sig(a) for a in args), tuple(sorted((k, sig(v)) for k, v in kwargs.items())),
               Target(self.target).canonical, get_num_threads())
        if key not in self.cache:
            self.cache[key] = cuvil.torch.compile(self.fn, args, kwargs, target=self.target)  # type: ignore[assignment]
        return self.cache[key](*args, **kwargs)  # type: ignore[operator]

    def lowered(self, *arrays: Any) -> str:
        """The loops compiled for these arguments' signature (compiling them if needed)."""
        key = self._signature(arrays)
        if key not in self.cache:
            self.cache[key] = self._compile(arrays)
        return self.cache[key][0].get_source("loops")


def _is_torch_tensor(a: Any) -> bool:
    """Whether ``a`` is a torch.Tensor (without importing torch)."""
    return any(c.__module__.startswith("torch") and c.__name__ == "Tensor" for c in type(a).__mro__)


def _c_name(name: str) -> str:
    import re

    out = re.sub(r"\W", "_", name) or "main"
    return out if not out[0].isdigit() else "_" + out


def compile(fn: Callable[..., Any] | None = None, *, target: str = "llvm",  # noqa: A001
            opt_level: int = 2) -> Any:
    """Decorator: ``@cuvil.compile`` or ``@cuvil.compile(target="llvm", opt_level=2)``."""
    if fn is not None:
        return CompiledFunction(fn, target, opt_level)
    return lambda f: CompiledFunction(f, target, opt_level)
