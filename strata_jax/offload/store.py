"""ExpertStore: every routed expert of every MoE layer in host memory, in GGML block format.

The MoE layers that share a row layout (core/experts.py's `Part`s: usually all of them) are one host
array in JAX's `pinned_host` memory, `uint8[L, E, P]`, a row holding one expert's gate, up and down
blocks back to back. So a jitted step takes one store argument per row layout, however many layers the
model has, and indexes it by the (possibly traced: a scanned run of layers) MoE layer. The step DMAs
one expert with a single copy (a dynamic slice of its row), or a whole layer, straight into device
memory with no host round trip. The device slot pools use the same row layout, so a miss is one copy.
If pinned memory cannot be had we fall back to pageable host memory, which works the same but copies
at a fraction of the speed.

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import jax
import numpy as np
from flax import struct
from jax.sharding import SingleDeviceSharding

from strata_jax.core import layer_ref
from strata_jax.core.experts import ExpertRows, ExpertSpec, Part
from strata_jax.core.hostrows import host_view
from strata_jax.core.units import fmt_bytes

log = logging.getLogger("strata_jax")

# threads reading the file into the store: preadv releases the GIL, so the reads run in parallel
READERS = min(16, os.cpu_count() or 1)
# bytes per copy task: small enough to balance the readers and to report progress, large enough to
# keep the per-task cost out of the rate
TASK_BYTES = 64 << 20


@struct.dataclass
class ExpertStore:
    groups: tuple[jax.Array, ...]  # uint8 [L, E, P] per row layout, its MoE layers in order
    parts: tuple[tuple[Part, Part, Part], ...] = struct.field(pytree_node=False)  # per group
    layer_group: tuple[int, ...] = struct.field(pytree_node=False)  # per MoE layer: its group
    layer_local: tuple[int, ...] = struct.field(pytree_node=False)  # per MoE layer: its index in the group
    memory_kind: str = struct.field(pytree_node=False)
    # per group, where the fetch kernel reads it (core/hostrows.py: uint32 [2] on the device); () = the
    # misses are fetched by a loop of copies (offload/fetch.py)
    addr: tuple[jax.Array, ...] = ()
    # mixed precision (--cold-experts): the same experts at a lower-bit type, from a second GGUF of the
    # model; misses not promoted to the cache are served from it (offload/provider.py)
    cold: "ExpertStore | None" = None
    # the groups' shapes where the arrays are not carried (`addressed`: read by their addresses only)
    shapes: tuple[tuple[int, int, int], ...] = struct.field(pytree_node=False, default=())

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    def shape(self, g: int) -> tuple[int, int, int]:
        """(layers, experts, row bytes) of group g."""
        return tuple(self.groups[g].shape) if self.groups else self.shapes[g]

    def addressed(self) -> "ExpertStore":
        """The store as a program on several cards takes it (core/cards.py): the fetch kernel's addresses and
        the shapes, not the host arrays, which a program over a mesh would need replicated (a host copy per
        card). Every read then goes by the kernel."""
        if not self.addr:
            raise ValueError("an addressed store needs the fetch kernel's addresses")
        return self.replace(groups=(), shapes=tuple(self.shape(g) for g in range(len(self.parts))),
                            cold=None if self.cold is None else self.cold.addressed())

    def group(self, moe_idx) -> int:
        """The group of MoE layer moe_idx (an int, or a LayerRef whose candidates share one group)."""
        groups = {self.layer_group[i] for i in layer_ref.each(moe_idx)}
        if len(groups) != 1:
            raise ValueError(f"MoE layers {layer_ref.each(moe_idx)} span store groups {sorted(groups)}: a "
                             "scanned run must share its row layout (SlotExperts.layer_key)")
        return groups.pop()

    def rows(self, moe_idx, start, n: int) -> jax.Array:
        """Rows start .. start + n - 1 of MoE layer moe_idx, in host memory: uint8 [1, n, P] (one dynamic
        slice of the group, its leading axis kept for the host-to-device copy to stay a plain slice)."""
        data_LEP = self.groups[self.group(moe_idx)]
        at = layer_ref.value(layer_ref.mapped(moe_idx, self.layer_local))
        return jax.lax.dynamic_slice(data_LEP, (at, start, 0), (1, n, data_LEP.shape[2]))

    def layer(self, moe_idx: int) -> ExpertRows:
        """All E experts of MoE layer moe_idx (a static int), uint8 [E, P], in host memory."""
        g = self.layer_group[moe_idx]
        return ExpertRows(self.groups[g][self.layer_local[moe_idx]], self.parts[g])


def store_groups(spec: ExpertSpec) -> tuple[tuple, tuple[int, ...], tuple[int, ...]]:
    """(parts of each group, each MoE layer's group, its index in the group): a group per row layout."""
    parts: list[tuple] = []
    layer_group, layer_local = [], []
    for p in spec.layer_parts:
        if p not in parts:
            parts.append(p)
        layer_group.append(parts.index(p))
        layer_local.append(layer_group.count(layer_group[-1]) - 1)
    return tuple(parts), tuple(layer_group), tuple(layer_local)


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


def _host_array(shape: tuple[int, ...], sharding) -> tuple[jax.Array, np.ndarray]:
    """A fresh host array of zeros and a writable numpy view of its bytes, to fill it in place.

    Sound because nothing else holds the array yet: the copy that made it is finished (blocked on),
    no computation has read it, and numpy's view is dropped before it is returned. Host memory (pinned
    or pageable) is addressable by the CPU on every backend. The zeros are calloc'd pages (never
    written), but device_put still copies them into the new buffer: one full write of the store before
    the copy from the file. On CPU that allocation is most of the load's time (benchmarks/load_store.py's
    alloc_GB_s); on a GPU's pinned memory it is not measured yet."""
    out = jax.device_put(np.zeros(shape, np.uint8), sharding)
    out.block_until_ready()
    return out, host_view(out).reshape(shape)


def _copy_tasks(gguf, spec: ExpertSpec, layers: tuple[int, ...], view_LEP: np.ndarray, files: dict[str, int]):
    """(copy, bytes) per task: a run of experts of one tensor of one layer into its columns of the store,
    read with one preadv from the file (files: path -> an open descriptor) into the rows' slices.
    Reading, not copying from the memory map: threads faulting one mapping in page by page serialize on
    the kernel's mapping lock (docs/benchmarks.md, "Stacked state and store")."""
    iov_max = max(1, min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024))
    tasks = []
    for j, i in enumerate(layers):
        at = 0
        for name in spec.tensor_names(i):
            src_EB = np.asarray(gguf.tensor(name).data).reshape(spec.n_experts, -1)
            path, offset = gguf.file_span(name)
            width = src_EB.shape[1]
            step = min(max(1, TASK_BYTES // max(width, 1)), iov_max)
            for e in range(0, spec.n_experts, step):
                dst, src = view_LEP[j, e : e + step, at : at + width], src_EB[e : e + step]
                tasks.append((lambda dst=dst, src=src, fd=files[path], off=offset + e * width: _read_rows(fd, off, dst, src),
                              src.nbytes))
            at += width
    return tasks


def _read_rows(fd: int, offset: int, dst_RB: np.ndarray, src_RB: np.ndarray) -> None:
    """dst_RB's rows (each contiguous) = the file's bytes from offset on, which src_RB maps; a short read
    (or no preadv on this platform) copies what is left from the map."""
    done = 0
    if hasattr(os, "preadv"):
        done = os.preadv(fd, list(dst_RB), offset)
    if done != dst_RB.nbytes:
        np.copyto(dst_RB, src_RB)


def _load_groups(gguf, spec: ExpertSpec, sharding, progress: _Progress) -> tuple[jax.Array, ...]:
    parts, layer_group, _ = store_groups(spec)
    groups = []
    alloc_s = 0.0  # logged apart: the reads alone are far faster than the load (docs/benchmarks.md)
    files = {path: os.open(path, os.O_RDONLY) for path in gguf.shard_paths}
    try:
        with ThreadPoolExecutor(READERS) as pool:
            for g, p in enumerate(parts):
                layers = tuple(i for i, q in enumerate(layer_group) if q == g)
                t0 = time.perf_counter()
                data_LEP, view_LEP = _host_array((len(layers), spec.n_experts, sum(x.nbytes for x in p)), sharding)
                alloc_s += time.perf_counter() - t0
                futures = {pool.submit(copy): n for copy, n in _copy_tasks(gguf, spec, layers, view_LEP, files)}
                for f in as_completed(futures):
                    f.result()
                    progress.add(futures[f])
                del view_LEP
                groups.append(data_LEP)
    finally:
        for fd in files.values():
            os.close(fd)
    log.info("experts: %.2f s of the load allocating host memory", alloc_s)
    return tuple(groups)


def store_shapes(spec: ExpertSpec, device, memory_kind: str = "pinned_host") -> ExpertStore:
    """The store load_expert_store makes, as shapes (jax.ShapeDtypeStruct leaves, same shardings): what a
    step's program is lowered and compiled against while the bytes are still being read."""
    parts, layer_group, layer_local = store_groups(spec)
    sharding = _host_sharding(device, memory_kind)
    groups = tuple(jax.ShapeDtypeStruct((layer_group.count(g), spec.n_experts, sum(x.nbytes for x in p)), np.uint8,
                                        sharding=sharding) for g, p in enumerate(parts))
    return ExpertStore(groups, parts, layer_group, layer_local, memory_kind)


def load_expert_store(gguf, spec: ExpertSpec, device=None, memory_kind: str = "pinned_host") -> ExpertStore:
    """Copy every routed expert from the memory-mapped GGUF file (strata_jax.gguf.reader.GGUFFile) into
    host memory of `memory_kind`, falling back to pageable memory (with a warning naming the cost) if
    pinned memory fails. spec: the experts' layout, already checked against the file."""
    device = device or jax.devices()[0]
    parts, layer_group, layer_local = store_groups(spec)
    total = sum(gguf.tensor(n).nbytes for i in range(len(spec.moe_layers)) for n in spec.tensor_names(i))
    kinds = [memory_kind] + (["unpinned_host"] if memory_kind == "pinned_host" else [])
    for k, kind in enumerate(kinds):
        t0 = time.perf_counter()
        try:
            groups = _load_groups(gguf, spec, _host_sharding(device, kind), _Progress(total, "experts"))
        except (RuntimeError, ValueError, MemoryError) as e:  # XLA reports allocation failure as RuntimeError
            if k + 1 == len(kinds):
                raise
            log.warning("could not place %s of experts in %s memory (%s); falling back to %s memory: expert "
                        "transfers will run at pageable-copy speed (a few GB/s instead of ~50). Raise the "
                        "locked-memory limit (ulimit -l) or free RAM to get pinned memory.",
                        fmt_bytes(total), kind, str(e).splitlines()[0][:200], kinds[k + 1])
            continue
        dt = time.perf_counter() - t0
        log.info("experts loaded: %s in %s host memory at %s/s (%d layers x %d experts, %d array%s)",
                 fmt_bytes(total), kind, fmt_bytes(total / max(dt, 1e-9)), len(layer_group), spec.n_experts,
                 len(groups), "s" if len(groups) > 1 else "")
        return ExpertStore(groups, parts, layer_group, layer_local, kind)
    raise AssertionError("unreachable")
