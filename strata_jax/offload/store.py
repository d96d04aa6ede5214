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

import ctypes
import logging
import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import jax
import numpy as np
from flax import struct
from jax.sharding import SingleDeviceSharding

from strata_jax.core import hostrows, layer_ref
from strata_jax.core.experts import ExpertRows, ExpertSpec, Part
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
    # the store as the model file itself (STRATA_JAX_STORE=mapped): per group, the bytes per expert of each of
    # its layers' expert tensors, and addr[g] is then a table of where each layer's tensors are mapped
    # (uint32 [L, T, 2]); () = rows back to back in one array per group
    widths: tuple[tuple[int, ...], ...] = struct.field(pytree_node=False, default=())

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(self.shape(g), dtype=np.int64)) for g in range(len(self.parts)))

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

    def kernel_rows(self, g: int, pool_XP: jax.Array, row_U: jax.Array, dst_U: jax.Array, miss_U: jax.Array,
                    addr: jax.Array | None = None) -> jax.Array:
        """pool_XP with store rows row_U of group g (layer * E + expert) copied into its rows dst_U where miss_U,
        by one call of the fetch kernel (core/hostrows.py); addr: the group's address as a card holds it."""
        L, E, _ = self.shape(g)
        a = self.addr[g] if addr is None else addr
        if self.widths:
            return hostrows.file_rows(a, pool_XP, row_U, dst_U, miss_U, L * E, E, self.widths[g])
        return hostrows.host_rows(a, pool_XP, row_U, dst_U, miss_U, L * E)

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
    return out, hostrows.host_view(out).reshape(shape)


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


class _LockedMemory:
    """Host memory page-locked and mapped for the device's kernels (core/hostrows.register) once `register`
    runs; `close` (or the last reference going) unregisters and unmaps it. address, nbytes: set by a subclass."""

    address: int | None
    nbytes: int
    device = None  # the device it is registered with
    read_only = False

    def register(self, device) -> None:
        why = hostrows.register(self.address, self.nbytes, device, read_only=self.read_only)
        if why is not None:
            raise MemoryError(f"could not page-lock {self} ({why})")
        self.device = device

    def close(self) -> None:
        if self.address is None:
            return
        try:
            if self.device is not None:
                hostrows.unregister(self.address, self.device)
            _libc.munmap(self.address, max(self.nbytes, 1))
        except Exception:  # noqa: BLE001 - at interpreter exit the runtime may be gone first
            pass
        self.address = None

    def __del__(self):
        self.close()


def _close_all(mems) -> None:
    for m in mems:
        m.close()


class HostMemory(_LockedMemory):
    """Host memory of the engine's own for a store group (the default where the fetch kernel reads the store;
    STRATA_JAX_STORE=pinned keeps JAX's pinned memory instead): an anonymous mapping, huge pages asked for,
    filled in place by the readers, then page-locked. JAX's pinned allocation page-locks fresh memory and
    writes zeros through it before the reads, which bounded the load (docs/benchmarks.md, "Loading the expert
    store"); here the reads are the first touch. The store is then addressed (ExpertStore.addressed): the
    kernels read it by its address, never as a program operand."""

    def __init__(self, shape: tuple[int, ...]):
        self.shape, self.nbytes = shape, int(np.prod(shape, dtype=np.int64))
        self.address = _libc.mmap(None, max(self.nbytes, 1), mmap.PROT_READ | mmap.PROT_WRITE,
                                  mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if self.address in (None, ctypes.c_void_p(-1).value):
            self.address = None
            raise MemoryError(f"could not map {fmt_bytes(self.nbytes)} of host memory for the expert store")
        if hasattr(mmap, "MADV_HUGEPAGE"):
            _libc.madvise(self.address, self.nbytes, mmap.MADV_HUGEPAGE)

    def __str__(self) -> str:
        return f"{fmt_bytes(self.nbytes)} of host memory"

    def view(self) -> np.ndarray:
        """Its bytes as a writable numpy array of its shape (valid until close)."""
        return np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(self.address)).reshape(self.shape)


def _mapping_functions():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


_libc = _mapping_functions()


def _load_groups(gguf, spec: ExpertSpec, alloc, progress: _Progress) -> tuple:
    """Each group's host memory, allocated by alloc(shape) -> (holder, writable uint8 view), filled from the
    file; the holders (JAX host arrays, or HostMemory)."""
    parts, layer_group, _ = store_groups(spec)
    groups = []
    alloc_s = 0.0  # logged apart: the reads alone are far faster than the load (docs/benchmarks.md)
    files = {path: os.open(path, os.O_RDONLY) for path in gguf.shard_paths}
    try:
        with ThreadPoolExecutor(READERS) as pool:
            for g, p in enumerate(parts):
                layers = tuple(i for i, q in enumerate(layer_group) if q == g)
                t0 = time.perf_counter()
                data_LEP, view_LEP = alloc((len(layers), spec.n_experts, sum(x.nbytes for x in p)))
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
            sharding = _host_sharding(device, kind)
            groups = _load_groups(gguf, spec, lambda shape: _host_array(shape, sharding), _Progress(total, "experts"))
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


