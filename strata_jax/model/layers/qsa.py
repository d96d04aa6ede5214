"""qwen4exp QSA token indexer: which cache positions each query of a full-attention layer attends to.

Cache positions are grouped into blocks of r = compress_ratio (block j holds positions jr .. jr+r-1).
A block's key is the mean of its r raw index keys, RMS-normed and rotated at the block's first
position; a query (Hi index heads, normed and rotated at its own position) scores each block it has
seen completely as sum over heads of relu(q_h . k_block) / sqrt(Di), and keeps the best
budget / r of them. The query also attends to its incomplete tail block (positions from
((pos + 1) // r) * r to pos, itself included), which is never scored. When the budget covers every
complete block the result is the plain causal mask.

Equal scores go to the lower block. They are exact, not rounding: relu makes a block's score exactly 0
whenever every index head scores it negative, which is common. transformers leaves that pick to
torch.topk, which takes among equals whichever its partial sort leaves first (not always the lowest),
so where the budget cuts through a tie it has no defined selection; elsewhere ours is its (issue 31).

The attention layer applies the returned mask on top of its own KV cache; nothing here touches that cache.

State per row, fixed shape: the finished block keys (written once, when a block's last position
arrives, so decode scores the blocks without pooling anything) and a ring of the raw keys of the
latest r positions (slot = position % r), from which a block is pooled when it completes. Prefill
(T > 1) and decode (T == 1) run the same code: the blocks a chunk touches are pooled from the ring
and the chunk, so a sequence fed in any chunking gives the same blocks. A row continues at its end;
rewinding it to a shorter prefix keeps the blocks, so it is exact when the new end is a multiple of r.

Reference: transformers' Qwen4ExpTextQSAIndexer (modular_qwen4_exp.py); llama.cpp's
src/models/qwen4exp.cpp build_qsa_top_k consumes the same GGUF tensors (its converter,
conversion/qwen4exp.py, splits index_qk_proj into indexer.q_proj / indexer.k_proj and folds the
zero-centred q/k layernorm gammas to 1 + w).

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from strata_jax.core.errors import TensorShapeError
from strata_jax.core.layer_ref import scatter_updates
from strata_jax.core.qtensor import QTensor
from strata_jax.model.dims import QSADims
from strata_jax.model.kernels import Kernels
from strata_jax.model.layers.attention import rope
from strata_jax.model.layers.basic import linear, rms_norm


@struct.dataclass
class QSAParams:
    q_proj: QTensor  # blk.{i}.indexer.q_proj [Hi*Di, D]
    k_proj: QTensor  # blk.{i}.indexer.k_proj [Di, D]
    q_norm_Di: jax.Array  # blk.{i}.indexer.q_norm, float32, 1 + w folded
    k_norm_Di: jax.Array  # blk.{i}.indexer.k_norm, float32, 1 + w folded

    @classmethod
    def from_gguf(cls, get: Callable[[str], Any], layer: int, dims: QSADims, d_model: int) -> "QSAParams":
        """get(name): a matrix as a QTensor, a vector as a float32 array, in the GGUF's (numpy) shape."""
        p = f"blk.{layer}.indexer."
        Hi, Di = dims.n_heads, dims.head_dim
        out = cls(get(p + "q_proj.weight"), get(p + "k_proj.weight"),
                  jnp.asarray(get(p + "q_norm.weight"), jnp.float32), jnp.asarray(get(p + "k_norm.weight"), jnp.float32))
        for name, w, shape in (("q_proj", out.q_proj, (Hi * Di, d_model)), ("k_proj", out.k_proj, (Di, d_model)),
                               ("q_norm", out.q_norm_Di, (Di,)), ("k_norm", out.k_norm_Di, (Di,))):
            if tuple(w.shape) != shape:
                raise TensorShapeError(f"{p}{name}.weight has shape {tuple(w.shape)}, expected {shape}")
        return out


