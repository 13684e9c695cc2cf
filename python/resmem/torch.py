"""resmem as PyTorch's CUDA allocator: for the whole program (``install()``), or for part of it
through ``torch.cuda.MemPool`` (``pool()``).

For the whole program, call ``resmem.torch.install()`` before the first CUDA allocation::

    import torch, resmem.torch
    resmem.torch.install()
    x = torch.empty(1 << 20, device="cuda")      # from resmem's pool
    torch.cuda.memory_reserved()                 # resmem's figures, under PyTorch's names

What it does:

- makes resmem the allocator (``torch.cuda.memory.CUDAPluggableAllocator``, then
  ``change_current_allocator``) through the package's ``libresmem_torch.so``: its allocation
  function reserves from ``libresmem.so`` and throws a failure for PyTorch to raise
  (``RuntimeError``; "CUDA out of memory. " and resmem's message for an out-of-memory, the text
  accelerate's batch-size retries look for) instead of the NULL PyTorch does not check (a tensor
  at address 0, whose first kernel ends the process's CUDA context). A package built without a
  C++ compiler lacks it: ``install()`` then warns and uses ``rm_torch_malloc``'s NULL;
- wires the allocator's hooks: ``torch.cuda.empty_cache()`` returns idle cache to the driver,
  ``torch.cuda.set_per_process_memory_fraction()`` caps the pool (an out-of-memory past the cap
  names it), ``Tensor.record_stream()`` reaches ``rm_record_stream``;
- makes ``torch.cuda.memory_stats``, ``memory_allocated``, ``memory_reserved``,
  ``max_memory_allocated``, ``max_memory_reserved`` and ``reset_peak_memory_stats`` report
  resmem's figures under PyTorch's key names (for a pluggable allocator PyTorch raises there),
  and ``memory_summary`` print them in its layout (PyTorch's would fail on the keys resmem
  does not keep: per-pool splits, totals allocated and freed);
- wires PyTorch's CUDA graph hooks (PyTorch 2.3 and later) to ``libresmem_torch.so``, which
  keeps each graph's private pool as PyTorch's own allocator does: while a capture runs, the
  allocations it takes belong to its graph's pool; a block of the pool, freed, stays there for
  the pool's later allocations (the graph writes to it on every replay) until the last graph
  using the pool is released and ``torch.cuda.empty_cache()`` runs (blocks reused whole, not
  split; README, "CUDA graphs", for the limits). While a capture is under way, allocations go
  through ``rm_reserve_no_wait``, which makes none of the waits the driver refuses during a
  capture. Without them (no ``libresmem_torch.so``, or
  an older PyTorch) ``torch.cuda.CUDAGraph.capture_begin`` raises ``RuntimeError`` instead: a
  tensor freed during the capture would go back to resmem's cache, be handed to a tensor made
  after it, and be written over by every replay.

``torch.cuda.mem_get_info`` keeps PyTorch's documented meaning, the driver's view, by default:
transformers already adds ``memory_reserved() - memory_allocated()`` to it when it plans a
load, and would count reusable memory twice if ``mem_get_info`` counted it too. For stacks that
read only ``mem_get_info`` (plain accelerate ``device_map="auto"``), pass
``count_reusable_as_free=True``: it then returns ``rm_mem_get_info``, driver free plus the
pool's reusable bytes.

For part of a program, where the installed PyTorch has ``torch.cuda.MemPool`` (2.5 and later),
and also after CUDA memory exists (PyTorch cannot swap its allocator then)::

    with resmem.torch.pool():                    # tensors made here come from resmem
        kv_cache = torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
    del kv_cache
    resmem.torch.empty_cache()                   # back to resmem, and on to the driver

PyTorch's caching allocator keeps managing the blocks of that pool; it takes its segments from
resmem (``rm_torch_malloc``) and gives them back (``rm_torch_free``) on ``empty_cache``, after
which ``resmem.torch.empty_cache()`` returns them to the driver. An out-of-memory inside
``pool()`` is raised as ``torch.cuda.OutOfMemoryError`` with resmem's message added (PyTorch's
caching allocator checks the NULL ``rm_torch_malloc`` returns there, returns its own cache and
tries again first). Under ``install()`` it is a ``RuntimeError`` (above).

Frees reach the right device whatever the current device: resmem finds a block's device from
its address, not from the device PyTorch passes.
"""

import collections
import contextlib
import ctypes
import os
import warnings

from . import _lib

