/*
 * What the C benchmarks share: clocks, and the check that stops one on a failed call.
 */
#ifndef RESMEM_BENCH_H
#define RESMEM_BENCH_H

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "resmem.h"

/* The monotonic clock, in ns. */
static inline double now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

/* The calling thread's CPU time, in ns: the time it ran, not the time it waited for a CPU. */
static inline double thread_cpu_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

/* Stop the benchmark, saying why, unless `s` is success. */
static inline void check(rm_status s, const char *what) {
  if (s != RM_SUCCESS) {
    fprintf(stderr, "%s failed: %s\n", what, rm_last_error());
    exit(1);
  }
}

#endif
