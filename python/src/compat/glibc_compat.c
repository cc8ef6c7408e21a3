// glibc symbols newer than 2.28 that GCC 12's libstdc++ (its headers and
// libstdc++.a) refers to, defined inside the module for the manylinux_2_28
// wheel (Note [manylinux_2_28 without a container] in python/CMakeLists.txt).
// Hidden: each module keeps its own copy and no other library sees them, so
// a newer glibc's own definitions are untouched.
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/random.h>
#include <time.h>

#define EBB_HIDDEN __attribute__((visibility("hidden")))

// glibc 2.32. libstdc++ reads it to skip atomic reference counts while a
// process has one thread; zero means "maybe several threads", which is always
// correct: only that fast path is given up.
EBB_HIDDEN char __libc_single_threaded = 0;

// glibc 2.30. std::condition_variable's steady_clock waits. Before it, glibc
// had only CLOCK_REALTIME deadlines, and libstdc++ converted a steady
// deadline to the system clock; this does the same (a wall-clock step during
// the wait lengthens or shortens it).
EBB_HIDDEN int pthread_cond_clockwait(pthread_cond_t* cond, pthread_mutex_t* mutex, clockid_t clock,
                                      const struct timespec* deadline) {
  if (clock == CLOCK_REALTIME) return pthread_cond_timedwait(cond, mutex, deadline);
  if (clock != CLOCK_MONOTONIC) return EINVAL;
  struct timespec now_mono, now_real;
  clock_gettime(CLOCK_MONOTONIC, &now_mono);
  clock_gettime(CLOCK_REALTIME, &now_real);
  int64_t left_ns = (int64_t)(deadline->tv_sec - now_mono.tv_sec) * 1000000000 + (deadline->tv_nsec - now_mono.tv_nsec);
  if (left_ns < 0) left_ns = 0;
  int64_t real_ns = (int64_t)now_real.tv_nsec + left_ns % 1000000000;
  struct timespec real = {now_real.tv_sec + (time_t)(left_ns / 1000000000) + (time_t)(real_ns / 1000000000),
                          (long)(real_ns % 1000000000)};
  return pthread_cond_timedwait(cond, mutex, &real);
}

// glibc 2.36. std::random_device's default source; getrandom is glibc 2.25.
EBB_HIDDEN uint32_t arc4random(void) {
  uint32_t v;
  for (;;) {
    ssize_t n = getrandom(&v, sizeof v, 0);
    if (n == (ssize_t)sizeof v) return v;
    if (n < 0 && errno != EINTR) abort();  // as glibc's arc4random does without a random source
  }
}
