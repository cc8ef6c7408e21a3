// Request: the caller's handle on one write or read (engine.hpp).
#include "engine_impl.hpp"

#include "ebbtide/util/error.hpp"

namespace ebbtide::io {

bool Request::done() const {
  EBB_CHECK(s_, "Request is empty");
  std::lock_guard lock(s_->mu);
  return s_->done;
}

void Request::wait() const {
  EBB_CHECK(s_, "Request is empty");
  std::unique_lock lock(s_->mu);
  s_->cv.wait(lock, [&] { return s_->finished; });
  if (s_->error) std::rethrow_exception(s_->error);
}

bool Request::ok() const {
  EBB_CHECK(s_, "Request is empty");
  std::lock_guard lock(s_->mu);
  return s_->done && !s_->error;
}

bool Request::cancelled() const {
  EBB_CHECK(s_, "Request is empty");
  std::lock_guard lock(s_->mu);
  return s_->done && s_->was_cancelled;
}

std::exception_ptr Request::error() const {
  EBB_CHECK(s_, "Request is empty");
  std::lock_guard lock(s_->mu);
  return s_->error;
}

SlotId Request::slot() const { return s_ ? s_->slot : 0; }
uint64_t Request::nbytes() const { return s_ ? s_->nbytes : 0; }
bool Request::is_write() const { return s_ && s_->write; }

}  // namespace ebbtide::io
