// Note [Transfer loop]
// Every byte the engine and the checkpoint code move goes through here. A
// transfer is issued to the backend (backend.hpp) with a tag indexing the op
// table; each completion is checked: EINTR/EAGAIN and short transfers are
// resubmitted for the remainder, an error or an unexpected end of file ends
// the transfer with an IoError naming the file and the offset reached. Writes
// pass the fault hook (Note [Fault injection] in faults.cpp) before they are
// issued. The backend is chosen once per loop (AUTO: io_uring, else POSIX).
#include "ebbtide/io/transfer.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>

#include "backend.hpp"
#include "ebbtide/io/direct_file.hpp"
#include "ebbtide/io/faults.hpp"
#include "ebbtide/util/error.hpp"
#include "ebbtide/util/log.hpp"

namespace ebbtide::io {

std::string_view to_string(BackendKind kind) {
  switch (kind) {
    case BackendKind::kAuto: return "auto";
    case BackendKind::kUring: return "uring";
    case BackendKind::kPosix: return "posix";
  }
  return "?";
}

BackendKind parse_backend(std::string_view text) {
  std::string t(text);
  std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return std::tolower(c); });
  if (t == "auto") return BackendKind::kAuto;
  if (t == "uring" || t == "io_uring") return BackendKind::kUring;
  if (t == "posix") return BackendKind::kPosix;
  EBB_CHECK(false, "I/O backend '", text, "' is not valid (valid: auto, uring, posix)");
  return BackendKind::kAuto;
}

struct TransferLoop::Impl {
  struct Op {
    const DirectFile* file = nullptr;
    bool write = false;
    char* buf = nullptr;
    uint64_t len = 0, offset = 0, done = 0, need = 0;
    int buf_index = -1;
    Handler handler;
  };
  std::unique_ptr<detail::Backend> backend;
  BackendKind kind = BackendKind::kPosix;
  unsigned depth = 1;
  std::vector<Op> ops;            // indexed by tag
  std::vector<uint64_t> free_tags;
  unsigned inflight = 0;
  std::vector<detail::IoCompletion> comps;
  std::exception_ptr error;       // the collecting interface's first error

  void issue(uint64_t tag) {
    const Op& op = ops[tag];
    detail::IoOp io;
    io.tag = tag;
    io.fd = op.file->fd();
    io.write = op.write;
    io.buf = op.buf + op.done;
    io.len = op.len - op.done;
    io.offset = op.offset + op.done;
    io.buf_index = op.buf_index;
    backend->submit(io);
  }

  void finish(uint64_t tag, std::exception_ptr err) {
    Handler h = std::move(ops[tag].handler);
    ops[tag].handler = nullptr;
    free_tags.push_back(tag);
    --inflight;
    h(std::move(err));
  }

  void complete(const detail::IoCompletion& c) {
    EBB_ASSERT(c.tag < ops.size() && ops[c.tag].handler, "unknown completion tag ", c.tag);
    Op& op = ops[c.tag];
    if (c.res == -EINTR || c.res == -EAGAIN) {
      issue(c.tag);
      return;
    }
    if (c.res <= 0) {
      const auto at = static_cast<int64_t>(op.offset + op.done);
      const uint64_t left = op.len - op.done;
      const char* what = op.write ? "write" : "read";
      std::exception_ptr err;
      if (c.res < 0)
        err = std::make_exception_ptr(IoError(static_cast<int>(-c.res), op.file->label(), at,
                                              ebbtide::detail::concat(what, " of ", left, " bytes failed")));
      else if (op.write)
        err = std::make_exception_ptr(
            IoError(EIO, op.file->label(), at, ebbtide::detail::concat("write moved 0 of ", left, " bytes")));
      else
        err = std::make_exception_ptr(IoError(
            ENODATA, op.file->label(), at,
            ebbtide::detail::concat("read moved 0 of ", left, " bytes: unexpected end of file (truncated ",
                                    op.file->what(), ")")));
      finish(c.tag, std::move(err));
      return;
    }
    op.done += static_cast<uint64_t>(c.res);
    if (op.done < op.need) {  // short transfer: resubmit the remainder
      issue(c.tag);
      return;
    }
    finish(c.tag, nullptr);
  }

