"""cuvil's intermediate representations: scalar expressions and loop IR."""

from cuvil.ir.expr import (
    Binary,
    Call,
    Cast,
    Const,
    Expr,
    IterVar,
    Load,
    Reduce,
    Select,
    TensorRead,
    Unary,
    Var,
)
from cuvil.ir.functor import ExprMutator, StmtMutator, collect, free_vars, structural_equal, substitute, walk
from cuvil.ir.stmt import Allocate, Block, Buffer, For, If, LetStmt, LoweredFunc, Stmt, Store, block
from cuvil.ir.unroll import unroll_loops

__all__ = [
    "Allocate", "Binary", "Block", "Buffer", "Call", "Cast", "Const", "Expr", "ExprMutator", "For",
    "If", "IterVar", "LetStmt", "Load", "LoweredFunc", "Reduce", "Select", "Stmt", "StmtMutator", "Store",
    "TensorRead", "Unary", "Var", "block", "collect", "free_vars", "structural_equal",
    "substitute", "unroll_loops", "walk",
]
