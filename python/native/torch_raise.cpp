// libresmem_torch.so: the allocation functions resmem.torch.install() gives PyTorch.
//
// PyTorch does not check what a pluggable allocator's allocation function returns: a NULL
// becomes a tensor at address 0, and the first kernel that touches it faults, which ends the
// process's CUDA context. rm_torch_raising_malloc is rm_torch_malloc, but a failure throws
// std::runtime_error instead, which PyTorch lets through to Python as a RuntimeError (as it did
// for out-of-memory before torch.cuda.OutOfMemoryError): for RM_ERROR_OUT_OF_MEMORY, "CUDA out of
// memory. " before resmem's message, the words accelerate's find_executable_batch_size and
// similar retries look for. The program goes on, its CUDA context intact. It reserves through
// rm_reserve, rm_torch_malloc's own path with a status to tell an out-of-memory by.
//
// C++ because only C++ code may throw into PyTorch: it is built apart from libresmem.so (which
// stays free of the C++ runtime, for C programs) by the Python package's build (setup.py), and
// calls libresmem through the entry points rm_torch_raising_init is given, so that it uses
// whichever libresmem.so the package loaded. resmem.torch keeps rm_torch_malloc's NULL for
// resmem.torch.pool(): PyTorch's caching allocator checks it there, and on a NULL returns its
// own cache and tries again before it raises.

#include <stdexcept>
#include <string>
#include <sys/types.h>

#include "resmem.h"

namespace {

using Reserve = rm_status (*)(int device, size_t size, void *stream, void **out_ptr);
using Free = void (*)(void *ptr, ssize_t size, int device, void *stream);
using LastError = const char *(*)();

Reserve reserve_fn = nullptr;
Free free_fn = nullptr;
LastError last_error_fn = nullptr;

const char *const NOT_SET_UP =
    "resmem: libresmem_torch.so was called before rm_torch_raising_init gave it libresmem's "
    "entry points; let resmem.torch.install() set it up";

}  // namespace

extern "C" {

// libresmem's rm_reserve, rm_torch_free and rm_last_error, given once by resmem.torch before
// PyTorch gets the functions below. Returns 0, or -1 (nothing changed) if one is NULL.
int rm_torch_raising_init(void *reserve, void *free, void *last_error) {
    if (reserve == nullptr || free == nullptr || last_error == nullptr) {
        return -1;
    }
    reserve_fn = reinterpret_cast<Reserve>(reserve);
    free_fn = reinterpret_cast<Free>(free);
    last_error_fn = reinterpret_cast<LastError>(last_error);
    return 0;
}

// PyTorch's alloc_fn (whose size is a size_t): a block from rm_reserve, a failure thrown as
// std::runtime_error (size 0 still returns NULL, as PyTorch expects of an empty tensor).
void *rm_torch_raising_malloc(size_t size, int device, void *stream) {
    if (reserve_fn == nullptr) {
        throw std::runtime_error(NOT_SET_UP);
    }
    void *ptr = nullptr;
    rm_status status = reserve_fn(device, size, stream, &ptr);
    if (status == RM_SUCCESS) {
        return ptr;
    }
    const char *why = last_error_fn();
    std::string message = std::string("resmem: ") + (why == nullptr ? "" : why);
    if (status == RM_ERROR_OUT_OF_MEMORY) {
        message = "CUDA out of memory. " + message;
    }
    throw std::runtime_error(message);
}

// PyTorch's free_fn: rm_torch_free (PyTorch takes both functions from one library).
void rm_torch_raising_free(void *ptr, ssize_t size, int device, void *stream) {
    if (free_fn != nullptr) {
        free_fn(ptr, size, device, stream);
    }
}

}  // extern "C"
