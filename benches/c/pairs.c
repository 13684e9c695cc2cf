/*
 * Cache-hit rm_reserve + rm_release pairs through the shipped libresmem.so, next to glibc's
 * malloc + free in the same run; and the pool's pauses while rm_free_reusable returns 100k idle
 * segments, and the time of rm_get_stats with 100k blocks cached.
 *
 * Run by scripts/bench-c.sh, with the simulated driver library as the CUDA driver
 * (RESMEM_DRIVER=cuda, RESMEM_CUDA_LIBRARY=libcuda_sim.so), so that each thread can create a
 * real (simulated) stream. Prints one line per measurement:
 *   pair <impl> <threads> <size> <cached> <wall ns per pair per thread> <CPU ns per pair per thread>
 *   stats <cached> <ns per rm_get_stats>
 *   free_reusable <segments> <ms> <bytes> <calls, median, p99.9, max us, calls over 100 us:
 *                 with nothing else running, then during the call>
 * `pairs pauses [SEGMENTS [lent]]` measures only the waits behind rm_free_reusable (100000
 * segments unless given; `lent`: segments made of lent pages, see free_reusable_pauses). `pairs devices` (two simulated devices) times pairs of 128 MiB blocks, which
 * the front cache passes to the pool, from one thread on device 0, then two threads on devices
 * 0 and 1: `device_pair <threads> <wall ns> <CPU ns>` per pair per thread; `pairs streams` the
 * same from 1, 2, 4 and 8 threads on device 0, each on its own stream: `stream_pair`.
 * `pairs work [HOLDS] [SPAN_US]` times spans of fixed work as long as rm_free_reusable's lock
 * holds, with no pool: the machine's own tail for such spans. `pairs handoff [HOLD_US] [BATCHES]`
 * measures the same waits behind a plain pthread mutex held HOLD_US (20) at a time, BATCHES
 * (320) times: the machine's share of the waits behind batches of that length. `pairs count N SIZE` only does N cache-hit pairs of SIZE bytes on one thread and prints
 * nothing: run under `valgrind --tool=callgrind` twice with different N, the difference of the
 * instruction counts over the difference of N is the instructions of one pair
 * (scripts/bench-c.sh does this). `pairs quick` measures only the pairs with nothing else cached, from
 * 1 and 2 threads. `pairs scaling [ROUNDS]` times the pairs from 1 and 2 threads in alternation,
 * ROUNDS (5) rounds of each case: `scaling <impl> <threads> <size> <cached> <wall ns> <CPU ns>`.
 * `pairs growth [COUNT] [SIZE]` measures the waits behind a thread whose reserves make the pool
 * grow: COUNT (200) blocks of SIZE (256 MiB) bytes, each kept (see growth_pauses). `pairs stitch
 * [COUNT] [SIZE] [HOLE] [touch|return]` measures the waits behind a thread whose COUNT (200) reserves of
 * SIZE (256 MiB) bytes are each made of cached pieces of HOLE (4 MiB) bytes (see stitch_pauses).
 */
#define _GNU_SOURCE
#include <alloca.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <time.h>

#include "bench.h"
#include "resmem.h"


static void *reserve_on(int device, size_t size, void *stream) {
  void *p = NULL;
  check(rm_reserve(device, size, stream, &p), "rm_reserve");
  return p;
}

static void *reserve(size_t size, void *stream) { return reserve_on(0, size, stream); }

/* ----- pairs from N threads ----- */

static atomic_int go, stop;
static size_t pair_size;
static int use_glibc;
/* Each thread on the device of its index (`devices` mode), else all on device 0. */
static int device_each;
/* `pairs sweep`: every worker on one stream, made by the first, so that the shifts of the
 * stack are all that differs between its runs (a new stream would key another bin). */
static int one_stream;
static void *the_stream;
static void *volatile sink;

struct worker {
  pthread_t thread;
  unsigned long long pairs;
  double ns, cpu_ns;
};

static struct worker workers[64];

