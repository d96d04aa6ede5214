"""qwen4exp PLE: hashed n-gram embeddings injected into the hyper-connection streams of a layer.

Per token, each of Gp = (ngram_size - 1) * heads_per_ngram hash heads picks one row of one shared
table (`per_layer_token_embd`, GGUF): head h of the n-gram of order g hashes the token and its g - 1
predecessors (an EOS among them cuts the context: the cut positions read as EOS) to
`((t0*m0) ^ (t1*m1) ^ ...) % vocab[h] + offset[h]`. The concatenated rows project to one value and one
key per stream; a sqrt-sign gate of key . query picks how much value each stream gets, and a dilated
(dilation = ngram_size) depthwise causal conv over the normed gated values adds local context.

The hash needs exact 64-bit products and remainders. The project runs without jax_enable_x64, so it is
done in uint32 limbs (`_mul64`, `_mod64`) inside jit, bit-exact with transformers' int64 arithmetic.

The real table is far larger than a GPU's memory, so it can stay in host memory (`pinned_host`): the
row indices are computed on the device, then only those rows are gathered on the host (XLA host
compute) and cross the bus; a small model can keep it resident ("device").

References: transformers qwen4_exp (Qwen4ExpTextNGramEmbedding, Qwen4ExpTextPLELayer), llama.cpp's
conversion/qwen4exp.py (the GGUF layout) and src/models/qwen4exp.cpp.

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
import jax.experimental.compute_on as compute_on_api
from jax.sharding import SingleDeviceSharding

from strata_jax.core import hostrows
from strata_jax.core.qtensor import QTensor
from strata_jax.gguf import quant
from strata_jax.model.dims import PLEDims
from strata_jax.model.kernels import Kernels
from strata_jax.model.layers.basic import linear, rms_norm

TABLE_NAME = "per_layer_token_embd.weight"
MEMORY_KINDS = ("device", "pinned_host")


# ---------------------------------------------------------------------------------------------------
# Exact 64-bit hash arithmetic in uint32 limbs


def _u32(v: int) -> jax.Array:
    return jnp.uint32(v & 0xFFFFFFFF)


def _mul64(t: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """(hi, lo) uint32 words of t * m mod 2**64, t uint32 (a token id), m a Python int constant."""
    m_hi, m_lo = m >> 32, m & 0xFFFFFFFF
    a0, a1 = t & 0xFFFF, t >> 16
    b0, b1 = _u32(m_lo & 0xFFFF), _u32(m_lo >> 16)
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1  # each < 2**32
    mid = (p00 >> 16) + (p01 & 0xFFFF) + (p10 & 0xFFFF)  # < 3 * 2**16
    lo = (p00 & 0xFFFF) | (mid << 16)
    hi = p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16) + t * _u32(m_hi)  # wraps mod 2**32, as wanted
    return hi, lo


def _mod64(hi: jax.Array, lo: jax.Array, p: jax.Array, p_max: int) -> jax.Array:
    """(hi * 2**32 + lo) % p in uint32, for p <= p_max < 2**31: hi % p first, then lo folded in,
    k bits at a time with k small enough that r * 2**k + chunk never passes 2**32 (r < p)."""
    k = 32 - p_max.bit_length()
    r = hi % p
    done = 0
    while done < 32:
        w = min(k, 32 - done)  # bits of lo still to fold, most significant first
        shift = 32 - done - w
        chunk = (lo >> shift) & _u32((1 << w) - 1)
        r = ((r << w) | chunk) % p
        done += w
    return r


def ngram_rows(tokens_BT: jax.Array, ctx_BKc: jax.Array, dims: PLEDims) -> jax.Array:
    """Table rows int32 [B, T, Gp] of every token, given the n-gram context before the chunk.

    ctx_BKc: the previous ngram_size - 1 token ids + 1, oldest first; 0 is "no token" and reads as EOS
    (a fresh row, as transformers' empty cache and llama.cpp's missing predecessors)."""
    n, eos = dims.ngram_size, dims.eos_token_id
    T = tokens_BT.shape[1]
    hist = jnp.concatenate([jnp.where(ctx_BKc > 0, ctx_BKc - 1, eos), tokens_BT.astype(jnp.int32)], axis=1)
    # vals[s]: the token s positions back, or EOS once an EOS lies between it and the token (inclusive
    # of the older end): the token's own EOS does not cut its context, as in transformers' shift
    vals = [tokens_BT.astype(jnp.int32)]
    cut = jnp.zeros(tokens_BT.shape, bool)
    for s in range(1, n):
        prev = jax.lax.slice_in_dim(hist, n - 1 - s, n - 1 - s + T, axis=1)
        cut = cut | (prev == eos)
        vals.append(jnp.where(cut, eos, prev))
    words = [_mul64(v.astype(jnp.uint32), m) for v, m in zip(vals, dims.layer_multipliers)]

    his, los = [], []
    hi, lo = words[0]
    for g in range(2, n + 1):  # n-grams of order g use tokens 0 .. g - 1
        hi, lo = hi ^ words[g - 1][0], lo ^ words[g - 1][1]
        his += [hi] * dims.heads_per_ngram
        los += [lo] * dims.heads_per_ngram
    p_Gp = jnp.asarray(np.array(dims.head_vocab_sizes, np.uint32))
    off_Gp = jnp.asarray(np.array(dims.head_offsets, np.int32))
    r = _mod64(jnp.stack(his, -1), jnp.stack(los, -1), p_Gp, max(dims.head_vocab_sizes))
    return r.astype(jnp.int32) + off_Gp


def next_ctx(tokens_BT: jax.Array, ctx_BKc: jax.Array, n_valid_B: jax.Array) -> jax.Array:
    """The n-gram context after each row's last valid token (padding past n_valid_B leaves it)."""
    hist = jnp.concatenate([ctx_BKc, tokens_BT.astype(jnp.int32) + 1], axis=1)
    return _window_at(hist, n_valid_B, ctx_BKc.shape[1])


