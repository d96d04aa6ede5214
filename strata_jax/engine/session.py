"""Session: B rows of KV cache and decode state over one Model, driving engine/programs.py's two programs.

`Model.generate_stream` is a one-row session; `serve --parallel N` runs one session of N rows. A
request is admitted into a free row and prefilled there alone (its first token is sampled by the same
program); then every `step` decodes up to `decode_chunk` tokens for all rows at once in one jitted call
whose shapes never change, so admitting and finishing requests never recompiles. One call is kept
queued ahead of the host: call c+1 is dispatched on call c's device state before the host waits for
call c's tokens, so the device does not idle while the host reads tokens or launches.

Each row keeps its last request's tokens after it finishes (the conversation's prefix for its next
turn). A new request goes to a free row whose whole cache is a prefix of its prompt (the longest; an
empty row counts), else to the free row sharing the longest prefix if that covers at least half the
prompt (llama.cpp's --slot-prompt-similarity), else to the least recently used free row. With the
model's conversation cache (engine/convcache.py, --conversation-cache-mib), a row's conversation goes to
host RAM before its row is overwritten, and comes back into a row for a prompt that continues it. A
recurrent state cannot be rewound, so for those models a row also keeps host copies of its state where its
last prompt's new tokens began and where the prompt ended: a regenerated or edited last message continues
from the first, a re-rendered reply from the second (both go to the conversation cache with the row).

Each row samples with its own key folded with its own step count, so a seeded request gives the same
tokens alone or batched. Rows without a request are computed too (fixed shapes) at an out-of-range
position, where they neither write the cache nor look experts up (forward). MoE layers see B tokens
per decode step: while B * k <= n_experts they take the few-token path, which fetches each expert
the batch routes to once, shared by all rows.

A request with a grammar (engine/constrained.py) gets its next token's mask from the host after each
sampled token: it joins a decode call only when its previous tokens have arrived, for the tokens the
grammar forces (fed without sampling, up to a chunk) and one masked sampled step (a capped row in
engine/programs.py), while the other rows keep their chunks, and while one runs no call is queued ahead;
its first token is masked in the prefill.

Speculative decoding (EngineConfig.spec "lookup", "mtp" or "draft:PATH", or Model.use_drafter's callable;
one-row sessions): a request's step drafts up to spec_max tokens (fewer while its passes accept few:
lookup.Acceptance) by prompt lookup (engine/lookup.py), the model's MTP block (model/mtp.py: its cache is a
part of the rows' cache, KVCache.mtp, that every program keeps up) or a draft model's greedy decode
(engine/draft.py) and verifies them in one multi-token pass of its row (engine/programs.py verify). Each
position's token is drawn on the device as plain decode draws it (same processed distribution, penalties
included, same key and step); drafts are accepted while they
equal those draws, plus the token drawn after them. For a deterministic drafter that is speculative
sampling's rejection rule (accept with probability p(d), else draw from the residual), so sampled
output keeps the target distribution, and greedy output is plain greedy decode's very tokens: several
per pass, their expert fetches shared. Without a match, or while the row's recent acceptance is low,
the step is a plain decode call. A constrained request decodes without speculation. A row that
speculates takes no call queued ahead (its drafts need the tokens before).

Shape legend: strata_jax/core/shapes.py (here N: the steps of a decode chunk).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.core.errors import ConfigError
from strata_jax.core.experts import join_provider, split_provider
from strata_jax.core.units import fmt_bytes
from strata_jax.model import kvquant, mtp
from strata_jax.model.forward import KVCache
from strata_jax.model.memory import kv_cache_bytes
from strata_jax.engine import compiling, programs
from strata_jax.engine.config import MIN_PREFILL_CHUNK, xla_options_from_env
from strata_jax.engine.constrained import Constraint
from strata_jax.engine.convcache import common_prefix, padded
from strata_jax.engine.lookup import Acceptance, lookup_draft
from strata_jax.engine.sampling import (GREEDY, REPEAT_WINDOW, TOP_LOGPROBS, PenaltyState, SamplingMode,
                                       SamplingParams, allowed_mask, token_logprobs, validate_sampling)
from strata_jax.engine.streaming import (GenerationChunk, TextStream, TokenLogprob, kv_cells, request_timings,
                                        token_logprob)

log = logging.getLogger("strata_jax")

SIMILARITY = 0.5  # share of a prompt a row's cached prefix must cover to be chosen over the LRU row
MIN_ATTN_BUCKET = 256  # static attention spans are powers of two from here
ATTN_BLOCK = 1024  # cache positions per step of blocked attention (model/layers/attention.py attend_blocked)
DECODE_STATIC_SPAN = 4096  # decode reads static spans up to here (no loop in a short step), then blocks
QUEUED = 2  # decode calls in flight: the one the host waits for and one queued behind it

_take_row = jax.jit(lambda kv, row: kv.take_row(row))  # a row's cache, to spill it
_put_row = jax.jit(lambda kv, row, one: kv.put_row(row, one), donate_argnums=0)  # in place


def _put_others(kv: KVCache, row, one: KVCache) -> KVCache:
    """kv with row `row` of all but K and V (a streamed cache's: kvquant.put_logical_row) from `one`."""
    rest = kv.replace(k_LBSKDh=None, v_LBSKDh=None).put_row(row, one)
    return rest.replace(k_LBSKDh=kv.k_LBSKDh, v_LBSKDh=kv.v_LBSKDh)


_put_rest = jax.jit(_put_others, donate_argnums=0)  # in place


def _state(kv: KVCache) -> KVCache:
    """What of a cache is not by position: the recurrent state and the MTP block's kept hidden state."""
    return KVCache(None, None, kv.rec, None if kv.mtp is None else mtp.MTPState(None, kv.mtp.h_1BD))


def _with_state(kv: KVCache, state: KVCache) -> KVCache:
    """kv with `state` (a _state of the same batch) in place of its own."""
    return dataclasses.replace(kv, rec=state.rec, mtp=None if kv.mtp is None else kv.mtp.replace(h_1BD=state.mtp.h_1BD))


_prompt_scores = jax.jit(token_logprobs)  # [T, V] logits, the next tokens [T] -> their Logprobs (echo's scores)
_take_rec = jax.jit(lambda kv, row: _state(kv).take_row(row))  # a row's state that cannot be rewound
# only that state, in place: put_row over a cache of the state alone
_put_rec = jax.jit(lambda kv, row, st: _with_state(kv, _state(kv).put_row(row, st)), donate_argnums=0)


def attn_bucket(end: int, ctx: int) -> int:
    """Cache positions attention reads when the furthest position written is end - 1."""
    return min(max(MIN_ATTN_BUCKET, 1 << (max(end, 1) - 1).bit_length()), ctx)


def attn_span(end: int, ctx: int, prefill: bool, blocked_ok: bool = True) -> dict[str, int | None]:
    """The programs' attention arguments (attn_len, attn_block) for a call whose furthest position
    written is end - 1. Every span a static bucket would be its own program of the whole model, so a
    prefill chunk attends in blocks (one program per token bucket, whatever the span) and so does
    decode past DECODE_STATIC_SPAN; a short decode step keeps its static span (a loop there adds
    kernels to every layer of a launch-bound step). blocked_ok False (QSA models: the indexer's mask
    spans attn_len): static spans throughout."""
    static = attn_bucket(end, ctx)
    if blocked_ok and (prefill or static > DECODE_STATIC_SPAN):
        return {"attn_len": ctx, "attn_block": ATTN_BLOCK}
    return {"attn_len": static, "attn_block": None}


def bucket(n: int, max_chunk: int) -> int:
    """Power-of-two token bucket for a chunk of n tokens, so prefill compiles O(log n) shapes."""
    return min(max(MIN_PREFILL_CHUNK, 1 << (max(n, 1) - 1).bit_length()), max_chunk)


def check_request(max_tokens, stop, **sampling) -> list[str]:
    """Reject invalid generation limits and sampling values; returns the stop strings as a list."""
    validate_sampling(**sampling)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ConfigError(f"max_tokens={max_tokens!r} is invalid: give an integer >= 1.")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(s, str) or not s for s in stops):
        raise ConfigError("stop must be a non-empty string or a list of non-empty strings.")
    return stops