#: The torch.cuda functions install() replaces.
PATCHED = (
    "memory_stats",
    "memory_allocated",
    "memory_reserved",
    "max_memory_allocated",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "memory_summary",
)

#: The hooks of PyTorch's allocator object, and the resmem function each is given.
HOOKS = {
    "set_init_fn": "rm_torch_init",
    "set_reset_fn": "rm_torch_empty_cache",
    "set_memory_fraction_fn": "rm_torch_set_memory_fraction",
    "set_record_stream_fn": "rm_torch_record_stream",
}


def torch_stats(s):
    """resmem's figures (a ``resmem.stats()`` dict) under ``torch.cuda.memory_stats()``'s keys.
    resmem keeps one pool per device, so "all" and "large_pool"/"small_pool" are not split:
    only the "all" keys are given. Figures resmem does not keep are left out rather than faked;
    resmem's own extras are under "resmem.*"."""
    out = {
        "allocated_bytes.all.current": s["allocated_bytes"],
        "allocated_bytes.all.peak": s["peak_allocated_bytes"],
        "reserved_bytes.all.current": s["reserved_bytes"],
        "reserved_bytes.all.peak": s["peak_reserved_bytes"],
        "active_bytes.all.current": s["allocated_bytes"],
        "active_bytes.all.peak": s["peak_allocated_bytes"],
        "requested_bytes.all.current": s["requested_bytes"],
        "allocation.all.current": s["live_blocks"],
        "allocation.all.allocated": s["reserve_calls"],
        "active.all.current": s["live_blocks"],
        "segment.all.current": s["segments"],
        "segment.all.allocated": s["driver_allocs"],
        "segment.all.freed": s["driver_frees"],
        "num_alloc_retries": s["oom_retries"],
        "num_ooms": s["ooms"],
        "num_device_alloc": s["driver_allocs"],
        "num_device_free": s["driver_frees"],
        "resmem.reusable_bytes": s["reusable_bytes"],
        "resmem.largest_reusable_block": s["largest_reusable_block"],
        "resmem.cache_hits": s["cache_hits"],
    }
    return collections.OrderedDict(sorted(out.items()))


def _size(n):
    """Bytes as PyTorch's memory_summary() prints them: whole units, the largest below 768."""
    unit = "B  "
    for larger in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 768 * 1024:
            break
        unit, n = larger, n // 1024
    return f"{n:6d} {unit}"


def summary(s, device):
    """resmem's figures (a ``resmem.stats()`` dict) as a printout in the layout of
    ``torch.cuda.memory_summary()``: what ``memory_summary`` returns under ``install()``. Only
    figures resmem keeps are printed (no per-pool split, no totals allocated and freed)."""
    width = 75
    rule, double = "-" * width, "=" * width
    title = f"resmem memory summary, device ID {device}"
    ooms = f"out-of-memory errors: {s['ooms']}"
    retries = f"retries after returning cache: {s['oom_retries']}"
    lines = [
        double,
        f"{title:^{width}}",
        rule,
        f"{ooms:^37}|{retries:^37}",
        double,
        f" {'Metric':<29} | {'Cur Usage':>12} | {'Peak Usage':>12}",
        rule,
        f" {'Allocated memory':<29} | {_size(s['allocated_bytes']):>12} | "
        f"{_size(s['peak_allocated_bytes']):>12}",
        f" {'Requested memory':<29} | {_size(s['requested_bytes']):>12} |",
        f" {'Reserved memory':<29} | {_size(s['reserved_bytes']):>12} | "
        f"{_size(s['peak_reserved_bytes']):>12}",
        f" {'Reusable (reserved, unused)':<29} | {_size(s['reusable_bytes']):>12} |",
        f" {'Largest reusable block':<29} | {_size(s['largest_reusable_block']):>12} |",
        rule,
        f" {'Live allocations':<29} | {s['live_blocks']:>12d} |",
        f" {'Segments':<29} | {s['segments']:>12d} |",
        rule,
        f" {'Metric':<29} | {'Total':>12}",
        rule,
        f" {'Allocation requests':<29} | {s['reserve_calls']:>12d}",
        f" {'  served from the cache':<29} | {s['cache_hits']:>12d}",
        f" {'Driver allocations':<29} | {s['driver_allocs']:>12d}",
        f" {'Driver frees':<29} | {s['driver_frees']:>12d}",
        double,
    ]
    return "|" + "|\n|".join(line.ljust(width) for line in lines) + "|\n"


