// Internal: what the files of the safetensors support share: safetensors.cpp
// (the header: parsing, validation, encoding), safetensors_read.cpp (Reader)
// and safetensors_save.cpp (save()).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ebbtide/ckpt/safetensors.hpp"
#include "ebbtide/mem/cuda_shim.hpp"
#include "shard_io.hpp"

namespace ebbtide::ckpt::safetensors {

// A name as error messages show it: quoted, cut to 120 bytes (a hostile
// header may hold names of megabytes).
inline std::string quoted(std::string_view name) {
  if (name.size() <= 120) return "'" + std::string(name) + "'";
  return "'" + std::string(name.substr(0, 120)) + "...' (" + std::to_string(name.size()) + " bytes)";
}

// Bytes of `shape` elements of `bits` each; false when the product overflows
// or does not end at a byte boundary.
inline bool tensor_bytes(const std::vector<uint64_t>& shape, uint32_t bits, uint64_t* out) {
  if (std::find(shape.begin(), shape.end(), uint64_t{0}) != shape.end()) {
    *out = 0;
    return true;
  }
  // Every partial product stays at most `limit` (2^67), so none wraps 128 bits.
  const unsigned __int128 limit = (static_cast<unsigned __int128>(UINT64_MAX) << 3) | 7;
  unsigned __int128 total = bits;
  for (uint64_t d : shape) {
    if (total > limit / d) return false;
    total *= d;
  }
  if (total % 8 != 0) return false;
  *out = static_cast<uint64_t>(total / 8);
  return true;
}

constexpr uint64_t kPieceBytes = 4ull << 20;  // one transfer (and one staging buffer)

inline mem::cuda::Driver* need_driver(const std::string& tensor, const IoOptions& opt) {
  return detail::device_driver(opt.cuda_driver, "tensor ", quoted(tensor), " is in CUDA device memory");
}

}  // namespace ebbtide::ckpt::safetensors
