/* The README's C tour as a program: build it against an installed prefix,
 *   scripts/install.sh --prefix /opt/resmem
 *   cc app.c $(PKG_CONFIG_PATH=/opt/resmem/lib/pkgconfig pkg-config --cflags --libs resmem)
 * and run it on a GPU, or on a simulated one with RESMEM_DRIVER=sim. */
#include <stdio.h>
#include "resmem.h"

#define CHECK(call)                                                   \
  do {                                                                \
    if ((call) != RM_SUCCESS) {                                       \
      fprintf(stderr, "%s failed: %s\n", #call, rm_last_error());     \
      return 1;                                                       \
    }                                                                 \
  } while (0)

int main(void) {
  void *p = NULL;
  size_t free_bytes = 0, total_bytes = 0, returned = 0;
  rm_stats stats;

  CHECK(rm_reserve(0, (size_t)64 << 20, NULL, &p)); /* 64 MiB on device 0, default stream */
  CHECK(rm_release(p));                             /* back to the pool, not to the driver */
  CHECK(rm_mem_get_info(0, &free_bytes, &total_bytes)); /* free counts those 64 MiB */
  CHECK(rm_warmup(0, (size_t)32 << 20));            /* already reusable: allocates nothing */
  CHECK(rm_get_stats(0, &stats));
  printf("resmem %s: free %zu of %zu bytes, reserved %llu, %llu driver allocation(s)\n",
         rm_version(), free_bytes, total_bytes, (unsigned long long)stats.reserved_bytes,
         (unsigned long long)stats.driver_allocs);
  CHECK(rm_free_reusable(-1, &returned)); /* torch.cuda.empty_cache(), for every device */
  printf("returned %zu bytes to the driver\n", returned);
  return 0;
}
