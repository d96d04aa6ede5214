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
[L, B, S, K, Dh], or a StreamedKV (--kv-resident) holding either for its first cells on the device and
the rest in pinned host memory; write/read take any, so attention has one code path. The hybrid
family's recurrent state is not a KV leaf: it stays float32.

Shape legend: strata_jax/core/shapes.py (Y: blocks along the head dim, Q: values per block).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from strata_jax.core.errors import ConfigError
from strata_jax.core import hostrows
from strata_jax.core.hostrows import host_put, host_rows
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
    if isinstance(c_LBSKDh, StreamedKV):
        c_LBSKDh = c_LBSKDh.dev
    if not isinstance(c_LBSKDh, QuantKV):
        return new_BTKDh.astype(c_LBSKDh.dtype)
    return dequantize(quantize(new_BTKDh, c_LBSKDh.kind), dtype)


def write(c_LBSKDh, layer: int, pos_BT: jax.Array, new_BTKDh: jax.Array):
    """The (donated) cache leaf with the step's entries scattered into layer `layer` at pos_BT, in place,
    quantized first where the leaf is; positions past the cache (an idle row) are dropped."""
    if isinstance(c_LBSKDh, StreamedKV):
        return c_LBSKDh.write(layer, pos_BT, new_BTKDh)
    pos_BT, new_BTKDh = scatter_updates(pos_BT, new_BTKDh, c_LBSKDh.shape[2])
    b_idx = jnp.arange(pos_BT.shape[0])[:, None]
    if not isinstance(c_LBSKDh, QuantKV):
        return c_LBSKDh.at[layer, b_idx, pos_BT].set(new_BTKDh.astype(c_LBSKDh.dtype), mode="drop")
    new = quantize(new_BTKDh, c_LBSKDh.kind)
    return jax.tree.map(lambda a, n: a.at[layer, b_idx, pos_BT].set(n, mode="drop"), c_LBSKDh, new)


def read(c_LBSKDh, layer: int, start, size: int, dtype, upto=None, want_BSr=None) -> jax.Array:
    """Positions start..start+size-1 of layer `layer`, [B, size, K, Dh]: a plain leaf as stored, a
    QuantKV dequantized to dtype (only these positions, so a blocked read stays one block). upto: no
    query sees a position at or past it; want_BSr (bool): the positions some query of the row may see
    (QSA's selected blocks): a streamed leaf brings only those over, the others read as zeros."""
    if isinstance(c_LBSKDh, StreamedKV):
        return c_LBSKDh.read(layer, start, size, dtype, upto, want_BSr)
    def take(a):
        return jax.lax.dynamic_slice(a, (layer, 0, start, 0, 0), (1, a.shape[1], size, *a.shape[3:]))[0]

    if not isinstance(c_LBSKDh, QuantKV):
        return take(c_LBSKDh)
    return dequantize(jax.tree.map(take, c_LBSKDh), dtype)


# -- KV streaming (--kv-resident): a leaf's first cells on the device, the rest in pinned host memory ---------

@struct.dataclass
class HostKV:
    """A streamed leaf's cells past the device's, in pinned host memory: per array of its device leaf (a
    plain array, or a QuantKV's q and scale) uint8 [L * Bh * Sh, cell bytes] (layer, host row, position
    past the resident ones; Bh: the session's rows), and its address for the host-rows kernels."""

    cells: tuple[jax.Array, ...]
    addr: tuple[jax.Array, ...]
    # the cells' shapes where the arrays are not carried (`addressed`: what a program takes)
    shapes: tuple[tuple[int, int], ...] = struct.field(pytree_node=False, default=())

    def shape(self, i: int) -> tuple[int, int]:
        return tuple(self.cells[i].shape) if self.cells else self.shapes[i]

    def addressed(self) -> "HostKV":
        """What a step takes: the kernels' addresses and the shapes. The arrays stay with the engine (the
        kernels read and write them by address), so a program on several cards needs no host copy per card."""
        return self.replace(cells=(), shapes=tuple(self.shape(i) for i in range(len(self.addr))))


