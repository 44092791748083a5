// Checks shared by the CPU and CUDA residency kernels (ops.cpp has the schemas).
#pragma once

#include <cstdint>

namespace mmreuse {

// Whether a bitmap of `words` int32 words holds `num_blocks` bits, without overflow for any
// caller-supplied int64 (`(num_blocks + 31) / 32` overflows near 2**63).
inline bool fits_bitmap(int64_t num_blocks, int64_t words) {
  return num_blocks >= 0 && words >= 0 && num_blocks / 32 + (num_blocks % 32 != 0) <= words;
}

}  // namespace mmreuse
