"""Dependencies point down: every import under cuvil/ (at module level and inside functions) goes to the
importer's own layer or a lower one of ``cuvil.layers.LAYERS``, and no module imports a private name of
another package.  The check lists every violation at once and knows no exception: fix the import (move
the code down, or pass it in), never the check.  No LLVM, no islpy: it only parses the sources."""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

from cuvil.layers import LAYERS, layer_of, markdown_table

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "cuvil"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _package(module: str) -> str:
    """The folder ``module`` sits in, as a dotted name (a package is its own folder)."""
    return module if MODULES.get(module, pathlib.Path()).name == "__init__.py" else module.rpartition(".")[0]


def _front_door() -> tuple[dict[str, str], set[str]]:
    """``cuvil/__init__.py``'s lazy names (name -> module) and the names it binds when imported."""
    tree = ast.parse(MODULES["cuvil"].read_text())
    lazy: dict[str, str] = {}
    eager = {"__file__", "__name__", "__path__", "__spec__", "__doc__", "__all__"}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if names == ["_LAZY"]:
                lazy = {k: v[0] for k, v in ast.literal_eval(node.value).items()}
            eager.update(names)
        elif isinstance(node, ast.ImportFrom):
            eager.update(a.asname or a.name for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            eager.add(node.name)
    return lazy, eager


LAZY, EAGER = _front_door()


@dataclass(frozen=True)
class Use:
    """One import: ``importer`` (line ``line``) uses ``target`` (a module), naming ``name`` in it (or None)."""

    importer: str
    line: int
    target: str
    name: str | None = None
    how: str = ""


def _absolute(importer: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _package(importer).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _front_door_use(importer: str, chain: list[str], line: int) -> Use:
    """What ``cuvil.a.b.c`` (``chain`` = [a, b, c]) in ``importer`` uses: the longest module prefix, a lazy
    name's module, or the front door itself for the names ``cuvil/__init__.py`` binds."""
    for k in range(len(chain), 0, -1):
        dotted = ".".join(["cuvil", *chain[:k]])
        if dotted in MODULES:
            return Use(importer, line, dotted, chain[k] if k < len(chain) else None, how=f"cuvil.{'.'.join(chain)}")
    if chain and chain[0] in LAZY:
        return Use(importer, line, LAZY[chain[0]], how=f"cuvil.{chain[0]} (the front door's _LAZY)")
    if chain and chain[0] in EAGER:
        return Use(importer, line, "cuvil", chain[0], how=f"cuvil.{chain[0]}")
    return Use(importer, line, "?", how=f"cuvil.{'.'.join(chain) or ''}: not a name of the front door")


def _bare_cuvil_uses(importer: str, scope: ast.AST) -> list[Use]:
    """The ``cuvil.X...`` chains in ``scope``, where ``import cuvil`` (or ``import cuvil.x``) bound the name."""
    uses = []
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(scope):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    for node in ast.walk(scope):
        if isinstance(node, ast.Name) and node.id == "cuvil":
            chain, up = [], parents.get(node)
            while isinstance(up, ast.Attribute):
                chain.append(up.attr)
                up = parents.get(up)
            uses.append(_front_door_use(importer, chain, node.lineno) if chain else
                        Use(importer, node.lineno, "?", how="the bare name cuvil (use one of its attributes)"))
    return uses


def _string_import(node: ast.Call) -> str | None:
    """The module ``importlib.import_module("cuvil....")`` names: a literal, or an f-string's literal head."""
    if not (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module" and node.args):
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        head = str(arg.values[0].value)
        return head.rpartition(".")[0] if "." in head else None  # "cuvil.models.registry.{x}" -> cuvil.models.registry
    return None


def _module_attribute_uses(importer: str, scope: ast.AST, alias: str, module: str) -> list[Use]:
    """``alias.name`` in ``scope``, where an import bound ``alias`` to ``module``: the names it reads there."""
    return [Use(importer, node.lineno, module, node.attr, how=f"{alias}.{node.attr} ({module})")
            for node in ast.walk(scope) if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == alias]


def uses_of(importer: str, source: str) -> list[Use]:
    """Every cuvil module ``importer`` imports, with the names it takes from each (and the names it reads
    from the modules it binds to a name: ``from cuvil.runtime import threads`` then ``threads.x``)."""
    tree = ast.parse(source)
    uses: list[Use] = []
    scopes: list[ast.AST] = []
    bound: list[tuple[ast.AST, str, str]] = []  # (scope, name, module)
    scope_of: dict[ast.AST, ast.AST] = {}  # node -> the function (or module) whose names it sees
    for node in ast.walk(tree):  # parents before children
        for child in ast.iter_child_nodes(node):
            functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            scope_of[child] = node if isinstance(node, functions) else scope_of.get(node, tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "cuvil" or a.name.startswith("cuvil."):
                    if a.name != "cuvil":
                        uses.append(Use(importer, node.lineno, a.name, how=f"import {a.name}"))
                    if a.asname is None:  # binds the name cuvil: its attributes are what is used
                        scopes.append(scope_of[node])
                    elif a.name == "cuvil":
                        uses.append(Use(importer, node.lineno, "?", how=f"import cuvil as {a.asname}"))
                    else:
                        bound.append((scope_of[node], a.asname, a.name))
        elif isinstance(node, ast.ImportFrom):
            mod = _absolute(importer, node)
            if mod != "cuvil" and not mod.startswith("cuvil."):
                continue
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub in MODULES:
                    uses.append(Use(importer, node.lineno, sub, a.name if a.name.startswith("_") else None,
                                    how=f"from {mod} import {a.name}"))
                    bound.append((scope_of[node], a.asname or a.name, sub))
                elif mod == "cuvil":
                    u = _front_door_use(importer, [a.name], node.lineno)
                    uses.append(Use(importer, node.lineno, u.target, a.name, how=f"from cuvil import {a.name}"))
                else:
                    uses.append(Use(importer, node.lineno, mod, a.name, how=f"from {mod} import {a.name}"))
        elif isinstance(node, ast.Call):
            target = _string_import(node)
            if target is not None and target.startswith("cuvil"):
                uses.append(Use(importer, node.lineno, target, how=f"importlib.import_module({target!r})"))
    for scope in {id(s): s for s in scopes}.values():
        uses.extend(_bare_cuvil_uses(importer, scope))
    for scope, alias, module in bound:
        uses.extend(_module_attribute_uses(importer, scope, alias, module))
    return uses


def _all_uses() -> list[Use]:
    return [u for m, p in MODULES.items() for u in uses_of(m, p.read_text())]


def _where(u: Use) -> str:
    return f"{MODULES[u.importer].relative_to(ROOT)}:{u.line}"


def _private(name: str | None) -> bool:
    return bool(name) and name.startswith("_") and not name.startswith("__")  # type: ignore[union-attr]


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in MODULES if layer_of(m) is None)
    assert not unplaced, f"modules no prefix of cuvil/layers.py's LAYERS names (add them to a layer): {unplaced}"


def test_imports_point_down():
    bad = []
    for u in _all_uses():
        if u.target == "?":
            bad.append(f"{_where(u)}: {u.how}")
            continue
        mine, theirs = layer_of(u.importer), layer_of(u.target)
        if theirs is None:
            bad.append(f"{_where(u)}: {u.how}: {u.target} is no module of cuvil")
        elif mine is not None and theirs > mine:
            bad.append(f"{_where(u)}: {u.how}: layer {LAYERS[mine].name!r} imports {u.target} of the higher "
                       f"layer {LAYERS[theirs].name!r}")
    assert not bad, "imports that point up (cuvil/layers.py):\n" + "\n".join(sorted(set(bad)))


def test_no_private_name_crosses_a_package():
    bad = sorted({f"{_where(u)}: {u.how} (package {_package(u.importer)} takes a private name of "
                  f"{_package(u.target) if u.target != 'cuvil' else 'cuvil'})"
                  for u in _all_uses() if _private(u.name) and u.target != "?"
                  and _package(u.importer) != _package(u.target)})
    assert not bad, "private names imported across packages:\n" + "\n".join(bad)


def test_the_docs_show_the_table():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert markdown_table() in doc, "docs/architecture.md does not show cuvil/layers.py's table: paste the " \
                                    "output of `python -m cuvil.layers`"
    assert "docs/architecture.md" in (ROOT / "README.md").read_text()


# -- the check itself: what it reads, what it refuses ----------------------------------------------


def _check(importer: str, source: str) -> list[tuple[str, str | None]]:
    return [(u.target, u.name) for u in uses_of(importer, source)]


def test_the_check_reads_every_form_of_import():
    src = """
import cuvil.graph.ir
from cuvil.schedule import auto
from . import ir as graph_ir
from .ops.base import op, _private_thing

def f():
    import cuvil
    from cuvil import te, build
    import importlib
    importlib.import_module("cuvil.autotune.api")
    importlib.import_module(f"cuvil.models.registry.{f}")
    return cuvil.lower, cuvil.__version__, cuvil.schedule.auto.auto_schedule, cuvil.runtime
"""
    got = _check("cuvil.graph.example", src)
    for want in [("cuvil.graph.ir", None), ("cuvil.schedule.auto", None), ("cuvil.graph.ir", None),
                 ("cuvil.graph.ops.base", "op"), ("cuvil.graph.ops.base", "_private_thing"), ("cuvil.te", None),
                 ("cuvil.pipeline", "build"), ("cuvil.autotune.api", None), ("cuvil.models.registry", None),
                 ("cuvil.pipeline", None), ("cuvil", "__version__"), ("cuvil.schedule.auto", None),
                 ("cuvil.runtime", None)]:
        assert want in got, (want, got)


def test_the_check_refuses_an_import_that_points_up():
    uses = uses_of("cuvil.graph.example", "def f():\n    import cuvil\n    return cuvil.autotune.tune\n")
    assert [(u.target, layer_of(u.target) > layer_of(u.importer)) for u in uses] == [("cuvil.autotune", True)]
    assert [u.target for u in uses_of("cuvil.ir.x", "import cuvil\ncuvil.not_a_name\n")] == ["?"]


def test_the_check_sees_private_names_read_through_a_module():
    for src in ("from cuvil.runtime import threads\ndef f():\n    return threads._explicit\n",
                "def f():\n    import cuvil\n    return cuvil.runtime.threads._explicit\n",
                "import cuvil.runtime.threads as th\nth._explicit\n",
                "from cuvil.runtime.threads import _explicit\n"):
        assert ("cuvil.runtime.threads", "_explicit") in _check("cuvil.graph.example", src), src


def test_the_layers_are_in_pipeline_order():
    order = [layer.name for layer in LAYERS]
    assert order.index("ground") == 0 and order[-1] == "tools"
    for low, high in [("cuvil.ir.expr", "cuvil.schedule.auto"), ("cuvil.schedule.records", "cuvil.graph.compile"),
                      ("cuvil.te.tensor", "cuvil.schedule.model"), ("cuvil.schedule.model", "cuvil.te.api"),
                      ("cuvil.codegen.llvm", "cuvil.runtime.module"), ("cuvil.runtime.module", "cuvil.pipeline"),
                      ("cuvil.graph.compile", "cuvil.frontend.onnx"), ("cuvil.frontend.onnx", "cuvil.autotune.api"),
                      ("cuvil.autotune.api", "cuvil.onnx"), ("cuvil.onnx", "cuvil.models.zoo"),
                      ("cuvil.models.resolve", "cuvil.cli.tune")]:
        assert layer_of(low) < layer_of(high), (low, high)


# -- no import cycle inside a package ---------------------------------------------------------------

ACYCLIC = ("cuvil.graph.ops",)  # packages whose modules import one another without a cycle


def import_cycles(package: str, uses: list[Use]) -> list[list[str]]:
    """The import cycles among the modules under ``package`` (each a strongly connected set of modules,
    module-level and function-level imports alike; a package's ``__init__`` counts as one more module)."""
    mods = sorted(m for m in MODULES if m == package or m.startswith(package + "."))
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for u in uses:
        if u.importer in edges and u.target in edges and u.target != u.importer:
            edges[u.importer].add(u.target)
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            comp = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(comp) > 1:
                found.append(sorted(comp))

    for m in mods:
        if m not in order:
            visit(m)
    return found


def test_no_import_cycle_inside_a_package():
    uses = _all_uses()
    bad = [f"{p}: {' <-> '.join(c)}" for p in ACYCLIC for c in import_cycles(p, uses)]
    assert not bad, "import cycles (move the shared code down into a module both may import):\n" + "\n".join(bad)


def test_the_cycle_check_finds_a_cycle():
    ops = sorted(m for m in MODULES if m.startswith("cuvil.graph.ops."))[:3]
    ring = [Use(a, 1, b) for a, b in zip(ops, ops[1:] + ops[:1])]
    assert import_cycles("cuvil.graph.ops", ring) == [ops]
    assert import_cycles("cuvil.graph.ops", ring[:-1]) == []
