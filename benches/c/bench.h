/*
 * What the C benchmarks share: clocks, the check that stops one on a failed call, and the
 * simulated driver's streams.
 */
#ifndef RESMEM_BENCH_H
#define RESMEM_BENCH_H

#include <dlfcn.h>
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

/* The simulated driver's functions the benchmarks make streams with (from RESMEM_CUDA_LIBRARY,
 * loaded as libcuda.so.1 would be), set by load_driver. */
typedef int (*cu_fn)();
static cu_fn cu_retain, cu_push, cu_stream_create;

/* Load RESMEM_CUDA_LIBRARY and initialise it; stop the benchmark, saying why, if it cannot. */
static inline void load_driver(void) {
  const char *lib = getenv("RESMEM_CUDA_LIBRARY");
  void *cuda = lib ? dlopen(lib, RTLD_NOW | RTLD_GLOBAL) : NULL;
  if (!cuda) {
    fprintf(stderr, "set RESMEM_CUDA_LIBRARY to libcuda_sim.so (%s)\n", dlerror());
    exit(1);
  }
  cu_fn cu_init = (cu_fn)dlsym(cuda, "cuInit");
  cu_retain = (cu_fn)dlsym(cuda, "cuDevicePrimaryCtxRetain");
  cu_push = (cu_fn)dlsym(cuda, "cuCtxPushCurrent_v2");
  cu_stream_create = (cu_fn)dlsym(cuda, "cuStreamCreate");
  if (!cu_init || !cu_retain || !cu_push || !cu_stream_create || cu_init(0) != 0) {
    fprintf(stderr, "%s lacks the stream functions\n", lib);
    exit(1);
  }
}

/* A new simulated stream on `device` for the calling thread (its context made current first);
 * with `reuse`, the stream `*reuse` if made already. After load_driver. */
static inline void *stream_on(int device, void **reuse) {
  void *ctx = NULL, *stream = reuse ? *reuse : NULL;
  if (cu_retain(&ctx, device) != 0 || cu_push(ctx) != 0 ||
      (!stream && cu_stream_create(&stream, 0) != 0)) {
    fprintf(stderr, "creating a simulated stream on device %d failed\n", device);
    exit(1);
  }
  if (reuse) *reuse = stream;
  return stream;
}

static inline void *new_stream(int device) { return stream_on(device, NULL); }

#endif
