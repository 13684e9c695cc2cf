/* Runs under LD_PRELOAD=libresmem_preload.so (or without it, as a control) against the
 * simulated driver, and prints what an unmodified program would see: cudaMemGetInfo (through
 * libcudart), cuMemGetInfo_v2 and cuMemGetInfo (through the driver it links), and how much the
 * driver really has handed out (cudasim_used_bytes). When resmem is preloaded, rm_reserve is found
 * in the process and used to leave 64 MiB of reusable memory in the pool. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stddef.h>

int cuInit(unsigned flags);
int cuDevicePrimaryCtxRetain(void **ctx, int device);
int cuCtxSetCurrent(void *ctx);
int cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes);
int cuMemAlloc_v2(uint64_t *ptr, size_t size);
int cuMemFree_v2(uint64_t ptr);
uint64_t cudasim_used_bytes(int device);
int cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);
int cudaMalloc(void **ptr, size_t size);
int cudaFree(void *ptr);
int cudaThreadExchangeStreamCaptureMode(int *mode);
int cuIpcGetMemHandle(void *handle, uint64_t ptr);
int cudaIpcGetMemHandle(void *handle, void *ptr);
int cuStreamCreate(void **stream, unsigned flags);
int cuStreamBeginCapture_v2(void *stream, int mode);
int cuStreamEndCapture(void *stream, void **graph);

#define MIB(x) ((size_t)(x) << 20)

static int failures = 0;

static void check(int status, const char *what) {
  if (status != 0) {
    printf("FAILED: %s returned %d\n", what, status);
    failures++;
  }
}

static void report(const char *when) {
  size_t f = 0, t = 0, rf = 0, rt = 0;
  check(cuMemGetInfo_v2(&f, &t), "cuMemGetInfo_v2");
  check(cudaMemGetInfo(&rf, &rt), "cudaMemGetInfo");
  printf("%-28s cuMemGetInfo_v2 free %6zu MiB  cudaMemGetInfo free %6zu MiB  driver used %4llu MiB\n",
         when, f >> 20, rf >> 20, (unsigned long long)(cudasim_used_bytes(0) >> 20));
}

int main(void) {
  void *ctx = NULL, *p = NULL, *q = NULL;
  uint64_t d = 0;
  typedef int (*reserve_fn)(int, size_t, void *, void **);
  typedef int (*release_fn)(void *);
  typedef int (*v1_fn)(unsigned *, unsigned *);
  reserve_fn reserve;
  release_fn release;
  v1_fn v1;

  check(cuInit(0), "cuInit");
  check(cuDevicePrimaryCtxRetain(&ctx, 0), "cuDevicePrimaryCtxRetain");
  check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  report("start");

  *(void **)&reserve = dlsym(RTLD_DEFAULT, "rm_reserve");
  *(void **)&release = dlsym(RTLD_DEFAULT, "rm_release");
  if (reserve && release) {
    check(reserve(0, MIB(64), NULL, &p), "rm_reserve");
    check(release(p), "rm_release");
    report("after rm_reserve+rm_release");
  } else {
    printf("resmem is not in the process\n");
  }

  check(cuMemAlloc_v2(&d, MIB(128)), "cuMemAlloc_v2");
  report("128 MiB cuMemAlloc_v2 live");
  {
    unsigned char handle[64];
    printf("cuIpcGetMemHandle of the cuMemAlloc_v2 block: %d\n", cuIpcGetMemHandle(handle, d));
  }
  check(cuMemFree_v2(d), "cuMemFree_v2");
  report("after cuMemFree_v2");

  check(cudaMalloc(&q, MIB(32)), "cudaMalloc");
  report("32 MiB cudaMalloc live");
  {
    unsigned char handle[64];
    printf("cudaIpcGetMemHandle of the cudaMalloc block: %d\n", cudaIpcGetMemHandle(handle, q));
  }
  check(cudaFree(q), "cudaFree");
  check(cudaFree(NULL), "cudaFree(NULL)");
  report("after cudaFree");

  {
    /* cudaMalloc while a stream captures a graph, in the relaxed mode PyTorch's allocator sets
     * around it: the capture must end cleanly. */
    void *s = NULL, *graph = NULL, *r = NULL;
    int mode = 2;
    check(cuStreamCreate(&s, 0), "cuStreamCreate");
    check(cuStreamBeginCapture_v2(s, 0), "cuStreamBeginCapture_v2");
    check(cudaThreadExchangeStreamCaptureMode(&mode), "to the relaxed capture mode");
    check(cudaMalloc(&r, MIB(256)), "cudaMalloc during a capture");
    check(cudaThreadExchangeStreamCaptureMode(&mode), "back from the relaxed capture mode");
    check(cuStreamEndCapture(s, &graph), "cuStreamEndCapture");
    report("256 MiB cudaMalloc captured");
    check(cudaFree(r), "cudaFree after the capture");
  }

  *(void **)&v1 = dlsym(RTLD_DEFAULT, "cuMemGetInfo");
  if (v1) {
    unsigned f1 = 0, t1 = 0;
    check(v1(&f1, &t1), "cuMemGetInfo");
    printf("cuMemGetInfo (32-bit) free %u total %u\n", f1, t1);
  }
  printf("%s: %d failure(s)\n", failures ? "FAILED" : "passed", failures);
  return failures != 0;
}