  void pump(bool block) {
    backend->flush();
    comps.clear();
    backend->reap(comps, block && inflight > 0);
    for (const auto& c : comps) complete(c);
  }
};

TransferLoop::TransferLoop(unsigned depth, const std::vector<iovec>& fixed, BackendKind kind, std::string_view who)
    : impl_(std::make_unique<Impl>()) {
  auto& I = *impl_;
  I.depth = std::max(1u, depth);
  std::string why;
  if (kind != BackendKind::kPosix) {
    I.backend = detail::make_uring_backend(I.depth, fixed, &why);
    if (!I.backend && kind == BackendKind::kUring)
      throw Unsupported(ebbtide::detail::concat(who, ": io backend 'uring' was requested but is unavailable: ", why));
    if (!I.backend) log::info(who, ": io backend auto -> posix (", why, ")");
    else if (kind == BackendKind::kAuto) log::info(who, ": io backend auto -> uring (io_uring available)");
  }
  if (I.backend) {
    I.kind = BackendKind::kUring;
  } else {
    I.backend = detail::make_posix_backend(I.depth);
  }
  I.ops.reserve(I.depth);
}

TransferLoop::~TransferLoop() {
  try {
    while (impl_->inflight > 0) impl_->pump(true);
  } catch (...) {
  }
}

void TransferLoop::start(const DirectFile& file, bool write, void* buf, uint64_t len, uint64_t offset,
                         int buf_index, Handler done, uint64_t need) {
  auto& I = *impl_;
  if (write) {
    if (int e = detail::take_write_fault(file, offset, len)) {
      done(std::make_exception_ptr(IoError(e, file.label(), static_cast<int64_t>(offset),
                                           ebbtide::detail::concat("write of ", len,
                                                                   " bytes failed (injected fault)"))));
      return;
    }
  }
  uint64_t tag;
  if (!I.free_tags.empty()) {
    tag = I.free_tags.back();
    I.free_tags.pop_back();
  } else {
    tag = I.ops.size();
    I.ops.emplace_back();
  }
  auto& op = I.ops[tag];
  op.file = &file;
  op.write = write;
  op.buf = static_cast<char*>(buf);
  op.len = len;
  op.offset = offset;
  op.done = 0;
  op.need = need == 0 || write ? len : std::min(need, len);
  op.buf_index = buf_index;
  op.handler = std::move(done);
  ++I.inflight;
  I.issue(tag);
}

void TransferLoop::flush() { impl_->backend->flush(); }

void TransferLoop::reap(bool block) {
  auto& I = *impl_;
  I.comps.clear();
  I.backend->reap(I.comps, block && I.inflight > 0);
  for (const auto& c : I.comps) I.complete(c);
}

unsigned TransferLoop::in_flight() const { return impl_->inflight; }

void TransferLoop::submit(const DirectFile& file, bool write, void* buf, uint64_t len, uint64_t offset,
                          int buf_index, std::function<void()> on_done, uint64_t need) {
  auto& I = *impl_;
  if (I.error) return;  // drain() reports it
  while (I.inflight >= I.depth) I.pump(true);
  start(file, write, buf, len, offset, buf_index,
        [&I, cb = std::move(on_done)](std::exception_ptr err) {
          if (err) {
            if (!I.error) I.error = std::move(err);
          } else if (cb && !I.error) {
            cb();
          }
        },
        need);
  if (I.inflight >= I.depth) I.backend->flush();
}

void TransferLoop::poll(bool block) {
  impl_->pump(block);
  if (impl_->error && impl_->inflight == 0) drain();
}

void TransferLoop::drain() {
  auto& I = *impl_;
  while (I.inflight > 0) I.pump(true);
  if (I.error) {
    auto e = I.error;
    I.error = nullptr;
    std::rethrow_exception(e);
  }
}

BackendKind TransferLoop::backend() const { return impl_->kind; }
const char* TransferLoop::name() const { return impl_->backend->name(); }
std::string TransferLoop::describe() const { return impl_->backend->describe(); }

}  // namespace ebbtide::io