@struct.dataclass
class QSAState:
    blocks_BSbDi: jax.Array  # float32: block j's key once position jr + r - 1 has been seen; stale otherwise
    tail_BRcDi: jax.Array  # float32: raw index key of the latest position p with p % r == slot
    length: int = struct.field(pytree_node=False)  # S: cache positions; one at or past S is not cached

    @classmethod
    def zeros(cls, batch: int, length: int, dims: QSADims) -> "QSAState":
        r, Di = dims.compress_ratio, dims.head_dim
        # a block past length // r can never complete inside the cache
        return cls(jnp.zeros((batch, length // r, Di), jnp.float32), jnp.zeros((batch, r, Di), jnp.float32), length)


def _update(state: QSAState, k_BTDi: jax.Array, start_B: jax.Array, end_B: jax.Array, dims: QSADims,
            p: QSAParams) -> QSAState:
    """Writes the blocks that complete at positions start .. end - 1 (the chunk's valid tokens) and
    moves those raw keys into the ring."""
    B, T, Di = k_BTDi.shape
    r, Sb = dims.compress_ratio, state.blocks_BSbDi.shape[1]
    n_win = (T + r - 2) // r + 1  # blocks a chunk of T positions can touch, wherever it starts
    off_B = start_B % r
    base_B = start_B - off_B  # the first touched block's first position
    j = jnp.arange(n_win * r)
    from_chunk = j[None, :] >= off_B[:, None]  # position base + j was computed in this call, else it is in the ring
    ci = jnp.clip(j[None, :] - off_B[:, None], 0, T - 1)
    win = jnp.where(from_chunk[..., None], jnp.take_along_axis(k_BTDi, ci[..., None], axis=1),
                    state.tail_BRcDi[:, j % r])  # [B, n_win * r, Di]
    pooled = jnp.mean(win.reshape(B, n_win, r, Di), axis=2)
    first_pos = base_B[:, None] + r * jnp.arange(n_win)[None, :]  # each touched block's first position
    kb = rms_norm(pooled, p.k_norm_Di, dims.rms_eps)
    kb = rope(kb[:, :, None, :], first_pos, dims)[:, :, 0]
    done = first_pos + r <= end_B[:, None]  # complete with this chunk's valid tokens (incomplete ones stay unwritten)
    slot = jnp.where(done, first_pos // r, Sb)  # Sb: out of range, dropped
    slot, kb = scatter_updates(slot, kb, Sb)
    blocks = state.blocks_BSbDi.at[jnp.arange(B)[:, None], slot].set(kb, mode="drop")

    return QSAState(blocks, _tail(state.tail_BRcDi, k_BTDi, start_B, end_B), state.length)


def _tail(tail_BRcDi: jax.Array, k_BTDi: jax.Array, start_B: jax.Array, end_B: jax.Array) -> jax.Array:
    """The ring after positions start .. end - 1 (keys k_BTDi from start): slot i holds the latest position
    p < end with p % r == i, from k when p >= start, else as it was."""
    r, T = tail_BRcDi.shape[1], k_BTDi.shape[1]
    i = jnp.arange(r)
    last_BRc = end_B[:, None] - 1 - (end_B[:, None] - 1 - i[None, :]) % r
    fresh = last_BRc >= start_B[:, None]
    li = jnp.clip(last_BRc - start_B[:, None], 0, T - 1)
    return jnp.where(fresh[..., None], jnp.take_along_axis(k_BTDi, li[..., None], axis=1), tail_BRcDi)


def rewind(before: QSAState, after: QSAState, k_BTDi: jax.Array, start_B: jax.Array, n_B: jax.Array) -> QSAState:
    """The state after only the first n_B tokens of a pass from start_B, from the states before and after
    it and the keys it computed (apply's `tape`), no weights read: the ring as those tokens leave it, and
    the blocks the pass completed at or past start + n back to what they were."""
    B, T, _ = k_BTDi.shape
    r, Sb = before.tail_BRcDi.shape[1], before.blocks_BSbDi.shape[1]
    end_B = start_B + jnp.clip(jnp.minimum(n_B, before.length - start_B), 0, T)
    n_win = (T + r - 2) // r + 1  # the blocks a pass of T positions can complete (as _update)
    b_BW = start_B[:, None] // r + jnp.arange(n_win)[None, :]
    undo_BW = ((b_BW + 1) * r > end_B[:, None]) & (b_BW < Sb)  # completes past the kept tokens, if at all
    old = jnp.take_along_axis(before.blocks_BSbDi, jnp.minimum(b_BW, Sb - 1)[..., None], axis=1)
    blocks = after.blocks_BSbDi.at[jnp.arange(B)[:, None], jnp.where(undo_BW, b_BW, Sb)].set(old, mode="drop")
    return QSAState(blocks, _tail(before.tail_BRcDi, k_BTDi, start_B, end_B), before.length)


def _scores(q_BTHiDi: jax.Array, blocks_BSbDi: jax.Array, dims: QSADims) -> jax.Array:
    """sum over heads of relu(q_h . k_block) / sqrt(Di): [B, T, Sb]. The [B, T, Hi, Sb] products are
    Hi / (H * r) of the attention's own scores, so they are not the step's peak."""
    s = jnp.einsum("bthd,bsd->bths", q_BTHiDi, blocks_BSbDi, preferred_element_type=jnp.float32)
    return jnp.sum(jax.nn.relu(s), axis=2) / jnp.sqrt(jnp.float32(dims.head_dim))


def apply(
    p: QSAParams,
    x_BTD: jax.Array,
    state: QSAState,
    *,
    start_B: jax.Array,
    n_valid_B: jax.Array,
    dims: QSADims,
    kernels: Kernels,
    attn_len: int | None = None,
    tape: bool = False,
):
    """The attention mask mask_BTS (bool, True = attend) for T tokens per row at positions
    start_B + 0 .. T-1, over the first attn_len (static) cache positions, and the updated state.

    x_BTD is the attention layer's input. Tokens at index >= n_valid_B, or at a position >= the
    state's length (a row that is not live), are padding: they leave the state as it is and get the
    plain causal mask. The mask already includes causality. With `tape` (static), also the pass's keys
    k_BTDi last (what `rewind` needs)."""
    B, T, _ = x_BTD.shape
    r, Hi, Di = dims.compress_ratio, dims.n_heads, dims.head_dim
    S = state.length
    pos_BT = start_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    valid_BT = (jnp.arange(T)[None, :] < n_valid_B[:, None]) & (pos_BT < S)
    end_B = start_B + jnp.sum(valid_BT, axis=1, dtype=jnp.int32)  # the valid tokens are a prefix of the chunk

    k_BTDi = linear(x_BTD, p.k_proj, kernels).astype(jnp.float32)
    state = _update(state, k_BTDi, start_B, end_B, dims, p)

    S_att = min(attn_len or S, S)
    s_S = jnp.arange(S_att)
    causal_BTS = s_S[None, None, :] <= pos_BT[:, :, None]
    n_blk = min(-(-S_att // r), state.blocks_BSbDi.shape[1])  # blocks that start below S_att
    k_top = min(dims.block_topk, n_blk)
    taped = (k_BTDi,) if tape else ()
    if k_top == n_blk:  # the budget covers every complete block: dense causal attention
        return (causal_BTS, state) + taped

    q = linear(x_BTD, p.q_proj, kernels).astype(jnp.float32).reshape(B, T, Hi, Di)
    q = rope(rms_norm(q, p.q_norm_Di, dims.rms_eps), pos_BT, dims)
    n_done_BT = (pos_BT + 1) // r  # blocks the query has seen completely
    seen_BTSb = jnp.arange(n_blk)[None, None, :] < n_done_BT[:, :, None]
    score_BTSb = jnp.where(seen_BTSb, _scores(q, state.blocks_BSbDi[:, :n_blk], dims), -jnp.inf)
    # [B, T, k_top]; equal scores (exact 0s: see the docstring) go to the lower block, as lax.top_k orders
    # them; a query with fewer blocks picks unseen ones too
    _, top = jax.lax.top_k(score_BTSb, k_top)
    chosen = jnp.zeros((B, T, n_blk), bool).at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None],
                                                  top].set(True)
    chosen = chosen & seen_BTSb
    blk_S = s_S // r
    in_blocks = jnp.take(chosen, jnp.minimum(blk_S, n_blk - 1), axis=2) & (blk_S < n_blk)[None, None, :]
    tail = (s_S[None, None, :] >= (n_done_BT * r)[:, :, None]) & causal_BTS
    mask_BTS = jnp.where(valid_BT[:, :, None], in_blocks | tail, causal_BTS)
    return (mask_BTS, state) + taped
