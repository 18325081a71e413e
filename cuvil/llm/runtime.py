"""Running a decoder: compiled steps, a KV cache updated in place, prefill, decode and generation.

:class:`Generator` compiles one step for a single token (decode) and one for a chunk of ``chunk`` tokens
(prefill), each a fixed sequence of kernels over buffers allocated once.  Per layer::

    h   = rms_norm(x)                       kernels.rms_norm
    qkv = h @ [Wq; Wk; Wv]^T (+ biases)     qlinear.linear (q, k, v fused)
    q, K[p:p+T], V[p:p+T] = rotary(qkv)     kernels.rotary: the new keys and values land in the cache
    a   = attention(q, K[:p+T], V[:p+T])    kernels.attention (causal, grouped, sliding window)
    x2  = x + a @ Wo^T                      qlinear.linear (residual)
    h   = rms_norm(x2)
    gu  = h @ [Wgate; Wup]^T                qlinear.linear (gate, up fused)
    x   = x2 + (act(gate) * up) @ Wdown^T   kernels.gated_act, qlinear.linear (residual)

then the final norm and the head on the last token, and the greedy choice (:func:`kernels.greedy`).  The
cache of a layer is ``[capacity, kv_heads, head_dim]``, token-major, so the rows a step writes are one
contiguous slice (the kernel's output argument points into the cache: no copy per token) and the rows
attention reads are another (a size variable gives their count).  An int8 cache (``kv_cache="int8"``) holds
int8 values and a scale per token and head, written by the same kernel.  Every call is bound once
(:class:`cuvil.llm.call.Bound`); a step moves the cache slot pointers and the attended length, and runs.

A prompt is taken ``chunk`` tokens at a time; a last part shorter than the chunk runs padded (the padding
rows write cache rows past the prompt, which no query reads before a later token overwrites them), or
token by token when it is short.  The cache keeps the tokens it holds: a prompt that starts with them
(prefix caching) only runs the rest.

Sampling (temperature, top-k, top-p) draws from the logits on the host; greedy decoding picks the token
in a kernel.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cuvil.errors import ArgumentError, ShapeError
from cuvil.llm import kernels as K
from cuvil.llm.call import Bound
from cuvil.llm.weights import Q4, DecoderConfig, DecoderWeights, Dense, default_inv_freq, stack

__all__ = ["Generator", "Stats"]


def _rope_tables(cfg: DecoderConfig, n: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every position's angles [n, head_dim / 2], in float32 as Hugging Face computes them
    (a constant of the model, computed once)."""
    D = cfg.head_dim
    if cfg.rope_inv_freq is not None:
        inv = np.asarray(cfg.rope_inv_freq, np.float32)
    else:
        inv = default_inv_freq(cfg.rope_theta, D)
    ang = np.arange(n, dtype=np.float32)[:, None] * inv[None, :]
    return np.ascontiguousarray(np.cos(ang), np.float32), np.ascontiguousarray(np.sin(ang), np.float32)


@dataclass
class Stats:
    """Tokens and seconds of the last :meth:`Generator.generate` (wall time; prefill includes the first
    token's logits)."""

    prompt_tokens: int = 0
    prefill_s: float = 0.0
    new_tokens: int = 0
    decode_s: float = 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s else 0.0


class _Sequence:
    """A sequence's KV cache (per layer: ``(k, v)`` or, int8, ``(k, k_scale, v, v_scale)``) and the tokens
    it holds."""

    def __init__(self, gen: Generator):
        cfg = gen.config
        cap, G, D = gen.context + gen.chunk, cfg.kv_heads, cfg.head_dim  # room for a padded chunk's rows
        if gen.kv_cache == "int8":
            def layer() -> tuple[np.ndarray, ...]:
                return (np.zeros((cap, G, D), np.int8), np.ones((cap, G), np.float32),
                        np.zeros((cap, G, D), np.int8), np.ones((cap, G), np.float32))
        else:
            def layer() -> tuple[np.ndarray, ...]:
                return (np.zeros((cap, G, D), np.float32), np.zeros((cap, G, D), np.float32))
        self.cache = [layer() for _ in range(cfg.layers)]
        self.tokens: list[int] = []


