"""ExpertStore: every routed expert of every MoE layer in host memory, in GGML block format.

Each MoE layer is one host array in JAX's `pinned_host` memory, `uint8[E, P]`, where a row holds one
expert's gate, up and down blocks back to back (core/experts.py's `ExpertRows`). The jitted step
DMAs one expert with a single copy (`lax.dynamic_index_in_dim` with a traced index), or a whole layer, straight into device
memory with no host round trip. The device slot pools use the same row layout, so a miss is one copy.
If pinned memory cannot be had we fall back to pageable host memory, which works the same but copies
at a fraction of the speed.

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jax
from flax import struct
from jax.sharding import SingleDeviceSharding

from strata_jax.core.experts import ExpertRows, ExpertSpec, fused_rows
from strata_jax.core.units import fmt_bytes

log = logging.getLogger("strata_jax")

# layers whose rows are read from the file (page faults, disk) while an earlier one is being pinned:
# numpy's copies release the GIL, so the reads overlap each other and the device_put
READ_AHEAD = 3


@struct.dataclass
class ExpertStore:
    layers: tuple[ExpertRows, ...]  # one per MoE layer
    memory_kind: str = struct.field(pytree_node=False)

    @property
    def nbytes(self) -> int:
        return sum(layer.data.nbytes for layer in self.layers)


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


def load_expert_store(gguf, spec: ExpertSpec, device=None, memory_kind: str = "pinned_host") -> ExpertStore:
    """Copy every routed expert from the memory-mapped GGUF file (strata_jax.gguf.reader.GGUFFile) into
    host memory of `memory_kind`, falling back to pageable memory (with a warning naming the cost) if
    pinned memory fails. spec: the experts' layout, already checked against the file."""
    device = device or jax.devices()[0]
    infos = [[gguf.tensor(name) for name in spec.tensor_names(i)] for i in range(len(spec.moe_layers))]
    total = sum(t.nbytes for layer in infos for t in layer)
    progress = _Progress(total, "experts")
    kinds = [memory_kind] + (["unpinned_host"] if memory_kind == "pinned_host" else [])
    t0 = time.perf_counter()
    for i, kind in enumerate(kinds):
        try:
            sharding = _host_sharding(device, kind)
            layers = []
            with ThreadPoolExecutor(READ_AHEAD) as pool:
                rows = [pool.submit(fused_rows, layer) for layer in infos[:READ_AHEAD]]
                for i, layer in enumerate(infos):
                    host = rows[i].result()
                    rows[i] = None  # its memory goes once pinned
                    if i + READ_AHEAD < len(infos):
                        rows.append(pool.submit(fused_rows, infos[i + READ_AHEAD]))
                    layers.append(ExpertRows(jax.device_put(host, sharding), spec.layer_parts[i]))
                    progress.add(sum(t.nbytes for t in layer))
            jax.block_until_ready(layers)
            dt = time.perf_counter() - t0
            log.info("experts loaded: %s in %s host memory at %s/s (%d layers x %d experts)", fmt_bytes(total), kind,
                     fmt_bytes(total / max(dt, 1e-9)), len(infos), spec.n_experts)
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
