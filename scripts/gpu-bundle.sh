#!/usr/bin/env bash
# Build what scripts/gpu-check.sh runs into one folder (default target/gpu-bundle): the release
# library, the cuda_driver and peer_access test binaries, the C examples and the C benchmarks (benches/c: the pair
# benchmark and the per-call driver costs), linked to find libresmem next to them,
# and the Python package (libresmem_torch.so compiled into it) with python/tests/test_torch_gpu.py
# and test_torch_pool_gpu.py (they use lib/libresmem.so.0).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/gpu-bundle}
mkdir -p "$out/lib"
cargo build --release -p resmem --lib
cargo build --release -p resmem-cli --bins
for test in cuda_driver peer_access; do
  test_bin=$(cargo test --release --test "$test" --no-run --message-format=json 2>/dev/null |
    TEST=$test python3 -c 'import json,os,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == os.environ["TEST"] and m.get("executable"):
        print(m["executable"])')
  cp "$test_bin" "$out/$test"
done
cp target/release/resmem "$out/resmem"
rm -f "$out/lib/libresmem.so.0"
cp target/release/libresmem.so "$out/lib/libresmem.so.0"
ln -sf libresmem.so.0 "$out/lib/libresmem.so"
for program in quickstart loader errors; do
  gcc -std=c99 -Wall -Wextra -pedantic -Werror -O2 -Iinclude "c_examples/$program.c" \
    -L"$out/lib" -lresmem -Wl,-rpath,'$ORIGIN/lib' -o "$out/$program"
done
for program in pairs driver_costs; do
  gcc -std=c11 -Wall -Wextra -Werror -O2 -Iinclude "benches/c/$program.c" \
    -L"$out/lib" -lresmem -Wl,-rpath,'$ORIGIN/lib' -lpthread -ldl -o "$out/$program"
done
rm -rf "$out/python"
mkdir -p "$out/python/tests"
cp -r python/resmem "$out/python/"
# What the package's build (python/setup.py) puts beside libresmem.so for resmem.torch.install().
g++ -std=c++17 -O2 -Wall -Wextra -Werror -shared -fPIC -fvisibility=hidden -Iinclude \
  python/native/*.cpp -o "$out/python/resmem/libresmem_torch.so" -ldl
cp python/tests/test_torch_gpu.py python/tests/test_torch_pool_gpu.py "$out/python/tests/"
echo "bundle ready in $out"
