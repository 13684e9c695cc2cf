/*
 * resmem: a CUDA device-memory caching pool that counts reserved-but-unused memory as free.
 *
 * This header is generated from src/capi.rs by cbindgen; do not edit it by hand.
 * Regenerate it with: RESMEM_BLESS=1 cargo test --test header
 *
 * Every function is thread-safe, never unwinds into the caller, never aborts the process, and
 * prints nothing unless RESMEM_CONF=logging:true. Like malloc, none is async-signal-safe: do
 * not call them from a signal handler. On failure a function returns a status other
 * than RM_SUCCESS and rm_last_error() describes what happened and what to do.
 *
 * Environment (read once, at the first call):
 *   RESMEM_DRIVER        cuda (default: load the real driver) or sim (simulated devices)
 *   RESMEM_CUDA_LIBRARY  the driver library to load (default libcuda.so.1)
 *   RESMEM_CONF          settings, key:value,key:value: release_before_grow, logging, vmm,
 *                        preload_allocations
 *   CUDA_SIM_DEVICES     simulated devices' capacities, e.g. 24GiB or 80GiB,80GiB
 */

#ifndef RESMEM_H
#define RESMEM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/**
 * The result of every resmem function.
 */
typedef enum rm_status {
  /**
   * The call did what it was asked.
   */
  RM_SUCCESS = 0,
  /**
   * An argument is wrong: a NULL out-pointer, a size that overflows, a malformed `RESMEM_CONF`.
   */
  RM_ERROR_INVALID_VALUE = 1,
  /**
   * The device ordinal is out of range for this process.
   */
  RM_ERROR_INVALID_DEVICE = 2,
  /**
   * The request cannot be met even after returning all reusable memory to the driver.
   */
  RM_ERROR_OUT_OF_MEMORY = 3,
  /**
   * The pointer was not returned by `rm_reserve`, points inside a block, or was already released.
   */
  RM_ERROR_INVALID_POINTER = 4,
  /**
   * No CUDA driver could be loaded or initialised.
   */
  RM_ERROR_NO_DRIVER = 5,
  /**
   * Another driver call failed; the message names the call and its `CUresult`.
   */
  RM_ERROR_DRIVER = 6,
  /**
   * A bug in resmem: a caught panic or a broken invariant. Please report it with the message.
   */
  RM_ERROR_INTERNAL = 7,
} rm_status;

/**
 * A device's figures, as `rm_get_stats` reports them. They are exact whenever no other call
 * is in flight (calls running meanwhile may or may not be counted yet).
 */
typedef struct rm_stats {
  /**
   * Bytes in live blocks (block sizes: requests rounded up to 512 bytes).
   */
  uint64_t allocated_bytes;
  /**
   * Bytes in live blocks as requested.
   */
  uint64_t requested_bytes;
  /**
   * Bytes held from the driver.
   */
  uint64_t reserved_bytes;
  /**
   * `reserved_bytes - allocated_bytes`: held but unused, counted as free by `rm_mem_get_info`.
   */
  uint64_t reusable_bytes;
  /**
   * The largest single request servable without the driver (on the stream owning that block).
   */
  uint64_t largest_reusable_block;
  /**
   * Highest `allocated_bytes` since start or the last `rm_reset_peak_stats`. Where threads
   * contended for the pool and their streams took separate shards of the device (README,
   * "shards"), the sum of the shards' highs: at least the device's.
   */
  uint64_t peak_allocated_bytes;
  /**
   * Highest `reserved_bytes` since start or the last `rm_reset_peak_stats`: the device's own,
   * whatever its shards.
   */
  uint64_t peak_reserved_bytes;
  /**
   * Blocks reserved and not yet released.
   */
  uint64_t live_blocks;
  /**
   * Segments (driver allocations) held.
   */
  uint64_t segments;
  /**
   * `rm_reserve` calls with a non-zero size.
   */
  uint64_t reserve_calls;
  /**
   * Of those, the ones served from a free block the pool held, with no new segment (a
   * segment mapped from cached pages, which allocates no memory, is not counted).
   */
  uint64_t cache_hits;
  /**
   * Successful driver allocations.
   */
  uint64_t driver_allocs;
  /**
   * Successful driver frees.
   */
  uint64_t driver_frees;
  /**
   * Times a driver out-of-memory made the pool return all reusable memory and retry.
   */
  uint64_t oom_retries;
  /**
   * Requests that failed with `RM_ERROR_OUT_OF_MEMORY`.
   */
  uint64_t ooms;
} rm_stats;

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

/**
 * Free and total memory of `device` in bytes, where *free* is what the driver reports free
 * plus this pool's reusable bytes on that device (memory it holds but nobody uses), and, with
 * `RESMEM_CONF=share:true,share_count:true`, the reusable bytes the other sharing processes on
 * the device would give up on request (never more than the total).
 *
 * # Safety
 * `free_bytes` and `total_bytes` are NULL or valid for writing a `size_t`.
 */
