"""Readable C-like text for expressions, statements and lowered functions.

Variables that share a name but are different objects print with a numeric
suffix (``i``, ``i_1``), so a printed nest is never ambiguous.
"""

from __future__ import annotations

import math

from cuvil.ir.expr import (
    SYMBOLS,
    Binary,
    Call,
    Cast,
    Const,
    Expr,
    Load,
    Reduce,
    Select,
    TensorRead,
    Unary,
    Var,
    index_check_parts,
)
from cuvil.ir.stmt import Allocate, Block, Buffer, For, If, LetStmt, LoweredFunc, Stmt, Store

_PREC = {
    "or": 1, "xor": 2, "and": 3,
    "eq": 4, "ne": 4, "lt": 4, "le": 4, "gt": 4, "ge": 4,
    "add": 5, "sub": 5, "mul": 6, "div": 6, "floordiv": 6, "floormod": 6,
}


class Printer:
    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        self.used: set[str] = set()

    def name(self, obj: Var | Buffer) -> str:
        key = id(obj)
        if key not in self.names:
            base = obj.name or "v"
            n, i = base, 0
            while n in self.used:
                i += 1
                n = f"{base}_{i}"
            self.used.add(n)
            self.names[key] = n
        return self.names[key]

    # -- expressions --------------------------------------------------------
    def expr(self, e: Expr, prec: int = 0) -> str:
        if isinstance(e, Const):
            return _const(e)
        if isinstance(e, Var):
            return self.name(e)
        if isinstance(e, Cast):
            return f"{e.dtype}({self.expr(e.value)})"
        if isinstance(e, Binary):
            if e.op in ("min", "max"):
                return f"{e.op}({self.expr(e.a)}, {self.expr(e.b)})"
            p = _PREC[e.op]
            # left-associative: the right operand needs parentheses at equal precedence
            text = f"{self.expr(e.a, p)} {SYMBOLS[e.op]} {self.expr(e.b, p + 1)}"
            return f"({text})" if p < prec else text
        if isinstance(e, Unary):
            sym = "-" if e.op == "neg" else ("!" if e.dtype == "bool" else "~")
            return f"{sym}{self.expr(e.a, 7)}"
        if isinstance(e, Call):
            check = index_check_parts(e)
            if check is not None:  # checked(k, 10) / checked_wrap(k, 10): k in [0, 10) / [-10, 10)
                v, n, wrap, _tag, site = check
                mark = f" #{site}" if site else ""
                return f"checked{'_wrap' if wrap else ''}({self.expr(v)}, {self.expr(n)}{mark})"
            return f"{e.name}({', '.join(self.expr(a) for a in e.args)})"
        if isinstance(e, Select):
            return f"select({self.expr(e.cond)}, {self.expr(e.t)}, {self.expr(e.f)})"
        if isinstance(e, TensorRead):
            return f"{e.tensor.name}[{', '.join(self.expr(i) for i in e.indices)}]"
        if isinstance(e, Load):
            return f"{self.name(e.buffer)}[{', '.join(self.expr(i) for i in e.indices)}]"
        if isinstance(e, Reduce):
            axes = ", ".join(self.name(a) for a in e.axis)
            where = "" if e.where is None else f", where={self.expr(e.where)}"
            return f"{e.name}({self.expr(e.source)}, axis=[{axes}]{where})"
        raise TypeError(f"cannot print {type(e).__name__}")

    # -- statements ---------------------------------------------------------
    def stmt(self, s: Stmt, indent: int, out: list[str]) -> None:
        pad = "  " * indent
        if isinstance(s, Block):
            for x in s.stmts:
                self.stmt(x, indent, out)
        elif isinstance(s, Store):
            idx = ", ".join(self.expr(i) for i in s.indices)
            out.append(f"{pad}{self.name(s.buffer)}[{idx}] = {self.expr(s.value)};")
        elif isinstance(s, For):
            v = self.name(s.var)
            lo = self.expr(s.min)
            hi = self.expr(s.extent) if _is_zero(s.min) else self.expr(simplify_expr(s.min + s.extent))
            kind = "" if s.kind == "serial" else f"{s.kind} "
            out.append(f"{pad}{kind}for ({v} = {lo}; {v} < {hi}; {v}++) {{")
            self.stmt(s.body, indent + 1, out)
            out.append(pad + "}")
        elif isinstance(s, If):
            out.append(f"{pad}if ({self.expr(s.cond)}) {{")
            self.stmt(s.then_body, indent + 1, out)
            if s.else_body is not None:
                out.append(pad + "} else {")
                self.stmt(s.else_body, indent + 1, out)
            out.append(pad + "}")
        elif isinstance(s, LetStmt):
            out.append(f"{pad}{s.var.dtype} {self.name(s.var)} = {self.expr(s.value)};")
            self.stmt(s.body, indent, out)
        elif isinstance(s, Allocate):
            b = s.buffer
            dims = ", ".join(self.expr(d) for d in b.shape)
            out.append(f"{pad}{b.scope} {b.dtype} {self.name(b)}[{dims}];")
            self.stmt(s.body, indent, out)
        else:
            raise TypeError(f"cannot print {type(s).__name__}")

    def func(self, f: LoweredFunc) -> str:
        params = []
        for p in f.params:
            if isinstance(p, Buffer):
                dims = ", ".join(self.expr(d) for d in p.shape)
                params.append(f"{self.name(p)}: {p.dtype}[{dims}]")
            else:
                params.append(f"{self.name(p)}: {p.dtype}")
        out = [f"func {f.name}({', '.join(params)}) {{"]
        for cond, site in f.entry_checks:  # sizes under which an access would leave its tensor
            out.append(f"  fail_if({self.expr(cond)} #{site});")
        self.stmt(f.body, 1, out)
        out.append("}")
        return "\n".join(out)


def _is_zero(e: Expr) -> bool:
    return isinstance(e, Const) and e.value == 0


def _const(e: Const) -> str:
    v = e.value
    if e.dtype == "bool":
        return "true" if v else "false"
    if isinstance(v, float):
        if math.isnan(v):
            text = "nan"
        elif math.isinf(v):
            text = "inf" if v > 0 else "-inf"
        else:
            text = repr(v)
        return text + ("f" if e.dtype == "float32" else "h" if e.dtype == "float16" else "")
    return str(v)


def simplify_expr(e: Expr) -> Expr:
    from cuvil.ir.simplify import simplify_expr as simp

    return simp(e)


def expr_str(e: Expr) -> str:
    return Printer().expr(e)


def stmt_str(s: Stmt) -> str:
    out: list[str] = []
    Printer().stmt(s, 0, out)
    return "\n".join(out)


def func_str(f: LoweredFunc) -> str:
    return Printer().func(f)
