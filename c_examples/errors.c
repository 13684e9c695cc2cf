/*
 * Every error path of every function: the status and the message are checked, and the pool's
 * figures are unchanged afterwards.
 *
 *   errors              with a working driver (any device size, simulated or real; the figures
 *                       are exact when CUDA_SIM_DEVICES is set)
 *   errors no-driver    with RESMEM_CUDA_LIBRARY pointing at a missing library
 *   errors bad-driver   with RESMEM_CUDA_LIBRARY pointing at a library that is not a driver
 *   errors bad-conf     with a malformed RESMEM_CONF
 */
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "resmem.h"

static int failures = 0;

/* Check that `got` is `want` and that rm_last_error() contains `needle`. */
static void expect(const char *what, rm_status got, rm_status want, const char *needle) {
  const char *message = rm_last_error();
  if (got != want) {
    fprintf(stderr, "FAIL %s: got %s, want %s (message: %s)\n", what, rm_status_string(got),
            rm_status_string(want), message);
    failures++;
    return;
  }
  if (needle != NULL && strstr(message, needle) == NULL) {
    fprintf(stderr, "FAIL %s: message \"%s\" lacks \"%s\"\n", what, message, needle);
    failures++;
    return;
  }
  printf("ok   %-44s %s\n", what, want == RM_SUCCESS ? "" : message);
}

static int same_stats(const rm_stats *a, const rm_stats *b) {
  return a->allocated_bytes == b->allocated_bytes && a->requested_bytes == b->requested_bytes &&
         a->reserved_bytes == b->reserved_bytes && a->live_blocks == b->live_blocks &&
         a->segments == b->segments;
}

static int no_driver(const char *needle) {
  size_t f = 0, t = 0;
  void *p = (void *)1;
  rm_stats s;
  expect("rm_reserve without a driver", rm_reserve(0, 512, NULL, &p), RM_ERROR_NO_DRIVER, needle);
  if (p != NULL) {
    fprintf(stderr, "FAIL out_ptr not cleared on failure\n");
    failures++;
  }
  expect("rm_mem_get_info without a driver", rm_mem_get_info(0, &f, &t), RM_ERROR_NO_DRIVER,
         "RESMEM_DRIVER=sim");
  expect("rm_get_stats without a driver", rm_get_stats(0, &s), RM_ERROR_NO_DRIVER, needle);
  expect("rm_warmup without a driver", rm_warmup(0, 1), RM_ERROR_NO_DRIVER, needle);
  expect("rm_free_reusable without a driver", rm_free_reusable(-1, NULL), RM_ERROR_NO_DRIVER,
         needle);
  expect("rm_release(NULL) without a driver", rm_release(NULL), RM_SUCCESS, NULL);
  expect("rm_release without a driver", rm_release((void *)0x1000), RM_ERROR_NO_DRIVER, needle);
  return failures;
}

static int bad_conf(void) {
  void *p = NULL;
  expect("rm_reserve with a malformed RESMEM_CONF", rm_reserve(0, 512, NULL, &p),
         RM_ERROR_INVALID_VALUE, "RESMEM_CONF: unknown key \"no_such_key\"");
  expect("rm_reset_peak_stats with a malformed RESMEM_CONF", rm_reset_peak_stats(0),
         RM_ERROR_INVALID_VALUE, "the keys are");
  return failures;
}

