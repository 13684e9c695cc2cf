/*
 * A recorded sequence of reserves and releases, replayed through the shipped libresmem.so on
 * one thread, many times over: what a program's calls cost when they are not all cache hits
 * (the pairs of benches/c/pairs.c are). Run by scripts/bench-trace.sh with the simulated driver
 * library as the CUDA driver (RESMEM_DRIVER=cuda, RESMEM_CUDA_LIBRARY=libcuda_sim.so).
 *
 *   trace FILE REPS
 *
 * FILE holds one operation a line: `a ID SIZE STREAM` (reserve SIZE bytes on stream STREAM, 0
 * the default stream, others made once each) or `f ID` (release the block reserved as ID). Each
 * repetition replays it and then releases the blocks it left live, so that every repetition
 * starts from the pool's cache alone. The first repetition, which fills the pool, is left out
 * of the times. Prints one line:
 *   trace <ops> <reps> <CPU ns per op, min over reps> <median> <reserves> <cache hits>
 *         <peak reserved bytes>
 * reserves and cache hits are rm_get_stats' over every repetition (a hit is a reserve served
 * from a free block, by the front cache or the pool, with no new segment).
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "resmem.h"

typedef struct {
  char kind;      /* 'a' or 'f' */
  uint32_t id;    /* the block's index in `live` */
  uint32_t stream;
  uint64_t size;
} op;

static int by_value(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: trace FILE REPS\n");
    return 2;
  }
  FILE *f = fopen(argv[1], "r");
  if (!f) {
    perror(argv[1]);
    return 1;
  }
  int reps = atoi(argv[2]);
  if (reps < 2) reps = 2;
  size_t n = 0, cap = 1024;
  op *ops = malloc(cap * sizeof *ops);
  uint32_t ids = 0, streams = 0;
  char kind;
  unsigned long long id, size, stream;
  while (fscanf(f, " %c %llu", &kind, &id) == 2) {
    op o = {kind, (uint32_t)id, 0, 0};
    if (kind == 'a') {
      if (fscanf(f, "%llu %llu", &size, &stream) != 2) return 1;
      o.size = size;
      o.stream = (uint32_t)stream;
      if (o.stream + 1 > streams) streams = o.stream + 1;
    } else if (kind != 'f') {
      fprintf(stderr, "%s: bad operation '%c'\n", argv[1], kind);
      return 1;
    }
    if (o.id + 1 > ids) ids = o.id + 1;
    if (n == cap) ops = realloc(ops, (cap *= 2) * sizeof *ops);
    ops[n++] = o;
  }
  fclose(f);

  /* The trace's streams: 0 is the default stream, each other a simulated stream of device 0. */
  void **handles = calloc(streams ? streams : 1, sizeof *handles);
  if (streams > 1) {
    load_driver();
    for (uint32_t s = 1; s < streams; s++) handles[s] = new_stream(0);
  }

  void **live = calloc(ids, sizeof *live);
  double *times = malloc(reps * sizeof *times);
  for (int r = 0; r < reps; r++) {
    double t0 = thread_cpu_ns();
    for (size_t i = 0; i < n; i++) {
      const op *o = &ops[i];
      if (o->kind == 'a') {
        check(rm_reserve(0, o->size, handles[o->stream], &live[o->id]), "rm_reserve");
      } else {
        check(rm_release(live[o->id]), "rm_release");
        live[o->id] = NULL;
      }
    }
    times[r] = (thread_cpu_ns() - t0) / (double)n;
    for (uint32_t i = 0; i < ids; i++) {
      if (live[i]) {
        check(rm_release(live[i]), "rm_release");
        live[i] = NULL;
      }
    }
  }
  rm_stats st;
  check(rm_get_stats(0, &st), "rm_get_stats");
  qsort(times + 1, reps - 1, sizeof *times, by_value);
  printf("trace %zu %d %.1f %.1f %llu %llu %llu\n", n, reps, times[1], times[1 + (reps - 1) / 2],
         (unsigned long long)st.reserve_calls, (unsigned long long)st.cache_hits,
         (unsigned long long)st.peak_reserved_bytes);
  return 0;
}
