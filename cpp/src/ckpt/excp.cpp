// Note [ExCP encoding]
// One weight W (n fp32 values) against its base B (the previous checkpoint
// as loaded), with Adam's moments m and v when the state has them:
//  1. residual r = W - B, scored s = |r| sqrt(v) (|r| without moments): 1/2 v
//     r^2 is the Fisher estimate of what dropping r costs;
//  2. the weight mask keeps the k largest scores, ties included (a score of
//     0 never): k = round(density n), raised where the update is large
//     (Note [Density that follows the update]), or with alpha the paper's
//     fixed threshold alpha median|W|;
//  3. m is kept where r is and |m| > beta mean|m|; v on m's mask;
//  4. the kept r, m and log(max(v, 1e-30)) are each quantised to the nearest
//     of 2^bits centres of a k-means codebook (quantiles of up to 65,536
//     evenly spaced samples as the start, then Lloyd steps); codes are one
//     byte per kept value, masks one bit per element, LSB first (m's and v's
//     over the weight's kept elements);
//  5. the error of what decodes (B + decoded r; decoded m, 0 elsewhere;
//     exp of decoded log v, the base's v or 0 elsewhere) against W, m, v.
// Note [ExCP batches]
// Splitting one weight over threads leaves them idle in the serial steps
// between passes (the histogram, the threshold, the codebooks' fits, the
// zeroed outputs): 1.7 of 2 cores busy on a 109M-parameter state. A batch
// runs whole weights side by side instead, one per thread and largest first
// (a weight at a time keeps its memory traffic local to one core), and
// splits only a weight too large to balance so: one holding 1 / (2
// runners) of the batch's elements or more. Each weight's result does not
// depend on where it ran (Note [ExCP encoding]), so a batch returns what
// encode() of each would.
//
// The k-th largest score is found exactly without sorting: a histogram of
// the top 16 bits of the scores' bit patterns (non-negative floats order as
// their bits do), then one of the low 16 bits inside the bucket holding it.
// Everything runs in passes over fixed parts of the tensor (a count that
// depends on n only), partial sums reduced in part order, so the result is
// the same on any number of threads. The passes recompute the score from
// W, B and v instead of storing it: storing costs as much memory traffic
// and a state-sized scratch buffer.
//
// Note [Density that follows the update]
// A fixed density keeps 10% of each residual whatever its size. Late in a
// run an update between checkpoints is small and its Fisher energy sum v r^2
// sits in few elements; early on, every element moves and the 90% dropped
// carried most of it (a 4-layer model at hidden 256 resumed from such a
// chain lost 7.7% against the uninterrupted run). With tolerance > 0 the
// weight mask is widened until the dropped residuals carry at most
// tolerance x the residual's whole Fisher energy, found on the same
// histogram (per bucket sums of v r^2), so a link costs what its update
// needs: density is the floor.
#include "ebbtide/ckpt/excp.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <utility>

