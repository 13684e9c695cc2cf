/* A small workload to record with RESMEM_CONF=record:PATH and compare the policies on with
 * `resmem replay PATH --device N`: the C API on two devices, PyTorch's allocator entry points
 * called as PyTorch calls them, and four threads reserving and releasing at once. */
#include <pthread.h>
#include <stdio.h>
#include "resmem.h"

#define THREADS 4
#define PAIRS 5000

#define CHECK(call)                                                                     \
  do {                                                                                  \
    if ((call) != RM_SUCCESS) {                                                         \
      fprintf(stderr, "%s failed: %s\n", #call, rm_last_error());                       \
      return 1;                                                                         \
    }                                                                                   \
  } while (0)

/* Thread `arg` reserves and releases PAIRS blocks of 512 B to 32 KiB on device arg % 2. */
static void *pairs(void *arg) {
  int device = (int)((size_t)arg % 2);
  int i;
  for (i = 0; i < PAIRS; i++) {
    void *p = NULL;
    if (rm_reserve(device, (size_t)512 * (size_t)(1 + i % 64), NULL, &p) != RM_SUCCESS ||
        rm_release(p) != RM_SUCCESS) {
      fprintf(stderr, "thread %zu: %s\n", (size_t)arg, rm_last_error());
      return arg;
    }
  }
  return NULL;
}

int main(void) {
  void *a = NULL, *b = NULL, *huge = NULL, *t;
  pthread_t threads[THREADS];
  size_t i;
  int failed = 0;

  CHECK(rm_warmup(0, (size_t)64 << 20));
  CHECK(rm_reserve(0, (size_t)8 << 20, NULL, &a));
  CHECK(rm_reserve(1, (size_t)16 << 20, NULL, &b));
  CHECK(rm_record_stream(a, NULL));

  /* What PyTorch does through CUDAPluggableAllocator. */
  t = rm_torch_malloc((ssize_t)4 << 20, 1, NULL);
  if (t == NULL) {
    fprintf(stderr, "rm_torch_malloc failed: %s\n", rm_last_error());
    return 1;
  }
  rm_torch_record_stream(t, NULL);
  rm_torch_free(t, (ssize_t)4 << 20, 1, NULL);
  CHECK(rm_release(a));

  for (i = 0; i < THREADS; i++)
    if (pthread_create(&threads[i], NULL, pairs, (void *)i) != 0) return 1;
  for (i = 0; i < THREADS; i++) {
    void *result = NULL;
    pthread_join(threads[i], &result);
    failed |= result != NULL;
  }
  if (failed) return 1;

  CHECK(rm_release(b));
  rm_torch_empty_cache();
  CHECK(rm_free_reusable(0, NULL));
  if (rm_reserve(0, (size_t)1 << 50, NULL, &huge) != RM_ERROR_OUT_OF_MEMORY) return 1;
  printf("%d threads x %d pairs, then a 1 PiB request: out of memory\n", THREADS, PAIRS);
  return 0;
}
