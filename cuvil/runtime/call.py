"""Calling native code: argument validation and packing, with a small per-call cost.

A :class:`CallPlan` is built once from a function's metadata (see
:mod:`cuvil.runtime.meta`): for every dimension of every buffer argument it
decides whether the dimension is a constant to compare, binds a size variable,
or checks one bound earlier.  The plan is unrolled into a straight-line Python
function (``plan.pack``; ``plan.pack_source()`` shows it) that checks a call's
arguments and fills the two native arrays of the ABI::

    int32_t name(void **args, int64_t *sizes);

When anything is off, the slow path :meth:`CallPlan.diagnose` finds the first
problem and raises an error naming the argument (name and position), the
dimension, what was expected and what was given.

Only ctypes, numpy and cuvil.errors are imported here: a module loaded from an
exported library needs neither llvmlite nor islpy.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cuvil.errors import ArgumentError, BoundsError, DTypeError, ShapeError
from cuvil.runtime.meta import eval_dim

_ndarray = np.ndarray
_CONST, _BIND, _CHECK = 0, 1, 2
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
CFUNC = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p)  # (void **args, int64_t *sizes)
# (void **args, int64_t *sizes, int64_t err[3]): err says which bounds check failed (status 4)
CFUNC_CHECKED = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
ErrorRecord = ctypes.c_int64 * 3  # [site, value, call]: zero until a check fails
BOUNDS_STATUS = 4


def bounds_message(checks: Sequence[Mapping[str, Any]], err: Any, sizes: Mapping[str, int] | None = None) -> str:
    """What a failed bounds check found, from the function's ``checks`` (its metadata) and the error
    record ``err`` ([site, value, call]); ``sizes`` are the call's size values (for a check on sizes)."""
    site, value = int(err[0]), int(err[1])
    if not 1 <= site <= len(checks):
        return f"a bounds check failed (site {site}, value {value})"
    c = checks[site - 1]
    if c["kind"] == "sizes":
        here = ", ".join(f"{k} = {v}" for k, v in (sizes or {}).items())
        return f"{c['what']}" + (f" (here {here})" if here else "")
    n = c["extent"]
    valid = f"-{n} .. {n} - 1" if c["wrap"] else f"0 .. {n} - 1"
    if n.lstrip("-").isdigit():
        valid = f"{-int(n)} .. {int(n) - 1}" if c["wrap"] else f"0 .. {int(n) - 1}"
    return f"index {value} is out of range for {c['what']} (size {n}; valid {valid})"


def _pointer_expression() -> str:
    """How generated code reads an array's data pointer (a format string for the array's name).

    ``PyArrayObject`` starts with ``PyObject_HEAD`` and then ``char *data`` (numpy's
    stable C ABI: what ``PyArray_DATA`` reads).  Reading that field through ctypes is
    ~6x faster than ``a.ctypes.data``; it is checked here on a few arrays, and the
    public spelling is used if it ever disagrees.
    """
    offset = object.__basicsize__
    read = ctypes.c_void_p.from_address
    probes = [np.zeros(3), np.arange(10, dtype=np.int8)[3:], np.empty((0, 2), np.float32)]
    if all(read(id(a) + offset).value == a.ctypes.data for a in probes):
        return "_read(id({0}) + _OFF).value"
    return "{0}.ctypes.data"


_POINTER = _pointer_expression()


