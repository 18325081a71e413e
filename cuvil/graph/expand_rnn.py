"""The graph pass that expands ONNX's recurrent operators (LSTM, GRU, RNN) into nodes the graph
compiler already has builders for, unrolled over the (static) sequence length.

Per direction, one ``MatMul`` projects the inputs of every step at once (``X[T * B, I] @ W^T`` plus
the input bias: a contraction the auto-scheduler packs), one ``Split`` hands each step its row
block, and each step is a small ``MatMul`` of the previous hidden state with ``R^T`` followed by
element-wise gate nodes, which the fusion pass groups into a few kernels.  Identical steps give
identical kernels, compiled once.  An LSTM step, for instance::

    g          = MatMul(h, R^T) + xp[t]            (B, 4H)   gates i, o, f, c (ONNX's order)
    i, o, f, c = Split(g)
    C          = Sigmoid(f) * C + Sigmoid(i) * Tanh(c)
    h          = Sigmoid(o) * Tanh(C)

Constant weights (initializers) are sliced, transposed and their biases summed with numpy here;
weights fed at run time get ``Gather`` / ``Slice`` / ``Transpose`` nodes instead.  ``sequence_lens``
masks the steps past each sequence's end (``Where``: the state is kept, ``Y`` is zero there), which
is also what a reverse direction needs.  The new nodes are named after the original one
(``lstm_1/fw/t3/gates``), so errors and profiles point at it.

A node this pass cannot expand (symbolic sizes, an unknown activation) is kept, with the reason in
its attribute :data:`UNEXPANDED`; the op's builder (``cuvil/graph/ops/rnn.py``) reports it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from cuvil.graph.ir import Graph, Node

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
UNEXPANDED = "_cuvil_unexpanded"
FAN = 8  # outputs of one Split, inputs of one Concat, in the trees that hand out and gather the steps
_DEFAULT_ACTS = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}
# ONNX activation name -> (op type, attribute names taking activation_alpha / activation_beta, defaults)
_ACTS: dict[str, tuple[str, tuple[str, ...], tuple[float, ...]]] = {
    "sigmoid": ("Sigmoid", (), ()), "tanh": ("Tanh", (), ()), "relu": ("Relu", (), ()),
    "softsign": ("Softsign", (), ()), "softplus": ("Softplus", (), ()),
    "leakyrelu": ("LeakyRelu", ("alpha",), (0.01,)), "thresholdedrelu": ("ThresholdedRelu", ("alpha",), (1.0,)),
    "elu": ("Elu", ("alpha",), (1.0,)), "hardsigmoid": ("HardSigmoid", ("alpha", "beta"), (0.2, 0.5)),
    "affine": ("Affine", ("alpha", "beta"), (1.0, 0.0)), "scaledtanh": ("ScaledTanh", ("alpha", "beta"), (1.0, 1.0)),
}

Value = str | np.ndarray  # a graph value's name, or a constant not yet in the graph


class _Skip(Exception):
    """The node cannot be expanded; the message says why."""


def expand_rnn(g: Graph) -> Graph:
    """Every LSTM / GRU / RNN node of ``g`` replaced by its unrolled steps (see the module docstring)."""
    if not any(n.op_type in GATES and not n.domain for n in g.nodes):
        return g
    taken = set(g.initializers) | {v.name for v in g.inputs} | {o for n in g.nodes for o in n.outputs}
    taken |= {n.name for n in g.nodes}
    inits = dict(g.initializers)
    nodes: list[Node] = []
    for n in g.nodes:
        if n.op_type not in GATES or n.domain:
            nodes.append(n)
            continue
        e = _Emitter(g, n, taken)
        try:
            _expand(e)
        except _Skip as exc:
            nodes.append(replace(n, attrs={**n.attrs, UNEXPANDED: str(exc)}))
            continue
        taken |= e.taken
        inits.update(e.inits)
        nodes.extend(e.nodes)
    return replace(g, nodes=nodes, initializers=inits)


class _Emitter:
    """The nodes and constants replacing one recurrent node, with fresh names derived from its name."""

    def __init__(self, g: Graph, node: Node, taken: set[str]):
        self.g, self.node = g, node
        self.base = node.name or f"{node.op_type.lower()}_{node.outputs[0]}"
        self.taken = set(taken)
        self.nodes: list[Node] = []
        self.inits: dict[str, np.ndarray] = {}
        self.dtype = np.dtype("float32")
        self._cache: dict[tuple, Value] = {}

    def fresh(self, tag: str) -> str:
        name, k = f"{self.base}/{tag}", 1
        while name in self.taken:
            name, k = f"{self.base}/{tag}_{k}", k + 1
        self.taken.add(name)
        return name

    def name(self, v: Value, tag: str = "const") -> str:
        if isinstance(v, str):
            return v
        c = self.fresh(tag)
        self.inits[c] = np.require(v, requirements="C")  # (ascontiguousarray makes 0-d arrays 1-d)
        return c

    def op(self, op_type: str, inputs: list[Value], tag: str, n_out: int = 1, out: str | None = None,
           **attrs: Any) -> list[str]:
        nm = self.fresh(tag)
        outs = [out] if out is not None else [nm] if n_out == 1 else [f"{nm}:{k}" for k in range(n_out)]
        self.taken.update(outs)
        ins = tuple(self.name(x, f"{tag}_c{k}") for k, x in enumerate(inputs))
        self.nodes.append(Node(op_type, nm, ins, tuple(outs), attrs))
        return outs

    def one(self, op_type: str, inputs: list[Value], tag: str, out: str | None = None, **attrs: Any) -> str:
        return self.op(op_type, inputs, tag, out=out, **attrs)[0]

    # -- what the graph knows ---------------------------------------------------------------
    def const(self, name: str) -> np.ndarray | None:
        return self.g.initializers.get(name) if name else None

    def shape(self, name: str) -> tuple[int, ...] | None:
        if name in self.g.initializers:
            return self.g.initializers[name].shape
        for v in list(self.g.inputs) + list(self.g.value_info.values()):
            if v.name == name:
                s = v.shape
                return tuple(s) if s is not None and all(isinstance(d, int) for d in s) else None  # type: ignore
        return None

    def scalar(self, v: float) -> np.ndarray:
        return np.asarray(v, self.dtype)

    # -- opset-independent spellings ----------------------------------------------------------
    def reshape(self, x: Value, shape: list[int], tag: str, out: str | None = None) -> Value:
        if isinstance(x, np.ndarray):
            x = x.reshape(shape)
            return self.one("Identity", [x], tag, out=out) if out is not None else x
        return self.one("Reshape", [x, np.asarray(shape, np.int64)], tag, out=out)

    def split(self, x: str, sizes: list[int], axis: int, tag: str) -> list[str]:
        if len(sizes) == 1:
            return [x]
        if self.g.opset >= 13:
            return self.op("Split", [x, np.asarray(sizes, np.int64)], tag, n_out=len(sizes), axis=axis)
        return self.op("Split", [x], tag, n_out=len(sizes), axis=axis, split=list(sizes))

    def steps(self, x: str, n: int, rows: int, tag: str) -> list[str]:
        """``x`` split along axis 0 into ``n`` blocks of ``rows`` rows, as a tree of Splits of at most
        :data:`FAN` outputs (a kernel with 64 outputs costs isl far more than 9 kernels with 8: the
        blocks of one level have equal shapes, so the level compiles once)."""
        if n <= FAN:
            return self.split(x, [rows] * n, 0, tag)
        per = -(-n // FAN)
        counts = [min(per, n - k) for k in range(0, n, per)]
        out: list[str] = []
        for k, (part, cnt) in enumerate(zip(self.split(x, [c * rows for c in counts], 0, tag), counts)):
            out.extend(self.steps(part, cnt, rows, f"{tag}{k}_"))
        return out

    def concat(self, parts: list[str], tag: str) -> str:
        """``parts`` joined along axis 0, as a tree of Concats of at most :data:`FAN` inputs."""
        if len(parts) == 1:
            return parts[0]
        if len(parts) <= FAN:
            return self.one("Concat", parts, tag, axis=0)
        per = -(-len(parts) // FAN)
        return self.concat([self.concat(parts[k:k + per], f"{tag}{k // per}_") for k in range(0, len(parts), per)],
                           tag)

    def take(self, src: str, d: int, axis: int, lo: int, hi: int, transpose: bool, tag: str) -> Value:
        """``src`` at index ``d`` of ``axis``, rows ``lo:hi`` of what is left, transposed if asked."""
        key = (src, d, axis, lo, hi, transpose)
        if key in self._cache:
            return self._cache[key]
        arr = self.const(src)
        v: Value
        if arr is not None:
            v = np.take(arr, d, axis=axis)[lo:hi]
            v = np.ascontiguousarray(v.T if transpose else v)
        else:
            v = self.one("Gather", [src, np.asarray(d, np.int64)], f"{tag}_d", axis=axis)
            full = self.shape(src)
            if full is None or (lo, hi) != (0, [n for k, n in enumerate(full) if k != axis][0]):
                if self.g.opset >= 10:
                    v = self.one("Slice", [v, np.asarray([lo], np.int64), np.asarray([hi], np.int64),
                                           np.asarray([0], np.int64)], f"{tag}_rows")
                else:
                    v = self.one("Slice", [v], f"{tag}_rows", starts=[lo], ends=[hi], axes=[0])
            if transpose:
                v = self.one("Transpose", [v], f"{tag}_t", perm=[1, 0])
        self._cache[key] = v
        return v

    def add(self, a: Value | None, b: Value | None, tag: str) -> Value | None:
        if a is None or b is None:
            return a if b is None else b
        if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
            return (a + b).astype(self.dtype)
        return self.one("Add", [a, b], tag)

    def activation(self, spec: tuple[str, float | None, float | None], x: str, tag: str) -> str:
        kind, alpha, beta = spec
        op_type, names, defaults = _ACTS[kind]
        vals = [v if v is not None else dflt for v, dflt in zip((alpha, beta), defaults)]
        if op_type == "Affine":
            return self.one("Add", [self.one("Mul", [x, self.scalar(vals[0])], f"{tag}_a"), self.scalar(vals[1])], tag)
        if op_type == "ScaledTanh":
            t = self.one("Tanh", [self.one("Mul", [x, self.scalar(vals[1])], f"{tag}_b")], f"{tag}_t")
            return self.one("Mul", [t, self.scalar(vals[0])], tag)
        return self.one(op_type, [x], tag, **{k: float(v) for k, v in zip(names, vals)})


def _attr_str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _activations(e: _Emitter, n_dir: int) -> list[list[tuple[str, float | None, float | None]]]:
    """Per direction, the activation functions (f, g[, h]) with their alpha and beta, if given."""
    node = e.node
    per = len(_DEFAULT_ACTS[node.op_type])
    names = node.attrs.get("activations")
    names = [_attr_str(a) for a in names] if names is not None else _DEFAULT_ACTS[node.op_type] * n_dir
    if len(names) != per * n_dir:
        raise _Skip(f"activations {names}: expected {per * n_dir} ({per} per direction)")
    alphas = [float(a) for a in node.attrs.get("activation_alpha", [])]
    betas = [float(b) for b in node.attrs.get("activation_beta", [])]
    specs: list[tuple[str, float | None, float | None]] = []
    ia = ib = 0
    for k, nm in enumerate(names):
        kind = nm.lower()
        if kind not in _ACTS:
            raise _Skip(f"activation {nm!r} is not supported (supported: {', '.join(sorted(_ACTS))})")
        takes = _ACTS[kind][1]
        a = b = None
        if "alpha" in takes:  # aligned with the activations when one is given per activation, else in order
            a = alphas[k] if len(alphas) == len(names) else alphas[ia] if ia < len(alphas) else None
            ia += 1
        if "beta" in takes:
            b = betas[k] if len(betas) == len(names) else betas[ib] if ib < len(betas) else None
            ib += 1
        specs.append((kind, a, b))
    return [specs[d * per:(d + 1) * per] for d in range(n_dir)]


def _expand(e: _Emitter) -> None:
    node = e.node
    kind = node.op_type
    ng = GATES[kind]
    ins = list(node.inputs) + [""] * (8 - len(node.inputs))
    X, W, R, Bn, seq, h0, c0, P = ins[:8]
    outs = list(node.outputs) + [""] * (3 - len(node.outputs))
    xs, ws, rs = e.shape(X), e.shape(W), e.shape(R)
    if xs is None or ws is None or rs is None:
        raise _Skip("the shapes of X, W and R must be static (the steps are unrolled at compile time)")
    layout = int(node.attrs.get("layout", 0))
    if len(xs) != 3 or layout not in (0, 1):
        raise _Skip(f"X of shape {list(xs)} with layout={layout}")
    T, B, n_in = (xs[0], xs[1], xs[2]) if layout == 0 else (xs[1], xs[0], xs[2])
    direction = _attr_str(node.attrs.get("direction", "forward"))
    if direction not in ("forward", "reverse", "bidirectional"):
        raise _Skip(f"direction {direction!r}")
    nd = 2 if direction == "bidirectional" else 1
    H = int(node.attrs.get("hidden_size", rs[-1]))
    if ws != (nd, ng * H, n_in) or rs != (nd, ng * H, H):
        raise _Skip(f"W {list(ws)} and R {list(rs)} do not fit X {list(xs)}, hidden_size {H} and {nd} direction(s)")
    if T < 1 or B < 1:
        raise _Skip(f"an empty sequence (X of shape {list(xs)})")
    if node.attrs.get("input_forget") and kind != "LSTM":
        raise _Skip("input_forget is an LSTM attribute")
    w = e.const(W)
    if w is not None:
        e.dtype = w.dtype
    elif e.g.value_info.get(X) is not None or any(v.name == X for v in e.g.inputs):
        vi = e.g.value_info.get(X) or next(v for v in e.g.inputs if v.name == X)
        e.dtype = np.dtype(vi.dtype or "float32")
    if e.dtype.kind != "f":
        raise _Skip(f"X is {e.dtype}; a float tensor is needed")
    acts = _activations(e, nd)
    clip = node.attrs.get("clip")
    masks = _masks(e, seq, T, B)
    # the inputs of every step, time-major rows: [T * B, I]
    if layout == 0 or B == 1:
        x2 = e.reshape(X, [T * B, n_in], "x")
    else:
        x2 = e.reshape(e.one("Transpose", [X], "x_tb", perm=[1, 0, 2]), [T * B, n_in], "x")
    results = []
    for d in range(nd):
        tag = "bw" if direction == "reverse" or d == 1 else "fw"
        results.append(_direction(e, d, tag, x2, (T, B, H), (Bn, h0, c0, P, R, W), layout, acts[d], clip, masks))
    _outputs(e, results, outs, (T, B, H), layout)


def _masks(e: _Emitter, seq: str, T: int, B: int) -> list[str] | None:
    """Per step, a (B, 1) boolean: the step is inside each sequence (None when all are full)."""
    if not seq:
        return None
    lens = e.const(seq)
    if lens is not None and np.all(lens == T):
        return None
    steps = np.arange(T, dtype=np.int32).reshape(T, 1)
    lens32 = e.one("Cast", [e.reshape(seq, [1, B], "lens")], "lens32", to=6)  # INT32
    inside = e.one("Less", [steps, lens32], "inside")  # (T, B)
    return [e.reshape(m, [B, 1], f"inside{t}") for t, m in enumerate(e.steps(inside, T, 1, "inside_t"))]


def _direction(e: _Emitter, d: int, tag: str, x2: Value, sizes: tuple[int, int, int], srcs: tuple[str, ...],
               layout: int, acts: list, clip: Any, masks: list[str] | None) -> tuple[list[str], str, str | None]:
    """One direction unrolled: its per-step outputs (time order), last hidden state and last cell state."""
    kind = e.node.op_type
    T, B, H = sizes
    Bn, h0, c0, P, R, W = srcs
    ng = GATES[kind]
    lbr = kind == "GRU" and int(e.node.attrs.get("linear_before_reset", 0)) != 0
    WT = e.take(W, d, 0, 0, ng * H, True, f"{tag}/W")
    wb = e.take(Bn, d, 0, 0, ng * H, False, f"{tag}/Wb") if Bn else None
    rb = e.take(Bn, d, 0, ng * H, 2 * ng * H, False, f"{tag}/Rb") if Bn else None
    xbias = wb if lbr else e.add(wb, rb, f"{tag}/bias")
    xp = e.one("MatMul", [x2, WT], f"{tag}/xw")
    if xbias is not None:
        xp = e.one("Add", [xp, xbias], f"{tag}/xp")
    xps = e.steps(xp, T, B, f"{tag}/xp_t")
    hax = 0 if layout == 0 else 1
    zeros = np.zeros((B, H), e.dtype)
    h: Value = e.take(h0, d, hax, 0, B, False, f"{tag}/h0") if h0 else zeros
    c: Value = e.take(c0, d, hax, 0, B, False, f"{tag}/c0") if c0 else zeros
    peep = [e.take(P, d, 0, k * H, (k + 1) * H, False, f"{tag}/P{k}") for k in range(3)] if P else None
    cell = {"LSTM": _lstm_step, "GRU": _gru_step, "RNN": _rnn_step}[kind]
    ys: list[str] = [""] * T
    order = range(T - 1, -1, -1) if tag == "bw" else range(T)
    for t in order:
        st = f"{tag}/t{t}"
        env = {"xp": xps[t], "h": h, "c": c, "R": R, "d": d, "H": H, "acts": acts, "clip": clip, "peep": peep,
               "rb": rb, "lbr": lbr}
        hn, cn = cell(e, st, env)
        if masks is not None:
            y = e.one("Where", [masks[t], hn, zeros], f"{st}/y")
            hn = e.one("Where", [masks[t], hn, h], f"{st}/h_kept")
            if cn is not None:
                cn = e.one("Where", [masks[t], cn, c], f"{st}/c_kept")
            ys[t] = y
        else:
            ys[t] = hn
        h, c = hn, cn if cn is not None else c
    return ys, e.name(h), e.name(c) if kind == "LSTM" else None


def _clip(e: _Emitter, x: str, clip: Any, tag: str) -> str:
    if clip is None:
        return x
    return e.one("Min", [e.one("Max", [x, e.scalar(-float(clip))], f"{tag}_lo"), e.scalar(float(clip))], f"{tag}_clip")


def _zero(v: Value) -> bool:
    """A state known to be zero (no initial state given, or a constant zero one)."""
    return isinstance(v, np.ndarray) and not v.any()


def _gates(e: _Emitter, st: str, env: dict, ng: int) -> str:
    """``h @ R^T + xp[t]`` (B, ng * H): the step's gate inputs (just ``xp[t]`` while ``h`` is zero)."""
    if _zero(env["h"]):
        return env["xp"]
    RT = e.take(env["R"], env["d"], 0, 0, ng * env["H"], True, st.split("/")[0] + "/R")
    return e.one("Add", [e.one("MatMul", [env["h"], RT], f"{st}/hr"), env["xp"]], f"{st}/gates")


