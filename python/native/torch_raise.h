// libresmem_torch.so's interface (torch_raise.cpp): the functions resmem.torch.install() gives
// PyTorch. Included by torch_raise.cpp, so that these declarations are checked against the
// definitions, and by the programs that call them as PyTorch does (tests/torch_raise/main.cpp,
// benches/c/torch_pairs.cpp).

#ifndef RESMEM_TORCH_RAISE_H
#define RESMEM_TORCH_RAISE_H

#include <cstddef>
#include <sys/types.h>

#include "graph_pools.h"

// The types PyTorch casts the allocation and free functions to.
using TorchAllocFn = void *(std::size_t, int, cudaStream_t);
using TorchFreeFn = void(void *, std::size_t, int, cudaStream_t);

extern "C" {
int rm_torch_raising_init(void *reserve, void *free, void *last_error, void *empty_cache,
                          void *reserve_no_wait);
void *rm_torch_raising_malloc(std::size_t size, int device, cudaStream_t stream);
void rm_torch_raising_free(void *ptr, ssize_t size, int device, cudaStream_t stream);
void rm_torch_raising_begin_allocate_to_pool(int device, graph_pools::MempoolId pool,
                                             graph_pools::Filter filter);
void rm_torch_raising_end_allocate_to_pool(int device, graph_pools::MempoolId pool);
void rm_torch_raising_release_pool(int device, graph_pools::MempoolId pool);
void rm_torch_raising_empty_cache();
}

#endif
