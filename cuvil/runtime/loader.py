"""Load a library written by ``Module.export_library`` (one function, called like a Module) or by
``InferenceSession.export_library`` (a whole model, run like the session).

Uses only ctypes, numpy and json (never llvmlite or islpy): what validates calls is the JSON the
library embeds (``cuvil_module_meta()`` says which kind it is; then ``cuvil_meta_<name>()`` for a
function, ``<prefix>_meta()`` for a model; see cuvil/graph/export/library.py).
"""

from __future__ import annotations

import ctypes
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cuvil.errors import ArgumentError, BoundsError, CuvilError, DTypeError, ShapeError
from cuvil.runtime import threads
from cuvil.runtime.call import CFUNC, CFUNC_CHECKED, CallPlan, NativeFunction, check_feed_names
from cuvil.runtime.meta import ABI_VERSION

MODEL_ABIS = (1, 2)  # cuvil.graph.export.library: MODEL_ABI (fixed shapes), SIZES_ABI (symbolic sizes first); not
# imported: that module needs the compiler


class LoadedModule(NativeFunction):
    """A function from an exported cuvil library."""

    def __init__(self, path: str, name: str | None = None, lib: Any = None):
        self.path = path
        self._lib = _open(path) if lib is None else lib
        names = _read_json(self._lib, "cuvil_module_meta", path).get("functions")
        if names is None:
            raise ArgumentError(f"{path} holds a whole model, not functions: load it with cuvil.runtime.load")
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
        checked = getattr(self._lib, f"{name}_checked", None)  # absent in libraries of older cuvil versions
        if checked is not None and self.meta.get("checks"):
            self._cfunc_checked = CFUNC_CHECKED(ctypes.cast(checked, ctypes.c_void_p).value)
        setter = getattr(self._lib, f"{name}_set_num_threads", None)
        if setter is not None:
            threads.register(self, threads.SETTER(ctypes.cast(setter, ctypes.c_void_p).value))

    def __repr__(self) -> str:
        return f"<cuvil LoadedModule {self.plan.signature()} from {self.path}>"


@dataclass(frozen=True)
class TensorArg:
    """An input or output of a loaded model, as onnxruntime (and cuvil.onnx.NodeArg) describe it."""

    name: str
    shape: list[int]
    type: str


_STATUS = {1: "out of memory (its workspace or a kernel's temporary buffer)", 2: "a NULL input or output pointer",
           3: "no compiled signature for these sizes", 4: "an index out of range"}