def _lstm_step(e: _Emitter, st: str, env: dict) -> tuple[str, str]:
    H, acts, clip, peep = env["H"], env["acts"], env["clip"], env["peep"]
    g = _gates(e, st, env, 4)
    i, o, f, cc = e.split(g, [H] * 4, 1, f"{st}/iofc")
    c = env["c"]
    if peep is not None and not _zero(c):
        i = e.one("Add", [i, e.one("Mul", [c, peep[0]], f"{st}/pi")], f"{st}/i_p")
        f = e.one("Add", [f, e.one("Mul", [c, peep[2]], f"{st}/pf")], f"{st}/f_p")
    i = e.activation(acts[0], _clip(e, i, clip, f"{st}/i"), f"{st}/i")
    if e.node.attrs.get("input_forget"):
        f = e.one("Sub", [e.scalar(1.0), i], f"{st}/f")
    else:
        f = e.activation(acts[0], _clip(e, f, clip, f"{st}/f"), f"{st}/f")
    cc = e.activation(acts[1], _clip(e, cc, clip, f"{st}/g"), f"{st}/g")
    if _zero(c):
        C = e.one("Mul", [i, cc], f"{st}/c")
    else:
        C = e.one("Add", [e.one("Mul", [f, c], f"{st}/fc"), e.one("Mul", [i, cc], f"{st}/ig")], f"{st}/c")
    if peep is not None:
        o = e.one("Add", [o, e.one("Mul", [C, peep[1]], f"{st}/po")], f"{st}/o_p")
    o = e.activation(acts[0], _clip(e, o, clip, f"{st}/o"), f"{st}/o")
    h = e.one("Mul", [o, e.activation(acts[2], C, f"{st}/hc")], f"{st}/h")
    return h, C


