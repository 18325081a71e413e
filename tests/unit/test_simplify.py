"""The loop-IR simplifier keeps integer values: random affine expressions with floor division and
modulo by constants evaluate the same before and after simplification (numpy floor semantics)."""

from hypothesis import given
from hypothesis import strategies as st
from reference import budget

from cuvil.ir import expr as E
from cuvil.ir.simplify import simplify_expr

X, Y = E.Var("int64", "x"), E.Var("int64", "y")


def _eval(e: E.Expr, env: dict[str, int]) -> int:
    if isinstance(e, E.Const):
        return int(e.value)
    if isinstance(e, E.Var):
        return env[e.name]
    if isinstance(e, E.Unary):
        assert e.op == "neg"
        return -_eval(e.a, env)
    a, b = _eval(e.a, env), _eval(e.b, env)
    ops = {"add": int.__add__, "sub": int.__sub__, "mul": int.__mul__, "floordiv": int.__floordiv__,
           "floormod": int.__mod__, "min": min, "max": max}
    return ops[e.op](a, b)


@st.composite
def _affine(draw, depth=3):
    """sum of c * atom + k, where an atom is a variable or (affine) // d or (affine) % d."""
    terms = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["var", "div", "mod"] if depth > 0 else ["var"]))
        if kind == "var":
            atom = draw(st.sampled_from([X, Y]))
        else:
            inner = draw(_affine(depth - 1))
            d = E.const(draw(st.sampled_from([1, 2, 3, 7, 14, 16, 32])), "int64")
            atom = inner // d if kind == "div" else inner % d
        terms.append(atom * draw(st.integers(-33, 33)))
    out = terms[0]
    for t in terms[1:]:
        out = out + t
    return out + draw(st.integers(-40, 40))


@budget(15)  # 300 examples under the ci profile
@given(_affine(), st.lists(st.tuples(st.integers(-60, 60), st.integers(-60, 60)), min_size=4, max_size=4))
def test_simplify_keeps_integer_values(e, points):
    s = simplify_expr(e)
    for x, y in points:
        env = {"x": x, "y": y}
        assert _eval(s, env) == _eval(e, env), (str(e), str(s), env)


