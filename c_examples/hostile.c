/*
 * Hostile input at the C boundary: every function with NULL, garbage and interior pointers,
 * extreme sizes and device ordinals; the pool's figures must not change, and every call must
 * return its documented status with a message.
 *
 *   hostile                 on two simulated devices (CUDA_SIM_DEVICES=4GiB,4GiB)
 *   hostile expect STATUS   rm_reserve(0, 512) must return STATUS (a number), twice, with a
 *                           message shorter than 512 bytes (for RESMEM_CONF and AT_SECURE checks)
 *   hostile panic           with RESMEM_TEST_PANIC=rm_reserve: RM_ERROR_INTERNAL, then usable
 *   hostile faults [CALL]   with CUDA_SIM_FAULTS=cuMemAlloc_v2@1=719,cuMemAlloc_v2@2=2,
 *                           cuMemAlloc_v2@3=2: a driver error, an out-of-memory, then success
 *                           (CALL: the function the faults are on, cuMemCreate with vmm:true;
 *                           through a loaded driver library its faults start at the 2nd call:
 *                           the first is the driver's check that it maps at offsets)
 */
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "resmem.h"

static int failures = 0;
static int checks = 0;

static void expect(const char *what, rm_status got, rm_status want, const char *needle) {
  const char *message = rm_last_error();
  checks++;
  if (got != want) {
    fprintf(stderr, "FAIL %s: got %s, want %s (message: %s)\n", what, rm_status_string(got),
            rm_status_string(want), message);
    failures++;
  } else if (needle != NULL && strstr(message, needle) == NULL) {
    fprintf(stderr, "FAIL %s: message \"%s\" lacks \"%s\"\n", what, message, needle);
    failures++;
  }
}

static void expect_true(const char *what, int ok) {
  checks++;
  if (!ok) {
    fprintf(stderr, "FAIL %s\n", what);
    failures++;
  }
}

static rm_stats stats(int device) {
  rm_stats s;
  memset(&s, 0, sizeof s);
  expect("rm_get_stats", rm_get_stats(device, &s), RM_SUCCESS, NULL);
  return s;
}

static int same(const rm_stats *a, const rm_stats *b) {
  return a->allocated_bytes == b->allocated_bytes && a->requested_bytes == b->requested_bytes &&
         a->reserved_bytes == b->reserved_bytes && a->live_blocks == b->live_blocks &&
         a->segments == b->segments;
}

static int finish(const char *mode) {
  printf("hostile %s: %d checks, %d failure(s)\n", mode, checks, failures);
  return failures == 0 ? 0 : 1;
}

