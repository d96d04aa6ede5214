// CUDA build of host_rows.h: each block copies one chunk of one requested row, reading the pinned store
// over PCIe (zero copy) and writing the slot in device memory. The ids stay on the device, so the call
// is one kernel launch that XLA can record into its command buffers (CUDA graphs).
#include <cuda_runtime.h>
#include "host_rows.h"

constexpr int kThreads = 256;
constexpr int64_t kChunk = 64 << 10;  // bytes per block: enough blocks in flight to fill the link
// device-to-device rows: one 16-byte word per thread, so a state row spreads over many blocks (64 KiB
// blocks left most SMs idle on a 2 MiB row; docs/benchmarks.md)
constexpr int64_t kRowChunk = kThreads * 16;

// grid.y is capped at 65,535 blocks: requests past it are taken by the same blocks, gridDim.y apart (a KV
// cache's streamed span is one request per cell)
constexpr unsigned kMaxGridY = 65535;

__global__ void host_rows_kernel(const uint32_t* addr, uint8_t* pool, const int32_t* row, const int32_t* dst,
                                 const int32_t* miss, int64_t rows, int64_t X, int64_t P, int64_t U) {
  for (int64_t j = blockIdx.y; j < U; j += gridDim.y) {
    if (!miss[j]) continue;
    const int64_t r = row[j], d = dst[j];
    if (r < 0 || r >= rows || d < 0 || d >= X) continue;
    const uint8_t* src = strata_base(addr) + r * P;
    uint8_t* out = pool + d * P;
    const int64_t begin = blockIdx.x * kChunk, end = min(begin + kChunk, P);
    const bool vec = ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(out) | begin | end) & 15) == 0;
    if (vec) {  // 16-byte loads, four in flight per thread before the stores
      const uint4* s = reinterpret_cast<const uint4*>(src + begin);
      uint4* o = reinterpret_cast<uint4*>(out + begin);
      const int64_t n = (end - begin) / 16;
      int64_t i = threadIdx.x;
      for (; i + 3 * kThreads < n; i += 4 * kThreads) {
        uint4 a = s[i], b = s[i + kThreads], c = s[i + 2 * kThreads], e = s[i + 3 * kThreads];
        o[i] = a; o[i + kThreads] = b; o[i + 2 * kThreads] = c; o[i + 3 * kThreads] = e;
      }
      for (; i < n; i += kThreads) o[i] = s[i];
    } else {
      for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) out[i] = src[i];
    }
  }
}

