// The private pools of CUDA graphs captured under resmem.torch.install().
//
// A graph replays the kernels it captured on the addresses they used, so memory freed during a
// capture must not go to other tensors while the graph lives. PyTorch's own allocator keeps a
// private pool per graph; for a pluggable allocator it only calls three hooks
// (beginAllocateToPool, endAllocateToPool, releasePool) and leaves the rest to it. This keeps
// PyTorch's rules: while a capture into a pool is under way on a device, the allocations its
// filter takes (those on the capturing stream) belong to the pool; a block of a pool, once freed,
// stays in it (a later allocation of the same pool may take it: the graph's own order makes that
// safe), whether freed during the capture or after it. When the last graph using the pool is
// released, its blocks are *retired*, the free ones at once and the live ones when freed: the
// graph's last replay may still be running, on a stream resmem never saw, so they go back to
// resmem only at the next empty_cache, before resmem waits for the device's work there (as
// PyTorch frees a released pool's blocks only at empty_cache, after a synchronization). Blocks
// are taken whole (the smallest free one that holds the request), not split as PyTorch's are.
//
// While a capture is under way, a free of a block not of a pool is held until no capture is:
// released then, it could record an event on the capturing stream (see defer_free).
//
// No lock is taken where no pool exists (any() is one atomic load), nor by an allocation while
// no capture is under way (capture_under_way()). While a pool exists, a free reads one counter
// of a filter: how many blocks of pools have addresses that hash to its slot. Zero (any block
// not of a pool, save a few that share a slot with one) and it is not a pool's, found without
// a lock, so that frees on several threads do not wait for each other.

#include "graph_pools.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>

namespace graph_pools {

namespace {

struct Capture {
    int device;
    MempoolId pool;
    Filter filter;
};

struct Pool {
    int users = 0;
    // Free blocks by size.
    std::multimap<std::size_t, void *> free;
};

struct Owner {
    MempoolId pool;
    std::size_t size;
};

std::mutex lock;
std::vector<Capture> captures;
std::map<MempoolId, Pool> pools;
// Every block of a pool still in use, live or free, with its pool and size.
std::unordered_map<void *, Owner> owners;
// Blocks of released pools, free, for resmem at the next empty_cache.
std::vector<void *> retired;
// Frees of blocks not of a pool, made while a capture was under way, held until none is.
std::vector<Free> deferred;

// The filter: for each slot, how many entries of `owners` hash to it. Changed under the lock
// with every entry; read without it. A block's entry is made before its allocation returns, so
// its free, which comes after, reads at least its own count.
constexpr int FILTER_BITS = 14;
std::atomic<std::uint32_t> filter[std::size_t{1} << FILTER_BITS];

std::atomic<std::uint32_t> &slot_of(void *ptr) { return filter[filter_slot(ptr)]; }

// Under the lock: a block's entry taken out of `owners`, with its count.
void disown(std::unordered_map<void *, Owner>::iterator owner) {
    slot_of(owner->first).fetch_sub(1, std::memory_order_relaxed);
    owners.erase(owner);
}

void update_exists() {
    exists.store(!captures.empty() || !owners.empty() || !pools.empty() || !retired.empty());
    captures_under_way.store(!captures.empty());
}

Pool *find_pool(MempoolId pool) {
    auto it = pools.find(pool);
    return it == pools.end() ? nullptr : &it->second;
}

}  // namespace

std::size_t filter_slot(void *ptr) {
    // Blocks are 512-byte aligned; the bits above that, mixed, pick the slot.
    auto bits = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(ptr) >> 9);
    return (bits * 0x9E3779B97F4A7C15ull) >> (64 - FILTER_BITS);
}

std::atomic<bool> exists{false};
std::atomic<bool> captures_under_way{false};

void begin(int device, MempoolId pool, Filter filter) {
    std::lock_guard<std::mutex> guard(lock);
    pools[pool].users += 1;
    captures.push_back({device, pool, std::move(filter)});
    update_exists();
}