/* How long each measurement runs, and its warm-up before, in ns (`pairs sweep` shortens
 * both). */
static long run_ns = 200 * 1000 * 1000, warm_ns = 20 * 1000 * 1000;

static void *work(void *arg) {
  struct worker *w = arg;
  int dev = device_each ? (int)(w - workers) : 0;
  void *stream = use_glibc ? NULL : stream_on(dev, one_stream ? &the_stream : NULL);
  if (!use_glibc) {
    check(rm_release(reserve_on(dev, pair_size, stream)), "rm_release"); /* now cached */
  }
  while (!atomic_load(&go)) {
  }
  unsigned long long n = 0;
  double start = now_ns(), cpu_start = thread_cpu_ns();
  while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
    for (int i = 0; i < 256; i++) {
      if (use_glibc) {
        void *p = malloc(pair_size);
        sink = p;
        free(p);
      } else {
        void *p = NULL;
        rm_reserve(dev, pair_size, stream, &p);
        rm_release(p);
      }
    }
    n += 256;
  }
  w->ns = now_ns() - start;
  w->cpu_ns = thread_cpu_ns() - cpu_start;
  w->pairs = n;
  return NULL;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Run `body` on `threads` threads (each given its `workers` slot) for `run_ns` after a warm-up
 * of `warm_ns`; the median over threads of each thread's wall time per pair, and of its CPU time per
 * pair (`*cpu`: the time the thread ran, which leaves out the time it waited for a CPU). */
static double time_workers(void *(*body)(void *), int threads, double *cpu) {
  double per[64], per_cpu[64];
  atomic_store(&go, 0);
  atomic_store(&stop, 0);
  for (int t = 0; t < threads; t++) {
    memset(&workers[t], 0, sizeof workers[t]);
    pthread_create(&workers[t].thread, NULL, body, &workers[t]);
  }
  struct timespec warm = {0, warm_ns}, run = {run_ns / 1000000000, run_ns % 1000000000};
  nanosleep(&warm, NULL);
  atomic_store(&go, 1);
  nanosleep(&run, NULL);
  atomic_store(&stop, 1);
  for (int t = 0; t < threads; t++) {
    pthread_join(workers[t].thread, NULL);
    per[t] = workers[t].ns / (double)workers[t].pairs;
    per_cpu[t] = workers[t].cpu_ns / (double)workers[t].pairs;
  }
  qsort(per, threads, sizeof per[0], cmp_double);
  qsort(per_cpu, threads, sizeof per_cpu[0], cmp_double);
  *cpu = per_cpu[threads / 2];
  return per[threads / 2];
}

/* PAIRS_STACK_SHIFT=N: each worker's stack starts N bytes lower (as without it where unset).
 * A pair's time can depend on whether the block's record and the stack the calls write to sit
 * at the same offset within their pages (the CPU then holds the record's loads behind those
 * stores: "4K aliasing"); shifting the stack shows it, and `pairs sweep` times every shift. */
static size_t stack_shift;
static int shift_stack;

static void *shifted_work(void *arg) {
  /* One byte more, so that shift 0 has a pad too: the shifts differ by exactly their values. */
  volatile char *pad = alloca(stack_shift + 1);
  pad[0] = 0;
  void *result = work(arg);
  pad[0] = 1;
  return result;
}

/* Cache-hit pairs of `size` bytes (glibc's malloc + free with `glibc`) from `threads` threads:
 * as `time_workers`. */
static double run_pairs(int threads, size_t size, int glibc, double *cpu) {
  pair_size = size;
  use_glibc = glibc;
  return time_workers(shift_stack ? shifted_work : work, threads, cpu);
}


/* ----- the cache ----- */

/* The size of the i-th other cached block: 90% small (up to 128 KiB), 10% large. */
static size_t other_size(size_t i) {
  return i % 10 == 9 ? (1u << 20) + 512 * (1 + i % 1024) : 512 * (1 + i % 256);
}

static void **fences;
static size_t have;

/* Cache blocks have..to: each reserved with a live 512-byte fence after it (so that released
 * neighbours do not merge), then released; then the front caches are drained into the pool. */