def _window_at(x_BS: jax.Array, start_B: jax.Array, n: int) -> jax.Array:
    """x[b, start_B[b] : start_B[b] + n] along axis 1, per row."""
    idx = start_B.astype(jnp.int32)[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
    idx = idx.reshape(idx.shape + (1,) * (x_BS.ndim - 2))
    return jnp.take_along_axis(x_BS, idx, axis=1)


# ---------------------------------------------------------------------------------------------------
# The table and its gather


@struct.dataclass
class PLETable:
    """per_layer_token_embd [rows, row_dim] as GGML rows, in device memory or in pinned host memory."""

    rows: QTensor
    memory_kind: str = struct.field(pytree_node=False)  # one of MEMORY_KINDS
    # a host table's address for the host-rows kernel (core/hostrows.py), uint32 [2] on the device; None:
    # a decode step's rows are copied by a loop of DMAs
    addr: jax.Array | None = None
    # `addressed` (several cards): the host table's rows; `rows` then holds none of them (shape [0, row bytes])
    n_rows: int = struct.field(pytree_node=False, default=0)

    def addressed(self, device) -> "PLETable":
        """A host table as a program on several cards takes it: its address and shape, every gather by the
        kernel, so the table is not an operand (replicated, it would be a host copy per card). The caller
        keeps the array."""
        addr = self.addr if self.addr is not None else hostrows.addresses([self.rows.data], device)[0]
        data = self.rows.data
        return self.replace(rows=QTensor(np.zeros((0,) + data.shape[1:], data.dtype), self.rows.qtype,
                                         self.rows.n_cols), addr=addr, n_rows=data.shape[0])


def place_table(qt: QTensor, memory_kind: str = "device", device: Any = None, kernel: bool | None = None) -> PLETable:
    """Put the table's bytes (numpy or jax) in `memory_kind` memory of `device` (default: the first).
    kernel: read a host table's rows with the host-rows kernel (default: on a GPU, where it builds)."""
    if memory_kind not in MEMORY_KINDS:
        raise ValueError(f"PLE table memory_kind={memory_kind!r}: choose one of {MEMORY_KINDS}")
    device = device or jax.devices()[0]
    data = jax.device_put(qt.data, SingleDeviceSharding(device, memory_kind=memory_kind))
    addr = None
    if memory_kind == "pinned_host" and (device.platform == "gpu" if kernel is None else kernel) \
            and hostrows.available(device):
        addr = (hostrows.addresses([data], device) or (None,))[0]
    return PLETable(QTensor(data, qt.qtype, qt.n_cols), memory_kind, addr)


def _take(data, idx):
    return jnp.take(data, idx, axis=0, mode="clip")


# The gather runs on the host CPU over the host-resident table (a gather from device code is refused:
# its operands must share a memory space); only its result crosses the bus. jax 0.10 names the keyword
# form compute_on2, jax 0.11 compute_on.
_compute_on = getattr(compute_on_api, "compute_on2", None) or compute_on_api.compute_on
_host_take = _compute_on(_take, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)


# Up to this many rows (a decode step's), a host table is read with one DMA per row from device code, as the
# expert misses are: host compute inside the decode loop would keep the loop off the GPU's command buffers
# and make the host drive every step. Larger gathers (prefill chunks) take the host compute gather.
DMA_ROWS_MAX = 512


def _dma_take(data, idx_N: jax.Array) -> jax.Array:
    """data[idx_N] (clipped, as _take) copied row by row from host memory into a device array."""
    idx_N = jnp.clip(idx_N, 0, data.shape[0] - 1)

    def body(i, out):
        row = jax.device_put(jax.lax.dynamic_index_in_dim(data, idx_N[i], 0, keepdims=False), jax.memory.Space.Device)
        return jax.lax.dynamic_update_index_in_dim(out, row, i, 0)

    return jax.lax.fori_loop(0, idx_N.shape[0], body, jnp.zeros((idx_N.shape[0],) + data.shape[1:], data.dtype))


def _kernel_take(addr_2: jax.Array, data, idx_N: jax.Array, R: int) -> jax.Array:
    """data[idx_N] (clipped, as _take; data: the table or a stand-in of its row shape and dtype, R its rows) by
    one call of the host-rows kernel (core/hostrows.py)."""
    N, W = idx_N.shape[0], data.shape[1]
    size = jnp.dtype(data.dtype).itemsize
    out_NB = hostrows.host_rows(addr_2, jnp.zeros((N, W * size), jnp.uint8), jnp.clip(idx_N, 0, R - 1),
                                jnp.arange(N, dtype=jnp.int32), jnp.ones((N,), bool), R)
    if data.dtype == jnp.uint8:
        return out_NB
    return jax.lax.bitcast_convert_type(out_NB.reshape(N, W, size), data.dtype)


def gather_rows(table: PLETable, idx_N: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Rows idx_N of the table, dequantized on the device: dtype [N, row_dim]. A host table sends only
    these rows' bytes to the device."""
    qt = table.rows
    if table.memory_kind == "device":
        return quant.take_rows(qt, idx_N, dtype)
    if table.n_rows:  # addressed (several cards): the kernel at every size
        raw = _kernel_take(table.addr, qt.data, idx_N, table.n_rows)
    elif table.addr is not None and idx_N.shape[0] <= DMA_ROWS_MAX:
        raw = _kernel_take(table.addr, qt.data, idx_N, qt.data.shape[0])
    elif idx_N.shape[0] <= DMA_ROWS_MAX:
        raw = _dma_take(qt.data, idx_N)
    else:
        raw = jax.device_put(_host_take(qt.data, jax.device_put(idx_N, jax.memory.Space.Host)), jax.memory.Space.Device)
    return quant.dequant(QTensor(raw, qt.qtype, qt.n_cols), dtype)


def embed(table: PLETable, rows_BTGp: jax.Array, dtype=jnp.float32) -> jax.Array:
    """The concatenated rows of every token, heads slowest: [B, T, Gp * row_dim] (transformers' flatten)."""
    B, T, Gp = rows_BTGp.shape
    return gather_rows(table, rows_BTGp.reshape(-1), dtype).reshape(B, T, Gp * table.rows.n_cols)


# ---------------------------------------------------------------------------------------------------
# The layer


@struct.dataclass
class PLEParams:
    """One PLE layer, GGUF tensors `blk.{i}.ple_*` (norm weights already +1: the converter adds it)."""

    ple_key: QTensor  # [Hc * D, Gp * row_dim]
    ple_value: QTensor  # [D, Gp * row_dim]
    ple_norm_key_HcD: jax.Array  # float32
    ple_norm_query_HcD: jax.Array
    ple_norm_conv_HcD: jax.Array
    ple_conv1d_CcKc: jax.Array  # float32 depthwise taps, oldest first (torch's [Cc, 1, Kc] squeezed)
    table: PLETable  # per_layer_token_embd (shared by the file's PLE layer)

    @classmethod
    def from_gguf(cls, get: Callable[[str], Any], layer: int, dims: PLEDims,
                  table_memory_kind: str = "device", device: Any = None) -> "PLEParams":
        """get(name) -> QTensor or array (numpy or jax), e.g. over WeightLoader; matrices stay as they
        come (quantized or not), small tensors become float32 arrays; the table goes to
        `table_memory_kind` memory ("pinned_host" keeps it off the device)."""
        p = f"blk.{layer}."
        D, Hc, E, Cc, Kc = dims.d_model, dims.hc_count, dims.embed_dim, dims.channels, dims.conv_kernel
        table = _matrix(get(TABLE_NAME), (None, dims.row_dim), TABLE_NAME, put=np.asarray)  # placed below
        if table.shape[0] < dims.n_rows:
            raise ValueError(f"{TABLE_NAME} has {table.shape[0]} rows, too few for the PLE head ranges "
                             f"({dims.n_rows})")

        def norm(name):  # stored [Hc * D]; llama.cpp views it [n_embd, hc]
            return _vector(get(p + name), (Hc * D,), p + name).reshape(Hc, D)

        return cls(
            ple_key=_matrix(get(p + "ple_key.weight"), (Hc * D, E), p + "ple_key.weight"),
            ple_value=_matrix(get(p + "ple_value.weight"), (D, E), p + "ple_value.weight"),
            ple_norm_key_HcD=norm("ple_norm_key.weight"),
            ple_norm_query_HcD=norm("ple_norm_query.weight"),
            ple_norm_conv_HcD=norm("ple_norm_conv.weight"),
            ple_conv1d_CcKc=_vector(get(p + "ple_conv1d.weight"), (Cc, Kc), p + "ple_conv1d.weight"),
            table=place_table(table, table_memory_kind, device),
        )


def _matrix(t, shape, name, put=jnp.asarray) -> QTensor:
    qt = t if isinstance(t, QTensor) else QTensor(put(t), None, int(np.shape(t)[-1]))
    if len(qt.shape) != len(shape) or any(want is not None and got != want for got, want in zip(qt.shape, shape)):
        raise ValueError(f"tensor {name!r} has shape {qt.shape}, expected {shape}")
    return qt


def _vector(t, shape, name) -> jax.Array:
    a = quant.dequant(t, jnp.float32) if isinstance(t, QTensor) else jnp.asarray(t, jnp.float32)
    if a.shape != shape:
        raise ValueError(f"tensor {name!r} has shape {a.shape}, expected {shape}")
    return a


def loader_get(loader) -> Callable[[str], Any]:
    """`get` for PLEParams.from_gguf over a WeightLoader (model/weights.py): matrices as its QTensors,
    small tensors as float32, and the table as the file's own (memory-mapped) GGML rows, so that
    place_table copies it once, straight into the memory it is meant for (never through the device)."""

    def get(name: str):
        t = loader.info(name, loader.gguf.tensor(name).shape)
        if name == TABLE_NAME:
            return QTensor(t.data, t.ggml_type, t.shape[-1])
        if len(t.shape) == 2 and not name.endswith("ple_conv1d.weight"):
            return loader.qtensor(name, t.shape)
        return loader.f32(name, t.shape)

    return get


@struct.dataclass
class PLEState:
    """Per row: the n-gram context (the last ngram_size - 1 token ids + 1, oldest first; 0 = none) and
    the conv's last (Kc - 1) * ngram_size inputs. All zeros is a fresh sequence."""

    ctx_BKc: jax.Array  # int32 [B, ngram_size - 1]
    conv_BKcCc: jax.Array  # float32 [B, (Kc - 1) * ngram_size, Hc * D]

    @classmethod
    def zeros(cls, B: int, dims: PLEDims) -> "PLEState":
        return cls(jnp.zeros((B, dims.ngram_size - 1), jnp.int32),
                   jnp.zeros((B, dims.conv_state_len, dims.channels), jnp.float32))


def rewind(before: PLEState, conv_in_BTCc: jax.Array, tokens_BT: jax.Array, n_B: jax.Array, dims: PLEDims) -> PLEState:
    """The state after only the first n_B of a pass's tokens, from the state before it and the conv inputs
    it computed (apply's `tape`): no weights read."""
    seq = jnp.concatenate([before.conv_BKcCc, conv_in_BTCc], axis=1)
    return PLEState(next_ctx(tokens_BT, before.ctx_BKc, n_B), _window_at(seq, n_B, dims.conv_state_len))


def apply(params: PLEParams, x: jax.Array, tokens_BT: jax.Array, state: PLEState, *, n_valid_B: jax.Array,
          dims: PLEDims, kernels: Kernels, tape: bool = False):
    """The PLE layer's output (what transformers' Qwen4ExpTextPLELayer returns: the caller adds it to
    the streams) for x [B, T, Hc * D] or [B, T, Hc, D] (returned in x's shape) and the chunk's token ids.
    Tokens at index >= n_valid_B[b] are computed but leave the state as the last valid one left it. Returns
    (out, state), and with `tape` (static) the conv's inputs [B, T, Cc] (float32) last, what `rewind` needs."""
    B, T = tokens_BT.shape
    D, Hc, eps = dims.d_model, dims.hc_count, dims.rms_eps
    x_BTHcD = x.reshape(B, T, Hc, D)

    emb = embed(params.table, ngram_rows(tokens_BT, state.ctx_BKc, dims), x.dtype)
    key = rms_norm(linear(emb, params.ple_key, kernels).reshape(B, T, Hc, D), params.ple_norm_key_HcD, eps)
    value_BTD = linear(emb, params.ple_value, kernels)
    query = rms_norm(x_BTHcD, params.ple_norm_query_HcD, eps)
    s_BTHc1 = jnp.sum(key.astype(jnp.float32) * query.astype(jnp.float32), -1, keepdims=True) / math.sqrt(D)
    gate = jnp.sqrt(jnp.maximum(jnp.abs(s_BTHc1), 1e-6)) * jnp.sign(s_BTHc1)
    gated = (jax.nn.sigmoid(gate) * value_BTD[:, :, None, :].astype(jnp.float32)).astype(x.dtype)
    normed = rms_norm(gated, params.ple_norm_conv_HcD, eps).reshape(B, T, Hc * D)

    # depthwise causal conv, dilation ngram_size: tap k reads (Kc - 1 - k) * dilation steps back
    seq = jnp.concatenate([state.conv_BKcCc, normed.astype(jnp.float32)], axis=1)  # [B, Kc + T, Cc]
    dil, w = dims.ngram_size, params.ple_conv1d_CcKc
    conv = sum(jax.lax.slice_in_dim(seq, k * dil, k * dil + T, axis=1) * w[:, k] for k in range(dims.conv_kernel))
    out = gated.reshape(B, T, Hc * D) + jax.nn.silu(conv).astype(x.dtype)

    new_state = PLEState(next_ctx(tokens_BT, state.ctx_BKc, n_valid_B),
                         _window_at(seq, n_valid_B, dims.conv_state_len))
    if tape:
        return out.reshape(x.shape), new_state, seq[:, seq.shape[1] - T:]
    return out.reshape(x.shape), new_state
