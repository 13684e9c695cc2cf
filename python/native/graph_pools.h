// The private pools of CUDA graphs captured under resmem.torch.install(), as PyTorch's own
// allocator keeps them (see graph_pools.cpp).

#ifndef RESMEM_GRAPH_POOLS_H
#define RESMEM_GRAPH_POOLS_H

#include <atomic>
#include <cstddef>
#include <functional>
#include <sys/types.h>
#include <utility>
#include <vector>

struct CUstream_st;
// As the CUDA runtime's headers declare it, so that the filter below is PyTorch's own type.
typedef CUstream_st *cudaStream_t;

namespace graph_pools {

// c10::cuda::MempoolId_t: a graph pool's id.
using MempoolId = std::pair<unsigned long long, unsigned long long>;
// Whether an allocation on a stream belongs to the capture (PyTorch's filter).
using Filter = std::function<bool(cudaStream_t)>;

// Whether any graph pool, capture or block of a pool exists, and whether a capture is under way
// (kept by graph_pools.cpp).
extern std::atomic<bool> exists;
extern std::atomic<bool> captures_under_way;

// Whether any graph pool, capture or block of a pool exists: one atomic load, inlined into the
// free function's fast path.
inline bool any() { return exists.load(std::memory_order_relaxed); }

// Whether a capture is under way on any device: one atomic load, inlined into the allocation
// function's fast path (graphs that live on after their capture cost allocations nothing).
inline bool capture_under_way() { return captures_under_way.load(std::memory_order_relaxed); }

// A capture into `pool` begins on `device`: allocations there that its filter takes belong to
// the pool, which lives until as many release() as begin() calls.
void begin(int device, MempoolId pool, Filter filter);

// The capture into `pool` on `device` ends: its pool keeps its blocks.
void end(int device, MempoolId pool);

// The pool an allocation on `stream` of `device` belongs to: that of the first capture under
// way on the device whose filter takes the stream, as PyTorch picks. False where none does.
bool capturing(int device, cudaStream_t stream, MempoolId *pool);

// The smallest freed block of `pool` that holds `size` bytes, taken out of its free blocks,
// or NULL.
void *reuse(MempoolId pool, std::size_t size);

// `ptr`, of `size` bytes, newly reserved for `pool`.
void adopt(MempoolId pool, void *ptr, std::size_t size);

// Whether `ptr` belongs to a graph pool, in use or released: if so it stays there, free for
// the pool's later allocations (its graph still uses the memory on every replay), or retired
// where its pool was released; the caller does not give it back to resmem.
bool keep(void *ptr);

// One graph using `pool` is gone: where none is left, its free blocks are retired, and its live
// ones when freed. (PyTorch's pool ids are unique across devices.)
void release(MempoolId pool);

// The retired blocks, for the caller to give back to resmem before resmem waits for the
// device's work (at empty_cache): the last replay of their graph may still be running.
std::vector<void *> take_retired();

// A free, as PyTorch passes it.
struct Free {
    void *ptr;
    ssize_t size;
    int device;
    cudaStream_t stream;
};

// Hold `free`, of a block not of a pool, while a capture is under way: releasing it then would
// record events on the streams that used it (`record_stream`), one of which may be capturing,
// and an event recorded in a capture cannot be asked after once it ends (PyTorch's allocator
// defers such events until no capture is under way). False where no capture is under way: the
// caller frees it now.
bool defer_free(const Free &free);

// The frees held, for the caller to make, once no capture is under way (at a capture's end,
// which PyTorch signals after the driver ended it); none while one is.
std::vector<Free> take_deferred();

// The slot of the free's filter that `ptr` hashes to (for tests: a block not of a pool that
// shares a slot with one is looked up under the lock, and still not kept).
std::size_t filter_slot(void *ptr);

// The calling thread in CUDA's relaxed stream-capture mode while it lives, where the process
// has the driver loaded (PyTorch's allocator makes its driver calls during a capture so): the
// driver calls that make memory are then allowed while another stream captures.
class RelaxedCapture {
  public:
    RelaxedCapture();
    ~RelaxedCapture();
    RelaxedCapture(const RelaxedCapture &) = delete;
    RelaxedCapture &operator=(const RelaxedCapture &) = delete;

  private:
    int mode_;
    bool set_;
};

}  // namespace graph_pools

#endif