@struct.dataclass
class StreamedKV:
    """A KV cache leaf of logical shape [L, B, length, ...] whose positions below `resident` are the device
    leaf `dev` [L, B, resident, ...] (plain or QuantKV) and the others host memory (`host`, joined for a
    call and None in the donated state: the engine keeps it). A step writes its cells past the device's
    into host memory and reads them back, both by kernels inside the step (core/hostrows.py); `token`
    (aliased by every write, an operand of every read) orders a read after the writes before it. rows_B: each
    batch entry's row of the host arrays (a take_row view has one)."""

    dev: jax.Array | QuantKV
    token: jax.Array  # uint8 [1]
    rows_B: jax.Array  # int32 [B]
    host: HostKV | None = None
    length: int = struct.field(pytree_node=False, default=0)
    host_rows: int = struct.field(pytree_node=False, default=1)  # Bh

    @property
    def resident(self) -> int:
        return self.dev.shape[2]

    @property
    def shape(self) -> tuple[int, ...]:
        L, B, _, *rest = self.dev.shape
        return (L, B, self.length, *rest)

    @property
    def nbytes(self) -> int:
        return self.dev.nbytes

    def _rows(self, layer, s_BSr: jax.Array) -> jax.Array:
        """The host row of each (batch entry, position) at `layer` (valid for resident <= s < length)."""
        Sh = self.length - self.resident
        return (layer * self.host_rows + self.rows_B[:, None]) * Sh + (s_BSr - self.resident)

    def write(self, layer, pos_BT: jax.Array, new_BTKDh: jax.Array) -> "StreamedKV":
        """The step's entries: those below `resident` into the device leaf (in place), the others into host
        memory (one kernel call per array)."""
        N = self.resident
        dev = write(self.dev, layer, jnp.where(pos_BT < N, pos_BT, N), new_BTKDh)  # N: past the leaf, dropped
        new = (new_BTKDh.astype(self.dev.dtype) if not isinstance(self.dev, QuantKV)
               else quantize(new_BTKDh, self.dev.kind))
        B, T = pos_BT.shape
        put_BT = (pos_BT >= N) & (pos_BT < self.length)
        row_BT = jnp.where(put_BT, self._rows(layer, pos_BT), -1)
        token = self.token
        for i, (n, addr) in enumerate(zip(jax.tree.leaves(new), self.host.addr)):
            src = jax.lax.bitcast_convert_type(n.reshape(B * T, -1), jnp.uint8).reshape(B * T, -1)
            token = host_put(addr, token, src, row_BT.reshape(-1), put_BT.reshape(-1), self.host.shape(i)[0])
        return self.replace(dev=dev, token=token)

    def read(self, layer, start, size: int, dtype, upto=None, want_BSr=None) -> jax.Array:
        """Positions start .. start + size - 1 (start: an int or traced), [B, size, ...] in dtype: those below
        `resident` from the device leaf, the others brought over from host memory (positions at or past
        upto, or not in want_BSr, which no query sees, are not: they read as zeros)."""
        N, B = self.resident, self.rows_B.shape[0]
        if isinstance(start, int) and start + size <= N:
            return read(self.dev, layer, start, size, dtype)
        s_Sr = start + jnp.arange(size, dtype=jnp.int32)
        near_Sr = jnp.clip(s_Sr, 0, N - 1)
        far_Sr = (s_Sr >= N) & (s_Sr < self.length) & (True if upto is None else s_Sr < upto)
        far_BSr = jnp.broadcast_to(far_Sr, (B, size)) if want_BSr is None else far_Sr[None] & want_BSr
        row_BSr = jnp.where(far_BSr, self._rows(layer, jnp.broadcast_to(s_Sr, (B, size))), -1).reshape(-1)
        # the token (always 0) added to the copy flags: a real operand, so the read runs after every write
        # before it (an optimization barrier ties values, not the runtime's order of the calls)
        get_BSr = far_BSr.reshape(-1).astype(jnp.int32) + self.token[0].astype(jnp.int32)
        at = jnp.arange(B * size, dtype=jnp.int32)
        parts = []
        for i, (a, addr) in enumerate(zip(jax.tree.leaves(self.dev), self.host.addr)):
            layer_a = jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False)  # [B, N, ...]
            near = jnp.take(layer_a, near_Sr, axis=1)  # [B, Sr, ...]
            n_rows, width = self.host.shape(i)
            got = host_rows(addr, jnp.zeros((B * size, width), jnp.uint8), row_BSr, at, get_BSr, n_rows)
            w = a.dtype.itemsize
            far = jax.lax.bitcast_convert_type(got if w == 1 else got.reshape(B * size, -1, w), a.dtype)
            far = far.reshape(near.shape)
            parts.append(jnp.where((s_Sr < N).reshape(1, size, *([1] * (near.ndim - 2))), near, far))
        if not isinstance(self.dev, QuantKV):
            return parts[0]
        return dequantize(jax.tree.unflatten(jax.tree.structure(self.dev), parts), dtype)

    def take_row(self, row) -> "StreamedKV":
        take = lambda a: jax.lax.dynamic_slice_in_dim(a, row, 1, axis=1)  # noqa: E731
        return self.replace(dev=jax.tree.map(take, self.dev),
                            rows_B=jax.lax.dynamic_slice_in_dim(self.rows_B, row, 1, axis=0))

    def put_row(self, row, one: "StreamedKV") -> "StreamedKV":
        put = lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b.astype(a.dtype), row, axis=1)  # noqa: E731
        return self.replace(dev=jax.tree.map(put, self.dev, one.dev), token=one.token)


