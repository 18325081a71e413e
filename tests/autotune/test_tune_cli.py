"""``cuvil tune`` from the command line: models named by file, cuvil.models.zoo name or registry name, ``--shapes``
for symbolic dimensions, kernels named by op and shapes, a runner built from the arguments and handed to every
kernel's tuning, and the mistakes a user makes (a symbolic batch without ``--shapes``, an unknown name)."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import pytest
import toolchain

import cuvil
from cuvil.autotune.database import Database
from cuvil.autotune.measure import LocalRunner
from cuvil.cli import main
from cuvil.cli import tune as tune_cli
from cuvil.cli.parser import build_parser


@pytest.fixture
def tiny(tmp_path):
    """MatMul (N x 32) x (32 x 16) + Relu with a symbolic batch N."""
    onnx = toolchain.module("onnx")
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
    g = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16])], [w])
    path = tmp_path / "tiny.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


class CountingRunner:
    """A local runner that counts what the tuner asks of it (the hook a board runner plugs into)."""

    def __init__(self) -> None:
        self.inner = LocalRunner(1, timeout_s=5.0)
        self.calls: dict[str, int] = {}
        self.closed = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name in ("set_inputs", "reference", "run", "final"):
            def counted(*a: Any, **kw: Any) -> Any:
                self.calls[name] = self.calls.get(name, 0) + 1
                return attr(*a, **kw)
            return counted
        return attr

    def close(self) -> None:
        self.closed += 1
        self.inner.close()


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cuvil: error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.slow
def test_a_file_with_a_symbolic_batch_tunes_at_the_given_shapes_through_the_runner_hook(tiny, tmp_path, capsys,
                                                                                        monkeypatch):
    made: list[CountingRunner] = []
    monkeypatch.setattr(tune_cli, "make_runner", lambda args: made.append(CountingRunner()) or made[-1])
    db = tmp_path / "t.db"
    assert main(["tune", str(tiny), "--shapes", "x=4,32", "--trials", "2", "--timeout", "5", "--threads", "1",
                 "--db", str(db)]) == 0
    out, err = capsys.readouterr()
    (runner,) = made  # one runner for the run, used by the kernel's tuning and its final round, closed by run()
    assert runner.closed == 1 and all(runner.calls.get(m) for m in ("set_inputs", "reference", "run", "final"))
    with Database(str(db)) as d:
        recs = d.records()
    (key,) = {r.workload for r in recs}
    assert len(recs) == 2
    name = f"MatMul 4x32 * 32x16 (+Relu) [{key[:8]}]"  # op and shapes (the batch from --shapes), then the key
    row = next(line for line in out.splitlines() if line.endswith(name))
    assert row.split()[:2] == ["1", "2"]  # called once a run, 2 trials
    assert "1 distinct kernel (1 call a run), 2 trials" in err
    assert f"[cuvil tune {name}] 2/2 trials" in err and f"[cuvil tune {name}] final round" in err


def test_a_zoo_name_tunes(tmp_path, capsys):
    db = tmp_path / "t.db"
    assert main(["tune", "mlp", "--trials", "1", "--timeout", "5", "--threads", "1", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "MatMul 64x784 * 784x1024 (+Add+Relu) [" in out  # cuvil.models.zoo's MLP at its own batch of 64
    with Database(str(db)) as d:
        assert len(d.records()) == 1


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["tune", *argv])


def test_names_resolve_to_zoo_registry_or_file(tiny, tmp_path, monkeypatch):
    # a zoo model with a symbolic batch is tuned at its own inputs' shapes; --shapes overrides them
    graph, shapes = tune_cli.resolve_model(_args("bert"), str(tmp_path))
    assert shapes == {"x": (1, 128, 256), "mask": (1, 128)}
    _, shapes = tune_cli.resolve_model(_args("bert", "--shapes", "x=2,128,256", "mask=2,128"), str(tmp_path))
    assert shapes == {"x": (2, 128, 256), "mask": (2, 128)}
    _, shapes = tune_cli.resolve_model(_args(str(tiny), "--shapes", "x=3,32"), str(tmp_path))
    assert shapes == {"x": (3, 32)}
    # registry names go to cuvil.models.registry at --config / --exporter; --registry where cuvil.models.zoo has the name too
    from cuvil.models import registry

    asked = []
    monkeypatch.setattr(registry, "export", lambda name, config, exporter: asked.append((name, config, exporter))
                        or str(tiny))
    tune_cli.resolve_model(_args("bert-base", "--config", "ci", "--shapes", "x=1,32"), str(tmp_path))
    tune_cli.resolve_model(_args("resnet18", "--registry", "--exporter", "torchscript", "--shapes", "x=1,32"),
                           str(tmp_path))
    assert asked == [("bert-base", "ci", "dynamo"), ("resnet18", "full", "torchscript")]
    graph, shapes = tune_cli.resolve_model(_args("resnet18"), str(tmp_path))  # cuvil.models.zoo's
    assert shapes == {"x": (1, 3, 224, 224)} and len(asked) == 2


def test_a_registry_model_resolves_at_its_ci_size(tmp_path):
    toolchain.module("torch")
    graph, shapes = tune_cli.resolve_model(_args("bert-base", "--config", "ci"), str(tmp_path))
    assert set(shapes) == {v.name for v in graph.feeds} and all(s[0] == 1 for s in shapes.values())


def test_a_symbolic_batch_without_shapes_is_a_one_line_error_that_names_it(tiny, capsys):
    assert main(["tune", str(tiny)]) == 1
    line = _one_line(capsys.readouterr().err)
    assert "input 'x' ['N', 32]: dimension 0 (N) is symbolic" in line and "pass --shapes x=1,32" in line


@pytest.mark.parametrize("argv,words", [
    (["no-such-model"], ["'no-such-model' is neither a model file", "resnet18", "mlp", "bert-base", "gpt2"]),
    (["{tiny}", "--shapes", "x=4,33"], ["--shapes x=4,33: dimension 1 must be 32"]),
    (["{tiny}", "--shapes", "y=4,32"], ["--shapes names 'y', not an input of the model"]),
    (["{tiny}", "--shapes", "x=4"], ["--shapes x=4 has rank 1; the model declares ['N', 32]"]),
])
def test_mistakes_are_one_line_errors(tiny, argv, words, capsys):
    assert main(["tune", *[a.format(tiny=tiny) for a in argv]]) == 1
    line = _one_line(capsys.readouterr().err)
    for w in words:
        assert w in line


def test_tune_kernels_hands_the_runner_to_every_call_and_reports_a_kernel_it_cannot_tune():
    from cuvil import te
    from cuvil.autotune.api import TuneResult
    from cuvil.autotune.whole_models import tune_kernels

    def prog(n: int) -> list[Any]:
        a = te.placeholder((n,), name="a")
        return [a, te.compute((n,), lambda i: a[i] * 2.0, name="b")]

    kernels = [(prog(8), 1, "Mul 8"), (prog(16), 3, "Mul 16")]
    seen: list[tuple[int, Any, str]] = []
    runner = object()

    def fake_tune(args, target, trials, **kw):
        n = int(args[0].shape[0].value)
        seen.append((n, kw.get("runner"), kw.get("label")))
        if n == 8:
            raise cuvil.CuvilError("tune: the untuned schedule of workload x does not run: BoundsError: ...")
        return TuneResult(1e-3, None, "[]", {}, f"key{n:012d}", "t", 1, trials, trials, untuned_time_s=2e-3)

    res = tune_kernels(kernels, trials=8, tune_fn=fake_tune, runner=runner, progress=False)
    assert all(r is runner for _, r, _ in seen) and {(n, lab) for n, _, lab in seen} == {(8, "Mul 8"), (16, "Mul 16")}
    failed, ok = res
    assert failed.trials == 0 and failed.best_time_s is None and "does not run" in failed.error
    assert failed.title.startswith("Mul 8 [") and ok.title == "Mul 16 [key00000]" and ok.best_time_s == 1e-3
    table = tune_cli.results_table(res)
    assert "not tuned: tune: the untuned schedule" in table and "3.000 ms tuned, 6.000 ms untuned (2.00x)" in table  # 3 calls
    with pytest.raises(cuvil.CuvilError, match="does not run"):  # nothing tunable: the run fails
        tune_kernels(kernels[:1], trials=4, tune_fn=fake_tune, progress=False)
    with pytest.raises(cuvil.ArgumentError, match="bad"):  # a mistake in the arguments stops the run at once

        def bad(*a, **kw):
            raise cuvil.ArgumentError("bad")
        tune_kernels(kernels, trials=4, tune_fn=bad, progress=False)
