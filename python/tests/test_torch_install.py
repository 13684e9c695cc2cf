"""resmem.torch.install() and resmem.torch.pool() against a minimal stand-in for torch (torch is
not needed): which functions install() replaces, which hooks it wires, the figures they report,
the MemPool that pool() builds, its out-of-memory message, and frees reaching the block's
device. The stand-in calls the allocation functions and hooks through the addresses it was
given, as PyTorch does."""

import contextlib
import ctypes
import os
import sys
import types

import pytest

import resmem
import resmem.torch as rtorch

GIB = 1 << 30
MIB = 1 << 20
DEVICE = 1  # the stand-in's current device; the ctypes tests use device 0

MALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
HOOK_TYPES = {
    "set_init_fn": ctypes.CFUNCTYPE(None, ctypes.c_int),
    "set_reset_fn": ctypes.CFUNCTYPE(None),
    "set_memory_fraction_fn": ctypes.CFUNCTYPE(None, ctypes.c_double, ctypes.c_int),
    "set_record_stream_fn": ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p),
}


class FakeOutOfMemoryError(RuntimeError):
    pass


def fake_torch(with_mem_pool=True, with_graph_hooks=True):
    """torch, torch.cuda and torch.cuda.memory with what install() and pool() touch. Its MemPool
    takes segments through the allocator object's raw_alloc, returning NULL as out-of-memory, as
    PyTorch's caching allocator does for a pool with an allocator (allocPrimitive). Without
    `with_graph_hooks`, its allocator object lacks the graph pool hooks, as before PyTorch 2.3."""
    torch = types.ModuleType("torch")
    cuda = types.ModuleType("torch.cuda")
    memory = types.ModuleType("torch.cuda.memory")
    torch.cuda, cuda.memory = cuda, memory
    state = {"current": None}

    class Hooks:
        def __init__(self, owner):
            self.fns = {}
            self.graph_fns = {}
            self.owner = owner

        def raw_alloc(self, size):
            return self.owner.malloc(size, cuda.current_device(), None)

        def raw_delete(self, ptr):
            self.owner.free(ptr, 0, cuda.current_device(), None)

        def __getattr__(self, name):
            if name in HOOK_TYPES:
                return lambda address: self.fns.__setitem__(name, HOOK_TYPES[name](address))
            if with_graph_hooks and name in rtorch.GRAPH_HOOKS:
                # Their functions take C++ objects (std::function): only their addresses here.
                return lambda address: self.graph_fns.__setitem__(name, address)
            raise AttributeError(name)

    class CUDAPluggableAllocator:
        def __init__(self, path, alloc_fn_name, free_fn_name):
            lib = ctypes.CDLL(path)
            address = lambda n: ctypes.cast(getattr(lib, n), ctypes.c_void_p).value
            self.path, self.names = path, (alloc_fn_name, free_fn_name)
            self.malloc = MALLOC(address(alloc_fn_name))
            self.free = FREE(address(free_fn_name))
            self._allocator = Hooks(self)

        def allocator(self):
            return self._allocator

    def change_current_allocator(allocator):
        state["current"] = allocator

    def driver_view(device=None):
        return ("driver view", device)

    def unsupported(device=None):
        raise RuntimeError("CUDAPluggableAllocator does not yet support getDeviceStats")

    class MemPool:
        def __init__(self, allocator=None):
            self.allocator = allocator
            self.segments = []  # what PyTorch caches: freed tensors stay here until empty_cache

    @contextlib.contextmanager
    def use_mem_pool(pool, device=None):
        state["pool"], state["pool_device"] = pool, device
        try:
            yield
        finally:
            state["pool"] = None

    def empty(size):
        """A tensor's memory from the active pool (one segment per tensor, for simplicity)."""
        ptr = state["pool"].allocator.raw_alloc(size)
        if not ptr:
            raise FakeOutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} bytes")
        state["pool"].segments.append(ptr)
        return ptr

    def empty_cache():
        state["emptied"] += 1
        for pool in state["pools"]:
            while pool.segments:
                pool.allocator.raw_delete(pool.segments.pop())

    class CUDAGraph:
        """torch.cuda.CUDAGraph: torch.cuda.graph and torch.compile's CUDA graphs begin every
        capture here."""

        def capture_begin(self, pool=None, capture_error_mode="global"):
            state["captures"] += 1

    state.update(pool=None, pools=[], emptied=0, captures=0)
    cuda.CUDAGraph = CUDAGraph
    torch.empty = empty
    cuda.OutOfMemoryError = FakeOutOfMemoryError
    cuda.empty_cache = empty_cache
    if with_mem_pool:
        cuda.MemPool = MemPool
        cuda.use_mem_pool = use_mem_pool
    memory.CUDAPluggableAllocator = CUDAPluggableAllocator
    memory.change_current_allocator = change_current_allocator
    cuda.current_device = lambda: DEVICE
    for module in (cuda, memory):
        module.mem_get_info = driver_view
        for name in rtorch.PATCHED:
            setattr(module, name, unsupported)
    return torch, state


