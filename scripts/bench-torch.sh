#!/usr/bin/env bash
# Cache-hit allocation + free pairs as PyTorch makes them under resmem.torch.install()
# (benches/c/torch_pairs.cpp): through libresmem_torch.so's functions, through libresmem.so's
# rm_torch_malloc/rm_torch_free, and through glibc, in alternating rounds of the same run, with
# the shipped release libresmem.so on the simulated driver library.
#
#   scripts/bench-torch.sh                    # PAIRS=2000000 ROUNDS=9 by default
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/bench-torch
cargo build --release -q -p resmem -p libcuda-sim
mkdir -p "$out"
ln -sf "$PWD/target/release/libresmem.so" "$out/libresmem.so.0"
g++ -O2 -std=c++17 -Wall -Wextra -Werror -Iinclude benches/c/torch_pairs.cpp \
  python/native/*.cpp -o "$out/torch_pairs" \
  -Ltarget/release -lresmem -Wl,-rpath,"$PWD/$out" -ldl -pthread
RESMEM_DRIVER=cuda RESMEM_CUDA_LIBRARY="$PWD/target/release/libcuda_sim.so" \
  CUDA_SIM_DEVICES=80GiB "$out/torch_pairs"