def logprob_count(logprobs, top_logprobs) -> int | None:
    """How many alternatives each token's logprobs carry, or None when the request wants no logprobs."""
    if not isinstance(logprobs, (bool, np.bool_)):
        raise ConfigError(f"logprobs={logprobs!r} is invalid: give True or False.")
    if (isinstance(top_logprobs, bool) or not isinstance(top_logprobs, (int, np.integer))
            or not 0 <= top_logprobs <= TOP_LOGPROBS):
        raise ConfigError(f"top_logprobs={top_logprobs!r} is invalid: give an integer in [0, {TOP_LOGPROBS}].")
    return int(top_logprobs) if logprobs or top_logprobs else None


class HostTiming:
    """Where the host spends decode time: inside the jitted calls (tracing aside, the launch: argument
    handling and XLA's kernel or CUDA-graph submission) and blocked on the sampled tokens, per decode
    step. With a call queued ahead, dispatch time near the step time means the host sets the pace."""

    def __init__(self):
        self.steps, self.chunks, self.dispatch_s, self.wait_s = 0, 0, 0.0, 0.0

    def dispatch(self, seconds: float) -> None:
        self.chunks += 1
        self.dispatch_s += seconds

    def wait(self, seconds: float, steps: int) -> None:
        self.wait_s += seconds
        self.steps += steps

    def summary(self) -> dict[str, float | int | None]:
        per = (lambda s: 1e3 * s / self.steps) if self.steps else (lambda s: None)  # noqa: E731
        return {"decode_steps": self.steps, "decode_calls": self.chunks,
                "dispatch_ms_per_step": per(self.dispatch_s), "wait_ms_per_step": per(self.wait_s)}


@dataclasses.dataclass(eq=False)
class _Request:
    """One request in a row: its text stream and the host's view of its progress."""

    ids: list[int]  # the prompt
    stream: TextStream
    n_cached: int
    mode: SamplingMode
    n_top: int | None  # alternatives per token's logprobs; None: no logprobs
    max_tokens: int  # capped by what the context has left
    t0: float
    fed: list[int]  # tokens written to the row's cache, from position 0
    last: int  # the latest sampled token, not yet fed back
    planned: int = 1  # tokens once the dispatched calls have run in full (the prefill's first included)
    constraint: Constraint | None = None  # its grammar's state, None when unconstrained
    in_flight: int = 0  # dispatched calls whose tokens have not been read (a constrained row waits for 0)
    spec: Acceptance | None = None  # its speculative decoding's recent acceptance; None: it does not speculate
    draft_n: int = 0  # tokens drafted for it (llama.cpp's names) ...
    draft_n_accepted: int = 0  # ... and how many of them the verify passes accepted
    draft_passes: int = 0  # verify passes run for it (tokens per pass: (accepted + passes) / passes)
    next_drafts: tuple[int, list[int]] | None = None  # MTP drafts a pass made for the next: (position, tokens)
    spec_on: bool = False  # the session speculates: its timings report the draft counts
    spec_max: int = 0  # drafted tokens per verify pass at most: the session's, or fewer if the request asks
    kv_resident: int | None = None  # --kv-resident: its timings report the KV cells read from VRAM
    t_prefill: float = 0.0
    t1: float = 0.0
    t_steady: float = 0.0

    @property
    def generated(self) -> list[int]:
        return self.stream.generated

    def final(self, finish: str) -> GenerationChunk:
        # decode time includes the prefills of requests admitted meanwhile
        timings = request_timings(len(self.ids) - self.n_cached, self.n_cached, self.t_prefill, len(self.generated),
                                  self.t1, self.t_steady, time.perf_counter(), n_before_steady=1)
        if self.spec_on:
            timings.update(draft_n=self.draft_n, draft_n_accepted=self.draft_n_accepted, draft_passes=self.draft_passes)
        if self.kv_resident is not None:
            cells, near = kv_cells(self.n_cached, len(self.fed), self.kv_resident)
            timings.update(kv_cells=cells, kv_cells_vram=near, kv_vram_hit=near / cells if cells else 1.0)
        return self.stream.last(finish, timings, self.ids)


@dataclasses.dataclass
class _Pending:
    out: programs.ChunkOut
    owners: list[_Request | None]  # each row's request when the call was dispatched


