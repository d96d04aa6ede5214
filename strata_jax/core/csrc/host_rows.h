// Copy chosen expert rows from a host (pinned) store into device slots, with the row and slot ids read
// from device memory: a fetch that needs no host round trip (core/hostrows.py says why).
//   addr   u32[2]  the store group's base address (lo, hi): host memory the device can read (UVA)
//   pool   u8[X, P] the slot pool, aliased to the result (written in place)
//   row    s32[U]   store row of each request (layer * E + expert)
//   dst    s32[U]   pool row to write it to
//   miss   s32[U]   nonzero: copy this one; zero: skip (a hit, or padding)
//   rows   attribute: rows in the store group (a bound check; an out-of-range request is skipped)
#pragma once
#include <cstdint>
#include <string>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#ifdef __CUDACC__
#define STRATA_HD __host__ __device__
#else
#define STRATA_HD
#endif

STRATA_HD inline const uint8_t* strata_base(const uint32_t* addr) {
  return reinterpret_cast<const uint8_t*>((static_cast<uint64_t>(addr[1]) << 32) | addr[0]);
}

// strata_row_get / strata_row_put: row idx of a device array [L, P] read out, or written in place, with
// idx read on the device (clamped to [0, L), as XLA's dynamic slices clamp). XLA runs a plain dynamic
// slice or update at a loop-dependent index as a memcpy thunk that needs the index on the host, which
// keeps the loop out of its command buffers; these are kernels, which it records.
STRATA_HD inline int64_t strata_clamp(int64_t i, int64_t L) { return i < 0 ? 0 : (i >= L ? L - 1 : i); }

// rows and bytes per row of a 2-D uint8 buffer, or the error naming the call that got another shape
inline ffi::Error strata_dims(const ffi::Buffer<ffi::U8>& b, const char* call, int64_t& rows, int64_t& bytes) {
  auto dims = b.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument(std::string(call) + ": expected a 2-D [rows, bytes] buffer");
  rows = dims[0];
  bytes = dims[1];
  return ffi::Error::Success();
}

// each call's operands, attributes and result after the platform's context: one binding for both builds
#define STRATA_HOST_ROWS_BIND(b)                                                                     \
  b.Arg<ffi::Buffer<ffi::U32>>().Arg<ffi::Buffer<ffi::U8>>().Arg<ffi::Buffer<ffi::S32>>()           \
      .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>().Attr<int64_t>("rows").Ret<ffi::Buffer<ffi::U8>>()
// strata_host_put: the other way, device rows written into host memory (the KV cache's cells past the
// device's, model/kvquant.py StreamedKV). token u8[1] is aliased to the result: it orders later reads after
// the write (they take the returned token), since XLA sees no other tie between them.
//   addr u32[2], token u8[1], src u8[U, P], row s32[U] (host row of each), put s32[U] (nonzero: write it)
#define STRATA_HOST_PUT_BIND(b)                                                                      \
  b.Arg<ffi::Buffer<ffi::U32>>().Arg<ffi::Buffer<ffi::U8>>().Arg<ffi::Buffer<ffi::U8>>()            \
      .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>().Attr<int64_t>("rows").Ret<ffi::Buffer<ffi::U8>>()
#define STRATA_ROW_GET_BIND(b) b.Arg<ffi::Buffer<ffi::U8>>().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::U8>>()
#define STRATA_ROW_PUT_BIND(b) \
  b.Arg<ffi::Buffer<ffi::U8>>().Arg<ffi::Buffer<ffi::U8>>().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::U8>>()
// strata_file_rows: strata_host_rows for a store that is the model file itself (offload/store.py, mapped):
// row r is layer r / E's expert r % E, whose bytes are `parts` pieces, piece t of width w_t at
// table[l][t] + (r % E) * w_t (an expert tensor of the layer, wherever its file is mapped), back to back in the
// slot's row. table u32[L, parts, 2] (lo, hi); the other operands as strata_host_rows'.
#define STRATA_FILE_ROWS_BIND(b)                                                                     \
  b.Arg<ffi::Buffer<ffi::U32>>().Arg<ffi::Buffer<ffi::U8>>().Arg<ffi::Buffer<ffi::S32>>()           \
      .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>().Attr<int64_t>("rows")               \
      .Attr<int64_t>("experts").Attr<int64_t>("w0").Attr<int64_t>("w1").Attr<int64_t>("w2")          \
      .Ret<ffi::Buffer<ffi::U8>>()

STRATA_HD inline int64_t strata_piece(int64_t t, int64_t w0, int64_t w1, int64_t w2) {
  return t == 0 ? w0 : (t == 1 ? w1 : w2);
}
