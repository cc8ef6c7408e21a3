#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ebbtide/mem/cuda_shim.hpp"
#include "ebbtide/mem/cufile_shim.hpp"
#include "ebbtide/util/error.hpp"
#include "test_utils.hpp"

namespace ebbtide::mem {
namespace {

using test::contains;

TEST(CufileShim, DriverAndReasonAreConsistent) {
  cufile::Driver* d = cufile::cufile();
  EXPECT_EQ(cufile::cufile(), d);
  EXPECT_EQ(d == nullptr, !cufile::unavailable_reason().empty()) << cufile::unavailable_reason();
  if (cuda::driver() == nullptr) {
    EXPECT_EQ(d, nullptr);  // cuFile needs the CUDA driver
    EXPECT_TRUE(contains(cufile::unavailable_reason(), "no CUDA driver")) << cufile::unavailable_reason();
  }
}

TEST(CufileShim, ProbeHonoursEbbtideCufileZero) {
  test::ScopedEnv env("EBBTIDE_CUFILE", "0");
  cufile::ProbeResult r = cufile::probe();
  EXPECT_EQ(r.driver, nullptr);
  EXPECT_EQ(r.reason, "disabled by EBBTIDE_CUFILE=0");
}

// Note [cuFile needs nvidia-fs]: unset EBBTIDE_CUFILE uses cuFile only with
// the kernel module (checked after the CUDA driver, so this needs a GPU).
TEST(CufileShim, ProbeWantsNvidiaFsUnlessForced) {
  if (::access("/proc/driver/nvidia-fs", F_OK) == 0) GTEST_SKIP() << "nvidia-fs is loaded here";
  if (cuda::driver() == nullptr) GTEST_SKIP() << "no CUDA driver: " << cuda::unavailable_reason();
  test::ScopedEnv env("EBBTIDE_CUFILE", std::nullopt);
  cufile::ProbeResult r = cufile::probe();
  EXPECT_EQ(r.driver, nullptr);
  EXPECT_TRUE(contains(r.reason, "nvidia-fs") && contains(r.reason, "EBBTIDE_CUFILE=1")) << r.reason;
  test::ScopedEnv force("EBBTIDE_CUFILE", "1");
  EXPECT_FALSE(contains(cufile::probe().reason, "nvidia-fs"));
}

TEST(CufileShim, ProbeRejectsABadSettingNamingIt) {
  test::ScopedEnv env("EBBTIDE_CUFILE", "perhaps");
  try {
    cufile::probe();
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(contains(e.what(), "EBBTIDE_CUFILE")) << e.what();
  }
}

// With GPUDirect Storage installed (or its compatibility mode): device memory
// -> file -> device memory.
TEST(CufileShim, RoundTripThroughAFile) {
  cufile::Driver* cf = cufile::cufile();
  if (cf == nullptr) GTEST_SKIP() << "cuFile unavailable: " << cufile::unavailable_reason();
  cuda::Driver* drv = cuda::driver();
  drv->bind_device(0);
  constexpr size_t kBytes = 1 << 20;
  test::TempDir dir;
  std::string path = dir.path() + "/cufile.bin";
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
  if (fd < 0) fd = ::open(path.c_str(), O_RDWR | O_CREAT, 0600);  // tmpfs: no O_DIRECT
  ASSERT_GE(fd, 0) << path;
  auto data = test::random_bytes(kBytes, 7);
  std::vector<unsigned char> back(kBytes, 0);
  cuda::DevicePtr src = drv->mem_alloc(kBytes);
  cuda::DevicePtr dst = drv->mem_alloc(kBytes);
  drv->memcpy_htod_async(src, data.data(), kBytes, 0);
  drv->stream_synchronize(0);
  auto* srcp = reinterpret_cast<void*>(src);
  auto* dstp = reinterpret_cast<void*>(dst);
  cufile::Handle h = 0;
  try {
    h = cf->handle_register(fd);
    cf->buf_register(dstp, kBytes);
    EXPECT_EQ(cf->write(h, srcp, kBytes, 4096), kBytes);
    EXPECT_EQ(cf->read(h, dstp, kBytes, 4096), kBytes);
    EXPECT_EQ(cf->read(h, dstp, kBytes, 4096 + kBytes), 0u);  // end of file
    cf->buf_deregister(dstp);
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
  }
  cf->handle_deregister(h);
  drv->memcpy_dtoh_async(back.data(), dst, kBytes, 0);
  drv->stream_synchronize(0);
  EXPECT_EQ(std::memcmp(back.data(), data.data(), kBytes), 0);
  drv->mem_free(src);
  drv->mem_free(dst);
  ::close(fd);
  EXPECT_THROW(cf->handle_register(-1), InvalidArgument);
}

}  // namespace
}  // namespace ebbtide::mem
