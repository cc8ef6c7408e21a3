// The process that made an object (Note [Objects across fork]).
#pragma once

#include <cstdint>

namespace ebbtide::mem {

// The number of forks between the first process and this one: the child
// handler of the process's pthread_atfork handlers (host_mapping.cpp, Note
// [Pinned memory across fork]) counts them. Installs the handlers on first
// use (IoError if pthread_atfork fails).
uint64_t fork_generation();

// Note [Objects across fork]
// fork() copies a process's memory but only the calling thread. An object
// that owns threads (the tensor cache's workers, the checkpoint writer's
// background save, the I/O engine's device threads), or a mutex or condition
// variable one of them held, is a husk in the child: destroying it joins
// threads that do not exist there, or waits on a condition no one will
// signal (a segfault and a hang, seen when a multiprocessing.Manager forked
// while such an object was garbage awaiting collection, and the child's
// collector ran its destructor). So:
// - the Python bindings of these classes free the memory of an instance that
//   another process made without running its destructor
//   (python/src/fork_safe.hpp);
// - the hooks' handles of such a cache do nothing when they die;
// - the store pool does not lend the parent's idle stores in a child, nor
//   destroy them there (Note [Store pool]);
// - the Python glue does not close them there (TensorCache.__del__ and
//   close(), the checkpoint module's exit hook), by the same generations
//   (python/ebbtide/_fork.py).
// The parent's objects are untouched: the child's copy is memory it never
// frees; its files close with the child. What the child makes is its own.
// "Made here" compares fork generations, not process ids: a grandchild may
// get the id of a parent that has exited.
class ForkOrigin {
 public:
  ForkOrigin() : generation_(fork_generation()) {}
  // A copy is made by the process that copies.
  ForkOrigin(const ForkOrigin&) : generation_(fork_generation()) {}
  ForkOrigin& operator=(const ForkOrigin&) { return *this; }
  bool made_in_this_process() const noexcept { return generation_ == fork_generation(); }

 private:
  uint64_t generation_;
};

}  // namespace ebbtide::mem
