/*
 * Every exported function called while the calling thread is being torn down: from a
 * thread-exit destructor (a pthread key destructor, which runs after the thread's other locals
 * are destroyed) and from an atexit handler (which runs after the main thread's locals are
 * destroyed), each time after failed calls and after reading rm_last_error() on that thread.
 * Nothing may abort: a call that should succeed succeeds, a failing one returns its status, and
 * rm_last_error() and the other string functions never return NULL.
 *
 *   exit        prints "exit in thread destructor: N failure(s)" and then, from the atexit
 *               handler, "exit in atexit handler: N failure(s)"; exits 1 on any failure
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include "resmem.h"

static int failures = 0;

static void expect(const char *where, const char *what, rm_status got, rm_status want) {
  if (got != want) {
    fprintf(stderr, "FAIL %s: %s: got %s, want %s\n", where, what, rm_status_string(got),
            rm_status_string(want));
    failures++;
  }
}

static void expect_text(const char *where, const char *what, const char *text) {
  if (text == NULL) {
    fprintf(stderr, "FAIL %s: %s returned NULL\n", where, what);
    failures++;
  }
}

/* Fail a few calls and read the message, so that the thread's last-error storage exists. */
static void fail_and_read(const char *where) {
  void *p = NULL;
  expect(where, "rm_reserve on device 99", rm_reserve(99, 512, NULL, &p),
         RM_ERROR_INVALID_DEVICE);
  expect(where, "rm_release of a foreign pointer", rm_release((void *)0x10),
         RM_ERROR_INVALID_POINTER);
  expect_text(where, "rm_last_error", rm_last_error());
}

/* Every export, successes and failures alike. */
static void every_export(const char *where) {
  void *p = NULL;
  size_t f = 0, t = 0, released = 0, limit = 1;
  rm_stats s;
  fail_and_read(where);
  expect(where, "rm_reserve", rm_reserve(0, 1 << 20, NULL, &p), RM_SUCCESS);
  expect(where, "rm_record_stream", rm_record_stream(p, NULL), RM_SUCCESS);
  expect(where, "rm_release", rm_release(p), RM_SUCCESS);
  expect(where, "rm_release twice", rm_release(p), RM_ERROR_INVALID_POINTER);
  expect(where, "rm_record_stream(NULL)", rm_record_stream(NULL, NULL), RM_ERROR_INVALID_POINTER);
  expect(where, "rm_mem_get_info", rm_mem_get_info(0, &f, &t), RM_SUCCESS);
  expect(where, "rm_mem_get_info(NULL)", rm_mem_get_info(0, NULL, &t), RM_ERROR_INVALID_VALUE);
  expect(where, "rm_warmup", rm_warmup(0, 1 << 20), RM_SUCCESS);
  expect(where, "rm_warmup on device 99", rm_warmup(99, 1), RM_ERROR_INVALID_DEVICE);
  expect(where, "rm_get_stats", rm_get_stats(0, &s), RM_SUCCESS);
  expect(where, "rm_get_stats(NULL)", rm_get_stats(0, NULL), RM_ERROR_INVALID_VALUE);
  uint64_t given, received;
  expect(where, "rm_get_share_stats", rm_get_share_stats(0, &given, &received), RM_SUCCESS);
  expect(where, "rm_get_share_stats(NULL)", rm_get_share_stats(0, NULL, &received),
         RM_ERROR_INVALID_VALUE);
  expect(where, "rm_reset_peak_stats", rm_reset_peak_stats(0), RM_SUCCESS);
  expect(where, "rm_reset_peak_stats on device 99", rm_reset_peak_stats(99),
         RM_ERROR_INVALID_DEVICE);
  expect(where, "rm_set_memory_limit", rm_set_memory_limit(0, 0), RM_SUCCESS);
  expect(where, "rm_set_memory_limit on device 99", rm_set_memory_limit(99, 1),
         RM_ERROR_INVALID_DEVICE);
  expect(where, "rm_get_memory_limit", rm_get_memory_limit(0, &limit), RM_SUCCESS);
  if (limit != 0) {
    fprintf(stderr, "FAIL %s: limit %zu, want 0\n", where, limit);
    failures++;
  }
  expect(where, "rm_get_memory_limit(NULL)", rm_get_memory_limit(0, NULL),
         RM_ERROR_INVALID_VALUE);
  rm_torch_init(1);
  p = rm_torch_malloc(4096, 0, NULL);
  expect_text(where, "rm_torch_malloc", p);
  rm_torch_record_stream(p, NULL);
  rm_torch_free(p, 4096, 0, NULL);
  if (rm_torch_malloc(-1, 0, NULL) != NULL) {
    fprintf(stderr, "FAIL %s: rm_torch_malloc(-1) is not NULL\n", where);
    failures++;
  }
  rm_torch_record_stream(NULL, NULL);
  rm_torch_free((void *)0x10, 1, 0, NULL);
  rm_torch_set_memory_fraction(2.0, 0);
  rm_torch_set_memory_fraction(1.0, 0);
  rm_torch_empty_cache();
  expect_text(where, "rm_last_error", rm_last_error());
  expect_text(where, "rm_version", rm_version());
  expect_text(where, "rm_status_string", rm_status_string(RM_ERROR_DRIVER));
  expect(where, "rm_set_memory_limit(-1, 0)", rm_set_memory_limit(-1, 0), RM_SUCCESS);
  expect(where, "rm_free_reusable", rm_free_reusable(-1, &released), RM_SUCCESS);
  expect(where, "rm_free_reusable on device 99", rm_free_reusable(99, NULL),
         RM_ERROR_INVALID_DEVICE);
  expect(where, "rm_get_stats at the end", rm_get_stats(0, &s), RM_SUCCESS);
  if (s.live_blocks != 0 || s.reserved_bytes != 0) {
    fprintf(stderr, "FAIL %s: %llu live blocks, %llu bytes reserved at the end\n", where,
            (unsigned long long)s.live_blocks, (unsigned long long)s.reserved_bytes);
    failures++;
  }
  printf("exit in %s: %d failure(s)\n", where, failures);
  fflush(stdout);
}

static void in_thread_destructor(void *value) {
  (void)value;
  every_export("thread destructor");
}

static void *thread_body(void *key) {
  fail_and_read("thread");
  pthread_setspecific(*(pthread_key_t *)key, (void *)1);
  return NULL;
}

static void in_atexit_handler(void) {
  every_export("atexit handler");
  if (failures != 0) {
    _exit(1);
  }
}

int main(void) {
  pthread_key_t key;
  pthread_t thread;
  fail_and_read("main");
  if (atexit(in_atexit_handler) != 0 || pthread_key_create(&key, in_thread_destructor) != 0 ||
      pthread_create(&thread, NULL, thread_body, &key) != 0 || pthread_join(thread, NULL) != 0) {
    fprintf(stderr, "FAIL could not set up the handlers\n");
    return 1;
  }
  /* Returning runs exit(): the main thread's locals are destroyed, then the handler runs. */
  return 0;
}