static void add_cached(size_t to) {
  void **others = malloc(sizeof(void *) * (to - have + 1));
  fences = realloc(fences, sizeof(void *) * (to + 1));
  for (size_t i = have; i < to; i++) {
    others[i - have] = reserve(other_size(i), NULL);
    fences[i] = reserve(512, NULL);
  }
  for (size_t i = have; i < to; i++) check(rm_release(others[i - have]), "rm_release");
  free(others);
  have = to;
  check(rm_free_reusable(0, NULL), "rm_free_reusable");
}

static double time_stats(void) {
  rm_stats s;
  int n = 20000;
  double start = now_ns();
  for (int i = 0; i < n; i++) check(rm_get_stats(0, &s), "rm_get_stats");
  return (now_ns() - start) / n;
}

/* ----- rm_free_reusable with many idle segments ----- */

static atomic_int phase; /* 0: wait, 1: baseline, 2: during rm_free_reusable, 3: stop */
#define SAMPLES (1 << 22)
static float *waits[3];
static size_t counts[3];

/* rm_mem_get_info calls, which take the device's lock, timed one by one in each phase: while
 * nothing else runs (the machine's own noise: preemption by other processes), and while
 * rm_free_reusable runs (how long a call that needs the device's lock waits behind it). */
static void *probe(void *arg) {
  (void)arg;
  size_t free_bytes, total;
  int p;
  while ((p = atomic_load(&phase)) != 3) {
    if (p == 0) continue;
    double start = now_ns();
    check(rm_mem_get_info(0, &free_bytes, &total), "rm_mem_get_info (probe)");
    if (counts[p] < SAMPLES) waits[p][counts[p]++] = (float)(now_ns() - start);
  }
  return NULL;
}

static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

/* Median, 99.9th percentile and maximum of a phase's waits in microseconds, and how many
 * exceeded 100 us. */
static void summarize(int p, double out[4]) {
  size_t n = counts[p];
  qsort(waits[p], n, sizeof(float), cmp_float);
  out[0] = n ? waits[p][n / 2] / 1e3 : 0;
  out[1] = n ? waits[p][(size_t)((double)n * 0.999)] / 1e3 : 0;
  out[2] = n ? waits[p][n - 1] / 1e3 : 0;
  out[3] = 0;
  for (size_t i = 0; i < n; i++) out[3] += waits[p][i] > 100e3;
}

/* Start a waiter thread running `fn`: 200 ms of phase 1 (the baseline), then phase 2, the
 * time measured. */
static pthread_t probe_begin(void *(*fn)(void *)) {
  waits[1] = malloc(sizeof(float) * SAMPLES);
  waits[2] = malloc(sizeof(float) * SAMPLES);
  pthread_t t;
  pthread_create(&t, NULL, fn, NULL);
  struct timespec baseline = {0, 200 * 1000 * 1000};
  atomic_store(&phase, 1);
  nanosleep(&baseline, NULL);
  atomic_store(&phase, 2);
  return t;
}

/* End the waiter thread, then print `head` and the waits of the baseline and of the measured
 * time: <calls> <median us> <p99.9 us> <max us> <calls over 100 us>, each. */
static void probe_end(pthread_t t, const char *head) {
  atomic_store(&phase, 3);
  pthread_join(t, NULL);
  double b[4], d[4];
  summarize(1, b);
  summarize(2, d);
  printf("%s %zu %.2f %.1f %.1f %.0f %zu %.2f %.1f %.1f %.0f\n", head, counts[1], b[0], b[1],
         b[2], b[3], counts[2], d[0], d[1], d[2], d[3]);
}