class CallPlan:
    """Validation and packing of arguments for one function signature (from its metadata)."""

    def __init__(self, meta: dict[str, Any]):
        self.meta = meta
        self.name = meta["name"]
        self.params = meta["params"]
        self.nargs = len(self.params)
        self.nsizes = len(meta["size_vars"])
        self.PtrArray = ctypes.c_void_p * max(1, sum(p["kind"] == "buffer" for p in self.params))
        self.SizeArray = ctypes.c_int64 * max(1, self.nsizes)
        self.origin: dict[int, str] = {}  # size var -> where its value comes from
        self.var_params: list[tuple[int, int]] = []  # (position, size index)
        for pos, p in enumerate(self.params):
            if p["kind"] == "var":
                self.var_params.append((pos, p["size_index"]))
                self.origin.setdefault(p["size_index"], f"argument {p['name']!r} (position {pos})")
        self.buffers: list[tuple[int, int, np.dtype, int, tuple[tuple[int, int, int], ...], bool]] = []
        self.deferred: list[tuple[int, int, Any]] = []  # (position, dim, expression) checked after binding
        for pos, p in enumerate(self.params):
            if p["kind"] != "buffer":
                continue
            checks = []
            for k, d in enumerate(p["shape"]):
                if isinstance(d, int):
                    checks.append((k, _CONST, d))
                elif d[0] == "var" and d[1] not in self.origin:
                    self.origin[d[1]] = f"{p['name']} (argument {pos}) dimension {k}"
                    checks.append((k, _BIND, d[1]))
                elif d[0] == "var":
                    checks.append((k, _CHECK, d[1]))
                else:
                    self.deferred.append((pos, k, d))
            slot = len(self.buffers)
            self.buffers.append((pos, slot, np.dtype(p["dtype"]), len(p["shape"]), tuple(checks), p["output"]))
        unbound = [n for j, n in enumerate(meta["size_vars"]) if j not in self.origin]
        if unbound:
            raise ShapeError(
                f"{self.name}: the size variable(s) {', '.join(map(repr, unbound))} are neither the exact extent "
                "of a dimension of a tensor argument nor passed as arguments, so a call cannot know their "
                "values; pass them as arguments (put the te.var in the argument list)"
            )
        self.outputs = [slot for (_, slot, _, _, _, out) in self.buffers if out]
        self.buffers_by_pos = {b[0]: b for b in self.buffers}
        # pack(args) -> (void *args[], int64_t sizes[], arrays to keep alive); raises on bad arguments
        self.pack = self._compile_pack()

    # -- the fast path ----------------------------------------------------------
    def pack_source(self) -> str:
        """Python source of the packing function: the plan unrolled into straight-line checks.

        Generated once per signature (like dataclasses' ``__init__``) because a loop over
        the plan costs about twice as much per call; every failed check calls the slow path.
        """
        out = ["def pack(args):", f"    if len(args) != {self.nargs}: plan.diagnose(args)"]
        names = [f"a{i}" for i in range(self.nargs)]
        if self.nargs:
            out.append(f"    {', '.join(names)}{',' if self.nargs == 1 else ''} = args")
        out.append("    ptrs = PtrArray(); sizes = SizeArray()")
        size_local: dict[int, str] = {}
        for pos, j in self.var_params:
            a = names[pos]
            out.append(f"    if type({a}) is not int or not {_INT64_MIN} <= {a} <= {_INT64_MAX}: "
                       f"{a} = plan.scalar({pos}, {a})")
            if j in size_local:
                out.append(f"    if {a} != {size_local[j]}: plan.diagnose(args)")
            else:
                size_local[j] = a
        for pos, slot, _dtype, ndim, checks, is_output in self.buffers:
            a = names[pos]
            out.append(f"    # {self.params[pos]['name']}: {self.params[pos]['dtype']}"
                       f"[{', '.join(self.params[pos]['shape_str'])}]")
            out.append(f"    if type({a}) is not ndarray or {a}.dtype is not dtype{slot}: "
                       f"{a} = plan.plain(args, {pos})")
            out.append(f"    s = {a}.shape")
            out.append(f"    if len(s) != {ndim}: plan.diagnose(args)")
            for k, kind, val in checks:
                if kind == _CONST:
                    out.append(f"    if s[{k}] != {val}: plan.diagnose(args)")
                elif kind == _BIND:
                    size_local[val] = f"n{val}"
                    out.append(f"    n{val} = s[{k}]")
                else:
                    out.append(f"    if s[{k}] != {size_local[val]}: plan.diagnose(args)")
            out.append(f"    f = {a}.flags")
            if is_output:
                out.append("    if not (f.c_contiguous and f.aligned and f.writeable): plan.diagnose(args)")
            else:
                out.append(f"    if not (f.c_contiguous and f.aligned): {a} = plan.input_copy(args, {pos})")
            out.append(f"    p{slot} = {_POINTER.format(a)}")
            out.append(f"    ptrs[{slot}] = p{slot}")
            if self.outputs and len(self.buffers) > 1:
                out.append(f"    e{slot} = p{slot} + {a}.nbytes")
        for j in range(self.nsizes):
            out.append(f"    sizes[{j}] = {size_local[j]}")
        if self.deferred:
            out.append("    plan.check_deferred(args, sizes)")
        # outputs overlap nothing: compare the byte ranges [p, e) of non-empty arrays
        for o in self.outputs:
            for x in range(len(self.buffers)):
                if x != o and not (x in self.outputs and x < o):
                    out.append(f"    if p{o} < e{x} and p{x} < e{o} and p{o} < e{o} and p{x} < e{x}: "
                               f"plan.overlap_error({o}, {x})")
        out.append(f"    return ptrs, sizes, ({', '.join(names)}{',' if self.nargs == 1 else ''})")
        return "\n".join(out) + "\n"

    def _compile_pack(self) -> Any:
        scope: dict[str, Any] = {"plan": self, "ndarray": _ndarray, "PtrArray": self.PtrArray,
                                 "SizeArray": self.SizeArray, "_read": ctypes.c_void_p.from_address,
                                 "_OFF": object.__basicsize__}
        for _pos, slot, dtype, *_ in self.buffers:
            scope[f"dtype{slot}"] = dtype
        exec(compile(self.pack_source(), f"<cuvil pack {self.name}>", "exec"), scope)
        return scope["pack"]

    def plain(self, args: tuple[Any, ...], pos: int) -> Any:
        """A plain ndarray of the right dtype for ``args[pos]`` (a subclass becomes a view), or raise."""
        a = args[pos]
        if isinstance(a, _ndarray) and a.dtype == self.buffers_by_pos[pos][2]:
            return a.view(_ndarray)  # np.memmap, np.matrix ...: the same memory as a plain array
        self.diagnose(args)

    def input_copy(self, args: tuple[Any, ...], pos: int) -> Any:
        """A C-contiguous aligned copy of a strided input, after checking it overlaps no output."""
        self.check_overlap_views(args, pos)
        return np.ascontiguousarray(args[pos])

    # -- the slow path: say exactly what is wrong -----------------------------------
    def what(self, pos: int) -> str:
        return f"{self.params[pos]['name']!r} (argument {pos})"

    def signature(self) -> str:
        parts = []
        for p in self.params:
            if p["kind"] == "buffer":
                parts.append(f"{p['name']}: {p['dtype']}[{', '.join(p['shape_str'])}]")
            else:
                parts.append(f"{p['name']}: int")
        return f"{self.name}({', '.join(parts)})"

    def scalar(self, pos: int, v: Any) -> int:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise ArgumentError(f"{self.name}: {self.what(pos)} is a size and must be a Python int, "
                                f"got {type(v).__name__} {v!r}")
        v = int(v)
        if not -(1 << 63) <= v < (1 << 63):
            raise ArgumentError(f"{self.name}: {self.what(pos)} = {v} does not fit in int64")
        return v

    def diagnose(self, args: tuple[Any, ...]) -> None:
        if len(args) != self.nargs:
            raise ArgumentError(f"{self.name} takes {self.nargs} arguments, got {len(args)}; "
                                f"signature: {self.signature()}")
        sizes: dict[int, int] = {}
        for pos, j in self.var_params:
            sizes[j] = self.scalar(pos, args[pos])
        for pos, _slot, dtype, ndim, checks, is_output in self.buffers:
            a, p, who = args[pos], self.params[pos], self.what(pos)
            if not isinstance(a, np.ndarray):
                raise ArgumentError(f"{self.name}: {who} must be a numpy.ndarray of {p['dtype']}, "
                                    f"got {type(a).__name__}")
            if a.dtype != dtype:
                raise DTypeError(f"{self.name}: {who} must have dtype {p['dtype']}, got {a.dtype} "
                                 "(cuvil never casts arguments; convert with .astype)")
            if a.ndim != ndim:
                raise ShapeError(f"{self.name}: {who} must have {ndim} dimension(s) "
                                 f"[{', '.join(p['shape_str'])}], got shape {a.shape}")
            for k, kind, val in checks:
                n = a.shape[k]
                if kind == _CONST and n != val:
                    raise ShapeError(f"{self.name}: {who} dimension {k} must be {val}, got {n} (shape {a.shape})")
                if kind == _BIND and val not in sizes:
                    sizes[val] = n
                elif kind != _CONST and n != sizes[val]:
                    sv = self.meta["size_vars"][val]
                    raise ShapeError(
                        f"{self.name}: {who} dimension {k} is {n}, but {sv} = {sizes[val]} "
                        f"(from {self.origin[val]})"
                    )
            if is_output and not a.flags.c_contiguous:
                raise ArgumentError(f"{self.name}: output {who} is not C-contiguous; pass a contiguous array "
                                    "(np.ascontiguousarray makes a copy, which would not receive the result)")
            if is_output and not a.flags.aligned:
                raise ArgumentError(f"{self.name}: output {who} is not aligned to its element size")
            if is_output and not a.flags.writeable:
                raise ArgumentError(f"{self.name}: output {who} is read-only")
        raise AssertionError("diagnose() found no problem")  # pack() and diagnose() disagree: a cuvil bug

    def check_deferred(self, args: tuple[Any, ...], sizes: Any) -> None:
        for pos, k, d in self.deferred:
            want = eval_dim(d, sizes)
            got = args[pos].shape[k]
            if got != want:
                text = self.params[pos]["shape_str"][k]
                raise ShapeError(f"{self.name}: {self.what(pos)} dimension {k} must be {text} = {want}, got {got}")

    def check_overlap_views(self, args: tuple[Any, ...], pos: int) -> None:
        for _p, slot, _d, _n, _c, is_output in self.buffers:
            if is_output and _p != pos and isinstance(args[_p], np.ndarray) and \
                    np.may_share_memory(args[_p], args[pos]):
                self.overlap_error(slot, [b[1] for b in self.buffers if b[0] == pos][0])

    def overlap_error(self, out_slot: int, other_slot: int) -> None:
        out_pos, other_pos = self.buffers[out_slot][0], self.buffers[other_slot][0]
        raise ArgumentError(
            f"{self.name}: output {self.what(out_pos)} overlaps {self.what(other_pos)} in memory; "
            "outputs must not share memory with any other argument (pass a separate array, or a .copy())"
        )


