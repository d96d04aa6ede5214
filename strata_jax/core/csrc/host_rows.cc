// CPU build of host_rows.h: the same call as the CUDA one, with memcpy. It lets CPU tests run the
// kernel path's plumbing (addresses, aliasing, the miss list) against the fetch loop.
#include <cstring>
#include "host_rows.h"

static ffi::Error HostRowsCpu(ffi::Buffer<ffi::U32> addr, ffi::Buffer<ffi::U8> pool, ffi::Buffer<ffi::S32> row,
                              ffi::Buffer<ffi::S32> dst, ffi::Buffer<ffi::S32> miss, int64_t rows,
                              ffi::ResultBuffer<ffi::U8> out) {
  int64_t X = 0, P = 0;
  if (auto e = strata_dims(pool, "strata_host_rows", X, P); e.failure()) return e;
  const int64_t U = row.element_count();
  const uint8_t* base = strata_base(addr.typed_data());
  uint8_t* o = out->typed_data();
  if (o != pool.typed_data()) std::memcpy(o, pool.typed_data(), X * P);
  for (int64_t j = 0; j < U; ++j) {
    const int64_t r = row.typed_data()[j], d = dst.typed_data()[j];
    if (!miss.typed_data()[j] || r < 0 || r >= rows || d < 0 || d >= X) continue;
    std::memcpy(o + d * P, base + r * P, P);
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataHostRowsCpu, HostRowsCpu, STRATA_HOST_ROWS_BIND(ffi::Ffi::Bind()));

static ffi::Error HostPutCpu(ffi::Buffer<ffi::U32> addr, ffi::Buffer<ffi::U8> token, ffi::Buffer<ffi::U8> src,
                             ffi::Buffer<ffi::S32> row, ffi::Buffer<ffi::S32> put, int64_t rows,
                             ffi::ResultBuffer<ffi::U8> out) {
  int64_t U = 0, P = 0;
  if (auto e = strata_dims(src, "strata_host_put", U, P); e.failure()) return e;
  uint8_t* base = const_cast<uint8_t*>(strata_base(addr.typed_data()));
  for (int64_t j = 0; j < U; ++j) {
    const int64_t r = row.typed_data()[j];
    if (!put.typed_data()[j] || r < 0 || r >= rows) continue;
    std::memcpy(base + r * P, src.typed_data() + j * P, P);
  }
  if (out->typed_data() != token.typed_data()) std::memcpy(out->typed_data(), token.typed_data(), token.element_count());
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataHostPutCpu, HostPutCpu, STRATA_HOST_PUT_BIND(ffi::Ffi::Bind()));

static ffi::Error FileRowsCpu(ffi::Buffer<ffi::U32> table, ffi::Buffer<ffi::U8> pool, ffi::Buffer<ffi::S32> row,
                              ffi::Buffer<ffi::S32> dst, ffi::Buffer<ffi::S32> miss, int64_t rows, int64_t E,
                              int64_t w0, int64_t w1, int64_t w2, ffi::ResultBuffer<ffi::U8> out) {
  int64_t X = 0, P = 0;
  if (auto e = strata_dims(pool, "strata_file_rows", X, P); e.failure()) return e;
  if (P != w0 + w1 + w2) return ffi::Error::InvalidArgument("strata_file_rows: the pieces do not make a slot row");
  const int64_t U = row.element_count(), T = w2 ? 3 : (w1 ? 2 : 1);
  uint8_t* o = out->typed_data();
  if (o != pool.typed_data()) std::memcpy(o, pool.typed_data(), X * P);
  for (int64_t j = 0; j < U; ++j) {
    const int64_t r = row.typed_data()[j], d = dst.typed_data()[j];
    if (!miss.typed_data()[j] || r < 0 || r >= rows || d < 0 || d >= X) continue;
    const int64_t l = r / E, e = r % E;
    int64_t at = 0;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t w = strata_piece(t, w0, w1, w2);
      std::memcpy(o + d * P + at, strata_base(table.typed_data() + 2 * (l * T + t)) + e * w, w);
      at += w;
    }
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataFileRowsCpu, FileRowsCpu, STRATA_FILE_ROWS_BIND(ffi::Ffi::Bind()));

extern "C" void* strata_device_pointer(void* host) { return host; }

static ffi::Error RowGetCpu(ffi::Buffer<ffi::U8> src, ffi::Buffer<ffi::S32> idx, ffi::ResultBuffer<ffi::U8> out) {
  int64_t L = 0, P = 0;
  if (auto e = strata_dims(src, "strata_row_get", L, P); e.failure()) return e;
  const int64_t i = strata_clamp(idx.typed_data()[0], L);
  std::memcpy(out->typed_data(), src.typed_data() + i * P, P);
  return ffi::Error::Success();
}

static ffi::Error RowPutCpu(ffi::Buffer<ffi::U8> dst, ffi::Buffer<ffi::U8> row, ffi::Buffer<ffi::S32> idx,
                            ffi::ResultBuffer<ffi::U8> out) {
  int64_t L = 0, P = 0;
  if (auto e = strata_dims(dst, "strata_row_put", L, P); e.failure()) return e;
  const int64_t i = strata_clamp(idx.typed_data()[0], L);
  uint8_t* o = out->typed_data();
  if (o != dst.typed_data()) std::memcpy(o, dst.typed_data(), L * P);
  std::memcpy(o + i * P, row.typed_data(), P);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataRowGetCpu, RowGetCpu, STRATA_ROW_GET_BIND(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataRowPutCpu, RowPutCpu, STRATA_ROW_PUT_BIND(ffi::Ffi::Bind()));

// host memory needs no registering for the CPU's own kernels
extern "C" int strata_host_register(void*, size_t, int) { return 0; }
extern "C" int strata_host_unregister(void*) { return 0; }
extern "C" const char* strata_error_string(int) { return "no error"; }