@pytest.fixture
def torch(monkeypatch):
    fake, state = fake_torch()
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setitem(sys.modules, "torch.cuda", fake.cuda)
    monkeypatch.setitem(sys.modules, "torch.cuda.memory", fake.cuda.memory)
    fake.state = state
    yield fake
    resmem.set_memory_limit(0, device=DEVICE)
    resmem.free_reusable(DEVICE)
    resmem.reset_peak_stats(DEVICE)


def test_install_makes_resmem_the_allocator_and_wires_every_hook(torch):
    allocator = rtorch.install()
    assert torch.state["current"] is allocator
    raising = rtorch.raising_library()
    if raising is not None:
        assert allocator.path == raising
        assert allocator.names == ("rm_torch_raising_malloc", "rm_torch_raising_free")
    else:
        assert allocator.path == resmem.library_path()
        assert allocator.names == ("rm_torch_malloc", "rm_torch_free")
    assert sorted(allocator.allocator().fns) == sorted(rtorch.HOOKS)
    for name in rtorch.PATCHED:
        assert getattr(torch.cuda, name) is getattr(torch.cuda.memory, name)
        assert getattr(torch.cuda, name).__module__ == "resmem.torch"
    # mem_get_info keeps the driver's view unless asked.
    assert torch.cuda.mem_get_info(0) == ("driver view", 0)


def test_install_wires_the_graph_hooks_to_the_library_that_keeps_graph_pools(torch):
    raising = rtorch.raising_library()
    if raising is None:
        pytest.skip("resmem imported from a checkout without libresmem_torch.so")
    allocator = rtorch.install()
    shim = ctypes.CDLL(raising)
    wired = allocator.allocator().graph_fns
    assert wired == {
        setter: ctypes.cast(getattr(shim, function), ctypes.c_void_p).value
        for setter, function in rtorch.GRAPH_HOOKS.items()
    }
    # empty_cache gives released graph pools' blocks back before resmem's own.
    reset = allocator.allocator().fns["set_reset_fn"]
    assert ctypes.cast(reset, ctypes.c_void_p).value == ctypes.cast(
        shim.rm_torch_raising_empty_cache, ctypes.c_void_p
    ).value
    # Captures go ahead: PyTorch calls the hooks (tests/torch_raise.rs checks what they do).
    torch.cuda.CUDAGraph().capture_begin()
    assert torch.state["captures"] == 1


def test_without_the_library_install_refuses_cuda_graph_capture(torch, monkeypatch):
    # Before install(), PyTorch's own allocator keeps each graph's private pool.
    torch.cuda.CUDAGraph().capture_begin()
    assert torch.state["captures"] == 1
    monkeypatch.setattr(rtorch, "raising_library", lambda: None)
    with pytest.warns(RuntimeWarning):
        rtorch.install()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="cannot keep this CUDA graph's memory") as refused:
        graph.capture_begin(pool=(0, 1), capture_error_mode="thread_local")
    assert "(this package has no libresmem_torch.so)" in str(refused.value)
    assert "resmem.torch.pool()" in str(refused.value)
    assert torch.state["captures"] == 1


def test_without_pytorchs_graph_hooks_install_refuses_cuda_graph_capture(monkeypatch):
    if rtorch.raising_library() is None:
        pytest.skip("resmem imported from a checkout without libresmem_torch.so")
    fake, state = fake_torch(with_graph_hooks=False)
    fake.__version__ = "2.2.2"
    monkeypatch.setitem(sys.modules, "torch", fake)
    rtorch.install()
    with pytest.raises(RuntimeError, match="PyTorch 2.2.2 has no pool hooks"):
        fake.cuda.CUDAGraph().capture_begin()
    assert state["captures"] == 0


