"""``cuvil bench --ops``: auto-scheduled operators beside numpy and onnxruntime (one-node models).

Each row builds one operator with ``auto_schedule`` (no tuning), checks it
against the reference, and prints the median time, GFLOP/s (or GB/s for
memory-bound operators), the compile time and the ratio reference / cuvil
(> 1: cuvil is faster) at each thread count, and the share of the machine's
measured fp32 peak (:func:`peak_flops`).  numpy is pinned to the same
thread count with threadpoolctl when it is installed.

Convolution filters are constants of the layer, as in an inference model: both
onnxruntime and cuvil (``cuvil.onnx.InferenceSession``, which calls
``auto_schedule`` per node and packs constant filters at compile time) run the
same one-node model with the filters as an initializer.  The ``(W fed)`` row
feeds them per call to both instead (each then repacks them every call).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Workload:
    name: str
    build: Callable[[], tuple[list[Any], list[np.ndarray]]]  # -> (te args, input arrays)
    reference: Callable[..., np.ndarray] | None  # numpy version of the operator (timed too), or None
    flops: float  # 0 for memory-bound rows (then bytes are used)
    nbytes: float = 0.0
    onnx: Callable[[list[np.ndarray]], Any] | None = None  # a one-node ONNX model of the operator
    # inputs that are constants of the model (conv filters): both onnxruntime and cuvil run the one-node
    # model with them as initializers (cuvil through cuvil.onnx.InferenceSession, which packs them at
    # compile time, as onnxruntime prepacks them); every other input is fed per call
    constants: tuple[int, ...] = ()


def _onnx_model(op: str, inputs: list[np.ndarray], out_shape: tuple[int, ...],
                inits: dict[str, np.ndarray] | None = None, **attrs: Any) -> Any:
    """A one-node float32 ONNX model: inputs x0, x1, ... (+ initializers), output y."""
    from onnx import TensorProto, helper, numpy_helper

    names = [f"x{k}" for k in range(len(inputs))]
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(a.shape)) for n, a in zip(names, inputs)]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, list(out_shape))
    inits = inits or {}
    node = helper.make_node(op, names + list(inits), ["y"], **attrs)
    graph = helper.make_graph([node], op.lower(), ins, [out],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _matmul(m: int, n: int, k: int, batch: int = 0) -> Workload:
    def build() -> tuple[list[Any], list[np.ndarray]]:
        from cuvil import te

        rng = np.random.default_rng(0)
        if batch:
            A = te.placeholder((batch, m, k), name="A")
            B = te.placeholder((batch, k, n), name="B")
            r = te.reduce_axis((0, k), name="k")
            C = te.compute((batch, m, n), lambda b, i, j: te.sum(A[b, i, r] * B[b, r, j], axis=r), name="C")
            return [A, B, C], [rng.standard_normal((batch, m, k), dtype=np.float32),
                               rng.standard_normal((batch, k, n), dtype=np.float32)]
        from cuvil.te import ops

        A = te.placeholder((m, k), name="A")
        B = te.placeholder((k, n), name="B")
        return [A, B, ops.matmul(A, B)], [rng.standard_normal((m, k), dtype=np.float32),
                                          rng.standard_normal((k, n), dtype=np.float32)]

    label = f"batch matmul {batch}x{m}x{n}x{k}" if batch else f"matmul {m}x{n}x{k}"
    shape = (batch, m, n) if batch else (m, n)
    return Workload(label, build, np.matmul, 2.0 * m * n * k * max(batch, 1),
                    onnx=lambda xs: _onnx_model("MatMul", xs, shape))


def _conv(n: int, c: int, h: int, f: int, kh: int, stride: int, pad: int, groups: int = 1,
          fed: bool = False) -> Workload:
    oh = (h + 2 * pad - kh) // stride + 1

    def build() -> tuple[list[Any], list[np.ndarray]]:
        from cuvil import te
        from cuvil.te import ops

        rng = np.random.default_rng(0)
        X = te.placeholder((n, c, h, h), name="X")
        W = te.placeholder((f, c // groups, kh, kh), name="W")
        Y = ops.conv2d_nchw(X, W, stride=stride, padding=pad, groups=groups)
        return [X, W, Y], [rng.standard_normal((n, c, h, h), dtype=np.float32),
                           rng.standard_normal((f, c // groups, kh, kh), dtype=np.float32)]

    kind = "depthwise" if groups == c and groups > 1 else "conv2d"
    flops = 2.0 * n * f * oh * oh * (c // groups) * kh * kh
    consts = () if fed else (1,)

    def model(xs: list[np.ndarray]) -> Any:
        return _onnx_model("Conv", [x for k, x in enumerate(xs) if k not in consts], (n, f, oh, oh),
                           inits={f"x{k}": xs[k] for k in consts}, strides=[stride] * 2, pads=[pad] * 4, group=groups)

    return Workload(f"{kind} {c}->{f} {kh}x{kh}/{stride} {h}x{h}" + (" (W fed)" if fed else ""), build, None, flops,
                    onnx=model, constants=consts)


def _softmax(rows: int, cols: int) -> Workload:
    def build() -> tuple[list[Any], list[np.ndarray]]:
        from cuvil import te

        X = te.placeholder((rows, cols), name="X")
        k1 = te.reduce_axis((0, cols), name="k1")
        k2 = te.reduce_axis((0, cols), name="k2")
        mx = te.compute((rows,), lambda i: te.max(X[i, k1], axis=k1), name="mx")
        e = te.compute((rows, cols), lambda i, j: te.exp(X[i, j] - mx[i]), name="e")
        s = te.compute((rows,), lambda i: te.sum(e[i, k2], axis=k2), name="s")
        Y = te.compute((rows, cols), lambda i, j: e[i, j] / s[i], name="softmax")
        return [X, Y], [np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)]

    def ref(x: np.ndarray) -> np.ndarray:
        e = np.exp(x - x.max(1, keepdims=True))
        return e / e.sum(1, keepdims=True)

    return Workload(f"softmax {rows}x{cols}", build, ref, 0.0, 2.0 * rows * cols * 4,
                    onnx=lambda xs: _onnx_model("Softmax", xs, (rows, cols), axis=1))


def _layernorm(rows: int, cols: int) -> Workload:
    def build() -> tuple[list[Any], list[np.ndarray]]:
        from cuvil import te

        X = te.placeholder((rows, cols), name="X")
        k1 = te.reduce_axis((0, cols), name="k1")
        k2 = te.reduce_axis((0, cols), name="k2")
        mean = te.compute((rows,), lambda i: te.sum(X[i, k1], axis=k1), name="sum")
        d = te.compute((rows, cols), lambda i, j: X[i, j] - mean[i] / cols, name="d")
        var = te.compute((rows,), lambda i: te.sum(d[i, k2] * d[i, k2], axis=k2), name="var")
        Y = te.compute((rows, cols), lambda i, j: d[i, j] * te.rsqrt(var[i] / cols + 1e-5), name="layernorm")
        return [X, Y], [np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)]

    def ref(x: np.ndarray) -> np.ndarray:
        d = x - x.mean(1, keepdims=True)
        return d / np.sqrt((d * d).mean(1, keepdims=True) + 1e-5)

    return Workload(f"layernorm {rows}x{cols}", build, ref, 0.0, 2.0 * rows * cols * 4,
                    onnx=lambda xs: _onnx_model("LayerNormalization", xs, (rows, cols),
                                                {"scale": np.ones(cols, np.float32)}, axis=-1, epsilon=1e-5))


def workloads(quick: bool = False) -> list[Workload]:
    rows = [_matmul(1024, 1024, 1024), _matmul(1000, 1000, 1000), _matmul(127, 255, 63),
            _matmul(128, 128, 64, batch=12), _conv(1, 64, 56, 64, 3, 1, 1), _conv(1, 32, 112, 32, 3, 1, 1, groups=32),
            _softmax(128, 768), _layernorm(128, 768)]
    if not quick:
        rows.insert(1, _matmul(4096, 4096, 1024))
        # the other ResNet-50 layer shapes: 3x3 at every stage, 1x1 reductions/expansions, a strided 3x3
        rows[6:6] = [_conv(1, 128, 28, 128, 3, 1, 1), _conv(1, 256, 14, 256, 3, 1, 1), _conv(1, 512, 7, 512, 3, 1, 1),
                     _conv(1, 512, 7, 512, 3, 1, 1, fed=True), _conv(1, 256, 56, 64, 1, 1, 0),
                     _conv(1, 64, 56, 256, 1, 1, 0), _conv(1, 1024, 14, 256, 1, 1, 0), _conv(1, 128, 56, 128, 3, 2, 1)]
        # MobileNetV2's depthwise layers after the first
        rows[15:15] = [_conv(1, 144, 56, 144, 3, 1, 1, groups=144), _conv(1, 384, 14, 384, 3, 1, 1, groups=384),
                       _conv(1, 960, 7, 960, 3, 1, 1, groups=960)]
    return rows


def peak_flops(threads: int, k: int = 1 << 16) -> float:
    """The machine's measured fp32 peak at ``threads`` threads, in FLOP/s: a cuvil kernel whose inner
    loop is only independent FMAs on registers (per thread, 12 accumulator vectors x one broadcast)::

        parallel for (b < threads) for (r < k) for (a < 12, unrolled) Y.local[a, 0:V] += X[b, a, 0:V] * W[r]
    """
    from cuvil import target, te

    lanes = target.Target("llvm").panel_lanes(4)
    X = te.placeholder((threads, 12, lanes), name="X")
    W = te.placeholder((k,), name="W")
    r = te.reduce_axis((0, k), name="r")
    Y = te.compute((threads, 12, lanes), lambda b, a, v: te.sum(X[b, a, v] * W[r], axis=r), name="Y")
    s = te.create_schedule([Y])
    sy, sl = s[Y], s[s.cache_write(Y, "local")]
    sy.parallel(sy.op.axis[0])
    sl.compute_at(sy, sy.op.axis[0])
    lb, la, lv = sl.op.axis
    sl.reorder(lb, sl.op.reduce_axis[0], la, lv)
    sl.unroll(la)
    sl.vectorize(lv)
    import cuvil

    mod = cuvil.build(s, [X, W, Y])
    x = np.ones((threads, 12, lanes), np.float32)
    w = np.full(k, 0.5, np.float32)
    y = np.empty_like(x)
    with _threads(threads):
        return 2.0 * x.size * k / min(median_time(lambda: mod(x, w, y)) for _ in range(3))


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    import cuvil

    cuvil.set_num_threads(n)
    try:
        from threadpoolctl import threadpool_limits  # type: ignore[import-not-found]

        ctx: Any = threadpool_limits(limits=n)
    except ImportError:  # numpy then uses its default thread count: said in the header
        ctx = contextlib.nullcontext()
    try:
        with ctx:
            yield
    finally:
        cuvil.set_num_threads(None)


def median_time(fn: Callable[[], Any], repeat: int = 5, budget_s: float = 0.2,
                clock: Callable[[], float] = time.perf_counter) -> float:
    """Median seconds of at least ``repeat`` calls of ``fn`` after one warm-up call; fast functions are
    called more often, until ``budget_s`` seconds (at most 1000 calls): a noisy machine needs samples.
    ``clock=time.thread_time`` counts this thread's CPU time only (single-threaded code on a shared machine:
    another process's time slices do not count)."""
    fn()
    ts: list[float] = []
    start = clock()
    while len(ts) < repeat or (clock() - start < budget_s and len(ts) < 1000):
        t0 = clock()
        fn()
        ts.append(clock() - t0)
    return float(np.median(ts))