static int everything(void) {
  void *p = NULL, *q = NULL, *out = NULL;
  size_t f = 0, t = 0, i;
  int d;
  rm_stats s0, s1, a0, a1;
  uintptr_t base;
  static const int devices[] = {-2, 2, 3, 1000, INT_MAX, INT_MIN};
  static const size_t huge[] = {SIZE_MAX, SIZE_MAX - 511, SIZE_MAX - (2u << 20) + 2};

  expect("rm_reserve(dev 0)", rm_reserve(0, 4096, NULL, &p), RM_SUCCESS, NULL);
  expect("rm_reserve(dev 1)", rm_reserve(1, 3u << 20, NULL, &q), RM_SUCCESS, NULL);
  s0 = stats(0);
  s1 = stats(1);
  base = (uintptr_t)p;
  {
    const uintptr_t garbage[] = {1,          511,        0x1000,        0xdeadbeef,
                                 UINTPTR_MAX, UINTPTR_MAX - 511, base + 1, base + 511,
                                 base + 512, base + 4095, base + 4096, base + (2u << 20) - 1,
                                 (uintptr_t)q + 512};
    for (i = 0; i < sizeof garbage / sizeof garbage[0]; i++) {
      expect("rm_release(garbage)", rm_release((void *)garbage[i]), RM_ERROR_INVALID_POINTER,
             "rm_release: ");
      expect("rm_record_stream(garbage)", rm_record_stream((void *)garbage[i], NULL),
             RM_ERROR_INVALID_POINTER, "rm_record_stream: ");
    }
  }
  expect("rm_release(interior)", rm_release((char *)p + 512), RM_ERROR_INVALID_POINTER,
         "points 512 bytes into a live block");
  expect("rm_record_stream(NULL)", rm_record_stream(NULL, NULL), RM_ERROR_INVALID_POINTER, NULL);
  expect("rm_release(NULL)", rm_release(NULL), RM_SUCCESS, NULL);
  for (i = 0; i < sizeof huge / sizeof huge[0]; i++) {
    out = (void *)1;
    expect("rm_reserve(huge)", rm_reserve(0, huge[i], NULL, &out), RM_ERROR_INVALID_VALUE,
           "overflows");
    expect_true("out_ptr cleared", out == NULL);
  }
  /* Past SIZE_MAX - 2 MiB + 1 the shortfall cannot be rounded to pages; below, it is too large. */
  expect("rm_warmup(SIZE_MAX)", rm_warmup(0, SIZE_MAX), RM_ERROR_INVALID_VALUE, "overflows");
  expect("rm_warmup(SIZE_MAX - 511)", rm_warmup(0, SIZE_MAX - 511), RM_ERROR_INVALID_VALUE,
         "overflows");
  expect("rm_warmup(SIZE_MAX / 2)", rm_warmup(0, SIZE_MAX / 2), RM_ERROR_OUT_OF_MEMORY,
         "total memory");
  out = (void *)1;
  expect("rm_reserve(SIZE_MAX/2)", rm_reserve(0, SIZE_MAX / 2, NULL, &out),
         RM_ERROR_OUT_OF_MEMORY, "total memory");
  expect_true("out_ptr cleared", out == NULL);
  expect("rm_reserve(0)", rm_reserve(0, 0, NULL, &out), RM_SUCCESS, NULL);
  expect_true("size 0 gives NULL", out == NULL);
  expect("rm_warmup(0)", rm_warmup(0, 0), RM_SUCCESS, NULL);
  for (i = 0; i < sizeof devices / sizeof devices[0]; i++) {
    rm_stats s;
    d = devices[i];
    expect("rm_reserve(bad device)", rm_reserve(d, 512, NULL, &out), RM_ERROR_INVALID_DEVICE,
           "is out of range");
    expect("rm_mem_get_info(bad device)", rm_mem_get_info(d, &f, &t), RM_ERROR_INVALID_DEVICE,
           "2 devices");
    expect("rm_warmup(bad device)", rm_warmup(d, 1), RM_ERROR_INVALID_DEVICE, NULL);
    expect("rm_get_stats(bad device)", rm_get_stats(d, &s), RM_ERROR_INVALID_DEVICE, NULL);
    expect("rm_reset_peak_stats(bad device)", rm_reset_peak_stats(d), RM_ERROR_INVALID_DEVICE,
           NULL);
    expect("rm_free_reusable(bad device)", rm_free_reusable(d, NULL), RM_ERROR_INVALID_DEVICE,
           NULL);
  }
  expect("rm_reserve(device -1)", rm_reserve(-1, 512, NULL, &out), RM_ERROR_INVALID_DEVICE, NULL);
  expect("rm_mem_get_info(free NULL)", rm_mem_get_info(0, NULL, &t), RM_ERROR_INVALID_VALUE,
         "free_bytes is NULL");
  expect("rm_mem_get_info(total NULL)", rm_mem_get_info(0, &f, NULL), RM_ERROR_INVALID_VALUE,
         "total_bytes is NULL");
  expect("rm_reserve(out NULL)", rm_reserve(0, 512, NULL, NULL), RM_ERROR_INVALID_VALUE,
         "out_ptr is NULL");
  expect("rm_get_stats(out NULL)", rm_get_stats(0, NULL), RM_ERROR_INVALID_VALUE, "out is NULL");
  uint64_t given = 7, received = 7;
  expect("rm_get_share_stats(given NULL)", rm_get_share_stats(0, NULL, &received),
         RM_ERROR_INVALID_VALUE, "given is NULL");
  expect("rm_get_share_stats(received NULL)", rm_get_share_stats(0, &given, NULL),
         RM_ERROR_INVALID_VALUE, "received is NULL");
  expect("rm_get_share_stats(bad device)", rm_get_share_stats(99, &given, &received),
         RM_ERROR_INVALID_DEVICE, NULL);
  expect("rm_get_share_stats", rm_get_share_stats(0, &given, &received), RM_SUCCESS, NULL);
  if (given != 0 || received != 0) {
    printf("FAIL rm_get_share_stats without sharing: given %llu, received %llu\n",
           (unsigned long long)given, (unsigned long long)received);
    failures++;
  }
  expect_true("rm_status_string(-1)", strcmp(rm_status_string(-1), "unknown rm_status value") == 0);
  expect_true("rm_status_string(INT_MAX)",
              strcmp(rm_status_string(INT_MAX), "unknown rm_status value") == 0);
  expect_true("rm_version", rm_version() != NULL && strlen(rm_version()) > 0);
  a0 = stats(0);
  a1 = stats(1);
  expect_true("device 0 unchanged", same(&s0, &a0));
  expect_true("device 1 unchanged", same(&s1, &a1));
  expect("rm_release(p)", rm_release(p), RM_SUCCESS, NULL);
  expect("rm_release(q)", rm_release(q), RM_SUCCESS, NULL);
  expect("rm_release(p) again", rm_release(p), RM_ERROR_INVALID_POINTER, "double release");
  expect("rm_free_reusable(-1)", rm_free_reusable(-1, NULL), RM_SUCCESS, NULL);
  a0 = stats(0);
  a1 = stats(1);
  expect_true("nothing reserved", a0.reserved_bytes == 0 && a1.reserved_bytes == 0);
  return finish("inputs");
}

