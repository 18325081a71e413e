"""The PyTorch front end's scatters and norms against eager torch: ``scatter_add``, ``scatter``
(``src``, ``value``, ``reduce=``), ``scatter_reduce`` (sum, prod, amax, amin; with and without
``include_self``), ``index_add`` (exported as ``index_put(accumulate=True)``, or kept whole),
``linalg_vector_norm`` (every ``ord``) and ``native_group_norm``; a graph convolution's message passing
as gcn writes it, and ``weight_norm`` as tcn and wav2vec2 use it.

Tolerances: scatters with ``add`` over duplicate indices add in index order in cuvil (ScatterElements /
ScatterND apply their updates one after another) and in torch's CPU kernels for these sizes; float32
addition is still not associative, so sums get rtol 1e-5 / atol 1e-6 (a few ulp of values of magnitude
~3).  Norms and group norms sum up to ~60 terms in another order (vector lanes): rtol 1e-4 / atol 1e-5.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reference import budget
from toolchain import IN_CI

try:
    importlib.import_module("torch")
except ImportError:
    if IN_CI:
        pytest.fail("torch is not installed (CI=true: .ci/run must install the test extra, torch included)",
                    pytrace=False)
    pytest.skip("torch is not installed (pip install -e '.[torch]')", allow_module_level=True)

import torch  # noqa: E402
from torch import nn  # noqa: E402

import cuvil.torch  # noqa: E402
from cuvil.errors import UnsupportedOpError  # noqa: E402

EXACT_RTOL, EXACT_ATOL = 1e-5, 1e-6
SUM_RTOL, SUM_ATOL = 1e-4, 1e-5


@pytest.fixture(autouse=True, scope="module")
def _kernel_cache(tmp_path_factory: pytest.TempPathFactory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUVIL_CACHE_DIR", str(tmp_path_factory.mktemp("kernels")))
        yield


def _same(fn, args: tuple, rtol: float = EXACT_RTOL, atol: float = EXACT_ATOL) -> None:
    got = cuvil.torch.compile(fn, args)(*args)
    with torch.no_grad():
        want = fn(*args)
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.shape, g.dtype) == (w.shape, w.dtype)
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class _MessagePassing(nn.Module):
    """gcn's layer: degrees counted with scatter_add, messages ``deg^-1/2 X W`` summed at their targets."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 16, bias=False)

    def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        src, dst = edges[0], edges[1]
        deg = torch.zeros(x.shape[0], dtype=x.dtype).scatter_add(0, dst, torch.ones(dst.shape[0], dtype=x.dtype))
        norm = (deg[src] * deg[dst]).clamp(min=1.0).rsqrt()
        h = self.lin(x)
        messages = h[src] * norm.unsqueeze(1)
        return torch.zeros_like(h).scatter_add(0, dst.unsqueeze(1).expand_as(messages), messages)


def test_message_passing_matches_eager():
    torch.manual_seed(0)
    g = _gen(1)
    x = torch.rand(30, 12, generator=g)
    edges = torch.randint(0, 30, (2, 90), generator=g)
    _same(_MessagePassing().eval(), (x, edges), SUM_RTOL, SUM_ATOL)


@budget(0.25)
@given(rows=st.integers(1, 9), cols=st.integers(1, 7), updates=st.integers(1, 12), dim=st.integers(0, 1),
       seed=st.integers(0, 2**16))
@pytest.mark.slow
def test_scatter_add_and_index_add_with_duplicates(rows, cols, updates, dim, seed):
    """Random shapes, indices drawn with repeats, both dimensions; ``src`` one row / column larger than the
    index (torch reads only the index's corner of it)."""
    g = _gen(seed)
    shape = (rows, cols)
    n = shape[dim]
    ishape = (updates, cols) if dim == 0 else (rows, updates)
    x = torch.rand(shape, generator=g) * 4 - 2
    idx = torch.randint(0, n, ishape, generator=g)
    src = torch.rand(ishape[0] + 1, ishape[1] + 1, generator=g) * 4 - 2
    flat = torch.randint(0, n, (updates,), generator=g)
    source = torch.rand(ishape, generator=g)

    def f(x, idx, src, flat, source):
        return x.scatter_add(dim, idx, src), x.index_add(dim, flat, source, alpha=0.5)

    _same(f, (x, idx, src, flat, source))


