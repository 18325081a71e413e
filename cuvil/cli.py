"""The ``cuvil`` command line.

    cuvil compile [model.onnx] [-o model.so | -o model.ll] [--shapes x=1,3,224,224 mask=1,128] [--dump]
    cuvil run model.onnx --input x=x.npy [-o out.npz]   # or --random [--shapes ...]; prints each output
    cuvil bench [model.onnx | zoo name ...] [--threads 1,2] [--shapes ...]   # whole models beside onnxruntime
    cuvil bench --ops [--quick] [--only matmul]         # operators beside numpy (cuvil.bench)
    cuvil bench --registry --torch [names] [--config ci]  # torch eager, Inductor, cuvil.torch beside onnxruntime
    cuvil bench --registry [names] --quant qdq-u8s8,dynamic  # int8 files beside onnxruntime and cuvil's fp32
    cuvil bench ... --target x86-64-v3                   # compile for another CPU this one runs (AVX2 here)
    cuvil tune ...                                       # the autotuner (cuvil.autotune.cli)
    cuvil scheduler | worker | cluster status ...        # tuning boards (cuvil.autotune.cluster, docs/boards.md)
    cuvil demo | info                                    # auto-scheduled matmul and conv beside numpy and ort

An error is one line on stderr, ``cuvil: error: ...``, and exit status 1 (2: an internal error, a bug);
``cuvil --traceback <command> ...`` shows Python's traceback instead.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from cuvil.errors import CuvilError


def demo(size: int = 512, rounds: int = 3) -> int:
    """An auto-scheduled matmul and conv2d+relu, checked against numpy and timed beside numpy and
    onnxruntime (interleaved rounds, all cores; ratio = their time / cuvil's, > 1: cuvil is faster)."""
    import cuvil
    from cuvil.bench import compare

    try:
        import onnxruntime  # type: ignore[import-not-found]  # noqa: F401

        have_ort = True
    except ImportError:
        have_ort = False
    threads = cuvil.get_num_threads()
    print(f"cuvil {cuvil.__version__}; target: {target_line(cuvil.Target('llvm'))}")
    print(f"auto_schedule (no tuning, no hand schedule), {threads} thread(s); ratio = their time / cuvil's "
          f"(> 1: cuvil is faster), medians of {rounds} interleaved rounds"
          + ("" if have_ort else "; onnxruntime not installed (pip install onnxruntime)"))
    print(f"{'kernel':<32}{'compile':>9}{'cuvil':>10}{'numpy':>10}{'ratio':>7}{'onnxrt':>10}{'ratio':>7}"
          f"{'max rel err':>13}")
    ok = True
    for w in (_demo_matmul(size), _demo_conv_relu()):
        (c,) = compare(w, [threads], rounds, have_ort)
        ok &= c.ok
        numpy_s = f"{c.numpy_s * 1e3:>8.2f}ms{c.numpy_ratio:>7.2f}" if c.numpy_s is not None else f"{'-':>10}{'-':>7}"
        ort_s = f"{c.ort_s * 1e3:>8.2f}ms{c.ort_ratio:>7.2f}" if c.ort_s is not None else f"{'-':>10}{'-':>7}"
        print(f"{w.name:<32}{c.compile_s:>8.1f}s{c.cuvil_s * 1e3:>8.2f}ms{numpy_s}{ort_s}{c.max_rel_err or 0:>13.1e}"
              + "".join(f"  {p}" for p in c.problems))
    print("results match numpy and onnxruntime" if ok else "MISMATCH (see above)")
    return 0 if ok else 1


def narrow_host(cpu: str) -> None:
    """Compile for ``cpu`` for the rest of this process and its children (``CUVIL_HOST_TARGET``; a CPU
    this machine cannot run is refused), and restrict PyTorch's kernels the same way (oneDNN and ATen read
    these before torch is imported) when ``cpu`` has no AVX-512."""
    import os

    import cuvil

    os.environ["CUVIL_HOST_TARGET"] = cpu
    t = cuvil.Target("llvm")
    if t.triple.startswith("x86_64") and "avx512f" not in t.enabled_features and "avx2" in t.enabled_features:
        if "torch" in sys.modules:
            raise CuvilError("--target: torch was imported before its CPU capability could be restricted")
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")


def target_line(t: Any) -> str:
    """``x86_64 znver3: AVX2 (8 fp32 lanes, FMA), 16 cores, L2 512 KiB`` (``cuvil info``: all of it)."""
    isa = ("AVX-512" if t.vector_bits >= 512 else "AVX2" if t.vector_bits == 256 else
           "NEON" if t.triple.startswith("aarch64") else "SSE")
    fma = ", FMA" if t.fma_units else ""
    return (f"{t.arch or t.triple.split('-')[0]} {t.cpu}: {isa} ({t.vector_lanes(32)} fp32 lanes{fma}), "
            f"{t.num_cores} cores, L2 {t.l2_size // 1024} KiB")


def _demo_matmul(n: int) -> Any:
    from cuvil.bench import Workload, _onnx_model

    def build() -> tuple[list[Any], list[np.ndarray]]:
        from cuvil import te
        from cuvil.te import ops

        rng = np.random.default_rng(0)
        A = te.placeholder((n, n), name="A")
        B = te.placeholder((n, n), name="B")
        return [A, B, ops.matmul(A, B)], [rng.standard_normal((n, n), dtype=np.float32),
                                          rng.standard_normal((n, n), dtype=np.float32)]

    return Workload(f"matmul {n}x{n}x{n}", build, np.matmul, 2.0 * n ** 3,
                    onnx=lambda xs: _onnx_model("MatMul", xs, (n, n)))


def _demo_conv_relu(n: int = 1, c: int = 64, h: int = 56, f: int = 64) -> Any:
    from cuvil.bench import Workload

    def build() -> tuple[list[Any], list[np.ndarray]]:
        from cuvil import te
        from cuvil.te import ops

        rng = np.random.default_rng(0)
        X = te.placeholder((n, c, h, h), name="X")
        W = te.placeholder((f, c, 3, 3), name="W")
        Y = ops.relu(ops.conv2d_nchw(X, W, stride=1, padding=1))
        return [X, W, Y], [rng.standard_normal((n, c, h, h), dtype=np.float32),
                           rng.standard_normal((f, c, 3, 3), dtype=np.float32)]

    def model(xs: list[np.ndarray]) -> Any:
        from onnx import TensorProto, helper

        vi = helper.make_tensor_value_info
        g = helper.make_graph([helper.make_node("Conv", ["x0", "x1"], ["c"], pads=[1, 1, 1, 1]),
                               helper.make_node("Relu", ["c"], ["y"])], "conv_relu",
                              [vi("x0", TensorProto.FLOAT, list(xs[0].shape)), vi("x1", TensorProto.FLOAT,
                                                                                 list(xs[1].shape))],
                              [vi("y", TensorProto.FLOAT, [n, f, h, h])])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])

    return Workload(f"conv2d {c}->{f} 3x3 {h}x{h} + relu", build, _conv_relu_ref, 2.0 * n * f * h * h * c * 9,
                    onnx=model)


