"""Rows of a host (pinned) array copied into device rows by one custom call, with the row ids read on the
device: the expert store's misses (offload/fetch.py) and a host-resident table's rows (qwen4exp's PLE).

Why: XLA copies a dynamic slice of host memory with a memcpy whose offset it must know on the host, so a
loop of such copies syncs the host once per row, and a loop holding one (a DynamicSliceFusion thunk)
cannot be recorded into XLA's command buffers: the host then drives every layer of the step
(docs/benchmarks.md, "The miss fetch as one kernel"). Here the rows of a layer are one call: on CUDA a
kernel reading the host array over PCIe (pinned memory is mapped into the device's address space) and
writing the destination in place; on CPU the same call with memcpy, so the CPU tests run the path's
plumbing. The extension is compiled on first use (nvcc / a C++ compiler) into the cache (core/paths.py)
and registered with XLA; where it cannot be built the callers keep their loops.

The host array's address travels as a device array (uint32 [2]), not as an attribute, so the compiled
program does not depend on where this process' arrays happen to sit and stays in the persistent
compilation cache.

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jaxlib import xla_client

from strata_jax.core.paths import cache_dir, file_lock

log = logging.getLogger("strata_jax")

SRC = Path(__file__).with_name("csrc")
TARGET = "strata_host_rows"
ROW_GET, ROW_PUT = "strata_row_get", "strata_row_put"
HOST_PUT = "strata_host_put"
FILE_ROWS = "strata_file_rows"
_SOURCES = {"cpu": "host_rows.cc", "cuda": "host_rows.cu"}
_HANDLERS = {"cpu": "StrataHostRowsCpu", "cuda": "StrataHostRowsCuda"}
_loaded: dict[str, ctypes.CDLL | None] = {}
_why: dict[str, str] = {}


def _platform(device) -> str:
    return "cuda" if device.platform == "gpu" else device.platform


def _compile_cmd(platform: str, src: Path, out: Path) -> list[str] | None:
    inc = jax.ffi.include_dir()
    if platform == "cuda":
        nvcc = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)
        if nvcc is None:
            return None
        return [nvcc, "-O3", "-shared", "-Xcompiler", "-fPIC", "-std=c++17", "-w", "-arch=native", f"-I{inc}",
                str(src), "-o", str(out)]
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        return None
    return [cxx, "-O2", "-shared", "-fPIC", "-std=c++17", "-w", f"-I{inc}", str(src), "-o", str(out)]


def _jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _build(platform: str) -> Path:
    """The compiled extension for `platform`, from the cache or built now (keyed by the sources, the jaxlib
    and the Python: the FFI headers come with jaxlib)."""
    src = SRC / _SOURCES[platform]
    key = hashlib.sha256()
    for f in sorted(SRC.iterdir()):
        key.update(f.name.encode() + f.read_bytes())
    key.update(f"{jax.__version__} {_jaxlib_version()} {sys.version}".encode())
    out_dir = cache_dir() / "ext" / f"host_rows-{platform}-{key.hexdigest()[:16]}"
    lib = out_dir / "libstrata_host_rows.so"
    if lib.exists():
        return lib
    with file_lock(out_dir / ".lock", "the host-rows extension"):
        if lib.exists():
            return lib
        cmd = _compile_cmd(platform, src, out_dir / "tmp.so")
        if cmd is None:
            raise RuntimeError("no compiler found (nvcc for CUDA, g++/clang++ for CPU)")
        with tempfile.TemporaryDirectory() as tmp:
            cmd[-1] = str(Path(tmp) / "lib.so")
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd[:2])} failed: {done.stderr.strip()[-800:]}")
            os.replace(cmd[-1], lib)
    log.info("built the host-rows extension for %s: %s", platform, lib)
    return lib


def _register(lib, platform: str) -> None:
    """The extension's handlers as FFI targets. On CUDA each is declared command-buffer compatible at the
    registration too (each only launches a kernel on XLA's stream): XLA leaves a loop holding a custom call it
    does not know as compatible out of the CUDA graphs, without a line in its log (docs/benchmarks.md)."""
    suffix = "Cuda" if platform == "cuda" else "Cpu"
    extra = {"traits": xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE} if platform == "cuda" else {}
    for target, handler in ((TARGET, _HANDLERS[platform]), (ROW_GET, "StrataRowGet" + suffix),
                            (ROW_PUT, "StrataRowPut" + suffix), (HOST_PUT, "StrataHostPut" + suffix),
                            (FILE_ROWS, "StrataFileRows" + suffix)):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, handler)),
                                    platform="CUDA" if platform == "cuda" else "cpu", **extra)


def available(device) -> bool:
    """Whether the fetch kernel can run on `device`'s platform (built and registered once per process);
    the reason it cannot is logged once."""
    platform = _platform(device)
    if platform not in _SOURCES:
        return False
    if platform not in _loaded:
        try:
            lib = ctypes.cdll.LoadLibrary(str(_build(platform)))
            _register(lib, platform)
            lib.strata_device_pointer.restype = ctypes.c_void_p
            lib.strata_device_pointer.argtypes = [ctypes.c_void_p]
            lib.strata_host_register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            lib.strata_host_unregister.argtypes = [ctypes.c_void_p]
            lib.strata_error_string.restype = ctypes.c_char_p
            _loaded[platform] = lib
        except (RuntimeError, OSError, AttributeError, ValueError) as e:
            _loaded[platform] = None
            _why[platform] = str(e)
            log.warning("the in-step fetch kernel is not available on %s (%s); misses are fetched by a loop of "
                        "copies instead, which holds the host once per miss", platform, e)
    return _loaded[platform] is not None


def why_not(device) -> str:
    return _why.get(_platform(device), "")


def addresses(groups, device) -> tuple[jax.Array, ...] | None:
    """Per store group, the address the kernel reads it at, as uint32 [2] (lo, hi) on `device`; None if a
    group is not memory the device can read (pageable memory on a GPU)."""
    out = []
    for g in groups:
        try:
            a = address_of(g.unsafe_buffer_pointer(), device)
        except (RuntimeError, ValueError) as e:  # a runtime that does not expose host buffers
            log.warning("cannot read the store's address (%s)", e)
            return None
        if a is None:
            return None
        out.append(a)
    return tuple(out)


def device_pointer(ptr: int, device) -> int | None:
    """Where the device's kernels read host memory `ptr` (page-locked, or any on CPU); None if they cannot."""
    lib = _loaded.get(_platform(device))
    return (lib.strata_device_pointer(ptr) or None) if lib is not None else None


def address_of(ptr: int, device) -> jax.Array | None:
    """device_pointer as the kernels take it: uint32 [2] (lo, hi) on `device`."""
    dev = device_pointer(ptr, device)
    return None if dev is None else jax.device_put(np.array([dev & 0xFFFFFFFF, dev >> 32], np.uint32), device)


def register(ptr: int, nbytes: int, device, read_only: bool = False) -> str | None:
    """Page-lock and map host memory (ptr, nbytes: of our own, or a file's read-only mapping) for the device's
    kernels (`available` first); None, or why it failed."""
    lib = _loaded.get(_platform(device))
    if lib is None:
        return why_not(device) or "the fetch kernel is not available"
    e = lib.strata_host_register(ptr, nbytes, int(read_only))
    return None if e == 0 else lib.strata_error_string(e).decode()


def unregister(ptr: int, device) -> None:
    lib = _loaded.get(_platform(device))
    if lib is not None:
        lib.strata_host_unregister(ptr)


def address_shapes(n_groups: int, device) -> tuple[jax.ShapeDtypeStruct, ...]:
    """What `addresses` gives, as shapes; device: a device, or a sharding (replicated on several cards)."""
    sharding = device if isinstance(device, jax.sharding.Sharding) else jax.sharding.SingleDeviceSharding(device)
    return tuple(jax.ShapeDtypeStruct((2,), np.uint32, sharding=sharding) for _ in range(n_groups))


def host_view(a: jax.Array) -> np.ndarray:
    """A writable numpy view of a host array's bytes (uint8, flat). Sound only while no computation reads or
    writes the array: the caller waits for those in flight first."""
    n = a.nbytes
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(a.unsafe_buffer_pointer()))


