// Cache-hit allocation + free pairs as PyTorch makes them under resmem.torch.install(): through
// std::function objects made from the raw addresses, as CUDAPluggableAllocator holds them. Three
// ways in the same run, in alternating rounds: libresmem_torch.so's functions (what install()
// gives PyTorch: python/native/torch_raise.cpp, compiled into this program, over rm_reserve),
// the same once a captured graph's pool exists (`graph_alive`), libresmem.so's rm_torch_malloc
// and rm_torch_free directly (what it gave before, and what pool() gives), and glibc's malloc
// and free behind the same std::function.
//
//   scripts/bench-torch.sh     (builds the release library, compiles this, runs it)
//
// Prints `torch_pair <way> <size> <ns per pair>`: for each way and size, the median over ROUNDS
// (default 9) rounds of PAIRS (default 2,000,000) pairs on one thread, the default stream; the
// graph_alive pair again on two threads at once (`_2_threads`: ns per pair on each).

#include <sys/types.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "resmem.h"

#include "../../python/native/torch_raise.h"

namespace {

// glibc behind PyTorch's function types.
void *glibc_alloc(size_t size, int, cudaStream_t) { return std::malloc(size); }
void glibc_free(void *ptr, size_t, int, cudaStream_t) { std::free(ptr); }

double now_ns() {
    timespec t{};
    clock_gettime(CLOCK_MONOTONIC, &t);
    return double(t.tv_sec) * 1e9 + double(t.tv_nsec);
}

struct Way {
    const char *name;
    std::function<TorchAllocFn> alloc;
    std::function<TorchFreeFn> free;
};

void run_pairs(const Way &way, size_t size, long pairs) {
    for (long i = 0; i < pairs; i++) {
        void *ptr = way.alloc(size, 0, nullptr);
        if (ptr == nullptr) {
            std::fprintf(stderr, "%s: %zu bytes failed: %s\n", way.name, size, rm_last_error());
            std::exit(1);
        }
        way.free(ptr, size, 0, nullptr);
    }
}

// Nanoseconds per pair on each of `threads` threads, each making `pairs` pairs at once (the
// wall time over `pairs`: a thread's figure where they do not wait for each other).
double pairs_ns(const Way &way, size_t size, long pairs, int threads) {
    double start = now_ns();
    std::vector<std::thread> others;
    for (int t = 1; t < threads; t++) {
        others.emplace_back(run_pairs, std::cref(way), size, pairs);
    }
    run_pairs(way, size, pairs);
    for (auto &other : others) {
        other.join();
    }
    return (now_ns() - start) / double(pairs);
}

}  // namespace

int main() {
    const long pairs = std::getenv("PAIRS") ? std::atol(std::getenv("PAIRS")) : 2000000;
    const int rounds = std::getenv("ROUNDS") ? std::atoi(std::getenv("ROUNDS")) : 9;
    if (rm_torch_raising_init(reinterpret_cast<void *>(&rm_reserve),
                              reinterpret_cast<void *>(&rm_torch_free),
                              reinterpret_cast<void *>(&rm_last_error),
                              reinterpret_cast<void *>(&rm_torch_empty_cache),
                              reinterpret_cast<void *>(&rm_reserve_no_wait)) != 0) {
        return 1;
    }
    std::vector<Way> ways = {
        {"libresmem_torch", reinterpret_cast<TorchAllocFn *>(&rm_torch_raising_malloc),
         reinterpret_cast<TorchFreeFn *>(&rm_torch_raising_free)},
        {"rm_torch_malloc", reinterpret_cast<TorchAllocFn *>(&rm_torch_malloc),
         reinterpret_cast<TorchFreeFn *>(&rm_torch_free)},
        {"glibc", &glibc_alloc, &glibc_free},
    };
    // Each way and size: the median of `rounds` rounds, the ways alternating.
    auto measure = [&](const std::vector<Way> &measured, int threads) {
        for (size_t size : {size_t{512}, size_t{64} << 10, size_t{4} << 20}) {
            std::vector<std::vector<double>> times(measured.size());
            for (const auto &way : measured) {
                pairs_ns(way, size, pairs / 10, threads);  // warm: the front caches hold blocks
            }
            for (int round = 0; round < rounds; round++) {
                for (size_t w = 0; w < measured.size(); w++) {
                    times[w].push_back(pairs_ns(measured[w], size, pairs, threads));
                }
            }
            for (size_t w = 0; w < measured.size(); w++) {
                std::sort(times[w].begin(), times[w].end());
                std::printf("torch_pair %s%s %zu %.2f\n", measured[w].name,
                            threads > 1 ? "_2_threads" : "", size, times[w][times[w].size() / 2]);
            }
        }
    };
    measure(ways, 1);
    // Then once a captured graph lives on (its pool holds a block), as in a server that captured
    // its graphs at start: each free looks the block up. Beside rm_torch_malloc again.
    const graph_pools::MempoolId pool{1, 0};
    static bool in_capture = false;
    rm_torch_raising_begin_allocate_to_pool(0, pool, [](cudaStream_t) { return in_capture; });
    in_capture = true;
    ways[0].alloc(1 << 20, 0, nullptr);
    in_capture = false;
    rm_torch_raising_end_allocate_to_pool(0, pool);
    const std::vector<Way> graph_ways = {{"graph_alive", ways[0].alloc, ways[0].free},
                                         {"rm_torch_malloc_again", ways[1].alloc, ways[1].free}};
    measure(graph_ways, 1);
    // And on two threads at once (each its own front cache): their frees look blocks up in the
    // graph pools' maps at the same time.
    measure(graph_ways, 2);
    return 0;
}
