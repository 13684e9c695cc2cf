#!/usr/bin/env bash
# resmem against the real CUDA driver, on a machine with an NVIDIA GPU.
#
#   scripts/gpu-check.sh               build with cargo and gcc here, then run the checks
#   scripts/gpu-check.sh BUNDLE        run prebuilt programs from BUNDLE (made by
#                                      scripts/gpu-bundle.sh on a build machine of the same
#                                      architecture), for GPU machines without a Rust toolchain
#
# What it runs, each against libcuda.so.1 and each under a time limit:
#   1. when python3 has torch (with the wheels of scripts/gpu-wheels.sh in .whl/ when present:
#      transformers 4.51.3, from before the fix of the seed): python/tests/test_torch_gpu.py, four
#      loads of a Qwen3-4B-shaped model in PyTorch with transformers' device_map="auto", under
#      PyTorch's allocator, with its expandable segments, and with resmem as the allocator, and
#      PyTorch's snapshots of the first two replayed (`resmem replay`: the torch policy, and its
#      model of expandable segments, against what PyTorch recorded); and
#      python/tests/test_torch_pool_gpu.py,
#      resmem.torch.pool() through torch.cuda.MemPool (empty_cache, out-of-memory as
#      torch.cuda.OutOfMemoryError, frees across devices);
#   2. the pool through the dlopen'ed driver (tests/cuda_driver.rs): reserve/release, cross-stream
#      reuse ordered by events, record_stream, free_reusable, a cache-hit pair timing, each
#      thread's per-thread default stream (cudaStreamPerThread) as a stream of its own, whether
#      cuMemCreate takes the GPUDirect RDMA flag on the device (and the pool's handles with it), a
#      1 GiB range made from 32 cached 32 MiB segments with the virtual-memory API (timed); and
#      (tests/peer_access.rs, on two GPUs or more) devices given access to each other's ranges;
#   3. c_examples/quickstart, loader (four loads of a Qwen3-4B-shaped bf16 model) and errors,
#      with classic segments and with RESMEM_CONF=vmm:true;
#   4. resmem info, and resmem demo on the GPU under both policies;
#   5. the cost of each driver call the pool makes, by size (benches/c/driver_costs.c: the figures
#      behind `resmem replay`'s estimated driver time), cache-hit pairs through libresmem.so
#      from 1 and 2 threads beside glibc (benches/c/pairs.c, `pairs quick`), and misses from 1,
#      2, 4 and 8 threads each on its own stream (`pairs streams`);
#   6. the trade of handles of larger parts (RESMEM_CONF=handle_part_mib:32): resmem demo, and
#      the four loads of step 1 under resmem, with their load times, beside step 1's pages.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
date -u

if [ $# -ge 1 ]; then
  bundle=$1
else
  bundle=target/gpu-bundle
  bash scripts/gpu-bundle.sh "$bundle"
fi

unset RESMEM_DRIVER RESMEM_CUDA_LIBRARY RESMEM_CONF CUDA_SIM_DEVICES
status=0
# Each step runs under a time limit (seconds), so that one that hangs on a device costs its own
# result and not the ones after it.
step() {
  local limit=$1
  shift
  timeout --kill-after=10 "$limit" "$@" || { echo "(exit status $?)"; status=1; }
}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  # The wheels scripts/gpu-wheels.sh fetched (transformers from before PR #37920).
  echo "== installing .whl/ into /tmp/site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# The seed first: it is the longest step and the one a short lease must not lose.
echo "== python/tests/test_torch_gpu.py"
if python3 -c "import torch" 2>/dev/null; then
  lib="$(cd "$bundle" && pwd)/lib/libresmem.so.0"
  pypath="$bundle/python${PYTHONPATH:+:$PYTHONPATH}"
  record=$(mktemp -d)
  RESMEM_TORCH_RECORD_DIR=$record RESMEM_LIBRARY=$lib PYTHONPATH=$pypath \
    step 420 python3 "$bundle/python/tests/test_torch_gpu.py"
  for snapshot in "$record"/seed-pytorch*.pickle; do
    [ -f "$snapshot" ] || continue
    echo "== $(basename "$snapshot") replayed"
    step 120 "$bundle/resmem" replay "$snapshot" --policy both --device-memory 144GiB
  done
  rm -rf "$record"
  echo "== python/tests/test_torch_pool_gpu.py"
  RESMEM_LIBRARY=$lib PYTHONPATH=$pypath step 120 python3 "$bundle/python/tests/test_torch_pool_gpu.py"
else
  echo "skipped: python3 has no torch"
fi
echo "== the pool through the real driver"
RESMEM_TEST_CUDA_LIBRARY=libcuda.so.1 step 180 "$bundle/cuda_driver" --nocapture --test-threads=1
echo "== devices given access to each other's ranges (two GPUs or more; else it says so)"
RESMEM_TEST_CUDA_LIBRARY=libcuda.so.1 step 60 "$bundle/peer_access" --nocapture
for conf in "" "vmm:true"; do
  for program in quickstart loader errors; do
    echo "== c_examples/$program${conf:+ with RESMEM_CONF=$conf}"
    RESMEM_CONF=$conf step 60 "$bundle/$program"
  done
done
echo "== resmem info and resmem demo (on the GPU)"
step 30 "$bundle/resmem" info
step 60 "$bundle/resmem" demo --loads 2
echo "== driver calls by kind and size (us: median, min, max of 20)"
RESMEM_CUDA_LIBRARY=libcuda.so.1 step 120 "$bundle/driver_costs" 20
echo "== cache-hit pairs (ns per pair per thread: wall, CPU)"
RESMEM_DRIVER=cuda RESMEM_CUDA_LIBRARY=libcuda.so.1 step 60 "$bundle/pairs" quick
echo "== misses: 128 MiB pairs from 1, 2, 4 and 8 threads, a stream each (the device's shards)"
RESMEM_DRIVER=cuda RESMEM_CUDA_LIBRARY=libcuda.so.1 step 60 "$bundle/pairs" streams
echo "== handles of 32 MiB parts (RESMEM_CONF=handle_part_mib:32)"
RESMEM_CONF=handle_part_mib:32 step 60 "$bundle/resmem" demo --loads 2
if python3 -c "import torch" 2>/dev/null; then
  model=$(mktemp -d)
  step 120 python3 "$bundle/python/tests/test_torch_gpu.py" make "$model"
  RESMEM_CONF=handle_part_mib:32 RESMEM_LIBRARY=$lib PYTHONPATH=$pypath \
    step 180 python3 "$bundle/python/tests/test_torch_gpu.py" resmem "$model"
  rm -rf "$model"
fi
echo "== gpu-check: $([ $status -eq 0 ] && echo passed || echo FAILED)"
exit $status
