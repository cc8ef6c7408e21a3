// ExCP delta encoding (Note [ExCP encoding] in ckpt/excp.cpp): the weight
// mask is exactly the top-k of |r| sqrt(v) (ties kept, zeros never), the
// moments' masks follow it, codes index sorted codebooks, the error it
// reports is the error of what decodes, and the result does not depend on
// the threads it ran on.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "ebbtide/ckpt/excp.hpp"
#include "ebbtide/ckpt/writer.hpp"
#include "ebbtide/util/error.hpp"

namespace ebbtide::ckpt::excp {
namespace {

struct Tensors {
  std::vector<float> w, base, m, v, base_v;
  Weight in(bool moments = true) const {
    Weight x;
    x.w = w.data();
    x.base = base.data();
    x.n = w.size();
    if (moments) {
      x.m = m.data();
      x.v = v.data();
      x.base_v = base_v.data();
    }
    return x;
  }
};

// A trained-looking state: weights, a small update (heavy-tailed), moments.
Tensors make(size_t n, uint64_t seed, float update = 1e-3f) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::student_t_distribution<float> td(3.0f);
  Tensors t;
  t.w.resize(n);
  t.base.resize(n);
  t.m.resize(n);
  t.v.resize(n);
  t.base_v.resize(n);
  for (size_t i = 0; i < n; ++i) {
    t.base[i] = 0.05f * nd(g);
    t.w[i] = t.base[i] + update * td(g);
    t.m[i] = 1e-3f * nd(g);
    t.v[i] = 1e-6f * std::exp(2.0f * nd(g));
    t.base_v[i] = t.v[i] * 0.9f;
  }
  return t;
}

bool bit(const std::vector<uint8_t>& mask, uint64_t i) { return (mask[i / 8] >> (i % 8)) & 1u; }

// Runs each part on a thread of its own.
ParallelFor threads() {
  return [](size_t n, const std::function<void(size_t)>& fn) {
    std::vector<std::thread> ts;
    for (size_t i = 0; i < n; ++i) ts.emplace_back([&fn, i] { fn(i); });
    for (auto& t : ts) t.join();
  };
}

// The decoded tensors and their error against the exact ones, as a reader
// of the checkpoint decodes them (lossy.py's decode()).
struct Check {
  double w_sq = 0, w_max = 0, m_sq = 0, v_sq = 0;
};

Check decode_error(const Tensors& t, const Encoded& e, bool carry) {
  Check c;
  uint64_t jw = 0, jm = 0;
  for (size_t i = 0; i < t.w.size(); ++i) {
    double w = t.base[i], m = 0, v = carry ? t.base_v[i] : 0.0;
    if (bit(e.w.mask, i)) {
      w = static_cast<double>(t.base[i]) + e.w.codebook.at(e.w.codes.at(jw));
      if (!e.m.mask.empty() && bit(e.m.mask, jw)) {
        m = e.m.codebook.at(e.m.codes.at(jm));
        v = std::exp(e.v.codebook.at(e.v.codes.at(jm)));
        ++jm;
      }
      ++jw;
    }
    const double dw = w - t.w[i];
    c.w_sq += dw * dw;
    c.w_max = std::max(c.w_max, std::fabs(dw));
    c.m_sq += (m - t.m[i]) * (m - t.m[i]);
    c.v_sq += (v - t.v[i]) * (v - t.v[i]);
  }
  EXPECT_EQ(jw, e.w.count);
  EXPECT_EQ(jm, e.m.count);
  return c;
}

void expect_sorted_codes(const Coded& c, int bits) {
  ASSERT_EQ(c.codebook.size(), 1u << bits);
  EXPECT_TRUE(std::is_sorted(c.codebook.begin(), c.codebook.end()));
  ASSERT_EQ(c.codes.size(), c.count);
  for (uint8_t code : c.codes) ASSERT_LT(code, 1u << bits);
}

TEST(Excp, WeightMaskIsTheTopKWithTies) {
  Tensors t = make(50000, 1);
  for (size_t i = 0; i < 2000; ++i) t.w[i] = t.base[i];  // zero residuals: never kept
  for (size_t i = 2000; i < 2600; ++i) {                    // a tie straddling the k-th largest
    t.w[i] = t.base[i] + 0.01f;
    t.v[i] = 1e-4f;
  }
  Options o;
  o.density = 0.01;  // k = 500 < 600 tied: all of the tie is kept
  const Encoded e = encode(t.in(), o);
  std::vector<float> score(t.w.size());
  for (size_t i = 0; i < score.size(); ++i) score[i] = std::fabs(t.w[i] - t.base[i]) * std::sqrt(t.v[i]);
  std::vector<float> sorted = score;
  std::sort(sorted.begin(), sorted.end(), std::greater<>());
  const float kth = sorted[499];
  uint64_t kept = 0;
  for (size_t i = 0; i < score.size(); ++i) {
    ASSERT_EQ(bit(e.w.mask, i), score[i] >= kth && score[i] > 0) << i;
    kept += bit(e.w.mask, i);
  }
  EXPECT_EQ(kept, e.w.count);
  EXPECT_GE(e.w.count, 600u);
  EXPECT_NEAR(e.w.kept, static_cast<double>(kept) / 50000.0, 1e-12);
  expect_sorted_codes(e.w, 4);
  expect_sorted_codes(e.m, 4);
  expect_sorted_codes(e.v, 4);
  EXPECT_EQ(e.m.mask, e.v.mask);
  EXPECT_EQ(e.m.mask.size(), (e.w.count + 7) / 8) << "the moments' mask is over the kept weights";
  EXPECT_EQ(e.m.count, e.w.count) << "beta 0: the moments are kept on the whole weight mask";
}

TEST(Excp, ReportedErrorIsTheErrorOfWhatDecodes) {
  for (bool carry : {true, false}) {
    const Tensors t = make(70001, 2);
    Options o;
    o.carry_v = carry;
    o.beta = 0.5;
    const Encoded e = encode(t.in(), o);
    EXPECT_LT(e.m.count, e.w.count) << "beta 0.5 keeps fewer moments than weights";
    EXPECT_EQ(e.carried, carry);
    const Check c = decode_error(t, e, carry);
    EXPECT_NEAR(e.w.sq_err, c.w_sq, 1e-4 * c.w_sq);  // summed in float per chunk
    EXPECT_NEAR(e.w.max_abs, c.w_max, 1e-5 * c.w_max);
    EXPECT_NEAR(e.m.sq_err, c.m_sq, 1e-4 * c.m_sq);
    EXPECT_NEAR(e.v.sq_err, c.v_sq, 1e-4 * c.v_sq);
    double w2 = 0;
    for (float x : t.w) w2 += static_cast<double>(x) * x;
    EXPECT_NEAR(e.w.sq_ref, w2, 1e-5 * w2);
    // The kept residuals are quantised, not dropped: the error is below the residual's own norm.
    double r2 = 0;
    for (size_t i = 0; i < t.w.size(); ++i) r2 += std::pow(static_cast<double>(t.w[i]) - t.base[i], 2);
    EXPECT_LT(e.w.sq_err, r2);
  }
}

void expect_same(const Encoded& a, const Encoded& b) {
  EXPECT_EQ(a.carried, b.carried);
  for (auto pick : {&Encoded::w, &Encoded::m, &Encoded::v}) {
    const Coded &x = a.*pick, &y = b.*pick;
    EXPECT_EQ(x.mask, y.mask);
    EXPECT_EQ(x.codes, y.codes);
    EXPECT_EQ(x.codebook, y.codebook);
    EXPECT_EQ(x.count, y.count);
    EXPECT_EQ(x.sq_err, y.sq_err);
    EXPECT_EQ(x.sq_ref, y.sq_ref);
    EXPECT_EQ(x.max_abs, y.max_abs);
  }
}

TEST(Excp, SameResultOnAnyNumberOfThreads) {
  const Tensors t = make((size_t{1} << 16) * 20 + 77, 3);  // 21 blocks over 16 parts
  Options o;
  o.tolerance = 0.2;
  const Encoded serial = encode(t.in(), o), parallel = encode(t.in(), o, threads());
  expect_same(serial, parallel);
  CheckpointWriter writer;  // the writer's threads: the same again
  const Encoded w = writer.encode_deltas({{t.in(), o}}).at(0);
  EXPECT_EQ(w.w.codes, serial.w.codes);
  EXPECT_EQ(w.v.codebook, serial.v.codebook);
}

// Note [ExCP batches]: a batch returns what encode() of each weight alone
// does, whether a weight ran split (the largest here: over 1 / (2 runners)
// of the elements), side by side with others, or on a spare scratch (more
// threads than runners), with moments or without, empty ones included.
TEST(Excp, BatchEqualsEachWeightAlone) {
  std::vector<Tensors> ts;
  for (size_t n : {size_t{1} << 20, size_t{70000}, size_t{5}, size_t{0}, size_t{200001}, size_t{65536}, size_t{3000}})
    ts.push_back(make(n, 10 + n));
  std::vector<Job> jobs;
  for (size_t i = 0; i < ts.size(); ++i) {
    Job j;
    j.in = ts[i].in(/*moments=*/i % 3 != 1);
    j.o.tolerance = i % 2 == 0 ? 0.1 : 0.0;
    j.o.beta = i == 4 ? 0.5 : 0.0;
    j.o.carry_v = i != 2;
    jobs.push_back(j);
  }
  std::vector<Encoded> alone;
  for (const Job& j : jobs) alone.push_back(encode(j.in, j.o));
  for (unsigned runners : {1u, 2u, 3u}) {
    std::vector<Scratch> pool;
    // threads() runs every part at once: more at a time than `runners` when it is 1 or 2.
    const std::vector<Encoded> batch = encode_batch(jobs, runners, threads(), &pool);
    ASSERT_EQ(batch.size(), jobs.size());
    EXPECT_EQ(pool.size(), runners);
    for (size_t i = 0; i < jobs.size(); ++i) {
      SCOPED_TRACE(testing::Message() << "runners " << runners << ", weight " << i);
      expect_same(batch[i], alone[i]);
    }
  }
  CheckpointWriter writer;  // the writer's threads and its kept scratch, twice
  for (int round = 0; round < 2; ++round) {
    const std::vector<Encoded> batch = writer.encode_deltas(jobs);
    for (size_t i = 0; i < jobs.size(); ++i) expect_same(batch[i], alone[i]);
  }
  EXPECT_TRUE(encode_batch({}, 2, threads()).empty());
}

#if defined(__x86_64__)
// A caller with flush-to-zero and denormals-are-zero set (torch.set_flush_denormal(True))
// gets what every other thread gets: tiny second moments scored as IEEE numbers.
TEST(Excp, DenormalsAreIeeeWhateverTheCallersMode) {
  Tensors t = make(size_t{1} << 17, 21);
  for (size_t i = 0; i < t.v.size(); i += 2) t.v[i] = 1e-40f;  // denormal: its score is not 0
  Options o;
  o.tolerance = 0.1;
  const Encoded plain = encode(t.in(), o);
  Encoded flushed;
  std::thread th([&] {
    _mm_setcsr(_mm_getcsr() | 0x8040u);
    flushed = encode(t.in(), o, threads());
    EXPECT_EQ(_mm_getcsr() & 0x8040u, 0x8040u) << "the caller's mode is restored";
  });
  th.join();
  expect_same(plain, flushed);
}
#endif

TEST(Excp, BatchChecksEveryJobFirst) {
  const Tensors t = make(1000, 4);
  std::vector<Job> jobs(2);
  jobs[0].in = t.in();
  jobs[1].in = t.in();
  jobs[1].o.bits = 9;
  int ran = 0;
  const ParallelFor counting = [&](size_t n, const std::function<void(size_t)>& fn) {
    for (size_t i = 0; i < n; ++i, ++ran) fn(i);
  };
  EXPECT_THROW(encode_batch(jobs, 2, counting), InvalidArgument);
  EXPECT_EQ(ran, 0);
}

// Note [Density that follows the update]: a dense update (every element
// moves alike, as early in a run) keeps what its tolerance asks, far above
// the density; a sparse one keeps the density.
TEST(Excp, ToleranceWidensTheMaskForDenseUpdates) {
  Tensors dense = make(100000, 4);
  std::mt19937_64 g(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (size_t i = 0; i < dense.w.size(); ++i) {
    dense.w[i] = dense.base[i] + 1e-3f * nd(g);
    dense.v[i] = 1e-6f;
  }
  Options o;
  o.tolerance = 0.1;
  const Encoded e = encode(dense.in(), o);
  double total = 0, dropped = 0;
  for (size_t i = 0; i < dense.w.size(); ++i) {
    const double r = static_cast<double>(dense.w[i]) - dense.base[i], s = r * r * dense.v[i];
    total += s;
    if (!bit(e.w.mask, i)) dropped += s;
  }
  EXPECT_LE(dropped, 0.1 * total * (1 + 1e-9));
  EXPECT_GT(e.w.kept, 0.4) << "a Gaussian update keeps 45% of its elements for 90% of its energy";
  Tensors sparse = make(100000, 6);
  for (size_t i = 0; i < sparse.w.size(); ++i)
    sparse.w[i] = sparse.base[i] + (i % 50 == 0 ? 1e-2f : 1e-7f);  // 2% of the elements carry the update
  const Encoded f = encode(sparse.in(), o);
  EXPECT_NEAR(f.w.kept, 0.1, 1e-4) << "the density is the floor";
}

TEST(Excp, AlphaKeepsScoresAboveTheScaledMedian) {
  const Tensors t = make(20001, 7);
  Options o;
  o.alpha = 1e-4;
  const Encoded e = encode(t.in(), o);
  std::vector<float> a(t.w.size());
  for (size_t i = 0; i < a.size(); ++i) a[i] = std::fabs(t.w[i]);
  std::nth_element(a.begin(), a.begin() + (a.size() - 1) / 2, a.end());
  const float cut = static_cast<float>(1e-4 * a[(a.size() - 1) / 2]);
  for (size_t i = 0; i < t.w.size(); ++i)
    ASSERT_EQ(bit(e.w.mask, i), std::fabs(t.w[i] - t.base[i]) * std::sqrt(t.v[i]) > cut) << i;
  EXPECT_GT(e.w.count, 0u);
}

TEST(Excp, FewDistinctValuesAreCodedExactly) {
  Tensors t = make(4096, 8);
  for (size_t i = 0; i < t.w.size(); ++i) t.w[i] = t.base[i] + 0.25f * static_cast<float>(1 + i % 16);
  Options o;
  o.density = 1.0;
  const Encoded e = encode(t.in(false), o);
  EXPECT_EQ(e.w.count, 4096u);
  EXPECT_EQ(e.w.max_abs, e.w.max_abs);  // not NaN
  EXPECT_LT(e.w.max_abs, 1e-6);
  EXPECT_TRUE(e.m.codes.empty() && e.m.mask.empty()) << "no moments";
}

TEST(Excp, BadOptionsAndInputsAreRefused) {
  const Tensors t = make(4096, 9);
  auto with = [](auto set) {
    Options o;
    set(o);
    return o;
  };
  EXPECT_THROW(encode(t.in(), with([](Options& o) { o.bits = 9; })), InvalidArgument);
  Tensors nan = t;  // the paper's rule on a weight whose median |W| is NaN
  std::fill(nan.w.begin(), nan.w.end(), std::numeric_limits<float>::quiet_NaN());
  EXPECT_THROW(encode(nan.in(), with([](Options& o) { o.alpha = 0.5; })), InvalidArgument);
  EXPECT_THROW(encode(t.in(), with([](Options& o) { o.bits_moments = 0; })), InvalidArgument);
  EXPECT_THROW(encode(t.in(), with([](Options& o) { o.density = 0; })), InvalidArgument);
  EXPECT_THROW(encode(t.in(), with([](Options& o) { o.tolerance = -0.1; })), InvalidArgument);
  EXPECT_THROW(encode(t.in(), with([](Options& o) { o.beta = -1; })), InvalidArgument);
  Weight half = t.in();
  half.v = nullptr;
  EXPECT_THROW(encode(half, Options{}), InvalidArgument);
  Weight no_base_v = t.in();
  no_base_v.base_v = nullptr;
  EXPECT_THROW(encode(no_base_v, Options{}), InvalidArgument);
  Options zero;
  zero.carry_v = false;
  EXPECT_NO_THROW(encode(no_base_v, zero));
}

}  // namespace
}  // namespace ebbtide::ckpt::excp
