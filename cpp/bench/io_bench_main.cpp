// ebbtide-bench-io: write then read back `--size` bytes through the storage
// engine and print GB/s (a table, or JSON with --json).
//   ebbtide-bench-io --dir D [--dir D ...] [--size 1GiB] [--chunk 1MiB] [--qd 16]
//                    [--request 64MiB] [--backend auto|uring|posix] [--checksum]
//                    [--no-device] [--no-verify] [--small-pages] [--json]
#include <cstdio>
#include <cstring>
#include <string>

#include "ebbtide/io/bench.hpp"
#include "ebbtide/util/config.hpp"
#include "ebbtide/util/error.hpp"

namespace {

void usage(FILE* f) {
  std::fprintf(f,
               "usage: ebbtide-bench-io --dir D [--dir D ...] [--size 1GiB] [--chunk 1MiB] [--qd 16]\n"
               "                        [--request 64MiB] [--backend auto|uring|posix] [--checksum]\n"
               "                        [--no-device] [--no-verify] [--small-pages] [--json]\n");
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace ebbtide;
  io::BenchOptions o;
  bool json = false;
  try {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      auto value = [&]() -> std::string {
        EBB_CHECK(i + 1 < argc, a, " needs a value");
        return argv[++i];
      };
      if (a == "--dir") o.dirs.push_back(value());
      else if (a == "--size") o.total_bytes = config::parse_bytes(value(), "--size");
      else if (a == "--chunk") o.chunk_bytes = config::parse_bytes(value(), "--chunk");
      else if (a == "--request") o.request_bytes = config::parse_bytes(value(), "--request");
      else if (a == "--qd") {
        std::string v = value();
        char* end = nullptr;
        long q = std::strtol(v.c_str(), &end, 10);
        EBB_CHECK(*end == '\0' && q > 0 && q <= 4096, "--qd: '", v, "' is not a queue depth in [1, 4096]");
        o.queue_depth = static_cast<unsigned>(q);
      } else if (a == "--backend") o.backend = io::parse_backend(value());
      else if (a == "--checksum") o.checksum = true;
      else if (a == "--no-device") o.device = false;
      else if (a == "--small-pages") o.huge_pages = false;
      else if (a == "--no-verify") o.verify = false;
      else if (a == "--json") json = true;
      else if (a == "-h" || a == "--help") {
        usage(stdout);
        return 0;
      } else {
        EBB_CHECK(false, "unknown argument '", a, "'");
      }
    }
    EBB_CHECK(!o.dirs.empty(), "at least one --dir is needed");
    auto r = io::run_io_bench(o);
    if (json) {
      std::printf("{\"backend\": \"%s\", \"describe\": \"%s\", \"bytes\": %llu, \"direct\": %s, "
                  "\"alignment\": %llu, \"write_seconds\": %.6f, \"read_seconds\": %.6f, "
                  "\"write_gbps\": %.4f, \"read_gbps\": %.4f, \"device_measured\": %s, "
                  "\"device_write_gbps\": %.4f, \"device_read_gbps\": %.4f, \"verified\": %s, "
                  "\"huge_pages\": %s}\n",
                  r.backend.c_str(), json_escape(r.describe).c_str(), static_cast<unsigned long long>(r.bytes),
                  r.direct ? "true" : "false", static_cast<unsigned long long>(r.alignment), r.write_seconds,
                  r.read_seconds, r.write_gbps, r.read_gbps, r.device_measured ? "true" : "false",
                  r.device_write_gbps, r.device_read_gbps, r.verified ? "true" : "false",
                  r.huge_pages ? "true" : "false");
    } else {
      std::printf("%s\n", r.describe.c_str());
      std::printf("  size %s, buffers on %s pages, O_DIRECT %s%s\n",
                  config::format_bytes(static_cast<double>(r.bytes)).c_str(), r.huge_pages ? "huge" : "small",
                  r.direct ? "yes" : "no (page cache: read numbers may be flattered)",
                  o.verify ? (r.verified ? ", data verified" : ", DATA MISMATCH") : "");
      std::printf("  %-14s %10s %10s\n", "transfer", "GB/s", "seconds");
      std::printf("  %-14s %10.3f %10.3f\n", "host write", r.write_gbps, r.write_seconds);
      std::printf("  %-14s %10.3f %10.3f\n", "host read", r.read_gbps, r.read_seconds);
      if (r.device_measured) {
        std::printf("  %-14s %10.3f\n", "device->file", r.device_write_gbps);
        std::printf("  %-14s %10.3f\n", "file->device", r.device_read_gbps);
      } else if (o.device) {
        std::printf("  device transfers: not measured (no CUDA device path)\n");
      }
    }
    return o.verify && !r.verified ? 3 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ebbtide-bench-io: %s\n", e.what());
    return 2;
  }
}
