"""Every ATen overload of the PyTorch importer's table (``cuvil.frontend.torch_ops.TABLE``) against eager torch.

A case is a tiny torch function (or module) whose exported graph -- ``torch.export`` then
:func:`cuvil.frontend.torch.decompositions` -- calls the overloads the case names.  That is checked
first, so that a change of torch's decompositions cannot make a case silently test something else.
The function is compiled by ``cuvil.torch.compile`` and its results compared with eager torch on seeded
random inputs: the same shapes and dtypes, integer and bool results exactly, floating results within
rtol 1e-5 / atol 1e-6 (element-wise fp32) or the looser tolerance a case states (reductions and
contractions add in another order than torch's kernels).  Overloads that torch's default
decompositions take apart are kept whole by dropping their entry from the decomposition table
(``keep=``), as :data:`cuvil.frontend.torch.KEEP_WHOLE` does for attention and linear layers; those
cases are imported and compiled by the same functions ``cuvil.torch.compile`` calls.  The few overloads
that only torch.compile's graphs hold are traced by make_fx as aot_autograd traces them
(``aten_graph=True``).  A compile costs ~0.5 s, so each case puts several overloads in one function.
Bugs found outside the table are strict xfails naming where they are.

Also: random broadcast shapes and dtype pairs through the element-wise binary ops (hypothesis), SymInt
sizes (``torch.export.Dim``) through view / expand / slice / arange / full and the size arithmetic,
one UnsupportedOpError naming every operator cuvil lacks, and a coverage test: every key of TABLE is
named by some case of this file, so a new table entry needs a case.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from toolchain import IN_CI

try:
    importlib.import_module("torch")
except ImportError:
    if IN_CI:
        pytest.fail("torch is not installed (CI=true: .ci/run must install the test extra, torch included)",
                    pytrace=False)
    pytest.skip("torch is not installed (pip install -e '.[torch]')", allow_module_level=True)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from reference import budget  # noqa: E402
from torch import nn  # noqa: E402
from torch.export import Dim  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402

import cuvil.torch  # noqa: E402
from cuvil.errors import UnsupportedOpError  # noqa: E402
from cuvil.frontend.torch import decompositions, import_exported_program, import_graph_module, target_name  # noqa: E402
from cuvil.frontend.torch_ops import TABLE  # noqa: E402
from cuvil.onnx import InferenceSession  # noqa: E402
from cuvil.torch import _FunctionModule  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6  # fp32 element-wise: a few ulp (cuvil's exp/log/erf... are polynomials of its own)
# sums of up to ~100 fp32 terms in another order (vector lanes, register tiles) than torch's kernels
SUM_RTOL, SUM_ATOL = 1e-4, 1e-5


@pytest.fixture(autouse=True, scope="module")
def _kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Compiled kernels go to a cache of this module's own (never the user's ~/.cache)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUVIL_CACHE_DIR", str(tmp_path_factory.mktemp("kernels")))
        yield


# -- cases ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[..., Any]
    args: tuple
    ops: tuple[str, ...]               # overloads the exported graph must call (TABLE's keys)
    keep: tuple[str, ...] = ()         # overloads kept out of the decompositions
    dynamic: Any = None                # torch.export's dynamic_shapes
    more: tuple[tuple, ...] = ()       # further argument tuples the compiled function runs on
    rtol: float = RTOL
    atol: float = ATOL
    values: bool = True                # False: torch leaves the values undefined (empty)
    raises: str | None = None          # compiling raises UnsupportedOpError matching this
    xfail: str | None = None           # a known bug outside the table (strict: a fix shows up as XPASS)
    aten_graph: bool = False           # traced as torch.compile backends get graphs, not torch.export'd


CASES: list[Case] = []


def _key(op: str) -> str:
    return op if "::" in op or op.startswith("_operator.") else f"aten::{op}"


def case(name: str, fn: Callable[..., Any], args: tuple, ops: str, keep: str = "", **kw: Any) -> None:
    """Add a case; ``ops`` and ``keep`` are space-separated overload names (``add.Tensor``)."""
    CASES.append(Case(name, fn, tuple(args), tuple(_key(o) for o in ops.split()),
                      tuple(_key(o) for o in keep.split()), **kw))


_GEN = torch.Generator().manual_seed(16)


def rand(*shape: int, lo: float = -3.0, hi: float = 3.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.rand(shape, generator=_GEN, dtype=torch.float64) * (hi - lo) + lo).to(dtype)


def away(*shape: int) -> torch.Tensor:
    """Floats of magnitude 0.5 to 3 (divisors), either sign."""
    sign = torch.where(torch.rand(shape, generator=_GEN) < 0.5, -1.0, 1.0)
    return rand(*shape, lo=0.5, hi=3.0) * sign


def halves(*shape: int) -> torch.Tensor:
    """Multiples of 0.5 in [-2, 2]: comparisons meet equal elements."""
    return torch.randint(-4, 5, shape, generator=_GEN).to(torch.float32) / 2


def ints(*shape: int, lo: int = -9, hi: int = 10, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=_GEN, dtype=dtype)


def nonzero(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    v = ints(*shape, lo=1, hi=6, dtype=dtype)
    return torch.where(torch.rand(shape, generator=_GEN) < 0.5, -v, v)


def bools(*shape: int) -> torch.Tensor:
    return torch.rand(shape, generator=_GEN) < 0.5


# element-wise, unary

_X = rand(4, 33)
_X[0, :8] = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 0.0, -0.0])  # round() ties go to even


def _unary(x: torch.Tensor, p: torch.Tensor) -> tuple:
    return (torch.relu(x), torch.sigmoid(x), torch.tanh(x), torch.neg(x), torch.abs(x), torch.log(p), torch.exp(x),
            torch.sqrt(p), torch.cos(x), torch.sin(x), torch.erf(x), torch.reciprocal(p), torch.floor(x),
            torch.ceil(x), torch.round(x), torch.sign(x), torch.tan(x * 0.45), torch.atan(x), torch.rsqrt(p))


case("unary_float", _unary, (_X, rand(4, 33, lo=0.05, hi=9.0)),
     "relu.default sigmoid.default tanh.default neg.default abs.default log.default exp.default sqrt.default "
     "cos.default sin.default erf.default reciprocal.default floor.default ceil.default round.default "
     "sign.default tan.default atan.default rsqrt.default")

_NANS = rand(3, 7)
_NANS[1, 2] = _NANS[2, 5] = float("nan")
_NANS[0, 3] = 0.0


def _unary_int(i: torch.Tensor, b: torch.Tensor, f: torch.Tensor) -> tuple:
    return (torch.neg(i), torch.abs(i), torch.sign(i), torch.relu(i), torch.bitwise_not(i), torch.bitwise_not(b),
            torch.logical_not(i), torch.logical_not(b), torch.logical_not(f), torch.isnan(f))


case("unary_int_bool", _unary_int, (ints(3, 7), bools(3, 7), _NANS),
     "neg.default abs.default sign.default relu.default bitwise_not.default logical_not.default isnan.default")


def _activations(x: torch.Tensor, i: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple:
    return (F.leaky_relu(x), F.leaky_relu(x, 0.2), F.elu(x), F.elu(x, 0.5), F.selu(x),
            F.hardtanh(x), F.hardtanh(x, -0.5, 2.0), F.relu6(x), F.gelu(x), F.gelu(x, approximate="tanh"),
            torch.clamp(x, -1.0, 0.5), torch.clamp(x, min=0.25), torch.clamp(x, max=-0.25), torch.clamp(i, -3, 4),
            torch.clamp(i, min=0.5), torch.clamp(x, lo, hi), torch.clamp(x, min=lo), torch.clamp(i, max=hi))


case("activations", _activations, (rand(4, 9), ints(4, 9), rand(4, 1, lo=-2, hi=0), rand(9, lo=0, hi=2)),
     "leaky_relu.default elu.default hardtanh.default gelu.default clamp.default clamp.Tensor")


def _kept_activations(x: torch.Tensor) -> tuple:
    return (F.silu(x), F.hardswish(x), F.hardsigmoid(x), F.softplus(x), F.softplus(x, beta=2.0, threshold=1.0),
            torch.clamp_min(x, 0.1), torch.clamp_max(x, -0.2))


case("activations_kept_whole", _kept_activations, (rand(4, 9, lo=-5, hi=5),),
     "silu.default hardswish.default hardsigmoid.default softplus.default clamp_min.default clamp_max.default",
     keep="silu.default hardswish.default hardsigmoid.default softplus.default clamp_min.default "
          "clamp_max.default")


def _nans(x: torch.Tensor) -> tuple:
    return (torch.relu(x), torch.clamp(x, -0.5, 0.5), F.hardtanh(x), torch.maximum(x, torch.zeros(7)),
            torch.minimum(x, torch.zeros(7)), x.amax(1), x.amin(-1), torch.sigmoid(x), F.leaky_relu(x), x.sum(1),
            F.elu(x), x > 0, x != x)


case("nan_propagation", _nans, (_NANS,), "relu.default clamp.default hardtanh.default maximum.default amax.default "
     "amin.default sum.dim_IntList ne.Tensor", rtol=SUM_RTOL, atol=SUM_ATOL)
case("argmax_nan", lambda x: (x.argmax(1), x.argmin(-1)), (_NANS,), "argmax.default argmin.default",
     xfail="ArgMax/ArgMin of a row holding NaN give index 2**63-1 (cuvil.graph.ops.reduce.arg_reduce compares "
           "each element with the NaN maximum); torch gives the first NaN's index")


def _doubles(d: torch.Tensor) -> tuple:
    return (torch.exp(d), torch.log(d.abs()), torch.tanh(d), torch.sigmoid(d), torch.erf(d), d / 3, d.sum(-1),
            d + torch.ones(37, dtype=torch.int32), d.to(torch.float32))


# float64 computes in float64: a few ulp (sums of 37 terms reassociated: ~1e-15)
case("float64", _doubles, (rand(4, 37, dtype=torch.float64),), "exp.default log.default tanh.default "
     "sigmoid.default erf.default div.Tensor sum.dim_IntList add.Tensor _to_copy.default", rtol=1e-12, atol=1e-14)


def _halves(h: torch.Tensor, x: torch.Tensor) -> tuple:
    return (h + h, h * 2, h.float(), torch.relu(h), torch.exp(h), torch.sigmoid(h), x.half(), h + x, h > 0.5)


# float16 computes in float32, rounded once: where cuvil's exp is an fp32 ulp off torch's the rounding to
# float16 may differ by one float16 ulp (~1e-3)
case("float16", _halves, (rand(4, 37, dtype=torch.float16), rand(4, 37)),
     "add.Tensor mul.Tensor _to_copy.default relu.default exp.default sigmoid.default gt.Scalar",
     rtol=1e-3, atol=1e-5)
case("float16_sums", lambda h: (h.sum(-1), h.mean(1)), (rand(4, 37, dtype=torch.float16),),
     "sum.dim_IntList mean.dim", rtol=1e-3, atol=1e-5,
     xfail="float16 reductions accumulate in float16 (torch accumulates in float32): sums of 37 values up "
           "to ~1% off")

# element-wise, binary (more shapes and dtypes in test_binary_ops_broadcast_and_promote)


def _arith(x: torch.Tensor, y: torch.Tensor, p: torch.Tensor, a: torch.Tensor, d: torch.Tensor) -> tuple:
    aten = torch.ops.aten
    return (a // d, a % d, torch.div(a, d, rounding_mode="trunc"), x + y, torch.add(x, y, alpha=2), x - y,
            torch.sub(x, y, alpha=0.5), x * y, x / y, torch.maximum(x, y), torch.minimum(x, y), p ** y, x ** y, x % y, torch.fmod(x, y), x // y,
            torch.div(x, y, rounding_mode="trunc"), x + 2, x - 1.5, x * 3, x / 4, x // 0.75, x % 2.5,
            torch.fmod(x, -1.5), x ** 2, p ** 0.5, 2 ** x, 2.5 % y, aten.add.Scalar(x, 2), aten.sub.Scalar(x, 1.5),
            aten.mul.Scalar(x, -3), aten.div.Scalar(x, 4), aten.div.Scalar_mode(x, 0.75, rounding_mode="trunc"))


# a // d where a / d rounds up to a whole number (1 // 0.1 is 9), and by zero
_A, _D = torch.tensor([1.0, -1.0, 0.3, 0.7, 5.0, -0.5, -0.0, 7.0]), torch.tensor([0.1, 0.1, 0.1, -0.1, 0.0, 0.0, 3.0, 0.7])
case("binary_float", _arith, (rand(3, 1, 5), away(4, 5), rand(3, 4, 5, lo=0.1, hi=3), _A, _D),
     "add.Tensor sub.Tensor mul.Tensor div.Tensor maximum.default minimum.default pow.Tensor_Tensor "
     "remainder.Tensor fmod.Tensor div.Tensor_mode remainder.Scalar fmod.Scalar pow.Tensor_Scalar pow.Scalar "
     "remainder.Scalar_Tensor add.Scalar sub.Scalar mul.Scalar div.Scalar div.Scalar_mode")


def _int_arith(i: torch.Tensor, j: torch.Tensor, f: torch.Tensor, e: torch.Tensor) -> tuple:
    return (i + j, i - j, i * j, i / j, i // j, torch.div(i, j, rounding_mode="trunc"), i % j, torch.fmod(i, j),
            i ** 2, i ** e, i + 1.5, i * f, i * torch.tensor(2.5), torch.maximum(i, j), torch.minimum(i, 3 * j),
            i // 4, i // -4, i % 4, i % -4, 7 % j, -7 // j, torch.fmod(i, -4), i / 2, i * 3, j - 2, 2 ** e)


case("binary_int", _int_arith, (ints(4, 5), nonzero(5), rand(4, 5), ints(4, 5, lo=0, hi=4, dtype=torch.int64)),
     "add.Tensor sub.Tensor mul.Tensor div.Tensor div.Tensor_mode remainder.Tensor fmod.Tensor pow.Tensor_Scalar "
     "pow.Tensor_Tensor pow.Scalar maximum.default minimum.default remainder.Scalar remainder.Scalar_Tensor "
     "fmod.Scalar")


def _compare(x: torch.Tensor, y: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> tuple:
    return (x == y, x != y, x < y, x <= y, x > y, x >= y, x == 0.5, x != 0.5, x < 0.5, x <= 0.5, x > 0.5, x >= 0.5,
            i == j, i < j, i >= x, i == 2.5, i > 1.5, i <= 2, j != 3, i < torch.tensor(1.5))


case("compare", _compare, (halves(3, 6), halves(6), ints(3, 6, lo=-2, hi=3), ints(3, 1, lo=-2, hi=3, dtype=torch.int64)),
     "eq.Tensor ne.Tensor lt.Tensor le.Tensor gt.Tensor ge.Tensor eq.Scalar ne.Scalar lt.Scalar le.Scalar "
     "gt.Scalar ge.Scalar")


def _logic(i: torch.Tensor, j: torch.Tensor, a: torch.Tensor, b: torch.Tensor, f: torch.Tensor) -> tuple:
    return (i & j, i | j, i ^ j, i & 6, i | 1, i ^ 3, torch.bitwise_and(5, i), torch.bitwise_or(9, j),
            torch.bitwise_xor(2, i), a & b, a | b, a ^ b, a & True, b ^ True, a & i, b | j,
            torch.logical_and(i, f), torch.logical_or(a, i), torch.logical_xor(a, b), torch.logical_and(f, b))


_F0 = rand(4, 5)
_F0[1] = 0.0
case("bitwise_logical", _logic, (ints(4, 5), ints(5, dtype=torch.int64), bools(4, 5), bools(4, 1), _F0),
     "bitwise_and.Tensor bitwise_or.Tensor bitwise_xor.Tensor bitwise_and.Scalar bitwise_or.Scalar "
     "bitwise_xor.Scalar bitwise_and.Scalar_Tensor bitwise_or.Scalar_Tensor bitwise_xor.Scalar_Tensor "
     "logical_and.default logical_or.default logical_xor.default")


def _where(c: torch.Tensor, x: torch.Tensor, i: torch.Tensor) -> tuple:
    return torch.where(c, x, i), torch.where(c, i, i * 2), torch.where(c[0], x, 0.5 * x)


case("where", _where, (bools(3, 4), rand(3, 4), ints(4)), "where.self")


def _where_scalars(c: torch.Tensor, x: torch.Tensor, i: torch.Tensor) -> tuple:
    return (torch.where(c, 1.5, x), torch.where(c, x, -2.0), torch.where(c, 3, i), torch.where(c, 1.0, 2.0),
            x.masked_fill(c, -1.0), i.masked_fill(c[0], 7), x.masked_fill(c, torch.tensor(0.25)))


case("where_scalars_and_masked_fill", _where_scalars, (bools(3, 4), rand(3, 4), ints(4)),
     "where.ScalarSelf where.ScalarOther where.Scalar masked_fill.Scalar masked_fill.Tensor",
     keep="where.ScalarSelf where.ScalarOther where.Scalar masked_fill.Scalar masked_fill.Tensor")

# copies and casts

_C = rand(2, 3, 4, 5)
_C[0, 0, 0] = 0.0


def _casts(x: torch.Tensor, i: torch.Tensor, b: torch.Tensor) -> tuple:
    return (x.to(torch.int32), x.to(torch.bool), b.to(torch.float32), i.to(torch.int64), x.to(torch.float64),
            i.to(torch.float32), x.to(torch.float16), x.to(torch.int64).to(torch.uint8), x.clone(),
            x.clone(memory_format=torch.channels_last), x[...] * 2, i.to(torch.int8))


case("casts_and_copies", _casts, (_C, ints(2, 3), bools(5)),
     "_to_copy.default _assert_tensor_metadata.default clone.default alias.default")
case("detach", lambda x: x.detach() + 1, (rand(3, 4),), "detach.default", keep="detach.default")

# reductions


def _reductions(x: torch.Tensor, i: torch.Tensor, b: torch.Tensor) -> tuple:
    return (x.sum((0, -1)), x.sum(-1, keepdim=True), x.sum(), i.sum(1), b.sum(), x.sum(1, dtype=torch.float64),
            x.mean((1, 2)), x.mean(-2, keepdim=True), x.mean(), x.mean(dtype=torch.float64), x.amax(1),
            x.amax((0, 2), keepdim=True), i.amin(-1), x.amin(), x.prod(1), i.prod(-1, keepdim=True), x.argmax(),
            x.argmax(1), x.argmax(-1, keepdim=True), x.argmin(0), i.argmin(1), x.argmax(keepdim=True),
            i.argmax(-2))


# sums of at most 30 terms: SUM_RTOL (reassociation)
case("reductions", _reductions, (rand(3, 5, 6), ints(3, 5, lo=-4, hi=5), bools(4, 5)),
     "sum.dim_IntList mean.dim mean.default amax.default amin.default prod.dim_int argmax.default argmin.default",
     rtol=SUM_RTOL, atol=SUM_ATOL)
case("sum_default", lambda x, i: (torch.sum(x), torch.sum(i)), (rand(3, 5), ints(2, 7)), "sum.default",
     keep="sum.default", rtol=SUM_RTOL, atol=SUM_ATOL)


def _softmaxes(x: torch.Tensor) -> tuple:
    return F.softmax(x, -1), F.log_softmax(x, 1), F.softmax(x, 0), F.log_softmax(x, dim=-3)


# the normaliser sums the row (reassociation)
case("softmax", _softmaxes, (rand(2, 3, 7, lo=-5, hi=5),), "_softmax.default _log_softmax.default",
     rtol=SUM_RTOL, atol=SUM_ATOL)
case("softmax_kept_whole", lambda x: (F.softmax(x, -1), F.log_softmax(x, 0)), (rand(3, 7),),
     "softmax.int log_softmax.int", keep="softmax.int log_softmax.int", rtol=SUM_RTOL, atol=SUM_ATOL)

# normalisation


class _Norms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(6)
        self.ln2 = nn.LayerNorm((5, 6), elementwise_affine=False, eps=1e-3)
        self.bn = nn.BatchNorm2d(3)
        self.bn1 = nn.BatchNorm1d(3, affine=False)
        self.inorm = nn.InstanceNorm2d(3, affine=True)
        self.inorm1 = nn.InstanceNorm1d(3)
        for p in [*self.parameters(), *self.buffers()]:
            if p.dtype.is_floating_point:
                p.data = rand(*p.shape, lo=0.5, hi=1.5)

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> tuple:
        return (self.ln(s), self.ln2(s), F.layer_norm(s, (6,), eps=1e-2), self.bn(x), self.bn1(s.transpose(1, 2)[:, :3]),
                self.inorm(x), self.inorm1(x[:, :, 0]))


# means and variances sum a row (reassociation)
case("norms", _Norms().eval(), (rand(2, 3, 4, 5), rand(2, 5, 6)),
     "layer_norm.default _native_batch_norm_legit_no_training.default _native_batch_norm_legit.no_stats "
     "_operator.getitem", rtol=SUM_RTOL, atol=SUM_ATOL)


def _vector_norms_and_group_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple:
    v = x[0, :, :, 0]
    return (torch.linalg.vector_norm(v), torch.linalg.vector_norm(v, 1, dim=1), torch.linalg.vector_norm(v, 3, dim=(0,),
            keepdim=True), torch.linalg.vector_norm(v, float("inf"), dim=-1), torch.linalg.vector_norm(v, -float("inf")),
            torch.linalg.vector_norm(torch.relu(v), 0, dim=1), F.group_norm(x, 2, w, b), F.group_norm(x, 4, eps=1e-3),
            F.group_norm(x[:, :, 0], 1, w, b))


case("vector_and_group_norms", _vector_norms_and_group_norm, (rand(2, 4, 5, 3), rand(4), rand(4)),
     "linalg_vector_norm.default native_group_norm.default", rtol=SUM_RTOL, atol=SUM_ATOL)

# contractions (SUM_RTOL: dot products of up to 7 terms, reassociated in register tiles)


class _Linears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(6, 3, bias=False)

    def forward(self, x2: torch.Tensor, x3: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, m1: torch.Tensor,
                m2: torch.Tensor, b1: torch.Tensor, b2: torch.Tensor) -> tuple:
        return (self.a(x2), self.a(x3), self.b(x3), self.b(x2), F.linear(x2, w, bias), F.linear(x3, w),
                torch.mm(m1, m2), torch.addmm(bias, m1, m2), torch.addmm(bias[:1], m1, m2, beta=0.5, alpha=2.0),
                torch.addmm(m1 @ m2, m1, m2, alpha=-1.0), torch.bmm(b1, b2))


case("contractions", _Linears().eval(),
     (rand(4, 6), rand(2, 3, 6), rand(7, 6), rand(7), rand(5, 3), rand(3, 7), rand(2, 4, 3), rand(2, 3, 5)),
     "linear.default mm.default addmm.default bmm.default", rtol=SUM_RTOL, atol=SUM_ATOL)


def _matmuls(a: torch.Tensor, b: torch.Tensor, v: torch.Tensor, c: torch.Tensor) -> tuple:
    return a @ b, v @ b[0], b[0] @ torch.ones(5), c @ a, v @ v


case("matmul_kept_whole", _matmuls, (rand(2, 3, 4), rand(2, 4, 5), rand(4), rand(3, 1, 2, 3)), "matmul.default",
     keep="matmul.default", rtol=SUM_RTOL, atol=SUM_ATOL)


class _Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(3, 4, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(4, 6, 3, padding=2, dilation=2, groups=2, bias=False)
        self.c3 = nn.Conv3d(2, 3, (2, 3, 3), stride=(1, 2, 1), padding=(0, 1, 1))
        self.t2 = nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1, output_padding=1)
        self.t1 = nn.ConvTranspose1d(3, 4, 4, stride=3, padding=1, dilation=2)
        self.tg = nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, bias=False)
        self.same = nn.Conv2d(4, 2, 3, padding="same")

    def forward(self, x1: torch.Tensor, x2: torch.Tensor, x3: torch.Tensor) -> tuple:
        return self.c1(x1), self.c2(x2), self.c3(x3), self.t2(x2), self.t1(x1), self.tg(x2), self.same(x2)


# SUM_RTOL: sums over up to 36 taps
case("convolutions", _Convs().eval(), (rand(2, 3, 11), rand(1, 4, 7, 6), rand(1, 2, 4, 7, 5)), "convolution.default",
     rtol=SUM_RTOL, atol=SUM_ATOL)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bmask: torch.Tensor, fmask: torch.Tensor) -> tuple:
    sdpa = F.scaled_dot_product_attention
    return (sdpa(q, k, v), sdpa(q, k, v, attn_mask=bmask), sdpa(q, k, v, attn_mask=fmask),
            sdpa(q, k, v, is_causal=True), sdpa(q, k, v, scale=0.3), sdpa(q[0], k[0], v[0], is_causal=True))


_MASK = bools(4, 6)
_MASK[torch.arange(4), torch.arange(4)] = True  # no row fully masked
# SUM_RTOL: a softmax and two contractions of 6 and 8 terms
case("attention", _attention, (rand(2, 3, 4, 8), rand(2, 3, 6, 8), rand(2, 3, 6, 8), _MASK, rand(3, 1, 6)),
     "scaled_dot_product_attention.default", rtol=SUM_RTOL, atol=SUM_ATOL)

# pooling


def _pools(x: torch.Tensor, v: torch.Tensor, e: torch.Tensor) -> tuple:
    return (F.max_pool2d(x, 3, 2, 1), F.max_pool2d(x, 2, ceil_mode=True), F.max_pool2d(x, 2, 2, 1, ceil_mode=True),
            F.avg_pool2d(x, 2, 2, 1, ceil_mode=True), F.avg_pool2d(e, 3, 2, 1, ceil_mode=True),
            F.avg_pool2d(e, 3, 2, 1, ceil_mode=True, count_include_pad=False), F.max_pool2d(e, 3, 2, 1, ceil_mode=True),
            F.max_pool2d(x, 3, 1, 1, dilation=2), F.max_pool3d(v, 2), F.max_pool3d(v, (2, 3, 2), 1, (1, 1, 0)),
            F.avg_pool2d(x, 3, 2, 1), F.avg_pool2d(x, 3, 2, 1, count_include_pad=False), F.avg_pool2d(x, 2, ceil_mode=True),
            F.avg_pool2d(x, (2, 3), (1, 2)), F.avg_pool3d(v, (2, 3, 2)), F.adaptive_avg_pool2d(x[..., :8, :8], 1),
            F.adaptive_avg_pool2d(x[..., :8, :8], (2, 4)))


# averages of up to 12 terms (reassociation)
case("pools", _pools, (rand(2, 3, 9, 9), rand(1, 2, 5, 6, 7), rand(1, 2, 10, 10)),
     "max_pool2d_with_indices.default max_pool3d_with_indices.default avg_pool2d.default avg_pool3d.default "
     "_adaptive_avg_pool2d.default _operator.getitem", rtol=SUM_RTOL, atol=SUM_ATOL)


def _pools_kept(x: torch.Tensor) -> tuple:
    return (F.max_pool2d(x, 2), F.max_pool2d(x, 3, 2, 1), F.max_pool1d(x[0], 3, 2), F.avg_pool1d(x[0], 2),
            F.avg_pool1d(x[0], 3, 2, 1, count_include_pad=False), F.adaptive_avg_pool2d(x[..., :6], 3))


case("pools_kept_whole", _pools_kept, (rand(2, 3, 6, 7),),
     "max_pool2d.default max_pool1d.default avg_pool1d.default adaptive_avg_pool2d.default",
     keep="max_pool2d.default max_pool1d.default avg_pool1d.default adaptive_avg_pool2d.default",
     rtol=SUM_RTOL, atol=SUM_ATOL)

# shapes


def _views(x: torch.Tensor, y: torch.Tensor) -> tuple:
    return (x.view(6, 4), x.view(-1), x.view(2, -1, 2), x.permute(2, 0, 1), x.permute(-1, -3, -2), x.unsqueeze(0),
            x.unsqueeze(-1), x.unsqueeze(1), x[None].squeeze(0), x.unsqueeze(2).squeeze((0, 2)), y.expand(2, 3, 4),
            y.expand(-1, 5), torch.permute_copy(x, (1, 2, 0)), torch.view_copy(x, (4, 6)))


case("views", _views, (rand(2, 3, 4), rand(3, 1)),
     "view.default permute.default unsqueeze.default squeeze.dims expand.default permute_copy.default "
     "view_copy.default")


def _views_kept(x: torch.Tensor, y: torch.Tensor) -> tuple:
    aten = torch.ops.aten
    return (aten._unsafe_view(x, (3, 8)), x.transpose(0, -1), x[0].t(), y.t(),
            torch.unsqueeze_copy(x, -2), x[:1].squeeze(0), x[:1].squeeze(), x[:1, :, :1].squeeze(-1),
            torch.squeeze_copy(x[:1], (0, 1)), torch.expand_copy(y, (2, 3)), torch.expand_copy(x[:, :1], (-1, 5, 4)))


case("views_kept_whole", _views_kept, (rand(2, 3, 4), rand(3)),
     "_unsafe_view.default transpose.int t.default unsqueeze_copy.default squeeze.dim "
     "squeeze.default squeeze_copy.dims expand_copy.default",
     keep="_unsafe_view.default transpose.int t.default unsqueeze_copy.default squeeze.dim "
          "squeeze.default squeeze_copy.dims expand_copy.default")


def _cat_split(x: torch.Tensor, i: torch.Tensor, e: torch.Tensor) -> tuple:
    a, b = torch.split(x, [2, 3], 1)
    c, d, f = x.split(2, dim=-1)
    return torch.cat([x, i], 1), torch.cat([x, x], -2), torch.cat([x, e]), a, b, c, d, f


case("cat_split", _cat_split, (rand(2, 5), ints(2, 3), torch.empty(0)),
     "cat.default split_with_sizes.default _operator.getitem")


def _cat_split_kept(x: torch.Tensor) -> tuple:
    return (torch.concat([x, x], -1), *torch.split(x, 2, -1), *torch.split(x, 3), *torch.unbind(x, -1),
            *x.unbind(), *torch.split_with_sizes_copy(x, [2, 1, 1], 1))


case("cat_split_kept_whole", _cat_split_kept, (rand(3, 4),),
     "concat.default split.Tensor unbind.int split_with_sizes_copy.default _operator.getitem",
     keep="concat.default split.Tensor unbind.int split_with_sizes_copy.default")


def _slices(x: torch.Tensor) -> tuple:
    return (x[1:4], x[:, ::2], x[..., -3:], x[:, 1:-1:3], x[2:100], x[-2], x[:, -1], x[:, :, 3], x[:, :, -7],
            torch.narrow(x, -1, 2, 3), torch.slice_copy(x, 2, 1, 6, 2), torch.select_copy(x, -1, -2), x[3:1])


case("slices", _slices, (rand(5, 6, 7),), "slice.Tensor select.int slice_copy.Tensor select_copy.int")


class _Indexing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, neg: torch.Tensor, idx2: torch.Tensor, g: torch.Tensor,
                ids: torch.Tensor, w: torch.Tensor) -> tuple:
        return (x.index_select(1, idx), torch.index_select(x, -1, idx.int()), torch.gather(x, 1, g),
                torch.gather(x, -1, g[:, :2]), x[neg], x[:, neg], x[:, :, idx2], x[neg, idx2], x[:, idx2, neg],
                x[:, idx[:3], idx2[0]], self.emb(ids), F.embedding(ids, w))


case("indexing", _Indexing().eval(),
     (rand(4, 5, 6), torch.tensor([3, 0, 3, 1]), torch.tensor([-1, 0, -4]), torch.tensor([[1, 4, 2], [0, -2, 3]]),
      ints(4, 3, 6, lo=0, hi=5, dtype=torch.int64), ints(2, 3, lo=0, hi=10, dtype=torch.int64), rand(10, 3)),
     "index_select.default gather.default index.Tensor embedding.default")


def _scatters(x: torch.Tensor, i: torch.Tensor, s: torch.Tensor, r: torch.Tensor) -> tuple:
    return (x.scatter_add(0, r, s[:4]), x.scatter_add(1, i, s), x.scatter(1, i, s), x.scatter(1, i, 2.5),
            x.scatter(1, i, s, reduce="add"), x.scatter(1, i, 2.0, reduce="multiply"),
            x.scatter_reduce(0, r, s[:4], "sum"), x.scatter_reduce(0, r, s[:4], "amax", include_self=False),
            x.scatter_reduce(1, i, s, "prod"), x.scatter_reduce(1, i, s, "amin", include_self=False),
            x.index_put((r[:, 0],), s[:4, :3], accumulate=True), x.index_put((r[:, 0], r[:, 1] % 3), s[:4, 0]))


# updates at duplicate positions add in order (torch's CPU kernels too); SUM tolerance for the sums
case("scatters", _scatters,
     (rand(5, 3), ints(5, 2, lo=0, hi=3, dtype=torch.int64), rand(5, 3), ints(4, 3, lo=0, hi=5, dtype=torch.int64)),
     "scatter_add.default scatter.src scatter.value scatter.reduce scatter.value_reduce scatter_reduce.two "
     "index_put.default", rtol=SUM_RTOL, atol=SUM_ATOL)
case("index_add", lambda x, i, s: (x.index_add(0, i, s), x.index_add(1, i[:2], s[:2].T, alpha=-0.5)),
     (rand(5, 5), torch.tensor([4, 0, 4, 2, 1, 0, 3]), rand(7, 5)), "index_add.default", keep="index_add.default",
     rtol=SUM_RTOL, atol=SUM_ATOL)

# creating tensors


def _creation(x: torch.Tensor, i: torch.Tensor) -> tuple:
    return (torch.full((2, 3), 1.5), torch.full((2,), 7, dtype=torch.int32), torch.full((3,), True),
            torch.full_like(x, 2), torch.full_like(x, 3, dtype=torch.int64), torch.full_like(i, -1),
            torch.ops.aten.scalar_tensor(2.5), torch.ops.aten.scalar_tensor(3, dtype=torch.int64) + i,
            torch.arange(0, 1, 0.125), torch.arange(2, 11, 3), torch.arange(1.0, 2.0, 0.3), torch.arange(5, -3, -2),
            x + torch.arange(4))


case("creation", _creation, (rand(3, 4), ints(2)),
     "full.default full_like.default scalar_tensor.default arange.start_step")


def _creation_kept(x: torch.Tensor) -> tuple:
    return (torch.zeros(2, 3), torch.ones(4, dtype=torch.int64), torch.zeros_like(x), torch.ones_like(x, dtype=torch.bool),
            x.new_zeros(3), x.new_ones((2, 2)), x.new_full((2,), 3.5), torch.arange(5), torch.arange(1, 4),
            torch.arange(6.0))


case("creation_kept_whole", _creation_kept, (rand(3, 4),),
     "zeros.default ones.default zeros_like.default ones_like.default new_zeros.default new_ones.default "
     "new_full.default arange.default arange.start",
     keep="zeros.default ones.default zeros_like.default ones_like.default new_zeros.default new_ones.default "
          "new_full.default arange.default arange.start")
case("empty", lambda x: (torch.empty(2, 3), torch.empty_like(x), x.new_empty((4,)), torch.empty(3, dtype=torch.int32)),
     (rand(3, 4),), "empty.memory_format empty_like.default new_empty.default",
     keep="empty_like.default new_empty.default", values=False)

# other data movement


def _movement(x: torch.Tensor, i: torch.Tensor, b: torch.Tensor) -> tuple:
    return (torch.cumsum(b, -1), F.pad(x, (1, 2)), F.pad(x, (0, 1, 2, 0), value=-1.5), F.pad(i, (1, 1), value=7), x.repeat(1, 2, 1, 2),
            x[0, 0].repeat(2, 1, 3), torch.cumsum(x, -1), torch.cumsum(i, 0), torch.cumsum(x, 1, dtype=torch.float64),
            x.flip(-1), x.flip(0, 2), torch.as_strided(x, (3, 4), (1, 3)), torch.as_strided(x, (2, 2), (2, 1), 3),
            torch.as_strided(x, x.shape, x.stride()), torch.as_strided_copy(x, (5, 2), (4, 7)))


# SUM_RTOL: the cumulative sums
case("movement", _movement, (rand(2, 3, 4, 5), ints(3, 4), bools(2, 6)),
     "constant_pad_nd.default repeat.default cumsum.default flip.default as_strided.default "
     "as_strided_copy.default", rtol=SUM_RTOL, atol=SUM_ATOL)
case("tril_triu", lambda x: (torch.tril(x), torch.triu(x, 1), torch.tril(x, -2), torch.triu(x[0], -1)),
     (rand(2, 4, 5),), "tril.default triu.default", keep="tril.default triu.default")


def _resize(x: torch.Tensor) -> tuple:
    return (F.interpolate(x, scale_factor=2), F.interpolate(x, size=(7, 9)), F.interpolate(x, scale_factor=1.3),
            F.interpolate(x, size=(8, 4), mode="bilinear"), F.interpolate(x, scale_factor=1.7, mode="bilinear"),
            F.interpolate(x, size=(9, 3), mode="bilinear", align_corners=True),
            F.interpolate(x, scale_factor=0.5, mode="bilinear"))


# bilinear: weights (1 - t) and t of the two taps in another order
case("resize", _resize, (rand(1, 2, 5, 6),), "upsample_nearest2d.vec upsample_bilinear2d.vec",
     rtol=SUM_RTOL, atol=SUM_ATOL)


def _resize_kept(x: torch.Tensor) -> tuple:
    aten = torch.ops.aten
    return (F.interpolate(x[0], scale_factor=2), F.interpolate(x[0], size=7), F.interpolate(x[None], scale_factor=2),
            F.interpolate(x[None], size=(3, 4, 7)), aten.upsample_nearest2d.default(x, [7, 9]),
            aten.upsample_nearest2d.default(x, [7, 9], 1.5, 1.5), aten.upsample_nearest2d.default(x, [6, 7], 1.3, 1.3))


case("resize_kept_whole", _resize_kept, (rand(1, 2, 5, 6),),
     "upsample_nearest1d.vec upsample_nearest3d.vec upsample_nearest2d.default",
     keep="upsample_nearest1d.vec upsample_nearest3d.vec upsample_nearest2d.default")


def _aten_graph_only(x: torch.Tensor) -> tuple:
    return (F.interpolate(x, size=(7, 8), mode="bilinear"), F.interpolate(x, scale_factor=1.3, mode="bilinear"),
            F.interpolate(x, scale_factor=1.5, mode="bilinear", align_corners=True),
            torch.ops.aten.lift_fresh_copy(x) * 2)


# overloads that torch.export's graphs never hold but torch.compile's (aot_autograd's) do: bilinear resizing
# by sizes or scales, and lift_fresh_copy (a tensor constant of the traced code)
case("aten_graph_only", _aten_graph_only, (rand(1, 2, 5, 6),), "upsample_bilinear2d.default lift_fresh_copy.default",
     aten_graph=True, rtol=SUM_RTOL, atol=SUM_ATOL)



def _aot_forms(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> tuple:
    return (F.layer_norm(x, (6,), torch.ones(6) * 0.5, torch.full((6,), 0.25)),
            F.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v, attn_mask=m),
            F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2))


# what aot_autograd makes of layer_norm and attention (the torch.compile backend keeps the CPU attention
# kernel whole: cuvil.torch.backend); SUM_RTOL: a softmax and contractions of 5-6 terms
case("aot_forms", _aot_forms, (rand(2, 3, 6), rand(1, 2, 4, 5), rand(1, 2, 6, 5), rand(1, 2, 6, 5), bools(4, 6)),
     "native_layer_norm.default _scaled_dot_product_flash_attention_for_cpu.default",
     keep="_scaled_dot_product_flash_attention_for_cpu.default", aten_graph=True, rtol=SUM_RTOL, atol=SUM_ATOL)


class _LSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.fwd = nn.LSTM(5, 6, num_layers=2)
        self.rev = nn.LSTM(5, 4, bidirectional=True)

    def forward(self, x: torch.Tensor) -> tuple:
        y, (h, c) = self.fwd(x)
        return y, h, c, self.rev(x)[0]


# nn.LSTM on the CPU as aot_autograd writes it (torch.compile with dynamo's allow_rnn): one layer and
# direction per call; SUM_RTOL: 7 steps of gates over 5-6 inputs
case("lstm_layers", _LSTM().eval(), (rand(7, 2, 5),), "mkldnn_rnn_layer.default", aten_graph=True,
     rtol=SUM_RTOL, atol=SUM_ATOL)


def _any_all(b: torch.Tensor, x: torch.Tensor, i: torch.Tensor) -> tuple:
    return (b.any(1), b.all(-1, keepdim=True), b.any(), b.all(), x.any(0), i.all(1), torch.any(i, dim=(0, 1)),
            torch.all(x, dim=(0,), keepdim=True))


_ZEROS = rand(3, 4)
_ZEROS[1] = 0.0
_ZEROS[:, 2] = 0.0
case("any_all", _any_all, (bools(3, 4), _ZEROS, ints(3, 4, lo=0, hi=2)),
     "any.dim any.dims any.default")

# symbolic sizes (torch.export.Dim): one compile, run at several sizes


def _dyn_shapes(x: torch.Tensor) -> tuple:
    m = x.shape[0]
    return (x.view(m // 2, 12), x.view(-1, 3), x[None].expand(3, m, 6), x[: m // 2], x[1:], x[:, None, :2].expand(-1, 4, -1),
            torch.arange(m), torch.arange(1, m, 2, dtype=torch.float32), torch.full((m + 1, 2), 1.5),
            x.new_zeros(m, 3), x + (m - 1) + m % 3, x * (m * 2))


_EVEN = 2 * Dim("half", min=1, max=32)
case("symbolic_sizes", _dyn_shapes, (rand(4, 6),),
     "sym_size.int view.default expand.default slice.Tensor arange.start_step full.default "
     "_operator.add _operator.sub _operator.mul _operator.floordiv _operator.mod",
     dynamic=({0: _EVEN},), more=((rand(10, 6),), (rand(2, 6),)))


def _dyn_kept(x: torch.Tensor, y: torch.Tensor) -> tuple:
    m = x.shape[1]
    return (torch.zeros(m, 2), torch.ones_like(x), x.reshape(-1), x.transpose(0, 1), torch.arange(0, m),
            torch.cat([x, y], 1), x.repeat(2, 1), F.pad(x, (1, 1)))


case("symbolic_sizes_kept_whole", _dyn_kept, (rand(3, 5), rand(3, 2)),
     "sym_size.int zeros.default ones_like.default view.default transpose.int arange.start cat.default "
     "repeat.default constant_pad_nd.default", keep="zeros.default ones_like.default transpose.int arange.start",
     dynamic=({1: Dim("n", min=2, max=64)}, None), more=((rand(3, 9), rand(3, 2)), (rand(3, 2), rand(3, 2))))


def _asserts(x: torch.Tensor) -> torch.Tensor:
    aten = torch.ops.aten
    n = x.shape[0]
    aten._assert_scalar(n > 1, "n > 1")
    aten._assert_scalar(n >= 2, "n >= 2")
    aten._assert_scalar(n < 100, "n < 100")
    aten._assert_scalar(n <= 64, "n <= 64")
    aten._assert_scalar(n != 0, "n != 0")
    aten._assert_scalar(n % 1 == 0, "n % 1 == 0")
    torch._assert_async(x.abs().sum() >= 0, "a sum of magnitudes is not negative")
    return x * 2


case("asserts", _asserts, (rand(4, 3),),
     "_assert_scalar.default _assert_async.msg "
     "_operator.gt _operator.ge _operator.lt _operator.le _operator.ne _operator.eq",
     dynamic=({0: Dim("n", min=2, max=64)},), more=((rand(9, 3),),))

# dropout: inference graphs only
case("dropout_training", lambda x: F.dropout(x, 0.3, training=True), (rand(3, 4),), "native_dropout.default",
     raises="dropout in training mode")


# -- running the cases -----------------------------------------------------------------------


def _export(c: Case) -> Any:
    """The case's ExportedProgram after the decompositions (but those of ``c.keep``)."""
    if not c.keep:
        return cuvil.torch.export(c.fn, c.args, dynamic_shapes=c.dynamic)
    table = decompositions()
    for k in list(table):
        if target_name(k) in c.keep:
            del table[k]
    model = c.fn if isinstance(c.fn, nn.Module) else _FunctionModule(c.fn)  # as cuvil.torch.compile wraps it
    with torch.no_grad():
        ep = torch.export.export(model, c.args, dynamic_shapes=c.dynamic, strict=False)
    return ep.run_decompositions(table)