class _Step:
    """The kernels and buffers of a step of T tokens of each of B sequences, bound once: the weight
    contractions take the B * T rows together, rotary and attention each sequence's rows and cache."""

    def __init__(self, gen: Generator, T: int, B: int = 1):
        cfg, w = gen.config, gen.weights
        H, G, D, F = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn
        self.T, self.B = T, B
        R = T * B
        f32 = np.float32
        self.ids = np.zeros(R, np.int32)
        self.x = np.zeros((R, cfg.hidden), f32)
        self.x2 = np.zeros((R, cfg.hidden), f32)
        self.h = np.zeros((R, cfg.hidden), f32)
        self.qkv = np.zeros((R, (H + 2 * G) * D), f32)
        self.q = np.zeros((R, H, D), f32)
        self.a = np.zeros((R, H * D), f32)
        self.gu = np.zeros((R, 2 * F), f32)
        self.act = np.zeros((R, F), f32)
        norm, rot = gen.kernel("rms_norm", R), gen.kernel("rotary", T)
        attn, gact = gen.kernel("attention", T), gen.kernel("gated_act", R)
        self.embed = Bound(gen.kernel("embed", R), self.ids, gen.table, self.x)
        self.rot: list[list[Bound]] = []  # [layer][sequence]
        self.attn: list[list[Bound]] = []
        self.calls: list[Callable[[], None]] = [self.embed]
        cos, sin = gen.cos[:T], gen.sin[:T]
        cache = gen.sequence.cache
        for i, layer in enumerate(w.layers):
            lin = gen.linears[i]
            rows = [slice(b * T, (b + 1) * T) for b in range(B)]
            rs = [Bound(rot, self.qkv[r], cos, sin, self.q[r], *(c[:T] for c in cache[i])) for r in rows]
            ats = [Bound(attn, self.q[r], *(c[:T] for c in cache[i]), self.a[r]) for r in rows]
            self.rot.append(rs)
            self.attn.append(ats)
            self.calls += [
                Bound(norm, self.x, layer.attn_norm, self.h),
                lin["qkv"](R).bind(self.h, self.qkv),
                *(c for pair in zip(rs, ats) for c in pair),
                lin["o"](R).bind(self.a, self.x2, self.x),
                Bound(norm, self.x2, layer.ffn_norm, self.h),
                lin["gu"](R).bind(self.h, self.gu),
                Bound(gact, self.gu, self.act),
                lin["down"](R).bind(self.act, self.x, self.x2),
            ]

    def run(self, gen: Generator, seqs: Sequence[_Sequence], positions: Sequence[int]) -> None:
        """The step for tokens ``self.ids``: sequence b's T tokens at positions ``positions[b] ..
        positions[b] + T - 1`` of its cache."""
        T = self.T
        for b, (seq, pos) in enumerate(zip(seqs, positions)):
            cos, sin = gen.cos[pos:pos + T], gen.sin[pos:pos + T]
            for i in range(len(self.rot)):
                r, a = self.rot[i][b], self.attn[i][b]
                r.point(1, cos)
                r.point(2, sin)
                for j, c in enumerate(seq.cache[i]):
                    r.point(4 + j, c[pos:pos + T])
                    a.point(1 + j, c[:T])  # (the base: the attended rows are the first pos + T)
                a.size("L", pos + T)
        for c in self.calls:
            c()