class LoadedModel:
    """A model from ``InferenceSession.export_library``: ``run(output_names, feeds)`` like the session.

    Inputs must have the shapes and dtypes the library was compiled for (``get_inputs()``; a
    library of several signatures shows its symbolic sizes by name, like onnxruntime, and picks
    the signature from the fed shapes); a run is one native call that writes every output into
    new numpy arrays.
    """

    def __init__(self, path: str, lib: Any, prefix: str):
        self.path = path
        self._lib = lib
        self.prefix = prefix
        self.meta = _read_json(lib, f"{prefix}_meta", path)
        if self.meta.get("abi") not in MODEL_ABIS or self.meta.get("kind") != "model":
            raise ArgumentError(f"{path} is a cuvil model of ABI {self.meta.get('abi')}; this runtime reads "
                                f"{' and '.join(map(str, MODEL_ABIS))}")
        self._inputs = [(t["name"], _shape(t["shape"]), np.dtype(t["dtype"]), t["type"]) for t in self.meta["inputs"]]
        self._outputs = [(t["name"], _shape(t["shape"]), np.dtype(t["dtype"]), t["type"])
                         for t in self.meta["outputs"]]
        self._sizes = self.meta.get("sizes", [])
        # the sizes' values -> (input shapes, output shapes) of that signature
        self._signatures = {tuple(s["sizes"]): ([tuple(x) for x in s["inputs"]], [tuple(y) for y in s["outputs"]])
                            for s in self.meta.get("signatures", [])}
        self._in_ptrs = ctypes.c_void_p * max(1, len(self._inputs))
        self._out_ptrs = ctypes.c_void_p * max(1, len(self._outputs))
        self._size_values = ctypes.c_int64 * max(1, len(self._sizes))
        self._run = _symbol(lib, f"{prefix}_run_array", path)
        self._run.restype = ctypes.c_int32
        self._run.argtypes = [ctypes.c_void_p] * (4 if self._sizes else 3)
        self._last_error = getattr(lib, f"{prefix}_last_error", None)  # absent in libraries of older versions
        if self._last_error is not None:
            self._last_error.restype, self._last_error.argtypes = ctypes.c_char_p, []
        setter = _symbol(lib, f"{prefix}_set_num_threads", path)
        threads.register(self, threads.SETTER(ctypes.cast(setter, ctypes.c_void_p).value))

    def __repr__(self) -> str:
        ins = ", ".join(f"{n}: {d.name}{list(s)}" for n, s, d, _ in self._inputs)
        outs = ", ".join(f"{n}: {d.name}{list(s) if s is not None else '[?]'}" for n, s, d, _ in self._outputs)
        sigs = f" for {self._compiled_sizes()}" if self._sizes else ""
        return f"<cuvil LoadedModel ({ins}) -> ({outs}){sigs} from {self.path}>"

    def get_inputs(self) -> list[TensorArg]:
        return [TensorArg(n, list(s), t) for n, s, _, t in self._inputs]

    def get_outputs(self) -> list[TensorArg]:
        return [TensorArg(n, list(s) if s is not None else None, t) for n, s, _, t in self._outputs]  # type: ignore

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options: Any = None
            ) -> list[np.ndarray]:
        """The outputs named (all when ``None``), in order, for the fed inputs (one native call)."""
        names = [n for n, *_ in self._outputs]
        if output_names is None:
            output_names = names
        elif isinstance(output_names, str):
            raise ArgumentError(f"output_names must be a list of names or None, got the string {output_names!r}")
        for n in output_names:
            if n not in names:
                raise ArgumentError(f"{n!r} is not an output of the model; outputs: {', '.join(names)}")
        feeds = self._check_feeds(input_feed)
        if self._sizes:
            values = self._signature_of(feeds)
            out_shapes = self._signatures[values][1]
        else:
            out_shapes = [s for _, s, _, _ in self._outputs]
        outs = [np.empty(s, d) for s, (_, _, d, _) in zip(out_shapes, self._outputs)]
        ins = self._in_ptrs(*[a.ctypes.data for a in feeds])
        ptrs = self._out_ptrs(*[a.ctypes.data for a in outs])
        if self._sizes:
            sizes = self._size_values(*values)
            rc = self._run(ctypes.addressof(sizes), ctypes.addressof(ins), ctypes.addressof(ptrs), None)
        else:
            rc = self._run(ctypes.addressof(ins), ctypes.addressof(ptrs), None)
        if rc == 4 and self._last_error is not None:
            raise BoundsError(f"{self.path}: {self._last_error().decode(errors='replace')}")
        if rc:
            raise CuvilError(f"{self.path}: the model failed with status {rc}: {_STATUS.get(rc, 'unknown status')}")
        by_name = dict(zip(names, outs))
        return [by_name[n] for n in output_names]

    def _compiled_sizes(self) -> str:
        """``N=1; N=4``: the sizes of every signature."""
        return "; ".join(", ".join(f"{s['name']}={v}" for s, v in zip(self._sizes, vals))
                         for vals in self._signatures)

    def _signature_of(self, feeds: list[np.ndarray]) -> tuple[int, ...]:
        """The sizes of the fed shapes, which must be those of a compiled signature (else the first
        mistake: a rank, a fixed dimension, a size two inputs disagree on, sizes not compiled)."""
        try:
            values = tuple(int(feeds[s["dims"][0][0]].shape[s["dims"][0][1]]) for s in self._sizes)
        except IndexError:
            values = ()
        sig = self._signatures.get(values)
        if sig is not None and all(a.shape == want for a, want in zip(feeds, sig[0])):
            return values
        symbols: dict[str, tuple[int, str]] = {}
        for (n, shape, _, _), a in zip(self._inputs, feeds):
            if a.ndim != len(shape):
                raise ShapeError(f"input {n!r}: expected rank {len(shape)} {list(shape)}, got shape {list(a.shape)}")
            for d, (want, got) in enumerate(zip(shape, a.shape)):
                if isinstance(want, int) and want != got:
                    raise ShapeError(f"input {n!r}: dimension {d} must be {want}, got {got} (shape {list(a.shape)})")
                if isinstance(want, str):
                    if want in symbols and symbols[want][0] != got:
                        raise ShapeError(f"input {n!r}: dimension {d} ({want}) is {got}, but {want} is "
                                         f"{symbols[want][0]} in input {symbols[want][1]!r}")
                    symbols.setdefault(want, (got, n))
        got = ", ".join(f"{s['name']}={v}" for s, v in zip(self._sizes, values))
        if sig is None:
            fed = ", ".join(f"{n!r} {list(a.shape)}" for (n, *_), a in zip(self._inputs, feeds))
            raise ShapeError(f"{self.path} has no compiled signature for {got} (inputs {fed}); it was compiled "
                             f"for {self._compiled_sizes()}: export it again with input_shapes=[...] that lists "
                             "these sizes too")
        for (n, *_), a, want in zip(self._inputs, feeds, sig[0]):
            if a.shape != want:
                raise ShapeError(f"input {n!r}: the signature {got} has shape {list(want)}, got {list(a.shape)}")
        return values

    def _check_feeds(self, input_feed: Mapping[str, Any]) -> list[np.ndarray]:
        expected = [n for n, *_ in self._inputs]
        check_feed_names(input_feed, expected)
        out = []
        for n, shape, dtype, type_str in self._inputs:
            a = input_feed[n]
            if isinstance(a, np.generic):
                a = np.asarray(a)
            if not isinstance(a, np.ndarray):
                raise ArgumentError(f"input {n!r}: expected a numpy array, got {type(a).__name__}")
            if a.dtype != dtype:
                raise DTypeError(f"input {n!r}: expected {type_str} ({dtype.name}), got {a.dtype.name}; cuvil "
                                 "does not cast inputs")
            if not self._sizes and a.shape != shape:
                raise ShapeError(f"input {n!r}: the library was compiled for shape {list(shape)}, got "
                                 f"{list(a.shape)}; export it again with input_shapes= for other shapes")
            out.append(np.ascontiguousarray(a))
        return out

    def _set_threads(self, n: int) -> None:
        """Tell the native code to use ``n`` threads (called by :mod:`cuvil.runtime.threads`)."""
        setter = getattr(self, "_threads_setter", None)
        if setter is not None:
            setter(n)