#include "ebbtide/util/error.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace ebbtide::ckpt::excp {
namespace {

constexpr uint64_t kBlock = uint64_t{1} << 16;  // elements per block: a multiple of 8, so masks pack per block
constexpr uint64_t kChunk = 512;                // elements scored at a time, into arrays the compiler vectorises
constexpr uint64_t kMaxParts = 4;  // as many threads as a writer has at most
constexpr size_t kBuckets = size_t{1} << 15;  // top 16 bits of a non-negative float's pattern
constexpr float kTiny = 1e-30f;  // log-domain floor of second moments (an exact 0 decodes to 1e-30)
constexpr uint64_t kSample = uint64_t{1} << 14;  // codebooks are fitted on at most this many values

// Denormals as IEEE on this thread while it lives: a caller (or the thread
// that made the pool's workers) with flush-to-zero set, as
// torch.set_flush_denormal(True) sets it, would otherwise score tiny second
// moments as 0 on some threads and not on others.
struct IeeeDenormals {
#if defined(__x86_64__) || defined(__i386__)
  unsigned saved = _mm_getcsr();
  IeeeDenormals() { _mm_setcsr(saved & ~0x8040u); }  // FTZ (bit 15) and DAZ (bit 6) off
  ~IeeeDenormals() { _mm_setcsr(saved); }
#endif
};

void run(const ParallelFor& par, size_t n, const std::function<void(size_t)>& fn) {
  if (n == 1 || !par) {
    for (size_t i = 0; i < n; ++i) fn(i);
  } else if (n > 1) {
    par(n, [&fn](size_t i) {
      IeeeDenormals ieee;
      fn(i);
    });
  }
}

// Fixed parts of a range of n elements: whole blocks, at most kMaxParts.
struct Parts {
  uint64_t n, blocks, count;
  explicit Parts(uint64_t n_) : n(n_), blocks((n_ + kBlock - 1) / kBlock), count(std::min(kMaxParts, blocks)) {}
  uint64_t first_block(size_t p) const { return blocks * p / count; }
  uint64_t end(uint64_t block) const { return std::min(n, block * kBlock); }
};

// The scores of elements [i, i + len) as bit patterns, sign bit cleared (a
// NaN sorts above every number): |W - B| sqrt(v), or |W - B| without moments.
void score_keys(const Weight& in, uint64_t i, uint64_t len, uint32_t* keys) {
  const float* w = in.w + i;
  const float* b = in.base + i;
  if (in.v != nullptr) {
    const float* v = in.v + i;
    for (uint64_t j = 0; j < len; ++j)
      keys[j] = std::bit_cast<uint32_t>(std::fabs(w[j] - b[j]) * std::sqrt(v[j])) & 0x7fffffffu;
  } else {
    for (uint64_t j = 0; j < len; ++j) keys[j] = std::bit_cast<uint32_t>(std::fabs(w[j] - b[j])) & 0x7fffffffu;
  }
}

// Sums of squares of a chunk (float lanes, then double), and of |x|.
double sum_sq(const float* x, uint64_t n) {
  float s = 0;
  for (uint64_t j = 0; j < n; ++j) s += x[j] * x[j];
  return s;
}
double sum_abs(const float* x, uint64_t n) {
  float s = 0;
  for (uint64_t j = 0; j < n; ++j) s += std::fabs(x[j]);
  return s;
}

// Sorted boundaries between centres, padded with +inf to 2^bits entries:
// of(v) is the number of boundaries below v (torch.bucketize, right=False).
struct Buckets {
  std::vector<float> bound;
  unsigned k;
  explicit Buckets(const std::vector<float>& centres)
      : bound(centres.size(), std::numeric_limits<float>::infinity()), k(static_cast<unsigned>(centres.size())) {
    for (unsigned i = 0; i + 1 < k; ++i) bound[i] = (centres[i + 1] + centres[i]) / 2;
  }
  unsigned of(float v) const {
    unsigned lo = 0;
    for (unsigned s = k / 2; s >= 1; s /= 2) lo += bound[lo + s - 1] < v ? s : 0;
    return lo;
  }
  // of() of values[0, len) (each first raised to `floor`), len <= kChunk: up
  // to 16 centres by counting the boundaries below each value (a loop the
  // compiler vectorises), more by search.
  void of(const float* values, uint64_t len, float floor, uint8_t* out) const {
    if (k > 16) {
      for (uint64_t j = 0; j < len; ++j) out[j] = static_cast<uint8_t>(of(std::max(values[j], floor)));
      return;
    }
    float x[kChunk];
    uint32_t c[kChunk] = {};
    for (uint64_t j = 0; j < len; ++j) x[j] = std::max(values[j], floor);
    for (unsigned q = 0; q + 1 < k; ++q) {
      const float bq = bound[q];
      for (uint64_t j = 0; j < len; ++j) c[j] += bq < x[j];
    }
    for (uint64_t j = 0; j < len; ++j) out[j] = static_cast<uint8_t>(c[j]);
  }
};

// Sorts floats (NaN last) by their bit patterns, made to order as the
// values do: three passes of an 11-bit radix sort.
void sort_floats(std::vector<float>& x) {
  std::vector<uint32_t> a(x.size()), b(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const uint32_t u = std::bit_cast<uint32_t>(x[i]);
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    // Negative numbers reversed below the positive ones; NaN (either sign) above +inf.
    a[i] = nan ? 0xffffffffu : (u & 0x80000000u) ? ~u : u | 0x80000000u;
  }
  for (unsigned shift = 0; shift < 32; shift += 11) {
    uint32_t count[2048] = {};
    for (uint32_t u : a) ++count[(u >> shift) & 2047];
    uint32_t sum = 0;
    for (uint32_t& c : count) sum += std::exchange(c, sum);
    for (uint32_t u : a) b[count[(u >> shift) & 2047]++] = u;
    a.swap(b);
  }
  for (size_t i = 0; i < x.size(); ++i) {
    const uint32_t u = a[i];
    x[i] = u == 0xffffffffu ? std::numeric_limits<float>::quiet_NaN()
                            : std::bit_cast<float>((u & 0x80000000u) ? u & 0x7fffffffu : ~u);
  }
}

// torch.quantile(sorted, q), linear interpolation, in float32 as torch computes it.
float quantile(const std::vector<float>& sorted, float q) {
  const float rank = q * static_cast<float>(sorted.size() - 1);
  const auto below = static_cast<size_t>(std::floor(rank));
  const size_t above = std::min(below + 1, sorted.size() - 1);
  const float w = rank - static_cast<float>(below), a = sorted[below], b = sorted[above];
  return w < 0.5f ? a + w * (b - a) : b - (b - a) * (1 - w);
}

// The codebook of `values` (count of them; with `log`, of log(max(v,
// kTiny))): the quantiles of an evenly spaced sample of at most kSample
// values as the start, then Lloyd steps on that sample. The sample is
// sorted, so a step finds each centre's values as a range between two
// boundaries and sums them by prefix sums.
std::vector<float> codebook(const float* values, uint64_t count, int bits, int iters, bool log) {
  const unsigned k = 1u << bits;
  if (count == 0) return std::vector<float>(k, 0.0f);
  std::vector<float> x;
  const uint64_t step = (count + kSample - 1) / kSample;
  x.reserve(count / step + 1);
  for (uint64_t i = 0; i < count; i += step) x.push_back(log ? std::log(std::max(values[i], kTiny)) : values[i]);
  sort_floats(x);
  std::vector<float> centres(k);
  for (unsigned j = 0; j < k; ++j) centres[j] = quantile(x, (0.5f + static_cast<float>(j)) / static_cast<float>(k));
  std::vector<double> prefix(x.size() + 1, 0.0);
  for (size_t i = 0; i < x.size(); ++i) prefix[i + 1] = prefix[i] + x[i];
  for (int it = 0; it < iters; ++it) {
    std::sort(centres.begin(), centres.end());
    const Buckets b(centres);
    size_t start = 0;
    for (unsigned j = 0; j < k; ++j) {
      // Centre j takes the values v with bound[j-1] < v <= bound[j].
      const size_t end = j + 1 < k ? static_cast<size_t>(std::upper_bound(x.begin() + start, x.end(), b.bound[j]) -
                                                         x.begin())
                                   : x.size();
      if (end > start) centres[j] = static_cast<float>((prefix[end] - prefix[start]) / static_cast<double>(end - start));
      start = end;
    }
  }
  std::sort(centres.begin(), centres.end());
  return centres;
}

// Quantises `values` to c.codebook (fitted here; with `log` in the log
// domain of max(v, kTiny)), codes into c.codes, and adds the error of the
// decoded values (codebook values, exp'd with `log`) against them to c's
// sums. log() is monotonic, so the log domain's boundaries, exp'd, bucket
// the values themselves: only the fitting sample takes logarithms.
void quantise(const float* values, uint64_t count, int bits, int iters, bool log, Coded& c, const ParallelFor& par) {
  c.codebook = codebook(values, count, bits, iters, log);
  c.codes.assign(count, 0);
  if (count == 0) return;
  Buckets b(c.codebook);
  std::vector<float> decoded(c.codebook);
  if (log) {
    for (float& d : decoded) d = std::exp(d);
    for (float& x : b.bound) x = std::exp(x);  // +inf stays +inf
  }
  const float floor = log ? kTiny : -std::numeric_limits<float>::infinity();
  const Parts parts(count);
  struct Err {
    double sq = 0, max = 0;
  };
  std::vector<Err> err(parts.count);
  run(par, parts.count, [&](size_t p) {
    Err e;
    for (uint64_t i = parts.end(parts.first_block(p)), last = parts.end(parts.first_block(p + 1)); i < last;
         i += kChunk) {
      const uint64_t len = std::min(kChunk, last - i);
      float sq = 0;
      int32_t mx = 0;  // the largest |error|'s bit pattern (as in encode's pass 3)
      b.of(values + i, len, floor, c.codes.data() + i);
      for (uint64_t j = 0; j < len; ++j) {
        const float d = std::fabs(values[i + j] - decoded[c.codes[i + j]]);
        sq += d * d;
        mx = std::max(mx, std::bit_cast<int32_t>(d));
      }
      e.sq += sq;
      e.max = std::max(e.max, static_cast<double>(std::bit_cast<float>(mx)));
    }
    err[p] = e;
  });
  for (const Err& e : err) {
    c.sq_err += e.sq;
    c.max_abs = std::max(c.max_abs, e.max);
  }
}

// The ((n - 1) / 2 + 1)-th smallest |W| (torch's median: the lower one), exactly.
float median_abs(const float* w, uint64_t n) {
  std::vector<uint64_t> h(kBuckets, 0);
  for (uint64_t i = 0; i < n; ++i) ++h[std::bit_cast<uint32_t>(std::fabs(w[i])) >> 16];
  const uint64_t want = (n - 1) / 2 + 1;
  uint64_t seen = 0;
  size_t bucket = 0;
  for (; bucket + 1 < kBuckets && seen + h[bucket] < want; ++bucket) seen += h[bucket];
  std::vector<uint64_t> low(size_t{1} << 16, 0);
  for (uint64_t i = 0; i < n; ++i) {
    const uint32_t key = std::bit_cast<uint32_t>(std::fabs(w[i]));
    if ((key >> 16) == bucket) ++low[key & 0xffff];
  }
  size_t l = 0;
  for (; l + 1 < low.size() && seen + low[l] < want; ++l) seen += low[l];
  return std::bit_cast<float>(static_cast<uint32_t>(bucket << 16 | l));
}

void check(const Weight& in, const Options& o) {
  EBB_CHECK(o.bits >= 1 && o.bits <= 8 && o.bits_moments >= 1 && o.bits_moments <= 8, "ExCP: bits ", o.bits,
            " and bits_moments ", o.bits_moments, " must lie in 1..8");
  EBB_CHECK(o.density > 0 && o.density <= 1, "ExCP: density ", o.density, " is not in (0, 1]");
  EBB_CHECK(o.tolerance >= 0 && o.tolerance < 1, "ExCP: tolerance ", o.tolerance, " is not in [0, 1)");
  EBB_CHECK(o.beta >= 0, "ExCP: beta ", o.beta, " is negative");
  EBB_CHECK(o.kmeans_iters >= 0, "ExCP: kmeans_iters ", o.kmeans_iters, " is negative");
  EBB_CHECK((in.m == nullptr) == (in.v == nullptr), "ExCP: a weight's moments come in pairs (m and v)");
  EBB_CHECK(in.n == 0 || (in.w != nullptr && in.base != nullptr), "ExCP: a weight of ", in.n,
            " elements without its values or base");
  EBB_CHECK(!o.carry_v || in.v == nullptr || in.n == 0 || in.base_v != nullptr,
            "ExCP: carry_v needs the base's second moments");
}

// The sums of what is dropped (Note [ExCP encoding], step 5).
struct Dropped {
  double w_sq = 0, w_max = 0, m_sq = 0, m_max = 0, m_ref = 0, v_sq = 0, v_max = 0, v_ref = 0;
  void add(const Dropped& d) {
    w_sq += d.w_sq;
    w_max = std::max(w_max, d.w_max);
    m_sq += d.m_sq;
    m_max = std::max(m_max, d.m_max);
    m_ref += d.m_ref;
    v_sq += d.v_sq;
    v_max = std::max(v_max, d.v_max);
    v_ref += d.v_ref;
  }
};

// x where kept is 0, else 0: by masking its bits, which keeps the loops
// that call it free of branches (and vectorised).
inline float dropped(uint8_t kept, float x) {
  return std::bit_cast<float>(std::bit_cast<uint32_t>(x) & (static_cast<uint32_t>(kept) - 1u));
}

// Eight 0/1 bytes as one byte, the first the least significant bit.
inline uint8_t pack8(const uint8_t* k) {
  uint64_t x;
  std::memcpy(&x, k, 8);
  return static_cast<uint8_t>((x * 0x0102040810204080ull) >> 56);
}

}  // namespace

