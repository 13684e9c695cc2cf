/* The ten-line tour: reserve, release, see released memory counted as free, give it back. */
#include <stdio.h>
#include "resmem.h"

#define CHECK(call)                                                                     \
  do {                                                                                  \
    if ((call) != RM_SUCCESS) {                                                         \
      fprintf(stderr, "%s failed: %s\n", #call, rm_last_error());                       \
      return 1;                                                                         \
    }                                                                                   \
  } while (0)

int main(void) {
  void *weights = NULL;
  size_t free_bytes = 0, total_bytes = 0, returned = 0;
  rm_stats stats;

  CHECK(rm_reserve(0, (size_t)64 << 20, NULL, &weights)); /* 64 MiB on device 0 */
  CHECK(rm_release(weights));                           /* back to the pool, not the driver */
  CHECK(rm_mem_get_info(0, &free_bytes, &total_bytes)); /* free counts those 64 MiB */
  CHECK(rm_get_stats(0, &stats));
  printf("resmem %s: reserved %llu, reusable %llu, free %zu of %zu bytes\n", rm_version(),
         (unsigned long long)stats.reserved_bytes, (unsigned long long)stats.reusable_bytes,
         free_bytes, total_bytes);
  CHECK(rm_free_reusable(0, &returned)); /* what torch.cuda.empty_cache() does */
  printf("returned %zu bytes to the driver\n", returned);

  /* The figures are exact: the test suite runs this program and relies on them. */
  if (stats.reserved_bytes != (64u << 20) || stats.reusable_bytes != (64u << 20) ||
      free_bytes < stats.reusable_bytes || returned != (64u << 20)) {
    fprintf(stderr, "unexpected figures\n");
    return 1;
  }
  return 0;
}
