"""A warm start in well under a second (issue 29): the second session of a model file loads the image the
first one saved (cuvil/graph/images.py) instead of importing and compiling the model; a changed file,
other options, a damaged image or a model given as bytes never use a stale one."""

from __future__ import annotations

import os

import numpy as np
import pytest
import toolchain
from test_compile_parallel import _model

import cuvil.frontend.onnx as frontend
from cuvil.graph import compile as gc
from cuvil.graph import images
from cuvil.onnx import InferenceSession

ort = toolchain.module("onnxruntime")


@pytest.fixture
def model_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CUVIL_CACHE_DIR", str(tmp_path / "cache"))
    gc.clear_kernels()
    path = tmp_path / "m.onnx"
    path.write_bytes(_model(7))
    return path


@pytest.fixture
def imports(monkeypatch):
    """The models imported from now on (the session's own import, counted)."""
    seen = []
    real = frontend.import_model
    monkeypatch.setattr(frontend, "import_model", lambda m: seen.append(m) or real(m))
    return seen


def _check(sess: InferenceSession, path) -> None:
    x = np.random.default_rng(8).standard_normal((1, 3, 20, 20)).astype(np.float32)
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for a, b in zip(sess.run(None, {"x": x}), ref):  # float32 sums of a few hundred terms in another order
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert [i.name for i in sess.get_inputs()] == ["x"] and [o.name for o in sess.get_outputs()] == ["y", "z"]


def test_the_second_session_of_a_file_starts_from_its_image(model_file, imports) -> None:
    first = InferenceSession(str(model_file))
    assert len(imports) == 1
    _check(first, model_file)
    gc.clear_kernels()
    second = InferenceSession(str(model_file))
    assert len(imports) == 1  # not imported again
    _check(second, model_file)
    assert second.get_modelmeta() == first.get_modelmeta()
    assert [p.n_kernels for p in second.programs()] == [p.n_kernels for p in first.programs()]


@pytest.mark.slow
def test_a_changed_file_or_other_options_miss_the_image(model_file, imports) -> None:
    InferenceSession(str(model_file))
    InferenceSession(str(model_file), bounds_checks=False)  # other options: their own image
    assert len(imports) == 2
    model_file.write_bytes(_model(9))  # another model under the same name
    os.utime(model_file, ns=(1, 10**18))
    sess = InferenceSession(str(model_file))
    assert len(imports) == 3
    _check(sess, model_file)


@pytest.mark.slow
def test_a_damaged_image_is_a_miss(model_file, imports) -> None:
    InferenceSession(str(model_file))
    folder = model_file.parent / "cache" / "images"
    [img] = list(folder.iterdir())
    img.write_bytes(b"not a pickle")
    sess = InferenceSession(str(model_file))
    assert len(imports) == 2
    _check(sess, model_file)


@pytest.mark.slow
def test_models_given_as_bytes_keep_no_image(model_file, imports) -> None:
    InferenceSession(model_file.read_bytes())
    InferenceSession(model_file.read_bytes())
    assert len(imports) == 2
    assert not (model_file.parent / "cache" / "images").exists()


def test_only_the_most_recently_used_images_are_kept(model_file, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(images, "KEEP", 2)
    for k in range(4):
        images.save(f"{k:064x}.img", {"k": k})
    folder = tmp_path / "cache" / "images"
    assert sorted(p.name for p in folder.iterdir()) == [f"{k:064x}.img" for k in (2, 3)]
    assert images.load(f"{3:064x}.img") == {"k": 3} and images.load(f"{0:064x}.img") is None


@pytest.mark.slow
def test_a_changed_pass_table_misses_the_image(model_file, imports, monkeypatch) -> None:
    from cuvil.graph import passes

    InferenceSession(str(model_file))
    monkeypatch.setattr(passes, "PASSES", tuple(p for p in passes.PASSES if p[0] != "common subexpressions"))
    _check(InferenceSession(str(model_file)), model_file)
    assert len(imports) == 2
