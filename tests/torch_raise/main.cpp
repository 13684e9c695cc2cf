// Calls python/native/torch_raise.cpp's functions as PyTorch's CUDAPluggableAllocator does:
// through a std::function made from the raw address, the exception caught by C++ above it.
// Prints what happened, one line a case, for tests/torch_raise.rs to check.

#include <cstdio>
#include <functional>
#include <stdexcept>
#include <sys/types.h>

#include "resmem.h"

extern "C" {
int rm_torch_raising_init(void *malloc, void *free, void *last_error);
void *rm_torch_raising_malloc(size_t size, int device, void *stream);
void rm_torch_raising_free(void *ptr, ssize_t size, int device, void *stream);
}

namespace {

// PyTorch's alloc_fn type, made from an address as PyTorch makes it.
using AllocFn = void *(size_t, int, void *);
using FreeFn = void(void *, size_t, int, void *);

void try_alloc(const char *what, const std::function<AllocFn> &alloc, size_t size) {
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

}  // namespace

int main() {
    std::function<AllocFn> alloc = reinterpret_cast<AllocFn *>(&rm_torch_raising_malloc);
    std::function<FreeFn> free = reinterpret_cast<FreeFn *>(&rm_torch_raising_free);
    try_alloc("before init", alloc, 1 << 20);
    std::printf("init with NULL: %d\n", rm_torch_raising_init(nullptr, nullptr, nullptr));
    std::printf("init: %d\n",
                rm_torch_raising_init(reinterpret_cast<void *>(&rm_reserve),
                                      reinterpret_cast<void *>(&rm_torch_free),
                                      reinterpret_cast<void *>(&rm_last_error)));
    try_alloc("1 MiB", alloc, 1 << 20);
    try_alloc("0 bytes", alloc, 0);
    if (rm_set_memory_limit(0, size_t{64} << 20) != RM_SUCCESS) {
        return 1;
    }
    try_alloc("128 MiB past a 64 MiB cap", alloc, size_t{128} << 20);
    try_alloc("more than the address space", alloc, ~size_t{0});
    void *kept = alloc(size_t{32} << 20, 0, nullptr);
    rm_stats stats{};
    rm_get_stats(0, &stats);
    std::printf("32 MiB kept: allocated %llu\n",
                static_cast<unsigned long long>(stats.allocated_bytes));
    free(kept, size_t{32} << 20, 0, nullptr);
    rm_get_stats(0, &stats);
    std::printf("freed: allocated %llu\n", static_cast<unsigned long long>(stats.allocated_bytes));
    return 0;
}
