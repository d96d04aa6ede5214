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
