"""cuvil's own float32 exp, log, tanh, erf and sigmoid, as straight-line LLVM IR.

Each function takes an ``ir.IRBuilder`` and a ``float`` or ``<N x float>`` value
and returns the result of the same type, built only from arithmetic, compares,
selects and integer bit operations: no calls, so LLVM keeps vector code vector
(it scalarises ``llvm.exp.v16f32`` into 16 ``expf`` calls) and can vectorise a
serial loop that uses them.  The scalar path uses the same code, so a vectorised
loop's vector body and scalar epilogue agree bit for bit with each other and
with a serial loop.

Algorithms (polynomials evaluated by Horner's rule; ``fmul``/``fadd`` carry the
``contract`` flag, so they become FMAs where the target has them):

- ``exp``: clamp x to [-104, 89]; n = round(x / ln 2) (the 1.5*2^23 shifter
  trick); r = x - n*ln2 with ln2 split in two (Cody-Waite: n*LN2_HI is exact);
  e^r = 1 + r + r^2*P(r), P of degree 4 (|r| <= ln2/2); the result is scaled by
  2^n as two factors 2^(n//2) * 2^(n - n//2), so overflow gives inf and
  subnormal results are rounded once.
- ``log``: subnormals are scaled by 2^23 first; x = m * 2^e with m in
  [sqrt(1/2), sqrt(2)) from the bits; f = m - 1 (exact); log(1+f) = f + f^2*P(f),
  P of degree 8; the result is e*LN2_HI + (e*LN2_LO + log(1+f)).
- ``tanh``: |x| < 0.9: x + x^3*P(x^2), P of degree 6; otherwise
  sign(x) * (1 - 2/(exp(2|x|) + 1)) with |x| clamped to 10 (tanh is 1 there).
- ``erf``: |x| < 1: x + x*P(x^2), P of degree 6; otherwise
  sign(x) * (1 - exp(-x^2) * Q(|x|)), Q of degree 9 fitted to erfc(x)*exp(x^2) on
  [1, 4], |x| clamped to 4 (erf is 1 there in float32).
- ``sigmoid``: e = exp(-|x|); 1/(1+e) for x >= 0, e/(1+e) otherwise (no overflow,
  subnormal results for large negative x).

The coefficients were fitted by ``tools/fit_vecmath.py`` (Lawson's minimax
algorithm on the relative error, float64 references from numpy/math, then
rounded to float32 one by one from the highest order down, re-fitting the rest).
Measured maximum errors are in docs/codegen.md and tests/codegen/test_vecmath.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from llvmlite import ir

_FAST = ("contract",)
_I32 = ir.IntType(32)
_INF, _NAN = float("inf"), float("nan")

# -- fitted coefficients (tools/fit_vecmath.py), lowest order first -------------------------
# e^r = 1 + r + r^2 * P(r) on |r| <= ln2/2: max relative error 4.8e-9 in float64 arithmetic
EXP_P = (0.4999999403953552, 0.16666515171527863, 0.04166845604777336, 0.008369418792426586,
         0.0013813144760206342)
# log(1+f) = f + f^2 * P(f) on [sqrt(1/2)-1, sqrt(2)-1]: max relative error 5.3e-9
LOG_P = (-0.49999988079071045, 0.33333325386047363, -0.25001582503318787, 0.20001976191997528,
         -0.16609077155590057, 0.14181776344776154, -0.132429838180542, 0.12904709577560425,
         -0.07622113078832626)
# tanh(x) = x + x^3 * P(x^2) on |x| < 0.9: max relative error 6.2e-9
TANH_P = (-0.33333322405815125, 0.13332977890968323, -0.05392930284142494, 0.021663542836904526,
          -0.008264543488621712, 0.0025826673954725266, -0.0004554598417598754)
TANH_SMALL = 0.9
# erf(x) = x + x * P(x^2) on |x| < 1: max relative error 2.5e-9
ERF_P = (0.12837916612625122, -0.3761262595653534, 0.1128358542919159, -0.026853812858462334,
         0.005188327748328447, -0.0008010192541405559, 7.853857823647559e-05)
# erfc(x) = exp(-x^2) * Q(x) on [1, 4]: max absolute error of 1 - erfc 3.2e-9
ERFC_Q = (0.9957204461097717, -1.0994882583618164, 0.911414384841919, -0.5880216956138611,
          0.29256489872932434, -0.1091095507144928, 0.029238617047667503, -0.00527937663719058,
          0.0005720971967093647, -2.7994561605737545e-05)

# ln 2 split so that n * LN2_HI is exact for |n| < 2^9 (LN2_HI: ln 2 rounded to 15 bits)
LN2_HI = 0.693145751953125
LN2_LO = 1.4286068202862268e-06  # ln 2 - LN2_HI
LOG2E = 1.4426950408889634
SHIFTER = 12582912.0  # 1.5 * 2^23: x + SHIFTER rounds x to an integer (|x| < 2^22)
SQRT_HALF_BITS = 0x3F3504F3  # float32 bits of sqrt(1/2)


class _Emit:
    """Small helpers that build scalar-or-vector IR of the type of a given float value."""

    def __init__(self, b: ir.IRBuilder, x: ir.Value, avx512: bool = False):
        self.b = b
        self.ft = x.type
        self.it = ir.VectorType(_I32, x.type.count) if isinstance(x.type, ir.VectorType) else _I32
        # AVX-512's vscalefps computes p * 2^n rounded once, as the two-factor product does (bit for bit)
        self.scalef = avx512 and isinstance(x.type, ir.VectorType) and x.type.count == 16

    def f(self, v: float) -> ir.Constant:
        return ir.Constant(self.ft, v)

    def i(self, v: int) -> ir.Constant:
        return ir.Constant(self.it, v & 0xFFFFFFFF)

    def add(self, a: ir.Value, c: ir.Value) -> ir.Value:
        return self.b.fadd(a, c, flags=_FAST)

    def sub(self, a: ir.Value, c: ir.Value) -> ir.Value:
        return self.b.fsub(a, c, flags=_FAST)

    def mul(self, a: ir.Value, c: ir.Value) -> ir.Value:
        return self.b.fmul(a, c, flags=_FAST)

    def mad(self, a: ir.Value, c: ir.Value, d: ir.Value) -> ir.Value:
        """a * c + d (an FMA where the target has one)."""
        return self.add(self.mul(a, c), d)

    def poly(self, t: ir.Value, coeffs: Sequence[float]) -> ir.Value:
        """sum coeffs[k] * t^k by Horner's rule."""
        acc: ir.Value = self.f(coeffs[-1])
        for c in reversed(coeffs[:-1]):
            acc = self.mad(acc, t, self.f(c))
        return acc

    def bits(self, v: ir.Value) -> ir.Value:
        return self.b.bitcast(v, self.it)

    def float_(self, v: ir.Value) -> ir.Value:
        return self.b.bitcast(v, self.ft)

    def abs(self, v: ir.Value) -> ir.Value:
        return self.float_(self.b.and_(self.bits(v), self.i(0x7FFFFFFF)))

    def copysign(self, mag: ir.Value, sign: ir.Value) -> ir.Value:
        """``mag`` (non-negative) with the sign bit of ``sign``."""
        return self.float_(self.b.or_(self.bits(mag), self.b.and_(self.bits(sign), self.i(-0x80000000))))

    def lt(self, a: ir.Value, c: ir.Value) -> ir.Value:
        return self.b.fcmp_ordered("<", a, c)

    def clamp(self, v: ir.Value, lo: float, hi: float) -> ir.Value:
        """min(max(v, lo), hi); NaN becomes ``lo`` (callers restore NaN at the end)."""
        b = self.b
        v = b.select(b.fcmp_ordered(">", v, self.f(lo)), v, self.f(lo))
        return b.select(self.lt(v, self.f(hi)), v, self.f(hi))

    def keep_nan(self, x: ir.Value, result: ir.Value) -> ir.Value:
        return self.b.select(self.b.fcmp_unordered("uno", x, x), x, result)

    def scale(self, p: ir.Value, n: ir.Value) -> ir.Value:
        """p * 2^n for integral float n with one AVX-512 vscalefps (16 float lanes)."""
        name = "llvm.x86.avx512.mask.scalef.ps.512"
        module = self.b.module
        fn = module.globals.get(name)
        if fn is None:
            i16 = ir.IntType(16)
            fn = ir.Function(module, ir.FunctionType(self.ft, [self.ft, self.ft, self.ft, i16, _I32]), name)
        mask, rounding = ir.Constant(ir.IntType(16), -1), ir.Constant(_I32, 4)  # all lanes, current mode
        return self.b.call(fn, [p, n, ir.Constant(self.ft, None), mask, rounding])

    def pow2(self, n: ir.Value) -> ir.Value:
        """2^n as a float, for integer n in [-126, 127]."""
        return self.float_(self.b.shl(self.b.add(n, self.i(127)), self.i(23)))


