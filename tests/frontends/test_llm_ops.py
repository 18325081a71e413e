"""onnxruntime-genai's com.microsoft operators (issue 30) against onnxruntime's CPU kernels, one node per
model: MatMulNBits, SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization, RotaryEmbedding.

Tolerances:
- MatMulNBits: both dequantise each weight the same way, ``(q - zero_point) * scale`` (with 4-bit zero
  points an integer of at most 5 bits times a float32: one rounding; with float ones two), and then sum K
  products in float32 in different orders (cuvil: in vector lanes per output column, fused multiply-adds;
  onnxruntime: its blocked SGEMM).  Each order's error is at most ``K * 2^-24 * sum_k |a_k * w_k|`` (the
  classic bound for a recursive sum, fma or not; the weights' own roundings, 2 * 2^-24 relative, fit in it
  for K >= 16), so the two differ by at most twice that, per output element.
- the normalisations: a sum of n squares (relative error ``n * 2^-24``), a square root and a division
  and three products: ``(n + 8) * 2^-24`` relative to ``|x| * inv * |gamma|``, per element.
- RotaryEmbedding: two products and a sum of two, the same in both: ``4 * 2^-24 * (|c x1| + |s x2|)``.
"""

from __future__ import annotations

import numpy as np
import pytest
import reference
import toolchain
from hypothesis import given
from hypothesis import strategies as st

onnx = toolchain.module("onnx")
ort = toolchain.module("onnxruntime")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper as h  # noqa: E402
from onnx import numpy_helper as nh  # noqa: E402

import cuvil.onnx  # noqa: E402
from cuvil.errors import CuvilError, ShapeError, UnsupportedOpError  # noqa: E402

U = 2.0 ** -24
_ELEM = {"float32": T.FLOAT, "int64": T.INT64, "uint8": T.UINT8}


def _model(node, feeds: dict, inits: dict, outs: list[str], shapes: dict | None = None) -> bytes:
    shapes = shapes or {}
    g = h.make_graph([node], "llm", [h.make_tensor_value_info(k, _ELEM[v.dtype.name], shapes.get(k, v.shape))
                                     for k, v in feeds.items()],
                     [h.make_tensor_value_info(o, T.FLOAT, None) for o in outs],
                     [nh.from_array(np.asarray(v), k) for k, v in inits.items()])
    ops = [h.make_opsetid("", 21), h.make_opsetid("com.microsoft", 1)]
    return h.make_model(g, opset_imports=ops, ir_version=10).SerializeToString()


def _both(model: bytes, feeds: dict) -> tuple[list, list]:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    ref = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, feeds)
    got = cuvil.onnx.InferenceSession(model).run(None, feeds)
    return got, ref


# -- MatMulNBits --------------------------------------------------------------------------------------