def test_an_installed_package_carries_the_library_that_raises(torch):
    """The wheel CI tests has libresmem_torch.so; a checkout's python/ folder need not."""
    package = os.path.dirname(os.path.abspath(resmem.__file__))
    if "site-packages" not in package.split(os.sep):
        pytest.skip(f"resmem imported from {package}, not an installed package")
    raising = rtorch.raising_library()
    assert raising == os.path.join(package, "libresmem_torch.so")


def test_without_the_library_that_raises_install_warns_and_returns_null(torch, monkeypatch):
    monkeypatch.setattr(rtorch, "raising_library", lambda: None)
    with pytest.warns(RuntimeWarning, match="has no libresmem_torch.so"):
        allocator = rtorch.install()
    assert allocator.path == resmem.library_path()
    assert allocator.names == ("rm_torch_malloc", "rm_torch_free")
    resmem.set_memory_limit(64 * MIB, device=DEVICE)
    assert allocator.malloc(128 * MIB, DEVICE, None) is None
    assert "memory limit of 64.00 MiB" in resmem.last_error()


def test_stats_report_resmem_figures_under_pytorch_names(torch):
    allocator = rtorch.install()
    cuda = torch.cuda
    assert allocator.malloc(0, DEVICE, None) is None
    ptr = allocator.malloc(1000, DEVICE, None)
    assert ptr
    assert cuda.memory_allocated() == 1024
    assert cuda.memory_allocated(DEVICE) == 1024
    assert cuda.memory_allocated(f"cuda:{DEVICE}") == 1024
    assert cuda.memory_allocated(types.SimpleNamespace(index=DEVICE)) == 1024
    assert cuda.memory_reserved() == 2 * MIB
    stats = cuda.memory_stats()
    assert stats["requested_bytes.all.current"] == 1000
    assert stats["allocation.all.current"] == 1
    assert stats["segment.all.current"] == 1
    assert stats["resmem.reusable_bytes"] == 2 * MIB - 1024
    assert list(stats) == sorted(stats)
    allocator.free(ptr, 1000, DEVICE, None)
    assert cuda.memory_allocated() == 0
    assert cuda.max_memory_allocated() == 1024
    cuda.reset_peak_memory_stats()
    assert cuda.max_memory_allocated() == 0
    assert cuda.max_memory_reserved() == 2 * MIB


def test_memory_summary_prints_resmem_figures_in_pytorchs_layout(torch):
    allocator = rtorch.install()
    ptr = allocator.malloc(1000, DEVICE, None)
    text = torch.cuda.memory_summary()
    assert text == torch.cuda.memory.memory_summary(DEVICE, abbreviated=True)
    lines = text.splitlines()
    assert all(len(line) == 77 and line[0] == line[-1] == "|" for line in lines)
    assert f"resmem memory summary, device ID {DEVICE}" in lines[1]


    def rows(text):
        cells = (line.strip("|").split("|") for line in text.splitlines())
        return {c[0].strip(): [v.strip() for v in c[1:]] for c in cells if len(c) > 1}

    row = rows(text)
    assert row["Allocated memory"] == ["1024 B", "1024 B"]
    assert row["Requested memory"] == ["1000 B", ""]
    assert row["Reserved memory"] == ["2048 KiB", "2048 KiB"]
    assert row["Reusable (reserved, unused)"] == ["2047 KiB", ""]
    assert row["Live allocations"] == ["1", ""]
    assert row["Segments"] == ["1", ""]
    allocator.free(ptr, 1000, DEVICE, None)
    assert rows(torch.cuda.memory_summary())["Allocated memory"] == ["0 B", "1024 B"]


def test_hooks_empty_cache_fraction_and_record_stream(torch):
    allocator = rtorch.install()
    hooks = allocator.allocator().fns
    hooks["set_init_fn"](2)
    ptr = allocator.malloc(64 * MIB, DEVICE, None)
    hooks["set_record_stream_fn"](ptr, None)
    allocator.free(ptr, 64 * MIB, DEVICE, None)
    assert torch.cuda.memory_reserved() == 64 * MIB
    hooks["set_reset_fn"]()  # torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == 0
    assert torch.cuda.memory_stats()["num_device_free"] >= 1

    hooks["set_memory_fraction_fn"](0.25, DEVICE)  # set_per_process_memory_fraction(0.25)
    assert resmem.memory_limit(DEVICE) == 6 * GIB
    ooms = torch.cuda.memory_stats()["num_ooms"]
    # libresmem_torch.so's function would throw here, which ctypes cannot carry
    # (tests/torch_raise.rs checks that); libresmem's returns NULL.
    assert resmem._lib.library().rm_torch_malloc(7 * GIB, DEVICE, None) is None
    assert "memory limit of 6.00 GiB" in resmem.last_error()
    assert torch.cuda.memory_stats()["num_ooms"] == ooms + 1

    hooks["set_record_stream_fn"](0x40, None)
    assert resmem.last_error().startswith("rm_torch_record_stream: ")


