/* A stand-in for libcudart.so.12 in the LD_PRELOAD tests: the few runtime functions the
 * preloaded object interposes, written over the driver library named by FAKE_CUDART_DRIVER the
 * way the real runtime works: through its own dlopen handle on the driver, never through the
 * global symbol scope (so the preloaded driver interposers are not in its path), on device 0's
 * primary context. */
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

typedef int (*mem_get_info_fn)(size_t *, size_t *);
typedef int (*mem_alloc_fn)(uint64_t *, size_t);
typedef int (*mem_free_fn)(uint64_t);
typedef int (*sync_fn)(void);
typedef int (*exchange_fn)(int *);
typedef int (*init_fn)(unsigned);
typedef int (*retain_fn)(void **, int);
typedef int (*set_current_fn)(void *);
typedef int (*ipc_handle_fn)(void *, uint64_t);

static struct {
  mem_get_info_fn mem_get_info;
  mem_alloc_fn mem_alloc;
  mem_free_fn mem_free;
  sync_fn synchronize;
  exchange_fn exchange_capture_mode;
  ipc_handle_fn ipc_get_mem_handle;
} drv;

/* cudaErrorInitializationError when the driver cannot be loaded. */
static int ready(void) {
  static int state = 0; /* 0: not tried, 1: ready, 3: failed */
  void *h, *ctx = NULL;
  if (state) return state == 1 ? 0 : 3;
  state = 3;
  h = dlopen(getenv("FAKE_CUDART_DRIVER"), RTLD_NOW | RTLD_LOCAL);
  if (!h) return 3;
  *(void **)&drv.mem_get_info = dlsym(h, "cuMemGetInfo_v2");
  *(void **)&drv.mem_alloc = dlsym(h, "cuMemAlloc_v2");
  *(void **)&drv.mem_free = dlsym(h, "cuMemFree_v2");
  *(void **)&drv.synchronize = dlsym(h, "cuCtxSynchronize");
  *(void **)&drv.exchange_capture_mode = dlsym(h, "cuThreadExchangeStreamCaptureMode");
  *(void **)&drv.ipc_get_mem_handle = dlsym(h, "cuIpcGetMemHandle");
  {
    init_fn cu_init;
    retain_fn retain;
    set_current_fn set_current;
    *(void **)&cu_init = dlsym(h, "cuInit");
    *(void **)&retain = dlsym(h, "cuDevicePrimaryCtxRetain");
    *(void **)&set_current = dlsym(h, "cuCtxSetCurrent");
    if (cu_init(0) || retain(&ctx, 0) || set_current(ctx)) return 3;
  }
  state = 1;
  return 0;
}

int cudaGetDevice(int *device) {
  *device = 0;
  return ready();
}

int cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
  return ready() ? 3 : drv.mem_get_info(free_bytes, total_bytes) ? 999 : 0;
}

int cudaMalloc(void **ptr, size_t size) {
  uint64_t p = 0;
  if (ready()) return 3;
  if (drv.mem_alloc(&p, size)) return 2;
  *ptr = (void *)(uintptr_t)p;
  return 0;
}

int cudaFree(void *ptr) {
  if (ready()) return 3;
  return ptr && drv.mem_free((uint64_t)(uintptr_t)ptr) ? 1 : 0;
}

int cudaDeviceSynchronize(void) { return ready() ? 3 : drv.synchronize() ? 999 : 0; }

/* The calling thread's stream-capture mode is the driver's, as in the runtime. */
int cudaThreadExchangeStreamCaptureMode(int *mode) {
  return ready() ? 3 : drv.exchange_capture_mode(mode) ? 1 : 0;
}

/* The handle of the allocation holding ptr, as the driver gives it (cudaErrorInvalidValue where
 * it refuses). */
int cudaIpcGetMemHandle(void *handle, void *ptr) {
  if (ready()) return 3;
  return drv.ipc_get_mem_handle(handle, (uint64_t)(uintptr_t)ptr) ? 1 : 0;
}