/* `segments` idle segments returned by rm_free_reusable while the probe runs. Prints:
 * free_reusable <segments> <ms> <bytes> then, for the baseline and for the time of the call:
 * <calls> <median us> <p99.9 us> <max us> <calls over 100 us>
 *
 * Plain: `segments` blocks of 2 MiB reserved and released: with classic segments, a segment
 * each. With `lent` (for the default's page-granular reuse, where growth takes headroom and the
 * same requests would share a few large segments): a warm-up of 4 x `segments` 2 MiB pages
 * carved into 2 MiB blocks; then, `segments` times, two of them released (not neighbours) and
 * a block of 4 MiB reserved, which those two free pages make, mapped again into a range of its
 * own (no memory created); then those blocks released: `segments` idle segments of two lent
 * runs each, whose taking apart fills the holes in the warm-up's segment (the heavier way
 * back). */
static void free_reusable_pauses(size_t segments, int lent) {
  size_t page = (size_t)2 << 20;
  if (lent) {
    void **pages = malloc(sizeof(void *) * 4 * segments);
    void **ranges = malloc(sizeof(void *) * segments);
    check(rm_warmup(0, 4 * segments * page), "rm_warmup");
    for (size_t i = 0; i < 4 * segments; i++) pages[i] = reserve(page, NULL);
    for (size_t i = 0; i < segments; i++) {
      check(rm_release(pages[4 * i]), "rm_release");
      check(rm_release(pages[4 * i + 2]), "rm_release");
      ranges[i] = reserve(2 * page, NULL);
    }
    for (size_t i = 0; i < segments; i++) check(rm_release(ranges[i]), "rm_release");
    rm_stats s;
    check(rm_get_stats(0, &s), "rm_get_stats");
    if (s.segments != segments + 1) {
      fprintf(stderr, "lent: %llu segments, not %zu idle ones and the warm-up's\n",
              (unsigned long long)s.segments, segments);
      exit(1);
    }
    free(ranges);
    free(pages);
  } else {
    void **blocks = malloc(sizeof(void *) * segments);
    for (size_t i = 0; i < segments; i++) blocks[i] = reserve(page, NULL);
    for (size_t i = 0; i < segments; i++) check(rm_release(blocks[i]), "rm_release");
    free(blocks);
  }
  pthread_t t = probe_begin(probe);
  size_t released = 0;
  double start = now_ns();
  check(rm_free_reusable(0, &released), "rm_free_reusable");
  double took = now_ns() - start;
  char head[96];
  snprintf(head, sizeof head, "free_reusable %zu %.2f %zu", segments, took / 1e6, released);
  probe_end(t, head);
}

/* `count` reserves of `size` bytes, each kept, so that the pool grows (the driver creates memory:
 * with CUDA_SIM_DELAYS, as long as a real driver takes), while the probe times the calls that
 * take the device's lock. Then everything is released and returned, untimed. Prints:
 * growth <count> <ms> <driver allocations> then the probe's waits, as free_reusable. */
/* End the probe begun at `start` (ns) as `t`, with device 0's figures `before`, and print the
 * line: <what> <count> <ms since start> <driver allocations since before> <the probe's waits>. */
static void timed_end(pthread_t t, const char *what, size_t count, double start,
                      const rm_stats *before) {
  double took = now_ns() - start;
  rm_stats after;
  check(rm_get_stats(0, &after), "rm_get_stats");
  char head[96];
  snprintf(head, sizeof head, "%s %zu %.2f %llu", what, count, took / 1e6,
           (unsigned long long)(after.driver_allocs - before->driver_allocs));
  probe_end(t, head);
}

static void growth_pauses(size_t count, size_t size) {
  void **blocks = malloc(sizeof(void *) * count);
  rm_stats before;
  check(rm_get_stats(0, &before), "rm_get_stats");
  pthread_t t = probe_begin(probe);
  double start = now_ns();
  for (size_t i = 0; i < count; i++) blocks[i] = reserve(size, NULL);
  timed_end(t, "growth", count, start, &before);
  for (size_t i = 0; i < count; i++) check(rm_release(blocks[i]), "rm_release");
  size_t released = 0;
  check(rm_free_reusable(0, &released), "rm_free_reusable");
  free(blocks);
}