def streamed(leaf, resident: int, device=None) -> StreamedKV:
    """A streamed leaf of `leaf`'s logical shape [L, B, S, ...] (an empty plain array or QuantKV): its first
    `resident` positions on the device (zeros), the other S - resident in pinned host memory (zeros; pageable
    where pinned memory cannot be had). The host-rows kernels must be available on the device's platform.
    device: a device, or a sharding (replicated on several cards: the host arrays then sit with the first card
    and every card reads and writes them by address)."""
    placement = device = device or jax.devices()[0]
    if isinstance(device, jax.sharding.NamedSharding):
        device = device.mesh.devices.flat[0]
    if not hostrows.available(device):
        raise ConfigError("--kv-resident streams the KV cache by the host-rows kernels, which are not available "
                          f"here ({hostrows.why_not(device)}): install a compiler (nvcc on a GPU, g++ on a CPU) "
                          "or keep the whole cache on the device (no --kv-resident).")
    L, B, S = leaf.shape[:3]
    if not 0 < resident < S:
        raise ConfigError(f"a streamed KV cache keeps 0 < resident < {S} positions on the device, not {resident}")
    dev = jax.tree.map(lambda a: jnp.zeros((L, B, resident, *a.shape[3:]), a.dtype), leaf)
    cells = []
    for a in jax.tree.leaves(leaf):
        shape = (L * B * (S - resident), cell_bytes(a))
        for kind in ("pinned_host", "unpinned_host"):
            try:
                cells.append(jax.device_put(np.zeros(shape, np.uint8),
                                            jax.sharding.SingleDeviceSharding(device, memory_kind=kind)))
                break
            except (RuntimeError, ValueError) as e:  # no such memory, or not that much of it
                if kind == "unpinned_host":
                    raise ConfigError(f"cannot allocate {shape[0] * shape[1]:,} bytes of host memory for the KV "
                                      f"cache's streamed cells ({e}): lower --ctx or raise --kv-resident.") from e
    addr = hostrows.addresses(cells, device)
    if addr is None:
        raise ConfigError("--kv-resident needs host memory the device can read (pinned memory): "
                          f"{hostrows.why_not(device) or 'the host arrays are not mapped'}.")
    token = jnp.zeros((1,), jnp.uint8)
    return StreamedKV(jax.device_put(dev, placement), jax.device_put(token, placement),
                      jax.device_put(jnp.arange(B, dtype=jnp.int32), placement),
                      HostKV(tuple(cells), jax.device_put(addr, placement)), length=S, host_rows=B)


def split_host(kv_leaf) -> tuple:
    """(the leaf without its host part, the host part) for a streamed leaf; (leaf, None) otherwise."""
    if isinstance(kv_leaf, StreamedKV):
        return kv_leaf.replace(host=None), kv_leaf.host
    return kv_leaf, None


def join_host(kv_leaf, host):
    return kv_leaf.replace(host=host) if isinstance(kv_leaf, StreamedKV) else kv_leaf


def _host_rows_of(leaf: StreamedKV, cells: jax.Array) -> np.ndarray:
    """A host array of the leaf as numpy, [L, Bh, Sh, cell bytes] (a view: see hostrows.host_view)."""
    L = leaf.dev.shape[0] if not isinstance(leaf.dev, QuantKV) else leaf.dev.q.shape[0]
    return hostrows.host_view(cells).reshape(L, leaf.host_rows, leaf.length - leaf.resident, -1)


def logical_row(leaf: StreamedKV, host: HostKV, row: int):
    """Row `row` of a streamed leaf over its whole length as host arrays [L, 1, length, ...] (plain or a
    QuantKV of them): what the conversation cache keeps. Every call writing the leaf must be finished."""
    parts = []
    for a, cells in zip(jax.tree.leaves(leaf.dev), host.cells):
        near = np.asarray(a[:, row:row + 1])
        far = _host_rows_of(leaf, cells)[:, row:row + 1].view(near.dtype)
        parts.append(np.concatenate([near, far.reshape(*near.shape[:2], -1, *near.shape[3:])], axis=2))
    return jax.tree.unflatten(jax.tree.structure(leaf.dev), parts)


_put_near = jax.jit(lambda dev, row, near: jax.tree.map(
    lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b.astype(a.dtype), row, axis=1), dev, near), donate_argnums=0)


def put_logical_row(leaf: StreamedKV, host: HostKV, row: int, value) -> StreamedKV:
    """The leaf with row `row` set from `value` (host arrays [L, 1, length, ...] as logical_row gives them):
    its first `resident` positions into the device leaf (donated), the others written into host memory.
    Every call reading the leaf must be finished."""
    N, vals = leaf.resident, jax.tree.leaves(value)
    for v, cells in zip(vals, host.cells):
        far = np.ascontiguousarray(np.asarray(v)[:, 0, N:leaf.length])
        _host_rows_of(leaf, cells)[:, row] = far.view(np.uint8).reshape(far.shape[0], far.shape[1], -1)
    near = jax.tree.unflatten(jax.tree.structure(leaf.dev), [np.asarray(v)[:, :, :N] for v in vals])
    return leaf.replace(dev=_put_near(leaf.dev, row, near))


def copy_host_row(leaf: StreamedKV, host: HostKV, src: int, dst: int) -> None:
    """Row src's host cells copied to row dst's (the device part is KVCache.put_row's). Every call using the
    leaf must be finished."""
    for cells in host.cells:
        view = _host_rows_of(leaf, cells)
        view[:, dst] = view[:, src]


def cell_bytes(a) -> int:
    """Bytes of one cache cell (one position's [...]) of a device leaf array [L, B, S, ...]."""
    n = 1
    for d in a.shape[3:]:
        n *= d
    return n * jnp.dtype(a.dtype).itemsize
