"""`load()` and `Model`: the Python API around the jitted forward pass.

The host drives one jitted call per prefill chunk and one per chunk of decoded tokens (model/decode.py:
the loop over tokens, sampling and the stop test run on the device, which returns only token ids);
nothing crosses to the host between layers or between the tokens of a chunk.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax import runtime
from strata_jax.core.errors import ConfigError
from strata_jax.core.experts import join_provider, split_provider
from strata_jax.gguf.reader import GGUFFile
from strata_jax.model.config import ModelConfig
from strata_jax.model.decode import STEP_DONATE, STEP_STATIC, DecodeState, decode_chunk, stop_array
from strata_jax.model.forward import KVCache, forward
from strata_jax.model.sampling import (TOP_LOGPROBS, PenaltyState, SamplingMode, SamplingParams, next_token,
                                      sample, validate_sampling)
from strata_jax.model.streaming import (Generation, GenerationChunk, TextStream, TokenLogprob,  # noqa: F401
                                        request_timings, token_logprob)
from strata_jax.model.kernels import Kernels
from strata_jax.model.tokenizer import GGUFTokenizer
from strata_jax.model.weights import WeightLoader, expert_spec, load_params
from strata_jax.offload.manager import OffloadManager
from strata_jax.offload.policies import Policy

log = logging.getLogger("strata_jax")

MIN_BUCKET = 16
MIN_ATTN_BUCKET = 256  # attention spans are powers of two from here up to the context length


def attn_bucket(end: int, ctx: int) -> int:
    """Cache positions attention reads when the furthest position written is end - 1."""
    return min(max(MIN_ATTN_BUCKET, 1 << (max(end, 1) - 1).bit_length()), ctx)


def bucket(n: int, max_chunk: int) -> int:
    """Power-of-two token bucket for a chunk of n tokens, so prefill compiles O(log n) shapes."""
    return min(max(MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length()), max_chunk)


# Decode steps per jitted call by default (load's decode_chunk, model/decode.py). On the H200 (48-layer
# B30, resident) 16 steps per call ran 223 tok/s against 134 one step per call: the host's launch of a
# step costs as much as the step. On the CPU the launch is cheap next to the compute and one step per
# call streams each token as soon as it exists.
DECODE_CHUNK_GPU = 16


def default_decode_chunk(platform: str) -> int:
    return DECODE_CHUNK_GPU if platform == "gpu" else 1


@functools.partial(jax.jit, static_argnames=STEP_STATIC + ("all_logits",), donate_argnames=STEP_DONATE)
def _prefill(params, experts, fixed, kv, tokens_BT, start_B, n_valid_B, *, cfg, dtype, kernels, attn_len, all_logits,
             forced=None):
    logits, kv, experts, routed = forward(params, join_provider(experts, fixed), kv, tokens_BT, start_B, n_valid_B,
                                          cfg=cfg, dtype=dtype, kernels=kernels, all_logits=all_logits,
                                          attn_len=attn_len, forced_MNk=forced)
    return logits, kv, split_provider(experts)[0], routed


@jax.jit
def _first_token(logits_1V, key, sp, recent_1W, want_logprobs):
    """The first token, from the prefill's logits; its penalty state starts with no generated tokens and
    the prompt's tail in the repeat window."""
    pen = PenaltyState(jnp.zeros(logits_1V.shape, jnp.int32), recent_1W)
    return next_token(logits_1V, lambda l: sample(l, key, sp), sp, pen, want_logprobs)


class HostTiming:
    """Where the host spends decode time: inside the jitted calls (tracing aside, the launch: argument
    handling and XLA's kernel or CUDA-graph submission) and blocked on the sampled tokens, per decode
    step (token). With a chunk queued ahead, dispatch time near the step time means the host, not the
    device, sets the pace."""

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


def _kernels_from_env(platform: str) -> Kernels:
    """TEMPORARY, until the engine config builds Kernels: STRATA_JAX_QMATVEC (1 on, 0 off, unset auto) and
    STRATA_JAX_MOE_PREFILL (dense, grouped), read once at load."""
    qm = os.environ.get("STRATA_JAX_QMATVEC", "")
    if qm not in ("", "0", "1"):
        raise ConfigError(f"STRATA_JAX_QMATVEC={qm!r}: use 1 (on), 0 (off) or leave it unset (auto)")
    prefill = os.environ.get("STRATA_JAX_MOE_PREFILL") or "dense"
    if prefill not in ("grouped", "dense"):
        raise ConfigError(f"STRATA_JAX_MOE_PREFILL={prefill!r}: use 'grouped' or 'dense'")
    return Kernels(qmatvec={"": "auto", "0": "off", "1": "on"}[qm], moe_prefill=prefill, platform=platform)