def _conv_relu_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """numpy reference: 3x3 convolution with padding 1 as a sum of shifted matmuls, then relu."""
    n, c, h, wd = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = np.zeros((n, w.shape[0], h, wd), x.dtype)
    for dy in range(3):
        for dx in range(3):
            out += np.einsum("fc,nchw->nfhw", w[:, :, dy, dx], xp[:, :, dy:dy + h, dx:dx + wd])
    return np.maximum(out, 0)


def info() -> int:
    import cuvil

    t = cuvil.Target("llvm")
    print(f"cuvil {cuvil.__version__}")
    print(f"target: {t.canonical}")
    isa = ("AVX-512" if t.vector_bits >= 512 else "AVX2" if t.vector_bits == 256 else
           "NEON" if t.triple.startswith("aarch64") else "SSE")
    print(f"  {t.arch or t.triple.split('-')[0]} {t.cpu}: {isa}, {t.vector_bits}-bit vectors "
          f"({t.vector_lanes(32)} fp32 lanes), {t.vector_registers} vector registers, {t.fma_units} FMA units "
          f"({t.peak_flops_per_cycle()} fp32 FLOP/cycle/core)")
    print(f"  {t.num_cores} cores; L1d {t.l1_size // 1024} KiB, L2 {t.l2_size // 1024} KiB, "
          f"L3 {t.l3_size // 1024} KiB")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cuvil", description="cuvil: a tensor compiler")
    parser.add_argument("--version", action="store_true", help="print the version")
    parser.add_argument("--traceback", action="store_true", help="on an error, show Python's traceback instead of "
                        "the one-line message")
    sub = parser.add_subparsers(dest="cmd")
    p_demo = sub.add_parser("demo", help="auto-schedule a matmul and a conv2d+relu, check them, time them beside "
                            "numpy and onnxruntime")
    p_demo.add_argument("--size", type=int, default=512, help="matmul size (default 512)")
    sub.add_parser("info", help="show the host target")
    p_bench = sub.add_parser("bench", help="benchmark whole models beside onnxruntime (--ops: operators beside "
                             "numpy)")
    p_bench.add_argument("models", nargs="*", help="model.onnx files, cuvil.zoo names (resnet18, mobilenet_v2, "
                         "bert, mlp) or light_<name> (the onnx wheel's light models); default: a set of each")
    p_bench.add_argument("--models", dest="model_list", default=None, help="comma-separated, like the positionals")
    p_bench.add_argument("--ops", action="store_true", help="the operator table instead of models")
    p_bench.add_argument("--threads", default="1,2", help="thread counts, e.g. 1,2")
    p_bench.add_argument("--no-cold", action="store_true", help="models: skip the cold/warm compiles in fresh "
                         "processes")
    p_bench.add_argument("--rounds", type=int, default=5, help="models: interleaved timing rounds")
    p_bench.add_argument("--profile", type=int, default=0, metavar="N", help="models: also print the N slowest "
                         "kernel calls of each (at the first thread count); --registry: the N longest kernels below "
                         "half of the peak (contractions) or of the streaming bandwidth (the rest), at 1 thread")
    p_bench.add_argument("--tuning-db", default=None, metavar="DB", help="models: compile with the best schedules "
                         "in this tuning database (cuvil tune) and time the untuned compilation beside it")
    p_bench.add_argument("--shapes", action="append", nargs="+", default=[], metavar="NAME=D0,D1,...",
                         help="models: input shapes (symbolic dimensions: 1 without it), e.g. --shapes "
                         "x=4,3,224,224 mask=4,128")
    p_bench.add_argument("--quick", action="store_true", help="--ops: skip the largest shapes")
    p_bench.add_argument("--only", default=None, help="--ops: only the rows whose name contains this text")
    p_bench.add_argument("--target", default=None, metavar="CPU", help="compile for this CPU instead of the host's "
                         "own (x86-64-v3, x86-64-v4, znver3, ...: cuvil.target.X86_CPUS; its code must run here): "
                         "sets CUVIL_HOST_TARGET for the run, and restricts the torch anchors of --torch to AVX2 "
                         "when the CPU has no AVX-512")
    p_bench.add_argument("--registry", action="store_true", help="the registry of real models (cuvil.registry; "
                         "needs torch): models are registry names (default: all), one protocol (docs/models.md)")
    p_bench.add_argument("--config", default="full", choices=("full", "ci"), help="--registry: model sizes")
    p_bench.add_argument("--exporter", default="dynamo", help="--registry: dynamo, torchscript or both, "
                         "comma-separated")
    p_bench.add_argument("--json", default=None, metavar="FILE", help="--registry: also write the results here")
    p_bench.add_argument("--quant", default=None, metavar="SCHEMES", help="--registry: the models quantized by "
                         "onnxruntime's tool (qdq-u8s8, qdq-s8s8, qdq-u8s8-pc, qdq-s8s8-pc, qop-u8s8, dynamic; "
                         "comma-separated), cuvil beside onnxruntime on the int8 file and beside cuvil's fp32 "
                         "(cuvil.bench_quant)")
    p_bench.add_argument("--llm", default=None, metavar="MODEL", help="an LLM's prefill and decode rates beside "
                         "llama.cpp, onnxruntime-genai and eager torch (MODEL: a folder of benchmarks/llm_models.py, "
                         "or a Hugging Face folder with --gguf / --ort)")
    p_bench.add_argument("--gguf", default=None, help="--llm: the GGUF Q4_0 file of the same weights")
    p_bench.add_argument("--ort", default=None, help="--llm: the onnxruntime-genai int4 folder of the same weights")
    p_bench.add_argument("--llama-bench", default=None, help="--llm: llama.cpp's llama-bench (default: "
                         "$CUVIL_LLAMA_BENCH or PATH)")
    p_bench.add_argument("--torch", action="store_true", help="--registry: eager torch, torch.compile (Inductor) "
                         "and cuvil's PyTorch front end beside cuvil's ONNX path and onnxruntime (cuvil.bench_torch)")
    from cuvil import cli_onnx

    cli_onnx.add_parsers(sub)
    from cuvil.autotune import cli as tune_cli

    tune_cli.add_parser(sub)
    from cuvil.autotune import cluster

    cluster.add_parsers(sub)
    from cuvil.llm import cli as llm_cli

    llm_cli.add_parsers(sub)
    args = parser.parse_args(argv)
    try:
        return _dispatch(parser, args, tune_cli)
    except CuvilError as exc:  # the user's mistake or the model's: one line, no traceback
        if args.traceback:
            raise
        return error(str(exc))
    except OSError as exc:  # a file that cannot be read or written
        if args.traceback:
            raise
        return error(f"{exc.strerror or exc}" + (f": {exc.filename!r}" if exc.filename else ""))
    except Exception as exc:  # noqa: BLE001  # a bug in cuvil: still one line, and how to see more
        if args.traceback:
            raise
        return error(f"internal error: {type(exc).__name__}: {exc} (a bug in cuvil; cuvil --traceback ... shows "
                     "where)", code=2)