enum rm_status rm_mem_get_info(int device, size_t *free_bytes, size_t *total_bytes);

/**
 * Reserve a block of at least `size` bytes on `device`, 512-byte aligned, for use on `stream`
 * (a `CUstream`; NULL is the default stream, and so is `CU_STREAM_LEGACY`;
 * `CU_STREAM_PER_THREAD`, `cudaStreamPerThread`, is the calling thread's own default stream: a
 * block reserved and released on it is reused at once by the same thread, by another thread
 * only after the device's work). `size` 0 succeeds with `*out_ptr = NULL`.
 *
 * Order of attempts: a cached block on this stream (best fit); an idle cached segment of
 * another stream, ordered after that stream's work; a new segment, returning idle cached
 * segments to the driver first if the driver's free memory is short; on a driver
 * out-of-memory, all reusable memory is returned and the allocation retried once (where
 * threads contending for the pool moved their streams to separate shards of the device, the
 * stream's shard first, then the other shards' idle cache and one more try); with
 * `RESMEM_CONF=share:true`, the other sharing processes on the device are asked for the
 * shortfall, and the allocation is retried once more if the driver's free memory rises within
 * `share_wait_ms`; then `RM_ERROR_OUT_OF_MEMORY`, with the requested, reserved, reusable and
 * driver-free bytes (and what sharing asked and received) in `rm_last_error()`. On failure
 * `*out_ptr` is NULL.
 *
 * # Safety
 * `out_ptr` is NULL or valid for writing a pointer.
 */
enum rm_status rm_reserve(int device, size_t size, void *stream, void **out_ptr);

/**
 * Reserve as [`rm_reserve`] for a stream that is capturing a CUDA graph, or while any stream
 * of the device captures one (`resmem.torch.install()` calls it for PyTorch's graph
 * captures): it never waits for the device's work (`cuCtxSynchronize`, `cuEventSynchronize`,
 * `cuEventQuery`, `cuMemFree`) nor orders `stream` after another stream's
 * (`cuStreamWaitEvent`), which the driver refuses during a capture, invalidating it. It takes
 * a cached block of `stream`, an idle cached segment whose work is known done (released before
 * the pool last waited for the device), or new memory; no cache goes back to the driver to
 * make room, so where memory is short it fails with `RM_ERROR_OUT_OF_MEMORY` where
 * `rm_reserve` might not. Use `rm_reserve` again once the capture has ended. During a capture,
 * the driver creates memory only for a thread in CUDA's relaxed capture mode
 * (`cuThreadExchangeStreamCaptureMode`), as PyTorch's allocator sets it around its own.
 *
 * # Safety
 * `out_ptr` is NULL or valid for writing a pointer.
 */
enum rm_status rm_reserve_no_wait(int device, size_t size, void *stream, void **out_ptr);

/**
 * Give a block back to the pool (not to the driver). NULL is accepted and does nothing.
 * A pointer the pool did not hand out, an interior pointer, or a second release fails with
 * `RM_ERROR_INVALID_POINTER` and changes nothing. The block is reusable at once on the stream it
 * was reserved for; elsewhere only after the work queued on every stream that used it.
 *
 * # Safety
 * None beyond passing a value: the pointer is looked up, never dereferenced.
 */
enum rm_status rm_release(void *ptr);

/**
 * Note that the live block at `ptr` is also used on `stream` (PyTorch's `record_stream`): its
 * release then waits for the work queued on `stream` before the block is reused.
 *
 * # Safety
 * None beyond passing values: the pointers are looked up, never dereferenced.
 */
enum rm_status rm_record_stream(void *ptr, void *stream);

/**
 * Return every idle cached segment to the driver (what `torch.cuda.empty_cache()` does), after
 * waiting for the device's queued work, which may still use released blocks. `device` -1
 * means every device. The bytes returned are stored in `*released_bytes` unless it is NULL.
 * The wait is made before the device's lock is taken, and idle segments go back in batches,
 * so other threads' calls on the device wait for one batch at most, never for the device's
 * work; blocks they release meanwhile may stay cached.
 *
 * # Safety
 * `released_bytes` is NULL or valid for writing a `size_t`.
 */
enum rm_status rm_free_reusable(int device, size_t *released_bytes);

/**
 * Make sure at least `bytes` of reusable memory is reserved on `device`, counting what is
 * already reusable first: only the shortfall is allocated, as one segment. Loading a model of
 * the same size again therefore reserves nothing new. With `RESMEM_CONF=share:true`, a
 * shortfall the driver cannot meet is asked of the other sharing processes, as in `rm_reserve`.
 *
 * # Safety
 * None: all arguments are values.
 */
enum rm_status rm_warmup(int device, size_t bytes);

