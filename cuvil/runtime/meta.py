"""A compiled function's signature as plain JSON-able data.

The runtime validates calls from this description alone, so a module loaded
from an exported ``.so`` (which embeds it as JSON) behaves exactly like one
compiled in this process.  Layout::

    {"abi": 1, "name": "main", "target": "llvm -mtriple=...",
     "size_vars": ["M", "N"],
     "params": [
        {"kind": "buffer", "name": "A", "dtype": "float32", "shape": [["var", 0], 16],
         "shape_str": ["M", "16"], "output": false},
        {"kind": "var", "name": "N", "dtype": "int64", "size_index": 1}]}

``"checks"`` (absent when there are none) lists the function's bounds checks, site 1 first
(:class:`cuvil.ir.stmt.CheckSite` as a dict), for the message of a failed one (status 4).

A dimension is an int, ``["var", j]`` (``size_vars[j]``), ``[op, x, y]`` with
``op`` in add sub mul floordiv floormod min max, or ``["cast", dtype, x]``.
:func:`eval_dim` evaluates one with Python ints.
"""

from __future__ import annotations

from typing import Any

from cuvil.errors import UnsupportedOpError

ABI_VERSION = 1
_DIM_OPS = ("add", "sub", "mul", "floordiv", "floormod", "min", "max")
_INT_BITS = {"int8": 8, "int16": 16, "int32": 32, "int64": 64, "uint8": 8, "uint16": 16, "uint32": 32,
             "uint64": 64}


def func_meta(func: Any, target: str) -> dict[str, Any]:
    """The signature of a LoweredFunc (the caller's view of it) as JSON-able data."""
    from cuvil.ir.stmt import Buffer

    index = {v: j for j, v in enumerate(func.size_vars)}
    outputs = {id(b) for b in func.outputs}
    params: list[dict[str, Any]] = []
    for p in func.params:
        if isinstance(p, Buffer):
            params.append({
                "kind": "buffer", "name": p.name, "dtype": p.dtype,
                "shape": [_dim(d, index, p.name, k) for k, d in enumerate(p.shape)],
                "shape_str": [str(d) for d in p.shape], "output": id(p) in outputs,
            })
        else:
            if p not in index:
                raise UnsupportedOpError(f"parameter {p.name!r} of {func.name} is a Var missing from size_vars")
            params.append({"kind": "var", "name": p.name, "dtype": p.dtype, "size_index": index[p]})
    meta = {"abi": ABI_VERSION, "name": func.name, "target": target,
            "size_vars": [v.name for v in func.size_vars], "params": params}
    checks = getattr(func, "checks", ())
    if checks:
        meta["checks"] = [{"kind": c.kind, "what": c.what, "buffer": c.buffer, "dim": c.dim, "extent": c.extent,
                           "wrap": c.wrap, "tag": c.tag} for c in checks]
    return meta


def _dim(e: Any, index: dict[Any, int], buf: str, k: int) -> Any:
    from cuvil.ir.expr import Binary, Cast, Const, Var

    if isinstance(e, Const):
        return int(e.value)
    if isinstance(e, Var):
        if e not in index:
            raise UnsupportedOpError(
                f"dimension {k} of {buf} uses the variable {e.name!r}, which is not a size variable of the function"
            )
        return ["var", index[e]]
    if isinstance(e, Cast) and e.dtype in _INT_BITS:
        inner = _dim(e.value, index, buf, k)
        return inner if e.dtype == "int64" and isinstance(inner, list) and inner[0] == "var" else \
            ["cast", e.dtype, inner]
    if isinstance(e, Binary) and e.op in _DIM_OPS:
        return [e.op, _dim(e.a, index, buf, k), _dim(e.b, index, buf, k)]
    raise UnsupportedOpError(f"dimension {k} of {buf} is {e}, which the runtime cannot evaluate from sizes")


def eval_dim(d: Any, sizes: Any) -> int:
    """The value of a serialised dimension, given the size variables' values."""
    if isinstance(d, int):
        return d
    op = d[0]
    if op == "var":
        return int(sizes[d[1]])
    if op == "cast":
        bits = _INT_BITS[d[1]]
        v = eval_dim(d[2], sizes) & ((1 << bits) - 1)
        return v - (1 << bits) if not d[1].startswith("u") and v >= 1 << (bits - 1) else v
    a, b = eval_dim(d[1], sizes), eval_dim(d[2], sizes)
    if op == "add":
        return a + b
    if op == "sub":
        return a - b
    if op == "mul":
        return a * b
    if op == "floordiv":
        return a // b if b else 0
    if op == "floormod":
        return a % b if b else 0
    return min(a, b) if op == "min" else max(a, b)
