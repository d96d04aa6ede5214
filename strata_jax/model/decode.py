"""Decode in chunks: up to n_max tokens per jitted call, the loop over tokens on the device.

Why: a decode step of a 48-layer MoE is ~1,600 kernels. Launched from the host one step at a time,
each cost ~8 us of host time (XLA's thunks; on the H200 the host spent 12.9 of 13.5 ms per B30 token
launching while the GPU needed ~6), so decode ran at the host's launch rate. Here a `while_loop` whose
body is one whole step (forward, sampling, stop test) runs up to `limit` steps in one program; with
XLA's WHILE/CONDITIONAL command buffers (runtime.py) the loop is a CUDA graph whose conditional nodes
are evaluated on the device, so the host launches once per chunk. The sampling choices are static
(SamplingMode) so the body holds no conditional that could keep it out of the graph.

The loop ends early when a stop id is sampled; the state says so (`done`) and a chunk queued after it
runs no step. Stop strings are text, found by the host, which then drops what a queued chunk produced.

Status (H200, JAX 0.11.2, 2026-12-01, docs/benchmarks.md): on the 48-layer B30, resident, 16 steps per
call decode 223 tok/s against 134 one step per call (LRU 50%, realistic routing: 115 against 53; BSEED
under 32 GiB: 110 against 81), and 133 with XLA's command buffers off (the loop then runs from the
host). So a GPU decodes 16 steps per call by default (model.py's DECODE_CHUNK_GPU), other devices one.
(A second sitting's 8.3 tok/s at 48 layers was a compilation inside the timed run: the first chunk
took an uncommitted initial state and the second the committed state the first returned; the initial
state is committed now, test_offload's second-request test.)

Shape legend: B batch (1), N tokens per chunk (n_max), M MoE layers, k experts per token, S stop ids.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from strata_jax.core.experts import join_provider, split_provider
from strata_jax.model.forward import forward
from strata_jax.model.sampling import TOP_LOGPROBS, Logprobs, PenaltyState, SamplingMode, next_token, sample

STEP_STATIC = ("cfg", "dtype", "kernels", "attn_len")  # the jitted steps' static arguments
STEP_DONATE = ("kv", "experts")  # and their donated state, updated in place


@struct.dataclass
class DecodeState:
    """What a chunk hands the next one, all on the device (donated: updated in place)."""

    tok_B: jax.Array  # int32: the last sampled token, the next step's input
    pos_B: jax.Array  # int32: the cache position it goes to
    step: jax.Array  # int32: tokens the request has generated (the PRNG fold-in index of the next one)
    done: jax.Array  # bool: a stop id was sampled; later chunks run no step
    pen: PenaltyState


@struct.dataclass
class ChunkOut:
    tokens_N: jax.Array  # int32: the sampled tokens; the first n_done are valid
    n_done: jax.Array  # int32: steps run
    routed_NMk: jax.Array  # int32: each step's routed experts per MoE layer
    logprobs: Logprobs | None  # fields stacked over N (SamplingMode.logprobs), else None


def stop_array(stop_ids) -> jax.Array:
    """int32 [S]: the stop ids padded with -1 to a power of two (>= 4), so their count rarely recompiles."""
    ids = sorted(int(t) for t in stop_ids)
    n = max(4, 1 << max(len(ids) - 1, 0).bit_length())
    return jnp.asarray(ids + [-1] * (n - len(ids)), jnp.int32)


def _stacked_logprobs(n: int, B: int, cfg) -> Logprobs:
    n_top = min(TOP_LOGPROBS, cfg.vocab_size)
    return Logprobs(jnp.zeros((n, B), jnp.float32), jnp.zeros((n, B, n_top), jnp.int32),
                    jnp.zeros((n, B, n_top), jnp.float32))


@functools.partial(jax.jit, static_argnames=STEP_STATIC + ("n_max", "mode"),
                   donate_argnames=STEP_DONATE + ("state",))
def decode_chunk(params, experts, fixed, kv, state: DecodeState, key, sp, stop_S, limit, *, cfg, dtype, kernels, attn_len,
                 n_max: int, mode: SamplingMode, forced=None):
    """Run min(limit, n_max) decode steps (fewer if a stop id is sampled; none if state.done). n_max 1 is
    one plain step with neither loop nor conditional: it runs even after a stop id (the host discards the
    token of a step queued after one).
    forced (int32 [N, M, B, k]): step i replays forced[i] as its routed experts (see forward).
    Returns (ChunkOut, kv, experts, DecodeState): the order of the prefill's outputs, whose routed ids
    stand where the state is (Model._step)."""
    B = state.tok_B.shape[0]
    M, K = len(cfg.moe_layers), max(cfg.n_experts_used, 1)

    # experts, fixed: the provider's changing and fixed parts (core.experts.split_provider); the loop
    # carries only the changing part, as the step donates only it

    def step(carry):
        i, st, kv, experts, out = carry
        experts = join_provider(experts, fixed)
        logits_BV, kv, experts, routed_MNk = forward(
            params, experts, kv, st.tok_B[:, None], st.pos_B, jnp.ones_like(st.pos_B), cfg=cfg, dtype=dtype,
            kernels=kernels, attn_len=attn_len, forced_MNk=None if forced is None else forced[i])
        experts = split_provider(experts)[0]
        k_step = jax.random.fold_in(key, st.step)
        tok_B, pen, lp = next_token(logits_BV, lambda l: sample(l, k_step, sp, mode), sp, st.pen, mode.logprobs,
                                    mode=mode)
        done = jnp.any(tok_B[:, None] == stop_S[None, :])
        out = ChunkOut(out.tokens_N.at[i].set(tok_B[0]), i + 1, out.routed_NMk.at[i].set(routed_MNk[:, 0]),
                       None if out.logprobs is None else jax.tree.map(lambda a, v: a.at[i].set(v), out.logprobs, lp))
        return i + 1, DecodeState(tok_B, st.pos_B + 1, st.step + 1, done, pen), kv, experts, out

    if n_max == 1:  # a plain step: no loop, and no conditional to skip it (see the module docstring)
        out1 = ChunkOut(jnp.zeros((1,), jnp.int32), jnp.int32(0), jnp.zeros((1, M, K), jnp.int32),
                        None if not mode.logprobs else _stacked_logprobs(1, B, cfg))
        _, state, kv, experts, out = step((jnp.int32(0), state, kv, experts, out1))
        return out, kv, experts, state

    def more(carry):
        i, st = carry[0], carry[1]
        return (i < limit) & ~st.done

    lp0 = _stacked_logprobs(n_max, B, cfg) if mode.logprobs else None
    out0 = ChunkOut(jnp.zeros((n_max,), jnp.int32), jnp.int32(0), jnp.zeros((n_max, M, K), jnp.int32), lp0)
    carry = (jnp.int32(0), state, kv, experts, out0)
    _, state, kv, experts, out = jax.lax.while_loop(more, step, carry)
    return out, kv, experts, state
