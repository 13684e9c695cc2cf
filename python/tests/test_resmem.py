"""The ctypes layer against simulated devices: device 0 is used here (device 1 by the torch
tests), and every test leaves it empty."""

import os
import shutil
import subprocess
import sys

import pytest

import resmem

GIB = 1 << 30
MIB = 1 << 20


@pytest.fixture(autouse=True)
def empty_device():
    yield
    resmem.set_memory_limit(0, device=0)
    resmem.free_reusable(0)


def test_version_and_library():
    assert resmem.version() == "0.1.0"
    assert resmem.library_path().endswith(".so") or ".so." in resmem.library_path()


def test_an_installed_package_loads_the_library_it_carries():
    package = os.path.dirname(os.path.abspath(resmem.__file__))
    if os.environ.get("RESMEM_LIBRARY"):
        assert resmem.library_path() == os.environ["RESMEM_LIBRARY"]
    elif os.path.basename(os.path.dirname(package)) in ("site-packages", "dist-packages"):
        assert resmem.library_path() == os.path.join(package, "libresmem.so")
    else:  # the checkout's source folder: its target/ build
        checkout = os.path.dirname(os.path.dirname(package))
        assert resmem.library_path().startswith(os.path.join(checkout, "target", ""))


def _in_a_new_process(tmp_path, env):
    """resmem's library path and version, from a fresh interpreter with ``env``."""
    code = "import resmem; print(resmem.library_path()); print(resmem.version())"
    search = os.path.dirname(os.path.dirname(os.path.abspath(resmem.__file__)))
    env = {**os.environ, "PYTHONPATH": search, **env}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_resmem_library_overrides_the_packaged_library(tmp_path):
    copy = tmp_path / "libresmem-copy.so"
    shutil.copy(resmem.library_path(), copy)
    assert _in_a_new_process(tmp_path, {"RESMEM_LIBRARY": str(copy)}) == [str(copy), "0.1.0"]


def test_mem_get_info_counts_reusable_memory():
    assert resmem.mem_get_info(0) == (24 * GIB, 24 * GIB)
    ptr = resmem.reserve(64 * MIB, device=0)
    assert ptr % 512 == 0 and ptr != 0
    assert resmem.mem_get_info(0) == (24 * GIB - 64 * MIB, 24 * GIB)
    resmem.release(ptr)
    assert resmem.mem_get_info(0) == (24 * GIB, 24 * GIB)
    assert resmem.free_reusable(0) == 64 * MIB
    assert resmem.stats(0)["reserved_bytes"] == 0


def test_stats_has_every_rm_stats_field():
    before = resmem.stats(0)
    assert tuple(before) == resmem.STATS_FIELDS
    ptr = resmem.reserve(1000, device=0)
    s = resmem.stats(0)
    assert s["allocated_bytes"] == 1024
    assert s["requested_bytes"] == 1000
    assert s["reserved_bytes"] == 2 * MIB
    assert s["reusable_bytes"] == 2 * MIB - 1024
    assert s["live_blocks"] == 1
    assert s["reserve_calls"] == before["reserve_calls"] + 1
    resmem.release(ptr)
    assert resmem.stats(0)["allocated_bytes"] == 0


def test_warmup_and_peaks():
    resmem.warmup(0, 256 * MIB)
    assert resmem.stats(0)["reusable_bytes"] == 256 * MIB
    resmem.warmup(0, 256 * MIB)
    assert resmem.stats(0)["reserved_bytes"] == 256 * MIB
    resmem.free_reusable(0)
    resmem.reset_peak_stats(0)
    assert resmem.stats(0)["peak_reserved_bytes"] == 0


def test_errors_carry_status_and_message():
    with pytest.raises(resmem.ResmemError) as e:
        resmem.mem_get_info(5)
    assert e.value.status == 2
    assert e.value.status_name == "RM_ERROR_INVALID_DEVICE"
    assert str(e.value).startswith("rm_mem_get_info: device 5 is out of range")
    with pytest.raises(resmem.ResmemError) as e:
        resmem.release(0x1234)
    assert e.value.status_name == "RM_ERROR_INVALID_POINTER"


def test_memory_limit():
    resmem.set_memory_limit(GIB, device=0)
    assert resmem.memory_limit(0) == GIB
    with pytest.raises(resmem.ResmemError) as e:
        resmem.reserve(2 * GIB, device=0)
    assert e.value.status_name == "RM_ERROR_OUT_OF_MEMORY"
    assert "memory limit of 1.00 GiB" in str(e.value)
    resmem.set_memory_limit(0, device=0)
    assert resmem.memory_limit(0) == 0
