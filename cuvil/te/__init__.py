"""Tensor expressions: describe an operator as ``te.compute`` stages over placeholders."""

from cuvil.ir.expr import Expr, IterVar, Reduce, Var
from cuvil.te.api import (
    abs,
    all,
    any,
    cast,
    ceil,
    comm_reducer,
    compute,
    const,
    create_schedule,
    erf,
    exp,
    floor,
    if_then_else,
    isnan,
    log,
    max,
    min,
    placeholder,
    pow,
    power,
    reduce_axis,
    round,
    rsqrt,
    scan,
    sigmoid,
    sqrt,
    structural_equal,
    sum,
    tanh,
    trunc,
    var,
)
from cuvil.te.tensor import ComputeOp, Operation, PlaceholderOp, ScanOp, Tensor

__all__ = [
    "ComputeOp", "Expr", "ScanOp", "IterVar", "Operation", "PlaceholderOp", "Reduce", "Tensor", "Var",
    "abs", "all", "any", "cast", "ceil", "comm_reducer", "compute", "const", "create_schedule",
    "erf", "exp", "floor", "if_then_else", "isnan", "log", "max", "min", "placeholder", "pow",
    "power", "reduce_axis", "round", "rsqrt", "scan", "sigmoid", "sqrt", "structural_equal", "sum", "tanh",
    "trunc", "var",
]