def _device_index(torch, device):
    """PyTorch's device argument (None, an int, "cuda:1", a torch.device) as an ordinal."""
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        _, _, index = device.partition(":")
        return int(index) if index else torch.cuda.current_device()
    index = getattr(device, "index", None)
    return torch.cuda.current_device() if index is None else index


#: PyTorch's CUDA graph pool hooks (2.3 and later), and libresmem_torch.so's function for each.
GRAPH_HOOKS = {
    "set_begin_allocate_to_pool": "rm_torch_raising_begin_allocate_to_pool",
    "set_end_allocate_to_pool_fn": "rm_torch_raising_end_allocate_to_pool",
    "set_release_pool": "rm_torch_raising_release_pool",
}

#: What a CUDA graph capture under install() raises where the hooks could not be wired.
GRAPH_REFUSAL = (
    "resmem.torch.install() cannot keep this CUDA graph's memory in a private pool here ({}), "
    "and without one memory freed during the capture would be handed to other tensors while "
    "every replay of the graph writes to it. Capture without install() (resmem.torch.pool() "
    "around the parts that should come from resmem), or run without CUDA graphs (torch.compile "
    "without mode='reduce-overhead')."
)


def _refusing_capture(reason):
    """torch.cuda.CUDAGraph.capture_begin where install() could not wire the graph hooks."""

    def capture_begin(self, *args, **kwargs):
        raise RuntimeError(GRAPH_REFUSAL.format(reason))

    return capture_begin


def _address(lib, name):
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


#: The library of the allocation functions install() gives PyTorch (``python/native/
#: torch_raise.cpp``, built beside libresmem.so by the package's build).
RAISING_LIBRARY = "libresmem_torch.so"

#: What install() warns where the package was built without RAISING_LIBRARY.
NO_RAISING_LIBRARY = (
    "resmem: this resmem package has no libresmem_torch.so (it is built with a C++ compiler: "
    "reinstall with one, c++ or $CXX): an out-of-memory under resmem.torch.install() is then a "
    "NULL, which PyTorch does not check; the first kernel on that tensor faults and ends the "
    "process's CUDA context"
)


#: RAISING_LIBRARY loaded, by path: opened once, whoever asks.
_RAISING_LOADED = {}


