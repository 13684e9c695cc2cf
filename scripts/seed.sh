#!/usr/bin/env bash
# The seed scenario: four consecutive loads of a Qwen3-4B-shaped bf16 model (8.04 GB) through
# resmem, printing per load the free memory a loader would see, reserved and allocated memory,
# and whether the loader would offload. Runs on a simulated 24 GiB device unless told otherwise:
#   scripts/seed.sh                      simulated 24 GiB device
#   RESMEM_DRIVER=cuda scripts/seed.sh   the real GPU through libcuda.so.1
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet -p resmem --lib
out=target/release/seed
mkdir -p "$out/lib"
rm -f "$out/lib/libresmem.so.0"
cp target/release/libresmem.so "$out/lib/libresmem.so.0"
ln -sf libresmem.so.0 "$out/lib/libresmem.so"
gcc -std=c99 -Wall -Wextra -pedantic -Werror -O2 -Iinclude c_examples/loader.c \
  -L"$out/lib" -lresmem -Wl,-rpath,'$ORIGIN/lib' -o "$out/loader"
export RESMEM_DRIVER=${RESMEM_DRIVER:-sim}
export CUDA_SIM_DEVICES=${CUDA_SIM_DEVICES:-24GiB}
if [ "$RESMEM_DRIVER" = sim ]; then
  echo "(on a simulated $CUDA_SIM_DEVICES device; RESMEM_DRIVER=cuda uses the real GPU)"
fi
exec "$out/loader"
