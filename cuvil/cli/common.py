"""What every ``cuvil`` command shares: the one-line error, a usage error, ``--shapes`` and ``--threads`` as
values, the compile options the flags ask for, and files written whole or not at all."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from cuvil.errors import ArgumentError

__all__ = ["UsageError", "check_writable", "compile_options", "error", "parse_shapes", "positive_ints",
           "write_atomic"]


class UsageError(Exception):
    """A command line that does not parse as meant (e.g. a flag another flag needs): :func:`cuvil.cli.main`
    prints argparse's usage and the message, and exits with status 2."""


def error(message: str, code: int = 1) -> int:
    """Print ``cuvil: error: message`` on stderr (further lines of the message indented) and return
    ``code``."""
    first, *rest = message.strip().splitlines() or [""]
    print(f"cuvil: error: {first}", file=sys.stderr)
    for line in rest:
        print(f"  {line}", file=sys.stderr)
    return code


def positive_ints(flag: str, text: str) -> list[int]:
    """``--threads 1,2`` -> [1, 2]; anything else is a :class:`UsageError`."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise UsageError(f"{flag} {text!r}: write positive integers separated by commas, e.g. {flag} 1,2")
    return values


def parse_shapes(groups: list[list[str]] | list[str], one: bool = False) -> Any:
    """``--shapes`` as argparse collects them (one list of ``NAME=D0,D1,...`` items per ``--shapes``;
    ``;`` also separates items) -> one ``{name: shape}`` per signature; with ``one``, at most one
    signature, returned as a dict ({} when none)."""
    signatures = []
    for group in groups:
        items = [group] if isinstance(group, str) else group
        sig: dict[str, tuple[int, ...]] = {}
        for text in items:
            for part in text.replace(" ", ";").split(";"):
                if not part:
                    continue
                name, eq, dims = part.partition("=")
                try:
                    shape = tuple(int(d) for d in dims.split(",") if d)
                except ValueError:
                    shape = ()
                if not eq or not name or not shape or any(d < 1 for d in shape):
                    raise ArgumentError(f"--shapes {part!r}: write NAME=D0,D1,... with positive sizes, e.g. "
                                        "--shapes x=1,3,224,224 mask=1,128 (the model goes before --shapes)")
                if name in sig:
                    raise ArgumentError(f"--shapes gives input {name!r} twice in one signature")
                sig[name] = shape
        signatures.append(sig)
    if one:
        if len(signatures) > 1:
            raise ArgumentError("this command takes one --shapes (a list of NAME=D0,D1,... items); several are "
                                "for `cuvil compile -o model.so`")
        return signatures[0] if signatures else {}
    return signatures


def compile_options(args: argparse.Namespace) -> Any:
    """The CompileOptions the command line asks for (``--target``, ``--precision`` and the flags of
    :func:`cuvil.cli.parser.option_flags`)."""
    from cuvil.options import CompileOptions

    opts = CompileOptions(target=args.target, precision=args.precision, winograd=not args.no_winograd,
                          bounds_checks=not args.no_bounds_checks, fuse=not args.no_fuse, jobs=args.jobs,
                          check_schedules=args.check_schedules)
    changes: dict[str, Any] = {}
    for item in args.threshold:
        name, sep, value = item.partition("=")
        if not sep:
            raise ArgumentError(f"--threshold {item!r}: expected NAME=VALUE")
        try:
            changes[name] = float(value) if "." in value else int(value)
        except ValueError:
            raise ArgumentError(f"--threshold {item!r}: {value!r} is not a number") from None
    return opts.with_heuristics(**changes) if changes else opts


def check_writable(path: str) -> None:
    """Refuse an output path whose folder is missing or that is a folder, before any work is done."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ArgumentError(f"cannot write {path!r}: the folder {folder!r} does not exist")
    if os.path.isdir(path):
        raise ArgumentError(f"cannot write {path!r}: it is a folder")


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` at ``path`` through a temporary file in the same folder, renamed at the end."""
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=".cuvil-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
