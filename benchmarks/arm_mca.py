"""Arm speed without Arm hardware: llvm-mca's estimate of each contraction's inner loop in a whole model.

    python benchmarks/arm_mca.py                                    # resnet50 + bert-base, full size, neoverse-n1
    python benchmarks/arm_mca.py --cpu neoverse-n1,cortex-a76,neoverse-v1 --model resnet50 --config ci --top 10

Per CPU and model: the registry model (:mod:`cuvil.models.registry`, dynamo export) is compiled for
``llvm -mtriple=aarch64-linux-gnu -mcpu=CPU`` as a session compiles it (untuned, default options), and the
AArch64 assembly of the linked module is kept in a cache (``$TMPDIR/cuvil-arm-mca``, keyed by the ONNX file,
the target and cuvil's sources).  Each contraction kernel (Conv, ConvTranspose, Gemm, MatMul, Einsum) gives
its innermost loop with the most vector FP multiply/adds (:func:`cuvil.bench.mca.hot_loop`), which goes
through ``llvm-mca-19 -mtriple=aarch64 -mcpu=CPU -iterations=100 -bottleneck-analysis``.  Columns:

- ``share``: the kernel's FLOPs (2 x multiply-adds of its reductions, over all its calls) / the model's
  contraction FLOPs;
- ``fp``: vector FP multiply/add instructions in the loop (``fmla``: of them fused), ``acc``: registers
  the fmla accumulate into across iterations (the register tile), ``ld``: loads, ``ins``: instructions;
- ``cyc``: llvm-mca's cycles per iteration (total cycles / 100), ``rthr``: its block reciprocal throughput
  (the resource bound alone, no dependences), ``bound``: fp / FMA pipes (the pipes as
  llvm-mca models them: 16 independent fmla / their block reciprocal throughput), ``eff``: bound / cyc;
- ``bottleneck``: the busiest resource per iteration (the FP pipes as one group) and its cycles, or
  ``latency`` when an iteration takes > 1.1x what any resource needs (a dependence chain sets the pace).

The last line per model is the FLOP-weighted efficiency of the kernels whose loop was found (and what
share of the FLOPs they cover).  It is an estimate of the steady-state inner loop only: no cache misses,
no loop overhead outside that loop, no edges or packing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cuvil.bench import mca as bench_mca  # noqa: E402

CONTRACTIONS = ("Conv", "ConvTranspose", "Gemm", "MatMul", "Einsum")
CPUS = ("neoverse-n1", "cortex-a76", "neoverse-v1")
_LOAD = re.compile(r"^(ld[1-4]r?|ldr|ldp|ldur|ldnp)\b")


def target_of(cpu: str) -> str:
    return f"llvm -mtriple=aarch64-linux-gnu -mcpu={cpu}"


# -- compiling a model for the Arm CPU (cached) -----------------------------------------------------------


def _sources_hash() -> str:
    """A hash of cuvil's Python sources (not the benchmark modules): a change to the compiler compiles the
    model again."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cuvil")
    h = hashlib.sha256()
    for d, _, files in sorted(os.walk(root)):
        for f in sorted(files):
            if f.endswith(".py") and not f.startswith("bench"):
                with open(os.path.join(d, f), "rb") as fh:
                    h.update(f.encode() + b"\0" + fh.read())
    return h.hexdigest()[:16]


def _name(key: tuple) -> str:
    """The kernel's name for people; a Winograd convolution says so (its FLOPs are those of its tile
    contraction, 16 multiplies per 2x2 outputs and channel pair instead of 36)."""
    from cuvil.graph.compile import kernel_name

    first = next((m for m in key[1:] if isinstance(m, tuple)), key) if key[0] == "fused" else key
    return kernel_name(key) + (" [winograd]" if "winograd" in first[7:] else "")


def compile_for(model: str, config: str, cpu: str, exporter: str = "dynamo", cache: bool = True) -> dict[str, Any]:
    """The model compiled for ``cpu``: {"asm", "kernels": [{kernel, label, op, calls, flops}], "fallbacks",
    "target", "compile_s", "onnx"}, from the cache when the same file, target and sources were compiled."""
    from cuvil.models import registry

    path = registry.export(model, config=config, exporter=exporter)
    target = target_of(cpu)
    key = hashlib.sha256(f"{os.path.basename(path)}|{target}|{_sources_hash()}".encode()).hexdigest()[:20]
    folder = os.path.join(tempfile.gettempdir(), "cuvil-arm-mca")
    file = os.path.join(folder, f"{model}-{config}-{cpu}-{key}.json")
    if cache and os.path.exists(file):
        with open(file) as f:
            return {**json.load(f), "cached": True}
    from cuvil.frontend.onnx import import_model, load_model
    from cuvil.graph.compile import compile_graph, prepare
    from cuvil.graph.profile import contraction_flops

    t0 = time.perf_counter()
    graph = prepare(import_model(load_model(path)))
    shapes = {v.name: tuple(v.shape) for v in graph.feeds}
    seen: list[tuple[str, float]] = []  # per kernel call, in call order: its name for people and FLOPs
    prog = compile_graph(graph, shapes, {}, target,
                         on_kernel=lambda k, args, label: seen.append((_name(k), contraction_flops(args)[0])))
    asm = prog.module.get_source("asm")
    kernels: dict[str, dict[str, Any]] = {}
    for call, (label, flops), nodes in zip(prog.kernel_calls, seen, prog.call_nodes):
        k = kernels.setdefault(call.kernel, {"kernel": call.kernel, "label": label,
                                             "op": nodes[0][0] if nodes else "", "calls": 0, "flops": 0.0})
        k["calls"] += 1
        k["flops"] += flops
    out = {"asm": asm, "kernels": list(kernels.values()), "fallbacks": list(prog.fallbacks),
           "target": prog.target.canonical, "compile_s": time.perf_counter() - t0, "onnx": path}
    os.makedirs(folder, exist_ok=True)
    tmp = f"{file}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, file)
    return out