def test_tile_offsets_cancel():
    # isl writes a tile's lower bound as (t + 14) // 14 * 32 + (-t - 1) // 14 * 32; with the index
    # 32 * (t // 14) + f it must leave f (a constant register-tile index, so LLVM keeps it in registers)
    f = E.Var("int64", "f")
    e = (X + 14) // 14 * 32 + f + (-X - 1) // 14 * 32
    assert str(simplify_expr(e)) == "f"
    assert str(simplify_expr((-X - 1) // 14)) == "-(x // 14) - 1"


def test_branch_condition_pins_the_tail_tile():
    # for (j < 32) { if (1000 - 32 * j >= 32) full else tail }: the tail runs for j = 31 only
    from cuvil.ir.simplify import simplify_stmt
    from cuvil.ir.stmt import Buffer, For, If, Store

    j, t = E.Var("int64", "j"), E.Var("int64", "t")
    buf = Buffer("C", (E.const(1000, "int64"),), "float32")
    ext = E.Binary("int64", "min", E.const(32, "int64"), X * 0 + E.const(1000, "int64") - j * 32)
    tail = For(t, E.const(0, "int64"), ext, Store(buf, (j * 32 + t,), E.const(0.0, "float32")), "vectorize")
    full = For(t, E.const(0, "int64"), E.const(32, "int64"), Store(buf, (j * 32 + t,), E.const(0.0, "float32")))
    cond = E.Binary("bool", "ge", E.const(1000, "int64") - j * 32, E.const(32, "int64"))
    loop = For(j, E.const(0, "int64"), E.const(32, "int64"), If(cond, full, tail))
    text = str(simplify_stmt(loop))
    assert "t < 8" in text and "C[t + 992]" in text, text


def test_loop_guarded_by_its_own_bound_stops_there():
    # isl bounds a loop over fused tiles by a hull and guards its body: for (t < 1169) if (t <= 783) body
    from cuvil.ir.simplify import simplify_stmt
    from cuvil.ir.stmt import Allocate, Buffer, For, If, Store

    t = E.Var("int64", "t")
    buf = Buffer("C", (E.const(784, "int64"),), "float32")
    local = Buffer("C.local", (E.const(8, "int64"),), "float32", "local")
    store = Store(buf, (t,), E.const(1.0, "float32"))
    guard = E.Binary("bool", "le", t, E.const(783, "int64"))
    loop = For(t, E.const(0, "int64"), E.const(1169, "int64"), Allocate(local, If(guard, store)), "parallel")
    text = str(simplify_stmt(loop))
    assert "t < 784" in text and "if" not in text, text
    # an else branch, or a guard on the lower side, keeps the loop as it is
    kept = For(t, E.const(0, "int64"), E.const(1169, "int64"), If(guard, store, store))
    assert "t < 1169" in str(simplify_stmt(kept))
    low = E.Binary("bool", "ge", t, E.const(5, "int64"))
    assert "t < 1169" in str(simplify_stmt(For(t, E.const(0, "int64"), E.const(1169, "int64"), If(low, store))))


def test_min_max_of_data_is_not_distributed_over_a_sum():
    """int64 data wraps: x + max(0, x) is not max(x, 2x) when 2x overflows (hypothesis found it)."""
    import numpy as np

    import cuvil
    from cuvil import te

    X = te.placeholder((4,), dtype="int64", name="x")
    Y = te.compute((4,), lambda i: X[i] + te.max(te.const(0, "int64"), X[i]), name="y")
    x = np.array([-6889112216835153290 // 2 + (1 << 63) // 2, 6, -4, 2**62 + 5], np.int64)
    y = np.empty(4, np.int64)
    cuvil.build(cuvil.auto_schedule([X, Y]), [X, Y])(x, y)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(y, x + np.maximum(0, x))


def test_floor_division_of_data_keeps_the_wrapped_value():
    import numpy as np

    import cuvil
    from cuvil import te

    X = te.placeholder((3,), dtype="int64", name="x")
    Y = te.compute((3,), lambda i: (X[i] * 4 + 1) // 4, name="y")
    x = np.array([2**62 + 3, 5, -7], np.int64)
    y = np.empty(3, np.int64)
    cuvil.build(cuvil.auto_schedule([X, Y]), [X, Y])(x, y)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(y, (x * 4 + 1) // 4)


@budget(15)  # 300 examples under the ci profile
@given(st.sampled_from([2, 4, 14, 16, 32]), st.integers(1, 3), st.sampled_from([3, 7, 896]), st.integers(-3, 3),
       st.integers(0, 3), st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 1000)), min_size=6, max_size=6))
def test_common_factor_of_divisor_and_coefficient(g, a, d, shift, width, points):
    """(g*a*f + i + k) // (g*d) and % (g*d) with i + k inside one multiple of g: folded by the common
    factor g (a fused tile loop's row: (14 * f + i) % 12544 == 14 * (f % 896) + i for i < 14)."""
    from cuvil.ir.simplify import Simplifier

    f, i = E.Var("int64", "f"), E.Var("int64", "i")
    hi = max(0, g - 1 - width)  # i in [0, hi], so i + shift * g + [0, width] stays in one multiple of g
    bounds = {id(f): (0, 4000), id(i): (0, hi)}
    c = E.const(g * d, "int64")
    for e in (((f * (g * a)) + i + shift * g + width) // c, ((f * (g * a)) + i + shift * g + width) % c):
        s = Simplifier(dict(bounds)).visit(e)
        for fv, iv in points:
            env = {"f": fv, "i": iv % (hi + 1)}
            assert _eval(s, env) == _eval(e, env), (str(e), str(s), env)


def test_tile_row_under_a_fused_loop_is_its_local_index():
    from cuvil.ir.simplify import Simplifier

    f, i = E.Var("int64", "f"), E.Var("int64", "i")
    simp = Simplifier({id(f): (0, 2687), id(i): (0, 13)})
    row = (f * 14 + i) % 12544
    local = i - (f * 14 + i) // 12544 * 12544 + f // 896 * 12544
    assert str(simp.visit(local)) == "i"
    assert str(simp.visit(row)) == "f * 14 - f // 896 * 12544 + i"  # i is out of every division
