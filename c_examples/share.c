/*
 * One process of a group sharing a device (RESMEM_CONF=share:true): the multi-process tests
 * start several of these on one simulated device shared across processes (CUDA_SIM_SHARED).
 *
 *   share hold GIB   reserve GIB GiB and release it, so that the pool caches it idle; print
 *                    "ready", then for every line read on standard input print this process's
 *                    figures; exit at the end of the input.
 *   share ask GIB    print the free memory rm_mem_get_info reports, reserve GIB GiB and print
 *                    the outcome, the time the call took and the figures; release and exit.
 *
 * Figures are printed as "given=B received=B reserved=B allocated=B" (bytes of rm_stats).
 * Exits non-zero only on a failure other than out-of-memory in "ask" (the tests read it).
 */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "resmem.h"

static int print_figures(void) {
  rm_stats s;
  rm_status status = rm_get_stats(0, &s);
  if (status != RM_SUCCESS) {
    fprintf(stderr, "rm_get_stats: %s\n", rm_last_error());
    return 1;
  }
  uint64_t given, received;
  status = rm_get_share_stats(0, &given, &received);
  if (status != RM_SUCCESS) {
    fprintf(stderr, "rm_get_share_stats: %s\n", rm_last_error());
    return 1;
  }
  printf("given=%llu received=%llu reserved=%llu allocated=%llu\n",
         (unsigned long long)given, (unsigned long long)received,
         (unsigned long long)s.reserved_bytes, (unsigned long long)s.allocated_bytes);
  fflush(stdout);
  return 0;
}

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static int hold(size_t bytes) {
  void *p = NULL;
  char line[64];
  if (rm_reserve(0, bytes, NULL, &p) != RM_SUCCESS || rm_release(p) != RM_SUCCESS) {
    fprintf(stderr, "hold: %s\n", rm_last_error());
    return 1;
  }
  printf("ready\n");
  fflush(stdout);
  while (fgets(line, sizeof line, stdin) != NULL) {
    if (print_figures() != 0) {
      return 1;
    }
  }
  return 0;
}

static int ask(size_t bytes) {
  size_t free_bytes = 0, total = 0;
  void *p = NULL;
  double start;
  rm_status status;
  if (rm_mem_get_info(0, &free_bytes, &total) != RM_SUCCESS) {
    fprintf(stderr, "ask: %s\n", rm_last_error());
    return 1;
  }
  printf("free=%llu\n", (unsigned long long)free_bytes);
  start = now_us();
  status = rm_reserve(0, bytes, NULL, &p);
  printf("status=%d us=%.0f\n", (int)status, now_us() - start);
  if (status != RM_SUCCESS) {
    printf("error=%s\n", rm_last_error());
    if (status != RM_ERROR_OUT_OF_MEMORY) {
      return 1;
    }
  }
  if (print_figures() != 0) {
    return 1;
  }
  return rm_release(p) == RM_SUCCESS ? 0 : 1;
}

int main(int argc, char **argv) {
  size_t bytes;
  if (argc != 3) {
    fprintf(stderr, "usage: share hold|ask GIB\n");
    return 2;
  }
  bytes = (size_t)strtoull(argv[2], NULL, 10) << 30;
  if (strcmp(argv[1], "hold") == 0) {
    return hold(bytes);
  }
  if (strcmp(argv[1], "ask") == 0) {
    return ask(bytes);
  }
  fprintf(stderr, "usage: share hold|ask GIB\n");
  return 2;
}