def test_count_reusable_as_free_switches_mem_get_info(torch):
    allocator = rtorch.install(count_reusable_as_free=True)
    ptr = allocator.malloc(64 * MIB, DEVICE, None)
    assert torch.cuda.mem_get_info() == (24 * GIB - 64 * MIB, 24 * GIB)
    allocator.free(ptr, 64 * MIB, DEVICE, None)
    assert torch.cuda.mem_get_info(DEVICE) == (24 * GIB, 24 * GIB)
    assert torch.cuda.memory.mem_get_info is torch.cuda.mem_get_info


def test_pool_allocates_part_of_a_program_from_resmem_and_empty_cache_returns_it(torch):
    before = resmem.stats(DEVICE)
    with rtorch.pool() as mem_pool:
        assert torch.state["pool"] is mem_pool
        torch.state["pools"].append(mem_pool)
        assert mem_pool.allocator.owner.path == resmem.library_path()
        torch.empty(64 * MIB)
        torch.empty(1000)
    assert torch.state["pool"] is None
    s = resmem.stats(DEVICE)
    assert s["reserved_bytes"] - before["reserved_bytes"] == 64 * MIB + 2 * MIB
    assert s["allocated_bytes"] - before["allocated_bytes"] == 64 * MIB + 1024
    # PyTorch gives its cached segments back to resmem, and resmem gives them to the driver.
    assert rtorch.empty_cache() == 64 * MIB + 2 * MIB
    assert torch.state["emptied"] == 1
    assert resmem.stats(DEVICE)["reserved_bytes"] == before["reserved_bytes"]


def test_pool_raises_out_of_memory_with_resmems_message(torch):
    with pytest.raises(FakeOutOfMemoryError) as raised:
        with rtorch.pool(device=DEVICE):
            torch.empty(1 << 50)
    text = str(raised.value)
    assert text.startswith(f"CUDA out of memory. Tried to allocate {1 << 50} bytes\nresmem: ")
    assert "rm_torch_malloc: " in text
    assert isinstance(raised.value.__cause__, FakeOutOfMemoryError)
    # PyTorch's own out-of-memory (no resmem failure) passes through unchanged.
    with pytest.raises(FakeOutOfMemoryError) as raised:
        with rtorch.pool():
            raise FakeOutOfMemoryError("over PyTorch's own fraction")
    assert str(raised.value) == "over PyTorch's own fraction"


def test_without_mem_pool_pool_says_to_install_instead(monkeypatch):
    fake, _ = fake_torch(with_mem_pool=False)
    fake.__version__ = "2.3.1"
    monkeypatch.setitem(sys.modules, "torch", fake)
    with pytest.raises(RuntimeError) as raised:
        rtorch.mem_pool()
    assert str(raised.value) == (
        "PyTorch 2.3.1 has no torch.cuda.MemPool (PyTorch 2.5 or later has it); call "
        "resmem.torch.install() before the first CUDA allocation instead"
    )


def test_frees_reach_the_device_of_the_block_whatever_the_current_device(torch):
    allocator = rtorch.install()
    other = 1 - DEVICE
    before = (resmem.stats(DEVICE)["allocated_bytes"], resmem.stats(other)["allocated_bytes"])
    ptr = allocator.malloc(8 * MIB, DEVICE, None)
    assert resmem.stats(DEVICE)["allocated_bytes"] == before[0] + 8 * MIB
    # PyTorch passes the device current at free time; the block goes back to its own device.
    allocator.free(ptr, 8 * MIB, other, None)
    assert resmem.stats(DEVICE)["allocated_bytes"] == before[0]
    assert resmem.stats(other)["allocated_bytes"] == before[1]
    assert resmem.stats(DEVICE)["reusable_bytes"] >= 8 * MIB