def raising_library():
    """The path of this package's libresmem_torch.so, set up to call the loaded libresmem, or
    None where the package was built without it. Its allocation function throws a failure for
    PyTorch to raise (``RuntimeError``, "CUDA out of memory. " and resmem's message for an
    out-of-memory) where ``rm_torch_malloc`` returns NULL, which PyTorch does not check."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), RAISING_LIBRARY)
    if not os.path.exists(path):
        return None
    lib = _lib.library()
    if path not in _RAISING_LOADED:
        _RAISING_LOADED[path] = ctypes.CDLL(path)
    init = _RAISING_LOADED[path].rm_torch_raising_init
    init.restype, init.argtypes = ctypes.c_int, [ctypes.c_void_p] * 5
    names = (
        "rm_reserve",
        "rm_torch_free",
        "rm_last_error",
        "rm_torch_empty_cache",
        "rm_reserve_no_wait",
    )
    if init(*(_address(lib, name) for name in names)) != 0:
        raise RuntimeError(f"{path}: rm_torch_raising_init refused libresmem's entry points")
    return path


def _pluggable(torch, raising=False):
    """PyTorch's allocator object over libresmem's entry points, with every hook wired. With
    ``raising``, over libresmem_torch.so where the package has it, its graph hooks wired too
    where PyTorch has them. Returns the object and, with ``raising``, why graphs' private pools
    cannot be kept (None where they can)."""
    lib = _lib.library()
    functions = (_lib.library_path(), "rm_torch_malloc", "rm_torch_free")
    path = raising_library() if raising else None
    if raising and path is None:
        warnings.warn(NO_RAISING_LIBRARY, RuntimeWarning, stacklevel=3)
    if path is not None:
        functions = (path, "rm_torch_raising_malloc", "rm_torch_raising_free")
    allocator = torch.cuda.memory.CUDAPluggableAllocator(*functions)
    hooks = allocator.allocator()
    for setter, function in HOOKS.items():
        getattr(hooks, setter)(_address(lib, function))
    no_graphs = "this package has no libresmem_torch.so"
    if path is not None:
        shim = _RAISING_LOADED[path]
        if all(hasattr(hooks, setter) for setter in GRAPH_HOOKS):
            for setter, function in GRAPH_HOOKS.items():
                getattr(hooks, setter)(_address(shim, function))
            # empty_cache gives released graph pools' blocks back first (graph_pools.cpp).
            hooks.set_reset_fn(_address(shim, "rm_torch_raising_empty_cache"))
            no_graphs = None
        else:
            no_graphs = (
                f"PyTorch {getattr(torch, '__version__', '(unknown version)')} has no pool "
                "hooks for a pluggable allocator; 2.3 and later have them"
            )
    return allocator, no_graphs


def mem_pool():
    """A ``torch.cuda.MemPool`` whose segments come from resmem. Raises ``RuntimeError`` when the
    installed PyTorch has no ``MemPool`` (before 2.5): use ``install()`` there."""
    import torch

    mem_pool_class = getattr(torch.cuda, "MemPool", None) or getattr(
        torch.cuda.memory, "MemPool", None
    )
    if mem_pool_class is None:
        raise RuntimeError(
            f"PyTorch {getattr(torch, '__version__', '(unknown version)')} has no "
            "torch.cuda.MemPool (PyTorch 2.5 or later has it); call resmem.torch.install() "
            "before the first CUDA allocation instead"
        )
    return mem_pool_class(_pluggable(torch)[0].allocator())


@contextlib.contextmanager
def pool(device=None, mem_pool_object=None):
    """Allocate the tensors made inside the ``with`` block on ``device`` from resmem, through a
    ``torch.cuda.MemPool`` (``mem_pool_object``, or a new one from ``mem_pool()``); yields the
    pool. An out-of-memory inside is re-raised as ``torch.cuda.OutOfMemoryError`` carrying
    resmem's message (the requested, reserved, reusable and driver-free bytes)."""
    import torch

    chosen = mem_pool_object if mem_pool_object is not None else mem_pool()
    index = _device_index(torch, device)
    ooms = _lib.stats(index)["ooms"]
    with torch.cuda.use_mem_pool(chosen, device):
        try:
            yield chosen
        except torch.cuda.OutOfMemoryError as e:
            if _lib.stats(index)["ooms"] == ooms:
                raise  # not resmem's: PyTorch's own limit, or another device
            raise torch.cuda.OutOfMemoryError(f"{e}\nresmem: {_lib.last_error()}") from e


def empty_cache():
    """``torch.cuda.empty_cache()`` (PyTorch gives the idle segments of its pools back to
    resmem), then resmem's idle memory on every device back to the driver. Returns the bytes
    resmem returned."""
    import torch

    torch.cuda.empty_cache()
    return _lib.free_reusable(-1)


def install(count_reusable_as_free=False):
    """Make resmem PyTorch's CUDA allocator; see the module's documentation. Call it before the
    first CUDA allocation (PyTorch refuses to swap an allocator in use; ``pool()`` works after).
    Returns PyTorch's allocator object."""
    import torch

    allocator, no_graphs = _pluggable(torch, raising=True)
    torch.cuda.memory.change_current_allocator(allocator)

    def memory_stats(device=None):
        return torch_stats(_lib.stats(_device_index(torch, device)))

    def memory_allocated(device=None):
        return memory_stats(device)["allocated_bytes.all.current"]

    def memory_reserved(device=None):
        return memory_stats(device)["reserved_bytes.all.current"]

    def max_memory_allocated(device=None):
        return memory_stats(device)["allocated_bytes.all.peak"]

    def max_memory_reserved(device=None):
        return memory_stats(device)["reserved_bytes.all.peak"]

    def reset_peak_memory_stats(device=None):
        _lib.reset_peak_stats(_device_index(torch, device))

    def memory_summary(device=None, abbreviated=False):
        index = _device_index(torch, device)
        return summary(_lib.stats(index), index)

    replacements = {name: value for name, value in locals().items() if name in PATCHED}
    if count_reusable_as_free:

        def mem_get_info(device=None):
            return _lib.mem_get_info(_device_index(torch, device))

        replacements["mem_get_info"] = mem_get_info
    for name, function in replacements.items():
        function.__doc__ = f"torch.cuda.{name}, answered by resmem (see resmem.torch)."
        for module in (torch.cuda, torch.cuda.memory):
            setattr(module, name, function)
    graph = getattr(torch.cuda, "CUDAGraph", None)
    if graph is not None and no_graphs is not None:
        graph.capture_begin = _refusing_capture(no_graphs)
    return allocator
