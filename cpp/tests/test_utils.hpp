// Test helpers with RAII restore: temporary directories, environment
// variables, small filesystems.
#pragma once

#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include "ebbtide/mem/buffer.hpp"

namespace ebbtide::test {

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Holds the threads that pass() while closed, to stage races: a test closes
// it, waits until a worker is inside (wait_started), checks, and opens it.
class Gate {
 public:
  void pass() {
    std::unique_lock<std::mutex> lock(mu_);
    ++started_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return open_; });
  }
  void set_open(bool open) {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = open;
    cv_.notify_all();
  }
  void wait_started(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return started_ >= n; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = true;
  int started_ = 0;
};

// A fresh directory under $TMPDIR (or /tmp, or `parent`), removed with its contents.
class TempDir {
 public:
  explicit TempDir(const std::string& parent = "") {
    std::string base = parent;
    if (base.empty()) {
      const char* t = std::getenv("TMPDIR");
      base = (t && *t) ? t : "/tmp";
    }
    std::string templ = base + "/ebbtide-test-XXXXXX";
    std::vector<char> buf(templ.begin(), templ.end());
    buf.push_back('\0');
    char* p = ::mkdtemp(buf.data());
    if (p == nullptr) throw std::runtime_error("mkdtemp failed under " + base);
    path_ = p;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::permissions(path_, std::filesystem::perms::owner_all,
                                 std::filesystem::perm_options::add, ec);
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string sub(const std::string& name) const {
    std::string p = path_ + "/" + name;
    std::filesystem::create_directories(p);
    return p;
  }
  size_t entries() const {
    size_t n = 0;
    for ([[maybe_unused]] auto& e : std::filesystem::directory_iterator(path_)) ++n;
    return n;
  }

 private:
  std::string path_;
};

// Sets (or unsets, with value nullopt) an environment variable for a scope.
class ScopedEnv {
 public:
  ScopedEnv(std::string name, std::optional<std::string> value) : name_(std::move(name)) {
    if (const char* old = std::getenv(name_.c_str())) old_ = old;
    if (value) ::setenv(name_.c_str(), value->c_str(), 1);
    else ::unsetenv(name_.c_str());
  }
  ~ScopedEnv() {
    if (old_) ::setenv(name_.c_str(), old_->c_str(), 1);
    else ::unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

// A file's bytes.
inline std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// Deterministic pseudo-random bytes.
inline std::vector<unsigned char> random_bytes(size_t n, uint64_t seed) {
  std::vector<unsigned char> v(n);
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t x = rng();
    std::memcpy(v.data() + i, &x, 8);
  }
  for (; i < n; ++i) v[i] = static_cast<unsigned char>(rng());
  return v;
}

// The bytes of a vector or string as a host buffer. Const data is fine for a
// source: the core never writes through one (mem/buffer.hpp).
template <class Bytes>
mem::Buffer host_buffer(const Bytes& v, uint64_t nbytes) {
  return {const_cast<void*>(static_cast<const void*>(v.data())), nbytes};
}
template <class Bytes>
mem::Buffer host_buffer(const Bytes& v) {
  return host_buffer(v, v.size() * sizeof(*v.data()));
}

}  // namespace ebbtide::test
