/* Opens libresmem_preload.so (argv[1]) as a privileged program that loads it might, and calls
 * its cuMemGetInfo_v2, which makes it open the driver library: RESMEM_CUDA_LIBRARY, unless the
 * process is privileged. Prints whether the kernel marked the process secure (AT_SECURE) and
 * the status the call returned. */
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/auxv.h>

typedef int (*mem_get_info_fn)(size_t *, size_t *);

int main(int argc, char **argv) {
  size_t f = 0, t = 0;
  void *preload = argc > 1 ? dlopen(argv[1], RTLD_NOW | RTLD_LOCAL) : NULL;
  mem_get_info_fn mem_get_info;
  if (preload == NULL) {
    printf("cannot open the preload object: %s\n", dlerror());
    return 1;
  }
  *(void **)&mem_get_info = dlsym(preload, "cuMemGetInfo_v2");
  if (mem_get_info == NULL) {
    printf("no cuMemGetInfo_v2: %s\n", dlerror());
    return 1;
  }
  printf("secure %lu, cuMemGetInfo_v2 returned %d\n", getauxval(AT_SECURE), mem_get_info(&f, &t));
  return 0;
}
