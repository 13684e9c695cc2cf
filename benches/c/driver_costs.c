/*
 * What each CUDA driver call the pool makes costs, by size: the per-call figures behind the
 * estimated driver time of `resmem replay` (cuda-sim/src/ledger.rs).
 *
 * Loads the driver the way resmem does (dlopen of RESMEM_CUDA_LIBRARY, else libcuda.so.1) and
 * times, on device 0, for each size: cuMemAlloc_v2 and cuMemFree_v2; cuMemAddressReserve and
 * cuMemAddressFree; cuMemCreate and cuMemRelease; cuMemMap, cuMemSetAccess and cuMemUnmap of one
 * handle into one reserved range. Each call is timed alone, REPS times (default 20), after one
 * untimed round. Prints one line per call and size:
 *   cost <call> <bytes> <median us> <min us> <max us>
 * Run by scripts/gpu-check.sh on a GPU; against libcuda_sim.so here it only checks that the
 * program works (the simulator's times mean nothing).
 *
 *   driver_costs [REPS]
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemHandle;

typedef struct {
  int type; /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
  int id;
} MemLocation;

typedef struct {
  int type; /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
  int requested_handle_types;
  MemLocation location;
  void *win32_handle_meta_data;
  unsigned char alloc_flags[8];
} MemAllocationProp;

typedef struct {
  MemLocation location;
  int flags; /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 */
} MemAccessDesc;

static CUresult (*cu_init)(unsigned);
static CUresult (*cu_retain)(void **, int);
static CUresult (*cu_push)(void *);
static CUresult (*cu_alloc)(CUdeviceptr *, size_t);
static CUresult (*cu_free)(CUdeviceptr);
static CUresult (*cu_granularity)(size_t *, const MemAllocationProp *, int);
static CUresult (*cu_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
static CUresult (*cu_address_free)(CUdeviceptr, size_t);
static CUresult (*cu_create)(CUmemHandle *, size_t, const MemAllocationProp *, unsigned long long);
static CUresult (*cu_release)(CUmemHandle);
static CUresult (*cu_map)(CUdeviceptr, size_t, size_t, CUmemHandle, unsigned long long);
static CUresult (*cu_unmap)(CUdeviceptr, size_t);
static CUresult (*cu_set_access)(CUdeviceptr, size_t, const MemAccessDesc *, size_t);

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static void need(CUresult r, const char *what) {
  if (r != 0) {
    fprintf(stderr, "%s failed: CUresult %d\n", what, r);
    exit(1);
  }
}

static void *symbol(void *lib, const char *name) {
  void *f = dlsym(lib, name);
  if (!f) {
    fprintf(stderr, "the driver lacks %s\n", name);
    exit(1);
  }
  return f;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

#define MAX_REPS 1000
/* The times of one call kind at one size: REPS samples. */
struct samples {
  double t[MAX_REPS];
  int n;
};

static void report(const char *call, size_t bytes, struct samples *s) {
  qsort(s->t, (size_t)s->n, sizeof s->t[0], cmp_double);
  printf("cost %s %zu %.1f %.1f %.1f\n", call, bytes, s->t[s->n / 2], s->t[0], s->t[s->n - 1]);
  fflush(stdout);
}

int main(int argc, char **argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 20;
  if (reps < 1 || reps > MAX_REPS) {
    fprintf(stderr, "REPS must be 1 to %d\n", MAX_REPS);
    return 1;
  }
  const char *name = getenv("RESMEM_CUDA_LIBRARY");
  if (!name || !*name) name = "libcuda.so.1";
  void *lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    fprintf(stderr, "cannot load %s: %s\n", name, dlerror());
    return 1;
  }
  *(void **)&cu_init = symbol(lib, "cuInit");
  *(void **)&cu_retain = symbol(lib, "cuDevicePrimaryCtxRetain");
  *(void **)&cu_push = symbol(lib, "cuCtxPushCurrent_v2");
  *(void **)&cu_alloc = symbol(lib, "cuMemAlloc_v2");
  *(void **)&cu_free = symbol(lib, "cuMemFree_v2");
  *(void **)&cu_granularity = symbol(lib, "cuMemGetAllocationGranularity");
  *(void **)&cu_reserve = symbol(lib, "cuMemAddressReserve");
  *(void **)&cu_address_free = symbol(lib, "cuMemAddressFree");
  *(void **)&cu_create = symbol(lib, "cuMemCreate");
  *(void **)&cu_release = symbol(lib, "cuMemRelease");
  *(void **)&cu_map = symbol(lib, "cuMemMap");
  *(void **)&cu_unmap = symbol(lib, "cuMemUnmap");
  *(void **)&cu_set_access = symbol(lib, "cuMemSetAccess");
  void *ctx = NULL;
  need(cu_init(0), "cuInit");
  need(cu_retain(&ctx, 0), "cuDevicePrimaryCtxRetain");
  need(cu_push(ctx), "cuCtxPushCurrent");

  MemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = 1;
  prop.location.type = 1;
  prop.location.id = 0;
  MemAccessDesc access = {{1, 0}, 3};
  size_t granularity = 0;
  need(cu_granularity(&granularity, &prop, 0), "cuMemGetAllocationGranularity");
  printf("granularity %zu\n", granularity);

  const size_t sizes[] = {2u << 20, 20u << 20, 64u << 20, 512u << 20, (size_t)2 << 30};
  static struct samples s[10];
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
    size_t bytes = sizes[k];
    memset(s, 0, sizeof s);
    for (int r = -1; r < reps; r++) { /* round -1 is not timed */
      double t[10];
      CUdeviceptr p = 0, range = 0;
      CUmemHandle h = 0;
      double a = now_us();
      need(cu_alloc(&p, bytes), "cuMemAlloc");
      double b = now_us();
      need(cu_free(p), "cuMemFree");
      double c = now_us();
      need(cu_reserve(&range, bytes, granularity, 0, 0), "cuMemAddressReserve");
      double d = now_us();
      need(cu_create(&h, bytes, &prop, 0), "cuMemCreate");
      double e = now_us();
      need(cu_map(range, bytes, 0, h, 0), "cuMemMap");
      double f = now_us();
      need(cu_set_access(range, bytes, &access, 1), "cuMemSetAccess");
      double g = now_us();
      need(cu_unmap(range, bytes), "cuMemUnmap");
      double hh = now_us();
      need(cu_release(h), "cuMemRelease");
      double i = now_us();
      need(cu_address_free(range, bytes), "cuMemAddressFree");
      double j = now_us();
      if (r < 0) continue;
      t[0] = b - a, t[1] = c - b, t[2] = d - c, t[3] = e - d, t[4] = f - e;
      t[5] = g - f, t[6] = hh - g, t[7] = i - hh, t[8] = j - i;
      for (int q = 0; q < 9; q++) s[q].t[s[q].n++] = t[q];
    }
    const char *calls[] = {"cuMemAlloc",  "cuMemFree",      "cuMemAddressReserve",
                           "cuMemCreate", "cuMemMap",       "cuMemSetAccess",
                           "cuMemUnmap",  "cuMemRelease",   "cuMemAddressFree"};
    for (int q = 0; q < 9; q++) report(calls[q], bytes, &s[q]);
  }
  return 0;
}