def _nbits(K: int, N: int, bs: int, zp: str | None, bias: bool, seed: int, bits: int = 4,
           b_shape: tuple | None = None) -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray | None]:
    """A MatMulNBits model and its dequantised weights [K, N] (for the error bound)."""
    rng = np.random.default_rng(seed)
    nb = -(-K // bs)
    B = rng.integers(0, 256, (N, nb, bs // 2), dtype=np.uint8)
    S = (rng.random(N * nb, dtype=np.float32) * 0.1 + 0.01).astype(np.float32)
    inits = {"B": B if b_shape is None else B.reshape(b_shape), "S": S}
    names = ["A", "B", "S"]
    q = np.stack([B & 15, B >> 4], axis=-1).reshape(N, nb * bs)[:, :K].astype(np.float32)
    zeros = np.full((N, nb), 8.0, np.float32)
    if zp == "float":  # float zero points, as given (the weight (q - zp) * scale then rounds twice)
        zeros = (rng.random((N, nb), dtype=np.float32) * 15).astype(np.float32)
        inits["Z"] = zeros.reshape(-1)
        names.append("Z")
    elif zp:
        Z = rng.integers(0, 256, (N, -(-nb // 2)), dtype=np.uint8)
        inits["Z"] = Z.reshape(-1)
        names.append("Z")
        zeros = np.stack([Z & 15, Z >> 4], axis=-1).reshape(N, -1)[:, :nb].astype(np.float32)
    elif bias:
        names.append("")
    bvec = None
    if bias:
        names += ["", "bias"]
        bvec = rng.standard_normal(N, dtype=np.float32)
        inits["bias"] = bvec
    w = (q - np.repeat(zeros, bs, axis=1)[:, :K]) * np.repeat(S.reshape(N, nb), bs, axis=1)[:, :K]
    node = h.make_node("MatMulNBits", names, ["Y"], domain="com.microsoft", K=K, N=N, bits=bits, block_size=bs,
                       accuracy_level=0, name="mnb")
    feeds = {"A": np.zeros((1, K), np.float32)}
    return _model(node, feeds, inits, ["Y"], {"A": ["M", K]}), w.T.astype(np.float64), bvec


def _check_nbits(got: np.ndarray, ref: np.ndarray, a: np.ndarray, w: np.ndarray, bias: np.ndarray | None) -> None:
    K = a.shape[-1]
    bound = 2 * K * U * (np.abs(a.reshape(-1, K).astype(np.float64)) @ np.abs(w))
    if bias is not None:
        bound += 2 * U * np.abs(ref.reshape(bound.shape))
    err = np.abs(got.reshape(bound.shape).astype(np.float64) - ref.reshape(bound.shape))
    assert got.shape == ref.shape and got.dtype == np.float32
    assert (err <= bound + 1e-30).all(), f"max error {err.max()} against bound {bound[err > bound].min()}"


@reference.budget(0.5)
@given(K=st.integers(1, 24).map(lambda x: 16 * x), N=st.integers(1, 70), bs=st.sampled_from([16, 32, 64, 128, 256]),
       M=st.sampled_from([1, 1, 3, 17]), zp=st.sampled_from([None, "uint8", "float"]), bias=st.booleans(),
       seed=st.integers(0, 2 ** 16))
@pytest.mark.slow
def test_matmul_nbits(K, N, bs, M, zp, bias, seed):
    """Random K (a multiple of 16: the last block may be partial), N, block sizes, without zero points,
    with packed 4-bit ones or float ones, with and without bias, one row (decode) and several (prefill),
    against onnxruntime."""
    model, w, bvec = _nbits(K, N, bs, zp, bias, seed)
    a = np.random.default_rng(seed + 1).standard_normal((M, K), dtype=np.float32)
    (got,), (ref,) = _both(model, {"A": a})
    _check_nbits(got, ref, a, w, bvec)


def test_matmul_nbits_batched_and_wide():
    """A 3-D input (batch, sequence, K) and a decode shape with several panels and a partial one."""
    model, w, _ = _nbits(256, 300, 32, None, False, 3)
    a = np.random.default_rng(4).standard_normal((2, 5, 256), dtype=np.float32)
    (got,), (ref,) = _run_rank3(model, a)
    _check_nbits(got, ref, a, w, None)


def _run_rank3(model: bytes, a: np.ndarray) -> tuple[list, list]:
    m = onnx.load_from_string(model)
    m.graph.input[0].type.tensor_type.shape.Clear()
    for d in a.shape:
        m.graph.input[0].type.tensor_type.shape.dim.add().dim_value = d
    return _both(m.SerializeToString(), {"A": a})


def test_matmul_nbits_errors():
    """A malformed MatMulNBits is refused with cuvil's error naming the node."""
    a = {"A": np.zeros((1, 64), np.float32)}
    bad_b, _, _ = _nbits(64, 8, 32, None, False, 0, b_shape=(8, 2 * 16))
    with pytest.raises(ShapeError, match="MatMulNBits node 'mnb'.*input B"):
        cuvil.onnx.InferenceSession(bad_b).run(None, a)
    three, _, _ = _nbits(64, 8, 32, None, False, 0, bits=3)
    with pytest.raises(UnsupportedOpError, match="MatMulNBits node 'mnb'.*bits=3"):
        cuvil.onnx.InferenceSession(three).run(None, a)


def test_matmul_nbits_unpacks_in_registers():
    """The kernel reads the packed weights inside the contraction (no dequantised weights in memory): one
    kernel, whose constant buffers hold 4 bits a weight (int32 words of 8) plus the scales, and whose
    vectorised innermost loops (the register tile's columns) take each value of a word with two shifts
    (``w * 2**(28 - 4j) // 2**28``, sign-extended) under the reduction loop."""
    model, _, _ = _nbits(512, 256, 32, None, False, 0)
    sess = cuvil.onnx.InferenceSession(model)
    sess.run(None, {"A": np.zeros((1, 512), np.float32)})
    (prog,) = sess.programs()
    (kernel,) = prog.kernel_funcs
    loops = str(kernel)
    tile = loops[loops.index("for (u = 0"):]  # the reduction over words of 8 values, 8 steps unrolled
    assert "vectorize for" in tile and "// 268435456" in tile and "* 16 // 268435456" in tile
    assert sorted(c.dtype.name for c in prog._consts.values()) == ["float32", "int32"]
    assert sum(c.nbytes for c in prog._consts.values()) == 512 * 256 // 2 + 256 * 16 * 4


# -- RMSNorm ------------------------------------------------------------------------------------------


def _rms_bound(z: np.ndarray, g: np.ndarray) -> np.ndarray:
    n = z.shape[-1]
    z64 = z.astype(np.float64)
    inv = 1 / np.sqrt((z64 * z64).mean(-1, keepdims=True) + 1e-5)
    return (n + 8) * U * np.abs(z64) * inv * np.abs(g) + 1e-30


@reference.budget(0.5)
@given(rows=st.lists(st.integers(1, 4), min_size=1, max_size=2), n=st.integers(1, 70), extra=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_simplified_layer_norm(rows, n, extra, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*rows, n), dtype=np.float32)
    g = rng.standard_normal(n, dtype=np.float32)
    outs = ["y", "inv"] if extra else ["y"]
    node = h.make_node("SimplifiedLayerNormalization", ["x", "g"], outs, epsilon=1e-5)
    got, ref = _both(_model(node, {"x": x}, {"g": g}, outs), {"x": x})
    assert np.all(np.abs(got[0] - ref[0]) <= 2 * _rms_bound(x, g))
    if extra:
        assert got[1].shape == ref[1].shape
        np.testing.assert_allclose(got[1], ref[1], rtol=(n + 4) * U * 2)


def test_simplified_layer_norm_com_microsoft_domain():
    """The com.microsoft spelling is read as the same operator."""
    x = np.random.default_rng(0).standard_normal((3, 16), dtype=np.float32)
    g = np.ones(16, np.float32)
    node = h.make_node("SimplifiedLayerNormalization", ["x", "g"], ["y"], domain="com.microsoft", epsilon=1e-5)
    (y,) = cuvil.onnx.InferenceSession(_model(node, {"x": x}, {"g": g}, ["y"])).run(None, {"x": x})
    np.testing.assert_allclose(y, x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5), rtol=1e-5)


@reference.budget(0.5)
@given(b=st.integers(1, 3), s=st.integers(1, 4), n=st.integers(1, 70), skip2d=st.booleans(), bias=st.booleans(),
       outs=st.sampled_from([1, 2, 3, 4]), seed=st.integers(0, 2 ** 16))
def test_skip_simplified_layer_norm(b, s, n, skip2d, bias, outs, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, s, n), dtype=np.float32)
    k = rng.standard_normal((s, n) if skip2d else (b, s, n), dtype=np.float32)
    g = rng.standard_normal(n, dtype=np.float32)
    inits = {"g": g}
    names = ["x", "k", "g"]
    if bias:
        inits["bias"] = rng.standard_normal(n, dtype=np.float32)
        names.append("bias")
    out_names = ["y", "mean", "inv", "sum"][:outs]
    node = h.make_node("SkipSimplifiedLayerNormalization", names, out_names, domain="com.microsoft", epsilon=1e-5)
    got, ref = _both(_model(node, {"x": x, "k": k}, inits, out_names), {"x": x, "k": k})
    z = x + k + (inits["bias"] if bias else 0)
    assert np.all(np.abs(got[0] - ref[0]) <= 2 * _rms_bound(z, g) + 4 * U * np.abs(ref[0]))
    for gi, ri in zip(got[1:], ref[1:]):
        assert gi.shape == ri.shape
        np.testing.assert_allclose(gi, ri, rtol=(n + 4) * U * 2, atol=1e-30)


# -- RotaryEmbedding ---------------------------------------------------------------------------------


@reference.budget(0.5)
@given(b=st.integers(1, 2), s=st.integers(1, 5), heads=st.integers(1, 3), half=st.integers(1, 8),
       interleaved=st.booleans(), layout4=st.booleans(), start=st.one_of(st.none(), st.integers(0, 6)),
       seed=st.integers(0, 2 ** 16))
def test_rotary_embedding(b, s, heads, half, interleaved, layout4, start, seed):
    """com.microsoft's RotaryEmbedding: position ids per token or the first token's position, both
    pairings, (B, S, H*D) and (B, H, S, D) inputs."""
    rng = np.random.default_rng(seed)
    d = 2 * half
    x = rng.standard_normal((b, heads, s, d) if layout4 else (b, s, heads * d), dtype=np.float32)
    positions = 16
    ang = rng.random((positions, half)) * 6
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    ids = (np.array([start], np.int64) if start is not None else
           rng.integers(0, positions, (b, s)).astype(np.int64))
    node = h.make_node("RotaryEmbedding", ["x", "p", "cos", "sin"], ["y"], domain="com.microsoft",
                       interleaved=int(interleaved), num_heads=heads)
    feeds = {"x": x, "p": ids}
    (got,), (ref,) = _both(_model(node, feeds, {"cos": cos, "sin": sin}, ["y"]), feeds)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=0, atol=4 * U * 2 * (np.abs(x).max() + 1e-30))


def test_rotary_embedding_errors():
    x = np.zeros((1, 2, 8), np.float32)
    cos = np.zeros((4, 3), np.float32)
    node = h.make_node("RotaryEmbedding", ["x", "p", "cos", "sin"], ["y"], domain="com.microsoft", name="rot",
                       rotary_embedding_dim=8)
    feeds = {"x": x, "p": np.zeros((1, 2), np.int64)}
    with pytest.raises(CuvilError, match="RotaryEmbedding node 'rot'.*rotary_embedding_dim 8"):
        cuvil.onnx.InferenceSession(_model(node, feeds, {"cos": cos, "sin": cos}, ["y"])).run(None, feeds)


# -- GroupQueryAttention -------------------------------------------------------------------------------


def _gqa(B, S, N, KV, D, P, seqlens, total, rotary, interleaved, seed, packed=False):
    rng = np.random.default_rng(seed)
    feeds = {"q": rng.standard_normal((B, S, N * D), dtype=np.float32),
             "k": rng.standard_normal((B, S, KV * D), dtype=np.float32),
             "v": rng.standard_normal((B, S, KV * D), dtype=np.float32),
             "pk": rng.standard_normal((B, KV, P, D), dtype=np.float32),
             "pv": rng.standard_normal((B, KV, P, D), dtype=np.float32),
             "sl": np.array(seqlens, np.int32), "tl": np.array(total, np.int32)}
    names = ["q", "k", "v", "pk", "pv", "sl", "tl"]
    if packed:
        names[1:3] = ["", ""]
        del feeds["k"], feeds["v"]
    inits = {}
    attrs = {"num_heads": N, "kv_num_heads": KV}
    if rotary:
        ang = rng.random((P + S + 4, D // 2)) * 6
        inits = {"cos": np.cos(ang).astype(np.float32), "sin": np.sin(ang).astype(np.float32)}
        names += ["cos", "sin"]
        attrs.update(do_rotary=1, rotary_interleaved=int(interleaved))
    node = h.make_node("GroupQueryAttention", names, ["y", "present_k", "present_v"], domain="com.microsoft",
                       name="gqa", **attrs)
    elem = {"float32": T.FLOAT, "int32": T.INT32}
    g = h.make_graph([node], "gqa", [h.make_tensor_value_info(k, elem[v.dtype.name], v.shape) for k, v in feeds.items()],
                     [h.make_tensor_value_info(o, T.FLOAT, None) for o in ["y", "present_k", "present_v"]],
                     [nh.from_array(v, k) for k, v in inits.items()])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 21), h.make_opsetid("com.microsoft", 1)], ir_version=10)
    return m.SerializeToString(), feeds


@reference.budget(0.25)
@given(B=st.integers(1, 2), S=st.sampled_from([1, 1, 3]), KV=st.integers(1, 2), group=st.integers(1, 3),
       D=st.sampled_from([16, 32]), mode=st.sampled_from(["prompt", "dynamic", "static"]), rotary=st.booleans(),
       interleaved=st.booleans(), data=st.data(), seed=st.integers(0, 2 ** 16))
@pytest.mark.slow
def test_group_query_attention(B, S, KV, group, D, mode, rotary, interleaved, data, seed):
    """A prompt (no cache), a dynamic cache (past P tokens, present P + S) and a static one (a buffer of P
    with each sequence's own length in seqlens_k), with and without rotary, against onnxruntime.
    Tolerance: the scores are sums of D products (error ``D * 2^-24 * sum |q k| * scale``), which exp turns
    into relative errors of the probabilities; the output sums T probabilities times values:
    ``8 * 2^-24 * (D * max sum|q k| * scale + T + 8) * max |v|`` (a few rounding steps of slack each)."""
    N = KV * group
    if mode != "prompt" and S > 1:
        B = 1  # (onnxruntime: several new tokens after a cache only for one sequence)
    if mode == "prompt":
        P, pasts = 0, [0] * B
    elif mode == "dynamic":
        P = data.draw(st.integers(1, 6))
        pasts = [P] * B
    else:
        P = data.draw(st.integers(S, 8))
        pasts = data.draw(st.lists(st.integers(0, P - S), min_size=B, max_size=B))
    seqlens = [p + S - 1 for p in pasts]
    total = P + S if mode != "static" else max(seqlens) + 1
    model, feeds = _gqa(B, S, N, KV, D, P, seqlens, total, rotary, interleaved, seed)
    got, ref = _both(model, feeds)
    for g_, r_ in zip(got, ref):
        assert g_.shape == r_.shape
    q, k = feeds["q"].astype(np.float64), np.concatenate([feeds["pk"].reshape(B, KV, P, D).transpose(0, 2, 1, 3)
                                                          .reshape(B, P, KV * D), feeds["k"]], axis=1)
    smax = np.abs(q).max() * np.abs(k).max() * D / np.sqrt(D)
    vmax = max(np.abs(feeds["v"]).max(), np.abs(feeds["pv"]).max() if P else 0.0)
    tol = 8 * U * (D * smax + P + S + 8) * vmax
    np.testing.assert_allclose(got[0], ref[0], rtol=0, atol=tol)
    for g_, r_ in zip(got[1:], ref[1:]):  # the caches: copies, rotated keys within a rotation's rounding
        np.testing.assert_allclose(g_, r_, rtol=0, atol=8 * U * max(np.abs(r_).max(), 1e-30))


def test_group_query_attention_unsupported():
    """A packed QKV input is refused naming the node."""
    model, feeds = _gqa(1, 1, 2, 1, 16, 2, [2], 3, False, False, 0, packed=True)
    with pytest.raises(UnsupportedOpError, match="GroupQueryAttention node 'gqa'.*packed QKV"):
        cuvil.onnx.InferenceSession(model).run(None, feeds)
