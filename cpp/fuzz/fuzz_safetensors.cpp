// libFuzzer target: the safetensors header parser and reader on hostile bytes
// (Note [Hostile safetensors] in cpp/src/ckpt/safetensors.cpp).
//
// The input is a whole safetensors file. The parser runs on its header bytes,
// then Reader opens the file and reads every tensor twice, staged (into
// buffers filled with 0xAA, then 0x55: a byte the reader never wrote would
// differ). Only ebbtide's typed errors may escape; anything else (a crash, a
// sanitizer report, another exception, two reads that disagree) is a finding.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "ebbtide/ckpt/safetensors.hpp"
#include "ebbtide/util/error.hpp"

namespace {

namespace st = ebbtide::ckpt::safetensors;

constexpr uint64_t kMaxLoadBytes = 64ull << 20;  // larger files are parsed, not read

std::string g_dir;  // where the input is written, removed at exit

const std::string& scratch_dir() {
  if (g_dir.empty()) {
    const char* t = std::getenv("TMPDIR");
    std::string templ = std::string(t && *t ? t : "/tmp") + "/ebbtide-fuzz-st-XXXXXX";
    std::vector<char> buf(templ.begin(), templ.end());
    buf.push_back('\0');
    if (::mkdtemp(buf.data()) == nullptr) std::abort();
    g_dir = buf.data();
    std::atexit([] {
      ::unlink((g_dir + "/input.safetensors").c_str());
      ::rmdir(g_dir.c_str());
    });
  }
  return g_dir;
}

void read_all(st::Reader& r) {
  const auto& h = r.header();
  if (h.data_bytes > kMaxLoadBytes) return;
  std::vector<std::vector<char>> first, second;
  for (char fill : {'\xAA', '\x55'}) {
    auto& bufs = fill == '\xAA' ? first : second;
    std::vector<st::ReadTarget> targets;
    for (size_t i = 0; i < h.tensors.size(); ++i) {
      bufs.emplace_back(h.tensors[i].end - h.tensors[i].begin, fill);
      targets.push_back({i, {bufs.back().data(), bufs.back().size()}});
    }
    r.read(targets);
  }
  if (first != second) std::abort();  // a byte of a destination was not written by the read
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  if (size >= 8) {
    uint64_t n = 0;
    std::memcpy(&n, data, 8);
    if (n <= size - 8) {
      try {
        st::parse_header(bytes.substr(8, n), size, "input");
      } catch (const ebbtide::Error&) {
      }
    }
  }
  const std::string path = scratch_dir() + "/input.safetensors";
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(size));
  }
  try {
    st::IoOptions o;
    o.direct = false;  // the staged path; O_DIRECT reads share the checks
    st::Reader r(path, o);
    read_all(r);
  } catch (const ebbtide::Error&) {
  }
  return 0;
}
