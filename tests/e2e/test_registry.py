"""Every model of cuvil.models.registry (real architectures in torch.nn and Hugging Face transformers),
exported by both of torch.onnx.export's exporters at its small "ci" config, compiled by
cuvil.onnx.InferenceSession and compared with onnxruntime on the same seeded inputs: every output
within rtol 1e-3, atol 1e-4.

Also: a dynamic-axes export of a few models run at two batch sizes, the registry's own contract
(names, errors, ``import cuvil`` stays free of torch), and, with ``CUVIL_TEST_REGISTRY=full`` only,
every model at its published size (slow: benchmarks/registry_status.py prints the same as a table).  Exports are made once per run by a
session fixture and cached on disk by content (``$CUVIL_REGISTRY_DIR``).  torch, transformers and
onnxscript are needed; without them the file is skipped, except under ``CI=true`` where that fails.

A model cuvil cannot compile yet is listed in XFAIL with the exception it raises today (strict: a
fix shows up as XPASS, and the entry is taken out).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import numpy as np
import pytest
from toolchain import IN_CI

for _mod in ("torch", "transformers", "onnxscript", "onnx", "onnxruntime"):
    try:
        importlib.import_module(_mod)
    except ImportError:
        if IN_CI:
            pytest.fail(f"{_mod} is not installed (CI=true: .ci/run must install the test extra, torch included)",
                        pytrace=False)
        pytest.skip(f"{_mod} is not installed (pip install -e '.[torch]')", allow_module_level=True)

import onnxruntime as ort  # noqa: E402

import cuvil.onnx  # noqa: E402
from cuvil.errors import CuvilError, UnsupportedOpError  # noqa: E402
from cuvil.models import registry  # noqa: E402

# (model, exporter, "static" | "dynamic" | "full") -> (the exception cuvil raises today, the message seen);
# exporter "*" stands for both.  strict: a fix shows up as XPASS, and its entry is taken out.
XFAIL: dict[tuple[str, str, str], tuple[type[BaseException], str]] = {
    ("lstm", "*", "dynamic"): (UnsupportedOpError, "LSTM node ...: cannot unroll it: the shapes of X, W and R "
                                                   "must be static (the steps are unrolled at compile time)"),
}

# models also exported with dynamic axes (batch; and sequence for text; past length for the decode step) and
# run at two batch sizes.  (Not ResNet-18: its ci model compiles in ~14 s at batch 2 but ~36 s at batch 3.)
DYNAMIC = ["unet", "lstm", "bert-base", "gpt2-decode"]
DYNAMIC_BATCHES = (2, 3)
# the fast lane's cases (-m "not slow"): a transformer with each exporter, and one dynamic export
FAST = {("vit-s16", "torchscript", "static"), ("gpt2-decode", "dynamo", "static"),
        ("gpt2-decode", "torchscript", "dynamic")}
RTOL, ATOL = 1e-3, 1e-4


def _cases(models: list[str], kind: str) -> list:
    out = []
    for name in models:
        for exporter in registry.EXPORTERS:
            known = XFAIL.get((name, exporter, kind)) or XFAIL.get((name, "*", kind))
            marks = [pytest.mark.xfail(strict=True, raises=known[0], reason=known[1])] if known else []
            marks += [] if (name, exporter, kind) in FAST else [pytest.mark.slow]
            out.append(pytest.param(name, exporter, id=f"{name}-{exporter}", marks=marks))
    return out


@pytest.fixture(scope="session")
def exported():
    """``get(name, exporter, dynamic=False)``: the model's ci export, made once per run (an export that
    failed fails every test that asks for it, with the same error)."""
    done: dict[tuple[str, str, bool], str | Exception] = {}

    def get(name: str, exporter: str, dynamic: bool = False) -> str:
        key = (name, exporter, dynamic)
        if key not in done:
            try:
                done[key] = registry.export(name, "ci", exporter, dynamic)
            except Exception as exc:  # noqa: BLE001 - re-raised for each test that needs it
                done[key] = exc
        if isinstance(done[key], Exception):
            raise done[key]
        return done[key]  # type: ignore[return-value]

    return get


def _check(path: str, feeds: dict[str, np.ndarray], what: str, sess: object = None) -> None:
    """Run ``path`` in cuvil (``sess``, or a new session) and in onnxruntime; every output must match."""
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    if sess is None:
        sess = cuvil.onnx.InferenceSession(path)
    got = sess.run(None, feeds)
    names = [o.name for o in sess.get_outputs()]
    assert len(got) == len(ref), f"{what}: {len(got)} outputs, onnxruntime gives {len(ref)}"
    for name, g, r in zip(names, got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype, f"{what} {name}: {g.shape} {g.dtype} vs {r.shape} {r.dtype}"
        np.testing.assert_allclose(g, r, rtol=RTOL, atol=ATOL, err_msg=f"{what}, output {name!r}")


@pytest.mark.parametrize("name, exporter", _cases(registry.names(), "static"))
def test_model_matches_onnxruntime(exported, name: str, exporter: str) -> None:
    path = exported(name, exporter)
    _check(path, registry.example_inputs(name, "ci"), f"{name} ({exporter})")


FULL = os.environ.get("CUVIL_TEST_REGISTRY", "") == "full"


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="full-size models: CUVIL_TEST_REGISTRY=full (about 10 min for all, cold)")
@pytest.mark.parametrize("name, exporter", _cases(registry.names(), "full"))
def test_full_size_matches_onnxruntime(name: str, exporter: str) -> None:
    path = registry.export(name, "full", exporter)
    _check(path, registry.example_inputs(name, "full"), f"{name} full size ({exporter})")


def _batched(feeds: dict[str, np.ndarray], batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The example feeds at ``batch``: integer inputs (ids, masks) repeated, float inputs drawn anew."""
    out = {}
    for k, a in feeds.items():
        shape = (batch,) + a.shape[1:]
        out[k] = rng.standard_normal(shape).astype(a.dtype) if a.dtype.kind == "f" else np.repeat(a, batch, 0)
    return out