/**
 * Fill `*out` with `device`'s figures. Reading them changes nothing (no later placement);
 * they are exact whenever no other call is in flight. Blocks waiting in a thread's front
 * cache count as reusable, not allocated.
 *
 * # Safety
 * `out` is NULL or valid for writing an `rm_stats`.
 */
enum rm_status rm_get_stats(int device, struct rm_stats *out);

/**
 * With `RESMEM_CONF=share:true`: `*given` is the bytes of idle cache this process returned
 * to the driver on `device` because other processes sharing the device asked, `*received`
 * the bytes they returned because this process asked. Zeros without sharing. (Separate from
 * `rm_stats`, whose layout the ABI promise keeps.)
 *
 * # Safety
 * `given` and `received` are NULL or valid for writing a `uint64_t`.
 */
enum rm_status rm_get_share_stats(int device, uint64_t *given, uint64_t *received);

/**
 * Set `device`'s peak figures to the current ones.
 *
 * # Safety
 * None: the argument is a value.
 */
enum rm_status rm_reset_peak_stats(int device);

/**
 * Cap what the pool may reserve on `device` at `bytes` (0: no cap; `device` -1: every device).
 * Idle cached memory above the cap goes back to the driver at once; a later `rm_reserve` that
 * would grow past the cap first returns idle cache, then fails with `RM_ERROR_OUT_OF_MEMORY`
 * naming the cap. This is what `torch.cuda.set_per_process_memory_fraction` sets.
 *
 * # Safety
 * None: all arguments are values.
 */
enum rm_status rm_set_memory_limit(int device, size_t bytes);

/**
 * Store `device`'s cap in `*bytes`: 0 when there is none.
 *
 * # Safety
 * `bytes` is NULL or valid for writing a `size_t`.
 */
enum rm_status rm_get_memory_limit(int device, size_t *bytes);

/**
 * This thread's last failure in words, prefixed with the function that failed; `""` if none.
 * The string stays valid until the next failing resmem call on this thread.
 */
const char *rm_last_error(void);

/**
 * The library's version, e.g. `"0.1.0"`; a static string.
 */
const char *rm_version(void);

/**
 * Allocate `size` bytes on `device` for use on `stream` (a `cudaStream_t`): PyTorch's
 * `alloc_fn`. Size 0 returns NULL, as PyTorch expects of an empty tensor. A negative size, or a
 * failure (out of memory, bad device, no driver), returns NULL with `rm_last_error()` saying why.
 *
 * # Safety
 * None beyond passing values: `stream` is handed to the driver, never dereferenced here.
 */
void *rm_torch_malloc(ssize_t size, int device, void *stream);

/**
 * Give back a block from [`rm_torch_malloc`]: PyTorch's `free_fn`. The pool knows the block's
 * size, device and stream, so those arguments are accepted for the signature's sake. NULL does
 * nothing; an unknown pointer leaves a message in `rm_last_error()` and changes nothing.
 *
 * # Safety
 * None beyond passing values: the pointer is looked up, never dereferenced.
 */
void rm_torch_free(void *ptr, ssize_t size, int device, void *stream);

/**
 * PyTorch's `init_fn`, called with the number of devices: starts the pool (loads the driver)
 * so that a missing driver shows up in `rm_last_error()` before the first allocation.
 *
 * # Safety
 * None: the argument is a value.
 */
void rm_torch_init(int device_count);

/**
 * PyTorch's `reset_fn`, which `torch.cuda.empty_cache()` calls: return every idle cached
 * segment on every device to the driver (`rm_free_reusable(-1, NULL)`).
 *
 * # Safety
 * None: there are no arguments.
 */
void rm_torch_empty_cache(void);

/**
 * PyTorch's `memory_fraction_fn`, which `torch.cuda.set_per_process_memory_fraction(fraction,
 * device)` calls: cap what the pool reserves on `device` at `fraction` of its total memory
 * (rounded down to a byte). Past the cap `rm_torch_malloc` fails with out-of-memory and a
 * message naming the cap. A fraction outside 0..=1 is refused and changes nothing.
 *
 * # Safety
 * None: all arguments are values.
 */
void rm_torch_set_memory_fraction(double fraction, int device);

/**
 * PyTorch's `record_stream_fn`, which `Tensor.record_stream(stream)` calls: the block at `ptr`
 * is also used on `stream`, so its reuse waits for that stream's work (`rm_record_stream`).
 *
 * # Safety
 * None beyond passing values: the pointers are looked up, never dereferenced.
 */
void rm_torch_record_stream(void *ptr, void *stream);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* RESMEM_H */

#ifndef RESMEM_H_STATUS_STRING
#define RESMEM_H_STATUS_STRING
#ifdef __cplusplus
extern "C" {
#endif

/**
 * A static description of a status code, never NULL (an unknown value is described as such).
 */
const char *rm_status_string(rm_status status);

#ifdef __cplusplus
}  /* extern "C" */
#endif
#endif  /* RESMEM_H_STATUS_STRING */
