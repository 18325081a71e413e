"""The pipeline, top to bottom.

    te program + schedule
      -> check the arguments              (_plan_args)
      -> polyhedral model                 (schedule.model.build_model: isl statements, accesses)
      -> bounds, proved                   (schedule.bounds: every quasi-affine access inside its tensor)
      -> schedule map                     (the te order for now)
      -> isl AST                          (schedule.astgen.generate_ast)
      -> loop IR                          (schedule.astgen.ast_to_loops, intermediates allocated)
      -> passes                           (ir.guards, ir.simplify, ir.versioning, ir.unroll)
      -> bounds, checked                  (ir.checks: the other indices, and sizes the proof needs)
      -> LoweredFunc                      (what cuvil.lower returns; print it)
      -> LLVM IR -> O3 -> machine code    (codegen.llvm, inside runtime.Module)
      -> Module                           (callable with numpy arrays)

Each stage is a plain function whose result prints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cuvil.errors import ArgumentError, ShapeError
from cuvil.ir.checks import insert_checks
from cuvil.ir.expr import IterVar, Var
from cuvil.ir.guards import bound_guarded_loops
from cuvil.ir.simplify import simplify
from cuvil.ir.stmt import Allocate, Buffer, LoweredFunc
from cuvil.ir.unroll import unroll_loops
from cuvil.ir.versioning import version_tails
from cuvil.schedule.astgen import ast_to_loops, generate_ast
from cuvil.schedule.bounds import prove_bounds
from cuvil.schedule.legality import check_program
from cuvil.schedule.model import PolyModel, build_model, isl_budget
from cuvil.schedule.schedule import Schedule
from cuvil.schedule.stage import Stage
from cuvil.schedule.storage import plan_storage
from cuvil.schedule.timemap import build_time_maps, tail_dims
from cuvil.te.tensor import PlaceholderOp, Tensor


@dataclass(frozen=True)
class ArgPlan:
    """The build arguments sorted out: what is passed, what is written, what is internal."""

    params: tuple[Tensor | Var, ...]
    outputs: tuple[Stage, ...]
    intermediates: tuple[Stage, ...]


def _plan_args(sched: Schedule, args: Sequence[Any]) -> ArgPlan:
    if not isinstance(args, (list, tuple)):
        raise ArgumentError("the arguments must be a list of te tensors (and te.var sizes)")
    seen: set[int] = set()
    for pos, a in enumerate(args):
        if not isinstance(a, (Tensor, Var)) or isinstance(a, IterVar):
            raise ArgumentError(f"argument {pos} is a {type(a).__name__}, not a te.Tensor or a te.var")
        if id(a) in seen:
            raise ArgumentError(f"argument {pos} ({a.name}) appears twice in the argument list")
        seen.add(id(a))
    outputs = []
    for pos, a in enumerate(args):
        if isinstance(a, Tensor) and not isinstance(a.op, PlaceholderOp):
            st = sched.stage_of(a)
            if st is None:
                raise ArgumentError(f"argument {pos} ({a.name}) is computed but is not part of this schedule")
            if st.attach == "inline":
                raise ArgumentError(
                    f"argument {pos} ({a.name}) is an output but its stage was inlined (compute_inline); "
                    f"call s[{a.name}].compute_root() or leave it out of the arguments"
                )
            outputs.append(st)
    if not outputs:
        raise ArgumentError("none of the arguments is a computed tensor: add the output tensor(s) to the arguments")
    for st in sched.stages:
        if isinstance(st.op, PlaceholderOp) and id(st.op.output(0)) not in seen:
            readers = [s.op.name for s in sched.compute_stages
                       if any(t.op is st.op for t in s.op.input_tensors)]
            raise ArgumentError(
                f"placeholder {st.op.name} is read by {', '.join(readers)} but is not in the arguments"
            )
    inter = tuple(st for st in sched.compute_stages if st.attach != "inline" and all(st is not o for o in outputs))
    return ArgPlan(tuple(args), tuple(outputs), inter)


def _size_vars(model: PolyModel, plan: ArgPlan) -> tuple[Var, ...]:
    """Run-time sizes, each bound from a shape dimension or passed as an argument."""
    bindable = {id(p) for p in plan.params if isinstance(p, Var)}
    for p in plan.params:
        if isinstance(p, Tensor):
            bindable.update(id(d) for d in p.shape if isinstance(d, Var))
    for v in model.params:
        if id(v) not in bindable:
            raise ShapeError(
                f"the size {v.name} cannot be found from the shapes of the arguments "
                "(it is not a whole dimension of any argument); pass it in the argument list"
            )
    extra = [p for p in plan.params if isinstance(p, Var) and all(p is not v for v in model.params)]
    return tuple(model.params) + tuple(extra)


def lower(s: Schedule, args: Sequence[Any], name: str = "main", bounds_checks: bool = True) -> LoweredFunc:
    """The loop IR of schedule ``s`` with arguments ``args``; ``str()`` of it is a C-like nest.

    Every quasi-affine access is proved inside its tensor (an access that leaves it is a ShapeError);
    the other indices, and the sizes for which the proof needs a condition, are checked at run time
    unless ``bounds_checks`` is False (:mod:`cuvil.ir.checks`)."""
    if not isinstance(s, Schedule):
        raise ArgumentError(f"cuvil.lower needs a schedule (te.create_schedule(...)), got {type(s).__name__}")
    plan = _plan_args(s, args)
    # isl proves a scheduled program legal for these outputs (the te order is legal as it is; the automatic
    # scheduler's strategies are legal by construction: Schedule.trusted_steps)
    tm = check_program(s, list(plan.outputs)) if s.trace and len(s.trace) != s.trusted_steps else None
    with isl_budget(f"lowering {name}"):
        model = build_model(s)
        size_vars = _size_vars(model, plan)
    entry = prove_bounds(plan.params, name)
    buffers: dict[int, Buffer] = {}

    def buffer_of(t: Tensor | Stage) -> Buffer:
        st = t if isinstance(t, Stage) else s.stage_of(t)
        if st is None:  # an input no stage reads: still an argument
            return buffers.setdefault(id(t), Buffer(t.name, t.shape, t.dtype))
        if id(st) not in buffers:
            out = st.op.output(0)
            buffers[id(st)] = Buffer(st.name, out.shape, out.dtype, st.scope)
        return buffers[id(st)]

    params = tuple(buffer_of(p) if isinstance(p, Tensor) else p for p in plan.params)
    with isl_budget(f"lowering {name}"):
        tm = tm if tm is not None else build_time_maps(model)
        ast = generate_ast(model, tm.union(), tail_dims(model, tm))
        storage = plan_storage(model, tm, list(plan.intermediates))
        body, placed = ast_to_loops(model, tm, ast, buffer_of, storage)
    for st in reversed(plan.intermediates):
        if id(st) not in placed:
            body = Allocate(buffer_of(st), body)
    func = LoweredFunc(name, params, body, size_vars, tuple(buffer_of(st) for st in plan.outputs))
    func = bound_guarded_loops(func)  # guards read from memory (an embedding bag's offsets) -> loop bounds
    return insert_checks(unroll_loops(simplify(version_tails(simplify(func)))), entry, bounds_checks)


def build(s: Schedule, args: Sequence[Any], target: Any = "llvm", name: str = "main",
          tuning_db: Any = None, bounds_checks: bool = True, board: str | None = None) -> Any:
    """Compile schedule ``s`` into a callable module for ``target``; ``bounds_checks=False`` leaves out
    the run-time bounds checks (indices read from memory; the proof's conditions on sizes).  With
    ``tuning_db``, the best record replaces ``s``: of board kind ``board`` when given, else this host's (or,
    for another target, a board's of that target; see :mod:`cuvil.schedule.records`)."""
    from cuvil.runtime.module import Module
    from cuvil.target import Target

    if tuning_db is not None:  # the best tuned schedule of this program replaces s, if there is one
        from cuvil.runtime.threads import get_num_threads
        from cuvil.schedule.records import apply_best

        s = apply_best(s, args, target, tuning_db, board, threads=get_num_threads())
    func = lower(s, args, name=name, bounds_checks=bounds_checks)
    tgt = target if isinstance(target, Target) else Target(target)
    if tgt.kind == "cuda":  # CUDA C -> NVRTC -> PTX (cuvil.codegen.cuda)
        from cuvil.runtime.cuda import CudaModule

        return CudaModule(func, tgt)
    return Module(func, tgt)