/* The waits behind a thread whose reserves are made of cached pages alone (the default's
 * page-granular reuse): 129 blocks of HOLE bytes (4 MiB) from one warm-up, every other one
 * released (64 free blocks between live ones, back in the pool from the front cache), then COUNT times a reserve
 * of SIZE bytes (256 MiB), which no free block holds, made of their pages (a cuMemMap each; 64
 * pieces for 256 MiB of 4 MiB holes, 32 for 128 MiB), its release, and rm_free_reusable (which
 * takes the range apart without the lock, its pages back in their blocks, so that the next
 * reserve is made of them again). With `touch` (and HOLE over the front cache's 64 MiB, so that
 * the pool sees it), each round first reserves and releases one hole: a block released since
 * the last wait for the device, whose pages the range then needs a wait before it may use.
 * With `return`, no rm_free_reusable: each round asks for 2 MiB more than the last, which the
 * last range, idle, does not hold, so the reserve takes it apart first (its pages back in their
 * blocks), after a wait for the device (it was released since the last).
 * Prints stitch <count> <ms> <driver allocations> then the probe's waits, as free_reusable. */
static void stitch_pauses(size_t count, size_t size, size_t hole, const char *mode) {
  int touch = strcmp(mode, "touch") == 0, grow = strcmp(mode, "return") == 0;
  enum { N = 129 };
  void *blocks[N];
  /* One warm range for all of them, so that each released block lies between live ones
   * whatever headroom the pool's growth would give. */
  check(rm_warmup(0, N * hole), "rm_warmup");
  for (int i = 0; i < N; i++) blocks[i] = reserve(hole, NULL);
  for (int i = 1; i < N; i += 2) check(rm_release(blocks[i]), "rm_release");
  size_t released = 0;
  check(rm_free_reusable(0, &released), "rm_free_reusable");
  rm_stats before;
  check(rm_get_stats(0, &before), "rm_get_stats");
  pthread_t t = probe_begin(probe);
  double start = now_ns();
  for (size_t i = 0; i < count; i++) {
    if (touch) check(rm_release(reserve(hole, NULL)), "rm_release");
    check(rm_release(reserve(size + (grow ? i << 21 : 0), NULL)), "rm_release");
    if (!grow) check(rm_free_reusable(0, &released), "rm_free_reusable");
  }
  timed_end(t, "stitch", count, start, &before);
  for (int i = 0; i < N; i += 2) check(rm_release(blocks[i]), "rm_release");
  check(rm_free_reusable(0, &released), "rm_free_reusable");
}

/* ----- the same waits behind a plain mutex, for reference ----- */

static pthread_mutex_t ref_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_int ref_waiting;

/* Lock, unlock and time it, in a loop, until phase 3; a lock that is held counts as waiting
 * until taken, as the pool counts its lock's waiters. */
static void *ref_probe(void *arg) {
  (void)arg;
  int p;
  while ((p = atomic_load(&phase)) != 3) {
    if (p == 0) continue;
    double start = now_ns();
    if (pthread_mutex_trylock(&ref_lock) != 0) {
      atomic_fetch_add(&ref_waiting, 1);
      pthread_mutex_lock(&ref_lock);
      atomic_fetch_sub(&ref_waiting, 1);
    }
    pthread_mutex_unlock(&ref_lock);
    if (counts[p] < SAMPLES) waits[p][counts[p]++] = (float)(now_ns() - start);
  }
  return NULL;
}

static void spin_us(double us) {
  double end = now_ns() + us * 1e3;
  while (now_ns() < end) {
  }
}

/* What rm_free_reusable's batches look like to a waiter, with a pthread mutex and no pool: the
 * main thread holds the lock `hold_us` at a time, `batches` times, and between two holds yields
 * while a thread waits for the lock, for up to 200 us (as the pool does). The waits measured
 * are the machine's (waking a thread that sleeps on a lock, preemption), for batches of that
 * length. Prints: handoff <batches> <hold us> then, as `pairs pauses` does, the baseline and
 * the time of the batches: <calls> <median us> <p99.9 us> <max us> <calls over 100 us> */
