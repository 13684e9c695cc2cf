/*
 * One thread per device, each cycling a 64 MiB block through rm_reserve, rm_record_stream,
 * rm_release and rm_free_reusable on its own device, so that one device returns memory while the
 * other grows. Every call must succeed (a live block must never become unknown to the pool), and
 * after rm_free_reusable(-1) every device holds nothing.
 *
 *   devices [ROUNDS]   needs two devices (CUDA_SIM_DEVICES=2GiB,2GiB); prints
 *                      "devices: ... 0 failure(s)"
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include "resmem.h"

static int rounds = 2000;
static int failures[2] = {0, 0};

static void *cycle(void *arg) {
  int device = *(const int *)arg, i;
  for (i = 0; i < rounds; i++) {
    void *p = NULL;
    rm_status s = rm_reserve(device, 64 << 20, NULL, &p);
    if (s == RM_SUCCESS) s = rm_record_stream(p, (void *)0);
    if (s == RM_SUCCESS) s = rm_release(p);
    if (s == RM_SUCCESS) s = rm_free_reusable(device, NULL);
    if (s != RM_SUCCESS) {
      fprintf(stderr, "FAIL device %d, round %d, block %p: %s\n", device, i, p, rm_last_error());
      failures[device]++;
      return NULL;
    }
  }
  return NULL;
}

int main(int argc, char **argv) {
  static const int ordinals[2] = {0, 1};
  pthread_t threads[2];
  int d, total;
  if (argc > 1) rounds = atoi(argv[1]);
  for (d = 0; d < 2; d++) {
    if (pthread_create(&threads[d], NULL, cycle, (void *)&ordinals[d]) != 0) {
      fprintf(stderr, "FAIL no thread\n");
      return 1;
    }
  }
  for (d = 0; d < 2; d++) pthread_join(threads[d], NULL);
  total = failures[0] + failures[1];
  if (rm_free_reusable(-1, NULL) != RM_SUCCESS) {
    fprintf(stderr, "FAIL rm_free_reusable(-1): %s\n", rm_last_error());
    total++;
  }
  for (d = 0; d < 2; d++) {
    rm_stats s;
    if (rm_get_stats(d, &s) != RM_SUCCESS || s.reserved_bytes != 0 || s.live_blocks != 0 ||
        s.driver_allocs != s.driver_frees) {
      fprintf(stderr, "FAIL device %d: %llu bytes reserved, %llu live, %llu allocs, %llu frees\n",
              d, (unsigned long long)s.reserved_bytes, (unsigned long long)s.live_blocks,
              (unsigned long long)s.driver_allocs, (unsigned long long)s.driver_frees);
      total++;
    }
  }
  printf("devices: 2 threads, %d rounds each; %d failure(s)\n", rounds, total);
  return total == 0 ? 0 : 1;
}