def _shape(shape: Any) -> Any:
    """A tensor's shape from the meta: a tuple of ints and size names (``None`` if it has no one form)."""
    return None if shape is None else tuple(shape)


_OPENED: dict[str, tuple[tuple[int, ...], Any]] = {}  # absolute path -> (file identity, library)


def _open(path: str) -> Any:
    """dlopen ``path``; a file rewritten since this process opened it is opened afresh (dlopen would
    hand back the library already loaded under that name: a model exported again would run stale)."""
    _check_machine(path)
    threads.prefer_short_spins()  # before the library's libgomp loads (see there)
    full = os.path.abspath(path)
    st = os.stat(full)
    ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    seen = _OPENED.get(full)
    if seen is not None and seen[0] == ident:
        return seen[1]
    try:
        if seen is None:
            lib = ctypes.CDLL(full)
        else:  # through a copy of another name (removed once loaded: the mapping stays)
            import shutil
            import tempfile

            with tempfile.TemporaryDirectory(prefix="cuvil-load-") as tmp:
                copy = os.path.join(tmp, os.path.basename(full))
                shutil.copyfile(full, copy)
                lib = ctypes.CDLL(copy)
    except OSError as exc:
        raise ArgumentError(f"cannot load the library {path!r}: {exc}") from None
    _OPENED[full] = (ident, lib)
    return lib


def _symbol(lib: Any, symbol: str, path: str) -> Any:
    try:
        return getattr(lib, symbol)
    except AttributeError:
        raise ArgumentError(f"{path} is not a complete cuvil library: it has no symbol {symbol!r}") from None


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


def load(path: str | os.PathLike[str], name: str | None = None) -> LoadedModule | LoadedModel:
    """Load an exported cuvil library: a :class:`LoadedModel` for a model (``InferenceSession.export_library``),
    else a :class:`LoadedModule` (``name`` picks the function if it holds several)."""
    path = os.fspath(path)
    lib = _open(path)
    index = _read_json(lib, "cuvil_module_meta", path)
    if index.get("kind") == "model":
        if name is not None:
            raise ArgumentError(f"{path} holds a whole model, not functions: load it without name=")
        return LoadedModel(path, lib, index["prefix"])
    return LoadedModule(path, name, lib)