@pytest.mark.parametrize("name, exporter", _cases(DYNAMIC, "dynamic"))
def test_dynamic_batch(exported, name: str, exporter: str) -> None:
    path = exported(name, exporter, dynamic=True)
    sess = cuvil.onnx.InferenceSession(path)
    symbolic = [i.name for i in sess.get_inputs() if not isinstance(i.shape[0], int)]
    assert symbolic, f"{name} ({exporter}, dynamic): no input has a symbolic batch axis"
    rng = np.random.default_rng(0)
    feeds = registry.example_inputs(name, "ci")
    for batch in DYNAMIC_BATCHES:
        _check(path, _batched(feeds, batch, rng), f"{name} ({exporter}, dynamic) at batch {batch}", sess)


# -- the registry's contract ------------------------------------------------------------------------------

def test_registry_entries() -> None:
    assert len(registry.names()) == len(set(registry.names())) >= 38
    for name in registry.names():
        e = registry.MODELS[name]
        assert e.name == name and e.family and e.description and callable(e.build)


def test_registry_errors() -> None:
    with pytest.raises(registry.RegistryError, match="no registry model 'resnet-1000'"):
        registry.export("resnet-1000")
    with pytest.raises(registry.RegistryError, match="unknown exporter"):
        registry.export("resnet18", exporter="tf2onnx")
    with pytest.raises(registry.RegistryError, match="unknown config"):
        registry.export("resnet18", config="huge")
    assert issubclass(registry.ExportError, CuvilError)


def test_import_cuvil_stays_light() -> None:
    """``import cuvil`` does not import the registry; importing the registry does not import torch."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    for code in ("import sys, cuvil, cuvil.onnx; assert 'cuvil.models' not in sys.modules",
                 "import sys, cuvil.models.registry; cuvil.models.registry.names(); "
                 "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"):
        subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_export_error_names_model_and_exporter(tmp_path, monkeypatch) -> None:
    import torch

    from cuvil.models.registry.export import export_entry

    class Eig(torch.nn.Module):  # no ONNX op computes eigenvalues: both exporters refuse it
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.linalg.eigvalsh(x)

    monkeypatch.setenv("CUVIL_REGISTRY_DIR", str(tmp_path))
    entry = registry.Entry("eig", "test", lambda config: (Eig(), {"x": torch.eye(3)}, ["y"]), "eigenvalues")
    for exporter in registry.EXPORTERS:
        with pytest.raises(registry.ExportError, match=f"torch.onnx.export \\({exporter}.* registry model 'eig'"):
            export_entry(entry, "ci", exporter, False)
    assert [f for f in os.listdir(tmp_path) if not f.startswith(".")] == []  # nothing half-written left
