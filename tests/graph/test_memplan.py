"""The static memory plan never lets two live buffers share a byte, and reuses dead ones."""

from hypothesis import given
from hypothesis import strategies as st
from reference import budget

from cuvil.graph.memplan import Lifetime, lifetimes, plan_memory


def test_chain_reuses_the_first_buffer():
    calls = [((), ("a",)), (("a",), ("b",)), (("b",), ("c",)), (("c",), ())]
    lt = lifetimes(calls, {"a": 4096, "b": 4096, "c": 4096})
    assert [(b.key, b.first, b.last) for b in lt] == [("a", 0, 1), ("b", 1, 2), ("c", 2, 3)]
    p = plan_memory(lt)
    assert p.arena_bytes == 8192 and p.total_bytes == 12288 and p.offsets["c"] == p.offsets["a"]
    assert "33% saved" in str(p)


@budget(10)  # 200 examples under the ci profile
@given(st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 20), st.integers(0, 8)), min_size=1, max_size=25))
def test_no_two_live_buffers_overlap(specs):
    bufs = [Lifetime(k, n, t, t + d) for k, (n, t, d) in enumerate(specs)]
    p = plan_memory(bufs, align=64)
    for a in bufs:
        assert p.offsets[a.key] % 64 == 0 and p.offsets[a.key] + a.nbytes <= p.arena_bytes
        for b in bufs:
            if a.key < b.key and a.first <= b.last and b.first <= a.last:
                lo_a, lo_b = p.offsets[a.key], p.offsets[b.key]
                assert lo_a + a.nbytes <= lo_b or lo_b + b.nbytes <= lo_a, (a, b, p)
    # never worse than one buffer after another
    assert p.arena_bytes <= sum((b.nbytes + 63) // 64 * 64 for b in bufs)