@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce_every_reduction(include_self):
    g = _gen(3)
    x = torch.rand(6, 4, generator=g) * 4 - 2
    idx = torch.randint(0, 6, (9, 4), generator=g)
    src = torch.rand(9, 4, generator=g) * 4 - 2

    def f(x, idx, src):
        return tuple(x.scatter_reduce(0, idx, src, r, include_self=include_self) for r in ("sum", "prod", "amax", "amin"))

    _same(f, (x, idx, src))


def test_scatter_and_its_reduce_forms():
    g = _gen(4)
    x = torch.rand(5, 6, generator=g)
    idx = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(5)])  # no repeats within a row
    src = torch.rand(5, 3, generator=g)

    def f(x, idx, src):
        return (x.scatter(1, idx, src), x.scatter(1, idx, -1.5), x.scatter(1, idx, src, reduce="add"),
                x.scatter(1, idx, 3.0, reduce="multiply"))

    _same(f, (x, idx, src))


def test_integer_scatter_add_is_exact():
    g = _gen(5)
    x = torch.randint(-9, 10, (7,), generator=g)
    idx = torch.randint(0, 7, (20,), generator=g)
    src = torch.randint(-9, 10, (20,), generator=g)
    got = cuvil.torch.compile(lambda x, i, s: x.scatter_add(0, i, s), (x, idx, src))(x, idx, src)
    assert torch.equal(got, x.scatter_add(0, idx, src))


def test_scatter_reduce_mean_is_named_unsupported():
    x, idx, src = torch.zeros(4), torch.tensor([0, 1, 1]), torch.ones(3)
    with pytest.raises(UnsupportedOpError, match="reduce='mean'"):
        cuvil.torch.compile(lambda x, i, s: x.scatter_reduce(0, i, s, "mean"), (x, idx, src))


def test_vector_norm_every_ord():
    g = _gen(6)
    x = torch.rand(3, 5, 4, generator=g) * 4 - 2
    x[0, 0, :2] = 0.0  # ord 0 counts the non-zero elements

    def f(x):
        return tuple(n for o in (2, 1, 3, 0.5, float("inf"), -float("inf"), 0)
                     for n in (torch.linalg.vector_norm(x, o), torch.linalg.vector_norm(x, o, dim=1),
                               torch.linalg.vector_norm(x, o, dim=(0, 2), keepdim=True)))

    _same(f, (x,), SUM_RTOL, SUM_ATOL)


@pytest.mark.parametrize("shape,groups,affine", [((2, 6, 5), 3, True), ((1, 8, 4, 3), 2, True), ((2, 4, 3, 3), 4, False),
                                                 ((1, 4, 2, 2, 3), 2, True)])
def test_group_norm_matches_eager(shape, groups, affine):
    torch.manual_seed(7)
    m = nn.GroupNorm(groups, shape[1], affine=affine, eps=1e-4).eval()
    if affine:
        with torch.no_grad():
            m.weight.uniform_(0.5, 1.5)
            m.bias.uniform_(-1, 1)
    x = torch.rand(shape, generator=_gen(8)) * 6 - 3
    _same(m, (x,), SUM_RTOL, SUM_ATOL)


def test_weight_norm_conv_matches_eager():
    """weight_norm's parametrization: ``g * v / ||v||`` (linalg_vector_norm over every dimension but 0)
    recomputed on each call, as tcn and wav2vec2's positional convolution have it."""
    torch.manual_seed(9)
    conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 6, 3, padding=1)).eval()
    x = torch.rand(2, 4, 10, generator=_gen(10))
    _same(conv, (x,), SUM_RTOL, SUM_ATOL)
    assert np.isfinite(conv(x).detach().numpy()).all()
