"""The error catalogue: each program in tests/e2e/errors/ makes one user mistake and must fail with the
cuvil error its docstring names (docs/errors.md lists them).

A program's docstring says, after its first line:

    needs: onnx                          (optional: skipped without it)
    raises: ShapeError                   (a cuvil.errors class), or
    exits: 1                             (a CLI command: its exit status, the message on stderr)
    says: compute C reads B[i, j] ...    (one or more: text the message must contain)

The programs run in this process (``runpy``), as ``python tests/e2e/errors/NAME.py`` would run them.
"""

import ast
import os
import runpy

import pytest
import toolchain

import cuvil.errors

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "errors")
PROGRAMS = sorted(f for f in os.listdir(HERE) if f.endswith(".py"))


def _expect(path: str) -> dict[str, list[str]]:
    doc = ast.get_docstring(ast.parse(open(path).read())) or ""
    out: dict[str, list[str]] = {}
    for line in doc.splitlines():
        key, sep, value = line.partition(": ")
        if sep and key in ("needs", "raises", "exits", "says"):
            out.setdefault(key, []).append(value.strip())
    return out


def test_catalogue_is_complete():
    assert len(PROGRAMS) >= 10
    for name in PROGRAMS:
        want = _expect(os.path.join(HERE, name))
        assert want.get("says") and ("raises" in want) != ("exits" in want), f"{name}: no raises/exits + says lines"


@pytest.mark.parametrize("name", PROGRAMS)
def test_error_program(name, capsys):
    path = os.path.join(HERE, name)
    want = _expect(path)
    for module in want.get("needs", []):
        toolchain.module(module)
    if "exits" in want:
        with pytest.raises(SystemExit) as info:
            runpy.run_path(path, run_name="__main__")
        assert info.value.code == int(want["exits"][0])
        message = capsys.readouterr().err.strip()
        assert "\n" not in message, f"{name}: the command printed more than its one-line error:\n{message}"
    else:
        cls = getattr(cuvil.errors, want["raises"][0])
        assert issubclass(cls, cuvil.errors.CuvilError)
        with pytest.raises(cuvil.errors.CuvilError) as info:
            runpy.run_path(path, run_name="__main__")
        assert type(info.value) is cls, f"{name}: raised {type(info.value).__name__}: {info.value}"
        message = str(info.value)
        inner, seen = info.value, []
        while inner is not None:  # no isl or LLVM exception in the traceback a user sees
            seen.append(type(inner).__module__)
            inner = inner.__cause__ or (None if inner.__suppress_context__ else inner.__context__)
        assert not [m for m in seen if m.split(".")[0] in ("islpy", "llvmlite")], f"{name}: chained from {seen}"
    for text in want["says"]:
        assert text in message, f"{name}: {text!r} is not in the message:\n{message}"