static void handoff_reference(double hold_us, int batches) {
  pthread_t t = probe_begin(ref_probe);
  for (int i = 0; i < batches; i++) {
    pthread_mutex_lock(&ref_lock);
    spin_us(hold_us);
    pthread_mutex_unlock(&ref_lock);
    double start = now_ns();
    while (atomic_load(&ref_waiting) > 0 && now_ns() - start < 200e3) sched_yield();
  }
  char head[64];
  snprintf(head, sizeof head, "handoff %d %.1f", batches, hold_us);
  probe_end(t, head);
}

/* ----- fixed work timed as the pool's lock holds are, for reference ----- */

static int cmp_u64(const void *a, const void *b) {
  unsigned long long x = *(const unsigned long long *)a, y = *(const unsigned long long *)b;
  return (x > y) - (x < y);
}

/* What this machine does to spans of fixed work the length of rm_free_reusable's batches, with
 * no pool and no lock: a random cycle through 64 MiB (cache misses, as the pool's maps and
 * trees take) is followed `holds` (500) times for a number of steps set so that the median span
 * takes about `span_us` (25) us, each span timed in wall-clock and the thread's CPU time. Prints:
 * work <holds> <median wall us> <99th pct wall us> <max wall us> <max CPU us> <spans over 100 us
 * wall> <over 100 us CPU> */
static void fixed_work_reference(int holds, double span_us) {
  size_t n = (size_t)16 << 20;
  unsigned *next = malloc(sizeof(unsigned) * n);
  for (size_t i = 0; i < n; i++) next[i] = (unsigned)i;
  unsigned long long x = 0x9E3779B97F4A7C15ull;
  for (size_t i = n - 1; i > 0; i--) { /* Sattolo: one cycle through every entry */
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    size_t j = (size_t)(x % i);
    unsigned t = next[i];
    next[i] = next[j];
    next[j] = t;
  }
  unsigned at = 0;
  /* Calibrate: the median of 101 spans of 1000 steps. */
  double trial[101];
  for (int k = 0; k < 101; k++) {
    double start = now_ns();
    for (int i = 0; i < 1000; i++) at = next[at];
    trial[k] = now_ns() - start;
  }
  qsort(trial, 101, sizeof trial[0], cmp_double);
  long steps = (long)(1000 * span_us * 1e3 / trial[50]);
  unsigned long long *wall = malloc(sizeof *wall * holds), *cpu = malloc(sizeof *cpu * holds);
  for (int h = 0; h < holds; h++) {
    double start = now_ns(), cpu_start = thread_cpu_ns();
    for (long i = 0; i < steps; i++) at = next[at];
    cpu[h] = (unsigned long long)(thread_cpu_ns() - cpu_start);
    wall[h] = (unsigned long long)(now_ns() - start);
  }
  sink = (void *)(uintptr_t)at;
  int over_wall = 0, over_cpu = 0;
  for (int h = 0; h < holds; h++) {
    over_wall += wall[h] > 100000;
    over_cpu += cpu[h] > 100000;
  }
  qsort(wall, holds, sizeof *wall, cmp_u64);
  qsort(cpu, holds, sizeof *cpu, cmp_u64);
  printf("work %d %.1f %.1f %.1f %.1f %d %d\n", holds, wall[holds / 2] / 1e3,
         wall[holds * 99 / 100] / 1e3, wall[holds - 1] / 1e3, cpu[holds - 1] / 1e3, over_wall,
         over_cpu);
  free(wall);
  free(cpu);
  free(next);
}

/* ----- releases the front cache does not know, one device per thread ----- */

/* Prints `device_pair <threads> <wall ns> <CPU ns>` per pair per thread (the median over
 * threads; the CPU time is the thread's own, which leaves out the time it waited for a CPU)
 * for 1 and 2 threads (devices 0 and 1 of CUDA_SIM_DEVICES). */
