"""ExpertStore: every routed expert of every MoE layer in host memory, in GGML block format.

Each MoE layer is one host array in JAX's `pinned_host` memory, `[E, B]` bytes, where a row holds one
expert's gate, up and down blocks back to back (`ExpertRows`). The jitted step DMAs one expert with a
single copy (`lax.dynamic_index_in_dim` with a traced index), or a whole layer, straight into device
memory with no host round trip. The device slot pools use the same row layout, so a miss is one copy.
If pinned memory cannot be had we fall back to pageable host memory, which works the same but copies
at a fraction of the speed.

Shape legend: E experts per layer, S slots, B bytes per expert, F expert ffn dim, D model dim,
R row bytes of one matrix.
"""

from __future__ import annotations

import logging
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from strata_jax.model.weights import QTensor, WeightLoader, pytree_dataclass
from strata_jax.units import fmt_bytes

log = logging.getLogger("strata_jax")

EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


Part = tuple  # (GGML type, rows, row bytes, columns) of one of an expert's three matrices


@pytree_dataclass(meta=("parts",))
class ExpertRows:
    """Whole experts as byte rows `uint8[X, B]`: gate, up and down blocks back to back."""

    data: jax.Array
    parts: tuple[Part, Part, Part]

    @property
    def bytes_per_expert(self) -> int:
        return self.data.shape[-1]

    @property
    def n_rows(self) -> int:
        return self.data.shape[0]

    def split(self, rows: jax.Array) -> tuple[QTensor, QTensor, QTensor]:
        """The gate, up and down matrices of gathered rows `[..., B]`, as quantized tensors."""
        out, offset = [], 0
        for qtype, n, row_bytes, n_cols in self.parts:
            size = n * row_bytes
            block = rows[..., offset : offset + size].reshape(*rows.shape[:-1], n, row_bytes)
            out.append(QTensor(block, qtype, n_cols))
            offset += size
        return tuple(out)

    def take(self, idx: jax.Array) -> tuple[QTensor, QTensor, QTensor]:
        return self.split(jnp.take(self.data, idx, axis=0))


@pytree_dataclass(meta=("memory_kind",))
class ExpertStore:
    layers: tuple[ExpertRows, ...]  # one per MoE layer
    memory_kind: str

    @property
    def nbytes(self) -> int:
        return sum(layer.data.nbytes for layer in self.layers)


def expert_parts(infos) -> tuple[Part, Part, Part]:
    """Row layout of one expert from the three TensorInfos (gate, up, down) of a layer."""
    return tuple((t.ggml_type, t.data.shape[1], t.data.shape[2], t.shape[-1]) for t in infos)


def fused_rows(infos) -> np.ndarray:
    """uint8 [E, B]: each expert's gate, up and down bytes back to back, from the memory-mapped tensors."""
    E = infos[0].data.shape[0]
    return np.concatenate([np.asarray(t.data).reshape(E, -1) for t in infos], axis=1)


def expert_shapes(cfg) -> tuple[tuple[int, ...], ...]:
    E, F, D = cfg.n_experts, cfg.expert_ffn_dim, cfg.d_model
    return (E, F, D), (E, F, D), (E, D, F)


class _Progress:
    """`experts: 12.3 / 46.8 GiB (3.1 GiB/s)` on one line when stderr is a terminal, else every ~10%."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.done, self.t0 = total, label, 0, time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.next_report = 0.1

    def add(self, n: int) -> None:
        self.done += n
        frac = self.done / max(self.total, 1)
        rate = self.done / max(time.perf_counter() - self.t0, 1e-9)
        msg = f"{self.label}: {fmt_bytes(self.done)} / {fmt_bytes(self.total)} ({fmt_bytes(rate)}/s)"
        if self.tty:
            sys.stderr.write("\r" + msg + " " * 8)
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif frac >= self.next_report:
            log.info(msg)
            self.next_report = frac + 0.1


def _host_sharding(device, memory_kind: str) -> SingleDeviceSharding:
    return SingleDeviceSharding(device, memory_kind=memory_kind)


def load_expert_store(loader: WeightLoader, memory_kind: str = "pinned_host") -> ExpertStore:
    """Copy every routed expert from the memory-mapped GGUF into host memory of `memory_kind`,
    falling back to pageable memory (with a warning naming the cost) if pinned memory fails."""
    cfg, device = loader.cfg, loader.device or jax.devices()[0]
    infos = [[loader.info(f"blk.{layer}.{name}.weight", shape) for name, shape in zip(EXPERT_TENSORS, expert_shapes(cfg))]
             for layer in cfg.moe_layers]
    total = sum(t.nbytes for layer in infos for t in layer)
    progress = _Progress(total, "experts")
    kinds = [memory_kind] + (["unpinned_host"] if memory_kind == "pinned_host" else [])
    t0 = time.perf_counter()
    for i, kind in enumerate(kinds):
        try:
            sharding = _host_sharding(device, kind)
            layers = []
            for layer in infos:
                layers.append(ExpertRows(jax.device_put(fused_rows(layer), sharding), expert_parts(layer)))
                progress.add(sum(t.nbytes for t in layer))
            jax.block_until_ready(layers)
            dt = time.perf_counter() - t0
            log.info("experts loaded: %s in %s host memory at %s/s (%d layers x %d experts)", fmt_bytes(total), kind,
                     fmt_bytes(total / max(dt, 1e-9)), len(infos), cfg.n_experts)
            return ExpertStore(tuple(layers), kind)
        except (RuntimeError, ValueError, MemoryError) as e:  # XLA reports allocation failure as RuntimeError
            if i + 1 == len(kinds):
                raise
            log.warning("could not place %s of experts in %s memory (%s); falling back to %s memory: expert "
                        "transfers will run at pageable-copy speed (a few GB/s instead of ~50). Raise the "
                        "locked-memory limit (ulimit -l) or free RAM to get pinned memory.",
                        fmt_bytes(total), kind, str(e).splitlines()[0][:200], kinds[i + 1])
            progress = _Progress(total, "experts")
            t0 = time.perf_counter()
    raise AssertionError("unreachable")
