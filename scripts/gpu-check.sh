#!/usr/bin/env bash
# resmem against the real CUDA driver, on a machine with an NVIDIA GPU.
#
#   scripts/gpu-check.sh               build with cargo and gcc here, then run the checks
#   scripts/gpu-check.sh BUNDLE        run prebuilt programs from BUNDLE (made by
#                                      scripts/gpu-bundle.sh on a build machine of the same
#                                      architecture), for GPU machines without a Rust toolchain
#
# What it runs, each against libcuda.so.1:
#   1. the pool through the dlopen'ed driver (tests/cuda_driver.rs): reserve/release, cross-stream
#      reuse ordered by events, record_stream, free_reusable, a cache-hit pair timing, and a
#      1 GiB range made from 32 cached 32 MiB segments with the virtual-memory API (timed);
#   2. c_examples/quickstart, loader (four loads of a Qwen3-4B-shaped bf16 model) and errors,
#      with classic segments and with RESMEM_CONF=vmm:true;
#   3. resmem info, and resmem demo on the GPU under both policies;
#   4. the cost of each driver call the pool makes, by size (benches/c/driver_costs.c: the figures
#      behind `resmem replay`'s estimated driver time), cache-hit pairs through libresmem.so
#      from 1 and 2 threads beside glibc (benches/c/pairs.c, `pairs quick`), and misses from 1,
#      2, 4 and 8 threads each on its own stream (`pairs streams`);
#   5. when python3 has torch (with the wheels of scripts/gpu-wheels.sh in .whl/ when present:
#      transformers 4.51.3, from before the fix of the seed): python/tests/test_torch_gpu.py, the same four loads in PyTorch
#      with transformers' device_map="auto", with and without resmem as the allocator; and
#      python/tests/test_torch_pool_gpu.py, resmem.torch.pool() through torch.cuda.MemPool
#      (empty_cache, out-of-memory as torch.cuda.OutOfMemoryError, frees across devices).
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
echo "== the pool through the real driver"
RESMEM_TEST_CUDA_LIBRARY=libcuda.so.1 "$bundle/cuda_driver" --nocapture --test-threads=1 || status=1
for conf in "" "vmm:true"; do
  for program in quickstart loader errors; do
    echo "== c_examples/$program${conf:+ with RESMEM_CONF=$conf}"
    RESMEM_CONF=$conf "$bundle/$program" || status=1
  done
done
echo "== resmem info and resmem demo (on the GPU)"
"$bundle/resmem" info || status=1
"$bundle/resmem" demo --loads 2 || status=1
echo "== driver calls by kind and size (us: median, min, max of 20)"
RESMEM_CUDA_LIBRARY=libcuda.so.1 "$bundle/driver_costs" 20 || status=1
echo "== cache-hit pairs (ns per pair per thread: wall, CPU)"
RESMEM_DRIVER=cuda RESMEM_CUDA_LIBRARY=libcuda.so.1 "$bundle/pairs" quick || status=1
echo "== misses: 128 MiB pairs from 1, 2, 4 and 8 threads, a stream each (the device's shards)"
RESMEM_DRIVER=cuda RESMEM_CUDA_LIBRARY=libcuda.so.1 "$bundle/pairs" streams || status=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  # The wheels scripts/gpu-wheels.sh fetched (transformers from before PR #37920).
  echo "== installing .whl/ into /tmp/site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
echo "== python/tests/test_torch_gpu.py"
if python3 -c "import torch" 2>/dev/null; then
  RESMEM_LIBRARY="$(cd "$bundle" && pwd)/lib/libresmem.so.0" PYTHONPATH="$bundle/python${PYTHONPATH:+:$PYTHONPATH}" \
    python3 "$bundle/python/tests/test_torch_gpu.py" || status=1
  echo "== python/tests/test_torch_pool_gpu.py"
  RESMEM_LIBRARY="$(cd "$bundle" && pwd)/lib/libresmem.so.0" PYTHONPATH="$bundle/python${PYTHONPATH:+:$PYTHONPATH}" \
    python3 "$bundle/python/tests/test_torch_pool_gpu.py" || status=1
else
  echo "skipped: python3 has no torch"
fi
echo "== gpu-check: $([ $status -eq 0 ] && echo passed || echo FAILED)"
exit $status
