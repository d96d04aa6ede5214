"""The physical limit of a decode step and how close a measured run comes to it (the limit ratio).

Two bandwidths are measured once per process, before any model loads:
  link GB/s: one device_put of a ~1 GiB array in pinned host memory to the device, timed after a warm-up
             copy, best of a few (the fastest the link was seen to go: a stricter limit);
  HBM GB/s:  a jitted elementwise op over a ~1 GiB on-device array (x + 1), bytes read + written over
             its time, after a warm-up, best of a few.

Per decode token of a run (batch 1):
  PCIe bytes   = (missed + prefetched experts in the timed decode) x bytes per expert of their layer
                 / decode steps                                   (0 when every expert is resident)
  HBM bytes    = dense tensors of the GGUF except token_embd (looked up, not read: one row per token)
               + k experts' bytes in every MoE layer              (the routed experts, read once)
               + K and V of every layer for the average context of the timed decode
                 (prompt + half the generated tokens), as the cache stores them (--kv)
  limit s/token = PCIe bytes / link GB/s + HBM bytes / HBM GB/s   (no overlap of the two assumed)
  limit ratio   = limit s/token / measured s/token (1 / steady-state decode tok/s); 1.0 is the limit,
                  higher is impossible, and the issue-5 target for miss-bound decode is >= 0.8.
Sizes are the GGUF's own (quantized) bytes: what the engine keeps on the device and moves.

Shape legend: strata_jax/core/shapes.py; the letter that differs here: S counter columns (hits, misses, ...).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from strata_jax.model import kvquant, memory
from strata_jax.offload.sizing import DEFAULT_RESERVE
from strata_jax.core.units import fmt_bytes

log = logging.getLogger("strata_jax")

GiB = 1 << 30
_probes: dict | None = None


def _best_seconds(fn, reps: int) -> float:
    fn()  # warm-up: compilation, first-touch of the destination, DMA mappings
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidths(nbytes: int | None = None, reps: int = 3) -> dict:
    """{'link_GB_s', 'hbm_GB_s', 'probe_bytes', 'host_memory_kind'}; measured on the first call only."""
    global _probes
    if _probes is not None:
        return _probes
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    dev = jax.devices()[0]
    if nbytes is None:
        nbytes = GiB if dev.platform == "gpu" else 64 << 20  # a CPU "device" shares RAM: keep tests quick
    on_device = SingleDeviceSharding(dev, memory_kind="device")
    kind = "pinned_host"
    try:
        host = jax.device_put(np.zeros(nbytes, np.uint8), SingleDeviceSharding(dev, memory_kind=kind))
    except (RuntimeError, ValueError) as e:
        log.warning("no pinned host memory for the link probe (%s): measuring pageable copies", str(e)[:120])
        kind = "unpinned_host"
        host = jax.device_put(np.zeros(nbytes, np.uint8), SingleDeviceSharding(dev, memory_kind=kind))
    host.block_until_ready()

    def h2d():
        jax.device_put(host, on_device).block_until_ready()

    link_s = _best_seconds(h2d, reps)
    host = None  # frees the pinned buffer before the device probe
    x = jnp.zeros(nbytes // 4, jnp.uint32, device=dev)
    bump = jax.jit(lambda a: a + 1)

    def copy():
        bump(x).block_until_ready()

    hbm_s = _best_seconds(copy, reps)
    x = None
    _probes = {"link_GB_s": nbytes / link_s / 1e9, "hbm_GB_s": 2 * (nbytes // 4 * 4) / hbm_s / 1e9,
               "probe_bytes": nbytes, "host_memory_kind": kind, "reps": reps}
    log.info("bandwidth probes (%s): host->device %.1f GB/s (%s), device memory %.0f GB/s (read + write)",
             fmt_bytes(nbytes), _probes["link_GB_s"], kind, _probes["hbm_GB_s"])
    return _probes


@dataclasses.dataclass(frozen=True)
class ModelBytes:
    """Byte counts of a GGUF that a decode step reads, from the file's tensor table."""

    dense_read: int  # every tensor but the routed experts and token_embd
    expert_M: tuple[int, ...]  # bytes of one expert, per MoE layer (gate + up + down)
    experts_total: int
    dense_total: int  # every tensor but the routed experts (token_embd included): what sits on the device
    k: int
    kv_elems_per_position: int  # K and V elements of one cache position over all layers
    kv: str = "f16"  # their storage (EngineConfig.kv)

    @classmethod
    def of(cls, gguf, cfg, kv: str = "f16") -> "ModelBytes":
        dense_total = memory.dense_weight_bytes(gguf)
        dense_read = dense_total - gguf.tensor("token_embd.weight").nbytes
        expert_M = tuple(sum(gguf.tensor(f"blk.{i}.{n}.weight").nbytes
                             for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")) // cfg.n_experts
                         for i in cfg.moe_layers)
        return cls(dense_read, expert_M, memory.routed_expert_bytes(gguf, cfg), dense_total, cfg.n_experts_used,
                   memory.kv_cache_bytes(cfg, ctx=1, rows=1, itemsize=1), kv)

    def kv_bytes_per_position(self, itemsize: int) -> int:
        # K and V hold equal values per position wherever their types differ (a latent cache takes one type)
        k, v = kvquant.kinds(self.kv)
        half = self.kv_elems_per_position // 2
        return kvquant.nbytes(k, half, itemsize) + kvquant.nbytes(v, self.kv_elems_per_position - half, itemsize)

    def hbm_bytes_per_token(self, context: float, itemsize: int) -> float:
        return self.dense_read + self.k * sum(self.expert_M) + self.kv_bytes_per_position(itemsize) * context


def resident_estimate(gguf, cfg, ctx: int, itemsize: int, prefill_chunk: int = 512,
                      reserve: int = DEFAULT_RESERVE, kv: str = "f16") -> int:
    """Device bytes an all-resident load needs, as the engine sizes it (model/memory.py's fixed bytes:
    dense + KV cache + activations, plus the default reserve) with every expert on top."""
    fixed = memory.fixed_device_bytes(gguf, cfg, ctx=ctx, itemsize=itemsize, prefill_chunk=prefill_chunk, kv=kv)
    return fixed + memory.routed_expert_bytes(gguf, cfg) + reserve


def limit_figures(mb: ModelBytes, counters_MS: np.ndarray | None, decode_steps: int, decode_tok_s: float,
                  context: float, itemsize: int, probes: dict, moved: int | None = None) -> dict:
    """The module docstring's formula for one run. counters_MS: the engine's per-layer counters of the
    timed run (columns: hits, misses, streamed, prefetched, ...), None when every expert is resident;
    moved: the decode's bytes over PCIe when the caller knows them better (low-bit misses)."""
    if moved is not None:
        pass
    elif counters_MS is None or not len(counters_MS):
        moved = 0
    else:
        moved = int(((counters_MS[:, 1] + counters_MS[:, 3]) * np.asarray(mb.expert_M, np.int64)).sum())
    pcie = moved / max(decode_steps, 1)
    hbm = mb.hbm_bytes_per_token(context, itemsize)
    limit_s = pcie / (probes["link_GB_s"] * 1e9) + hbm / (probes["hbm_GB_s"] * 1e9)
    measured_s = 1.0 / decode_tok_s if decode_tok_s else None
    return {
        "pcie_MB_per_token": pcie / 1e6,
        "hbm_MB_per_token": hbm / 1e6,
        "probe_link_GB_s": probes["link_GB_s"],
        "probe_hbm_GB_s": probes["hbm_GB_s"],
        "limit_ms_per_token": limit_s * 1e3,
        "measured_ms_per_token": measured_s * 1e3 if measured_s else None,
        "limit_ratio": limit_s / measured_s if measured_s else None,
    }
