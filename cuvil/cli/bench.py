"""``cuvil bench``: which benchmark of :mod:`cuvil.bench` the flags ask for, and its arguments.

    cuvil bench [model.onnx | zoo name ...] [--threads 1,2] [--shapes ...]   # cuvil.bench.models
    cuvil bench --ops [--quick] [--only matmul]                              # cuvil.bench.ops
    cuvil bench --registry [names] [--config ci]                             # cuvil.bench.registry
    cuvil bench --registry --torch [names]                                   # cuvil.bench.torch
    cuvil bench --registry [names] --quant qdq-u8s8,dynamic                  # cuvil.bench.quant
    cuvil bench --llm MODEL [--gguf F] [--ort DIR]                           # cuvil.llm.bench
    cuvil bench ... --target x86-64-v3          # compile for another CPU this one runs (AVX2 here)
"""

from __future__ import annotations

import argparse
import os
import sys

from cuvil.cli.common import UsageError, parse_shapes, positive_ints
from cuvil.errors import CuvilError

__all__ = ["bench_cmd", "narrow_host"]


def bench_cmd(args: argparse.Namespace) -> int:
    threads = positive_ints("--threads", args.threads)
    if args.target:
        narrow_host(args.target)
    if args.shapes and (args.ops or args.registry):
        raise UsageError("--shapes sets the input shapes of model files and cuvil.models.zoo models, not of --ops "
                         "or --registry")
    if args.llm:
        from cuvil.llm.bench import run as llm_run

        return llm_run(args.llm, threads, gguf=args.gguf, ort=args.ort, llama_bench=args.llama_bench,
                       repeats=min(args.rounds, 3))
    if args.ops:
        from cuvil.bench.ops import run

        return run(threads, quick=args.quick, only=args.only, rounds=args.rounds)
    models = list(args.models) + [m for m in (args.model_list or "").split(",") if m]
    if args.torch and not args.registry:
        raise UsageError("--torch needs --registry (cuvil bench --registry --torch [names])")
    if args.quant and not args.registry:
        raise UsageError("--quant needs --registry (cuvil bench --registry [names] --quant qdq-u8s8)")
    if args.registry:
        return _registry(args, [n for m in models for n in m.split(",") if n], threads)
    from cuvil.bench import models as bench_models

    shapes = parse_shapes(args.shapes, one=True)
    return bench_models.run(models, threads, cold=not args.no_cold, rounds=args.rounds, profile_top=args.profile,
                            tuning_db=args.tuning_db, shapes=shapes or None)


def _registry(args: argparse.Namespace, names: list[str], threads: list[int]) -> int:
    """``--registry``: fp32 exports beside onnxruntime, or ``--quant`` / ``--torch``'s engines."""
    if args.quant:
        from cuvil.bench import quant

        return quant.run(names, [s for s in args.quant.split(",") if s], args.config, threads, rounds=args.rounds,
                         cold=not args.no_cold, json_path=args.json)
    if args.torch:
        from cuvil.bench import torch as bench_torch

        return bench_torch.run(names, args.config, threads, rounds=args.rounds, cold=not args.no_cold,
                               json_path=args.json)
    from cuvil.bench import registry

    return registry.run(names, [e for e in args.exporter.split(",") if e], args.config, threads, rounds=args.rounds,
                        cold=not args.no_cold, json_path=args.json, profile=args.profile)


def narrow_host(cpu: str) -> None:
    """Compile for ``cpu`` for the rest of this process and its children (``CUVIL_HOST_TARGET``; a CPU
    this machine cannot run is refused), and restrict PyTorch's kernels the same way (oneDNN and ATen read
    these before torch is imported) when ``cpu`` has no AVX-512."""
    import cuvil

    os.environ["CUVIL_HOST_TARGET"] = cpu
    t = cuvil.Target("llvm")
    if t.triple.startswith("x86_64") and "avx512f" not in t.enabled_features and "avx2" in t.enabled_features:
        if "torch" in sys.modules:
            raise CuvilError("--target: torch was imported before its CPU capability could be restricted")
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