def error(message: str, code: int = 1) -> int:
    """Print ``cuvil: error: message`` on stderr (further lines of the message indented) and return
    ``code``."""
    first, *rest = message.strip().splitlines() or [""]
    print(f"cuvil: error: {first}", file=sys.stderr)
    for line in rest:
        print(f"  {line}", file=sys.stderr)
    return code


def _ints(parser: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        parser.error(f"{flag} {text!r}: write positive integers separated by commas, e.g. {flag} 1,2")
    return values


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace, tune_cli: Any) -> int:
    from cuvil import cli_onnx

    if args.version:
        import cuvil

        print(cuvil.__version__)
        return 0
    from cuvil.autotune import cluster
    from cuvil.llm import cli as llm_cli

    code = cli_onnx.dispatch(args)
    if code is None:
        code = cluster.dispatch(args)
    if code is None:
        code = llm_cli.dispatch(args)
    if code is not None:
        return code
    if args.cmd == "tune":
        return tune_cli.run(args)
    if args.cmd == "demo":
        return demo(args.size)
    if args.cmd == "info":
        return info()
    if args.cmd == "bench":
        threads = _ints(parser, "--threads", args.threads)
        if args.target:
            narrow_host(args.target)
        if args.shapes and (args.ops or args.registry):
            parser.error("--shapes sets the input shapes of model files and cuvil.zoo models, not of --ops or "
                         "--registry")
        if args.llm:
            from cuvil.llm.bench import run as llm_run

            return llm_run(args.llm, threads, gguf=args.gguf, ort=args.ort, llama_bench=args.llama_bench,
                           repeats=min(args.rounds, 3))
        if args.ops:
            from cuvil.bench import run

            return run(threads, quick=args.quick, only=args.only, rounds=args.rounds)
        from cuvil import bench_model

        models = list(args.models) + [m for m in (args.model_list or "").split(",") if m]
        if args.torch and not args.registry:
            parser.error("--torch needs --registry (cuvil bench --registry --torch [names])")
        if args.quant and not args.registry:
            parser.error("--quant needs --registry (cuvil bench --registry [names] --quant qdq-u8s8)")
        if args.registry:
            from cuvil import bench_registry

            names = [n for m in models for n in m.split(",") if n]
            if args.quant:
                from cuvil import bench_quant

                return bench_quant.run(names, [s for s in args.quant.split(",") if s], args.config, threads,
                                       rounds=args.rounds, cold=not args.no_cold, json_path=args.json)
            if args.torch:
                from cuvil import bench_torch

                return bench_torch.run(names, args.config, threads, rounds=args.rounds, cold=not args.no_cold,
                                       json_path=args.json)
            return bench_registry.run(names, [e for e in args.exporter.split(",") if e], args.config, threads,
                                      rounds=args.rounds, cold=not args.no_cold, json_path=args.json,
                                      profile=args.profile)
        shapes = cli_onnx.parse_shapes(args.shapes, one=True)
        return bench_model.run(models, threads, cold=not args.no_cold, rounds=args.rounds,
                               profile_top=args.profile, tuning_db=args.tuning_db, shapes=shapes or None)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
