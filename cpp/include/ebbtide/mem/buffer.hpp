// Bytes in host memory or on a CUDA device, with the stream that orders
// copies of them: what every transfer of the core takes (io::Engine requests,
// cache::Store puts and gets, tensor cache saves, checkpoint blobs).
//
// Const rule: `ptr` is always `void*`. A Buffer that a call only reads (the
// source of a write, put or save) is taken as `const Buffer&` and is never
// written through; a caller holding read-only memory casts its constness away
// where it builds the Buffer. Destinations (reads, gets) are written.
#pragma once

#include <cstdint>

#include "ebbtide/mem/cuda_shim.hpp"

namespace ebbtide::mem {

constexpr int kHost = -1;  // Buffer::device of host memory

// device >= 0: `ptr` is a CUDA device pointer on that ordinal, copied on
// `stream` after the work already queued there (the caller orders the stream
// after the data's producer). The tensor cache uses the ordinal (one copy
// stream per device); io::Engine and the checkpoint writer find the device
// from the pointer and test only on_device(), so their callers that know no
// ordinal pass 0. Host memory: any alignment; `stream` unused.
struct Buffer {
  void* ptr = nullptr;
  uint64_t nbytes = 0;
  int device = kHost;
  cuda::Stream stream = 0;  // CUstream (0 = legacy default stream)

  bool on_device() const { return device >= 0; }
};

}  // namespace ebbtide::mem