SETTLE_S = 0.15  # seconds between rivals at more than one thread (see interleaved)


def interleaved(rivals: dict[str, Callable[[], Any]], rounds: int = 7, budget_s: float = 0.04,
                settle_s: float = 0.0) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds of each rival and the median over rounds of (rival time / cuvil time).

    Each round times every rival (a median of its calls for ``budget_s``) in a rotating order, so a
    ratio compares times taken a moment apart: on a shared machine whose speed drifts by 10-40%
    between seconds, the ratio of medians taken one after the other drifts with it.  ``settle_s``:
    a pause before each rival, for the idle threads of the one before to stop spinning (with 2
    threads, onnxruntime's pool spins for 20-100 ms after a run: a 128x768 softmax timed right after
    it took 0.21 ms instead of 0.04)."""
    names = list(rivals)
    per: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            time.sleep(settle_s)
            per[n].append(median_time(rivals[n], 3, budget_s))
    times = {n: float(np.median(v)) for n, v in per.items()}
    ratios = {n: float(np.median([t / c for t, c in zip(v, per["cuvil"])])) for n, v in per.items()}
    return times, ratios


def _ort_session(model: Any, threads: int) -> Any:
    import onnxruntime as ort  # type: ignore[import-not-found]

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


@dataclass
class Comparison:
    """One workload at one thread count: cuvil's median time and the rivals' beside it (ratio =
    rival time / cuvil time, > 1: cuvil is faster), the compile time and what did not match."""

    threads: int
    compile_s: float
    cuvil_s: float
    numpy_s: float | None = None
    numpy_ratio: float | None = None
    ort_s: float | None = None
    ort_ratio: float | None = None
    max_rel_err: float | None = None
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems


def compare(w: Workload, threads: list[int], rounds: int = 7, have_ort: bool = True) -> list[Comparison]:
    """Build ``w`` with ``auto_schedule`` (its constants through an InferenceSession), check it against
    its numpy reference and onnxruntime, and time the three interleaved at each thread count."""
    import cuvil

    args, inputs = w.build()
    t0 = time.perf_counter()
    if w.constants:  # the one-node model, its constants as initializers, through cuvil's ONNX session
        from cuvil.onnx import InferenceSession

        sess_c = InferenceSession(w.onnx(inputs).SerializeToString())  # type: ignore[misc]
        fed = {f"x{k}": x for k, x in enumerate(inputs) if k not in w.constants}

        def call(s_: Any = sess_c, f_: Any = fed) -> list[np.ndarray]:
            return s_.run(None, f_)
    else:
        mod = cuvil.build(cuvil.auto_schedule(args), args)
        outs = [np.empty([int(d.value) for d in t.shape], t.dtype) for t in args[len(inputs):]]

        def call(m: Any = mod, i: Any = inputs, o: Any = outs) -> list[np.ndarray]:
            m(*i, *o)
            return o
    outs = call()
    compile_s = time.perf_counter() - t0
    problems: list[str] = []
    err = None
    if w.reference is not None:
        ref = w.reference(*[x.astype(np.float64) for x in inputs])
        err = float(np.max(np.abs(outs[0] - ref)) / max(np.max(np.abs(ref)), 1e-30))
        if err > 1e-4:
            problems.append(f"WRONG (max rel err {err:.1e})")
    results = []
    for th in threads:
        rivals: dict[str, Callable[[], Any]] = {"cuvil": call}
        if w.reference is not None:
            rivals["numpy"] = lambda f=w.reference, i=inputs: f(*i)
        if have_ort and w.onnx is not None:
            sess = _ort_session(w.onnx(inputs), th)
            feeds = {f"x{k}": x for k, x in enumerate(inputs) if k not in w.constants}
            got = sess.run(None, feeds)[0]
            if not np.allclose(got, outs[0], rtol=1e-3, atol=1e-3):
                problems.append("cuvil and onnxruntime disagree")
            rivals["ort"] = lambda s_=sess, f_=feeds: s_.run(None, f_)
        with _threads(th):
            times, ratios = interleaved(rivals, rounds, settle_s=SETTLE_S if th > 1 else 0.0)
        results.append(Comparison(th, compile_s, times["cuvil"], times.get("numpy"), ratios.get("numpy"),
                                  times.get("ort"), ratios.get("ort"), err, tuple(dict.fromkeys(problems))))
    return results


def run(threads: list[int], quick: bool = False, rounds: int = 7, only: str | None = None) -> int:
    import cuvil

    try:
        import onnxruntime  # type: ignore[import-not-found]  # noqa: F401

        have_ort = True
    except ImportError:
        have_ort = False

    try:
        import threadpoolctl  # type: ignore[import-not-found]  # noqa: F401

        pinned = "numpy pinned with threadpoolctl"
    except ImportError:
        pinned = "numpy NOT pinned (pip install threadpoolctl)"
    print(f"cuvil {cuvil.__version__}, auto_schedule, no tuning; {pinned}; ratio = reference time / cuvil time "
          f"(median over {rounds} interleaved rounds)"
          + ("" if have_ort else "; onnxruntime not installed (pip install -e '.[bench]')"))
    peaks = {th: peak_flops(th) for th in threads}
    print("measured fp32 peak (a cuvil kernel of independent FMAs): "
          + ", ".join(f"{p / 1e9:.0f} GFLOP/s at {th} thread{'s' if th > 1 else ''}" for th, p in peaks.items()))
    print(f"{'operator':<34}{'compile':>9}{'thr':>4}{'cuvil ms':>10}{'rate':>14}{'peak':>6}{'numpy ms':>10}{'ratio':>7}"
          f"{'ort ms':>9}{'ratio':>7}")
    ok = True
    for w in workloads(quick):
        if only is not None and only not in w.name:
            continue
        said: set[str] = set()
        for c in compare(w, threads, rounds, have_ort):
            ok &= c.ok
            for problem in c.problems:
                if problem not in said:
                    said.add(problem)
                    print(f"{w.name}: {problem}")
            rate = (f"{w.flops / c.cuvil_s / 1e9:8.1f} GFLOP/s" if w.flops
                    else f"{w.nbytes / c.cuvil_s / 1e9:8.1f} GB/s  ")
            share = f"{w.flops / c.cuvil_s / peaks[c.threads]:>6.0%}" if w.flops else f"{'-':>6}"
            ref_s = (f"{c.numpy_s * 1e3:>10.2f}{c.numpy_ratio:>7.2f}" if c.numpy_s is not None
                     else f"{'-':>10}{'-':>7}")
            ort_s = f"{c.ort_s * 1e3:>9.2f}{c.ort_ratio:>7.2f}" if c.ort_s is not None else f"{'-':>9}{'-':>7}"
            print(f"{w.name:<34}{c.compile_s:>8.2f}s{c.threads:>4}{c.cuvil_s * 1e3:>10.2f}{rate:>14}{share}{ref_s}"
                  f"{ort_s}")
    return 0 if ok else 1