class NativeFunction:
    """A callable compiled function: numpy arrays in, outputs written in place, returns None."""

    plan: CallPlan
    _cfunc: Any

    _cfunc_checked: Any = None  # name_checked: also says which bounds check failed

    def __call__(self, *args: Any) -> None:
        ptrs, sizes, _keep = self.plan.pack(args)
        f = self._cfunc_checked
        if f is None:
            rc = self._cfunc(ptrs, sizes)
        else:
            err = ErrorRecord()
            rc = f(ptrs, sizes, err)
        if rc:
            self._failed(rc, sizes, None if f is None else err)

    def _failed(self, rc: int, sizes: Any, err: Any) -> None:
        if rc == BOUNDS_STATUS:
            named = {n: int(sizes[j]) for j, n in enumerate(self.plan.meta["size_vars"])}
            checks = self.plan.meta.get("checks", [])
            what = bounds_message(checks, err, named) if err is not None else "a bounds check failed"
            raise BoundsError(f"{self.plan.name}: {what}; nothing was read or written outside the tensors, "
                              "and the outputs are incomplete")
        raise MemoryError(f"{self.plan.name}: out of memory allocating a temporary buffer")

    def time(self, *args: Any, number: int = 10, repeat: int = 5) -> float:
        """Median seconds per call over ``repeat`` runs of ``number`` calls (arguments checked once)."""
        ptrs, sizes, _keep = self.plan.pack(args)
        f = self._cfunc
        rc = f(ptrs, sizes)  # warm up
        if rc:
            self(*args)  # raises what went wrong
        runs = []
        for _ in range(max(1, repeat)):
            t0 = time.perf_counter()
            for _ in range(max(1, number)):
                f(ptrs, sizes)
            runs.append((time.perf_counter() - t0) / max(1, number))
        return statistics.median(runs)

    def _set_threads(self, n: int) -> None:
        """Tell the native code to use ``n`` threads (called by :mod:`cuvil.runtime.threads`)."""
        setter = getattr(self, "_threads_setter", None)
        if setter is not None:
            setter(n)

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def signature(self) -> str:
        return self.plan.signature()


def check_feed_names(input_feed: Any, expected: Sequence[str]) -> None:
    """``input_feed`` is a dict naming each of a model's ``expected`` inputs and nothing else (the
    session's and the loaded library's ``run``)."""
    if not isinstance(input_feed, Mapping):
        raise ArgumentError(f"the feeds must be a dict {{input name: array}}, got {type(input_feed).__name__}")
    extra = [n for n in input_feed if n not in expected]
    if extra:
        raise ArgumentError(f"unknown input(s) {', '.join(repr(n) for n in extra)}; the model's inputs are "
                            f"{', '.join(expected)}")
    missing = [n for n in expected if n not in input_feed]
    if missing:
        raise ArgumentError(f"missing input(s) {', '.join(repr(n) for n in missing)}")