def _exp(m: _Emit, x: ir.Value, nan_through: bool = False) -> ir.Value:
    """e^x, NaN not yet restored (NaN lanes hold e^-104 = 0); with ``nan_through`` (the vscalefps path
    only: the integer scaling would turn NaN into garbage) NaN lanes stay NaN."""
    b = m.b
    if nan_through:  # (x < lo) ? lo : x keeps a NaN x (one vmaxps with x second)
        xc = b.select(m.lt(x, m.f(-104.0)), m.f(-104.0), x)
        xc = b.select(b.fcmp_ordered(">", xc, m.f(89.0)), m.f(89.0), xc)
    else:
        xc = m.clamp(x, -104.0, 89.0)
    k = m.mad(xc, m.f(LOG2E), m.f(SHIFTER))
    n = m.sub(k, m.f(SHIFTER))  # round(x / ln2), exact
    r = m.mad(n, m.f(-LN2_HI), xc)  # exact: n * LN2_HI has <= 24 significant bits
    r = m.mad(n, m.f(-LN2_LO), r)
    p = m.add(m.mad(m.mul(r, r), m.poly(r, EXP_P), r), m.f(1.0))
    if m.scalef:
        return m.scale(p, n)
    ni = b.fptosi(n, m.it)  # in [-150, 129]
    n1 = b.ashr(ni, m.i(1))
    n2 = b.sub(ni, n1)
    return m.mul(m.mul(p, m.pow2(n1)), m.pow2(n2))