def _called(gm: Any) -> set[str]:
    """The overloads an ExportedProgram or GraphModule calls (TABLE's names)."""
    return {target_name(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def _compile(c: Case) -> Any:
    if c.aten_graph:
        return _compile_aten_graph(c)
    ep = _export(c)
    called = _called(ep)
    missing = [op for op in c.ops if op not in called]
    assert not missing, f"{c.name}: the exported graph does not call {missing}; it calls {sorted(called)}"
    if not c.keep:
        return cuvil.torch.compile(c.fn, c.args, dynamic_shapes=c.dynamic)
    imported = import_exported_program(ep, c.name)
    return cuvil.torch.CompiledModule(InferenceSession.from_graph(imported.graph), imported, ep)


def _compile_aten_graph(c: Case) -> Callable[..., tuple]:
    """The case traced to ATen by make_fx with the importer's decompositions (the graphs aot_autograd
    gives a torch.compile backend), imported by import_graph_module and run by an InferenceSession."""
    from torch.fx.experimental.proxy_tensor import make_fx

    table = {k: v for k, v in decompositions().items() if target_name(k) not in c.keep}
    gm = make_fx(c.fn, decomposition_table=table)(*c.args)
    called = _called(gm)
    missing = [op for op in c.ops if op not in called]
    assert not missing, f"{c.name}: the traced graph does not call {missing}; it calls {sorted(called)}"
    imported = import_graph_module(gm, [n.name for n in gm.graph.nodes if n.op == "placeholder"], c.name)
    session = InferenceSession.from_graph(imported.graph)

    def run(*args: torch.Tensor) -> tuple:
        outs = iter(session.run(None, {name: a.numpy() for name, a in zip(imported.inputs, args)}))
        return tuple(torch.from_numpy(next(outs)) if kind == "tensor" else v for kind, v in imported.outputs)

    return run


def assert_same(got: Any, want: Any, rtol: float = RTOL, atol: float = ATOL, values: bool = True) -> None:
    """``got`` has ``want``'s structure, and every tensor its shape, dtype and values."""
    g, w = pytree.tree_leaves(got), pytree.tree_leaves(want)
    assert len(g) == len(w), f"{len(g)} results, expected {len(w)}"
    for k, (a, b) in enumerate(zip(g, w)):
        assert isinstance(a, torch.Tensor), f"result {k}: {type(a).__name__}, expected a tensor"
        assert (a.shape, a.dtype) == (b.shape, b.dtype), \
            f"result {k}: {a.dtype}{list(a.shape)}, expected {b.dtype}{list(b.shape)}"
        if not values:
            continue
        if b.dtype.is_floating_point:
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True,
                                       msg=lambda m, k=k: f"result {k}: {m}")
        else:
            assert torch.equal(a, b), f"result {k}: {a} != {b}"


# the cases the fast lane (-m "not slow") runs: one of each kind, each well under a second
FAST = {"unary_int_bool", "cat_split", "creation", "softmax", "argmax_nan", "float16_sums", "asserts",
        "matmul_kept_whole", "cat_split_kept_whole", "index_add", "aten_graph_only", "tril_triu", "detach",
        "softmax_kept_whole", "dropout_training", "sum_default"}


@pytest.mark.parametrize("c", [pytest.param(c, id=c.name, marks=([pytest.mark.xfail(strict=True, reason=c.xfail)]
                                                              if c.xfail else [])
                                            + ([] if c.name in FAST else [pytest.mark.slow])) for c in CASES])
def test_overloads_match_eager(c: Case) -> None:
    if c.raises is not None:
        with pytest.raises(UnsupportedOpError, match=c.raises):
            _compile(c)
        return
    cm = _compile(c)
    for args in (c.args, *c.more):
        with torch.no_grad():
            want = c.fn(*args)
        assert_same(cm(*args), want, c.rtol, c.atol, c.values)


PROPERTY_OPS: set[str] = set()  # the overloads the tests below exercise

# -- random shapes and dtypes (hypothesis) ----------------------------------------------------

_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float32, torch.float64]
PROPERTY_OPS |= {_key(o) for o in ("add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor", "maximum.default",
                                   "minimum.default", "eq.Tensor", "lt.Tensor", "ge.Tensor", "ne.Tensor",
                                   "gt.Scalar", "le.Scalar")}


