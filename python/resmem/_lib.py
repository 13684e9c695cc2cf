"""Finding libresmem.so and calling it through ctypes."""

import ctypes
import os
import threading

STATS_FIELDS = (
    "allocated_bytes",
    "requested_bytes",
    "reserved_bytes",
    "reusable_bytes",
    "largest_reusable_block",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "live_blocks",
    "segments",
    "reserve_calls",
    "cache_hits",
    "driver_allocs",
    "driver_frees",
    "oom_retries",
    "ooms",
)


class _Stats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in STATS_FIELDS]


class ResmemError(RuntimeError):
    """A resmem call failed. ``status`` is the rm_status value, ``status_name`` its name, and the
    message is rm_last_error()'s: what happened, with figures, and what to do."""

    def __init__(self, status, status_name, message):
        super().__init__(message)
        self.status = status
        self.status_name = status_name


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _preloaded_path():
    """The file of an rm_version already in the process (a preloaded libresmem_preload.so), so
    that Python, PyTorch and the preloaded hooks share one pool."""
    try:
        process = ctypes.CDLL(None)
        symbol = process.rm_version
        info = _DlInfo()
        if process.dladdr(ctypes.cast(symbol, ctypes.c_void_p), ctypes.byref(info)) and info.dli_fname:
            return os.fsdecode(info.dli_fname)
    except (AttributeError, OSError):
        pass
    return None


def _candidates():
    env = os.environ.get("RESMEM_LIBRARY")
    if env:
        yield env
        return
    preloaded = _preloaded_path()
    if preloaded:
        yield preloaded
    here = os.path.dirname(os.path.abspath(__file__))
    for name in ("libresmem.so", "libresmem.so.0"):
        yield os.path.join(here, name)
    folder = here
    for _ in range(6):
        folder = os.path.dirname(folder)
        for profile in ("release", "debug"):
            yield os.path.join(folder, "target", profile, "libresmem.so")
    yield "libresmem.so.0"


_lock = threading.Lock()
_state = {}


def _load():
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        tried = []
        for candidate in _candidates():
            if os.sep in candidate and not os.path.exists(candidate):
                tried.append(candidate)
                continue
            try:
                lib = ctypes.CDLL(candidate)
            except OSError as e:
                tried.append(f"{candidate} ({e})")
                continue
            _declare(lib)
            _state["lib"], _state["path"] = lib, _resolve_path(lib, candidate)
            return lib
        raise OSError(
            "libresmem.so was not found: an installed resmem carries it, so reinstall the "
            "package from a checkout with `pip install ./python` (it builds the library with "
            "cargo), or set RESMEM_LIBRARY to a libresmem.so. Tried: " + "; ".join(tried)
        )


def _resolve_path(lib, candidate):
    info = _DlInfo()
    try:
        address = ctypes.cast(lib.rm_version, ctypes.c_void_p)
        if ctypes.CDLL(None).dladdr(address, ctypes.byref(info)) and info.dli_fname:
            return os.fsdecode(info.dli_fname)
    except (AttributeError, OSError):
        pass
    return candidate


def _declare(lib):
    c_int, c_size_t, c_void_p, c_char_p = ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_char_p
    size_p = ctypes.POINTER(c_size_t)
    signatures = {
        "rm_mem_get_info": (c_int, [c_int, size_p, size_p]),
        "rm_reserve": (c_int, [c_int, c_size_t, c_void_p, ctypes.POINTER(c_void_p)]),
        "rm_release": (c_int, [c_void_p]),
        "rm_record_stream": (c_int, [c_void_p, c_void_p]),
        "rm_free_reusable": (c_int, [c_int, size_p]),
        "rm_warmup": (c_int, [c_int, c_size_t]),
        "rm_get_stats": (c_int, [c_int, ctypes.POINTER(_Stats)]),
        "rm_reset_peak_stats": (c_int, [c_int]),
        "rm_set_memory_limit": (c_int, [c_int, c_size_t]),
        "rm_get_memory_limit": (c_int, [c_int, size_p]),
        "rm_status_string": (c_char_p, [c_int]),
        "rm_last_error": (c_char_p, []),
        "rm_version": (c_char_p, []),
        "rm_torch_malloc": (c_void_p, [ctypes.c_ssize_t, c_int, c_void_p]),
        "rm_torch_free": (None, [c_void_p, ctypes.c_ssize_t, c_int, c_void_p]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes


def library():
    """The loaded ctypes library (loading it on first use)."""
    return _load()


def library_path():
    """The path of the loaded libresmem (what PyTorch's CUDAPluggableAllocator is given)."""
    _load()
    return _state["path"]


def _check(status):
    if status != 0:
        lib = _load()
        name = lib.rm_status_string(status).decode().split(":")[0]
        raise ResmemError(status, name, lib.rm_last_error().decode())


def last_error():
    """This thread's last failure in words ("" if none)."""
    return _load().rm_last_error().decode()


def version():
    """The library's version."""
    return _load().rm_version().decode()


def mem_get_info(device=0):
    """(free, total) bytes of ``device``; free counts the pool's reusable bytes."""
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    _check(_load().rm_mem_get_info(device, ctypes.byref(free), ctypes.byref(total)))
    return free.value, total.value


def stats(device=0):
    """``device``'s figures (the rm_stats fields) as a dict of ints."""
    out = _Stats()
    _check(_load().rm_get_stats(device, ctypes.byref(out)))
    return {name: getattr(out, name) for name in STATS_FIELDS}


def reserve(size, device=0, stream=None):
    """A block of at least ``size`` bytes (an int address; 0 for size 0)."""
    out = ctypes.c_void_p()
    _check(_load().rm_reserve(device, size, stream, ctypes.byref(out)))
    return out.value or 0


def release(ptr):
    """Give a block back to the pool."""
    _check(_load().rm_release(ptr or None))


def free_reusable(device=-1):
    """Return idle cached memory to the driver (device -1: all); returns the bytes returned."""
    out = ctypes.c_size_t()
    _check(_load().rm_free_reusable(device, ctypes.byref(out)))
    return out.value


def warmup(device, size):
    """Make at least ``size`` bytes reusable on ``device``, allocating only the shortfall."""
    _check(_load().rm_warmup(device, size))


def reset_peak_stats(device=0):
    """Set ``device``'s peak figures to the current ones."""
    _check(_load().rm_reset_peak_stats(device))


def set_memory_limit(size, device=-1):
    """Cap what the pool reserves on ``device`` (-1: every device) at ``size`` bytes (0: no cap)."""
    _check(_load().rm_set_memory_limit(device, size))


def memory_limit(device=0):
    """``device``'s cap in bytes (0: none)."""
    out = ctypes.c_size_t()
    _check(_load().rm_get_memory_limit(device, ctypes.byref(out)))
    return out.value