Encoded encode(const Weight& in, const Options& o, const ParallelFor& par, Scratch* scratch) {
  check(in, o);
  IeeeDenormals ieee;
  Encoded out;
  const uint64_t n = in.n;
  const bool moments = in.m != nullptr;
  out.carried = moments && o.carry_v;
  if (n == 0) {
    out.w.codebook.assign(1u << o.bits, 0.0f);
    if (moments) out.m.codebook = out.v.codebook = std::vector<float>(1u << o.bits_moments, 0.0f);
    return out;
  }
  Scratch own;
  Scratch& sc = scratch != nullptr ? *scratch : own;
  std::vector<uint32_t>& keys = sc.keys;
  if (keys.size() < n) keys.resize(n);
  const Parts parts(n);
  const uint64_t blocks = parts.blocks;
  auto for_blocks = [&](const std::function<void(uint64_t b, uint64_t first, uint64_t last)>& fn) {
    run(par, parts.count, [&](size_t p) {
      for (uint64_t b = parts.first_block(p), e = parts.first_block(p + 1); b < e; ++b)
        fn(b, parts.end(b), parts.end(b + 1));
    });
  };

  // Pass 1: the scores' keys, a histogram of their top 16 bits (four
  // interleaved ones: runs of one bucket would otherwise wait on each
  // increment), sums of W^2 and |m|.
  const bool topk = o.alpha < 0;
  const bool want_m1 = moments && o.beta > 0;
  struct Pass1 {
    double w2 = 0, m1 = 0;
  };
  std::vector<Pass1> p1(parts.count);
  if (topk) sc.counts.assign(parts.count * 4 * kBuckets, 0);
  run(par, parts.count, [&](size_t p) {
    Pass1& a = p1[p];
    uint32_t* c = topk ? sc.counts.data() + p * 4 * kBuckets : nullptr;
    for (uint64_t i = parts.end(parts.first_block(p)), hi = parts.end(parts.first_block(p + 1)); i < hi;
         i += kChunk) {
      const uint64_t len = std::min(kChunk, hi - i);
      uint32_t* k = keys.data() + i;
      score_keys(in, i, len, k);
      if (topk) {
        uint64_t j = 0;
        for (; j + 4 <= len; j += 4)
          for (unsigned q = 0; q < 4; ++q) ++c[q * kBuckets + (k[j + q] >> 16)];
        for (; j < len; ++j) ++c[k[j] >> 16];
      }
      a.w2 += sum_sq(in.w + i, len);
      if (want_m1) a.m1 += sum_abs(in.m + i, len);
    }
  });
  double w2 = 0, m1 = 0;
  uint32_t bucket, low = 0;  // the threshold key is bucket << 16 | low
  uint64_t need = 0;         // top-k: the k-th largest score is the need-th largest in `bucket`
  if (topk) {
    std::vector<uint64_t> hist(kBuckets, 0);
    for (size_t q = 0; q < parts.count * 4; ++q)
      for (size_t b = 0; b < kBuckets; ++b) hist[b] += sc.counts[q * kBuckets + b];
    uint64_t k = std::max<uint64_t>(1, static_cast<uint64_t>(std::nearbyint(o.density * static_cast<double>(n))));
    if (o.tolerance > 0) {  // Note [Density that follows the update]
      // v r^2 = s^2 per bucket, each score taken as its bucket's middle (within 1.6%).
      std::vector<double> energy(kBuckets);
      double total = 0;
      for (size_t b = 0; b < kBuckets; ++b) {
        const double s = std::bit_cast<float>(static_cast<uint32_t>(b << 16 | 0x8000));
        energy[b] = std::isfinite(s) ? static_cast<double>(hist[b]) * s * s : 0.0;
        total += energy[b];
      }
      double dropped = total;
      uint64_t kept = 0;
      for (size_t b = kBuckets; b-- > 0 && dropped > o.tolerance * total;) {
        dropped -= energy[b];
        kept += hist[b];
      }
      k = std::max(k, kept);
    }
    k = std::min(k, n);
    uint64_t above = 0;
    size_t b = kBuckets - 1;
    while (b > 0 && above + hist[b] < k) above += hist[b--];
    bucket = static_cast<uint32_t>(b);
    need = k - above;
  } else {
    // The paper's rule: score > alpha * median|W|, i.e. keys above cut's.
    const auto cut = static_cast<float>(o.alpha * median_abs(in.w, n));
    // A NaN cut has no keys above it that both passes agree on (its pattern + 1 wraps the sign).
    EBB_CHECK(!std::isnan(cut), "ExCP: alpha x median|W| is NaN for a weight of ", n,
              " elements (at least half its values are NaN); save it losslessly");
    const uint32_t key = std::bit_cast<uint32_t>(cut) + 1;
    bucket = key >> 16;
    low = key & 0xffff;
  }
  for (const Pass1& a : p1) {
    w2 += a.w2;
    m1 += a.m1;
  }
  p1.clear();

  // Pass 2: per block, the scores above `bucket` and the low bits of those in it.
  std::vector<uint64_t> above(blocks, 0);
  std::vector<std::vector<uint16_t>> in_bucket(blocks);
  for_blocks([&](uint64_t b, uint64_t first, uint64_t last) {
    // Keys are below 2^31: compared as int32, which vectorises on any x86-64.
    const auto* k = reinterpret_cast<const int32_t*>(keys.data());
    const auto top = static_cast<int32_t>(bucket);
    uint64_t a = 0;
    for (uint64_t i = first; i < last; i += kChunk) {
      const uint64_t len = std::min(kChunk, last - i);
      uint32_t hit = 0, up = 0;
      for (uint64_t j = 0; j < len; ++j) {
        up += (k[i + j] >> 16) > top;
        hit += (k[i + j] >> 16) == top;
      }
      a += up;
      if (hit != 0)
        for (uint64_t j = 0; j < len; ++j)
          if ((k[i + j] >> 16) == top) in_bucket[b].push_back(static_cast<uint16_t>(k[i + j] & 0xffff));
    }
    above[b] = a;
  });
  if (topk) {
    std::vector<uint64_t> h(size_t{1} << 16, 0);
    for (const auto& l : in_bucket)
      for (uint16_t x : l) ++h[x];
    uint64_t seen = 0;
    size_t l = h.size() - 1;
    while (l > 0 && seen + h[l] < need) seen += h[l--];
    low = static_cast<uint32_t>(l);
    if (bucket == 0 && low == 0) low = 1;  // the k-th largest score is 0: only nonzero scores are kept (torch's rule)
  }
  const uint32_t threshold = bucket << 16 | low;
  std::vector<uint64_t> offset(blocks + 1, 0);
  for (uint64_t b = 0; b < blocks; ++b) {
    uint64_t c = above[b];
    for (uint16_t x : in_bucket[b]) c += x >= low;
    offset[b + 1] = offset[b] + c;
    in_bucket[b] = {};
  }
  const uint64_t count_w = offset[blocks];

  // Pass 3: the weight mask, the kept values in order, and what is dropped.
  Coded& w = out.w;
  w.mask.assign((n + 7) / 8, 0);  // each block holds whole bytes of it
  // The kept values, in element order.
  std::vector<float>&kr = sc.r, &km = sc.m, &kv = sc.v;
  std::vector<uint8_t>& kflag = sc.m_flag;  // per kept weight: its moments are kept (beta)
  kr.resize(std::max(kr.size(), count_w));
  if (moments) {
    km.resize(std::max(km.size(), count_w));
    kv.resize(std::max(kv.size(), count_w));
    kflag.resize(std::max(kflag.size(), count_w));
  }
  std::vector<Dropped> sums(blocks);
  const float m_cut = want_m1 ? static_cast<float>(o.beta * (m1 / static_cast<double>(n))) : 0.0f;
  const float carry = o.carry_v ? 1.0f : 0.0f;
  for_blocks([&](uint64_t b, uint64_t first, uint64_t last) {
    uint8_t k[kChunk], kw[kChunk];  // kept: the moments' (k), the weight's (kw)
    float tr[kChunk], tm[kChunk], tv[kChunk];
    uint8_t tf[kChunk];
    Dropped& d = sums[b];
    uint64_t out_i = offset[b];
    for (uint64_t i = first; i < last; i += kChunk) {
      const uint64_t len = std::min(kChunk, last - i);
      const uint32_t* key = keys.data() + i;
      const float* wi = in.w + i;
      const float* bi = in.base + i;
      for (uint64_t j = 0; j < len; ++j) k[j] = static_cast<int32_t>(key[j]) >= static_cast<int32_t>(threshold);
      std::memcpy(kw, k, len);
      for (uint64_t j = 0; j + 8 <= len; j += 8) w.mask[(i + j) / 8] = pack8(k + j);
      if (len % 8 != 0) {
        uint8_t tail[8] = {};
        std::memcpy(tail, k + len / 8 * 8, len % 8);
        w.mask[(i + len) / 8] = pack8(tail);
      }
      // Maxima of |x| as the largest bit pattern: integer lanes (non-negative floats
      // order as their bits do; a NaN comes out as the maximum, as torch's max).
      float sq = 0;
      int32_t mx = 0;
      for (uint64_t j = 0; j < len; ++j) {  // the dropped residuals
        const float x = dropped(k[j], std::fabs(wi[j] - bi[j]));
        sq += x * x;
        mx = std::max(mx, std::bit_cast<int32_t>(x));
      }
      d.w_sq += sq;
      d.w_max = std::max(d.w_max, static_cast<double>(std::bit_cast<float>(mx)));
      if (moments) {
        const float* mi = in.m + i;
        const float* vi = in.v + i;
        const float* bv = o.carry_v ? in.base_v + i : vi;  // read, then weighted by `carry`
        if (want_m1)  // beta: the moments are kept where the residual is and |m| > m_cut
          for (uint64_t j = 0; j < len; ++j) k[j] = k[j] & (std::fabs(mi[j]) > m_cut);
        float mref = 0, vref = 0, msq = 0, vsq = 0;
        int32_t mmx = 0, vmx = 0;
        for (uint64_t j = 0; j < len; ++j) {  // the dropped moments (v: against what decodes there)
          const float m = mi[j], v = vi[j];
          mref += m * m;
          vref += v * v;
          const float dm = dropped(k[j], std::fabs(m)), dv = dropped(k[j], std::fabs(v - carry * bv[j]));
          msq += dm * dm;
          mmx = std::max(mmx, std::bit_cast<int32_t>(dm));
          vsq += dv * dv;
          vmx = std::max(vmx, std::bit_cast<int32_t>(dv));
        }
        d.m_ref += mref;
        d.v_ref += vref;
        d.m_sq += msq;
        d.m_max = std::max(d.m_max, static_cast<double>(std::bit_cast<float>(mmx)));
        d.v_sq += vsq;
        d.v_max = std::max(d.v_max, static_cast<double>(std::bit_cast<float>(vmx)));
      }
      // The kept values, compacted without branches: each element is
      // written at the next free slot of the chunk's arrays, which advances
      // only where it is kept (k: the moments' flags, 1 where no beta).
      uint64_t c = 0;
      for (uint64_t j = 0; j < len; ++j) {
        tr[c] = wi[j] - bi[j];
        c += kw[j];
      }
      if (c != 0) std::memcpy(kr.data() + out_i, tr, c * sizeof(float));
      if (moments) {
        const float* mi = in.m + i;
        const float* vi = in.v + i;
        c = 0;
        for (uint64_t j = 0; j < len; ++j) {
          tm[c] = mi[j];
          tv[c] = vi[j];
          tf[c] = k[j];
          c += kw[j];
        }
        if (c != 0) {
          std::memcpy(km.data() + out_i, tm, c * sizeof(float));
          std::memcpy(kv.data() + out_i, tv, c * sizeof(float));
          std::memcpy(kflag.data() + out_i, tf, c);
        }
      }
      out_i += c;
    }
  });
  Dropped drop;
  for (const Dropped& d : sums) drop.add(d);
  sums.clear();

  w.count = count_w;
  w.kept = static_cast<double>(count_w) / static_cast<double>(n);
  w.sq_err = drop.w_sq;
  w.max_abs = drop.w_max;
  w.sq_ref = w2;
  quantise(kr.data(), count_w, o.bits, o.kmeans_iters, false, w, par);
  if (!moments) return out;
  // The moments are kept where their weight is (and |m| passed beta): the
  // kept weights' values, less those beta dropped.
  uint64_t count_m = count_w;
  if (want_m1) {
    count_m = 0;
    for (uint64_t j = 0; j < count_w; ++j) {
      if (!kflag[j]) continue;
      km[count_m] = km[j];
      kv[count_m++] = kv[j];
    }
  }
  Coded& m = out.m;
  m.mask.assign((count_w + 7) / 8, 0);
  for (uint64_t j = 0; j + 8 <= count_w; j += 8) m.mask[j / 8] = pack8(kflag.data() + j);
  for (uint64_t j = count_w / 8 * 8; j < count_w; ++j) m.mask[j / 8] |= static_cast<uint8_t>(kflag[j] << (j % 8));
  m.count = count_m;
  m.kept = static_cast<double>(count_m) / static_cast<double>(n);
  m.sq_err = drop.m_sq;
  m.max_abs = drop.m_max;
  m.sq_ref = drop.m_ref;
  quantise(km.data(), count_m, o.bits_moments, o.kmeans_iters, false, m, par);
  Coded& v = out.v;
  v.mask = m.mask;
  v.count = count_m;
  v.kept = m.kept;
  v.sq_err = drop.v_sq;
  v.max_abs = drop.v_max;
  v.sq_ref = drop.v_ref;
  quantise(kv.data(), count_m, o.bits_moments, o.kmeans_iters, true, v, par);
  return out;
}