void end(int device, MempoolId pool) {
    std::lock_guard<std::mutex> guard(lock);
    auto it = std::find_if(captures.begin(), captures.end(), [&](const Capture &c) {
        return c.device == device && c.pool == pool;
    });
    if (it != captures.end()) {
        captures.erase(it);
    }
    update_exists();
}

bool capturing(int device, cudaStream_t stream, MempoolId *pool) {
    std::lock_guard<std::mutex> guard(lock);
    for (const Capture &c : captures) {
        if (c.device == device && c.filter && c.filter(stream)) {
            *pool = c.pool;
            return true;
        }
    }
    return false;
}

void *reuse(MempoolId pool, std::size_t size) {
    std::lock_guard<std::mutex> guard(lock);
    Pool *p = find_pool(pool);
    if (p == nullptr) {
        return nullptr;
    }
    auto it = p->free.lower_bound(size);
    if (it == p->free.end()) {
        return nullptr;
    }
    void *ptr = it->second;
    p->free.erase(it);
    return ptr;
}

void adopt(MempoolId pool, void *ptr, std::size_t size) {
    std::lock_guard<std::mutex> guard(lock);
    if (owners.insert_or_assign(ptr, Owner{pool, size}).second) {
        slot_of(ptr).fetch_add(1, std::memory_order_relaxed);
    }
    update_exists();
}

bool keep(void *ptr) {
    if (slot_of(ptr).load(std::memory_order_relaxed) == 0) {
        return false;
    }
    std::lock_guard<std::mutex> guard(lock);
    auto owner = owners.find(ptr);
    if (owner == owners.end()) {
        return false;
    }
    Pool *p = find_pool(owner->second.pool);
    if (p == nullptr) {
        // Its pool was released while it lived.
        retired.push_back(ptr);
        disown(owner);
    } else {
        p->free.emplace(owner->second.size, ptr);
    }
    return true;
}

void release(MempoolId pool) {
    std::lock_guard<std::mutex> guard(lock);
    auto it = pools.find(pool);
    if (it == pools.end() || --it->second.users > 0) {
        return;
    }
    for (const auto &block : it->second.free) {
        retired.push_back(block.second);
        auto owner = owners.find(block.second);
        if (owner != owners.end()) {
            disown(owner);
        }
    }
    pools.erase(it);
    update_exists();
}

bool defer_free(const Free &free) {
    std::lock_guard<std::mutex> guard(lock);
    if (captures.empty()) {
        return false;
    }
    deferred.push_back(free);
    return true;
}

std::vector<Free> take_deferred() {
    std::lock_guard<std::mutex> guard(lock);
    std::vector<Free> taken;
    if (captures.empty()) {
        taken.swap(deferred);
    }
    return taken;
}

std::vector<void *> take_retired() {
    std::lock_guard<std::mutex> guard(lock);
    std::vector<void *> taken;
    taken.swap(retired);
    update_exists();
    return taken;
}

namespace {

// CUstreamCaptureMode's CU_STREAM_CAPTURE_MODE_RELAXED.
constexpr int RELAXED = 2;
using Exchange = int (*)(int *mode);

// The driver's cuThreadExchangeStreamCaptureMode, where the process has libcuda.so.1 loaded
// (PyTorch's CUDA runtime loads it); nothing is loaded here.
Exchange exchange_fn() {
    static const Exchange exchange = []() -> Exchange {
        void *driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (driver == nullptr) {
            return nullptr;
        }
        return reinterpret_cast<Exchange>(dlsym(driver, "cuThreadExchangeStreamCaptureMode"));
    }();
    return exchange;
}

}  // namespace

RelaxedCapture::RelaxedCapture() : mode_(RELAXED), set_(false) {
    if (Exchange exchange = exchange_fn()) {
        set_ = exchange(&mode_) == 0;
    }
}

RelaxedCapture::~RelaxedCapture() {
    if (set_) {
        exchange_fn()(&mode_);
    }
}

}  // namespace graph_pools
