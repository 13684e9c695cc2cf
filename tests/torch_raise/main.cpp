// Calls python/native/torch_raise.cpp's functions as PyTorch's CUDAPluggableAllocator does:
// through std::function objects made from the raw addresses, an exception caught by C++ above
// them, and the graph-pool hooks called as torch.cuda.graph calls them (a capture emulated by a
// filter that takes the default stream while `capturing` is set; and, on the simulated driver
// library, a capture the driver sees). Prints what happened, one line a case, for
// tests/torch_raise.rs to check.

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <thread>
#include <vector>
#include <sys/types.h>

#include "resmem.h"

#include "../../python/native/torch_raise.h"

namespace {

// PyTorch's hook types (its alloc and free types are torch_raise.h's), made from addresses as
// PyTorch makes them.
using BeginFn = void(int, graph_pools::MempoolId, std::function<bool(cudaStream_t)>);
using PoolFn = void(int, graph_pools::MempoolId);

unsigned long long allocated() {
    rm_stats stats{};
    rm_get_stats(0, &stats);
    return static_cast<unsigned long long>(stats.allocated_bytes);
}

void try_alloc(const char *what, const std::function<TorchAllocFn> &alloc, size_t size) {
    try {
        void *ptr = alloc(size, 0, nullptr);
        std::printf("%s: returned %s\n", what, ptr == nullptr ? "NULL" : "a block");
        if (ptr != nullptr) {
            rm_torch_raising_free(ptr, static_cast<ssize_t>(size), 0, nullptr);
        }
    } catch (const std::runtime_error &e) {
        std::printf("%s: threw: %s\n", what, e.what());
    }
}

// A capture the simulated driver sees, where resmem loads libcuda_sim.so as the driver
// (RESMEM_CUDA_LIBRARY): the same library, opened again, gives its streams and captures. A
// warm-up's 64 MiB block on stream `a`, its work still queued, is cached in the pool when stream `c`
// begins capturing; an allocation the capture takes must not order `c` after `a`'s work nor
// wait for the device (the driver refuses both, and the capture with them).
int real_capture(const std::function<TorchAllocFn> &alloc, const std::function<TorchFreeFn> &free) {
    const char *path = std::getenv("RESMEM_CUDA_LIBRARY");
    if (path == nullptr) {
        std::printf("real capture: no driver library\n");
        return 0;
    }
    void *driver = dlopen(path, RTLD_NOW);
    if (driver == nullptr) {
        std::printf("real capture: %s\n", dlerror());
        return 1;
    }
    using Retain = int (*)(void **, int);
    using SetCurrent = int (*)(void *);
    using StreamCreate = int (*)(cudaStream_t *, unsigned);
    using BeginCapture = int (*)(cudaStream_t, int);
    using EndCapture = int (*)(cudaStream_t, void **);
    using OnStream = int (*)(cudaStream_t);
    auto sym = [&](const char *name) { return dlsym(driver, name); };
    void *ctx = nullptr;
    cudaStream_t a = nullptr, c = nullptr;
    void *graph = nullptr;
    if (reinterpret_cast<Retain>(sym("cuDevicePrimaryCtxRetain"))(&ctx, 0) != 0 ||
        reinterpret_cast<SetCurrent>(sym("cuCtxSetCurrent"))(ctx) != 0 ||
        reinterpret_cast<StreamCreate>(sym("cuStreamCreate"))(&a, 0) != 0 ||
        reinterpret_cast<StreamCreate>(sym("cuStreamCreate"))(&c, 0) != 0) {
        std::printf("real capture: no streams\n");
        return 1;
    }
    const size_t MiB = size_t{1} << 20;
    // The warm-up on a thread of its own, which ends: its cached block goes back to the pool,
    // an idle segment of `a` (on this thread it would stay in this thread's cache).
    std::thread warm_up([&] {
        void *warm = alloc(64 * MiB, 0, a);
        reinterpret_cast<OnStream>(sym("cudasim_enqueue_work"))(a);
        free(warm, 64 * MiB, 0, a);
    });
    warm_up.join();
    // A tensor made before the capture, also used on `c`, and freed during it: its free waits
    // for the capture's end, where its event is recorded outside the capture.
    void *used = alloc(MiB, 0, a);
    rm_torch_record_stream(used, c);
    unsigned long long before = allocated();
    static cudaStream_t capturing = nullptr;
    capturing = c;
    const graph_pools::MempoolId pool{2, 0};
    rm_torch_raising_begin_allocate_to_pool(0, pool, [](cudaStream_t s) { return s == capturing; });
    int begun = reinterpret_cast<BeginCapture>(sym("cuStreamBeginCapture_v2"))(c, 0);
    const char *outcome = "allocated";
    void *block = nullptr;
    try {
        block = alloc(64 * MiB, 0, c);
    } catch (const std::runtime_error &e) {
        std::printf("real capture: threw: %s\n", e.what());
        outcome = "threw";
    }
    unsigned long long grown = allocated() - before;
    free(used, MiB, 0, a);
    rm_torch_raising_empty_cache();  // torch.cuda.empty_cache() during the capture: nothing
    int ended = reinterpret_cast<EndCapture>(sym("cuStreamEndCapture"))(c, &graph);
    rm_torch_raising_end_allocate_to_pool(0, pool);
    std::printf("real capture: begun %d, %s %llu MiB, ended %d\n", begun, outcome, grown / MiB,
                ended);
    // The next allocation asks after the freed tensor's event on `c`.
    try {
        void *next = alloc(MiB, 0, a);
        std::printf("after the capture: 1 MiB: returned a block\n");
        free(next, MiB, 0, a);
    } catch (const std::runtime_error &e) {
        std::printf("after the capture: 1 MiB: threw: %s\n", e.what());
    }
    rm_torch_raising_release_pool(0, pool);
    if (block != nullptr) {
        free(block, 64 * MiB, 0, c);
    }
    rm_torch_raising_empty_cache();
    std::printf("real capture released: allocated %llu\n", allocated());
    return 0;
}

}  // namespace

