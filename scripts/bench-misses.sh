#!/usr/bin/env bash
# Misses: pairs of 128 MiB blocks (beyond the front cache, so every rm_reserve and rm_release
# goes to the pool) through the shipped libresmem.so from C, from 1, 2, 4 and 8 threads on one
# device each on its own stream (`pairs streams`: the device's shards), then from 1 and 2 threads
# on two devices (`pairs devices`). RUNS (default 10) runs, each followed by the same with the
# library in BEFORE_LIB (a folder holding another build's libresmem.so.0, e.g. of an earlier
# commit) where given, so that both meet the machine's other work alike. Prints a Markdown table:
# CPU ns per pair per thread, minimum / median over the runs, and the ratios of the minima to
# the one-thread figure.
#
#   scripts/bench-misses.sh
#   BEFORE_LIB=/tmp/before RUNS=10 scripts/bench-misses.sh
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-10}
out=target/bench-c
. scripts/c-bench.sh
c_bench_build pairs "$out"
: > "$out/misses"
for i in $(seq 1 "$runs"); do
  for lib in now before; do
    if [ "$lib" = before ]; then
      [ -n "${BEFORE_LIB:-}" ] || continue
      export LD_LIBRARY_PATH="$BEFORE_LIB"
    fi
    CUDA_SIM_DEVICES=80GiB "$out/pairs" streams | sed "s/^/$lib /" >> "$out/misses"
    CUDA_SIM_DEVICES=80GiB,80GiB "$out/pairs" devices | sed "s/^/$lib /" >> "$out/misses"
    unset LD_LIBRARY_PATH
  done
done
python3 - "$out/misses" "$runs" <<'PY'
import statistics, sys, datetime, platform
path, runs = sys.argv[1], int(sys.argv[2])
cpu = {}
for line in open(path):
    lib, kind, threads, _, c = line.split()
    cpu.setdefault((lib, kind, int(threads)), []).append(float(c))
print(f"`scripts/bench-misses.sh`, {runs} runs; date {datetime.date.today()}; {platform.machine()}, "
      "simulated devices through `libcuda_sim.so` (80 GiB each). CPU ns per pair per thread, "
      "minimum / median over the runs; with more threads than the 2 CPUs, threads take turns on "
      "a CPU, which CPU time leaves out. A device has 16 shards: each stream moves to its own.\n")
print("| library | case | 1 thread | 2 threads | 4 threads | 8 threads | 2 / 1 | 4 / 1 | 8 / 1 |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
names = {"stream_pair": "one device, a stream per thread", "device_pair": "a device per thread"}
for lib in ("now", "before"):
    for kind in ("stream_pair", "device_pair"):
        if (lib, kind, 1) not in cpu:
            continue
        counts = [1, 2, 4, 8]
        cells = [f"{min(cpu[(lib, kind, n)]):.0f} / {statistics.median(cpu[(lib, kind, n)]):.0f}"
                 if (lib, kind, n) in cpu else "" for n in counts]
        one = min(cpu[(lib, kind, 1)])
        ratios = [f"{min(cpu[(lib, kind, n)]) / one:.2f}" if (lib, kind, n) in cpu else ""
                  for n in counts[1:]]
        print(f"| {lib} | {names[kind]} | " + " | ".join(cells + ratios) + " |")
PY
