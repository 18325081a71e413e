"""A schedule's stage: one operation, its loops (split, fuse, reorder, annotations) and its placement.

The primitives of :class:`Stage` (``split``, ``tile``, ``reorder``, ``fuse``, ``vectorize``, ``parallel``,
``unroll``, ``bind``, ``compute_at``, ``compute_inline``, ``compute_root``, ``rfactor``) each build a
trace step and hand it to :meth:`cuvil.schedule.schedule.Schedule.apply`, which checks it with isl.
See :mod:`cuvil.schedule.schedule` for the schedule as a whole and for scans' part stages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cuvil.errors import ScheduleError
from cuvil.ir import expr as E
from cuvil.ir.expr import IterVar
from cuvil.schedule.axes import Fuse, Relation, Split, const_int, derived
from cuvil.schedule.trace import Step
from cuvil.te.tensor import Operation, PlaceholderOp, ScatterOp, Tensor

if TYPE_CHECKING:
    from cuvil.schedule.schedule import Schedule

_PLACEMENT = ("compute_at", "compute_inline", "compute_root")


class Stage:
    """One operation of a schedule, with its loop structure and placement.

    A scan's part stage (``s[init]``, ``s[update]``) has ``scan`` set to the scan's stage; the scan's
    stage lists them in ``parts`` (init, update).
    """

    def __init__(self, sched: Schedule, op: Operation, scan: Stage | None = None, part: str = ""):
        self.sched = sched
        self.op = op
        self.origin_op = op
        self.label = op.name  # the stage's name: the op's, numbered when two ops of a program share one
        self.scan = scan
        self.part = part  # "init" | "update" for a scan's part stage
        self.parts: tuple[Stage, ...] = ()
        self.aliases: list[Operation] = [op]  # every op this stage has computed (readers may name any)
        self.scope = "global"
        self.attach = "root"  # "root" | "inline" | "at"
        self.attach_stage: Stage | None = None
        self.attach_axis: IterVar | None = None
        self.reset_loops()

    def reset_loops(self) -> None:
        op = self.op
        # a scatter's loops: the copy's over the output, then the updates' (cuvil.te.tensor.ScatterOp)
        roots = (op.axis + op.reduce_axis + getattr(op, "update_axis", ())) if not isinstance(op, PlaceholderOp) else ()
        self.roots: tuple[IterVar, ...] = roots
        self.leaves: list[IterVar] = list(roots)
        self.relations: list[Relation] = []
        self.kinds: dict[int, str] = {}

    def set_op(self, op: Operation, keep_loops: bool = False) -> None:
        """Replace the op (same output values); ``keep_loops`` when its axes are the same objects."""
        self.op = op
        self.aliases = self.aliases + [op]
        if not keep_loops:
            self.reset_loops()

    @property
    def name(self) -> str:
        return self.label

    @property
    def is_placeholder(self) -> bool:
        return isinstance(self.op, PlaceholderOp)

    @property
    def all_axes(self) -> list[IterVar]:
        out = list(self.roots)
        for r in self.relations:
            out.extend((r.outer, r.inner) if isinstance(r, Split) else (r.fused,))
        return out

    def __repr__(self) -> str:
        return f"Stage({self.name})"

    def loops_scheduled(self) -> bool:
        """Whether a primitive changed this stage's loops, or a stage is computed at one of them."""
        return (bool(self.relations) or bool(self.kinds) or any(a is not b for a, b in zip(self.leaves, self.roots))
                or bool(self.attached_here()))

    def loops_of(self, kind: str) -> Stage:
        """The stage whose loops run this stage's statements of ``kind``: the stage itself, or for a
        scan whose init or update stage was scheduled, that part's stage."""
        if kind in ("scan_init", "scan_update") and any(p.loops_scheduled() for p in self.parts):
            return self.parts[0 if kind == "scan_init" else 1]
        return self

    # -- helpers ----------------------------------------------------------------
    def _leaf(self, axis: Any, what: str) -> IterVar:
        if isinstance(axis, str):
            axis = self.axis_by_name(axis)
        if not isinstance(axis, IterVar):
            raise ScheduleError(f"{self.name}.{what}: expected a loop axis of stage {self.name}, got {axis!r}")
        if any(axis is a for a in self.leaves):
            return axis
        for st in self.sched.all_stages:
            if st is not self and any(axis is a for a in st.all_axes):
                raise ScheduleError(
                    f"{self.name}.{what}: axis {axis.name} belongs to stage {st.name}, not {self.name}; "
                    f"use s[{st.name}].{what}(...)"
                )
        if any(axis is a for a in self.all_axes):
            raise ScheduleError(
                f"{self.name}.{what}: axis {axis.name} was already split or fused; "
                f"the current loops are {[a.name for a in self.leaves]}"
            )
        raise ScheduleError(f"{self.name}.{what}: {axis.name} is not a loop of stage {self.name}")

    def axis_by_name(self, name: str) -> IterVar:
        for a in self.all_axes:
            if a.name == name:
                return a
        raise ScheduleError(f"stage {self.name} has no axis named {name!r}; its loops are "
                            f"{[a.name for a in self.leaves]}")

    def _fresh(self, name: str) -> str:
        names = {a.name for a in self.all_axes}
        n, i = name, 0
        while n in names:
            i += 1
            n = f"{name}{i}"
        return n

    def _not_an_attach_point(self, axis: IterVar, what: str) -> None:
        here = [st.name for st in self.sched.stages if st.attach == "at" and st.attach_axis is axis]
        if here:
            raise ScheduleError(
                f"{self.name}.{what}({axis.name}): {', '.join(here)} is computed at loop {axis.name}; "
                f"{what} the loop before compute_at, or compute_at another loop first"
            )

    def attached_here(self) -> list[str]:
        """Names of the stages computed at a loop of this stage."""
        return [st.name for st in self.sched.stages if st.attach == "at" and st.attach_stage is self]

    def _compute(self, what: str) -> None:
        if isinstance(self.op, PlaceholderOp):
            raise ScheduleError(f"{what}: {self.name} is a placeholder; only computed stages have loops")
        self._scan_rules(what)

    def _scan_rules(self, what: str) -> None:
        """A scan's loops are scheduled through ``s[scan]`` (one nest for both parts) or through its part
        stages (``s[init]``, ``s[update]``), not both; a part is placed only with its scan."""
        scan = self.scan if self.scan is not None else self
        if self.scan is not None and what in _PLACEMENT:
            raise ScheduleError(
                f"{self.name}.{what}: {self.name} runs inside scan {scan.name}, once per time step; "
                f"place the whole scan with s[{scan.name}].{what}(...)"
            )
        if not scan.parts or what in _PLACEMENT:
            return
        done = scan if self.scan is not None else next((p for p in scan.parts if p.loops_scheduled()), None)
        if done is not None and done.loops_scheduled():
            raise ScheduleError(
                f"{self.name}.{what}: the loops of scan {scan.name} are already scheduled through "
                f"s[{done.name}]; schedule a scan either as one loop nest (s[{scan.name}]) or through its parts "
                f"({', '.join(p.name for p in scan.parts)}), not both"
            )

    def _keep_time(self, what: str, axes: list[IterVar]) -> None:
        """The first loop of a scan's part is the scan's time axis: it stays one loop, the outermost."""
        if self.scan is None or not any(a is self.roots[0] for a in axes):
            return
        t = self.roots[0]
        raise ScheduleError(
            f"{self.name}.{what}: {t.name} is the time axis of scan {self.scan.name}: each step reads the steps "
            f"before it, so it stays one sequential loop, the outermost; schedule the loops inside a time step "
            f"instead: {[a.name for a in self.leaves if a is not t]}"
        )

    # -- loop primitives ----------------------------------------------------------
    def split(self, parent: IterVar, factor: int | None = None, nparts: int | None = None) -> tuple[IterVar, IterVar]:
        """Split a loop in two: ``outer`` over tiles, ``inner`` within a tile.

        Before, after ``s[C].split(i, factor=8)`` (a tail is guarded by isl when 8 does not divide M)::

            for (i = 0; i < M; i++)             for (i.outer = 0; i.outer < (M + 7) // 8; i.outer++)
              C[i] = ...                          for (i.inner = 0; i.inner < min(8, M - 8 * i.outer); i.inner++)
                                                    C[i.outer * 8 + i.inner] = ...
        """
        self._compute("split")
        p = self._leaf(parent, "split")
        self._keep_time(f"split({p.name})", [p])
        if (factor is None) == (nparts is None):
            raise ScheduleError(f"{self.name}.split({p.name}): give exactly one of factor= and nparts=")
        n = factor if factor is not None else nparts
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ScheduleError(f"{self.name}.split({p.name}): the factor must be a positive int, got {n!r}")
        if nparts is not None:
            ext = const_int(p.extent)
            if ext is None:
                raise ScheduleError(
                    f"{self.name}.split({p.name}, nparts={nparts}): nparts needs a constant extent, "
                    f"{p.name} has extent {p.extent}; use factor="
                )
            factor = -(-ext // nparts)
        self._not_an_attach_point(p, "split")
        step = Step("split", self.name, (p.name, factor))
        out: list[IterVar] = []

        def do() -> None:
            outer = derived(self._fresh(p.name + ".outer"), (p.extent + (factor - 1)) // factor, p.kind)
            inner = derived(self._fresh(p.name + ".inner"), E.const(factor, "int64"), p.kind)
            self.relations.append(Split(p, outer, inner, inner.extent))
            pos = next(k for k, a in enumerate(self.leaves) if a is p)
            self.leaves[pos:pos + 1] = [outer, inner]
            self.kinds.pop(id(p), None)
            out.extend((outer, inner))

        self.sched.apply(step, do, check=False)
        return out[0], out[1]

    def tile(self, x_parent: IterVar, y_parent: IterVar, x_factor: int, y_factor: int
             ) -> tuple[IterVar, IterVar, IterVar, IterVar]:
        """Split two loops and order them ``x.outer, y.outer, x.inner, y.inner``.

        Before, after ``s[C].tile(i, j, 4, 64)``::

            for (i ...)                    for (i.outer ...)
              for (j ...)                    for (j.outer ...)
                C[i, j] = ...                  for (i.inner < 4 ...)
                                                 for (j.inner < 64 ...)
                                                   C[i.outer * 4 + i.inner, j.outer * 64 + j.inner] = ...
        """
        snap, steps = self.sched._snapshot(), len(self.sched.trace)
        try:
            xo, xi = self.split(x_parent, factor=x_factor)
            yo, yi = self.split(y_parent, factor=y_factor)
            self.reorder(xo, yo, xi, yi)
        except BaseException:  # all or nothing
            self.sched._restore(snap)
            del self.sched.trace[steps:]
            raise
        return xo, yo, xi, yi

    def reorder(self, *axes: IterVar) -> None:
        """Put the given loops, in the given order, at the positions they occupy now.

        Before, after ``s[C].reorder(k, i)`` on the nest ``i, j, k``::

            for (i) for (j) for (k) ...        for (k) for (j) for (i) ...
        """
        self._compute("reorder")
        if len(axes) == 1 and isinstance(axes[0], (list, tuple)):
            axes = tuple(axes[0])
        leaves = [self._leaf(a, "reorder") for a in axes]
        if len({id(a) for a in leaves}) != len(leaves):
            raise ScheduleError(f"{self.name}.reorder: an axis is repeated in {[a.name for a in leaves]}")
        if leaves and leaves[0] is not self.roots[0]:  # the time axis of a scan's part may not move inward
            self._keep_time(f"reorder({', '.join(a.name for a in leaves)})", leaves)
        step = Step("reorder", self.name, tuple(a.name for a in leaves))

        def do() -> None:
            positions = sorted(k for k, a in enumerate(self.leaves) if any(a is b for b in leaves))
            for pos, a in zip(positions, leaves):
                self.leaves[pos] = a

        self.sched.apply(step, do)

    def fuse(self, outer: IterVar, inner: IterVar) -> IterVar:
        """Fuse two adjacent loops (outer first) into one.

        Before, after ``s[C].fuse(i, j)`` (j's extent must be a constant)::

            for (i < 4) for (j < 8)            for (i.j.fused < 32)
              C[i, j] = ...                      C[i.j.fused // 8, i.j.fused % 8] = ...
        """
        self._compute("fuse")
        o, i = self._leaf(outer, "fuse"), self._leaf(inner, "fuse")
        self._keep_time(f"fuse({o.name}, {i.name})", [o, i])
        po = next(k for k, a in enumerate(self.leaves) if a is o)
        pi = next(k for k, a in enumerate(self.leaves) if a is i)
        if pi != po + 1:
            raise ScheduleError(
                f"{self.name}.fuse({o.name}, {i.name}): the loops must be adjacent, outer first; "
                f"the loop order is {[a.name for a in self.leaves]}"
            )
        if const_int(i.extent) is None:
            raise ScheduleError(
                f"{self.name}.fuse({o.name}, {i.name}): the inner loop needs a constant extent "
                f"({i.name} has extent {i.extent}) so the fused index stays affine"
            )
        if o.kind != i.kind:
            raise ScheduleError(
                f"{self.name}.fuse({o.name}, {i.name}): a data loop and a reduction loop cannot be fused; "
                "fuse loops of one kind"
            )
        self._not_an_attach_point(o, "fuse")
        self._not_an_attach_point(i, "fuse")
        step = Step("fuse", self.name, (o.name, i.name))
        out: list[IterVar] = []

        def do() -> None:
            kind = "reduce" if "reduce" in (o.kind, i.kind) else "data"
            fused = derived(self._fresh(f"{o.name}.{i.name}.fused"), o.extent * i.extent, kind)
            self.relations.append(Fuse(o, i, fused))
            self.leaves[po:pi + 1] = [fused]
            self.kinds.pop(id(o), None)
            self.kinds.pop(id(i), None)
            out.append(fused)

        self.sched.apply(step, do, check=False)
        return out[0]

    def _annotate(self, axis: IterVar, kind: str) -> None:
        self._compute(kind)
        a = self._leaf(axis, kind)
        if kind in ("vectorize", "unroll"):  # parallel / bind of a scan's time axis: isl finds the recurrence
            self._keep_time(f"{kind}({a.name})", [a])
        if kind in ("vectorize", "unroll") and const_int(a.extent) is None:
            raise ScheduleError(
                f"{self.name}.{kind}({a.name}): the loop needs a constant extent, it has {a.extent}; "
                f"split it first, e.g. s[{self.name}].split({a.name}, factor=8)"
            )
        if kind == "parallel" or "Idx." in kind:
            others = [b.name for b in self.leaves if self.kinds.get(id(b)) == "parallel" and b is not a]
            if others:
                if kind == "parallel":
                    raise ScheduleError(
                        f"{self.name}.parallel({a.name}): {others[0]} is already parallel; a parallel loop may not "
                        "contain or sit inside another (fuse them into one parallel loop instead)"
                    )
                raise ScheduleError(f"{self.name}.{kind}({a.name}): {others[0]} is parallel; GPU code has no "
                                    "parallel loops (bind them to threads instead)")
        step = Step("bind", self.name, (a.name, kind)) if "Idx." in kind else Step(kind, self.name, (a.name,))

        def do() -> None:
            self.kinds[id(a)] = kind

        self.sched.apply(step, do, check=kind != "unroll")

    def vectorize(self, axis: IterVar) -> None:
        """Run the loop as SIMD lanes (explicit vector code); it must carry no dependence.

        ``s[C].vectorize(j.inner)``: ``for (j.inner < 16) C[i, j] = A[i, j] + 1`` becomes one
        16-lane vector load, add and store.
        """
        self._annotate(axis, "vectorize")

    def parallel(self, axis: IterVar) -> None:
        """Run the loop's iterations on native threads; it must carry no dependence.

        ``s[C].parallel(i)``: ``for (i < M) ...`` becomes ``parallel for (i < M) ...``, its
        iterations split in contiguous chunks among the threads.
        """
        self._annotate(axis, "parallel")

    def unroll(self, axis: IterVar) -> None:
        """Repeat the loop body once per iteration in the loop IR (constant extent).

        ``for (i.inner < 2) S(i.inner)`` becomes ``S(0); S(1)``.
        """
        self._annotate(axis, "unroll")

    def bind(self, axis: IterVar, tag: str) -> None:
        """Map the loop onto a GPU grid dimension (CUDA targets); it must carry no dependence.

        ``tag`` is ``"blockIdx.x|y|z"`` or ``"threadIdx.x|y|z"``.  After ``bo, bi = s[C].split(i, 256)``,
        ``s[C].bind(bo, "blockIdx.x"); s[C].bind(bi, "threadIdx.x")``::

            for (i.outer < (N + 255) // 256)          blockIdx.x for (i.outer < (N + 255) // 256)
              for (i.inner < 256)                       threadIdx.x for (i.inner < 256)
                C[i.outer * 256 + i.inner] = ...          C[i.outer * 256 + i.inner] = ...

        Each block runs on one multiprocessor, its threads side by side; the CUDA code generator turns
        ``threadIdx.x for (v < n)`` into ``v = threadIdx.x; if (v < n)`` and puts ``__syncthreads()``
        between thread loops that follow one another (see docs/cuda.md).
        """
        from cuvil.ir.stmt import GPU_TAGS

        if tag not in GPU_TAGS:
            raise ScheduleError(f"{self.name}.bind: unknown thread tag {tag!r}; use one of {', '.join(GPU_TAGS)}")
        a = self._leaf(axis, "bind")
        others = [b.name for b in self.leaves if self.kinds.get(id(b)) == tag and b is not a]
        if others:
            raise ScheduleError(f"{self.name}.bind({a.name}, {tag!r}): loop {others[0]} is already bound to {tag}")
        self._annotate(a, tag)

    # -- placement -----------------------------------------------------------------
    def compute_at(self, parent: Stage, axis: IterVar) -> None:
        """Compute this stage inside loop ``axis`` of its consumer ``parent``: exactly the region
        that one iteration of ``axis`` reads (halos included), just before it is read.

        Before, after ``s[B].compute_at(s[C], i)`` with ``C[i] = B[i] + B[i + 1]``::

            for (i < 11) B[i] = A[i] * 2       for (i < 10) {
            for (i < 10) C[i] = B[i] + B[i+1]    for (b < 2) B[b] = A[i + b] * 2   // B's region for this i
                                                 C[i] = B[0] + B[1]
                                               }
        """
        self._compute("compute_at")
        if not isinstance(parent, Stage):
            raise ScheduleError(f"{self.name}.compute_at: the first argument must be a stage, s[T]")
        a = parent._leaf(axis, "compute_at")
        if parent.scan is not None or any(p.loops_scheduled() for p in parent.parts):
            scan = parent.scan or parent
            raise ScheduleError(
                f"{self.name}.compute_at(s[{parent.name}], {a.name}): the loops of scan {scan.name} are scheduled "
                f"through its parts ({', '.join(p.name for p in scan.parts)}); compute {self.name} at the root, "
                f"or schedule the scan as one loop nest (s[{scan.name}]) and compute it at one of its loops"
            )
        if parent is self:
            raise ScheduleError(f"{self.name}.compute_at: a stage cannot be computed inside itself")
        if not self.sched.reads(parent, self):
            readers = [st.name for st in self.sched.stages if self.sched.reads(st, self)]
            raise ScheduleError(
                f"{self.name}.compute_at(s[{parent.name}], {a.name}): {parent.name} does not read {self.name}; "
                f"it can be computed at a loop of a stage that reads it: {readers}"
            )
        step = Step("compute_at", self.name, (parent.name, a.name))

        def do() -> None:
            self.attach, self.attach_stage, self.attach_axis = "at", parent, a

        self.sched.apply(step, do)

    def compute_inline(self) -> None:
        """Substitute this element-wise stage into every reader; it gets no loops of its own.

        Before, after ``s[B].compute_inline()``::

            for (i) B[i] = A[i] * 2            for (i) C[i] = A[i] * 2 + 1
            for (i) C[i] = B[i] + 1
        """
        self._compute("compute_inline")
        if self.op.reduce_axis:
            raise ScheduleError(
                f"{self.name}.compute_inline: {self.name} is a reduction and cannot be inlined; "
                f"compute it at a loop of its reader with compute_at instead"
            )
        if isinstance(self.op, ScatterOp):
            raise ScheduleError(f"{self.name}.compute_inline: {self.name} is a scatter (stores at positions read from "
                                "memory) and cannot be inlined; compute it at the root")
        if any(a is not b for a, b in zip(self.op.store_indices, self.op.axis)):
            raise ScheduleError(
                f"{self.name}.compute_inline: {self.name} stores its elements in another layout (a packed "
                "copy); inlining it would read the wrong elements: leave out the cache_read instead"
            )
        step = Step("compute_inline", self.name, ())

        def do() -> None:
            self.attach, self.attach_stage, self.attach_axis = "inline", None, None
            self.kinds.clear()

        self.sched.apply(step, do)

    def compute_root(self) -> None:
        """Undo compute_at / compute_inline: compute the whole stage at the root, in stage order."""
        self._compute("compute_root")
        step = Step("compute_root", self.name, ())

        def do() -> None:
            self.attach, self.attach_stage, self.attach_axis = "root", None, None

        self.sched.apply(step, do)

    def rfactor(self, axis: IterVar, factor_axis: int = 0) -> Tensor:
        """TVM's rfactor on this stage; see :meth:`Schedule.rfactor`."""
        return self.sched.rfactor(self.op.output(0), axis, factor_axis)