def _gru_step(e: _Emitter, st: str, env: dict) -> tuple[str, None]:
    H, acts, clip, h, d, R = env["H"], env["acts"], env["clip"], env["h"], env["d"], env["R"]
    tag = st.split("/")[0]
    xz, xr, xh = e.split(env["xp"], [H] * 3, 1, f"{st}/x_zrh")
    if env["lbr"]:
        rec = e.one("MatMul", [h, e.take(R, d, 0, 0, 3 * H, True, f"{tag}/R")], f"{st}/hr")
        if env["rb"] is not None:
            rec = e.one("Add", [rec, env["rb"]], f"{st}/hr_b")
        rz, rr, rh = e.split(rec, [H] * 3, 1, f"{st}/h_zrh")
    else:
        rec = e.one("MatMul", [h, e.take(R, d, 0, 0, 2 * H, True, f"{tag}/Rzr")], f"{st}/hr")
        rz, rr = e.split(rec, [H] * 2, 1, f"{st}/h_zr")
    z = e.activation(acts[0], _clip(e, e.one("Add", [xz, rz], f"{st}/z_in"), clip, f"{st}/z"), f"{st}/z")
    r = e.activation(acts[0], _clip(e, e.one("Add", [xr, rr], f"{st}/r_in"), clip, f"{st}/r"), f"{st}/r")
    if env["lbr"]:
        hin = e.one("Add", [xh, e.one("Mul", [r, rh], f"{st}/r_hr")], f"{st}/hh_in")
    else:
        rh = e.one("MatMul", [e.one("Mul", [r, h], f"{st}/rh"), e.take(R, d, 0, 2 * H, 3 * H, True, f"{tag}/Rh")],
                   f"{st}/rh_r")
        hin = e.one("Add", [xh, rh], f"{st}/hh_in")
    hh = e.activation(acts[1], _clip(e, hin, clip, f"{st}/hh"), f"{st}/hh")
    # (1 - z) * hh + z * h  ==  hh + z * (h - hh)
    hn = e.one("Add", [hh, e.one("Mul", [z, e.one("Sub", [h, hh], f"{st}/dh")], f"{st}/zdh")], f"{st}/h")
    return hn, None