def load_registered_store(gguf, spec: ExpertSpec, device) -> tuple[ExpertStore, tuple[HostMemory, ...]]:
    """The store in host memory of the engine's own (HostMemory), registered for `device` and addressed: what
    a step takes, and the memory, which the caller keeps (and closes) while the store is in use. Raises
    MemoryError where the memory cannot be had or page-locked (the caller then loads it as JAX's)."""
    parts, layer_group, layer_local = store_groups(spec)
    total = sum(gguf.tensor(n).nbytes for i in range(len(spec.moe_layers)) for n in spec.tensor_names(i))
    t0 = time.perf_counter()

    def alloc(shape):
        mem = HostMemory(shape)
        return mem, mem.view()

    mems = _load_groups(gguf, spec, alloc, _Progress(total, "experts"))
    t_read = time.perf_counter() - t0
    try:
        for m in mems:
            m.register(device)
        addr = tuple(hostrows.address_of(m.address, device) for m in mems)
        if any(a is None for a in addr):
            raise MemoryError("the device cannot read the registered store")
    except BaseException:
        _close_all(mems)
        raise
    t_reg = time.perf_counter() - t0 - t_read
    log.info("experts loaded: %s in registered host memory at %s/s (read %.2f s, page-locked %.2f s)",
             fmt_bytes(total), fmt_bytes(total / max(t_read + t_reg, 1e-9)), t_read, t_reg)
    store = ExpertStore((), parts, layer_group, layer_local, "registered", addr=addr,
                        shapes=tuple(m.shape for m in mems))
    return store, mems


class FileMapping(_LockedMemory):
    """A model file mapped read-only, to be page-locked in place (STRATA_JAX_STORE=mapped): the expert store is
    then the file itself, read by the kernels from the page cache, with no copy and no second copy in RAM."""

    read_only = True

    def __init__(self, path: str):
        self.path, self.nbytes = path, os.path.getsize(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            self.address = _libc.mmap(None, max(self.nbytes, 1), mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        if self.address in (None, ctypes.c_void_p(-1).value):
            self.address = None
            raise MemoryError(f"could not map {path} ({fmt_bytes(self.nbytes)})")

    def __str__(self) -> str:
        return f"the mapping of {os.path.basename(self.path)} ({fmt_bytes(self.nbytes)})"


def file_widths(gguf, spec: ExpertSpec) -> tuple[tuple[int, ...], ...]:
    """Per store group, the bytes per expert of each expert tensor of its layers (a mapped store's row pieces)."""
    _, layer_group, _ = store_groups(spec)
    out: dict[int, tuple[int, ...]] = {}
    for i, g in enumerate(layer_group):
        w = tuple(gguf.tensor(n).nbytes // spec.n_experts for n in spec.tensor_names(i))
        if out.setdefault(g, w) != w:
            raise ValueError(f"MoE layer {i}'s expert tensors split their rows otherwise than its group's")
    return tuple(out[g] for g in range(len(out)))


def load_file_store(gguf, spec: ExpertSpec, device) -> tuple[ExpertStore, tuple[FileMapping, ...]]:
    """The store as the model file itself: each shard mapped read-only and page-locked, and per group a table of
    where each layer's expert tensors are (ExpertStore.widths). Raises MemoryError where that cannot be had."""
    parts, layer_group, layer_local = store_groups(spec)
    t0 = time.perf_counter()
    maps = {path: FileMapping(path) for path in gguf.shard_paths}
    try:
        for m in maps.values():
            m.register(device)
            if hostrows.device_pointer(m.address, device) != m.address:  # the tables hold host addresses as they are
                raise MemoryError("the device reads mapped host memory at another address than the host's")
    except BaseException:
        _close_all(maps.values())
        raise
    widths = file_widths(gguf, spec)
    tables = []
    for g in range(len(parts)):
        layers = [i for i, q in enumerate(layer_group) if q == g]
        t = np.zeros((len(layers), len(widths[g]), 2), np.uint32)
        for j, i in enumerate(layers):
            for k, name in enumerate(spec.tensor_names(i)):
                path, offset = gguf.file_span(name)
                ptr = maps[path].address + offset
                t[j, k] = (ptr & 0xFFFFFFFF, ptr >> 32)
        tables.append(t)
    shapes = tuple((len(t), spec.n_experts, sum(x.nbytes for x in parts[g])) for g, t in enumerate(tables))
    total = sum(int(np.prod(x)) for x in shapes)
    log.info("experts: the model file itself, %s mapped and page-locked in %.2f s (%s of experts; no copy)",
             fmt_bytes(sum(m.nbytes for m in maps.values())), time.perf_counter() - t0, fmt_bytes(total))
    store = ExpertStore((), parts, layer_group, layer_local, "mapped", shapes=shapes, widths=widths,
                        addr=tuple(jax.device_put(t, device) for t in tables))
    return store, tuple(maps.values())