int main(int argc, char **argv) {
  const size_t GiB = (size_t)1 << 30, PAGE = (size_t)2 << 20;
  size_t f = 0, t = 0, total = 0, released = 0, big_size, rest_size;
  void *p = NULL, *q = NULL, *big = NULL;
  rm_stats before, after;
  char needle[128];
  int raw, simulated = getenv("CUDA_SIM_DEVICES") != NULL;

  if (strcmp(rm_last_error(), "") != 0) {
    fprintf(stderr, "FAIL rm_last_error is not empty before any failure\n");
    failures++;
  }
  if (rm_version() == NULL || rm_version()[0] == '\0') failures++;
  for (raw = -1; raw <= 8; raw++) {
    const char *text = rm_status_string((rm_status)raw);
    if (text == NULL || text[0] == '\0') failures++;
  }
  if (strstr(rm_status_string(RM_ERROR_OUT_OF_MEMORY), "OUT_OF_MEMORY") == NULL) failures++;
  if (strstr(rm_status_string((rm_status)42), "unknown") == NULL) failures++;

  if (argc > 1 && strcmp(argv[1], "no-driver") == 0) return no_driver("could not load");
  if (argc > 1 && strcmp(argv[1], "bad-driver") == 0) return no_driver("lacks cuInit");
  if (argc > 1 && strcmp(argv[1], "bad-conf") == 0) return bad_conf();

  /* Null out-pointers. */
  expect("rm_mem_get_info(free NULL)", rm_mem_get_info(0, NULL, &t), RM_ERROR_INVALID_VALUE,
         "rm_mem_get_info: free_bytes is NULL");
  expect("rm_mem_get_info(total NULL)", rm_mem_get_info(0, &f, NULL), RM_ERROR_INVALID_VALUE,
         "total_bytes is NULL");
  expect("rm_reserve(out NULL)", rm_reserve(0, 512, NULL, NULL), RM_ERROR_INVALID_VALUE,
         "rm_reserve: out_ptr is NULL");
  expect("rm_get_stats(out NULL)", rm_get_stats(0, NULL), RM_ERROR_INVALID_VALUE,
         "out is NULL");

  expect("rm_mem_get_info", rm_mem_get_info(0, &f, &total), RM_SUCCESS, NULL);
  /* On a 24 GiB device: 20 GiB live, then 5 GiB more cannot fit. Whole 2 MiB pages, so that
     the segments hold no slack and nothing is reusable while the 20 GiB are live. */
  big_size = total / 6 * 5 / PAGE * PAGE;
  rest_size = total / 24 * 5 / PAGE * PAGE;

  /* A live block to check that nothing below changes the books. */
  expect("rm_reserve(4096)", rm_reserve(0, 4096, NULL, &p), RM_SUCCESS, NULL);
  expect("rm_get_stats", rm_get_stats(0, &before), RM_SUCCESS, NULL);

  /* Sizes. */
  q = (void *)1;
  expect("rm_reserve(0 bytes)", rm_reserve(0, 0, NULL, &q), RM_SUCCESS, NULL);
  if (q != NULL) {
    fprintf(stderr, "FAIL size 0 must give NULL\n");
    failures++;
  }
  q = (void *)1;
  expect("rm_reserve(SIZE_MAX)", rm_reserve(0, SIZE_MAX, NULL, &q), RM_ERROR_INVALID_VALUE,
         "overflows");
  if (q != NULL) failures++;
  expect("rm_reserve(SIZE_MAX - 511)", rm_reserve(0, SIZE_MAX - 511, NULL, &q),
         RM_ERROR_INVALID_VALUE, "overflows");
  expect("rm_reserve(device size + 1 GiB)", rm_reserve(0, total + GiB, NULL, &q),
         RM_ERROR_OUT_OF_MEMORY, "more than the device's total memory");

  /* Devices. */
  expect("rm_reserve(device -2)", rm_reserve(-2, 512, NULL, &q), RM_ERROR_INVALID_DEVICE,
         "device -2 is out of range: this process sees 1 device");
  expect("rm_reserve(device -1)", rm_reserve(-1, 512, NULL, &q), RM_ERROR_INVALID_DEVICE,
         "device -1 is out of range");
  expect("rm_reserve(device 10000)", rm_reserve(10000, 512, NULL, &q), RM_ERROR_INVALID_DEVICE,
         "device 10000");
  expect("rm_reserve(device INT_MAX)", rm_reserve(INT_MAX, 512, NULL, &q),
         RM_ERROR_INVALID_DEVICE, "out of range");
  expect("rm_mem_get_info(device 1)", rm_mem_get_info(1, &f, &t), RM_ERROR_INVALID_DEVICE,
         "device 1 is out of range");
  expect("rm_free_reusable(device -2)", rm_free_reusable(-2, NULL), RM_ERROR_INVALID_DEVICE,
         "device -2");
  expect("rm_warmup(device 5)", rm_warmup(5, 1), RM_ERROR_INVALID_DEVICE, "device 5");
  expect("rm_get_stats(device 99)", rm_get_stats(99, &after), RM_ERROR_INVALID_DEVICE,
         "device 99");
  expect("rm_reset_peak_stats(device -3)", rm_reset_peak_stats(-3), RM_ERROR_INVALID_DEVICE,
         "device -3");

  /* Pointers. */
  expect("rm_release(NULL)", rm_release(NULL), RM_SUCCESS, NULL);
  expect("rm_release(unknown)", rm_release((void *)0x1000), RM_ERROR_INVALID_POINTER,
         "0x1000 was not returned by rm_reserve");
  expect("rm_release(interior)", rm_release((char *)p + 512), RM_ERROR_INVALID_POINTER,
         "points 512 bytes into a live block");
  expect("rm_record_stream(NULL)", rm_record_stream(NULL, NULL), RM_ERROR_INVALID_POINTER,
         "ptr is NULL");
  expect("rm_record_stream(unknown)", rm_record_stream((void *)0x1000, NULL),
         RM_ERROR_INVALID_POINTER, "not returned by rm_reserve");
  expect("rm_get_stats", rm_get_stats(0, &after), RM_SUCCESS, NULL);
  if (!same_stats(&before, &after)) {
    fprintf(stderr, "FAIL the failed calls changed the books\n");
    failures++;
  }
  expect("rm_release(live)", rm_release(p), RM_SUCCESS, NULL);
  expect("rm_release(again)", rm_release(p), RM_ERROR_INVALID_POINTER,
         "already released (double release)");

  /* Out of memory after returning everything reusable: 5/6 of the device live, 5/24 more. */
  expect("rm_reserve(5/6 of the device)", rm_reserve(0, big_size, NULL, &big), RM_SUCCESS, NULL);
  snprintf(needle, sizeof needle, "(%zu bytes) (a new segment", rest_size);
  expect("rm_reserve(5/24 of the device)", rm_reserve(0, rest_size, NULL, &q),
         RM_ERROR_OUT_OF_MEMORY, needle);
  expect("rm_reserve(5/24) again", rm_reserve(0, rest_size, NULL, &q), RM_ERROR_OUT_OF_MEMORY,
         "of which 0 B is reusable, and the driver reports");
  expect("rm_warmup(5/24)", rm_warmup(0, rest_size), RM_ERROR_OUT_OF_MEMORY, "out of memory");
  expect("rm_get_stats", rm_get_stats(0, &after), RM_SUCCESS, NULL);
  if (after.ooms < 3 || after.live_blocks != 1 || after.requested_bytes != big_size) {
    fprintf(stderr, "FAIL after out-of-memory: ooms %llu, live %llu\n",
            (unsigned long long)after.ooms, (unsigned long long)after.live_blocks);
    failures++;
  }
  expect("rm_release(5/6)", rm_release(big), RM_SUCCESS, NULL);
  expect("rm_get_stats", rm_get_stats(0, &before), RM_SUCCESS, NULL);
  expect("rm_reserve(5/24) from cache", rm_reserve(0, rest_size, NULL, &q), RM_SUCCESS, NULL);
  if (rm_get_stats(0, &after) != RM_SUCCESS || after.driver_allocs != before.driver_allocs) {
    fprintf(stderr, "FAIL the 5/24 request after the release was not served from cache\n");
    failures++;
  }
  expect("rm_release(5/24)", rm_release(q), RM_SUCCESS, NULL);
  expect("rm_free_reusable(all)", rm_free_reusable(-1, &released), RM_SUCCESS, NULL);
  expect("rm_mem_get_info", rm_mem_get_info(0, &f, &t), RM_SUCCESS, NULL);
  if (t != total || released < big_size || (simulated ? f != t : f < t / 10 * 9)) {
    fprintf(stderr, "FAIL after rm_free_reusable: free %zu total %zu released %zu\n", f, t,
            released);
    failures++;
  }
  printf("%s: %d failure(s)\n", failures ? "FAILED" : "passed", failures);
  return failures == 0 ? 0 : 1;
}
