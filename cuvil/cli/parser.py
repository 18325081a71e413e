"""The ``cuvil`` command line's one parser: every subcommand and flag, written down here and nowhere else.

Each subcommand names the function that runs it (``command``: module and name, imported when the command
runs, so ``cuvil --help`` loads no compiler); :func:`cuvil.cli.main` calls it with the parsed arguments.
Flags that several commands take are written once: :func:`shapes_flag`, :func:`option_flags`,
:func:`tls_flags`.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["build_parser", "option_flags", "shapes_flag", "tls_flags"]

PRECISION_HELP = ("bf16: contractions with constant weights (MatMul, Gemm, Conv) multiply in bfloat16 with float32 "
                  "accumulation on AVX512-BF16 (docs/precision.md); fp32 elsewhere")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cuvil", description="cuvil: a tensor compiler")
    parser.add_argument("--version", action="store_true", help="print the version")
    parser.add_argument("--traceback", action="store_true", help="on an error, show Python's traceback instead of "
                        "the one-line message")
    sub = parser.add_subparsers(dest="cmd")
    p = sub.add_parser("demo", help="auto-schedule a matmul and a conv2d+relu, check them, time them beside "
                       "numpy and onnxruntime")
    p.add_argument("--size", type=int, default=512, help="matmul size (default 512)")
    p.set_defaults(command=("cuvil.cli.info", "demo_cmd"))
    sub.add_parser("info", help="show the host target").set_defaults(command=("cuvil.cli.info", "info_cmd"))
    _bench(sub)
    _compile(sub)
    _run(sub)
    _tune(sub)
    _boards(sub)
    _generate(sub)
    return parser


def shapes_flag(p: Any, what: str) -> None:
    p.add_argument("--shapes", action="append", nargs="+", default=[], metavar="NAME=D0,D1,...", help=what)


def _bench(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmark whole models beside onnxruntime (--ops: operators beside numpy)")
    p.set_defaults(command=("cuvil.cli.bench", "bench_cmd"))
    p.add_argument("models", nargs="*", help="model.onnx files, cuvil.models.zoo names (resnet18, mobilenet_v2, "
                   "bert, mlp) or light_<name> (the onnx wheel's light models); default: a set of each")
    p.add_argument("--models", dest="model_list", default=None, help="comma-separated, like the positionals")
    p.add_argument("--ops", action="store_true", help="the operator table instead of models")
    p.add_argument("--threads", default="1,2", help="thread counts, e.g. 1,2")
    p.add_argument("--no-cold", action="store_true", help="models: skip the cold/warm compiles in fresh processes")
    p.add_argument("--rounds", type=int, default=5, help="models: interleaved timing rounds")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="models: also print the N slowest kernel "
                   "calls of each (at the first thread count); --registry: the N longest kernels below half of the "
                   "peak (contractions) or of the streaming bandwidth (the rest), at 1 thread")
    p.add_argument("--tuning-db", default=None, metavar="DB", help="models: compile with the best schedules in this "
                   "tuning database (cuvil tune) and time the untuned compilation beside it")
    shapes_flag(p, "models: input shapes (symbolic dimensions: 1 without it), e.g. --shapes x=4,3,224,224 "
                "mask=4,128")
    p.add_argument("--quick", action="store_true", help="--ops: skip the largest shapes")
    p.add_argument("--only", default=None, help="--ops: only the rows whose name contains this text")
    p.add_argument("--target", default=None, metavar="CPU", help="compile for this CPU instead of the host's own "
                   "(x86-64-v3, x86-64-v4, znver3, ...: cuvil.target.X86_CPUS; its code must run here): sets "
                   "CUVIL_HOST_TARGET for the run, and restricts the torch anchors of --torch to AVX2 when the CPU "
                   "has no AVX-512")
    p.add_argument("--registry", action="store_true", help="the registry of real models (cuvil.models.registry; "
                   "needs torch): models are registry names (default: all), one protocol (docs/models.md)")
    p.add_argument("--config", default="full", choices=("full", "ci"), help="--registry: model sizes")
    p.add_argument("--exporter", default="dynamo", help="--registry: dynamo, torchscript or both, comma-separated")
    p.add_argument("--json", default=None, metavar="FILE", help="--registry: also write the results here")
    p.add_argument("--quant", default=None, metavar="SCHEMES", help="--registry: the models quantized by "
                   "onnxruntime's tool (qdq-u8s8, qdq-s8s8, qdq-u8s8-pc, qdq-s8s8-pc, qop-u8s8, dynamic; "
                   "comma-separated), cuvil beside onnxruntime on the int8 file and beside cuvil's fp32 "
                   "(cuvil.bench.quant)")
    p.add_argument("--llm", default=None, metavar="MODEL", help="an LLM's prefill and decode rates beside "
                   "llama.cpp, onnxruntime-genai and eager torch (MODEL: a folder of benchmarks/llm_models.py, or "
                   "a Hugging Face folder with --gguf / --ort)")
    p.add_argument("--gguf", default=None, help="--llm: the GGUF Q4_0 file of the same weights")
    p.add_argument("--ort", default=None, help="--llm: the onnxruntime-genai int4 folder of the same weights")
    p.add_argument("--llama-bench", default=None, help="--llm: llama.cpp's llama-bench (default: "
                   "$CUVIL_LLAMA_BENCH or PATH)")
    p.add_argument("--torch", action="store_true", help="--registry: eager torch, torch.compile (Inductor) and "
                   "cuvil's PyTorch front end beside cuvil's ONNX path and onnxruntime (cuvil.bench.torch)")


def _compile(sub: Any) -> None:
    p = sub.add_parser("compile", help="compile an ONNX model into one native module")
    p.set_defaults(command=("cuvil.cli.compile", "compile_cmd"))
    p.add_argument("model", nargs="?", default=None, help="model.onnx (default: the onnx wheel's light ResNet-50)")
    p.add_argument("-o", "--output", default=None,
                   help="model.so: a shared library with a C entry point and model.h (docs/export.md); "
                        "any other name: the module's LLVM IR; without -o nothing is written")
    shapes_flag(p, "input shapes, e.g. --shapes x=1,3,224,224 mask=1,128 (symbolic dimensions); repeat --shapes "
                "for several signatures in one .so")
    p.add_argument("--target", default="llvm")
    p.add_argument("--dump", nargs="?", const="graph", choices=["graph", "loops"], default=None,
                   help="print the graph after each pass and the kernel calls (loops: and each kernel's loop nest)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help=PRECISION_HELP)
    p.add_argument("--time", action="store_true",
                   help="print the wall time of each stage (import, graph passes, kernels, LLVM, export)")
    option_flags(p)


def _run(sub: Any) -> None:
    p = sub.add_parser("run", help="run an ONNX model on .npy inputs or random ones; print its outputs")
    p.set_defaults(command=("cuvil.cli.run", "run_cmd"))
    p.add_argument("model", help="model.onnx")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy", help="one per model input")
    p.add_argument("--random", action="store_true", help="random inputs for those not given by --input (floats "
                   "standard normal, token ids within their embedding's rows, other integers 0 or 1)")
    p.add_argument("--seed", type=int, default=0, help="--random: the seed")
    shapes_flag(p, "input shapes, e.g. --shapes x=1,3,224,224 mask=1,128 (symbolic dimensions); --random makes "
                "inputs of these shapes (default: 1 for symbolic dimensions)")
    p.add_argument("-o", "--output", default=None, help="write the outputs to this .npz")
    p.add_argument("--target", default="llvm")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help=PRECISION_HELP)
    option_flags(p)


def option_flags(p: Any) -> None:
    """The compile options beyond --target and --precision (cuvil.options.CompileOptions)."""
    p.add_argument("--no-winograd", action="store_true", help="every 3x3 convolution direct")
    p.add_argument("--no-bounds-checks", action="store_true", help="no run-time checks of indices read from inputs")
    p.add_argument("--no-fuse", action="store_true", help="one kernel per node")
    p.add_argument("--jobs", "-j", type=int, default=None,
                   help="worker processes that compile kernels (default: one per core; 1: none)")
    p.add_argument("--check-schedules", action="store_true",
                   help="isl proves the automatic schedules legal although they are legal by construction "
                        "(a debug mode, slower)")
    p.add_argument("--threshold", action="append", default=[], metavar="NAME=VALUE",
                   help="one of the scheduler's thresholds (cuvil.schedule.heuristics.Heuristics; default: derived "
                        "from the target), e.g. --threshold winograd_min_tiles=1")


def _tune(sub: Any) -> None:
    p = sub.add_parser("tune", help="autotune the kernels of a model (.onnx, a cuvil.models.zoo or a registry "
                       "name); results go to a tuning database")
    p.set_defaults(command=("cuvil.cli.tune", "tune_cmd"))
    p.add_argument("model", help="model.onnx, a cuvil.models.zoo name (resnet18, mobilenet_v2, bert, mlp) or a "
                   "registry name (bert-base, resnet50, ...: cuvil.models.registry, needs torch)")
    shapes_flag(p, "input shapes for the model's symbolic dimensions, e.g. --shapes x=8,3,224,224 mask=8,128 "
                "(the sizes the tuned kernels will run at)")
    p.add_argument("--trials", type=int, default=64, help="candidates to measure in all (default 64)")
    p.add_argument("--db", default="cuvil-tuning.db", help="the tuning database (SQLite; default cuvil-tuning.db)")
    p.add_argument("--target", default=None, help="the compile target (default: llvm, this machine's CPU)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds one candidate may run (default 10)")
    p.add_argument("--threads", type=int, default=None, help="threads the kernels run with (default: all cores)")
    p.add_argument("--plot", default=None, metavar="FILE", help="draw estimated latency against trials (.svg, or "
                   "any format with matplotlib)")
    p.add_argument("--registry", action="store_true", help="MODEL is a registry name even where cuvil.models.zoo "
                   "has a model of that name (resnet18)")
    p.add_argument("--config", default="full", choices=("full", "ci"), help="registry models: the published size "
                   "(full, default) or the small one (ci)")
    p.add_argument("--exporter", default="dynamo", choices=("dynamo", "torchscript"),
                   help="registry models: how they are exported to ONNX (default dynamo)")
    b = p.add_argument_group("tuning on boards (docs/boards.md)")
    b.add_argument("--cluster", default=None, metavar="URL", help="measure on the boards of this Dask scheduler "
                   "(cuvil scheduler), e.g. tls://tuner.local:8786; the kernels are compiled for the boards")
    b.add_argument("--board", default=None, metavar="NAME", help="with --cluster: the kind of board to measure on")
    b.add_argument("--tls-ca-file", default=None, metavar="FILE", help="the cluster's CA certificate (PEM)")
    b.add_argument("--tls-cert", default=None, metavar="FILE", help="this host's certificate (PEM), signed by the CA")
    b.add_argument("--tls-key", default=None, metavar="FILE", help="its private key (PEM)")
    b.add_argument("--insecure", action="store_true", help="allow a plain tcp:// scheduler beyond loopback")


def _boards(sub: Any) -> None:
    """``cuvil scheduler``, ``cuvil worker`` and ``cuvil cluster status`` (run by cuvil.autotune.cluster)."""
    from cuvil.autotune.cluster import DEFAULT_PORT, SCHEDULER_CONFIG

    p = sub.add_parser("scheduler", help="start a Dask scheduler for tuning boards (cuvil's defaults)")
    p.set_defaults(command=("cuvil.autotune.cluster", "dispatch"))
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; another needs "
                   "TLS or --insecure)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free one)")
    p.add_argument("--worker-ttl", default=SCHEDULER_CONFIG["distributed.scheduler.worker-ttl"],
                   help="drop a board silent this long (default %(default)s)")
    p.add_argument("--no-workers-timeout", default=SCHEDULER_CONFIG["distributed.scheduler.no-workers-timeout"],
                   help="fail a task no connected board can take after this long (default %(default)s)")
    tls_flags(p)
    w = sub.add_parser("worker", help="join a board to a cuvil scheduler: measures tuning candidates here")
    w.set_defaults(command=("cuvil.autotune.cluster", "dispatch"))
    w.add_argument("address", help="the scheduler, e.g. tls://tuner.local:8786")
    w.add_argument("--board", required=True, help="this board's kind, e.g. rpi5 (the Dask resource "
                   "cuvil-board-NAME)")
    w.add_argument("--threads", type=int, default=1, help="threads the kernels run with (default 1)")
    w.add_argument("--exec", dest="exec_prefix", default=None, metavar="PREFIX",
                   help="measure on a board reached through this command prefix (e.g. \"qemu-aarch64 -L "
                   "/usr/aarch64-linux-gnu\" or \"ssh pi@rpi\") with a C timing harness")
    w.add_argument("--host", default=None, help="address this worker listens on (default: loopback when the "
                   "scheduler is on loopback, else the interface that reaches it)")
    w.add_argument("--port", type=int, default=0, help="port this worker listens on (default: any free one; the "
                   "scheduler and the tuner connect to it: open it in a firewall)")
    w.add_argument("--death-timeout", default="60s", help="give up when the scheduler cannot be reached for "
                   "this long (default %(default)s)")
    tls_flags(w)
    c = sub.add_parser("cluster", help="the boards a cuvil scheduler knows")
    c.set_defaults(command=("cuvil.autotune.cluster", "dispatch"))
    csub = c.add_subparsers(dest="cluster_cmd")
    s = csub.add_parser("status", help="list the boards: kind, address, facts, busy or idle")
    s.add_argument("address", help="the scheduler, e.g. tls://tuner.local:8786")
    s.add_argument("--board", default=None, help="only boards of this kind")
    s.add_argument("--json", action="store_true", help="print the list as JSON (facts in full)")
    s.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the scheduler (default 10)")
    tls_flags(s)


def tls_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca-file", default=None, metavar="FILE", help="the cluster's CA certificate (PEM)")
    p.add_argument("--tls-cert", default=None, metavar="FILE", help="this side's certificate (PEM), signed by the CA")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="its private key (PEM)")
    p.add_argument("--insecure", action="store_true", help="allow plain TCP beyond loopback: anyone who reaches "
                   "the port can run code on every board")


def _generate(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate tokens with an LLM (Hugging Face folder, onnxruntime-genai "
                       "folder or GGUF file)")
    p.set_defaults(command=("cuvil.cli.generate", "generate_cmd"))
    p.add_argument("model", help="a Hugging Face folder (config.json), an onnxruntime-genai folder "
                   "(genai_config.json) or a .gguf file")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt-ids", default=None, help="the prompt as token ids, e.g. 1,15043,3186")
    g.add_argument("--prompt", default=None, help="the prompt as text (the folder's tokenizer encodes it)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--weights", default="as-stored", choices=("as-stored", "fp32", "int4", "int8"))
    p.add_argument("--group", type=int, default=32, help="int4: the weights of a group share a scale")
    p.add_argument("--threads", type=int, default=None, help="threads (default: cuvil's)")
    p.add_argument("--context", type=int, default=None, help="positions the KV cache holds")
    p.add_argument("--kv-cache", default="float32", choices=("float32", "int8"), help="the KV cache's values")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
