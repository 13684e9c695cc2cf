// libresmem_torch.so: the functions resmem.torch.install() gives PyTorch.
//
// PyTorch does not check what a pluggable allocator's allocation function returns: a NULL
// becomes a tensor at address 0, and the first kernel that touches it faults, which ends the
// process's CUDA context. rm_torch_raising_malloc reserves from libresmem but throws a failure
// as std::runtime_error instead, which PyTorch lets through to Python as a RuntimeError (as it
// did for out-of-memory before torch.cuda.OutOfMemoryError): for RM_ERROR_OUT_OF_MEMORY, "CUDA
// out of memory. " before resmem's message, the words accelerate's find_executable_batch_size
// and similar retries look for. The program goes on, its CUDA context intact. It reserves
// through rm_reserve, rm_torch_malloc's own path with a status to tell an out-of-memory by.
//
// And PyTorch keeps no private pool for a graph captured with a pluggable allocator unless the
// allocator answers its three pool hooks: the rm_torch_raising_*_pool functions below do, with
// graph_pools.cpp, so that a graph's memory is not handed to other tensors while it lives.
//
// C++ because only C++ may throw into PyTorch, and take PyTorch's std::function filter: it is
// built apart from libresmem.so (which stays free of the C++ runtime, for C programs) by the
// Python package's build (setup.py), and calls libresmem through the entry points
// rm_torch_raising_init is given, so that it uses whichever libresmem.so the package loaded.
// resmem.torch keeps rm_torch_malloc's NULL for resmem.torch.pool(): PyTorch's caching allocator
// checks it there, and on a NULL returns its own cache and tries again before it raises.

#include <stdexcept>
#include <string>
#include <sys/types.h>

#include "resmem.h"
#include "torch_raise.h"

// The library's interface; everything else is hidden (built with -fvisibility=hidden).
#define RM_TORCH_EXPORT __attribute__((visibility("default")))

namespace {

using Reserve = rm_status (*)(int device, size_t size, void *stream, void **out_ptr);
using Free = void (*)(void *ptr, ssize_t size, int device, void *stream);
using LastError = const char *(*)();
using EmptyCache = void (*)();

Reserve reserve_fn = nullptr;
Reserve reserve_no_wait_fn = nullptr;
Free free_fn = nullptr;
LastError last_error_fn = nullptr;
EmptyCache empty_cache_fn = nullptr;

const char *const NOT_SET_UP =
    "resmem: libresmem_torch.so was called before rm_torch_raising_init gave it libresmem's "
    "entry points; let resmem.torch.install() set it up";

// The failure of an rm_reserve that returned `status`, thrown (apart from the hit path).
[[noreturn]] __attribute__((noinline, cold)) void fail(rm_status status) {
    const char *why = last_error_fn();
    std::string message = std::string("resmem: ") + (why == nullptr ? "" : why);
    if (status == RM_ERROR_OUT_OF_MEMORY) {
        message = "CUDA out of memory. " + message;
    }
    throw std::runtime_error(message);
}

// A block from `reserve_with` (rm_reserve or rm_reserve_no_wait), a failure thrown.
inline void *reserve(Reserve reserve_with, std::size_t size, int device, void *stream) {
    void *ptr = nullptr;
    rm_status status = reserve_with(device, size, stream, &ptr);
    if (__builtin_expect(status != RM_SUCCESS, 0)) {
        fail(status);
    }
    return ptr;
}

// An allocation while a capture is under way: rm_reserve_no_wait, which never waits for the
// device's work or orders the stream after another's (the driver refuses both during a capture
// and invalidates it), in CUDA's relaxed capture mode, where the driver makes memory during a
// capture (as PyTorch's own allocator makes it). From the graph's pool first where the capture
// takes it (`pool` not null).
__attribute__((noinline)) void *capture_alloc(const graph_pools::MempoolId *pool,
                                              std::size_t size, int device, void *stream) {
    if (pool != nullptr) {
        if (void *ptr = graph_pools::reuse(*pool, size)) {
            return ptr;
        }
    }
    void *ptr;
    {
        graph_pools::RelaxedCapture relaxed;
        ptr = reserve(reserve_no_wait_fn, size, device, stream);
    }
    if (pool != nullptr) {
        graph_pools::adopt(*pool, ptr, size);
    }
    return ptr;
}

}  // namespace

