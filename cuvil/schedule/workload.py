"""The workload key: a structural hash of a te program, independent of the names in it.

Two programs that compute the same thing the same way (same operations in the
same order, same shapes, dtypes and index expressions) get the same key, whatever
their tensors and axes are called::

    A = te.placeholder((64, 64), name="A")          X = te.placeholder((64, 64), name="X")
    ... C = matmul(A, B)                            ... Y = matmul(X, W)
    workload_key([A, B, C]) == workload_key([X, W, Y])

The walk gives every tensor, axis and size variable a name by position
(``t0, t1 ...``; ``t2.a0``, ``t2.r0``; ``s0``); the key hashes the canonical
text together with the canonical target, :data:`SCHEMA_VERSION` and the
auto-scheduler's knob-space version (:data:`cuvil.schedule.auto.KNOB_SPACE_VERSION`):
a tuning run under a new space neither counts nor learns from points of an older
one.  :attr:`Workload.older_keys` are the keys of the same program under the
older spaces: their records still replay (a trace is schedule steps, not knobs)
when the current space has none.
:class:`Workload` also keeps the mapping from canonical names to the names this
program uses, so a trace recorded under one spelling replays under another.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cuvil.errors import ArgumentError

SCHEMA_VERSION = 1  # bump when the canonical text, the knobs or the record format change meaning


@dataclass(frozen=True)
class Workload:
    """A te program seen by the tuner: its key, canonical text and name mapping."""

    key: str  # sha256 of (canonical program, target, schema version), 16 hex digits
    program_hash: str  # the structural hash alone (no target)
    target: str  # the canonical target string
    text: str  # the canonical program (for humans and for debugging a key mismatch)
    names: dict[str, str] = field(default_factory=dict)  # canonical name -> this program's name
    flops: float = 0.0  # multiply-adds x 2 of the reductions (0 when there are none)
    older_keys: tuple[str, ...] = ()  # the keys under older knob spaces, newest first

    def describe(self) -> str:
        return f"workload {self.key}"


class _Canon:
    def __init__(self) -> None:
        self.tensors: dict[int, str] = {}
        self.vars: dict[int, str] = {}
        self.names: dict[str, str] = {}
        self.sizes = 0

    def var(self, v: Any, scope: str, kind: str) -> str:
        if id(v) not in self.vars:
            if kind == "s":
                name = f"s{self.sizes}"
                self.sizes += 1
            else:
                n = sum(1 for c in self.vars.values() if c.startswith(f"{scope}.{kind}"))
                name = f"{scope}.{kind}{n}"
            self.vars[id(v)] = name
            self.names[name] = v.name
        return self.vars[id(v)]

    def expr(self, e: Any, scope: str) -> Any:
        from cuvil.ir.expr import Expr, IterVar, TensorRead, Var

        if isinstance(e, (list, tuple)):
            return [self.expr(x, scope) for x in e]
        if not isinstance(e, Expr):
            return e if isinstance(e, (int, float, str, bool)) or e is None else repr(e)
        if isinstance(e, IterVar):
            kind = "r" if e.kind == "reduce" else "a"
            if id(e) not in self.vars:
                self.var(e, scope, kind)
                return ["iv", self.vars[id(e)], e.kind, self.expr(e.min, scope), self.expr(e.extent, scope)]
            return ["v", self.vars[id(e)]]
        if isinstance(e, Var):
            if id(e) not in self.vars:
                self.var(e, scope, "s" if scope == "" else "l")
            return ["v", self.vars[id(e)], e.dtype]
        if isinstance(e, TensorRead):
            return ["read", self.tensors.get(id(e.tensor.op), "?"), e.dtype, self.expr(list(e.indices), scope)]
        out: list[Any] = [type(e).__name__]
        for f in dataclasses.fields(e):
            out.append(self.expr(getattr(e, f.name), scope))
        return out


def _post_order(outputs: Sequence[Any]) -> list[Any]:
    order: list[Any] = []
    done: set[int] = set()

    def visit(op: Any) -> None:
        if id(op) in done:
            return
        done.add(id(op))
        for t in op.input_tensors:
            visit(t.op)
        order.append(op)

    for o in outputs:
        visit(o)
    return order


def workload_of(args: Sequence[Any], target: Any = "llvm") -> Workload:
    """The :class:`Workload` of the program whose build arguments are ``args`` (inputs, outputs, sizes)."""
    from cuvil.ir.expr import IterVar, Var
    from cuvil.target import Target
    from cuvil.te.tensor import ComputeOp, PlaceholderOp, ScanOp, ScatterOp, Tensor

    if not isinstance(args, (list, tuple)) or not args:
        raise ArgumentError("the tuner needs the argument list of the program, e.g. [A, B, C]")
    for pos, a in enumerate(args):
        if not isinstance(a, (Tensor, Var)) or isinstance(a, IterVar):
            raise ArgumentError(f"argument {pos} is a {type(a).__name__}, not a te.Tensor or a te.var")
    outs = [a.op for a in args if isinstance(a, Tensor) and not isinstance(a.op, PlaceholderOp)]
    if not outs:
        raise ArgumentError("none of the arguments is a computed tensor: add the output tensor(s)")
    tgt = target if isinstance(target, Target) else Target(target)
    c = _Canon()
    ops = _post_order(outs)
    lines: list[Any] = []
    for k, op in enumerate(ops):
        name = f"t{k}"
        c.tensors[id(op)] = name
        c.names[name] = op.name
    for op in ops:
        name = c.tensors[id(op)]
        shape = c.expr(list(op.shape), "")
        if isinstance(op, PlaceholderOp):
            lines.append(["placeholder", name, op.dtype, shape])
        elif isinstance(op, ComputeOp):
            axes = [c.expr(a, name) for a in op.axis]
            lines.append(["compute", name, op.dtype, shape, axes, c.expr(op.body, name),
                          c.expr(list(op.store_indices), name), op.tag])
        elif isinstance(op, ScanOp):
            axes = [c.expr(a, name) for a in op.axis]
            lines.append(["scan", name, op.dtype, shape, axes, c.expr(op.init_extent, name),
                          c.expr(op.init_body, name), c.expr(op.update_body, name)])
        elif isinstance(op, ScatterOp):
            axes = [c.expr(a, name) for a in op.axis + op.update_axis]
            lines.append(["scatter", name, op.dtype, shape, axes, c.expr(op.init, name),
                          c.expr(list(op.indices), name), c.expr(op.value, name)])
        else:
            raise ArgumentError(f"the tuner cannot key the operation {op!r}")
    roles = []
    for a in args:
        if isinstance(a, Tensor):
            roles.append(["tensor", c.tensors.get(id(a.op), "?")])
        else:
            roles.append(["var", c.var(a, "", "s")])
    text = json.dumps({"ops": lines, "args": roles}, sort_keys=True, separators=(",", ":"))
    program_hash = hashlib.sha256(text.encode()).hexdigest()[:16]
    from cuvil.schedule.auto import KNOB_SPACE_VERSION

    keys = [_key(program_hash, tgt.canonical, v) for v in range(KNOB_SPACE_VERSION, 0, -1)]
    return Workload(keys[0], program_hash, tgt.canonical, text, dict(c.names), _flops(ops), tuple(keys[1:]))


def _key(program_hash: str, target: str, knob_version: int) -> str:
    """The key of a program for a target under knob space ``knob_version`` (version 1, the space before
    versions were counted, keeps the key it had then, so older databases still replay)."""
    tail = "" if knob_version <= 1 else f"|knobs{knob_version}"
    return hashlib.sha256(f"{program_hash}|{target}|{SCHEMA_VERSION}{tail}".encode()).hexdigest()[:16]


def _flops(ops: list[Any]) -> float:
    from cuvil.schedule.axes import const_int
    from cuvil.te.tensor import ComputeOp

    total = 0.0
    for op in ops:
        if isinstance(op, ComputeOp) and op.reduce_axis:
            ext = [const_int(a.extent) for a in (*op.axis, *op.reduce_axis)]
            if all(e is not None for e in ext):
                total += 2.0 * math.prod(ext)  # type: ignore[arg-type]
    return total


def workload_key(args: Sequence[Any], target: Any = "llvm") -> str:
    """The key the tuning database files this program's records under (see :func:`workload_of`)."""
    return workload_of(args, target).key


def rename_map(recorded: dict[str, str], here: dict[str, str]) -> dict[str, str]:
    """Names in a recorded trace -> the names of the same things in this program (only those that differ)."""
    return {old: here[c] for c, old in recorded.items() if c in here and here[c] != old}
