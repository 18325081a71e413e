"""Fusion groups: which nodes of a graph compile into one kernel (a pure decision, printable).

A group is a *root* node (a Conv, MatMul, Gemm, pooling, or any node a kernel computes) followed
by element-wise nodes that read what the group computed, such that the group has one exit: every
value the group produces except the last member's output is read only inside the group and is not
a graph output.  The importer builds one te program per group (each member's builder reads the
earlier members' te tensors instead of placeholders), so the auto-scheduler sees, e.g., a
convolution with its bias, residual add and relu as one contraction with an epilogue::

    h   = Conv(x, W, b)                 group 0: Conv -> Add -> Relu     (exit y)
    s   = Conv(x, Wd, bd)               group 1: Conv                    (exit s)
    a   = Add(h, s)          =>
    y   = Relu(a)                       run in the order of each group's last member:
                                        group 1, then group 0

Members keep the graph's order; a group runs where its last member stood (every value it reads is
computed before that, and nothing outside reads its intermediates).  Chains of element-wise nodes
group likewise, and so do element-wise subgraphs with one exit (erf GELU: ``x * 0.5 * (1 +
erf(x / sqrt 2))`` reads ``x`` twice).  Nodes whose inputs are all constants are left alone (the
importer folds them at compile time).
"""

from __future__ import annotations

from dataclasses import dataclass

from cuvil.graph.ir import Graph, Node

ELEMENTWISE = frozenset({
    "Add", "Sub", "Mul", "Div", "Relu", "Clip", "Sigmoid", "Tanh", "Erf", "Sqrt", "Exp", "Neg", "Abs",
    "LeakyRelu", "HardSigmoid", "HardSwish", "Gelu", "Pow", "Max", "Min", "Sum", "PRelu", "Softplus", "Elu",
    "Selu", "Celu", "Mish", "Reciprocal",
})
# nodes that alias their input or produce compile-time values: they never start a group
_NOT_ROOT = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout", "Shape", "Size",
                       "Constant", "ConstantOfShape"})
WINDOW = 64  # nodes looked at past a group's last member for more element-wise readers


@dataclass(frozen=True)
class Group:
    """Node indices (into ``graph.nodes``, increasing) compiled as one kernel; the last one's first
    output is the group's result."""

    members: tuple[int, ...]

    @property
    def last(self) -> int:
        return self.members[-1]


def _constants(g: Graph) -> set[str]:
    """Values known at compile time: initializers and outputs of nodes that read only those."""
    known = set(g.initializers)
    for n in g.nodes:
        if n.op_type in ("Constant", "Shape", "Size") or (any(n.inputs) and all(not x or x in known for x in n.inputs)):
            known.update(o for o in n.outputs if o)
    return known


# quantized element-wise ops: they group with each other (SiLU's table lookup and QLinearMul), and a
# residual QLinearAdd joins the quantized convolution before it (its requantization epilogue: ResNet-50
# QDQ U8S8, 1 thread, whole run -1.7 ms).  Nothing else joins a quantized contraction: a depthwise
# convolution's taps were computed again for each of SiLU's two reads, and table lookups in a
# contraction's epilogue ran slower than on their own (EfficientNet-B0 QDQ U8S8: 27.5 ms fused, 8.6 ms
# not); a QLinearAdd in a MatMul's epilogue did not pay either (BERT-base).
QUANT_ELEMENTWISE = frozenset({"QLinearAdd", "QLinearMul", "QLinearSigmoid", "QLinearLeakyRelu", "CuvilQLinearLookup"})
_QUANT_CONVS = frozenset({"CuvilQLinearConvNHWC", "CuvilQLinearConv", "QLinearConv"})


def _fusible_member(n: Node, root: Node) -> bool:
    if n.domain or len([o for o in n.outputs if o]) != 1:
        return False
    if n.op_type in ELEMENTWISE:
        return True
    return n.op_type in QUANT_ELEMENTWISE and (
        root.op_type in QUANT_ELEMENTWISE or (n.op_type == "QLinearAdd" and root.op_type in _QUANT_CONVS))


def fusion_groups(g: Graph) -> tuple[Group, ...]:
    """Every node in exactly one group, groups ordered by their last member (the order to run them)."""
    readers: dict[str, set[int]] = {}
    for k, n in enumerate(g.nodes):
        for x in n.inputs:
            if x:
                readers.setdefault(x, set()).add(k)
    outputs = {v.name for v in g.outputs}
    consts = _constants(g)
    claimed: set[int] = set()
    groups: list[Group] = []
    for r, root in enumerate(g.nodes):
        if r in claimed:
            continue
        members = [r]
        claimed.add(r)
        if (not root.domain and root.op_type not in _NOT_ROOT and len(root.outputs) == 1 and root.outputs[0]
                and root.outputs[0] not in consts):
            members = _grow(g, r, readers, outputs, claimed)
            claimed.update(members)
        groups.append(Group(tuple(members)))
    return tuple(sorted(groups, key=lambda grp: grp.last))


def _grow(g: Graph, r: int, readers: dict[str, set[int]], outputs: set[str], claimed: set[int]) -> list[int]:
    """The largest group from root ``r`` (scanning forward) that has one exit."""
    members = [r]
    produced = {g.nodes[r].outputs[0]}
    best = [r]
    for k in range(r + 1, len(g.nodes)):
        if k - members[-1] > WINDOW:
            break
        n = g.nodes[k]
        if not any(x in produced for x in n.inputs):
            continue
        if k in claimed or not _fusible_member(n, g.nodes[r]):
            break  # an outside reader of a group value: no later member can close it
        members.append(k)
        produced.add(n.outputs[0])
        inside = set(members)
        open_ = [v for v in produced if v in outputs or not readers.get(v, set()) <= inside]
        if open_ == [n.outputs[0]]:
            best = list(members)
    return best


def groups_str(g: Graph, groups: tuple[Group, ...]) -> str:
    """One line per group of more than one node: ``exit = Op+Op+Op(root name)``; then the counts."""
    lines = []
    for grp in groups:
        if len(grp.members) > 1:
            nodes = [g.nodes[k] for k in grp.members]
            lines.append(f"  {nodes[-1].outputs[0]} = {'+'.join(n.op_type for n in nodes)} ({nodes[0].name})")
    fused = sum(len(grp.members) for grp in groups if len(grp.members) > 1)
    lines.append(f"  {len(g.nodes)} nodes in {len(groups)} groups ({fused} nodes fused)")
    return "\n".join(lines)