class Generator:
    """A decoder compiled for this CPU, with its KV cache: ``prefill``, ``decode``, ``generate``, ``reset``.

    ``context``: the most positions the cache holds (default: the config's ``max_context``); ``chunk``:
    the tokens a prefill step takes; ``linear``: the factory of the weight contractions (default
    :func:`cuvil.llm.qlinear.linear`); ``activations``: "int8" or "float32" for the 4-bit weights' contractions
    (default: the kernels' choice, int8 where the CPU has an exact 8-bit dot product); ``kv_cache``:
    "float32" or "int8" (a quarter of the bytes: int8 values and a float32 scale per token and head);
    ``options``: :class:`~cuvil.options.CompileOptions` for the weight contractions (``check_schedules``)."""

    def __init__(self, weights: DecoderWeights, *, context: int | None = None, chunk: int = 64,
                 target: Any = None, linear: Callable[..., Any] | None = None, activations: str | None = None,
                 kv_cache: str = "float32", options: Any = None):
        cfg = weights.config
        self.activations = activations
        self.options = options
        if kv_cache not in ("float32", "int8"):
            raise ArgumentError(f"kv_cache={kv_cache!r}: 'float32' or 'int8'")
        self.kv_cache = kv_cache
        self.config, self.weights, self.target = cfg, weights, target
        self.context = int(context or cfg.max_context)
        self.chunk = max(1, min(int(chunk), self.context))
        if linear is None:
            from cuvil.llm.qlinear import linear
        self._linear = linear
        cap = self.context + self.chunk
        self.sequence = _Sequence(self)  # the one prefill, decode and generate use
        self.cos, self.sin = _rope_tables(cfg, cap)
        self.table = self._table()
        self._kernels: dict[tuple[str, int], Any] = {}
        self._compiled: dict[tuple[int, str, int], Any] = {}
        self.linears = [self._layer_linears(i, L) for i, L in enumerate(weights.layers)]
        self._steps: dict[tuple[int, int], _Step] = {}
        self.logits = np.zeros((1, cfg.vocab), np.float32)
        self._last = np.zeros((1, cfg.hidden), np.float32)
        self._normed = np.zeros((1, cfg.hidden), np.float32)
        self._best = np.zeros(1, np.int32)
        self._head = self._make_linear(weights.head, 1, residual=False, bias=None)
        self._final = Bound(self.kernel("rms_norm", 1), self._last, weights.norm, self._normed)
        self._head_call = self._head.bind(self._normed, self.logits)
        self._greedy = Bound(K.greedy(cfg.vocab, target), self.logits, self._best)
        self.stats = Stats()

    # -- compiling ---------------------------------------------------------------------------------------

    def _table(self) -> np.ndarray:
        e = self.weights.embed
        return e.w if isinstance(e, Dense) else np.ascontiguousarray(e.dequantize(), np.float32)

    def kernel(self, name: str, T: int) -> Any:
        """The compiled kernel ``name`` of :mod:`cuvil.llm.kernels` for steps of T tokens (built once)."""
        key = (name, T)
        if key not in self._kernels:
            extra = {"kv": self.kv_cache} if name in ("rotary", "attention") else {}
            self._kernels[key] = getattr(K, name)(self.config, T, self.target, **extra)
        return self._kernels[key]

    def _layer_linears(self, i: int, L: Any) -> dict[str, Callable[[int], Any]]:
        """Per projection, a function of (T, target) giving the compiled contraction (built once per T)."""
        cfg = self.config
        qkv_bias = None
        if L.q_bias is not None or L.k_bias is not None or L.v_bias is not None:
            H, G, D = cfg.heads, cfg.kv_heads, cfg.head_dim
            z = np.zeros
            qkv_bias = np.concatenate([L.q_bias if L.q_bias is not None else z(H * D, np.float32),
                                       L.k_bias if L.k_bias is not None else z(G * D, np.float32),
                                       L.v_bias if L.v_bias is not None else z(G * D, np.float32)])
        plan = {"qkv": (stack(L.q, L.k, L.v), False, qkv_bias), "o": (L.o, True, None),
                "gu": (stack(L.gate, L.up), False, None), "down": (L.down, True, None)}

        def maker(name: str) -> Callable[[int], Any]:
            weight, residual, bias = plan[name]

            def make(T: int) -> Any:
                key = (i, name, T)
                if key not in self._compiled:
                    self._compiled[key] = self._make_linear(weight, T, residual=residual, bias=bias)
                return self._compiled[key]
            return make
        return {n: maker(n) for n in plan}

    def _make_linear(self, weight: Any, T: int, *, residual: bool, bias: np.ndarray | None) -> Any:
        extra = {"activations": self.activations} if self.activations and isinstance(weight, Q4) else {}
        if self.options is not None:  # (a linear factory written without options stays usable)
            extra["options"] = self.options
        return self._linear(weight, T, self.target, residual=residual, bias=bias, **extra)

    def compile(self) -> Generator:
        """Build the prefill and decode steps now (otherwise the first prompt builds them)."""
        self.step(self.chunk)
        self.step(1)
        return self

    def step(self, T: int, B: int = 1) -> _Step:
        if (T, B) not in self._steps:
            self._steps[T, B] = _Step(self, T, B)
        return self._steps[T, B]

    # -- running -----------------------------------------------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        """The tokens whose keys and values the cache holds, in order."""
        return self.sequence.tokens

    def reset(self) -> None:
        """Forget the cached tokens (the next prompt starts at position 0)."""
        self.sequence.tokens = []

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        out = [int(t) for t in ids]
        bad = [t for t in out if not 0 <= t < self.config.vocab]
        if bad:
            raise ArgumentError(f"token ids {bad[:5]} are outside the vocabulary (0 .. {self.config.vocab - 1})")
        return out

    def _run(self, ids: list[int], pos: int) -> None:
        """Run the tokens ``ids`` from position ``pos`` (the cache holds positions < pos) and leave the last
        token's logits in ``self.logits``."""
        if pos + len(ids) > self.context:
            raise ShapeError(f"{pos + len(ids)} tokens do not fit the context of {self.context} positions "
                             "(Generator(context=...) to make it longer)")
        C = self.chunk
        i = 0
        while i < len(ids):
            rest = len(ids) - i
            T = C if rest >= C or (C > 1 and rest * 8 >= C) else 1
            step = self.step(T)
            part = ids[i:i + T]
            step.ids[:len(part)] = part
            step.ids[len(part):] = 0
            step.run(self, [self.sequence], [pos + i])
            last = len(part) - 1
            i += len(part)
        self._last[0] = step.x[last]
        self._final()
        self._head_call()
        self.sequence.tokens = self.sequence.tokens[:pos] + ids

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Run a prompt and return the logits of its last token; the cache keeps the prompt's tokens that
        earlier calls already ran (the longest common prefix) and runs the rest."""
        ids = self._check_ids(ids)
        if not ids:
            raise ArgumentError("prefill needs at least one token")
        keep = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(ids) - 1)  # the last token runs again: its logits are the answer
        self.sequence.tokens = self.sequence.tokens[:keep]
        self._run(ids[keep:], keep)
        return self.logits[0]

    def decode(self, token: int) -> np.ndarray:
        """Run one more token after the cached ones; return its logits."""
        self._run(self._check_ids([token]), len(self.tokens))
        return self.logits[0]

    def greedy(self) -> int:
        """The token of the largest logit of the last step (chosen by a kernel)."""
        self._greedy()
        return int(self._best[0])

    def _choose(self, rng: np.random.Generator | None, temperature: float, top_k: int, top_p: float,
                logits: np.ndarray | None = None, greedy: Callable[[], int] | None = None) -> int:
        if rng is None:
            return (greedy or self.greedy)()
        z = (self.logits[0] if logits is None else logits).astype(np.float64) / temperature
        if 0 < top_k < z.size:
            cut = np.partition(z, -top_k)[-top_k]
            z = np.where(z >= cut, z, -np.inf)
        p = np.exp(z - z.max())
        p /= p.sum()
        if top_p < 1.0:
            order = np.argsort(-p)
            keep = np.cumsum(p[order]) - p[order] < top_p
            mask = np.zeros_like(p, bool)
            mask[order[keep]] = True
            p = np.where(mask, p, 0.0)
            p /= p.sum()
        return int(rng.choice(p.size, p=p))

    def generate(self, ids: Sequence[int], max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop: Sequence[int] | None = None) -> Iterator[int]:
        """Yield up to ``max_new_tokens`` tokens after the prompt ``ids`` as they come: greedy when
        ``temperature`` is 0, else sampled (top-k, then top-p) with ``seed``; ``stop`` tokens (default:
        the model's end-of-sequence ids) end the generation after being yielded."""
        stops = set(self.config.eos if stop is None else stop)
        rng = None if temperature <= 0 else np.random.default_rng(seed)
        self.stats = Stats(prompt_tokens=len(ids))
        t0 = time.perf_counter()
        self.prefill(ids)
        tok = self._choose(rng, temperature, top_k, top_p)
        self.stats.prefill_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        for n in range(max_new_tokens):
            yield tok
            if tok in stops or n == max_new_tokens - 1:
                break
            if len(self.tokens) >= self.context:
                break
            self.decode(tok)
            tok = self._choose(rng, temperature, top_k, top_p)
            self.stats.new_tokens = n + 1
            self.stats.decode_s = time.perf_counter() - t1

    # -- batches -----------------------------------------------------------------------------------------

    def _batch_head(self, step: _Step) -> tuple[np.ndarray, list[Callable[[], int]], Callable[[], None]]:
        """For a decode step of B sequences: the logits [B, vocab], a greedy choice per row, and the call
        that fills the logits (final norm and head over the B rows)."""
        B = step.B
        key = ("head", B)
        if key not in self._kernels:
            cfg = self.config
            normed = np.zeros((B, cfg.hidden), np.float32)
            logits = np.zeros((B, cfg.vocab), np.float32)
            best = np.zeros((B, 1), np.int32)
            norm = Bound(self.kernel("rms_norm", B), step.x, self.weights.norm, normed)
            head = self._make_linear(self.weights.head, B, residual=False, bias=None).bind(normed, logits)
            pick = self._greedy.module

            def chooser(b: int) -> Callable[[], int]:
                bound = Bound(pick, logits[b:b + 1], best[b])

                def choose() -> int:
                    bound()
                    return int(best[b, 0])
                return choose

            def fill() -> None:
                norm()
                head()
            self._kernels[key] = (logits, [chooser(b) for b in range(B)], fill)
        return self._kernels[key]

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32, temperature: float = 0.0,
                       top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                       stop: Sequence[int] | None = None) -> list[list[int]]:
        """New tokens for several prompts of any lengths: each prompt is prefilled into a cache of its own,
        then every decode step takes one token of each sequence (the weight contractions read the weights
        once for all of them).  A sequence that stopped (``stop`` tokens, as :meth:`generate`) still fills
        its row (padding) until all have; its list ends at its stop token."""
        if not prompts:
            return []
        stops = set(self.config.eos if stop is None else stop)
        rng = None if temperature <= 0 else np.random.default_rng(seed)
        B = len(prompts)
        mine = self.sequence
        seqs = [_Sequence(self) for _ in range(B)]
        out: list[list[int]] = []
        try:
            for seq, ids in zip(seqs, prompts):
                self.sequence = seq
                self.prefill(ids)
                out.append([self._choose(rng, temperature, top_k, top_p)])
        finally:
            self.sequence = mine
        done = [o[-1] in stops or max_new_tokens <= 1 for o in out]
        if max_new_tokens < 1:
            return [[] for _ in out]
        if all(done):
            return out
        step = self.step(1, B)
        logits, choose, fill = self._batch_head(step)
        for _ in range(max_new_tokens - 1):
            positions = [len(seq.tokens) for seq in seqs]
            if max(positions) >= self.context:
                break
            step.ids[:] = [o[-1] for o in out]
            step.run(self, seqs, positions)
            fill()
            for b, seq in enumerate(seqs):
                seq.tokens.append(int(step.ids[b]))
                tok = self._choose(rng, temperature, top_k, top_p, logits[b], choose[b])
                if not done[b]:
                    out[b].append(tok)
                    done[b] = tok in stops or len(out[b]) >= max_new_tokens
            if all(done):
                break
        return out
