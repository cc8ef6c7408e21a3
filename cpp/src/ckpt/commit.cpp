// Note [Commit by rename]
// A save writes everything into PATH.tmp-XXXXXX beside PATH, fsyncs each file
// and the directory, then swaps the two names atomically with renameat2
// (RENAME_EXCHANGE) and fsyncs the parent: at every instant PATH names either
// the complete previous checkpoint or the complete new one. The old contents
// (now under the temporary name) are removed afterwards. Where the
// filesystem lacks RENAME_EXCHANGE, PATH is first renamed to PATH.old-XXXXXX
// (the loader falls back to it if a crash hits between the two renames).
// A killed save leaves at most a PATH.tmp-* directory, removed by the next
// save of PATH (remove_stale_temps).
#include <dirent.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <set>
#include <vector>

#include "ebbtide/ckpt/writer.hpp"
#include "reaper.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::ckpt {
namespace {

namespace fs = std::filesystem;

std::string parent_of(const std::string& path) {
  fs::path p(path);
  auto parent = p.parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

std::string strip_slashes(std::string p) {
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p;
}

void fsync_path(const std::string& path, bool dir) {
  int fd = ::open(path.c_str(), (dir ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) throw_io_error(errno, path, -1, "open for fsync");
  int rc = ::fsync(fd);
  int e = errno;
  ::close(fd);
  if (rc != 0) throw_io_error(e, path, -1, "fsync");
}

}  // namespace

void fsync_directory(const std::string& dir) { fsync_path(dir, true); }

std::string make_temp_dir(const std::string& path_in) {
  std::string path = strip_slashes(path_in);
  EBB_CHECK(!path.empty(), "checkpoint path is empty");
  std::string parent = parent_of(path);
  struct stat st {};
  if (::stat(parent.c_str(), &st) != 0) throw IoError(errno, parent, -1, "the checkpoint's parent directory is not accessible");
  std::string templ = path + ".tmp-XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) {
    int e = errno;
    throw IoError(e, parent, -1,
                  e == EROFS ? "cannot create the checkpoint's temporary directory: read-only filesystem"
                             : "cannot create the checkpoint's temporary directory");
  }
  return std::string(buf.data());
}

void write_file_durably(const std::string& path, const std::string& content) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw_io_error(errno, path, -1, "open");
  size_t done = 0;
  while (done < content.size()) {
    ssize_t r = ::write(fd, content.data() + done, content.size() - done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      int e = r < 0 ? errno : EIO;
      ::close(fd);
      throw_io_error(e, path, static_cast<int64_t>(done), "write");
    }
    done += static_cast<size_t>(r);
  }
  int rc = ::fsync(fd);
  int e = errno;
  ::close(fd);
  if (rc != 0) throw_io_error(e, path, -1, "fsync");
}

std::string commit_checkpoint(const std::string& tmp_in, const std::string& path_in,
                              const std::vector<NamedContent>& files) {
  std::string tmp = strip_slashes(tmp_in), path = strip_slashes(path_in);
  std::set<std::string> written;
  for (const auto& [name, content] : files) {
    write_file_durably(tmp + "/" + name, content);
    written.insert(name);
  }
  for (auto& e : fs::directory_iterator(tmp)) {  // what others wrote there
    if (e.is_regular_file() && !written.count(e.path().filename().string())) fsync_path(e.path().string(), false);
  }
  fsync_path(tmp, true);
  std::string parent = parent_of(path);
  struct stat st {};
  bool exists = ::lstat(path.c_str(), &st) == 0;
  if (!exists) {
    if (::rename(tmp.c_str(), path.c_str()) != 0) throw_io_error(errno, path, -1, "rename (commit)");
    fsync_path(parent, true);
    return {};
  }
  if (!S_ISDIR(st.st_mode)) throw IoError(EEXIST, path, -1, "cannot commit the checkpoint: the path exists and is not a directory");
  long rc = ::syscall(SYS_renameat2, AT_FDCWD, tmp.c_str(), AT_FDCWD, path.c_str(), RENAME_EXCHANGE);
  std::string old = tmp;  // after the exchange the temporary name holds the old checkpoint
  if (rc != 0) {
    if (errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP) throw_io_error(errno, path, -1, "renameat2 (commit)");
    std::string templ = path + ".old-XXXXXX";
    std::vector<char> buf(templ.begin(), templ.end());
    buf.push_back('\0');
    int fd = ::mkstemp(buf.data());  // reserve a unique name, then rename over it
    if (fd < 0) throw_io_error(errno, parent, -1, "mkstemp");
    ::close(fd);
    ::unlink(buf.data());
    old = buf.data();
    if (::rename(path.c_str(), old.c_str()) != 0) throw_io_error(errno, path, -1, "rename (set old aside)");
    if (::rename(tmp.c_str(), path.c_str()) != 0) throw_io_error(errno, path, -1, "rename (commit)");
  }
  fsync_path(parent, true);
  return old;
}

namespace detail {
namespace {
std::mutex g_removing_mu;
std::multiset<std::string> g_removing;  // directories queued or being removed by a Reaper
}  // namespace

bool being_removed(const std::string& dir) {
  std::lock_guard lock(g_removing_mu);
  return g_removing.count(strip_slashes(dir)) > 0;
}

Reaper::~Reaper() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Reaper::remove(std::string dir) {
  dir = strip_slashes(dir);
  {
    std::lock_guard lock(g_removing_mu);
    g_removing.insert(dir);
  }
  std::lock_guard lock(mu_);
  queue_.push_back(std::move(dir));
  if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  cv_.notify_all();
}

void Reaper::drain() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
}

void Reaper::run() {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ with nothing left
    std::string dir = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    std::error_code ec;
    fs::remove_all(dir, ec);
    if (ec && ec != std::errc::no_such_file_or_directory)
      log::warn("checkpoint committed but the previous one at ", dir, " could not be removed: ", ec.message());
    {
      std::lock_guard g(g_removing_mu);
      g_removing.erase(g_removing.find(dir));
    }
    lock.lock();
    busy_ = false;
    cv_.notify_all();
  }
}
}  // namespace detail

void remove_stale_temps(const std::string& path_in) {
  std::string path = strip_slashes(path_in);
  fs::path p(path);
  std::string parent = parent_of(path), base = p.filename().string();
  std::error_code ec;
  for (auto& e : fs::directory_iterator(parent, ec)) {
    std::string name = e.path().filename().string();
    if (name.rfind(base + ".tmp-", 0) == 0 && name.size() == base.size() + 11 &&
        !detail::being_removed(e.path().string())) {
      std::error_code ec2;
      fs::remove_all(e.path(), ec2);
    }
  }
}

}  // namespace ebbtide::ckpt