int main() {
    std::function<TorchAllocFn> alloc = reinterpret_cast<TorchAllocFn *>(&rm_torch_raising_malloc);
    std::function<TorchFreeFn> free = reinterpret_cast<TorchFreeFn *>(&rm_torch_raising_free);
    std::function<BeginFn> begin =
        reinterpret_cast<BeginFn *>(&rm_torch_raising_begin_allocate_to_pool);
    std::function<PoolFn> end = reinterpret_cast<PoolFn *>(&rm_torch_raising_end_allocate_to_pool);
    std::function<PoolFn> release = reinterpret_cast<PoolFn *>(&rm_torch_raising_release_pool);
    try_alloc("before init", alloc, 1 << 20);
    std::printf("init with NULL: %d\n",
                rm_torch_raising_init(nullptr, nullptr, nullptr, nullptr, nullptr));
    std::printf("init: %d\n",
                rm_torch_raising_init(reinterpret_cast<void *>(&rm_reserve),
                                      reinterpret_cast<void *>(&rm_torch_free),
                                      reinterpret_cast<void *>(&rm_last_error),
                                      reinterpret_cast<void *>(&rm_torch_empty_cache),
                                      reinterpret_cast<void *>(&rm_reserve_no_wait)));
    try_alloc("1 MiB", alloc, 1 << 20);
    try_alloc("0 bytes", alloc, 0);
    if (rm_set_memory_limit(0, size_t{64} << 20) != RM_SUCCESS) {
        return 1;
    }
    try_alloc("128 MiB past a 64 MiB cap", alloc, size_t{128} << 20);
    try_alloc("more than the address space", alloc, ~size_t{0});
    void *kept = alloc(size_t{32} << 20, 0, nullptr);
    std::printf("32 MiB kept: allocated %llu\n", allocated());
    free(kept, size_t{32} << 20, 0, nullptr);
    std::printf("freed: allocated %llu\n", allocated());
    rm_set_memory_limit(0, 0);

    // A graph: a capture into pool (1, 0) on the default stream.
    const size_t MiB = size_t{1} << 20;
    static bool capturing = false;
    const graph_pools::MempoolId pool{1, 0};
    begin(0, pool, [](cudaStream_t stream) { return capturing && stream == nullptr; });
    capturing = true;
    void *a = alloc(8 * MiB, 0, nullptr);
    free(a, 8 * MiB, 0, nullptr);
    std::printf("freed in the capture: allocated %llu\n", allocated());
    void *b = alloc(4 * MiB, 0, nullptr);
    std::printf("4 MiB in the capture: %s\n", b == a ? "the freed 8 MiB block" : "another");
    free(b, 4 * MiB, 0, nullptr);
    void *c = alloc(16 * MiB, 0, nullptr);
    capturing = false;
    end(0, pool);
    void *d = alloc(8 * MiB, 0, nullptr);
    std::printf("8 MiB after the capture: %s; allocated %llu\n",
                d == a ? "the graph's block" : "another block", allocated());
    free(d, 8 * MiB, 0, nullptr);
    free(c, 16 * MiB, 0, nullptr);  // the graph's output, dropped while the graph lives
    std::printf("the graph's output freed: allocated %llu\n", allocated());

    // Blocks not of the pool, made and freed while it lives, go back to resmem: those whose
    // free finds a zero in the filter, and one sharing the slot of the pool's 8 MiB block.
    std::vector<void *> others;
    bool shared = false;
    while (!shared && others.size() < 200000) {
        others.push_back(alloc(512, 0, nullptr));
        shared = graph_pools::filter_slot(others.back()) == graph_pools::filter_slot(a);
    }
    for (void *other : others) {
        free(other, 512, 0, nullptr);
    }
    std::printf("others freed: one in the 8 MiB block's slot: %s; allocated %llu\n",
                shared ? "yes" : "no", allocated());

    // A second graph sharing the pool.
    begin(0, pool, [](cudaStream_t stream) { return capturing && stream == nullptr; });
    capturing = true;
    void *e = alloc(12 * MiB, 0, nullptr);
    std::printf("12 MiB in the second capture: %s\n", e == c ? "the 16 MiB block" : "another");
    capturing = false;
    end(0, pool);
    release(0, pool);
    std::printf("one graph released: allocated %llu\n", allocated());
    release(0, pool);
    std::printf("both released: allocated %llu\n", allocated());
    free(e, 12 * MiB, 0, nullptr);
    std::printf("the last block freed: allocated %llu\n", allocated());
    rm_torch_raising_empty_cache();  // torch.cuda.empty_cache()
    std::printf("empty_cache: allocated %llu\n", allocated());
    void *f = alloc(8 * MiB, 0, nullptr);
    std::printf("8 MiB after: %s\n", f == a ? "the released block" : "another");
    free(f, 8 * MiB, 0, nullptr);
    return real_capture(alloc, free);
}
