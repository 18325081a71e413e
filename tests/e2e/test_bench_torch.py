"""``cuvil bench --registry --torch`` (cuvil.bench.torch) on one small model: ResNet-18 at its "ci" config, 1 thread,
few rounds, Inductor's two rows left out (they compile for 10-60 s).  Every engine has its row, the rows that ran
give numbers (times, ratio to onnxruntime) and match eager torch; an engine that cannot run (the torch.compile
backend before it is registered) prints ``failed: ...`` in its row and the others still run.

torch, transformers, onnxscript (the dynamo exporter), onnx and onnxruntime are needed: without them the tests are
skipped, except under ``CI=true`` where that fails.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
from toolchain import missing

ENGINES = ["eager", "cuvil.torch", "compile(cuvil)", "cuvil-onnx", "onnxruntime"]


def _needs_torch() -> None:
    for mod in ("torch", "transformers", "onnxscript", "onnx", "onnxruntime"):
        if importlib.util.find_spec(mod) is None:
            missing(f"{mod} is not installed (pip install -e '.[torch]')")


def _usable(engine: str) -> bool:
    """Whether cuvil's torch front end offers ``engine`` in this checkout (the lead's work lands in steps)."""
    if engine not in ("cuvil.torch", "compile(cuvil)"):
        return True
    try:
        import torch

        import cuvil.torch  # noqa: F401
    except ImportError:
        return False
    return engine == "cuvil.torch" or "cuvil" in torch._dynamo.list_backends()


@pytest.mark.slow
def test_every_engine_has_a_row_with_numbers(capsys):
    _needs_torch()
    from cuvil.bench import torch as bench_torch

    code = bench_torch.run(["resnet18"], "ci", [1], rounds=2, budget_s=0.05, cold=False, engines=ENGINES)
    out = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(out) if line.startswith("model"))
    assert "1T cpu ms" in out[head] and "/ort" in out[head]
    rows = {line.split()[1]: line for line in out[head + 1:] if line.startswith("resnet18")}
    assert sorted(rows) == sorted(ENGINES)  # no Inductor rows: left out by engines=
    for engine, line in rows.items():
        if not _usable(engine):
            assert "failed: " in line, line
            continue
        fields = line.split()
        assert fields[2].endswith("s") and float(fields[2][:-1]) >= 0, line  # compile seconds
        cpu, wall, ratio = (float(x) for x in fields[3:6])
        assert all(math.isfinite(x) and x > 0 for x in (cpu, wall, ratio)), line
        assert fields[6] == "ok", line  # every output within rtol 1e-3 / atol 1e-4 of eager torch
    assert float(rows["onnxruntime"].split()[5]) == 1.0
    assert any(line.startswith("1 thread(s), geometric mean") for line in out)
    assert out[-1].startswith("load average after:")
    assert code == (0 if all(_usable(e) for e in ENGINES) else 1)


def test_torch_needs_registry():
    from cuvil import cli

    with pytest.raises(SystemExit):
        cli.main(["bench", "--torch"])