@st.composite
def _broadcast_shapes(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two shapes that broadcast: a shape, and a suffix of it with some sizes 1."""
    shape = draw(st.lists(st.integers(1, 5), min_size=0, max_size=4))
    other = [1 if draw(st.booleans()) else d for d in shape]
    other = other[draw(st.integers(0, len(other))):]
    return (tuple(shape), tuple(other)) if draw(st.booleans()) else (tuple(other), tuple(shape))


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if dtype.is_floating_point:
        return torch.randint(-8, 9, shape, generator=g).to(dtype) / 4  # equal elements happen
    lo = 0 if dtype == torch.uint8 else -9
    return torch.randint(lo, 10, shape, generator=g, dtype=dtype)


@budget(0.5)
@given(shapes=_broadcast_shapes(), dtypes=st.tuples(st.sampled_from(_DTYPES), st.sampled_from(_DTYPES)),
       scalar=st.one_of(st.integers(-5, 5), st.sampled_from([-2.5, -0.75, 0.5, 3.0])), seed=st.integers(0, 2**16))
@pytest.mark.slow
def test_binary_ops_broadcast_and_promote(shapes: tuple, dtypes: tuple, scalar: float, seed: int) -> None:
    x, y = _random(shapes[0], dtypes[0], seed), _random(shapes[1], dtypes[1], seed + 1)
    subtract = torch.bool not in dtypes  # torch refuses to subtract bool tensors

    def f(x: torch.Tensor, y: torch.Tensor) -> tuple:
        out = [x + y, x * y, x / y, torch.maximum(x, y), torch.minimum(x, y), x == y, x < y, x >= y, x != y,
               x > scalar, x <= scalar]
        if subtract:
            out += [x - y, x * scalar - y]
        return tuple(out)

    ops = {"add.Tensor", "mul.Tensor", "div.Tensor", "maximum.default", "minimum.default", "eq.Tensor",
           "lt.Tensor", "ge.Tensor", "ne.Tensor", "gt.Scalar", "le.Scalar"} | ({"sub.Tensor"} if subtract else set())
    c = Case("binary", f, (x, y), tuple(_key(o) for o in sorted(ops)))
    assert_same(_compile(c)(x, y), f(x, y))


# -- what cuvil lacks -------------------------------------------------------------------------


def test_unsupported_ops_are_listed_in_one_error() -> None:
    def f(x: torch.Tensor) -> tuple:
        return torch.sort(x).values, torch.topk(x, 2).values, torch.atan2(x, x + 1), torch.cumprod(x, 1), x + 1

    missing = ("aten::sort.default", "aten::topk.default", "aten::atan2.default", "aten::cumprod.default")
    assert not set(missing) & set(TABLE)
    with pytest.raises(UnsupportedOpError) as err:
        cuvil.torch.compile(f, (rand(3, 4),))
    message = str(err.value)
    assert "4 ATen operator(s)" in message, message
    for op in missing:
        assert message.count(op) == 1, message
    assert "aten::add.Tensor" not in message


def test_every_table_entry_has_a_case() -> None:
    named = {op for c in CASES for op in c.ops} | PROPERTY_OPS
    assert not sorted(set(TABLE) - named), f"overloads of TABLE without a case: {sorted(set(TABLE) - named)}"
    assert not sorted(named - set(TABLE)), f"cases name overloads TABLE lacks: {sorted(named - set(TABLE))}"
