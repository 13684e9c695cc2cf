/* A program linked against libresmem.so.0 that also calls the CUDA runtime (the stand-in
 * libcudart.so.12). Run with LD_PRELOAD=libresmem_preload.so and preload_allocations:true, its
 * rm_* calls and the cudaMalloc the preload routes must meet one pool: the preload exports the
 * rm_* API under the SONAME libresmem.so.0, so the loader binds the program's libresmem.so.0 to
 * it rather than loading a second library with a second pool, which would count the first
 * one's cache as used. Prints the live blocks the pool sees and which object rm_reserve is. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "resmem.h"

int cudaMalloc(void **ptr, size_t size);
int cudaFree(void *ptr);

#define MIB(x) ((size_t)(x) << 20)

int main(void) {
  void *p = NULL, *q = NULL;
  struct rm_stats s;
  Dl_info info;
  const char *name = "unknown";
  int failures = 0;
  memset(&s, 0, sizeof s);
  if (rm_reserve(0, MIB(64), NULL, &p) != RM_SUCCESS) {
    printf("FAILED: rm_reserve: %s\n", rm_last_error());
    failures++;
  }
  if (cudaMalloc(&q, MIB(32)) != 0) {
    printf("FAILED: cudaMalloc\n");
    failures++;
  }
  if (rm_get_stats(0, &s) != RM_SUCCESS) {
    printf("FAILED: rm_get_stats: %s\n", rm_last_error());
    failures++;
  }
  printf("live blocks %llu\n", (unsigned long long)s.live_blocks);
  /* The definition the program's own calls bind to: the first in the global scope. */
  if (dladdr(dlsym(RTLD_DEFAULT, "rm_reserve"), &info) && info.dli_fname) {
    name = strrchr(info.dli_fname, '/') ? strrchr(info.dli_fname, '/') + 1 : info.dli_fname;
  }
  printf("rm_reserve in %s\n", name);
  if (q && cudaFree(q) != 0) {
    printf("FAILED: cudaFree\n");
    failures++;
  }
  if (p && rm_release(p) != RM_SUCCESS) {
    printf("FAILED: rm_release: %s\n", rm_last_error());
    failures++;
  }
  printf("linked: %d failure(s)\n", failures);
  return failures != 0;
}
