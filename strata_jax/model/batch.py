"""BatchSession: continuous batching over one Model, with a KV-cache row per request slot.

The session's KV cache has N rows. A request is admitted into a free row and prefilled alone there;
then every decode step runs all N rows at once, with fixed shapes, so admitting and finishing requests
between steps never recompiles. Rows without a request are computed too (at an out-of-range position,
so they never write the cache) and their tokens ignored; with an offloaded MoE their routing also
counts as expert lookups. MoE layers see N tokens per decode step: while N * k <= n_experts they take
the few-token path, which fetches each expert the batch routes to once, shared by all rows.

Per-conversation prefix cache: a row keeps its last request's tokens (prompt and the generated tokens
fed back) after it finishes, so the conversation's next turn, whose prompt starts with them, prefills
only its new tokens. A new request goes to a free row whose whole cache is a prefix of its prompt if
there is one (the longest; an empty row counts, so a new conversation does not evict another's cache
while a row is unused); else to the free row sharing the longest prefix with the prompt if that covers
at least half of it (llama.cpp's --slot-prompt-similarity); else to the least recently used free row.
So at most N conversations keep their cache: the bound is the number of rows, as with llama.cpp's slots.

Each row samples with its own key folded with its own step count, exactly as Model does for one
request, so a seeded request gives the same tokens alone or batched. Each row's penalty state (token
counts and repeat window, sampling.py) is a row of one device array the decode step carries and updates;
admitting a request writes its row. Logprobs are computed for the whole batch in a step where any row
asked for them, and read back only then.

Shape legend: N rows (the forward pass's B), T tokens per prefill chunk, V vocab, L layers, S cache
length, K kv heads, Dh head dim, M MoE layers, k experts per token, W repeat window.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.core.errors import ConfigError
from strata_jax.core.experts import join_provider, split_provider
from strata_jax.model.decode import STEP_DONATE, STEP_STATIC
from strata_jax.model.forward import KVCache, forward
from strata_jax.model.model import (Model, _common_prefix, _first_token, attn_bucket, bucket, check_request,
                                    logprob_count)
from strata_jax.model.streaming import GenerationChunk, TextStream, TokenLogprob, request_timings, token_logprob
from strata_jax.model.sampling import PenaltyState, SamplingParams, next_token, sample_rows
from strata_jax.core.units import fmt_bytes

log = logging.getLogger("strata_jax")

SIMILARITY = 0.5  # share of a prompt a row's cached prefix must cover to be chosen over the LRU row


@functools.partial(jax.jit, static_argnames=STEP_STATIC, donate_argnames=STEP_DONATE)
def _prefill_row(params, experts, fixed, kv, row, tokens_1T, start_1, n_valid_1, *, cfg, dtype, kernels, attn_len):
    """One prefill chunk of one row: the row is sliced out of the donated cache, run at batch 1 (the
    same program shape as Model's prefill) and written back in place."""
    take = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=row, slice_size=1, axis=1)
    row_kv = KVCache(take(kv.k_LBSKDh), take(kv.v_LBSKDh))
    logits_1V, row_kv, experts, routed = forward(params, join_provider(experts, fixed), row_kv, tokens_1T, start_1,
                                                 n_valid_1, cfg=cfg, dtype=dtype, kernels=kernels, attn_len=attn_len)
    put = functools.partial(jax.lax.dynamic_update_slice_in_dim, start_index=row, axis=1)
    kv = KVCache(put(kv.k_LBSKDh, row_kv.k_LBSKDh), put(kv.v_LBSKDh, row_kv.v_LBSKDh))
    return logits_1V, kv, split_provider(experts)[0], routed


@functools.partial(jax.jit, static_argnames=STEP_STATIC, donate_argnames=STEP_DONATE + ("pen",))
def _decode_rows(params, experts, fixed, kv, tokens_N, start_N, keys_N2, steps_N, sp, pen, want_logprobs, *, cfg, dtype,
                 kernels, attn_len):
    logits_NV, kv, experts, routed = forward(params, join_provider(experts, fixed), kv, tokens_N[:, None], start_N,
                                             jnp.ones_like(start_N), cfg=cfg, dtype=dtype, kernels=kernels,
                                             attn_len=attn_len)
    keys_N2 = jax.vmap(jax.random.fold_in)(keys_N2, steps_N)
    active_N = start_N < kv.k_LBSKDh.shape[2]  # idle rows run at an out-of-range position; keep their state
    out = next_token(logits_NV, lambda l: sample_rows(l, keys_N2, sp), sp, pen, want_logprobs, active_N)
    return out, kv, split_provider(experts)[0], routed


@functools.partial(jax.jit, donate_argnames=("pen_N",))
def _put_row(pen_N, row, pen_1):
    """Write a request's penalty state (batch 1, after its first token) into its row."""
    return jax.tree.map(lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b, row, axis=0), pen_N, pen_1)