class Session:
    """B request rows over one Model. Not thread-safe: one thread admits, steps and releases.

        s = Session(model, 4)
        row, chunks = s.admit(ids, max_tokens=64, temperature=0)   # prefill; chunks of the first token
        while s.active_rows:
            for row, chunks in s.step().items(): ...               # tokens for every active row

    A chunk with finish_reason set is a request's last; its row is free from then on.
    """

    def __init__(self, model, n_rows: int, *, decode_chunk: int | None = None):
        if isinstance(n_rows, bool) or not isinstance(n_rows, int) or n_rows < 1:
            raise ConfigError(f"a session needs at least one row; got {n_rows!r}.")
        self.model, self.n_rows = model, n_rows
        self.decode_chunk = decode_chunk or model.decode_chunk
        self._decode = programs.decode_program(xla_options_from_env())
        self._prefill_fn = programs.prefill_program(xla_options_from_env("prefill"))
        self._conv = model.conversation_cache  # None: no conversation cache
        model._adopt(self)
        self._kv: KVCache | None = None  # allocated at the first call
        self._kv_host: tuple | None = None  # a streamed cache's host part (--kv-resident: KVCache.split_host)
        self._made: set = set()  # the programs calls made (_program_key)
        self._beside: tuple[Any, threading.Thread] | None = None  # a program compiling on a thread
        self._rows: programs.RowState | None = None
        self._reqs: list[_Request | None] = [None] * n_rows
        self._cached: list[list[int]] = [[] for _ in range(n_rows)]  # a free row's tokens, from position 0
        # recurrent models: each row's kept states (tokens, host copy of the row's recurrent state after
        # them), valid while the row's cache below that position is untouched: where its last prompt's
        # prefill started (the turn's start: an edited or regenerated last message continues from there)
        # and where it ended
        self._snaps: list[list[tuple[tuple[int, ...], Any]]] = [[] for _ in range(n_rows)]
        self._used = [0] * n_rows  # last use, for least-recently-used choice
        self._clock = 0
        self._pending: collections.deque[_Pending] = collections.deque()
        self._t_last = 0.0  # when the previous call's tokens arrived (telemetry: seconds per step)
        self._stops: tuple[frozenset, jax.Array] | None = None
        cfg = model.config
        ec = model.engine_config
        self.spec, self.spec_max = model.spec, model.spec_max
        if self.spec is not None and n_rows > 1:
            log.warning("spec=%r ignored: speculative decoding runs on one-row sessions only (parallel 1), this one "
                        "has %d rows", self.spec, n_rows)
            self.spec = None
        elif self.spec is not None:
            log.info("speculative decoding: %s drafts, up to %d per verify pass, for unconstrained requests", self.spec,
                     self.spec_max)
        if n_rows > 1:
            kv_bytes = kv_cache_bytes(cfg, model.ctx, n_rows, jnp.dtype(model.dtype).itemsize, model.kv)
            log.info("session: %d rows of %d tokens (KV cache %s), decode %d steps per call", n_rows, model.ctx,
                     fmt_bytes(kv_bytes), self.decode_chunk)
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
                        cfg.n_experts, ", and streamed from the host when offloading" if e is not None and
                        not e.plan.resident else "")

    # -- state ------------------------------------------------------------------------------------
    @property
    def active_rows(self) -> list[int]:
        return [r for r, q in enumerate(self._reqs) if q is not None]

    @property
    def free_rows(self) -> int:
        return sum(q is None for q in self._reqs)

    def cached_tokens(self, row: int) -> list[int]:
        """The tokens row `row` holds from position 0 (for an active row: the ones written so far)."""
        q = self._reqs[row]
        return list(q.fed if q is not None else self._cached[row])

    def tokens_held(self) -> int:
        """Tokens in the KV cache over all rows (active, or kept for prefix reuse)."""
        return sum(len(q.fed) if q is not None else len(c) for q, c in zip(self._reqs, self._cached))

    def kv_bytes(self) -> int:
        """Device bytes of the rows' KV cache (and recurrent state) as allocated; 0 before the first call."""
        return sum(x.nbytes for x in jax.tree.leaves(self._kv)) if self._kv is not None else 0

    def generated(self, row: int) -> int:
        q = self._reqs[row]
        return len(q.generated) if q is not None else 0

    # -- requests -----------------------------------------------------------------------------------
    def admit(self, prompt, *, max_tokens: int = 256, temperature: float = 0.8, top_p: float = 0.95, top_k: int = 40,
              min_p: float = 0.05, seed: int | None = None, stop: str | Sequence[str] | None = None,
              cache_prompt: bool = True, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
              repeat_penalty: float = 1.0, repeat_last_n: int = 64, logprobs: bool = False, top_logprobs: int = 0,
              keep_special: Sequence[int] = (), constraint: str | None = None, spec_max: int | None = None,
              prompt_logprobs: bool = False, **template_kwargs) -> tuple[int, list[GenerationChunk]]:
        """Prefill a request into a free row and sample its first token; arguments as for
        Model.generate_stream, and keep_special: special token ids whose text stays in the streamed
        text (a tool-call parser's markers); constraint: an llguidance grammar (engine/constrained.py's
        request_grammar). Returns the row and the chunks of that first token (ending with the final
        chunk if the request is already done, and then the row is free again)."""
        m = self.model
        penalties = dict(presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                         repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n)
        stops = check_request(max_tokens, stop, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                              **penalties)
        n_top = logprob_count(logprobs, top_logprobs)
        ids = m.prompt_tokens(prompt, **template_kwargs)
        m.check_len(len(ids) + 1)
        if not self.free_rows:
            raise ConfigError(f"all {self.n_rows} rows are busy: admit after a request finishes or is released.")
        if constraint is not None:
            constraint = Constraint(constraint, m.tokenizer, m.config.vocab_size)
        score = n_top if prompt_logprobs and n_top is not None else None
        cache_prompt = cache_prompt and score is None  # every prompt position's logits are needed then
        row = self._pick_row(ids, cache_prompt)
        n_cached = common_prefix(ids, self._cached[row]) if cache_prompt else 0
        n_cached = min(n_cached, len(ids) - 1)  # at least one token must run to give the next-token logits
        if m.config.has_recurrent_state and n_cached < len(self._cached[row]):
            # a recurrent layer's state cannot be rewound: only a prompt that extends everything the row
            # holds (the next turn of its conversation) continues from it, or one that extends the row's
            # last prompt (its state was kept at that point: a client that re-renders the last reply, a
            # turn that ended on a stop string); the others prefill from 0
            n_cached = 0
        snap = self._snap_for(row, ids) if m.config.has_recurrent_state and cache_prompt else None
        if snap is not None and len(snap[0]) > n_cached:
            self._spill(row)
            self._kv = _put_rec(self._kv, np.int32(row), jax.device_put(snap[1], m.placement))
            self._cached[row] = list(snap[0])
            n_cached = len(snap[0])
        if self._conv is not None and cache_prompt:
            entry, n, tier = self._conv.best(ids, len(ids) - 1, beat=n_cached)
            if n > n_cached:
                self._spill(row)
                self._restore(row, entry, n, tier)
                n_cached = n
        max_tokens = min(max_tokens, m.ctx - len(ids))
        mode = SamplingMode.of(dict(temperature=temperature, **penalties), n_top is not None)
        seed = seed if seed is not None else time.time_ns() % (2**31)
        sp = jax.tree.map(np.asarray, SamplingParams.make(1, temperature, top_p, top_k, min_p, **penalties))
        start = programs.RowStart(np.asarray(jax.random.key_data(jax.random.PRNGKey(seed))), sp,
                                  PenaltyState.window(ids), np.int32(max_tokens), np.array(mode, bool),
                                  constraint.mask() if constraint else allowed_mask(m.config.vocab_size))
        self._touch(row)
        if constraint is None and self.spec is None and m.forced_TMk is None:
            # the plain decode call that follows this prompt compiles on a thread beside the prefill
            n = min(self.decode_chunk, max_tokens)
            self._compile_beside(self._decode, (np.zeros(self.n_rows, bool), self._stop_St, np.int32(n)),
                                 len(ids) + n, False, dict(mode=mode, n_max=self.decode_chunk))
        t0 = time.perf_counter()
        turn_start = tuple(ids[:n_cached])
        if m.config.has_recurrent_state and n_cached and not any(t == turn_start for t, _ in self._snaps[row]):
            self._snaps[row].append((turn_start, jax.device_get(_take_rec(self._kv_now(), np.int32(row)))))
        scored: list[TokenLogprob] = []
        out = self._prefill(row, ids, n_cached, start, all_logits=False, score=score, scored=scored)
        tok = int(np.asarray(out.tok_1)[0])
        if m.config.has_recurrent_state:  # keep the turn's start (if it continued one) and the prompt's end
            base = [sn for sn in self._snaps[row] if n_cached and sn[0] == turn_start]
            self._snaps[row] = base + [(tuple(ids), jax.device_get(_take_rec(self._kv, np.int32(row))))]
        m.note_steps(time.perf_counter() - t0, -(-(len(ids) - n_cached) // m.prefill_chunk))
        stream = TextStream(stops, max_tokens, m.tokenizer.stream_decoder(keep=keep_special), n_top is not None)
        q = _Request(list(ids), stream, n_cached, mode, n_top, max_tokens, t0, list(ids), tok, constraint=constraint,
                     kv_resident=m.kv_resident)
        if self.spec is not None:
            q.spec_on = True
            q.spec_max = self.spec_max if spec_max is None else min(spec_max, self.spec_max)
            if constraint is None and q.spec_max > 0:
                q.spec = Acceptance(adaptive=getattr(m.drafter, "accept_n", None) is None)  # not a forced one
            elif constraint is not None:
                log.info("spec %s: this request decodes without speculation (it has a grammar, whose mask for each "
                         "token needs the host)", self.spec)
        q.t_prefill = time.perf_counter() - t0
        q.t1 = q.t_steady = time.perf_counter()
        self._reqs[row] = q
        lp = token_logprob(jax.device_get(out.logprobs), 0, tok, n_top, 0) if n_top is not None else None
        chunks = self._push(row, q, tok, lp, first=True)
        if score is not None:  # ahead of the first token's chunk (whose text may be held back)
            dec, at = m.tokenizer.stream_decoder(skip_special=False), 0
            for e, t in zip(scored, ids):  # entry j scores ids[j + 1]: its text starts after ids[:j + 1]'s
                at += len(dec.push(t))
                e.offset = at
            chunks.insert(0, GenerationChunk("", [], prompt_logprobs=scored))
        return row, chunks

    def step(self) -> dict[int, list[GenerationChunk]]:
        """Dispatch decode calls (keeping one queued ahead), wait for the oldest, and stream its tokens:
        {row: the chunks its new tokens gave}."""
        m = self.model
        t_start = time.perf_counter()
        if not self._pending:
            self._t_last = t_start
            out = self._speculate()
            if out is not None:
                return out
        # a call queued ahead could not serve a constrained row (its mask waits for the call before), so
        # while one runs the calls go one at a time and it takes a token in every call
        queued = 1 if any(q is not None and (q.constraint is not None or q.spec is not None)
                          for q in self._reqs) else QUEUED
        while len(self._pending) < queued and self._dispatch():
            pass
        if not self._pending:
            # every planned token was delivered, so TextStream has ended each request; never spin on one
            done = {r: [self._final(q, "length")] for r, q in enumerate(self._reqs) if q is not None}
            for r in done:
                self._end(r)
            return done
        p = self._pending.popleft()
        t_w = time.perf_counter()
        n_B = np.asarray(p.out.n_B)
        toks_NB = np.asarray(p.out.tokens_NB)
        lps = jax.device_get(p.out.logprobs) if p.out.logprobs is not None else None
        now = time.perf_counter()
        steps = int(n_B.max()) if len(n_B) else 0
        m.host.wait(now - t_w, steps)
        m.note_steps(now - self._t_last, steps)  # wall time between the calls' results: the device's pace
        for q in p.owners if not self._pending else ():  # alone in flight: the call's time is its own pace
            if q is not None and q.spec is not None:
                q.spec.timed("plain", now - self._t_last, steps)
        self._t_last = now
        if m.routing is not None and steps:
            routed = np.asarray(p.out.routed_NMBk)
            for c in range(steps):
                rows = [r for r in range(self.n_rows) if n_B[r] > c and p.owners[r] is not None]
                if rows:
                    m.routing.append(routed[c][:, rows].transpose(1, 0, 2))
        out: dict[int, list[GenerationChunk]] = {}
        for q in p.owners:
            if q is not None:
                q.in_flight -= 1
        for r, q in enumerate(p.owners):
            if q is None or self._reqs[r] is not q:  # ended since the call was dispatched: drop its tokens
                continue
            chunks = []
            for j in range(int(n_B[r])):
                tok = int(toks_NB[j, r])
                lp = (token_logprob(jax.tree.map(lambda a: a[j], lps), r, tok, q.n_top, 0)
                      if q.n_top is not None else None)
                chunks += self._push(r, q, tok, lp)
                if self._reqs[r] is not q:  # done: a stop id or string, or max_tokens
                    break
            if chunks:
                out[r] = chunks
        return out

    def release(self, row: int) -> int:
        """End the request in `row` now (a cancelled request): the row is free and keeps what it has
        written for prefix reuse. Returns how many tokens the request had generated."""
        n = self.generated(row)
        self._count_kv(self._reqs[row])
        self._end(row)
        return n

    def fork(self, row: int) -> int | None:
        """Copy the prompt active row `row` has prefilled into a free row, which then holds it for prefix
        reuse: admitting the same prompt again (another choice of it) prefills only its last token there.
        Returns that row, or None where there is none free or the model's recurrent state cannot be
        shared (it then prefills the prompt whole)."""
        q = self._reqs[row]
        free = [r for r in range(self.n_rows) if self._reqs[r] is None]
        if q is None or not free or self._kv is None or self.model.config.has_recurrent_state:
            return None
        dst = min(free, key=self._used.__getitem__)
        self._spill(dst)
        self._kv = programs.copy_row(self._kv, np.int32(row), np.int32(dst))
        if self._kv_host is not None:  # the cells past the device's: host memory, copied by the host
            jax.block_until_ready(self._kv)
            for leaf, host in zip((self._kv.k_LBSKDh, self._kv.v_LBSKDh), self._kv_host):
                if host is not None:
                    kvquant.copy_host_row(leaf, host, row, dst)
        self._cached[dst] = list(q.ids)
        self._snaps[dst] = []
        return dst

    def logits(self, ids: list[int]) -> np.ndarray:
        """float32 [len(ids), vocab]: the next-token logits after each position, prefilled into a free row
        (which then holds ids for prefix reuse; the row is not decoded)."""
        return np.concatenate([o for o, _ in self._all_logits(ids)], axis=0)

    def mtp_logits(self, ids: list[int]) -> np.ndarray:
        """float32 [len(ids), vocab]: the MTP block's logits at each position p, its guess at the token after
        ids[p + 1] from ids[p] and the trunk's state before it (model/mtp.py), prefilled as `logits`
        does; a session of an "mtp" spec only (it keeps the block's cache)."""
        if self.spec != "mtp":
            raise ConfigError("mtp_logits: load the model with spec='mtp' (its MTP block's cache is kept then).")
        return np.concatenate([o for _, o in self._all_logits(ids)], axis=0)

    def _all_logits(self, ids: list[int]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        if not self.free_rows:
            raise ConfigError(f"all {self.n_rows} rows are busy: take logits after a request finishes.")
        row = self._pick_row(ids, cache_prompt=False)
        sp = jax.tree.map(np.asarray, SamplingParams.make(1))
        start = programs.RowStart(np.zeros(2, np.uint32), sp, PenaltyState.window(ids), np.int32(0),
                                  np.zeros(3, bool), allowed_mask(self.model.config.vocab_size))
        return self._prefill(row, ids, 0, start, all_logits=True, keep=True)

    # -- internals ------------------------------------------------------------------------------------
    @property
    def _stop_St(self) -> jax.Array:
        """The tokenizer's stop ids on the device (made again if they were changed)."""
        ids = frozenset(self.model.tokenizer.stop_ids)
        if self._stops is None or self._stops[0] != ids:
            self._stops = (ids, programs.stop_array(ids))
        return self._stops[1]

    def _final(self, q: _Request, finish: str) -> GenerationChunk:
        """The request's last chunk; the model's KV-read telemetry counts its cells (--kv-resident)."""
        chunk = q.final(finish)
        self._count_kv(q)
        return chunk

    def _count_kv(self, q: _Request | None) -> None:
        """A request that ends (or is released): the cells its computed tokens attended to, into the model's
        KV-read telemetry (Model.kv_stats; --kv-resident only)."""
        if q is not None and q.kv_resident is not None:
            cells, near = kv_cells(q.n_cached, len(q.fed), q.kv_resident)
            total, vram = self.model.kv_read
            self.model.kv_read = [total + cells, vram + near]  # one assignment: a scrape reads a consistent pair

    def _push(self, row: int, q: _Request, tok: int, lp, first: bool = False) -> list[GenerationChunk]:
        """Take in a sampled token: stream it, and end the request if it is done."""
        if not first:
            q.fed.append(q.last)  # the step that sampled tok took `last` in
            q.last = tok
        chunks, finish = q.stream.push(tok, self.model.tokenizer.stop_ids, lp)
        if q.constraint is not None and finish is None:
            q.constraint.take(tok)
            finish = "stop" if q.constraint.done else None  # the grammar is complete: nothing may follow
        if finish is not None:
            chunks.append(self._final(q, finish))
            # the device stops a row by itself at a stop id or max_tokens, so its state is then exactly
            # `fed`'s; at a stop string or a grammar's end calls already queued may have run it further
            self._end(row, exact=q.stream.stop_string is None and q.constraint is None)
        return chunks

    def _dispatch(self) -> bool:
        """Queue one decode call for the rows with tokens still to plan; False when there is none."""
        live = [(r, q) for r, q in enumerate(self._reqs) if q is not None and q.planned < q.max_tokens]
        # a constrained row needs its last token's mask: it waits (cap 0, still alive) while a call is out
        ready = [(r, q) for r, q in live if q.constraint is None or not q.in_flight]
        if not ready:
            return False
        m = self.model
        free_running = [q for _, q in ready if q.constraint is None]
        n = min(self.decode_chunk, max(q.max_tokens - q.planned for q in free_running)) if free_running else 1
        # a constrained row takes the tokens its grammar forces (up to a chunk, leaving one step to sample)
        ff = {r: q.constraint.forced(min(self.decode_chunk, q.max_tokens - q.planned) - 1)
              for r, q in ready if q.constraint is not None}
        n = max([n] + [len(f) + 1 for f in ff.values()])
        owners: list[_Request | None] = [None] * self.n_rows
        pos = [m.ctx] * self.n_rows
        alive = np.zeros(self.n_rows, bool)
        caps = np.zeros(self.n_rows, np.int32)
        mode = GREEDY
        for r, q in live:
            pos[r], alive[r] = len(q.ids) + q.planned - 1, True
        for r, q in ready:
            owners[r], caps[r] = q, (len(ff[r]) + 1 if q.constraint is not None else n)
            mode = mode | q.mode
        constraint = {}
        if any(q.constraint is not None for _, q in live):
            allowed = allowed_mask(m.config.vocab_size, self.n_rows)
            ff_BN = np.zeros((self.n_rows, self.decode_chunk), np.int32)
            n_ff = np.zeros(self.n_rows, np.int32)
            for r, f in ff.items():
                allowed[r] = self._reqs[r].constraint.mask()[0]
                ff_BN[r, : len(f)], n_ff[r] = f, len(f)
            constraint = {"constraint": (allowed, caps, ff_BN, n_ff)}
        end = max(pos[r] for r, _ in ready) + n
        t_d = time.perf_counter()
        try:
            out, _ = self._call(self._decode, alive, self._stop_St, np.int32(n), end=end, mode=mode,
                                n_max=self.decode_chunk, **self._forced_decode(pos), **constraint)
        except BaseException:
            for r, _ in live:  # the call did not happen: every request it was to serve ends here
                self._end(r)
            raise
        m.host.dispatch(time.perf_counter() - t_d)
        now = time.perf_counter()
        for r, q in ready:
            q.planned += min(int(caps[r]), q.max_tokens - q.planned)
            q.in_flight += 1
            if q.t_steady == q.t1:  # steady-state speed starts once its first decode call is launched
                q.t_steady = now
        self._pending.append(_Pending(out, owners))
        return True

    def _speculate(self) -> dict[int, list[GenerationChunk]] | None:
        """One verify pass of the speculating row's drafts and its tokens; None when this step should be a
        plain decode call (no speculating row, no n-gram match, or low recent acceptance)."""
        live = [(r, q) for r, q in enumerate(self._reqs) if q is not None and q.planned < q.max_tokens]
        if len(live) != 1 or live[0][1].spec is None:
            return None
        r, q = live[0]
        n_max = min(q.spec_max, q.max_tokens - q.planned - 1)  # the bonus token is one more
        if n_max < 1 or not q.spec.should_draft():
            return None
        n_max = q.spec.draft_count(n_max)
        seq = q.fed + [q.last]
        if self.spec == "mtp":  # the previous pass drafted them, if it ended where this row now is
            ahead = q.next_drafts if q.next_drafts is not None and q.next_drafts[0] == len(q.fed) else None
            drafts = (ahead[1] if ahead is not None else self._mtp_draft(r, len(q.fed)))[:n_max]
        elif self.model.drafter is not None:
            drafts = self.model.drafter(seq, n_max)
        else:
            drafts = lookup_draft(seq, n_max)
        if not drafts:
            return None
        if not q.spec.worth(len(drafts)):  # this session's timings say plain steps emit faster now
            q.spec.pause()
            return None
        m = self.model
        toks = np.zeros((1, self.spec_max + 1), np.int32)  # one program for every draft count
        toks[0, 0], toks[0, 1: len(drafts) + 1] = q.last, drafts
        pos = len(q.fed)
        t_d = time.perf_counter()
        forced_accept = getattr(self.model.drafter, "accept_n", None)  # a benchmark's oracle (bench/spec.py)
        ahead = self.spec_max if self.spec == "mtp" else 0  # the MTP block drafts the next pass's tokens in this one
        (out, routed) = self._call(programs.verify, np.int32(r), toks, np.array([len(drafts) + 1], np.int32),
                                   self._stop_St, end=pos + toks.shape[1] + ahead, mode=q.mode, draft_next=ahead,
                                   **m.forced_prefill(pos, toks.shape[1]),
                                   **({} if forced_accept is None else {"accept_n": np.int32(forced_accept)}))
        m.host.dispatch(time.perf_counter() - t_d)
        t_w = time.perf_counter()
        tokens, n_emit, accepted = np.asarray(out.tokens_T), int(out.n_emit), int(out.n_acc)
        q.next_drafts = None if out.next_drafts is None else (pos + n_emit, np.asarray(out.next_drafts).tolist())
        lps = jax.device_get(out.logprobs) if out.logprobs is not None else None
        now = time.perf_counter()
        m.host.wait(now - t_w, 1)
        m.note_steps(now - self._t_last, 1)  # one pass: the expert cache saw one step
        q.spec.timed("pass", now - self._t_last)
        self._t_last = now
        if m.routing is not None:
            m.routing.append(np.asarray(routed).transpose(1, 0, 2)[:n_emit])
        q.draft_n += len(drafts)
        q.draft_n_accepted += accepted
        q.draft_passes += 1
        q.spec.record(len(drafts), accepted)
        q.planned += n_emit
        if q.t_steady == q.t1:
            q.t_steady = t_d
        chunks = []
        for j, tok in enumerate(tokens[:n_emit].tolist()):
            lp = token_logprob(jax.tree.map(lambda a: a[j], lps), 0, tok, q.n_top, 0) if lps is not None else None
            chunks += self._push(r, q, tok, lp)
            if self._reqs[r] is not q:  # done: a stop id or string, or max_tokens
                if j < n_emit - 1 and m.config.has_recurrent_state:
                    self._cached[r] = []  # the pass ran the row past its end: its state is not `fed`'s
                break
        return {r: chunks} if chunks else {}

    def _mtp_draft(self, row: int, pos: int) -> list[int]:
        """spec_max greedy drafts of the model's MTP block for `row`, whose last token goes to `pos`."""
        m = self.model
        span = attn_span(pos + self.spec_max + 1, m.ctx, False, not m.config.has_qsa)
        kv, self._kv = self._kv_now(), None
        try:
            drafts, kv = programs.mtp_draft(m.params, kv, self._rows_now(), np.int32(row), cfg=m.config, dtype=m.dtype,
                                            kernels=m.kernels, n=self.spec_max, **span)
        finally:
            self._kv = kv
        return np.asarray(drafts).tolist()

    def _prefill(self, row: int, ids: list[int], start: int, req: programs.RowStart, all_logits: bool,
                 keep: bool = False, score: int | None = None, scored: list | None = None):
        """Prefill ids[start:] into `row` at positions start.. (ids[:start] are already there); returns the
        last chunk's PrefillOut (all_logits: the list of every chunk's valid logits). score: append to
        `scored` a TokenLogprob with `score` alternatives for each of ids[start + 1:], from the logits
        before it (taken on the device: only the scores cross to the host)."""
        m, pos, out, outs = self.model, start, None, []
        if start < len(self._cached[row]) or any(start < len(t) for t, _ in self._snaps[row]):
            self._spill(row)
            self._snaps[row] = [(t, state) for t, state in self._snaps[row] if len(t) <= start]
        self._cached[row] = []  # being rewritten: nothing in it is reusable until the prefill returns
        while pos < len(ids):
            chunk = ids[pos: pos + m.prefill_chunk]
            T = bucket(len(chunk), m.prefill_chunk)
            toks = np.zeros((1, T), np.int32)
            toks[0, : len(chunk)] = chunk
            out, routed = self._call(self._prefill_fn, np.int32(row), toks, np.array([pos], np.int32),
                                     np.array([len(chunk)], np.int32), req, self._stop_St, end=pos + T, prefill=True,
                                     all_logits=all_logits or score is not None, **m.forced_prefill(pos, T))
            if m.routing is not None:
                m.routing.append(np.asarray(routed).transpose(1, 0, 2)[: len(chunk)])
            if score is not None:
                n = min(len(chunk), len(ids) - pos - 1)  # positions whose next token is in the prompt
                nxt = np.zeros(T, np.int32)
                nxt[:n] = ids[pos + 1: pos + 1 + n]
                lp = jax.device_get(_prompt_scores(out.logits[0], nxt))
                scored += [token_logprob(lp, j, nxt[j], score, 0) for j in range(n)]
            if all_logits:  # the trunk's logits, and the MTP block's where the cache keeps its state
                outs.append((np.asarray(out.logits[0, : len(chunk)]),
                             None if out.mtp_logits is None else np.asarray(out.mtp_logits[0, : len(chunk)])))
            pos += len(chunk)
        if keep:
            self._cached[row] = list(ids)
        return outs if all_logits else out

    def _forced_decode(self, pos: list[int]) -> dict:
        """The forced-routing argument of a decode call ({} when not forcing): [N, M, B, k] by each row's
        positions."""
        trace = self.model.forced_TMk
        if trace is None:
            return {}
        idx = (np.asarray(pos)[None, :] + np.arange(self.decode_chunk)[:, None]) % len(trace)  # [C, B]
        return {"forced": jnp.asarray(trace[idx].transpose(0, 2, 1, 3))}

    def _call(self, fn, *args, end: int, prefill: bool = False, **static):
        """One jitted call over the donated state (KV cache, rows, slot table, counters); puts it back
        after; end - 1: the furthest position it writes. Returns the call's first output and its routed
        ids."""
        m, e = self.model, self.model.experts
        span = attn_span(end, m.ctx, prefill, not m.config.has_qsa)
        shape = f"attention over {span['attn_len']:,} positions"
        if self._beside is not None and self._beside[0] is fn:  # its program compiles on a thread: wait
            t0 = time.perf_counter()
            self._beside[1].join()
            compiling.waited(time.perf_counter() - t0)
            self._beside = None
        self._compile_ahead(fn, args, end, prefill, static)
        if e is not None:
            e.wait()  # a failed load raises here, with the rows' state still held
        kv, self._kv = self._kv_now(), None
        rows, self._rows = self._rows_now(), None
        provider = e.take() if e is not None else None
        experts, fixed = split_provider(provider)  # only the changing part is donated
        try:
            with compiling.watch(fn.__name__, shape):
                out, kv_out, experts_out, routed, rows_out = fn(
                    m.params, experts, fixed, kv, rows, *args, cfg=m.config, dtype=m.dtype, kernels=m.kernels,
                    **span, **static, **self._host_arg())
        except BaseException:
            # a call that failed before it ran leaves its donated inputs intact; one that ran consumed them
            if e is not None:
                e.put(provider)
            deleted = any(a.is_deleted() for a in jax.tree.leaves((kv, rows)))
            if not deleted:
                self._kv, self._rows = kv, rows
            else:  # every row's cache is gone, and with it every request in flight
                self._cached = [[] for _ in range(self.n_rows)]
                self._snaps = [[] for _ in range(self.n_rows)]
                self._reqs = [None] * self.n_rows
                self._pending.clear()
            raise
        if e is not None:
            e.put(join_provider(experts_out, fixed))
        self._kv, self._rows = kv_out, rows_out
        self._made.add(_program_key(fn, span, static))
        return out, routed

    def _compile_ahead(self, fn, args: tuple, end: int, prefill: bool, static: dict) -> None:
        """While the expert store loads: compile the call `_call(fn, *args, end=end, prefill=prefill,
        **static)` against the store's shapes. The program goes into the persistent compilation cache, so
        the call itself, once the store is in, reads it back instead of compiling (a no-op without the
        cache, or after the load)."""
        m, e = self.model, self.model.experts
        if e is None or not e.loading or not jax.config.jax_compilation_cache_dir:
            return
        span = attn_span(end, m.ctx, prefill, not m.config.has_qsa)
        with compiling.watch(fn.__name__, f"attention over {span['attn_len']:,} positions"):
            self._lower(fn, args, span, static).compile()

    def _lower(self, fn, args: tuple, span: dict, static: dict):
        """fn lowered as `_call` calls it, against the store's shapes (a loading store's too)."""
        m, e = self.model, self.model.experts
        self._kv, self._rows = self._kv_now(), self._rows_now()
        provider = split_provider(e.ahead()) if e is not None else (None, None)
        return fn.lower(m.params, *provider, self._kv, self._rows, *args, cfg=m.config, dtype=m.dtype,
                        kernels=m.kernels, **span, **static, **self._host_arg())

    def _compile_beside(self, fn, args: tuple, end: int, prefill: bool, static: dict) -> None:
        """Compile the call `_call(fn, *args, end=end, prefill=prefill, **static)` on a thread while the caller
        goes on (a new request's decode program beside its prefill's compile: XLA compiles both at once);
        the call itself waits for it and finds the executable in JAX's in-memory cache (same lowering). A
        no-op for a program a call already made, or while another compiles."""
        m = self.model
        span = attn_span(end, m.ctx, prefill, not m.config.has_qsa)
        if self._beside is not None or _program_key(fn, span, static) in self._made:
            return
        # lowered here (the arrays are the caller's until its next call donates them), compiled there
        try:
            lowered = self._lower(fn, args, span, static)
        except Exception as err:  # noqa: BLE001 - the call lowers it again and reports what is wrong
            log.warning("could not lower the %s program ahead (%s); its call compiles it", fn.__name__, err)
            return

        def run() -> None:
            t0 = time.perf_counter()
            try:
                lowered.compile()
            except Exception as err:  # noqa: BLE001 - the call compiles it itself then
                log.warning("compiling the %s program beside failed (%s); the call compiles it", fn.__name__, err)
                return
            log.info("compiled the %s program beside (attention over %s positions) in %.1f s", fn.__name__,
                     f"{span['attn_len']:,}", time.perf_counter() - t0)

        compiling.announce(fn.__name__, " beside")
        thread = threading.Thread(target=run, name=f"strata-jax compile {fn.__name__}", daemon=True)
        thread.start()
        self._beside = (fn, thread)

    def _rows_now(self) -> programs.RowState:
        """The rows' decode state; made at first use committed like the state the programs return, or the
        second call would compile again."""
        m = self.model
        if self._rows is not None:
            return self._rows
        return jax.device_put(programs.RowState.zeros(self.n_rows, m.config.vocab_size, REPEAT_WINDOW), m.placement)

    def _kv_now(self) -> KVCache:
        """The rows' cache, allocated at its first use (with the MTP block's, when it drafts)."""
        m = self.model
        if self._kv is not None:
            return self._kv
        # --kv-resident: K and V keep that many positions on the device, the rest in host memory (split off)
        kv = KVCache.zeros(m.config, self.n_rows, m.ctx, m.dtype, m.placement, kv=m.kv, resident=m.kv_resident)
        if self.spec == "mtp":
            kv = kv.replace(mtp=mtp.state_zeros(m.config, self.n_rows, m.ctx, m.dtype, m.kv))
        if m.kv_resident is not None:
            kv, self._kv_host = kv.split_host()
        return jax.device_put(kv, m.placement)

    def _host_arg(self) -> dict:
        """The programs' kv_host argument: a streamed cache's host part (none otherwise)."""
        return {} if self._kv_host is None else {"kv_host": tuple(h and h.addressed() for h in self._kv_host)}

    def _row_cache(self, kv: KVCache, row: int) -> KVCache:
        """Row `row`'s one-row cache over the whole context, to spill it (a streamed cache's host part read
        back on the host, once the calls writing it are done)."""
        one = _take_row(kv, np.int32(row))
        if self._kv_host is None:
            return one
        jax.block_until_ready(kv)
        k, v = (None if h is None else kvquant.logical_row(leaf, h, row)
                for leaf, h in zip((kv.k_LBSKDh, kv.v_LBSKDh), self._kv_host))
        return one.replace(k_LBSKDh=k, v_LBSKDh=v)

    def _spill(self, row: int) -> None:
        """Before the content of a free row is overwritten: its conversation to the host tier."""
        held, kv = self._cached[row], self._kv
        if self._conv is None or kv is None:
            return
        for tokens, state in self._snaps[row]:  # the kept states (a turn's start, a prompt's end), each whole
            if tuple(held) != tokens:
                self._conv.spill(tokens, lambda s=state: _with_state(self._row_cache(kv, row), s), True)
        if held:  # last: the longest, and the most recently used in each tier
            self._conv.spill(held, lambda: self._row_cache(kv, row), self.model.config.has_recurrent_state)

    def _restore(self, row: int, entry, n: int, tier: str) -> None:
        """Put a cached conversation into `row`, which then holds its tokens; n: the prompt's tokens it serves."""
        m = self.model
        kv, self._kv = self._kv_now(), None
        one = padded(entry, m.ctx)
        if self._kv_host is not None:  # the streamed leaves row by row: their device part, then host memory
            jax.block_until_ready(kv)
            k, v = (leaf if h is None else kvquant.put_logical_row(leaf, h, row, val)
                    for leaf, h, val in zip((kv.k_LBSKDh, kv.v_LBSKDh), self._kv_host, (one.k_LBSKDh, one.v_LBSKDh)))
            kv, one = kv.replace(k_LBSKDh=k, v_LBSKDh=v), one.replace(k_LBSKDh=None, v_LBSKDh=None)
            self._kv = _put_rest(kv, np.int32(row), jax.device_put(one, m.placement))
        else:
            self._kv = _put_row(kv, np.int32(row), jax.device_put(one, m.placement))
        self._cached[row] = list(entry.tokens)
        self._snaps[row] = []
        self._conv.restored(tier, n)
        log.debug("conversation cache: %d of %d tokens back from %s into row %d", n, len(entry.tokens), tier, row)

    def _pick_row(self, ids: list[int], cache_prompt: bool) -> int:
        free = [r for r in range(self.n_rows) if self._reqs[r] is None]
        shared = {r: max(common_prefix(ids, self._cached[r]), self._snap_reuse(r, ids)) if cache_prompt else 0
                  for r in free}
        by_reuse = lambda r: (shared[r], -self._used[r])  # noqa: E731 - ties go to the least recently used
        lossless = [r for r in free if shared[r] == len(self._cached[r])]  # taking it discards nothing
        if lossless:
            return max(lossless, key=by_reuse)
        best = max(free, key=by_reuse)
        return best if shared[best] >= SIMILARITY * len(ids) else min(free, key=self._used.__getitem__)

    def _snap_for(self, row: int, ids: list[int]) -> tuple[tuple[int, ...], Any] | None:
        """The longest of the row's kept states whose tokens ids extends, or None."""
        fits = [sn for sn in self._snaps[row] if common_prefix(ids, sn[0]) == len(sn[0]) < len(ids)]
        return max(fits, key=lambda sn: len(sn[0]), default=None)

    def _snap_reuse(self, row: int, ids: list[int]) -> int:
        """The tokens of ids the row's kept states serve."""
        snap = self._snap_for(row, ids)
        return len(snap[0]) if snap is not None else 0

    def _touch(self, row: int) -> None:
        self._clock += 1
        self._used[row] = self._clock

    def _end(self, row: int, exact: bool = False) -> None:
        """The row's request is over: the row keeps its tokens for prefix reuse. With recurrent state only
        when `exact` (no step ran past them): that state cannot be rewound to a prefix."""
        q = self._reqs[row]
        if q is not None:
            keep = self._kv is not None and (exact or not self.model.config.has_recurrent_state)
            self._cached[row] = q.fed if keep else []
            self._reqs[row] = None
            self._touch(row)
            if not any(r is not None for r in self._reqs):
                self._pending.clear()  # nothing left to deliver; the calls in flight finish on their own


def _program_key(fn, span: dict, static: dict) -> tuple:
    """What tells one of a session's compiled programs from another: the program, its attention span and
    its static arguments."""
    return fn.__name__, tuple(sorted(span.items())), tuple(sorted((k, repr(v)) for k, v in static.items()))