# -- the table ----------------------------------------------------------------------------------------------


def analyse(compiled: dict[str, Any], cpu: str) -> list[dict[str, Any]]:
    """One row per contraction kernel, most FLOPs first."""
    pipes = bench_mca.fma_pipes(cpu)
    asm = compiled["asm"]
    rows = []
    for k in compiled["kernels"]:
        if k["op"] not in CONTRACTIONS:
            continue
        row = dict(k)
        loop = bench_mca.hot_loop(asm, k["kernel"])
        if loop is not None:
            rep = bench_mca.run_mca(loop.text(), cpu)
            est = bench_mca.estimate(loop, rep, pipes)
            row.update(loop=f"{loop.function} {loop.label}", fp=est.fp_ops, fmla=est.fmla, ins=est.instructions,
                       acc=len(loop.accumulators), ld=sum(1 for s in loop.instructions if _LOAD.match(s)),
                       cyc=est.cycles, rthr=rep.block_rthroughput, bound=est.bound, eff=est.efficiency,
                       bottleneck=est.bottleneck)
        rows.append(row)
    return sorted(rows, key=lambda r: -r["flops"])


def table(rows: list[dict[str, Any]], top: int) -> list[str]:
    total = sum(r["flops"] for r in rows) or 1.0
    lines = [f"{'kernel':<6} {'share':>6} {'calls':>5} {'fp':>4} {'fmla':>4} {'acc':>3} {'ld':>3} {'ins':>4} "
             f"{'cyc':>6} {'rthr':>6} {'bound':>6} {'eff':>6}  {'bottleneck':<30} name"]
    for r in rows[:top]:
        share = f"{r['flops'] / total:6.1%}"
        if "cyc" not in r:
            lines.append(f"{r['kernel']:<6} {share} {r['calls']:>5}  (no loop with vector FP ops){'':>45}"
                         f"{r['label']}")
            continue
        lines.append(f"{r['kernel']:<6} {share} {r['calls']:>5} {r['fp']:>4} {r['fmla']:>4} {r['acc']:>3} "
                     f"{r['ld']:>3} {r['ins']:>4} {r['cyc']:>6.2f} {r.get('rthr', 0):>6.2f} {r['bound']:>6.2f} "
                     f"{r['eff']:>6.1%}  "
                     f"{r['bottleneck']:<30} {r['label']}")
    if len(rows) > top:
        rest = sum(r["flops"] for r in rows[top:]) / total
        lines.append(f"... {len(rows) - top} more contraction kernels ({rest:.1%} of the FLOPs)")
    return lines


def weighted(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """The FLOP-weighted efficiency of the kernels with a loop, and the share of FLOPs they hold."""
    total = sum(r["flops"] for r in rows)
    found = [r for r in rows if "eff" in r]
    covered = sum(r["flops"] for r in found)
    eff = sum(r["flops"] * r["eff"] for r in found) / covered if covered else 0.0
    return eff, (covered / total if total else 0.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", default="neoverse-n1", help=f"comma-separated -mcpu values (e.g. {','.join(CPUS)})")
    ap.add_argument("--model", default="resnet50,bert-base", help="comma-separated registry models")
    ap.add_argument("--config", default="full", choices=("full", "ci"))
    ap.add_argument("--exporter", default="dynamo", choices=("dynamo", "torchscript"))
    ap.add_argument("--top", type=int, default=12, help="kernel rows per table (most FLOPs first)")
    ap.add_argument("--no-cache", action="store_true", help="compile again even if the asm is cached")
    args = ap.parse_args(argv)
    from cuvil.target import Target

    cmd = " ".join(["python benchmarks/arm_mca.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"# {cmd}")
    summary = []
    for cpu in args.cpu.split(","):
        pipes = bench_mca.fma_pipes(cpu)
        mca = " ".join(os.path.basename(x) if n == 0 else x for n, x in enumerate(bench_mca.mca_command(cpu)))
        print(f"\n## {cpu}: {mca} <loop>; FMA pipes in llvm-mca's model: {pipes.count:g} "
              f"({', '.join(pipes.units)})")
        if pipes.count != Target(target_of(cpu)).fma_units:
            print(f"   note: cuvil.Target gives {cpu} {Target(target_of(cpu)).fma_units} FMA pipes; llvm-mca's model "
                  f"issues {pipes.count:g} fmla v.4s per cycle: bounds and efficiencies here are the model's")
        for model in args.model.split(","):
            c = compile_for(model, args.config, cpu, args.exporter, cache=not args.no_cache)
            rows = analyse(c, cpu)
            eff, covered = weighted(rows)
            print(f"\n{model} ({args.config}, {args.exporter}) for {c['target']}: {len(rows)} contraction kernels, "
                  f"compiled in {c['compile_s']:.0f} s{' (cached)' if 'cached' in c else ''}")
            if c["fallbacks"]:
                print(f"  {len(c['fallbacks'])} fallback(s): " + "; ".join(c["fallbacks"][:3]))
            for line in table(rows, args.top):
                print("  " + line)
            line = (f"{model:<12} {cpu:<12} FLOP-weighted eff {eff:6.1%} of the FMA bound "
                    f"({covered:.1%} of contraction FLOPs have a vector FP loop)")
            print("  " + line)
            summary.append(line)
    print("\n# totals")
    for line in summary:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