def _resolve_dtype(dtype: Any, platform: str):
    if dtype in (None, "auto"):
        return jnp.float32 if platform == "cpu" else jnp.bfloat16
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ConfigError(f"dtype={dtype!r} is not supported: use 'float32', 'bfloat16', 'float16' or 'auto'.")
    return dt.type


class Model:
    def __init__(self, gguf: GGUFFile, *, ctx: int | None = None, dtype: Any = None, device: Any = None,
                 prefill_chunk: int = 512, dequantize_dense: bool | None = None, expert_slots: int | None = None,
                 vram_budget: int | str | None = None, vram_reserve: int | str | None = None,
                 policy: str | Policy = "lru", prefetch: bool | int = False, expert_pools: str = "per-layer",
                 record_routing: bool = False,
                 parallel: int = 1, decode_chunk: int | None = None):
        t0 = time.perf_counter()
        self.gguf = gguf
        self.config = cfg = ModelConfig.from_gguf(gguf)
        self.device = device or jax.devices()[0]
        self.dtype = _resolve_dtype(dtype, self.device.platform)
        if runtime.applied and self.device.platform == "gpu":
            log.info("XLA: %s (expert-miss loops run as CUDA graph nodes, no host sync per iteration; "
                     "STRATA_JAX_XLA_DEFAULTS=0 turns this off)", " ".join(f"{k}={v}" for k, v in runtime.applied.items()))
        self.ctx = int(ctx or min(cfg.context_length, 4096))
        if self.ctx < 1:
            raise ConfigError(f"ctx={ctx!r} is invalid: give a positive context length.")
        if self.ctx > cfg.context_length:
            log.warning("ctx %d exceeds the model's trained context %d; quality may degrade past it",
                        self.ctx, cfg.context_length)
        if prefill_chunk < MIN_BUCKET or prefill_chunk & (prefill_chunk - 1):
            raise ConfigError(f"prefill_chunk={prefill_chunk} must be a power of two >= {MIN_BUCKET}.")
        self.prefill_chunk = prefill_chunk
        if decode_chunk is None:
            decode_chunk = default_decode_chunk(self.device.platform)
        if isinstance(decode_chunk, bool) or not isinstance(decode_chunk, int) or decode_chunk < 1:
            raise ConfigError(f"decode_chunk={decode_chunk!r} must be a positive integer (decode steps per call).")
        self.decode_chunk = decode_chunk
        self.tokenizer = GGUFTokenizer.from_metadata(gguf.metadata)
        if dequantize_dense is None:
            dequantize_dense = self.device.platform == "cpu"
        loader = WeightLoader(gguf, cfg, self.device, dequantize_dense=dequantize_dense, dense_dtype=self.dtype)
        self.params = load_params(loader)
        self.experts: OffloadManager | None = None
        if cfg.is_moe:
            # a server decoding `parallel` requests at once holds that many KV-cache rows (model/batch.py)
            kv_bytes = 2 * cfg.n_layers * self.ctx * cfg.kv_dim * jnp.dtype(self.dtype).itemsize * max(parallel, 1)
            act_bytes = 64 * prefill_chunk * max(cfg.d_model, cfg.n_experts * cfg.expert_ffn_dim // 8) * 4
            dense_bytes = sum(t.nbytes for t in gguf.tensors.values() if "_exps." not in t.name)
            self.experts = OffloadManager(gguf, expert_spec(loader), self.device,
                                          fixed_bytes=dense_bytes + kv_bytes + act_bytes,
                                          expert_slots=expert_slots, vram_budget=vram_budget,
                                          vram_reserve=vram_reserve, policy=policy, prefetch=prefetch,
                                          expert_pools=expert_pools, batch_rows=parallel)
            loader.bytes_loaded += self.experts.device_bytes
        self.kernels = _kernels_from_env(self.device.platform)
        jax.block_until_ready(self.params)
        dt = time.perf_counter() - t0
        log.info("loaded %s (%s, %d layers%s) in %.1f s: %.2f GiB of weights on %s at %.2f GiB/s; "
                 "compute %s, context %d, decode %s per jitted call, dense weights %s",
                 os.path.basename(gguf.path), cfg.arch, cfg.n_layers,
                 f", {cfg.n_experts} experts top-{cfg.n_experts_used}" if cfg.is_moe else "",
                 dt, loader.bytes_loaded / 2**30, self.device, loader.bytes_loaded / 2**30 / max(dt, 1e-9),
                 jnp.dtype(self.dtype).name, self.ctx,
                 f"{self.decode_chunk} steps" if self.decode_chunk > 1 else "1 step",
                 "dequantized at load (CPU default; dequantize_dense=False keeps GGML blocks)" if dequantize_dense
                 else "in GGML blocks, dequantized in each step")
        self._kv: KVCache | None = None
        self._kv_tokens: list[int] = []  # tokens whose keys/values the KV cache holds, from position 0
        self._routing: list[np.ndarray] | None = [] if record_routing else None
        self._forced_TMk: np.ndarray | None = None
        self._host = HostTiming()

    # -- telemetry --------------------------------------------------------------------------------
    @property
    def cache_plan(self):
        return self.experts.plan if self.experts is not None else None

    def stats(self) -> dict[str, Any]:
        """Expert-cache telemetry since load or reset_stats (see OffloadManager.stats); {} for dense models."""
        return self.experts.stats() if self.experts is not None else {}

    def host_timing(self) -> dict[str, float | int | None]:
        """Decode steps and jitted decode calls since load or reset_stats, the host's milliseconds per
        step inside the jitted calls (dispatch) and blocked on the tokens (wait); see HostTiming."""
        return self._host.summary()

    def reset_stats(self) -> None:
        self._host = HostTiming()
        if self.experts is not None:
            self.experts.reset_stats()

    def routing_trace(self) -> np.ndarray:
        """int32 [tokens, MoE layers, k]: the experts routed for every token processed since load (needs
        record_routing=True). Feed it to strata_jax.offload.simulate."""
        if self._routing is None:
            raise ConfigError("routing is not recorded: load the model with record_routing=True.")
        if not self._routing:
            return np.zeros((0, len(self.config.moe_layers), self.config.n_experts_used), np.int32)
        return np.concatenate(self._routing, axis=0)

    def force_routing(self, trace_TMk: np.ndarray | None) -> None:
        """Replay a routing trace (int [tokens, MoE layers, k], e.g. strata_jax.offload.routing's
        realistic_trace) instead of the routers' choices: the token at cache position p uses row
        p % len(trace). For benchmarks of cache behaviour under a chosen routing; None restores the routers."""
        if trace_TMk is None:
            self._forced_TMk = None
            return
        cfg = self.config
        t = np.asarray(trace_TMk)
        if t.ndim != 3 or t.shape[1:] != (len(cfg.moe_layers), cfg.n_experts_used) or not len(t):
            raise ConfigError(f"a routing trace must be [tokens, {len(cfg.moe_layers)}, {cfg.n_experts_used}] "
                              f"for this model, got shape {t.shape}")
        if t.min() < 0 or t.max() >= cfg.n_experts:
            raise ConfigError(f"routing trace ids must lie in [0, {cfg.n_experts})")
        self._forced_TMk = t.astype(np.int32)

    def _forced(self, pos: int, T: int, chunk: bool = False) -> dict:
        """The forced-routing argument of a step over cache positions pos..pos+T-1 ({} when not forcing):
        [M, T, k] for a prefill, [T, M, 1, k] for a decode chunk of T steps (decode_chunk)."""
        if self._forced_TMk is None:
            return {}
        rows = self._forced_TMk[np.arange(pos, pos + T) % len(self._forced_TMk)]  # [T, M, k]
        return {"forced": jnp.asarray(rows[:, :, None] if chunk else rows.transpose(1, 0, 2))}

    def _record(self, routed_NMk: jax.Array, n_valid: int) -> None:
        """Keep the routed experts [tokens, M, k] of the first n_valid tokens (record_routing)."""
        if self._routing is not None and routed_NMk.shape[1]:
            self._routing.append(np.asarray(routed_NMk)[:n_valid])

    def _step(self, fn, *args, end: int, **static):
        """One jitted call over the donated state (KV cache, slot table, counters); puts it back after.
        Returns the call's first and fourth outputs (a prefill's logits and routed ids; a decode chunk's
        tokens and state). end: one past the furthest cache position it writes (sizes the attention span)."""
        kv, self._kv = self._kv, None
        if kv is None:
            kv = KVCache.zeros(self.config, 1, self.ctx, self.dtype, self.device)
        e = self.experts
        experts, fixed = split_provider(e.take() if e is not None else None)  # only `experts` is donated
        self._kv_tokens = []  # until the step returns, the cache's contents are not known
        out, self._kv, experts, extra = fn(self.params, experts, fixed, kv, *args, cfg=self.config, dtype=self.dtype,
                                           kernels=self.kernels, attn_len=attn_bucket(end, self.ctx), **static)
        if e is not None:
            e.put(join_provider(experts, fixed))
        return out, extra

    # -- tokens ---------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def prompt_tokens(self, prompt_or_messages: str | Sequence[dict] | Sequence[int], **template_kwargs) -> list[int]:
        """A raw prompt is tokenized as is (with BOS if the model wants one); a message list goes through
        the GGUF's chat template first; a list of token ids is used as is."""
        if isinstance(prompt_or_messages, str):
            return self.tokenize(prompt_or_messages)
        if not prompt_or_messages:
            raise ConfigError("the prompt is empty: give text, token ids, or at least one message.")
        if all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt_or_messages):
            ids = [int(t) for t in prompt_or_messages]
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ConfigError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size}).")
            return ids
        if not all(isinstance(m, dict) for m in prompt_or_messages):
            raise ConfigError("a prompt list must hold either token ids or message dicts "
                              "({'role': ..., 'content': ...}), not a mix.")
        text = self.tokenizer.apply_chat_template(list(prompt_or_messages), add_generation_prompt=True,
                                                  **template_kwargs)
        bos = self.tokenizer.bos_id
        has_bos = bos is not None and text.startswith(self.tokenizer.decode([bos], skip_special=False))
        return self.tokenize(text, add_special=not has_bos)

    # -- forward --------------------------------------------------------------------------------
    def _check_len(self, n: int) -> None:
        if n > self.ctx:
            raise ConfigError(f"{n} tokens exceed the context of {self.ctx}; shorten the input or load the "
                              f"model with a larger ctx (--ctx, up to the model's {self.config.context_length}).")

    def _run_prefill(self, ids: Sequence[int], all_logits: bool, start: int = 0) -> tuple[jax.Array, list[jax.Array]]:
        """Prefill ids[start:] at cache positions start.. (ids[:start] are already in the KV cache)."""
        outs, pos = [], start
        self._kv_tokens = []  # the cache is being rewritten; valid again once this returns
        while pos < len(ids):
            chunk = list(ids[pos : pos + self.prefill_chunk])
            T = bucket(len(chunk), self.prefill_chunk)
            toks = np.zeros((1, T), np.int32)
            toks[0, : len(chunk)] = chunk
            logits, routed = self._step(_prefill, jnp.asarray(toks), jnp.array([pos], jnp.int32),
                                        jnp.array([len(chunk)], jnp.int32), end=pos + T, all_logits=all_logits,
                                        **self._forced(pos, T))
            self._record(routed.transpose(1, 0, 2), len(chunk))
            outs.append(logits[0, : len(chunk)] if all_logits else logits)
            pos += len(chunk)
        self._kv_tokens = list(ids)
        return outs[-1], outs

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 [len(token_ids), vocab]: the next-token logits after each position."""
        if isinstance(token_ids, str) or not all(isinstance(t, (int, np.integer)) for t in token_ids):
            raise ConfigError("logits() takes a list of token ids; use model.tokenize(text) first.")
        ids = self.prompt_tokens(list(token_ids))
        self._check_len(len(ids))
        _, outs = self._run_prefill(ids, all_logits=True)
        return np.concatenate([np.asarray(o) for o in outs], axis=0)

    # -- generation -----------------------------------------------------------------------------
    def generate_stream(
        self,
        prompt_or_messages: str | Sequence[dict] | Sequence[int],
        max_tokens: int = 256,
        temperature: float = 0.8,
        top_p: float = 0.95,
        top_k: int = 40,
        min_p: float = 0.05,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        cache_prompt: bool = True,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repeat_penalty: float = 1.0,
        repeat_last_n: int = 64,
        logprobs: bool = False,
        top_logprobs: int = 0,
        **template_kwargs,
    ) -> Iterator[GenerationChunk]:
        """Stream a generation. cache_prompt: reuse the KV cache for the longest token prefix this prompt
        shares with what the cache holds (the previous request's prompt and output), as llama.cpp does;
        timings["cache_n"] says how many prompt tokens were reused.

        presence_penalty / frequency_penalty (OpenAI's, in [-2, 2]) act on the tokens generated so far;
        repeat_penalty (llama.cpp's, 1 = off) on the last repeat_last_n tokens of prompt and output.
        logprobs: each chunk's `logprobs` holds a TokenLogprob per token (the model's log-probability and
        the top_logprobs most likely alternatives, 0..20; top_logprobs > 0 implies logprobs)."""
        penalties = dict(presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                         repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n)
        stops = check_request(max_tokens, stop, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                              **penalties)
        n_top = logprob_count(logprobs, top_logprobs)
        want = np.bool_(n_top is not None)
        ids = self.prompt_tokens(prompt_or_messages, **template_kwargs)
        self._check_len(len(ids) + 1)
        max_tokens = min(max_tokens, self.ctx - len(ids))
        sp = SamplingParams.make(1, temperature, top_p, top_k, min_p, **penalties)
        key = jax.random.PRNGKey(seed if seed is not None else time.time_ns() % (2**31))

        n_cached = _common_prefix(ids, self._kv_tokens) if cache_prompt else 0
        n_cached = min(n_cached, len(ids) - 1)  # at least one token must run to give the next-token logits
        t0 = time.perf_counter()
        last_logits, _ = self._run_prefill(ids, all_logits=False, start=n_cached)
        tok, pen, lp = _first_token(last_logits, jax.random.fold_in(key, 0), sp, PenaltyState.window(ids), want)
        tok_host = int(np.asarray(tok)[0])
        t_prefill = time.perf_counter() - t0

        stream = TextStream(stops, max_tokens, self.tokenizer.stream_decoder(), n_top is not None)
        t1 = t_steady = time.perf_counter()
        fed = list(ids)  # tokens written to the KV cache; if the consumer stops early, they stay reusable
        self._kv_tokens = []
        n_steps = 0
        # Decode runs in chunks of up to decode_chunk steps, the loop on the device (model/decode.py), and
        # one chunk stays queued ahead of the host: chunk c+1 is dispatched (fed chunk c's state, still on
        # the device) before the host waits for chunk c's tokens, so the device does not idle while the
        # host reads tokens or launches. A chunk that sampled a stop id marks the state done and the
        # queued one runs no step (a one-step chunk runs anyway: its token is dropped); after a stop
        # string the queued chunk's tokens are dropped (the cache positions they wrote lie past `fed`
        # and are overwritten before anything attends to them).
        mode = SamplingMode.of(dict(temperature=temperature, **penalties), n_top is not None)
        # committed to the device like the state a chunk returns: an uncommitted first state compiled a
        # second program for the second chunk (on the H200, 48 layers: the timed decode spent ~15 s in it)
        state = DecodeState(tok, *jax.device_put((np.full((1,), len(ids), np.int32), np.int32(1), np.bool_(False)),
                                                 self.device), pen)
        stop_S = stop_array(self.tokenizer.stop_ids)
        pos, planned, last = len(ids), 1, tok_host  # planned: tokens once the dispatched chunks have run in full
        pending: collections.deque = collections.deque()
        try:
            tok_lp = token_logprob(jax.device_get(lp), 0, tok_host, n_top, 0) if n_top is not None else None
            chunks, finish = stream.push(tok_host, self.tokenizer.stop_ids, tok_lp)
            yield from chunks
            while finish is None:
                while len(pending) < 2 and planned < max_tokens:
                    n = min(self.decode_chunk, max_tokens - planned)
                    t_d = time.perf_counter()
                    out, state = self._step(decode_chunk, state, key, sp, stop_S, np.int32(n), end=pos + n,
                                            n_max=self.decode_chunk, mode=mode,
                                            **self._forced(pos, self.decode_chunk, chunk=True))
                    self._host.dispatch(time.perf_counter() - t_d)
                    if t_steady == t1:  # steady-state speed starts once the first call has compiled
                        t_steady = time.perf_counter()
                    pending.append(out)
                    planned, pos = planned + n, pos + n
                if not pending:
                    break
                out = pending.popleft()
                t_w = time.perf_counter()
                n_done = int(out.n_done)
                toks = np.asarray(out.tokens_N)[:n_done].tolist()
                lps = jax.device_get(out.logprobs) if n_top is not None else None
                self._host.wait(time.perf_counter() - t_w, n_done)
                n_steps += n_done
                self._record(out.routed_NMk, n_done)
                for j, t in enumerate(toks):
                    fed.append(last)  # the step that sampled t took `last` in
                    last = t
                    tok_lp = (token_logprob(jax.tree.map(lambda a: a[j], lps), 0, t, n_top, 0)
                              if n_top is not None else None)
                    chunks, finish = stream.push(t, self.tokenizer.stop_ids, tok_lp)
                    yield from chunks
                    if finish is not None:
                        break
        finally:
            self._kv_tokens = fed if self._kv is not None else []  # a failed step leaves no valid cache
        t_end = time.perf_counter()
        n_gen = len(stream.generated)
        if self.experts is not None:
            self.experts.note_steps(t_end - t0, n_steps + math.ceil((len(ids) - n_cached) / self.prefill_chunk))
        yield stream.last(finish, request_timings(len(ids) - n_cached, n_cached, t_prefill, n_gen, t1, t_steady, t_end,
                                                  n_before_steady=1), ids)

    def generate(self, prompt_or_messages: str | Sequence[dict], **kwargs) -> Generation:
        """Generate to completion; keyword arguments as for generate_stream."""
        parts, ids, lps = [], [], None
        for chunk in self.generate_stream(prompt_or_messages, **kwargs):
            parts.append(chunk.text)
            ids.extend(chunk.token_ids)
            if chunk.logprobs is not None:
                lps = lps if lps is not None else []
                lps.extend(chunk.logprobs)
        return Generation("".join(parts), ids, chunk.prompt_token_ids or [], chunk.finish_reason or "length",
                          chunk.timings or {}, lps)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token contributes to decoded text (a byte token's single byte, which may be part of
        a UTF-8 sequence): the `bytes` of OpenAI's logprobs."""
        pieces = self.tokenizer._piece_bytes()
        return pieces[token_id] if 0 <= token_id < len(pieces) else b""


def check_request(max_tokens: Any, stop: str | Sequence[str] | None, **sampling: Any) -> list[str]:
    """Reject invalid generation limits and sampling values; returns the stop strings as a list."""
    validate_sampling(**sampling)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ConfigError(f"max_tokens={max_tokens!r} is invalid: give an integer >= 1.")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(s, str) or not s for s in stops):
        raise ConfigError("stop must be a non-empty string or a list of non-empty strings.")
    return stops


def logprob_count(logprobs: Any, top_logprobs: Any) -> int | None:
    """How many alternatives each token's logprobs carry, or None when the request wants no logprobs."""
    if not isinstance(logprobs, (bool, np.bool_)):
        raise ConfigError(f"logprobs={logprobs!r} is invalid: give True or False.")
    if (isinstance(top_logprobs, bool) or not isinstance(top_logprobs, (int, np.integer))
            or not 0 <= top_logprobs <= TOP_LOGPROBS):
        raise ConfigError(f"top_logprobs={top_logprobs!r} is invalid: give an integer in [0, {TOP_LOGPROBS}].")
    return int(top_logprobs) if logprobs or top_logprobs else None


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def enable_compilation_cache() -> None:
    """Keep compiled programs on disk (cache_dir()/xla) so a second start skips XLA compilation.
    STRATA_JAX_COMPILATION_CACHE=0 turns it off."""
    if os.environ.get("STRATA_JAX_COMPILATION_CACHE", "1") == "0" or jax.config.jax_compilation_cache_dir:
        return
    from strata_jax.model.default_model import cache_dir

    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def load(path: str | os.PathLike[str] | None = None, **options: Any) -> Model:
    """Load a GGUF model (the embedded default model when path is None).

    Options: ctx, dtype ("auto" | "float32" | "bfloat16"), device, prefill_chunk, dequantize_dense
    (default: on CPU only); for MoE models the expert cache: expert_slots (total slots) or vram_budget
    (bytes or "32GiB"; default: free device memory) and vram_reserve, policy ("lru", ... or a Policy),
    prefetch (False, True or a depth: MoE layers ahead whose predicted experts each layer fetches; off by
    default: in-step fetches are not yet overlapped with compute, and on an H200 the extra, partly
    mispredicted traffic cost more than the misses it saved, see docs/benchmarks.md), expert_pools
    ("per-layer": a cache per MoE layer with an equal share of the slots, the default; "shared": layers
    with the same expert types compete for one pool),
    record_routing; parallel: KV-cache rows to leave room for beside the expert cache (a BatchSession's
    rows, the server's --parallel); decode_chunk: decode steps per jitted call, the loop over tokens on
    the device (model/decode.py); a stream's tokens then arrive up to that many at a time (default: 16 on
    a GPU, where it measured 1.7x one step per call on the 48-layer B30, 1 elsewhere; docs/benchmarks.md)."""
    enable_compilation_cache()
    if path is None:
        from strata_jax.model.default_model import default_model_path

        path = default_model_path()
    return Model(GGUFFile(path), **options)