def exp(b: ir.IRBuilder, x: ir.Value, avx512: bool = False) -> ir.Value:
    """e^x: inf for x > ln(FLT_MAX), 0 below -103.98, subnormals rounded once; NaN stays NaN."""
    m = _Emit(b, x, avx512)
    if m.scalef:  # a NaN goes through the clamp and the arithmetic: no mask and blend at the end
        return _exp(m, x, nan_through=True)
    return m.keep_nan(x, _exp(m, x))


def log(b: ir.IRBuilder, x: ir.Value, avx512: bool = False) -> ir.Value:
    """Natural log: log(0) = -inf, log(x < 0) = NaN, log(inf) = inf, subnormals exact-scaled."""
    m = _Emit(b, x, avx512)
    tiny = m.lt(x, m.f(2.0**-126))
    xs = b.select(tiny, m.mul(x, m.f(2.0**23)), x)
    ix = b.sub(m.bits(xs), m.i(SQRT_HALF_BITS))
    e = b.add(b.ashr(ix, m.i(23)), b.select(tiny, m.i(-23), m.i(0)))
    mant = m.float_(b.add(b.and_(ix, m.i(0x7FFFFF)), m.i(SQRT_HALF_BITS)))  # in [sqrt(1/2), sqrt(2))
    f = m.sub(mant, m.f(1.0))  # exact (Sterbenz)
    lg1p = m.mad(m.mul(f, f), m.poly(f, LOG_P), f)
    ef = b.sitofp(e, m.ft)
    r = m.mad(ef, m.f(LN2_HI), m.mad(ef, m.f(LN2_LO), lg1p))
    r = b.select(b.fcmp_ordered("==", x, m.f(_INF)), x, r)
    r = b.select(b.fcmp_ordered("==", x, m.f(0.0)), m.f(-_INF), r)
    return b.select(b.fcmp_unordered("<", x, m.f(0.0)), m.f(_NAN), r)  # x < 0 or NaN


def tanh(b: ir.IRBuilder, x: ir.Value, avx512: bool = False) -> ir.Value:
    """tanh: odd polynomial near 0 (tiny x gives x, -0 gives -0), 1 - 2/(e^2|x| + 1) beyond."""
    m = _Emit(b, x, avx512)
    a = m.abs(x)
    u = m.mul(a, a)
    small = m.mad(m.mul(a, u), m.poly(u, TANH_P), a)
    ac = m.clamp(a, 0.0, 10.0)
    big = m.sub(m.f(1.0), b.fdiv(m.f(2.0), m.add(_exp(m, m.add(ac, ac)), m.f(1.0))))
    return m.keep_nan(x, m.copysign(b.select(m.lt(a, m.f(TANH_SMALL)), small, big), x))


def erf(b: ir.IRBuilder, x: ir.Value, avx512: bool = False) -> ir.Value:
    """erf: odd polynomial for |x| < 1, 1 - exp(-x^2) Q(|x|) beyond (1 from |x| = 4 on)."""
    m = _Emit(b, x, avx512)
    a = m.abs(x)
    small = m.mad(a, m.poly(m.mul(a, a), ERF_P), a)
    ac = m.clamp(a, 1.0, 4.0)
    big = m.sub(m.f(1.0), m.mul(_exp(m, b.fneg(m.mul(ac, ac))), m.poly(ac, ERFC_Q)))
    return m.keep_nan(x, m.copysign(b.select(m.lt(a, m.f(1.0)), small, big), x))


def sigmoid(b: ir.IRBuilder, x: ir.Value, avx512: bool = False) -> ir.Value:
    """1 / (1 + e^-x), as e/(1+e) with e = e^-|x| for negative x (no overflow, no NaN)."""
    m = _Emit(b, x, avx512)
    e = _exp(m, b.fneg(m.abs(x)))
    d = m.add(e, m.f(1.0))
    pos = b.fdiv(m.f(1.0), d)
    neg = b.fdiv(e, d)
    return m.keep_nan(x, b.select(b.fcmp_ordered(">=", x, m.f(0.0)), pos, neg))


FUNCTIONS: dict[str, Callable[..., ir.Value]] = {  # (builder, x, avx512=False) -> f(x)
    "exp": exp, "log": log, "tanh": tanh, "erf": erf, "sigmoid": sigmoid}