@dataclasses.dataclass(eq=False)
class _Seq:
    """One request in a row: its text stream and the state Model.generate_stream keeps in locals."""

    ids: list[int]
    stream: TextStream
    n_cached: int
    t0: float
    fed: list[int]  # tokens written to the row's cache, from position 0 (the next one goes at len(fed))
    tok: int  # sampled and not yet taken in by push()
    n_top: int | None = None  # alternatives per token's logprobs; None: the request wants no logprobs
    tok_lp: TokenLogprob | None = None  # tok's logprobs (offset not yet known)
    t_prefill: float = 0.0
    t1: float = 0.0
    t_steady: float = 0.0

    @property
    def generated(self) -> list[int]:
        return self.stream.generated

    def push(self, stop_ids) -> tuple[list[GenerationChunk], str | None]:
        """Take in the sampled token (see TextStream.push)."""
        return self.stream.push(self.tok, stop_ids, self.tok_lp)

    def final(self, finish: str) -> GenerationChunk:
        # decode time includes the prefills of requests admitted meanwhile
        timings = request_timings(len(self.ids) - self.n_cached, self.n_cached, self.t_prefill, len(self.generated),
                                  self.t1, self.t_steady, time.perf_counter())
        return self.stream.last(finish, timings, self.ids)


class BatchSession:
    """N request slots over one Model. Not thread-safe: one thread admits, steps and releases.

        s = BatchSession(model, 4)
        row, chunks = s.admit(ids, max_tokens=64, temperature=0)   # prefill; chunks of the first token
        while s.active_rows:
            for row, chunks in s.step().items(): ...               # one token for every active row

    A chunk with finish_reason set is a request's last; its row is free from then on.
    """

    def __init__(self, model: Model, n_rows: int):
        if isinstance(n_rows, bool) or not isinstance(n_rows, int) or n_rows < 1:
            raise ConfigError(f"a batch needs at least one row; got {n_rows!r}.")
        self.model, self.n_rows = model, n_rows
        # the single-request cache is not used alongside a session: free its memory for the rows
        model._kv, model._kv_tokens = None, []
        self._kv: KVCache | None = None  # allocated at the first step
        self._seqs: list[_Seq | None] = [None] * n_rows
        self._cached: list[list[int]] = [[] for _ in range(n_rows)]  # a free row's tokens, from position 0
        self._used = [0] * n_rows  # last use, for least-recently-used choice
        self._clock = 0
        self._keys_N2 = np.zeros((n_rows, 2), np.uint32)
        proto = SamplingParams.make(1)
        self._sp_host = {f.name: np.zeros(n_rows, getattr(proto, f.name).dtype) for f in dataclasses.fields(proto)}
        self._sp: SamplingParams | None = None  # device copy of the rows' sampling parameters; None: stale
        self._keys: jax.Array | None = None
        self._pen: PenaltyState | None = None  # the rows' penalty state, on the device (allocated at the first admit)
        cfg = model.config
        kv_bytes = 2 * cfg.n_layers * n_rows * model.ctx * cfg.kv_dim * jnp.dtype(model.dtype).itemsize
        log.info("batched decode: %d rows of %d tokens (KV cache %s)", n_rows, model.ctx, fmt_bytes(kv_bytes))
        e = model.experts
        need = min(n_rows * cfg.n_experts_used, cfg.n_experts)
        if e is not None and not e.plan.resident and min(e.plan.slots_per_pool) < need:
            raise ConfigError(
                f"{n_rows} rows can route {need} distinct experts per layer in one decode step, but an expert "
                f"pool holds only {min(e.plan.slots_per_pool)} slots ({e.expert_pools} pools); load the model "
                f"with parallel={n_rows} (pools are then sized for it), more expert_slots, or expert_pools='shared'.")
        if cfg.is_moe and n_rows * cfg.n_experts_used > cfg.n_experts:
            log.warning("%d rows x %d experts per token exceed the %d experts: decode steps take the many-token "
                        "MoE path (every expert computed%s); use fewer rows", n_rows, cfg.n_experts_used,
                        cfg.n_experts, ", and streamed from the host when offloading" if model.experts and
                        not model.experts.plan.resident else "")

    # -- state ------------------------------------------------------------------------------------
    @property
    def active_rows(self) -> list[int]:
        return [r for r, s in enumerate(self._seqs) if s is not None]

    @property
    def free_rows(self) -> int:
        return sum(s is None for s in self._seqs)

    def cached_tokens(self, row: int) -> list[int]:
        """The tokens row `row` holds from position 0 (for an active row: the ones written so far)."""
        s = self._seqs[row]
        return list(s.fed if s is not None else self._cached[row])

    def tokens_held(self) -> int:
        """Tokens in the KV cache over all rows (what the rows' caches hold, active or kept for reuse)."""
        return sum(len(s.fed) if s is not None else len(c) for s, c in zip(self._seqs, self._cached))

    def generated(self, row: int) -> int:
        s = self._seqs[row]
        return len(s.generated) if s is not None else 0

    # -- requests -----------------------------------------------------------------------------------
    def admit(self, prompt: str | Sequence[dict] | Sequence[int], *, max_tokens: int = 256, temperature: float = 0.8,
              top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05, seed: int | None = None,
              stop: str | Sequence[str] | None = None, cache_prompt: bool = True, presence_penalty: float = 0.0,
              frequency_penalty: float = 0.0, repeat_penalty: float = 1.0, repeat_last_n: int = 64,
              logprobs: bool = False, top_logprobs: int = 0, **template_kwargs) -> tuple[int, list[GenerationChunk]]:
        """Prefill a request into a free row and sample its first token; arguments as for
        Model.generate_stream. Returns the row and the chunks of that first token (ending with the final
        chunk if the request is already done, and then the row is free again)."""
        m = self.model
        penalties = dict(presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                         repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n)
        stops = check_request(max_tokens, stop, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                              **penalties)
        n_top = logprob_count(logprobs, top_logprobs)
        ids = m.prompt_tokens(prompt, **template_kwargs)
        m._check_len(len(ids) + 1)
        if not self.free_rows:
            raise ConfigError(f"all {self.n_rows} rows are busy: admit after a request finishes or is released.")
        row = self._pick_row(ids, cache_prompt)
        n_cached = _common_prefix(ids, self._cached[row]) if cache_prompt else 0
        n_cached = min(n_cached, len(ids) - 1)  # at least one token must run to give the next-token logits
        key = jax.random.PRNGKey(seed if seed is not None else time.time_ns() % (2**31))
        sp = SamplingParams.make(1, temperature, top_p, top_k, min_p, **penalties)
        self._touch(row)
        t0 = time.perf_counter()
        self._cached[row] = []  # being rewritten: nothing in it is reusable until the prefill returns
        last_logits = self._prefill(row, ids, n_cached)
        tok_1, pen_1, lp = _first_token(last_logits, jax.random.fold_in(key, 0), sp, PenaltyState.window(ids),
                                        np.bool_(n_top is not None))
        if self._pen is None:  # committed to the device as the steps' outputs are, or _put_row compiles twice
            self._pen = jax.device_put(jax.tree.map(lambda a: np.zeros((self.n_rows, *a.shape[1:]), a.dtype), pen_1),
                                       m.device)
        self._pen = _put_row(self._pen, np.int32(row), pen_1)
        tok = int(tok_1[0])
        self._note_steps(time.perf_counter() - t0, -(-(len(ids) - n_cached) // m.prefill_chunk))
        stream = TextStream(stops, min(max_tokens, m.ctx - len(ids)), m.tokenizer.stream_decoder(), n_top is not None)
        seq = _Seq(list(ids), stream, n_cached, t0, list(ids), tok, n_top,
                   token_logprob(jax.device_get(lp), 0, tok, n_top, 0) if n_top is not None else None)
        seq.t_prefill = time.perf_counter() - t0
        seq.t1 = seq.t_steady = time.perf_counter()
        self._seqs[row] = seq
        self._keys_N2[row] = np.asarray(key)
        for f in dataclasses.fields(SamplingParams):
            self._sp_host[f.name][row] = np.asarray(getattr(sp, f.name))[0]
        self._sp = self._keys = None
        return row, self._advance(row)

    def step(self) -> dict[int, list[GenerationChunk]]:
        """One decode step for every active row: {row: the chunks its new token gave}."""
        rows = self.active_rows
        if not rows:
            return {}
        m, N = self.model, self.n_rows
        tokens_N = np.zeros(N, np.int32)
        start_N = np.full(N, m.ctx, np.int32)  # idle rows: out of range, so their cache writes are dropped
        steps_N = np.zeros(N, np.int32)
        for r in rows:
            s = self._seqs[r]
            tokens_N[r], start_N[r], steps_N[r] = s.tok, len(s.fed), len(s.generated)
        t0 = time.perf_counter()
        if self._sp is None:
            self._sp = SamplingParams(**{k: jnp.asarray(v.copy()) for k, v in self._sp_host.items()})
            self._keys = jnp.asarray(self._keys_N2.copy())
        want = any(self._seqs[r].n_top is not None for r in rows)
        pen, self._pen = self._pen, None
        try:
            (toks_N, pen, lp), routed = self._call(_decode_rows, tokens_N, start_N, self._keys, steps_N, self._sp, pen,
                                                   np.bool_(want), end=int(start_N[rows].max()) + 1)
            toks_N = np.asarray(toks_N)
            lp = jax.device_get(lp) if want else None
        except BaseException:
            if not any(a.is_deleted() for a in jax.tree.leaves(pen)):
                self._pen = pen  # the step failed before it ran: the other rows' state is intact
            for r in rows:  # the step did not happen: every active request ends here
                self._end(r)
            raise
        self._pen = pen
        self._note_steps(time.perf_counter() - t0, 1)
        if m._routing is not None:
            m._routing.append(np.asarray(routed)[:, rows].transpose(1, 0, 2))
        now = time.perf_counter()
        out = {}
        for r in rows:
            s = self._seqs[r]
            s.fed.append(s.tok)
            s.tok = int(toks_N[r])
            s.tok_lp = token_logprob(lp, r, s.tok, s.n_top, 0) if s.n_top is not None else None
            if len(s.generated) == 1:  # steady-state decode speed starts after the first step, as in Model
                s.t_steady = now
            out[r] = self._advance(r)
        return out

    def release(self, row: int) -> int:
        """End the request in `row` now (a cancelled request): the row is free and keeps what it has
        written for prefix reuse. Returns how many tokens the request had generated."""
        n = self.generated(row)
        self._end(row)
        return n

    # -- internals ------------------------------------------------------------------------------------
    def _pick_row(self, ids: list[int], cache_prompt: bool) -> int:
        free = [r for r in range(self.n_rows) if self._seqs[r] is None]
        shared = {r: _common_prefix(ids, self._cached[r]) if cache_prompt else 0 for r in free}
        by_reuse = lambda r: (shared[r], -self._used[r])  # noqa: E731 - ties go to the least recently used
        lossless = [r for r in free if shared[r] == len(self._cached[r])]  # taking it discards nothing
        if lossless:
            return max(lossless, key=by_reuse)
        best = max(free, key=by_reuse)
        return best if shared[best] >= SIMILARITY * len(ids) else min(free, key=self._used.__getitem__)

    def _note_steps(self, seconds: float, n: int) -> None:
        if self.model.experts is not None:  # the expert cache's bandwidth and stall telemetry
            self.model.experts.note_steps(seconds, n)

    def _touch(self, row: int) -> None:
        self._clock += 1
        self._used[row] = self._clock

    def _advance(self, row: int) -> list[GenerationChunk]:
        s = self._seqs[row]
        chunks, finish = s.push(self.model.tokenizer.stop_ids)
        if finish is not None:
            chunks.append(s.final(finish))
            self._end(row)
        return chunks

    def _end(self, row: int) -> None:
        s = self._seqs[row]
        if s is not None:
            self._cached[row] = s.fed if self._kv is not None else []
            self._seqs[row] = None
            self._touch(row)

    def _prefill(self, row: int, ids: list[int], start: int) -> jax.Array:
        """Prefill ids[start:] into `row` at positions start.. (ids[:start] are already there); returns
        the last token's logits [1, V]."""
        m, pos, logits = self.model, start, None
        while pos < len(ids):
            chunk = ids[pos : pos + m.prefill_chunk]
            T = bucket(len(chunk), m.prefill_chunk)
            toks = np.zeros((1, T), np.int32)
            toks[0, : len(chunk)] = chunk
            logits, routed = self._call(_prefill_row, np.int32(row), toks, np.array([pos], np.int32),
                                        np.array([len(chunk)], np.int32), end=pos + T)
            m._record(routed, len(chunk))
            pos += len(chunk)
        return logits

    def _call(self, fn, *args, end: int):
        """One jitted step over the donated state, threaded as Model._step does; end: one past the
        furthest cache position written (sizes the attention span)."""
        m, e = self.model, self.model.experts
        kv, self._kv = self._kv, None
        if kv is None:
            kv = KVCache.zeros(m.config, self.n_rows, m.ctx, m.dtype, m.device)
        experts, fixed = split_provider(e.take() if e is not None else None)  # only `experts` is donated
        try:
            out, kv_out, experts_out, routed = fn(m.params, experts, fixed, kv, *args, cfg=m.config, dtype=m.dtype,
                                                  kernels=m.kernels, attn_len=attn_bucket(end, m.ctx))
        except BaseException:
            # a step that failed before it ran leaves its donated inputs intact; one that ran consumed them
            if e is not None:
                e.put(join_provider(experts, fixed))
            if not any(a.is_deleted() for a in jax.tree.leaves(kv)):
                self._kv = kv
            else:  # every row's cache is gone, and with it every request in flight
                self._cached = [[] for _ in range(self.n_rows)]
                self._seqs = [None] * self.n_rows
            raise
        if e is not None:
            e.put(join_provider(experts_out, fixed))
        self._kv = kv_out
        return out, routed