def host_rows(addr_2: jax.Array, pool_XP: jax.Array, row_U: jax.Array, dst_U: jax.Array, miss_U: jax.Array,
              n_rows: int) -> jax.Array:
    """pool_XP with store row row_U[j] copied into pool row dst_U[j] wherever miss_U[j] (one call, in place:
    the pool is aliased to the result). n_rows: the store group's rows (requests outside are skipped)."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(pool_XP.shape, pool_XP.dtype), input_output_aliases={1: 0})
    return call(addr_2, pool_XP, row_U.astype(jnp.int32), dst_U.astype(jnp.int32), miss_U.astype(jnp.int32),
                rows=np.int64(n_rows))


def file_rows(table_LT2: jax.Array, pool_XP: jax.Array, row_U: jax.Array, dst_U: jax.Array, miss_U: jax.Array,
              n_rows: int, n_experts: int, widths: tuple[int, ...]) -> jax.Array:
    """host_rows for a store that is the model file (offload/store.py, mapped): store row r (layer r // E,
    expert r % E) is len(widths) pieces, piece t of widths[t] bytes at table_LT2[layer, t] + expert * widths[t],
    back to back in pool row dst_U[j]."""
    w = tuple(widths) + (0,) * (3 - len(widths))
    call = jax.ffi.ffi_call(FILE_ROWS, jax.ShapeDtypeStruct(pool_XP.shape, pool_XP.dtype), input_output_aliases={1: 0})
    return call(table_LT2, pool_XP, row_U.astype(jnp.int32), dst_U.astype(jnp.int32), miss_U.astype(jnp.int32),
                rows=np.int64(n_rows), experts=np.int64(n_experts), w0=np.int64(w[0]), w1=np.int64(w[1]),
                w2=np.int64(w[2]))


def host_put(addr_2: jax.Array, token_1: jax.Array, src_UP: jax.Array, row_U: jax.Array, put_U: jax.Array,
             n_rows: int) -> jax.Array:
    """Write device row src_UP[j] into host row row_U[j] of the array at addr_2 wherever put_U[j] (one call;
    rows outside [0, n_rows) are skipped). Returns the token (aliased): a read of those rows must take it
    (model/kvquant.py ties them), since XLA sees no other dependence between the write and the read."""
    call = jax.ffi.ffi_call(HOST_PUT, jax.ShapeDtypeStruct(token_1.shape, token_1.dtype), input_output_aliases={1: 0})
    return call(addr_2, token_1, src_UP, row_U.astype(jnp.int32), put_U.astype(jnp.int32), rows=np.int64(n_rows))


# -- one row of a device stack at a traced index (row_get / row_put) ----------------------------------------


def _bytes(a: jax.Array) -> jax.Array:
    """a [L, ...] as uint8 [L, P] (a bitcast: no copy)."""
    b = a if a.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(a, jnp.uint8)
    return b.reshape(a.shape[0], -1)


def _unbytes(b: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    size = jnp.dtype(dtype).itemsize
    if jnp.dtype(dtype) == jnp.uint8:
        return b.reshape(shape)
    return jax.lax.bitcast_convert_type(b.reshape(shape + ((size,) if size > 1 else ())), dtype)


def rows_ok(a) -> bool:
    """Whether row_get/row_put take a's dtype (a bitcast to bytes: not bool)."""
    return jnp.dtype(a.dtype) != jnp.bool_ and a.ndim >= 1


def row_get(a: jax.Array, i: jax.Array) -> jax.Array:
    """a[i] (i traced, clamped) by one kernel call (`available` first)."""
    out = jax.ffi.ffi_call(ROW_GET, jax.ShapeDtypeStruct((1, _row_bytes(a)), jnp.uint8))(
        _bytes(a), jnp.asarray(i, jnp.int32).reshape(()))
    return _unbytes(out, a.shape[1:], a.dtype)


def row_put(a: jax.Array, v: jax.Array, i: jax.Array) -> jax.Array:
    """a with a[i] = v (i traced, clamped), in place: one kernel call (`available` first)."""
    b = _bytes(a)
    out = jax.ffi.ffi_call(ROW_PUT, jax.ShapeDtypeStruct(b.shape, jnp.uint8), input_output_aliases={0: 0})(
        b, _bytes(v.astype(a.dtype)[None]), jnp.asarray(i, jnp.int32).reshape(()))
    return _unbytes(out, a.shape, a.dtype)


def _row_bytes(a) -> int:
    return int(np.prod(a.shape[1:], dtype=np.int64)) * jnp.dtype(a.dtype).itemsize