static ffi::Error HostRowsCuda(cudaStream_t stream, ffi::Buffer<ffi::U32> addr, ffi::Buffer<ffi::U8> pool,
                               ffi::Buffer<ffi::S32> row, ffi::Buffer<ffi::S32> dst, ffi::Buffer<ffi::S32> miss,
                               int64_t rows, ffi::ResultBuffer<ffi::U8> out) {
  int64_t X = 0, P = 0;
  if (auto e = strata_dims(pool, "strata_host_rows", X, P); e.failure()) return e;
  const int64_t U = row.element_count();
  uint8_t* o = out->typed_data();
  if (o != pool.typed_data()) {  // XLA aliases them (input_output_aliases); copy if it ever does not
    cudaError_t e = cudaMemcpyAsync(o, pool.typed_data(), X * P, cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(e));
  }
  if (U == 0 || P == 0) return ffi::Error::Success();
  dim3 grid(static_cast<unsigned>((P + kChunk - 1) / kChunk), static_cast<unsigned>(U < kMaxGridY ? U : kMaxGridY));
  host_rows_kernel<<<grid, kThreads, 0, stream>>>(addr.typed_data(), o, row.typed_data(), dst.typed_data(),
                                                  miss.typed_data(), rows, X, P, U);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? ffi::Error::Success() : ffi::Error::Internal(cudaGetErrorString(e));
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataHostRowsCuda, HostRowsCuda, STRATA_HOST_ROWS_BIND(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

// bytes [begin, end) of s into o by one block: 16-byte words where both are aligned for them
__device__ inline void copy_span(const uint8_t* s, uint8_t* o, int64_t begin, int64_t end) {
  const bool vec = ((reinterpret_cast<uintptr_t>(s) | reinterpret_cast<uintptr_t>(o) | begin | end) & 15) == 0;
  if (vec) {
    const uint4* s4 = reinterpret_cast<const uint4*>(s + begin);
    uint4* o4 = reinterpret_cast<uint4*>(o + begin);
    for (int64_t k = threadIdx.x; k < (end - begin) / 16; k += kThreads) o4[k] = s4[k];
  } else {
    for (int64_t k = begin + threadIdx.x; k < end; k += kThreads) o[k] = s[k];
  }
}

// device rows written into host rows (zero copy over PCIe): block (x, j) writes chunk x of row j
__global__ void host_put_kernel(const uint32_t* addr, const uint8_t* src, const int32_t* row, const int32_t* put,
                                int64_t rows, int64_t P, int64_t U) {
  for (int64_t j = blockIdx.y; j < U; j += gridDim.y) {
    if (!put[j]) continue;
    const int64_t r = row[j];
    if (r < 0 || r >= rows) continue;
    const int64_t begin = blockIdx.x * kChunk;
    copy_span(src + j * P, const_cast<uint8_t*>(strata_base(addr)) + r * P, begin, min(begin + kChunk, P));
  }
}

static ffi::Error HostPutCuda(cudaStream_t stream, ffi::Buffer<ffi::U32> addr, ffi::Buffer<ffi::U8> token,
                              ffi::Buffer<ffi::U8> src, ffi::Buffer<ffi::S32> row, ffi::Buffer<ffi::S32> put,
                              int64_t rows, ffi::ResultBuffer<ffi::U8> out) {
  int64_t U = 0, P = 0;
  if (auto e = strata_dims(src, "strata_host_put", U, P); e.failure()) return e;
  if (out->typed_data() != token.typed_data()) {
    cudaError_t e = cudaMemcpyAsync(out->typed_data(), token.typed_data(), token.element_count(),
                                    cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(e));
  }
  if (U == 0 || P == 0) return ffi::Error::Success();
  dim3 grid(static_cast<unsigned>((P + kChunk - 1) / kChunk), static_cast<unsigned>(U < kMaxGridY ? U : kMaxGridY));
  host_put_kernel<<<grid, kThreads, 0, stream>>>(addr.typed_data(), src.typed_data(), row.typed_data(),
                                                 put.typed_data(), rows, P, U);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? ffi::Error::Success() : ffi::Error::Internal(cudaGetErrorString(e));
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataHostPutCuda, HostPutCuda, STRATA_HOST_PUT_BIND(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

// one row copied between two device buffers, block b taking chunk b (kRowChunk); the row index is read on
// the device
__global__ void row_copy_kernel(const uint8_t* src, uint8_t* dst, const int32_t* idx, int64_t L, int64_t P,
                                bool get) {
  const int64_t i = strata_clamp(idx[0], L);
  const int64_t begin = blockIdx.x * kRowChunk;
  copy_span(get ? src + i * P : src, get ? dst : dst + i * P, begin, min(begin + kRowChunk, P));
}

static ffi::Error RowGetCuda(cudaStream_t stream, ffi::Buffer<ffi::U8> src, ffi::Buffer<ffi::S32> idx,
                             ffi::ResultBuffer<ffi::U8> out) {
  int64_t L = 0, P = 0;
  if (auto e = strata_dims(src, "strata_row_get", L, P); e.failure()) return e;
  if (P == 0) return ffi::Error::Success();
  row_copy_kernel<<<static_cast<unsigned>((P + kRowChunk - 1) / kRowChunk), kThreads, 0, stream>>>(
      src.typed_data(), out->typed_data(), idx.typed_data(), L, P, true);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? ffi::Error::Success() : ffi::Error::Internal(cudaGetErrorString(e));
}

static ffi::Error RowPutCuda(cudaStream_t stream, ffi::Buffer<ffi::U8> dst, ffi::Buffer<ffi::U8> row,
                             ffi::Buffer<ffi::S32> idx, ffi::ResultBuffer<ffi::U8> out) {
  int64_t L = 0, P = 0;
  if (auto e = strata_dims(dst, "strata_row_put", L, P); e.failure()) return e;
  uint8_t* o = out->typed_data();
  if (o != dst.typed_data()) {
    cudaError_t e = cudaMemcpyAsync(o, dst.typed_data(), L * P, cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(e));
  }
  if (P == 0) return ffi::Error::Success();
  row_copy_kernel<<<static_cast<unsigned>((P + kRowChunk - 1) / kRowChunk), kThreads, 0, stream>>>(
      row.typed_data(), o, idx.typed_data(), L, P, false);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? ffi::Error::Success() : ffi::Error::Internal(cudaGetErrorString(e));
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataRowGetCuda, RowGetCuda, STRATA_ROW_GET_BIND(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataRowPutCuda, RowPutCuda, STRATA_ROW_PUT_BIND(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

// a store that is the model file (host_rows.h, strata_file_rows): block (x, j) writes chunk x of request j's
// slot row, taking each piece of the expert's bytes that falls in it from its tensor in the mapped file
__global__ void file_rows_kernel(const uint32_t* table, uint8_t* pool, const int32_t* row, const int32_t* dst,
                                 const int32_t* miss, int64_t rows, int64_t E, int64_t X, int64_t P, int64_t w0,
                                 int64_t w1, int64_t w2, int64_t U) {
  const int64_t T = w2 ? 3 : (w1 ? 2 : 1);
  for (int64_t j = blockIdx.y; j < U; j += gridDim.y) {
    if (!miss[j]) continue;
    const int64_t r = row[j], d = dst[j];
    if (r < 0 || r >= rows || d < 0 || d >= X) continue;
    const int64_t l = r / E, e = r % E;
    const int64_t begin = blockIdx.x * kChunk, end = min(begin + kChunk, P);
    int64_t at = 0;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t w = strata_piece(t, w0, w1, w2), lo = max(begin, at), hi = min(end, at + w);
      if (lo < hi) copy_span(strata_base(table + 2 * (l * T + t)) + e * w - at, pool + d * P, lo, hi);
      at += w;
    }
  }
}

static ffi::Error FileRowsCuda(cudaStream_t stream, ffi::Buffer<ffi::U32> table, ffi::Buffer<ffi::U8> pool,
                               ffi::Buffer<ffi::S32> row, ffi::Buffer<ffi::S32> dst, ffi::Buffer<ffi::S32> miss,
                               int64_t rows, int64_t experts, int64_t w0, int64_t w1, int64_t w2,
                               ffi::ResultBuffer<ffi::U8> out) {
  int64_t X = 0, P = 0;
  if (auto e = strata_dims(pool, "strata_file_rows", X, P); e.failure()) return e;
  if (P != w0 + w1 + w2) return ffi::Error::InvalidArgument("strata_file_rows: the pieces do not make a slot row");
  const int64_t U = row.element_count();
  uint8_t* o = out->typed_data();
  if (o != pool.typed_data()) {
    cudaError_t e = cudaMemcpyAsync(o, pool.typed_data(), X * P, cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(e));
  }
  if (U == 0 || P == 0) return ffi::Error::Success();
  dim3 grid(static_cast<unsigned>((P + kChunk - 1) / kChunk), static_cast<unsigned>(U < kMaxGridY ? U : kMaxGridY));
  file_rows_kernel<<<grid, kThreads, 0, stream>>>(table.typed_data(), o, row.typed_data(), dst.typed_data(),
                                                  miss.typed_data(), rows, experts, X, P, w0, w1, w2, U);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? ffi::Error::Success() : ffi::Error::Internal(cudaGetErrorString(e));
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataFileRowsCuda, FileRowsCuda, STRATA_FILE_ROWS_BIND(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

// The address a kernel reads host memory `host` at (the same under UVA; 0 if it is not pinned memory
// the device can reach, then the engine keeps the fetch loop).
extern "C" void* strata_device_pointer(void* host) {
  void* dev = nullptr;
  if (cudaHostGetDevicePointer(&dev, host, 0) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return dev;
}

// Host memory of the engine's own (an expert store it allocated: offload/store.py HostMemory), or a model file's
// read-only mapping, page-locked and mapped for every device, so the kernels above can read it; 0 or the CUDA
// error's number.
extern "C" int strata_host_register(void* host, size_t bytes, int read_only) {
  cudaError_t e = cudaHostRegister(host, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped |
                                                    (read_only ? cudaHostRegisterReadOnly : 0));
  if (e != cudaSuccess) cudaGetLastError();
  return static_cast<int>(e);
}

extern "C" int strata_host_unregister(void* host) {
  cudaError_t e = cudaHostUnregister(host);
  if (e != cudaSuccess) cudaGetLastError();
  return static_cast<int>(e);
}

extern "C" const char* strata_error_string(int e) { return cudaGetErrorString(static_cast<cudaError_t>(e)); }
