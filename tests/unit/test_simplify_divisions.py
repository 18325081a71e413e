"""Integer division and remainder of linear index expressions: the simplifier's rewrites keep the value for
every integer (negative ones too), and the forms isl writes for a fused loop's tile offsets cancel to the
constants they are (so a register tile's local index is known and its accumulators stay in registers)."""

from __future__ import annotations

import itertools

import pytest

from cuvil.ir import expr as E
from cuvil.ir.simplify import simplify_expr

F, G = E.Var("int64", "F"), E.Var("int64", "G")


def _c(v: int) -> E.Expr:
    return E.const(v, "int64")


def _value(e: E.Expr, env: dict[str, int]) -> int:
    if isinstance(e, E.Const):
        return int(e.value)
    if isinstance(e, E.Var):
        return env[e.name]
    if isinstance(e, E.Unary):
        assert e.op == "neg", e
        return -_value(e.a, env)
    a, b = _value(e.a, env), _value(e.b, env)
    ops = {"add": lambda: a + b, "sub": lambda: a - b, "mul": lambda: a * b, "floordiv": lambda: a // b,
           "floormod": lambda: a % b}
    return ops[e.op]()


@pytest.mark.parametrize("op", ["floordiv", "floormod"])
def test_divisions_of_two_variables_keep_their_value_everywhere(op):
    points = list(itertools.product(range(-7, 8), range(-5, 6)))
    for k1, k2, r, d in itertools.product(range(-9, 10, 2), range(-8, 9, 3), range(-6, 7, 2), range(2, 8)):
        e = E.Binary("int64", op, F * _c(k1) + G * _c(k2) + _c(r), _c(d))
        s = simplify_expr(e)
        for f, g in points:
            want = (k1 * f + k2 * g + r) // d if op == "floordiv" else (k1 * f + k2 * g + r) % d
            assert _value(s, {"F": f, "G": g}) == want, f"{e} -> {s} at F={f}, G={g}"


def test_isl_form_of_a_block_offset_cancels():
    # a fused loop F over 4 filter blocks x 54 rows: isl writes the block's first filter as
    # 32 * F - 32 * ((53 * F + 53) // 54), the tile's local index subtracts 32 * (F // 54)
    fd = lambda a, d: E.Binary("int64", "floordiv", a, _c(d))  # noqa: E731
    local = F * _c(32) - fd(F * _c(53) + _c(53), 54) * _c(32) - fd(F, 54) * _c(32) + _c(3)
    assert isinstance(simplify_expr(local), E.Const) and simplify_expr(local).value == 3
    assert str(simplify_expr(fd(F * _c(53) + _c(53), 54))) == "F - F // 54"


def test_a_division_of_a_division_is_one_division():
    fd = lambda a, d: E.Binary("int64", "floordiv", a, _c(d))  # noqa: E731
    for k, r, c, d in itertools.product(range(-5, 6), range(-4, 5), range(1, 6), range(1, 6)):
        s = simplify_expr(fd(fd(F * _c(k) + _c(r), c), d))
        for f in range(-30, 31):
            assert _value(s, {"F": f}) == (k * f + r) // c // d, s
    # isl's form of a 7x7 stem convolution's filter block under a fused loop of 3 blocks x 109 rows
    assert str(simplify_expr(fd(fd(F * _c(32) + _c(31), 109), 32))) == "F // 109"