extern "C" {

// libresmem's rm_reserve, rm_torch_free, rm_last_error, rm_torch_empty_cache and
// rm_reserve_no_wait, given once by resmem.torch before PyTorch gets the functions below.
// Returns 0, or -1 (nothing changed) if one is NULL.
RM_TORCH_EXPORT int rm_torch_raising_init(void *reserve, void *free, void *last_error,
                                          void *empty_cache, void *reserve_no_wait) {
    if (reserve == nullptr || free == nullptr || last_error == nullptr ||
        empty_cache == nullptr || reserve_no_wait == nullptr) {
        return -1;
    }
    reserve_fn = reinterpret_cast<Reserve>(reserve);
    reserve_no_wait_fn = reinterpret_cast<Reserve>(reserve_no_wait);
    free_fn = reinterpret_cast<Free>(free);
    last_error_fn = reinterpret_cast<LastError>(last_error);
    empty_cache_fn = reinterpret_cast<EmptyCache>(empty_cache);
    return 0;
}

// PyTorch's alloc_fn (whose size is a size_t): a block from rm_reserve, a failure thrown as
// std::runtime_error (size 0 still returns NULL, as PyTorch expects of an empty tensor). While
// a capture is under way, from rm_reserve_no_wait, and an allocation the capture takes from its
// graph's pool.
RM_TORCH_EXPORT void *rm_torch_raising_malloc(std::size_t size, int device, cudaStream_t stream) {
    if (reserve_fn == nullptr) {
        throw std::runtime_error(NOT_SET_UP);
    }
    if (__builtin_expect(graph_pools::capture_under_way(), 0) && size > 0) {
        graph_pools::MempoolId pool;
        bool taken = graph_pools::capturing(device, stream, &pool);
        return capture_alloc(taken ? &pool : nullptr, size, device, stream);
    }
    return reserve(reserve_fn, size, device, stream);
}

// PyTorch's free_fn: rm_torch_free, but a block of a graph's pool stays in the pool, and the
// free of another block while a capture is under way waits for its end.
RM_TORCH_EXPORT void rm_torch_raising_free(void *ptr, ssize_t size, int device, cudaStream_t stream) {
    if (free_fn == nullptr || (__builtin_expect(graph_pools::any(), 0) && graph_pools::keep(ptr))) {
        return;
    }
    if (__builtin_expect(graph_pools::capture_under_way(), 0) &&
        graph_pools::defer_free({ptr, size, device, stream})) {
        return;
    }
    free_fn(ptr, size, device, stream);
}

// PyTorch's begin_allocate_to_pool hook (torch.cuda.graph's capture_begin, before the capture
// starts): allocations on `device` that `filter` takes belong to `pool` from now on.
RM_TORCH_EXPORT void rm_torch_raising_begin_allocate_to_pool(int device,
                                                             graph_pools::MempoolId pool,
                                                             graph_pools::Filter filter) {
    graph_pools::begin(device, pool, std::move(filter));
}

// PyTorch's end_allocate_to_pool hook (the capture has ended): `pool` keeps its blocks.
RM_TORCH_EXPORT void rm_torch_raising_end_allocate_to_pool(int device, graph_pools::MempoolId pool) {
    graph_pools::end(device, pool);
    // PyTorch ends the allocations after the driver ended the capture: where it was the last,
    // the frees held during it are made.
    for (const graph_pools::Free &f : graph_pools::take_deferred()) {
        free_fn(f.ptr, f.size, f.device, f.stream);
    }
}

// PyTorch's release_pool hook (a graph using `pool` is reset or destroyed): where no graph uses
// the pool any more, its blocks are retired, for resmem at the next empty_cache.
RM_TORCH_EXPORT void rm_torch_raising_release_pool(int device, graph_pools::MempoolId pool) {
    (void)device;
    graph_pools::release(pool);
}

// PyTorch's reset_fn (torch.cuda.empty_cache()): the retired blocks of released graph pools back
// to resmem, then rm_torch_empty_cache, which waits for the device's work before it lets any
// of them be used again or returns memory to the driver. Nothing while a capture is under way:
// the driver refuses that wait during a capture, and the refusal would end the capture.
RM_TORCH_EXPORT void rm_torch_raising_empty_cache() {
    if (empty_cache_fn == nullptr || graph_pools::capture_under_way()) {
        return;
    }
    if (graph_pools::any()) {
        for (void *ptr : graph_pools::take_retired()) {
            free_fn(ptr, 0, 0, nullptr);
        }
    }
    empty_cache_fn();
}

}  // extern "C"
