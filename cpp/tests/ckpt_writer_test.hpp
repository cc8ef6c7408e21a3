// The backend-parameterized checkpoint writer fixture of test_ckpt_format.cpp
// (which instantiates it) and test_ckpt_pipeline.cpp.
#pragma once

#include <gtest/gtest.h>

#include "ebbtide/ckpt/writer.hpp"
#include "ebbtide/io/engine.hpp"

namespace ebbtide::ckpt {

class CkptWriterTest : public ::testing::TestWithParam<io::BackendKind> {
 protected:
  // The parameter's backend, 2 threads, chunks of `chunk` bytes.
  WriterOptions options(uint64_t chunk) const {
    WriterOptions o;
    o.chunk_bytes = chunk;
    o.threads = 2;
    o.backend = GetParam();
    return o;
  }
};

}  // namespace ebbtide::ckpt
