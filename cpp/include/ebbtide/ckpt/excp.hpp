// ExCP delta encoding of one weight and its Adam moments (Li et al. 2024,
// "ExCP: Extreme LLM Checkpoint Compression via Weight-Momentum Joint
// Shrinking"): the residual against the base, the weight and moment masks,
// per-tensor k-means codebooks, bit-packed masks and one-byte codes, and the
// error of what decodes against the exact values (Note [ExCP encoding] in
// excp.cpp). The checkpoint layout of the result is python/ebbtide/
// checkpoint/lossy.py's Note [Lossy tensor layout]; decoding stays there.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace ebbtide::ckpt::excp {

struct Options {
  // Kept fraction of each weight's residuals (top by |r| sqrt(v)); the
  // floor when `tolerance` > 0.
  double density = 0.1;
  // > 0: keep more than `density` where needed so that the dropped
  // residuals' L2 norm stays within tolerance x the weight's L2 norm (Note
  // [Density that follows the update]).
  double tolerance = 0.0;
  // >= 0: the paper's fixed threshold instead: keep |r| sqrt(v) > alpha *
  // median|W| (tolerance and density are then unused).
  double alpha = -1.0;
  // First moments are kept where the residual is and |m| > beta * mean|m|.
  double beta = 0.0;
  int bits = 4;            // codebook of the residuals: 2^bits centres
  int bits_moments = 4;    // codebooks of the kept moments
  bool carry_v = true;     // an unkept v decodes to the base's (else 0)
  int kmeans_iters = 8;    // Lloyd steps per codebook
};

// One weight to encode, `n` fp32 values each, host memory, read only. `m`
// and `v` (Adam's moments) are null together or set together; `base_v`
// (the base's v) is read only with carry_v.
struct Weight {
  const float* w = nullptr;
  const float* base = nullptr;
  uint64_t n = 0;
  const float* m = nullptr;
  const float* v = nullptr;
  const float* base_v = nullptr;
};

// One encoded tensor. The mask has one bit per element (LSB first), over
// the weight's elements, or for the moments over the weight's kept ones.
struct Coded {
  std::vector<uint8_t> mask;
  std::vector<uint8_t> codes;     // one per kept value, each < 2^bits
  std::vector<float> codebook;    // 2^bits centres, sorted (logarithms for v)
  uint64_t count = 0;             // kept values
  double kept = 0;                // count / elements
  // Of the decoded tensor against the exact one: max |error|, sum of
  // squared errors, sum of squared exact values.
  double max_abs = 0, sq_err = 0, sq_ref = 0;
};

struct Encoded {
  Coded w, m, v;  // m and v empty without moments
  bool carried = false;  // v decodes to the base's v where not kept
};

// Runs fn(i) for every i < n, on any threads; returns when all have run
// and rethrows the first error. The checkpoint writer passes its workers.
using ParallelFor = std::function<void(size_t n, const std::function<void(size_t)>& fn)>;

// Working memory of encode(), kept by a caller that encodes many tensors
// so that its pages are faulted in once (on the 2-core VM fresh memory
// costs as much as the encoding). Not shared between concurrent calls.
struct Scratch {
  std::vector<uint32_t> keys, counts;
  std::vector<float> r, m, v;
  std::vector<uint8_t> m_flag;
};

// Encodes `in` (Note [ExCP encoding]). Throws InvalidArgument for bad
// options (bits outside 1..8, density outside (0, 1], tolerance outside
// [0, 1), a negative beta, kmeans_iters < 0) or a weight with moments
// missing one of them. Serial when `parallel` is empty.
Encoded encode(const Weight& in, const Options& o, const ParallelFor& parallel = {}, Scratch* scratch = nullptr);

struct Job {
  Weight in;
  Options o;
};

// encode() of every job, each result the same as alone (Note [ExCP
// batches]): a weight of at least 1 / (2 runners) of the batch's elements
// is split over `parallel`, the others run side by side, one per runner,
// largest first. `runners`: how many threads `parallel` runs at once.
// `scratch` (resized to `runners`) is kept across calls; options are
// checked for every job before any is encoded.
std::vector<Encoded> encode_batch(const std::vector<Job>& jobs, unsigned runners, const ParallelFor& parallel = {},
                                  std::vector<Scratch>* scratch = nullptr);

}  // namespace ebbtide::ckpt::excp
