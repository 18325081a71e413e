"""The ``cuvil`` command line.

    cuvil compile [model.onnx] [-o model.ll] [--dump]   # ONNX -> one native module (cuvil.cli_onnx)
    cuvil run model.onnx --input x=x.npy [-o out.npz]
    cuvil bench [model.onnx | zoo name ...] [--threads 1,2]   # whole models beside onnxruntime
    cuvil bench --ops [--quick] [--only matmul]         # operators beside numpy (cuvil.bench)
    cuvil bench --registry --torch [names] [--config ci]  # torch eager, Inductor, cuvil.torch beside onnxruntime
    cuvil tune ...                                       # the autotuner (cuvil.autotune.cli)
    cuvil demo | info
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def demo(size: int = 512) -> int:
    """Build a matmul and a conv2d+relu, check them against numpy, print the times."""
    import cuvil
    from cuvil import te
    from cuvil.bench import median_time
    from cuvil.te import ops

    rng = np.random.default_rng(0)
    ok = True
    print(f"cuvil {cuvil.__version__} on {cuvil.Target('llvm').canonical}")
    print(f"{'kernel':<34}{'compile':>10}{'cuvil':>12}{'numpy':>12}{'max rel err':>14}")

    # matmul, default (unscheduled) loops
    n = size
    A = te.placeholder((n, n), name="A")
    B = te.placeholder((n, n), name="B")
    C = ops.matmul(A, B)
    t0 = time.perf_counter()
    f = cuvil.build(te.create_schedule(C), [A, B, C])
    t_compile = time.perf_counter() - t0
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty((n, n), np.float32)
    f(a, b, c)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    err = float(np.max(np.abs(c - ref)) / np.max(np.abs(ref)))
    ok &= err < np.sqrt(n) * 1e-7 * 4
    t_ours = f.time(a, b, c, number=1, repeat=3)
    t_np = median_time(lambda: a @ b)
    print(f"{f'matmul {n}x{n}x{n} (unscheduled)':<34}{t_compile * 1e3:>8.0f}ms"
          f"{t_ours * 1e3:>10.2f}ms{t_np * 1e3:>10.2f}ms{err:>14.2e}")

    # conv2d + relu
    N, Cin, H, W, F = 1, 16, 56, 56, 32
    X = te.placeholder((N, Cin, H, W), name="X")
    Wt = te.placeholder((F, Cin, 3, 3), name="W")
    Y = ops.relu(ops.conv2d_nchw(X, Wt, stride=1, padding=1))
    t0 = time.perf_counter()
    g = cuvil.build(te.create_schedule(Y), [X, Wt, Y])
    t_compile = time.perf_counter() - t0
    x = rng.standard_normal((N, Cin, H, W), dtype=np.float32)
    w = rng.standard_normal((F, Cin, 3, 3), dtype=np.float32)
    y = np.empty((N, F, H, W), np.float32)
    g(x, w, y)
    yref = _conv_relu_ref(x, w)
    err = float(np.max(np.abs(y - yref)) / np.max(np.abs(yref)))
    ok &= err < np.sqrt(Cin * 9) * 1e-7 * 4
    t_ours = g.time(x, w, y, number=1, repeat=3)
    t_np = median_time(lambda: _conv_relu_ref(x, w, np.float32))
    print(f"{f'conv2d {Cin}->{F} 3x3 {H}x{W} + relu':<34}{t_compile * 1e3:>8.0f}ms"
          f"{t_ours * 1e3:>10.2f}ms{t_np * 1e3:>10.2f}ms{err:>14.2e}")
    print("results match numpy" if ok else "MISMATCH against numpy")
    return 0 if ok else 1


def _conv_relu_ref(x: np.ndarray, w: np.ndarray, dtype: type = np.float64) -> np.ndarray:
    """numpy reference: 3x3 convolution with padding 1 as a sum of shifted matmuls, then relu."""
    n, c, h, wd = x.shape
    xp = np.pad(x.astype(dtype), ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = np.zeros((n, w.shape[0], h, wd), dtype)
    for dy in range(3):
        for dx in range(3):
            out += np.einsum("fc,nchw->nfhw", w[:, :, dy, dx].astype(dtype), xp[:, :, dy:dy + h, dx:dx + wd])
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
    sub = parser.add_subparsers(dest="cmd")
    p_demo = sub.add_parser("demo", help="build a matmul and a conv2d+relu, check against numpy, time them")
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
                         "kernel calls of each (at the first thread count)")
    p_bench.add_argument("--tuning-db", default=None, metavar="DB", help="models: compile with the best schedules "
                         "in this tuning database (cuvil tune) and time the untuned compilation beside it")
    p_bench.add_argument("--quick", action="store_true", help="--ops: skip the largest shapes")
    p_bench.add_argument("--only", default=None, help="--ops: only the rows whose name contains this text")
    p_bench.add_argument("--registry", action="store_true", help="the registry of real models (cuvil.registry; "
                         "needs torch): models are registry names (default: all), one protocol (docs/models.md)")
    p_bench.add_argument("--config", default="full", choices=("full", "ci"), help="--registry: model sizes")
    p_bench.add_argument("--exporter", default="dynamo", help="--registry: dynamo, torchscript or both, "
                         "comma-separated")
    p_bench.add_argument("--json", default=None, metavar="FILE", help="--registry: also write the results here")
    p_bench.add_argument("--torch", action="store_true", help="--registry: eager torch, torch.compile (Inductor) "
                         "and cuvil's PyTorch front end beside cuvil's ONNX path and onnxruntime (cuvil.bench_torch)")
    from cuvil import cli_onnx

    cli_onnx.add_parsers(sub)
    from cuvil.autotune import cli as tune_cli

    tune_cli.add_parser(sub)
    args = parser.parse_args(argv)
    if args.version:
        import cuvil

        print(cuvil.__version__)
        return 0
    code = cli_onnx.dispatch(args)
    if code is not None:
        return code
    if args.cmd == "tune":
        return tune_cli.run(args)
    if args.cmd == "demo":
        return demo(args.size)
    if args.cmd == "info":
        return info()
    if args.cmd == "bench":
        threads = [int(x) for x in args.threads.split(",")]
        if args.ops:
            from cuvil.bench import run

            return run(threads, quick=args.quick, only=args.only, rounds=args.rounds)
        from cuvil import bench_model

        models = list(args.models) + [m for m in (args.model_list or "").split(",") if m]
        if args.torch and not args.registry:
            parser.error("--torch needs --registry (cuvil bench --registry --torch [names])")
        if args.registry:
            from cuvil import bench_registry

            names = [n for m in models for n in m.split(",") if n]
            if args.torch:
                from cuvil import bench_torch

                return bench_torch.run(names, args.config, threads, rounds=args.rounds, cold=not args.no_cold,
                                       json_path=args.json)
            return bench_registry.run(names, [e for e in args.exporter.split(",") if e], args.config, threads,
                                      rounds=args.rounds, cold=not args.no_cold, json_path=args.json)
        return bench_model.run(models, threads, cold=not args.no_cold, rounds=args.rounds,
                               profile_top=args.profile, tuning_db=args.tuning_db)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
