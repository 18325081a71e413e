"""The target-neutral loop IR: buffers and statements.

A :class:`LoweredFunc` is what ``cuvil.lower`` returns and what every code
generator consumes.  Its ``str()`` is a readable C-like loop nest::

    func main(A: float32[M, K], B: float32[K, N], C: float32[M, N]) {
      for (i = 0; i < M; i++) {
        for (j = 0; j < N; j++) {
          C[i, j] = 0f;
          for (k = 0; k < K; k++) {
            C[i, j] = C[i, j] + A[i, k] * B[k, j];
          }
        }
      }
    }
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cuvil.ir.expr import Expr, Var

GPU_TAGS = tuple(f"{u}.{d}" for u in ("blockIdx", "threadIdx") for d in "xyz")
LOOP_KINDS = ("serial", "parallel", "vectorize", "unroll") + GPU_TAGS  # GPU_TAGS: loops bound with bind()


@dataclass(frozen=True, eq=False, slots=True, repr=False)
class Buffer:
    """A dense row-major array: an argument, an intermediate, or a local scratch."""

    name: str
    shape: tuple[Expr, ...]
    dtype: str
    scope: str = "global"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        return f"{self.name}: {self.dtype}[{dims}]"


class Stmt:
    """Base class of loop IR statements."""

    __slots__ = ()

    def __str__(self) -> str:
        from cuvil.ir.printer import stmt_str

        return stmt_str(self)

    def __repr__(self) -> str:
        return str(self)


@dataclass(frozen=True, eq=False, slots=True, repr=False)
class Store(Stmt):
    buffer: Buffer
    indices: tuple[Expr, ...]
    value: Expr


@dataclass(frozen=True, eq=False, slots=True, repr=False)
class For(Stmt):
    """``for (var = min; var < min + extent; var++) body``; ``kind`` in LOOP_KINDS."""

    var: Var
    min: Expr
    extent: Expr
    body: Stmt
    kind: str = "serial"


@dataclass(frozen=True, eq=False, slots=True, repr=False)
class If(Stmt):
    cond: Expr
    then_body: Stmt
    else_body: Stmt | None = None


@dataclass(frozen=True, eq=False, slots=True, repr=False)
class Block(Stmt):
    stmts: tuple[Stmt, ...]


@dataclass(frozen=True, eq=False, slots=True, repr=False)
class LetStmt(Stmt):
    """Binds ``var`` to ``value`` for the duration of ``body``."""

    var: Var
    value: Expr
    body: Stmt


@dataclass(frozen=True, eq=False, slots=True, repr=False)
class Allocate(Stmt):
    """Storage for ``buffer`` while ``body`` runs (stack if small, else heap)."""

    buffer: Buffer
    body: Stmt


def sub_stmts(s: Stmt) -> tuple[Stmt, ...]:
    """The statements directly inside ``s``: a loop's, let's or allocation's body, a block's statements,
    both sides of an if (none for a store)."""
    if isinstance(s, Block):
        return s.stmts
    if isinstance(s, (For, LetStmt, Allocate)):
        return (s.body,)
    if isinstance(s, If):
        return (s.then_body,) if s.else_body is None else (s.then_body, s.else_body)
    return ()


def block(stmts: list[Stmt] | tuple[Stmt, ...]) -> Stmt:
    """A Block of ``stmts`` with nested blocks flattened; one statement stays itself."""
    flat: list[Stmt] = []
    for s in stmts:
        if isinstance(s, Block):
            flat.extend(s.stmts)
        elif s is not None:
            flat.append(s)
    return flat[0] if len(flat) == 1 else Block(tuple(flat))


@dataclass(frozen=True, slots=True)
class CheckSite:
    """One bounds check of a lowered function (``LoweredFunc.checks[site - 1]``), for its error message.

    ``kind`` is "index" (a data-dependent or non-affine index of ``buffer``'s dimension ``dim``, which must
    lie in ``[0, extent)``; with ``wrap``, in ``[-extent, extent)``, a negative one counting from the end as
    ONNX's indices do) or "sizes" (run-time sizes for which an affine access leaves its tensor:
    ``what`` says which access and when).  ``tag`` is the caller's (the graph compiler: which member of a
    fused kernel); ``what`` describes the access.
    """

    kind: str
    what: str
    buffer: str = ""
    dim: int = -1
    extent: str = ""
    wrap: bool = False
    tag: int = -1


@dataclass(frozen=True, eq=False, slots=True, repr=False)
class LoweredFunc:
    """A function in loop IR.

    ``params`` are the arguments in call order: a Buffer for each tensor, a Var
    for each run-time size passed explicitly.  ``size_vars`` are the run-time
    sizes the function needs, in the order they are passed to native code.
    ``outputs`` names the buffers the function writes.  ``checks`` describes the bounds checks the body
    makes (``index_check`` calls number them from 1); ``entry_checks`` are conditions on the sizes,
    checked once per call before the body runs, under which an access would leave its tensor (each
    with its site number).  ``workspace`` are the last params: scratch buffers the caller gives
    (uninitialised memory the body writes before it reads), made by :func:`cuvil.ir.workspace.hoist_workspace`.
    """

    name: str
    params: tuple[Buffer | Var, ...]
    body: Stmt
    size_vars: tuple[Var, ...] = ()
    outputs: tuple[Buffer, ...] = field(default=())
    checks: tuple[CheckSite, ...] = ()
    entry_checks: tuple[tuple[Expr, int], ...] = ()
    workspace: tuple[Buffer, ...] = ()  # trailing params: scratch memory its caller gives (cuvil/ir/workspace.py)

    def __str__(self) -> str:
        from cuvil.ir.printer import func_str

        return func_str(self)

    __repr__ = __str__
