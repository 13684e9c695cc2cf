"""resmem: a CUDA device-memory pool that counts memory it holds but does not use as free.

This package calls ``libresmem.so`` through ctypes and needs nothing else (no torch)::

    import resmem
    free, total = resmem.mem_get_info(0)   # free counts the pool's reusable bytes
    resmem.stats(0)["reserved_bytes"]

``resmem.torch.install()`` makes resmem PyTorch's CUDA allocator.

The library is found, in order: the ``RESMEM_LIBRARY`` variable (a path); a copy already in the
process (``LD_PRELOAD=libresmem_preload.so``); ``libresmem.so`` inside this package (where
``pip install ./python`` and the wheel put it); the ``target/release`` or ``target/debug``
folder of a resmem checkout above it; ``libresmem.so.0`` on the system library path.
"""

from ._lib import (
    STATS_FIELDS,
    ResmemError,
    free_reusable,
    last_error,
    library_path,
    mem_get_info,
    memory_limit,
    release,
    reserve,
    reset_peak_stats,
    set_memory_limit,
    stats,
    version,
    warmup,
)

__all__ = [
    "STATS_FIELDS",
    "ResmemError",
    "free_reusable",
    "last_error",
    "library_path",
    "mem_get_info",
    "memory_limit",
    "release",
    "reserve",
    "reset_peak_stats",
    "set_memory_limit",
    "stats",
    "version",
    "warmup",
]
