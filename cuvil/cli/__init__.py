"""The ``cuvil`` command line.

    cuvil compile [model.onnx] [-o model.so | -o model.ll] [--shapes x=1,3,224,224 mask=1,128] [--dump]
    cuvil run model.onnx --input x=x.npy [-o out.npz]   # or --random [--shapes ...]; prints each output
    cuvil bench [model.onnx | zoo name ...] [--threads 1,2] [--shapes ...]   # whole models beside onnxruntime
    cuvil bench --ops [--quick] [--only matmul]         # operators beside numpy (cuvil.bench.ops)
    cuvil bench --registry --torch [names] [--config ci]  # torch eager, Inductor, cuvil.torch beside onnxruntime
    cuvil bench --registry [names] --quant qdq-u8s8,dynamic  # int8 files beside onnxruntime and cuvil's fp32
    cuvil bench ... --target x86-64-v3                   # compile for another CPU this one runs (AVX2 here)
    cuvil tune ...                                       # the autotuner (cuvil.cli.tune)
    cuvil scheduler | worker | cluster status ...        # tuning boards (cuvil.autotune.cluster, docs/boards.md)
    cuvil generate MODEL --prompt TEXT                   # an LLM's tokens (cuvil.llm)
    cuvil demo | info                                    # auto-scheduled matmul and conv beside numpy and ort

The package: :mod:`~cuvil.cli.parser` is the one parser (every command and flag); each command runs in a
module of its own (:mod:`~cuvil.cli.compile`, :mod:`~cuvil.cli.run`, :mod:`~cuvil.cli.bench`,
:mod:`~cuvil.cli.tune`, :mod:`~cuvil.cli.generate`, :mod:`~cuvil.cli.info`; the board commands in
:mod:`cuvil.autotune.cluster`); :mod:`~cuvil.cli.common` holds what they share.  A model named on the
command line resolves in one place, :mod:`cuvil.models.resolve` (a file, a zoo name, a registry name).

An error is one line on stderr, ``cuvil: error: ...``, and exit status 1 (2: an internal error, a bug);
``cuvil --traceback <command> ...`` shows Python's traceback instead.
"""

from __future__ import annotations

import argparse
import importlib

from cuvil.cli.common import UsageError, error
from cuvil.cli.parser import build_parser
from cuvil.errors import CuvilError

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _dispatch(args)
    except UsageError as exc:  # a flag that needs another: argparse's usage line and exit status 2
        parser.error(str(exc))
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


def _dispatch(args: argparse.Namespace) -> int:
    if args.version:
        import cuvil

        print(cuvil.__version__)
        return 0
    if getattr(args, "command", None) is None:
        build_parser().print_help()
        return 0
    module, name = args.command
    return getattr(importlib.import_module(module), name)(args)