static void device_pairs(void) {
  /* Pairs of 128 MiB blocks: beyond the front cache's 64 MiB, so each release goes to the pool
   * and finds the block's device there; each thread on its own device and stream. */
  device_each = 1;
  for (int threads = 1; threads <= 2; threads++) {
    double cpu, wall = run_pairs(threads, (size_t)128 << 20, 0, &cpu);
    printf("device_pair %d %.1f %.1f\n", threads, wall, cpu);
    fflush(stdout);
  }
  device_each = 0;
}

/* The same pairs of 128 MiB blocks from 1, 2, 4 and 8 threads on device 0, each on its own
 * stream: every reserve and release takes the lock of its stream's shard of the device, the
 * threads' blocks in different segments. Prints `stream_pair <threads> <wall ns> <CPU ns>` per
 * pair per thread. */
static void stream_pairs(void) {
  for (int threads = 1; threads <= 8; threads *= 2) {
    double cpu, wall = run_pairs(threads, (size_t)128 << 20, 0, &cpu);
    printf("stream_pair %d %.1f %.1f\n", threads, wall, cpu);
    fflush(stdout);
  }
}

/* ----- two threads against one, alternating ----- */

/* For each count of other cached blocks and each size: `rounds` rounds, each timing the pair
 * from 1 thread, then from 2 threads (each on its own stream), resmem's then glibc's, for
 * 100 ms each. Alternating, both thread counts meet the machine's other work alike; the minimum
 * over many rounds is the figure that work left alone. Prints `scaling <impl> <threads> <size>
 * <cached> <wall ns> <CPU ns>` per pair per thread. */
static void scaling(const size_t sizes[4], const size_t cached[3], int rounds) {
  long saved_run = run_ns, saved_warm = warm_ns;
  run_ns = 100 * 1000 * 1000;
  warm_ns = 10 * 1000 * 1000;
  for (int c = 0; c < 3; c++) {
    add_cached(cached[c]);
    for (int s = 0; s < 4; s++) {
      for (int r = 0; r < rounds; r++) {
        for (int glibc = 0; glibc < 2; glibc++) {
          for (int threads = 1; threads <= 2; threads++) {
            double cpu, wall = run_pairs(threads, sizes[s], glibc, &cpu);
            printf("scaling %s %d %zu %zu %.2f %.2f\n", glibc ? "glibc" : "resmem", threads,
                   sizes[s], cached[c], wall, cpu);
          }
        }
        fflush(stdout);
      }
    }
  }
  run_ns = saved_run;
  warm_ns = saved_warm;
}

/* The one-thread pair of each size (or only of size `only`; resmem's, then glibc's) with
 * `cached` other blocks cached, the worker's stack shifted by each multiple of `step` below 4096,
 * `ms` ms each after a 5 ms warm-up; all of it `passes` times over, so that each shift is timed
 * at several moments (a minimum over them leaves out the machine's other work). Prints
 * `shift <impl> <size> <cached> <shift> <wall ns> <CPU ns>` per pair. */
static void shift_sweep(const size_t sizes[4], size_t cached, size_t step, long ms, size_t only,
                        int passes) {
  add_cached(cached);
  run_ns = ms * 1000 * 1000;
  warm_ns = 5 * 1000 * 1000;
  shift_stack = 1;
  one_stream = 1;
  for (int pass = 0; pass < passes; pass++) {
    for (int s = 0; s < 4; s++) {
      if (only && sizes[s] != only) continue;
      for (size_t shift = 0; shift < 4096; shift += step) {
        stack_shift = shift;
        for (int glibc = 0; glibc < 2; glibc++) {
          double cpu, wall = run_pairs(1, sizes[s], glibc, &cpu);
          printf("shift %s %zu %zu %zu %.2f %.2f\n", glibc ? "glibc" : "resmem", sizes[s],
                 cached, shift, wall, cpu);
        }
        fflush(stdout);
      }
    }
  }
}

