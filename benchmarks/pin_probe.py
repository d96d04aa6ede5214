"""Can the expert store be the file itself? (issue 30's load target, >= 5 GB/s from the page cache.)

The store's load is bound by page-locking fresh memory (~2.3 GB/s to a fresh process on the H100,
docs/benchmarks.md). Three ways to get GPU-readable host memory holding a cached file's bytes, timed:
  alloc    cudaHostAlloc, then 16 threads pread the file into it (what the store does today)
  huge     anonymous memory with transparent huge pages (madvise), touched, cudaHostRegister'ed, then read
  mapped   the file mmap'ed read-only and cudaHostRegister'ed in place (cudaHostRegisterReadOnly): no copy
and then, from each, the GPU reading 1 GiB over PCIe (a copy-engine memcpy and a kernel reading the mapped
pointer, as the fetch kernel does), the bytes checked. Needs a GPU and CuPy. Prints JSON (also --out).

    python benchmarks/pin_probe.py --gib 8 [--path /tmp/pin_probe.bin] [--out F]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import json
import mmap
import os
import time

import numpy as np

PROT_READ, MAP_SHARED, MADV_HUGEPAGE = 1, 1, 14
REG_DEFAULT, REG_MAPPED, REG_READONLY = 0, 2, 8
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def write_file(path: str, n: int) -> None:
    if os.path.exists(path) and os.path.getsize(path) == n:
        return
    block = (np.arange(1 << 26, dtype=np.uint32) * 2654435761).view(np.uint8)  # 256 MiB, not all zeros
    with open(path, "wb") as f:
        for i in range(0, n, block.nbytes):
            f.write((block[: min(block.nbytes, n - i)] + np.uint8(i >> 28)).tobytes())


def read_into(path: str, addr: int, n: int, threads: int = 16) -> float:
    """pread the file into n bytes at addr with `threads` readers; seconds."""
    fd = os.open(path, os.O_RDONLY)
    piece = -(-n // threads)
    buf = (ctypes.c_uint8 * n).from_address(addr)
    view = memoryview(buf).cast("B")

    def one(i):
        lo, hi = i * piece, min(n, (i + 1) * piece)
        while lo < hi:
            lo += os.preadv(fd, [view[lo:hi]], lo)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, range(threads)))
    os.close(fd)
    return time.perf_counter() - t0


def gpu_reads(cp, host_ptr: int, n: int, expect: np.ndarray) -> dict:
    """1 GiB (or n) from host_ptr to the device: memcpy and a kernel through the mapped pointer; GB/s."""
    rt = cp.cuda.runtime
    m = min(n, 1 << 30)
    dst = cp.empty(m, dtype=cp.uint8)
    out = {}
    for name in ("memcpy", "kernel"):
        dst.fill(0)
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        if name == "memcpy":
            rt.memcpy(dst.data.ptr, host_ptr, m, 4)  # cudaMemcpyDefault (unified addressing)
        else:
            get = getattr(rt, "hostGetDevicePointer", None)  # with unified addressing the host pointer works too
            dev_ptr = get(host_ptr, 0) if get else host_ptr
            k = cp.RawKernel(r'''extern "C" __global__ void rd(const uint4* src, uint4* dst, long long n) {
                for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
                     i += (long long)gridDim.x * blockDim.x) dst[i] = src[i]; }''', "rd")
            k((1024,), (256,), (cp.uint64(dev_ptr), dst, cp.int64(m // 16)))
        cp.cuda.Device().synchronize()
        t = time.perf_counter() - t0
        ok = bool((cp.asnumpy(dst[: 1 << 20]) == expect[: 1 << 20]).all())
        out[name] = {"GB_s": m / t / 1e9, "bytes_ok": ok}
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=8)
    p.add_argument("--path", default="/tmp/pin_probe.bin")
    p.add_argument("--out")
    args = p.parse_args(argv)
    import cupy as cp

    rt = cp.cuda.runtime
    n = int(args.gib * (1 << 30)) // 4096 * 4096
    t0 = time.perf_counter()
    write_file(args.path, n)
    res = {"bytes": n, "write_s": time.perf_counter() - t0, "device": rt.getDeviceProperties(0)["name"].decode()}
    expect = np.fromfile(args.path, dtype=np.uint8, count=1 << 20)
    try:
        res["readonly_register_supported"] = bool(rt.deviceGetAttribute(113, 0))  # HostRegisterReadOnlySupported
    except Exception as e:  # noqa: BLE001 - an older runtime
        res["readonly_register_supported"] = repr(e)

    def attempt(name, fn):
        try:
            res[name] = fn()
        except Exception as e:  # noqa: BLE001 - each way on its own: record why it failed
            res[name] = {"error": repr(e)}
        print(name, json.dumps(res[name]), flush=True)

    def alloc():
        t0 = time.perf_counter()
        ptr = rt.hostAlloc(n, 0)
        t_alloc = time.perf_counter() - t0
        t_read = read_into(args.path, ptr, n)
        r = {"alloc_GB_s": n / t_alloc / 1e9, "read_GB_s": n / t_read / 1e9, "load_GB_s": n / (t_alloc + t_read) / 1e9}
        r.update(gpu_reads(cp, ptr, n, expect))
        rt.freeHost(ptr)
        return r

    def huge():
        t0 = time.perf_counter()
        ptr = libc.mmap(None, n, 3, 0x22, -1, 0)  # PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS
        libc.madvise(ptr, n, MADV_HUGEPAGE)
        np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr))[::4096] = 0  # fault every page in
        t_touch = time.perf_counter() - t0
        t0 = time.perf_counter()
        rt.hostRegister(ptr, n, REG_MAPPED)
        t_reg = time.perf_counter() - t0
        t_read = read_into(args.path, ptr, n)
        r = {"touch_GB_s": n / t_touch / 1e9, "register_GB_s": n / t_reg / 1e9, "read_GB_s": n / t_read / 1e9,
             "load_GB_s": n / (t_touch + t_reg + t_read) / 1e9}
        r.update(gpu_reads(cp, ptr, n, expect))
        rt.hostUnregister(ptr)
        libc.munmap(ptr, n)
        return r

    def mapped():
        fd = os.open(args.path, os.O_RDONLY)
        t0 = time.perf_counter()
        ptr = libc.mmap(None, n, PROT_READ, MAP_SHARED, fd, 0)
        rt.hostRegister(ptr, n, REG_MAPPED | REG_READONLY)
        t_reg = time.perf_counter() - t0
        r = {"register_GB_s": n / t_reg / 1e9, "load_GB_s": n / t_reg / 1e9}
        r.update(gpu_reads(cp, ptr, n, expect))
        rt.hostUnregister(ptr)
        libc.munmap(ptr, n)
        os.close(fd)
        return r

    for name, fn in (("mapped", mapped), ("huge", huge), ("alloc", alloc)):
        attempt(name, fn)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return res


if __name__ == "__main__":
    main()
