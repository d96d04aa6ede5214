"""The KV cache's storage types and their one layout: quantized where a step writes, dequantized where
attention reads a span or a block.

- f16: the compute dtype as is (bfloat16 on an accelerator, float32 on CPU), a plain array.
- q8_0: GGML's Q8_0: per 32 values along the head dim one float16 scale d = max|x| / 127 and int8
  q = round(x / d); x ~ q d (34 bytes per 32 values).
- q4_0: GGML's Q4_0: d = m / -8 with m the block's value of largest magnitude, q = clip(round(x / d) + 8,
  0, 15) two a byte; x ~ (q - 8) d (18 bytes per 32 values).

The values and scales are GGML's blocks' fields as separate arrays (gguf-py's quantizers give the same
bytes), not byte blocks: nothing but attention reads the cache. The error per value is d / 2 for q8_0
(plus the float16 rounding of d, times q), up to |d| for q4_0 (a block's extreme maps to -8 d exactly, the
opposite sign reaches only 7 |d|).

A cache leaf is a plain array (f16) or a QuantKV (q8_0, q4_0) of the same logical shape
[L, B, S, K, Dh]; write/read/read_block take either, so attention has one code path. The hybrid
family's recurrent state is not a KV leaf: it stays float32.

Shape legend: strata_jax/core/shapes.py (Y: blocks along the head dim, Q: values per block).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from strata_jax.core.errors import ConfigError
from strata_jax.core.layer_ref import scatter_updates

KV_TYPES = ("f16", "q8_0", "q4_0")
BLOCK = 32  # values per scale, along the head dim
SCALE_DTYPE = jnp.float16


@struct.dataclass
class QuantKV:
    """A quantized cache leaf: q int8 [..., Dh] (q8_0) or uint8 [..., Dh / 2] (q4_0, two values a
    byte), scale float16 [..., Dh / 32]. `shape` is the logical (dequantized) shape."""

    q: jax.Array
    scale: jax.Array

    @property
    def kind(self) -> str:
        return "q8_0" if self.q.dtype == jnp.int8 else "q4_0"

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.scale.shape[:-1], self.scale.shape[-1] * BLOCK)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


def kinds(kv: str) -> tuple[str, str]:
    """(key type, value type) of an EngineConfig.kv: "q8_0" for both, or "K,V" such as "q8_0,q4_0"."""
    k, _, v = kv.partition(",")
    return k, v or k


def check_kv(kv, name: str = "kv") -> str:
    """The option normalized ("q8_0,q8_0" -> "q8_0"), or a ConfigError naming the allowed values."""
    parts = [p.strip() for p in kv.split(",")] if isinstance(kv, str) else []
    if not 1 <= len(parts) <= 2 or any(p not in KV_TYPES for p in parts):
        shown = f"{name} {kv!r}" if name.startswith("-") else f"{name}={kv!r}"
        raise ConfigError(f"{shown} is invalid: it must be one of {', '.join(KV_TYPES)} (the KV cache's storage: "
                          "f16 is the compute dtype, q8_0 and q4_0 are 8- and 4-bit blocks of 32 with a float16 "
                          "scale), or K,V for separate key and value types such as q8_0,q4_0.")
    return parts[0] if len(parts) == 1 or parts[0] == parts[1] else ",".join(parts)


def check_model_kv(kv: str, cfg) -> None:
    """A quantized type needs head dims in whole blocks of 32; MLA's latent (keys and values at once)
    takes one type."""
    k, v = kinds(kv)
    (_, k_dim), v_dims = cfg.kv_cache_dims
    if v_dims is None and k != v:
        raise ConfigError(f"kv={kv!r} (--kv) gives keys and values separate types, but {cfg.arch}'s latent cache "
                          f"holds both in one; give one type, e.g. kv={k!r}.")
    for kind, dim in ((k, k_dim), (v, v_dims[1] if v_dims else k_dim)):
        if kind != "f16" and dim % BLOCK:
            raise ConfigError(f"kv={kv!r} (--kv) needs cached head dims in whole blocks of {BLOCK}, but {cfg.arch} "
                              f"caches {dim} values per head; use kv='f16'.")


def nbytes(kind: str, n_values: int, itemsize: int) -> int:
    """Bytes of n_values cached values of this type (itemsize: the compute dtype's, for f16)."""
    if kind == "f16":
        return n_values * itemsize
    scales = -(-n_values // BLOCK) * jnp.dtype(SCALE_DTYPE).itemsize
    return (n_values if kind == "q8_0" else -(-n_values // 2)) + scales


def quantize(x: jax.Array, kind: str) -> QuantKV:
    """x [..., Dh] (Dh a multiple of 32) as a QuantKV of `kind` (q8_0 or q4_0): ggml-quants.c's reference
    quantizers step for step (the scale computed in float32, stored as float16)."""
    x_YQ = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    if kind == "q8_0":
        d = jnp.max(jnp.abs(x_YQ), axis=-1) / 127
        y = x_YQ * _inverse(d)[..., None]
        a = jnp.abs(y)  # roundf (halves away from zero) as gguf-py writes it: no a + 0.5 to round up
        q = jnp.sign(y) * (jnp.floor(a) + jnp.floor(2 * (a - jnp.floor(a))))
        return QuantKV(q.astype(jnp.int8).reshape(x.shape), d.astype(SCALE_DTYPE))
    m = jnp.take_along_axis(x_YQ, jnp.argmax(jnp.abs(x_YQ), axis=-1)[..., None], axis=-1)[..., 0]
    d = m / -8  # the value of largest magnitude becomes q = 0 exactly
    q = jnp.clip(jnp.floor(x_YQ * _inverse(d)[..., None] + 8.5), 0, 15).astype(jnp.uint8)
    half = BLOCK // 2  # GGML's byte order: value j in the low nibble of byte j, value j + 16 in its high nibble
    packed = q[..., :half] | (q[..., half:] << 4)
    return QuantKV(packed.reshape(*x.shape[:-1], x.shape[-1] // 2), d.astype(SCALE_DTYPE))


def _inverse(d: jax.Array) -> jax.Array:
    return jnp.where(d == 0, 0.0, 1.0 / jnp.where(d == 0, 1.0, d))


def dequantize(c: QuantKV, dtype) -> jax.Array:
    """The values a QuantKV stands for, [..., Dh] in dtype."""
    *lead, y = c.scale.shape
    if c.kind == "q8_0":
        q_YQ = c.q.reshape(*lead, y, BLOCK).astype(jnp.float32)
    else:
        b = c.q.reshape(*lead, y, BLOCK // 2)
        q_YQ = jnp.concatenate([b & 15, b >> 4], axis=-1).astype(jnp.float32) - 8
    return (q_YQ * c.scale.astype(jnp.float32)[..., None]).reshape(*lead, y * BLOCK).astype(dtype)


def zeros(shape: tuple[int, ...], kind: str, dtype) -> jax.Array | QuantKV:
    """An empty cache leaf of logical shape [..., Dh]."""
    if kind == "f16":
        return jnp.zeros(shape, dtype)
    *lead, dh = shape
    q = jnp.zeros((*lead, dh if kind == "q8_0" else dh // 2), jnp.int8 if kind == "q8_0" else jnp.uint8)
    return QuantKV(q, jnp.zeros((*lead, dh // BLOCK), SCALE_DTYPE))


def stored(new_BTKDh: jax.Array, c_LBSKDh, dtype) -> jax.Array:
    """The entries as a read of the leaf gives them back once written: cast to its dtype, or quantized and
    dequantized to dtype."""
    if not isinstance(c_LBSKDh, QuantKV):
        return new_BTKDh.astype(c_LBSKDh.dtype)
    return dequantize(quantize(new_BTKDh, c_LBSKDh.kind), dtype)


def write(c_LBSKDh, layer: int, pos_BT: jax.Array, new_BTKDh: jax.Array):
    """The (donated) cache leaf with the step's entries scattered into layer `layer` at pos_BT, in place,
    quantized first where the leaf is; positions past the cache (an idle row) are dropped."""
    pos_BT, new_BTKDh = scatter_updates(pos_BT, new_BTKDh, c_LBSKDh.shape[2])
    b_idx = jnp.arange(pos_BT.shape[0])[:, None]
    if not isinstance(c_LBSKDh, QuantKV):
        return c_LBSKDh.at[layer, b_idx, pos_BT].set(new_BTKDh.astype(c_LBSKDh.dtype), mode="drop")
    new = quantize(new_BTKDh, c_LBSKDh.kind)
    return jax.tree.map(lambda a, n: a.at[layer, b_idx, pos_BT].set(n, mode="drop"), c_LBSKDh, new)


def read(c_LBSKDh, layer: int, start, size: int, dtype) -> jax.Array:
    """Positions start..start+size-1 of layer `layer`, [B, size, K, Dh]: a plain leaf as stored, a
    QuantKV dequantized to dtype (only these positions, so a blocked read stays one block)."""
    def take(a):
        return jax.lax.dynamic_slice(a, (layer, 0, start, 0, 0), (1, a.shape[1], size, *a.shape[3:]))[0]

    if not isinstance(c_LBSKDh, QuantKV):
        return take(c_LBSKDh)
    return dequantize(jax.tree.map(take, c_LBSKDh), dtype)
