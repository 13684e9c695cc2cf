"""resmem.torch.pool() in real PyTorch on a GPU: a with-block allocated from resmem through
torch.cuda.MemPool after PyTorch's own allocator already holds memory, empty_cache returning
it to the driver, resmem's out-of-memory raised as torch.cuda.OutOfMemoryError with resmem's
message, and (with two GPUs) frees reaching the device of the block.

    python3 python/tests/test_torch_pool_gpu.py     (or through pytest)

Without torch, torch.cuda.MemPool or a CUDA device it skips, saying why.
"""

import sys

MIB = 1 << 20


def missing():
    """Why this cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if getattr(torch.cuda, "MemPool", None) is None:
        return f"PyTorch {torch.__version__} has no torch.cuda.MemPool"
    return None


def check():
    import torch

    import resmem
    import resmem.torch

    before = torch.empty(MIB, dtype=torch.uint8, device="cuda")  # PyTorch's allocator is in use
    reserved = resmem.stats(0)["reserved_bytes"]
    with resmem.torch.pool():
        x = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
        x.fill_(1)
    got = resmem.stats(0)
    print(f"inside pool(): resmem allocated {got['allocated_bytes'] / MIB:.0f} MiB, "
          f"reserved {got['reserved_bytes'] / MIB:.0f} MiB")
    assert got["allocated_bytes"] >= 256 * MIB, got
    assert int(x.sum().item()) == 256 * MIB
    del x
    returned = resmem.torch.empty_cache()
    after = resmem.stats(0)
    print(f"after empty_cache: {returned / MIB:.0f} MiB returned to the driver, "
          f"resmem reserved {after['reserved_bytes'] / MIB:.0f} MiB")
    assert after["allocated_bytes"] == 0, after
    assert after["reserved_bytes"] == reserved, after

    try:
        with resmem.torch.pool():
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        raise AssertionError("a 1 PiB tensor was allocated")
    except torch.cuda.OutOfMemoryError as e:
        print(f"1 PiB in pool(): torch.cuda.OutOfMemoryError: {str(e).splitlines()[-1]}")
        assert "resmem: rm_torch_malloc: " in str(e), str(e)

    if torch.cuda.device_count() >= 2:
        with torch.cuda.device(1):
            with resmem.torch.pool(device=1):
                y = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda:1")
        assert resmem.stats(1)["allocated_bytes"] >= 64 * MIB
        with torch.cuda.device(0):
            del y
            resmem.torch.empty_cache()
        assert resmem.stats(1)["allocated_bytes"] == 0
        assert resmem.stats(0)["allocated_bytes"] == 0
        print("a device-1 block freed while device 0 was current went back to device 1")
    del before
    print("pool() checks passed")


def test_pool_in_pytorch():
    import pytest

    reason = missing()
    if reason:
        pytest.skip(reason)
    check()


if __name__ == "__main__":
    reason = missing()
    if reason:
        print(f"test_torch_pool_gpu: skipped: {reason}")
        sys.exit(0)
    check()
