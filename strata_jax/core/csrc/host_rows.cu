// CUDA build of host_rows.h: each block copies one chunk of one requested row, reading the pinned store
// over PCIe (zero copy) and writing the slot in device memory. The ids stay on the device, so the call
// is one kernel launch that XLA can record into its command buffers (CUDA graphs).
#include <cuda_runtime.h>
#include "host_rows.h"

constexpr int kThreads = 256;
constexpr int64_t kChunk = 64 << 10;  // bytes per block: enough blocks in flight to fill the link

__global__ void host_rows_kernel(const uint32_t* addr, uint8_t* pool, const int32_t* row, const int32_t* dst,
                                 const int32_t* miss, int64_t rows, int64_t X, int64_t P) {
  const int j = blockIdx.y;
  if (!miss[j]) return;
  const int64_t r = row[j], d = dst[j];
  if (r < 0 || r >= rows || d < 0 || d >= X) return;
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

static ffi::Error HostRowsCuda(cudaStream_t stream, ffi::Buffer<ffi::U32> addr, ffi::Buffer<ffi::U8> pool,
                               ffi::Buffer<ffi::S32> row, ffi::Buffer<ffi::S32> dst, ffi::Buffer<ffi::S32> miss,
                               int64_t rows, ffi::ResultBuffer<ffi::U8> out) {
  auto dims = pool.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("strata_host_rows: pool must be 2-D [slots, bytes]");
  const int64_t X = dims[0], P = dims[1], U = row.element_count();
  uint8_t* o = out->typed_data();
  if (o != pool.typed_data()) {  // XLA aliases them (input_output_aliases); copy if it ever does not
    cudaError_t e = cudaMemcpyAsync(o, pool.typed_data(), X * P, cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(e));
  }
  if (U == 0 || P == 0) return ffi::Error::Success();
  dim3 grid(static_cast<unsigned>((P + kChunk - 1) / kChunk), static_cast<unsigned>(U));
  host_rows_kernel<<<grid, kThreads, 0, stream>>>(addr.typed_data(), o, row.typed_data(), dst.typed_data(),
                                                  miss.typed_data(), rows, X, P);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? ffi::Error::Success() : ffi::Error::Internal(cudaGetErrorString(e));
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataHostRowsCuda, HostRowsCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("rows")
                                  .Ret<ffi::Buffer<ffi::U8>>(),
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