static int expect_status(const char *raw) {
  void *p = (void *)1;
  int want = atoi(raw), round;
  for (round = 0; round < 2; round++) {
    rm_status got = rm_reserve(0, 512, NULL, &p);
    checks++;
    if ((int)got != want) {
      fprintf(stderr, "FAIL rm_reserve: got %s, want %d (%s)\n", rm_status_string(got), want,
              rm_last_error());
      failures++;
    }
    if (got != RM_SUCCESS) {
      expect_true("the message is short", strlen(rm_last_error()) < 512);
      printf("%s\n", rm_last_error());
    } else {
      expect("rm_release", rm_release(p), RM_SUCCESS, NULL);
    }
  }
  return finish("expect");
}

static int panic_mode(void) {
  void *p = NULL;
  rm_stats s;
  size_t f, t;
  expect("rm_reserve (panics)", rm_reserve(0, 512, NULL, &p), RM_ERROR_INTERNAL,
         "rm_reserve: internal error (RESMEM_TEST_PANIC=rm_reserve)");
  expect("rm_reserve (panics again)", rm_reserve(0, 512, NULL, &p), RM_ERROR_INTERNAL, NULL);
  expect("rm_get_stats after a panic", rm_get_stats(0, &s), RM_SUCCESS, NULL);
  expect("rm_mem_get_info after a panic", rm_mem_get_info(0, &f, &t), RM_SUCCESS, NULL);
  expect("rm_warmup after a panic", rm_warmup(0, 1u << 20), RM_SUCCESS, NULL);
  expect("rm_free_reusable after a panic", rm_free_reusable(-1, NULL), RM_SUCCESS, NULL);
  return finish("panic");
}

/* `call` is the driver function the faults are on: cuMemAlloc_v2, or cuMemCreate for stitched
   segments (RESMEM_CONF=vmm:true). */
static int faults_mode(const char *call) {
  void *p = NULL;
  rm_stats s;
  char needle[96];
  snprintf(needle, sizeof needle, "%s failed with CUDA_ERROR_LAUNCH_FAILED (719)", call);
  expect("rm_reserve (the driver call fails with 719)", rm_reserve(0, 64u << 20, NULL, &p),
         RM_ERROR_DRIVER, needle);
  expect("rm_reserve (out of memory twice)", rm_reserve(0, 64u << 20, NULL, &p),
         RM_ERROR_OUT_OF_MEMORY, "out of memory");
  s = stats(0);
  expect_true("nothing reserved after the faults", s.reserved_bytes == 0 && s.oom_retries == 1);
  expect("rm_reserve (the fault cleared)", rm_reserve(0, 64u << 20, NULL, &p), RM_SUCCESS, NULL);
  s = stats(0);
  expect_true("64 MiB reserved", s.reserved_bytes == (64u << 20) && s.live_blocks == 1);
  expect("rm_release", rm_release(p), RM_SUCCESS, NULL);
  expect("rm_free_reusable", rm_free_reusable(0, NULL), RM_SUCCESS, NULL);
  s = stats(0);
  expect_true("nothing left", s.reserved_bytes == 0);
  return finish("faults");
}

int main(int argc, char **argv) {
  if (argc == 1) return everything();
  if (argc == 3 && strcmp(argv[1], "expect") == 0) return expect_status(argv[2]);
  if (argc == 2 && strcmp(argv[1], "panic") == 0) return panic_mode();
  if (argc == 2 && strcmp(argv[1], "faults") == 0) return faults_mode("cuMemAlloc_v2");
  if (argc == 3 && strcmp(argv[1], "faults") == 0) return faults_mode(argv[2]);
  fprintf(stderr, "usage: hostile [expect STATUS | panic | faults [CALL]]\n");
  return 2;
}