def _rnn_step(e: _Emitter, st: str, env: dict) -> tuple[str, None]:
    a = _gates(e, st, env, 1)
    return e.activation(env["acts"][0], _clip(e, a, env["clip"], f"{st}/a"), f"{st}/h"), None


def _outputs(e: _Emitter, results: list[tuple[list[str], str, str | None]], outs: list[str],
             sizes: tuple[int, int, int], layout: int) -> None:
    """Y (T, D, B, H) or (B, T, D, H); Y_h and Y_c (D, B, H) or (B, D, H), under the node's output names."""
    T, B, H = sizes
    nd = len(results)
    y, yh, yc = outs[:3]
    if y:
        per_dir = []
        for d, (ys, _, _) in enumerate(results):
            steps = [e.reshape(s, [1, 1, B, H], f"y{d}_{t}") for t, s in enumerate(ys)]
            per_dir.append(e.concat(steps, f"y{d}"))
        full = e.one("Concat", per_dir, "y", axis=1) if nd > 1 else per_dir[0]  # (T, D, B, H)
        if layout == 0:
            e.one("Identity", [full], "y_out", out=y)
        elif B == 1:
            e.reshape(full, [B, T, nd, H], "y_out", out=y)
        else:
            e.one("Transpose", [full], "y_out", out=y, perm=[2, 0, 1, 3])
    for name, k in ((yh, 1), (yc, 2)):
        if not name or (k == 2 and e.node.op_type != "LSTM"):
            continue
        parts = [e.reshape(r[k], [1, B, H], f"last{k}_{d}") for d, r in enumerate(results)]  # type: ignore[arg-type]
        full = e.one("Concat", parts, f"last{k}", axis=0) if nd > 1 else parts[0]
        if layout == 0 or B == 1 or nd == 1:
            e.reshape(full, [B, nd, H] if layout else [nd, B, H], f"last{k}_out", out=name)
        else:
            e.one("Transpose", [full], f"last{k}_out", out=name, perm=[1, 0, 2])