int main(int argc, char **argv) {
  const char *shift = getenv("PAIRS_STACK_SHIFT");
  stack_shift = shift ? (size_t)atol(shift) : 0;
  shift_stack = shift != NULL;
  load_driver();
  const size_t sizes[] = {512, 64 << 10, 4 << 20, 64 << 20};
  const size_t cached[] = {0, 1000, 100000};
  const int threads[] = {1, 2, 4, 8};
  int only_pauses = argc > 1 && strcmp(argv[1], "pauses") == 0;
  /* `pairs quick`: only the pairs with nothing else cached, from 1 and 2 threads. */
  int quick = argc > 1 && strcmp(argv[1], "quick") == 0;
  if (argc > 3 && strcmp(argv[1], "count") == 0) {
    long n = atol(argv[2]);
    size_t size = (size_t)atol(argv[3]);
    void *stream = new_stream(0);
    check(rm_release(reserve(size, stream)), "rm_release");
    for (long i = 0; i < n; i++) {
      void *p = NULL;
      rm_reserve(0, size, stream, &p);
      rm_release(p);
    }
    return 0;
  }
  if (argc > 2 && strcmp(argv[1], "sweep") == 0) {
    size_t step = argc > 3 ? (size_t)atol(argv[3]) : 64;
    shift_sweep(sizes, (size_t)atol(argv[2]), step ? step : 64, argc > 4 ? atol(argv[4]) : 20,
                argc > 5 ? (size_t)atol(argv[5]) : 0, argc > 6 ? atoi(argv[6]) : 4);
    return 0;
  }
  if (argc > 1 && strcmp(argv[1], "scaling") == 0) {
    int rounds = argc > 2 ? atoi(argv[2]) : 5;
    if (rounds < 1) {
      fprintf(stderr, "pairs scaling: ROUNDS must be at least 1\n");
      return 1;
    }
    scaling(sizes, cached, rounds);
    return 0;
  }
  if (argc > 1 && strcmp(argv[1], "handoff") == 0) {
    handoff_reference(argc > 2 ? atof(argv[2]) : 20, argc > 3 ? atoi(argv[3]) : 320);
    return 0;
  }
  if (argc > 1 && strcmp(argv[1], "devices") == 0) {
    device_pairs();
    return 0;
  }
  if (argc > 1 && strcmp(argv[1], "work") == 0) {
    fixed_work_reference(argc > 2 ? atoi(argv[2]) : 500, argc > 3 ? atof(argv[3]) : 25);
    return 0;
  }
  if (argc > 1 && strcmp(argv[1], "growth") == 0) {
    growth_pauses(argc > 2 ? (size_t)atol(argv[2]) : 200,
                  argc > 3 ? (size_t)atol(argv[3]) : (size_t)256 << 20);
    return 0;
  }
  if (argc > 1 && strcmp(argv[1], "stitch") == 0) {
    stitch_pauses(argc > 2 ? (size_t)atol(argv[2]) : 200,
                  argc > 3 ? (size_t)atol(argv[3]) : (size_t)256 << 20,
                  argc > 4 ? (size_t)atol(argv[4]) : (size_t)4 << 20,
                  argc > 5 ? argv[5] : "");
    return 0;
  }
  if (argc > 1 && strcmp(argv[1], "streams") == 0) {
    stream_pairs();
    return 0;
  }
  if (!only_pauses) {
    for (int c = 0; c < (quick ? 1 : 3); c++) {
      add_cached(cached[c]);
      printf("stats %zu %.1f\n", cached[c], time_stats());
      fflush(stdout);
      for (int s = 0; s < 4; s++) {
        for (int t = 0; t < (quick ? 2 : 4); t++) {
          for (int glibc = 0; glibc < 2; glibc++) {
            double cpu, wall = run_pairs(threads[t], sizes[s], glibc, &cpu);
            printf("pair %s %d %zu %zu %.2f %.2f\n", glibc ? "glibc" : "resmem", threads[t],
                   sizes[s], cached[c], wall, cpu);
          }
          fflush(stdout);
        }
      }
    }
  } else {
    free_reusable_pauses(argc > 2 ? (size_t)atol(argv[2]) : 100000,
                         argc > 3 && strcmp(argv[3], "lent") == 0);
  }
  return 0;
}