std::vector<Encoded> encode_batch(const std::vector<Job>& jobs, unsigned runners, const ParallelFor& par,
                                  std::vector<Scratch>* scratch) {
  for (const Job& j : jobs) check(j.in, j.o);
  runners = par ? std::max(1u, runners) : 1u;
  std::vector<Scratch> own;
  std::vector<Scratch>& pool = scratch != nullptr ? *scratch : own;
  if (pool.size() < runners) pool.resize(runners);
  uint64_t total = 0;
  for (const Job& j : jobs) total += j.in.n;
  std::vector<Encoded> out(jobs.size());
  std::vector<size_t> side;  // run side by side
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (runners > 1 && jobs[i].in.n * 2 * runners >= total)
      out[i] = encode(jobs[i].in, jobs[i].o, par, &pool[0]);
    else
      side.push_back(i);
  }
  std::stable_sort(side.begin(), side.end(), [&](size_t a, size_t b) { return jobs[a].in.n > jobs[b].in.n; });
  std::mutex mu;
  std::vector<Scratch*> free;
  for (Scratch& s : pool) free.push_back(&s);
  run(par, side.size(), [&](size_t t) {
    Scratch* s = nullptr;
    {
      std::lock_guard lock(mu);
      if (!free.empty()) {
        s = free.back();
        free.pop_back();
      }
    }
    Scratch spare;  // more runners than `runners` said
    const Job& j = jobs[side[t]];
    out[side[t]] = encode(j.in, j.o, {}, s != nullptr ? s : &spare);
    if (s != nullptr) {
      std::lock_guard lock(mu);
      free.push_back(s);
    }
  });
  return out;
}

}  // namespace ebbtide::ckpt::excp
